//! What the lattice IQ formats share (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: ggml's `block_iq*`,
//! super-blocks of 256 values): every 32-value sub-block decodes into four rows of a grid ([`super::iq_grid`], 8
//! values each), a sign bit per value, an odd integer scale per 16 values and, for IQ1, a ±1 offset per 8 values. A
//! format is its super-scale (`d` times the power of two that makes the scales integers) and one [`Sub`] decoder;
//! the scalar reference unpacks into the K-quants' [`Unpacked`] (codes, per-16 scales, no minimums), so
//! dequantization is `(d · sc) · q` in the order of ggml's `dequantize_row_iq*` and the `gguf` package. The SIMD
//! kernels (`quant::dot_k`) read each format's bytes directly (IQ2_S's AVX-512 kernel goes through its decoder) and
//! give the bits of one generic kernel over the decoder, which the tests keep as their reference. Products pair the
//! rows with Q8_K activations.

use super::kquant::{Unpacked, QK_K};
use crate::quant::GgmlType;

/// The lattice formats (their CUDA kernels need the grids header, [`super::iq_grid::cuda_header`]).
pub const TYPES: [GgmlType; 7] = [
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
    GgmlType::IQ1_S,
    GgmlType::IQ1_M,
];

/// One 32-value sub-block decoded: value `j` = `sc[j / 16] · (±grid byte j + delta[j / 8])` times the super-scale.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sub {
    /// Four grid rows, value `8l + j` in byte `j` of row `l` (signed levels).
    pub grid: [u64; 4],
    /// Bit `j` set: value `j` is negated.
    pub signs: u32,
    /// Integer scale of the first and the second 16 values.
    pub sc: [i16; 2],
    /// Offset added to each 8 values after the sign (IQ1's ±1; 0 for the others).
    pub delta: [i8; 4],
}

impl Sub {
    /// The 32 signed codes.
    #[inline]
    pub fn codes(&self) -> [i8; 32] {
        let mut q = [0i8; 32];
        for (j, v) in q.iter_mut().enumerate() {
            let g = (self.grid[j / 8] >> (8 * (j % 8))) as u8 as i8;
            let s = if self.signs >> j & 1 == 1 { -g } else { g };
            *v = s + self.delta[j / 8];
        }
        q
    }
}

/// A lattice format: its super-block bytes, super-scale and sub-block decoder.
#[derive(Debug, Clone, Copy)]
pub struct Lattice {
    /// Bytes per super-block.
    pub bytes: usize,
    /// The super-scale of a block (f16 `d` times the format's power of two).
    pub d: fn(&[u8]) -> f32,
    /// Sub-block `ib` (0..8) of a block.
    pub sub: fn(&[u8], usize) -> Sub,
}

/// Unpacks one super-block as the K-quants'.
pub fn unpack(l: &Lattice, b: &[u8], u: &mut Unpacked) {
    u.d = (l.d)(b);
    u.dmin = 0.0;
    u.mn = [0; 16];
    for ib in 0..QK_K / 32 {
        let s = (l.sub)(b, ib);
        u.sc[2 * ib] = s.sc[0];
        u.sc[2 * ib + 1] = s.sc[1];
        u.q[32 * ib..32 * ib + 32].copy_from_slice(&s.codes());
    }
}

/// Dequantizes whole super-blocks.
pub fn dequantize_with(l: &Lattice, src: &[u8], dst: &mut [f32]) {
    let mut u = Unpacked::default();
    for (b, out) in src.chunks_exact(l.bytes).zip(dst.chunks_exact_mut(QK_K)) {
        unpack(l, b, &mut u);
        for (e, o) in out.iter_mut().enumerate() {
            *o = (u.d * u.sc[e / 16] as f32) * u.q[e] as f32;
        }
    }
}

/// Scalar reference dot product of a row of super-blocks with `x` (8 activation blocks per super-block).
pub fn dot_with(l: &Lattice, row: &[u8], x: &[crate::quant::BlockQ8]) -> f32 {
    let mut u = Unpacked::default();
    let mut acc = 0f32;
    for (b, xs) in row.chunks_exact(l.bytes).zip(x.chunks_exact(8)) {
        unpack(l, b, &mut u);
        acc += super::kquant::dot_unpacked(&u, xs);
    }
    acc
}

/// The odd scale `2 s + 1` of a 4-bit (or 3-bit) field `s`.
#[inline]
pub fn odd(s: u32) -> i16 {
    2 * s as i16 + 1
}

//! IQ1_M (about 1.75 bits per value): super-blocks of 256 values, 56 bytes: 32 bytes of the low 8 bits of
//! [`IQ1S_GRID`](super::iq_grid::IQ1S_GRID) rows (one per 8 values), 16 bytes of their high 3 bits and offset signs
//! (sub-block `i` in bytes `2i`, `2i + 1`, one nibble per row: bits 0..3 the row's high bits, bit 3 the offset's sign),
//! then four little-endian u16 holding 3-bit scales (16 values each, scale `k` in word `k/4` at bits `3·(k%4)`) and, in
//! their top nibbles, the f16 `d` (word `i`'s nibble is bits `4i..4i+4`); value = `d · (2s + 1) · (grid ± 1/8)` (ggml
//! `block_iq1_m`), held as `(d/8) · (2s + 1) · (8 · grid ± 1)`. Products pair it with Q8_K activations ([`super::iq`]).

use super::iq::{dequantize_with, dot_with, odd, Lattice, Sub};
use super::iq_grid::IQ1S_GRID_X8;
use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::dequant::f16_to_f32;
use crate::quant::{BlockQ8, GgmlType};

/// Bytes per super-block.
pub const BYTES: usize = 56;

/// The IQ1_M lattice (the decoder of the scalar kernels, of the prefill unpack and of the SIMD kernels' reference).
pub const LATTICE: Lattice = Lattice { bytes: BYTES, d, sub };

/// The IQ1_M row.
pub const FORMAT: Format = Format {
    ty: GgmlType::IQ1_M,
    name: "iq1_m",
    activation: Activation::Q8K,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot_k::avx2::dot_iq1_m,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot_k::avx2::dot_iq1_m_x4,
        #[cfg(target_arch = "x86_64")]
        avx2_t4: None,
        #[cfg(target_arch = "x86_64")]
        avx2_t8: None,
        wide: false,
        #[cfg(target_arch = "x86_64")]
        avx512: None,
        #[cfg(target_arch = "x86_64")]
        gemm512: Some(crate::quant::gemm512::Gemm512::scalar(|b, u| super::iq::unpack(&LATTICE, b, u), BYTES, false)),
    }),
    f32_dot: None,
    f32_dot4: None,
    cuda: Some(CudaFormat { index: 22, suffix: "iq1_m", narrow: false, prefill: Prefill::Mmq, on_demand: true }),
};

/// The super-scale: the f16 `d` gathered from the scale words' top nibbles, over 8.
#[inline(always)]
pub fn d(b: &[u8]) -> f32 {
    let w = |i: usize| u16::from_le_bytes([b[48 + 2 * i], b[49 + 2 * i]]);
    let bits = (w(0) >> 12) | (w(1) >> 8 & 0x00f0) | (w(2) >> 4 & 0x0f00) | (w(3) & 0xf000);
    f16_to_f32(bits) * 0.125
}

/// Writes the f16 bits `d` into block `b`'s scale words' top nibbles, keeping their scales (the inverse of [`d`]'s
/// gathering; for writers of IQ1_M blocks).
pub fn set_d(b: &mut [u8], d: u16) {
    for i in 0..4 {
        b[49 + 2 * i] = (b[49 + 2 * i] & 0x0f) | ((d >> (4 * i)) as u8 & 0x0f) << 4;
    }
}

/// Sub-block `ib` (0..8) of block `b`.
#[inline(always)]
pub fn sub(b: &[u8], ib: usize) -> Sub {
    let sc = |k: usize| {
        let w = u16::from_le_bytes([b[48 + 2 * (k / 4)], b[49 + 2 * (k / 4)]]) as u32;
        odd(w >> (3 * (k % 4)) & 7)
    };
    let mut o = Sub { sc: [sc(2 * ib), sc(2 * ib + 1)], ..Sub::default() };
    for l in 0..4 {
        let nib = (b[32 + 2 * ib + l / 2] >> (4 * (l % 2)) & 0xf) as usize;
        o.grid[l] = IQ1S_GRID_X8[b[4 * ib + l] as usize | (nib & 7) << 8];
        o.delta[l] = if nib & 8 != 0 { -1 } else { 1 };
    }
    o
}

fn dequantize(src: &[u8], dst: &mut [f32]) {
    dequantize_with(&LATTICE, src, dst)
}

fn dot(row: &[u8], x: &[BlockQ8]) -> f32 {
    dot_with(&LATTICE, row, x)
}

//! IQ2_XXS (about 2.06 bits per value): super-blocks of 256 values, 66 bytes: f16 `d`, then per 32-value sub-block
//! two little-endian u32: the first holds four 8-bit rows of [`IQ2XXS_GRID`] (8 values each), the second four 7-bit
//! sign indices into [`KSIGNS`] (bits 0, 7, 14, 21) and the 4-bit scale `s` (bits 28..32); value =
//! `d · (0.5 + s) · 0.25 · (±grid)` = `(d/8) · (2s + 1) · (±grid)` (ggml `block_iq2_xxs`,
//! `dequantize_row_iq2_xxs`).
//! Products pair it with Q8_K activations ([`super::iq`]).

use super::iq::{dequantize_with, dot_with, odd, Lattice, Sub};
use super::iq_grid::{IQ2XXS_GRID, KSIGNS};
use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::dequant::{f16_to_f32, rd16};
use crate::quant::{BlockQ8, GgmlType};

/// Bytes per super-block.
pub const BYTES: usize = 66;

/// The IQ2_XXS lattice (the decoder of the scalar kernels, of the prefill unpack and of the SIMD kernels' reference).
pub const LATTICE: Lattice = Lattice { bytes: BYTES, d, sub };

/// The IQ2_XXS row.
pub const FORMAT: Format = Format {
    ty: GgmlType::IQ2_XXS,
    name: "iq2_xxs",
    activation: Activation::Q8K,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot_k::avx2::dot_iq2_xxs,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot_k::avx2::dot_iq2_xxs_x4,
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
    cuda: Some(CudaFormat { index: 16, suffix: "iq2_xxs", narrow: false, prefill: Prefill::Mmq, on_demand: true }),
};

/// The super-scale: the block's f16 `d`, over 8.
#[inline(always)]
pub fn d(b: &[u8]) -> f32 {
    f16_to_f32(rd16(b, 0)) * 0.125
}

/// Sub-block `ib` (0..8) of block `b`.
#[inline(always)]
pub fn sub(b: &[u8], ib: usize) -> Sub {
    let w = |k: usize| u32::from_le_bytes([b[k], b[k + 1], b[k + 2], b[k + 3]]);
    let (a, s) = (w(2 + 8 * ib), w(6 + 8 * ib));
    let mut o = Sub { sc: [odd(s >> 28); 2], ..Sub::default() };
    for l in 0..4 {
        o.grid[l] = IQ2XXS_GRID[(a >> (8 * l) & 0xff) as usize];
        o.signs |= (KSIGNS[(s >> (7 * l) & 0x7f) as usize] as u32) << (8 * l);
    }
    o
}

fn dequantize(src: &[u8], dst: &mut [f32]) {
    dequantize_with(&LATTICE, src, dst)
}

fn dot(row: &[u8], x: &[BlockQ8]) -> f32 {
    dot_with(&LATTICE, row, x)
}

//! IQ3_XXS (about 3.06 bits per value): super-blocks of 256 values, 98 bytes: f16 `d`, 64 bytes of [`IQ3XXS_GRID`]
//! rows (4 values each), then per 32-value sub-block a little-endian u32 of four 7-bit sign indices into [`KSIGNS`]
//! (bits 0, 7, 14, 21) and the 4-bit scale `s` (bits 28..32); value = `d · (0.5 + s) · 0.5 · (±grid)` =
//! `(d/4) · (2s + 1) · (±grid)` (ggml `block_iq3_xxs`).
//! Products pair it with Q8_K activations ([`super::iq`]).

use super::iq::{dequantize_with, dot_with, odd, Lattice, Sub};
use super::iq_grid::{IQ3XXS_GRID, KSIGNS};
use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::dequant::{f16_to_f32, rd16};
use crate::quant::{BlockQ8, GgmlType};

/// Bytes per super-block.
pub const BYTES: usize = 98;

/// The IQ3_XXS lattice (the decoder of the scalar kernels, of the prefill unpack and of the SIMD kernels' reference).
pub const LATTICE: Lattice = Lattice { bytes: BYTES, d, sub };

/// The IQ3_XXS row.
pub const FORMAT: Format = Format {
    ty: GgmlType::IQ3_XXS,
    name: "iq3_xxs",
    activation: Activation::Q8K,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot_k::avx2::dot_iq3_xxs,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot_k::avx2::dot_iq3_xxs_x4,
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
    cuda: Some(CudaFormat { index: 19, suffix: "iq3_xxs", narrow: false, prefill: Prefill::Mmq, on_demand: true }),
};

/// The super-scale: the block's f16 `d`, over 4.
#[inline(always)]
pub fn d(b: &[u8]) -> f32 {
    f16_to_f32(rd16(b, 0)) * 0.25
}

/// Sub-block `ib` (0..8) of block `b`.
#[inline(always)]
pub fn sub(b: &[u8], ib: usize) -> Sub {
    let s = u32::from_le_bytes([b[66 + 4 * ib], b[67 + 4 * ib], b[68 + 4 * ib], b[69 + 4 * ib]]);
    let mut o = Sub { sc: [odd(s >> 28); 2], ..Sub::default() };
    for l in 0..4 {
        let (lo, hi) = (b[2 + 8 * ib + 2 * l] as usize, b[3 + 8 * ib + 2 * l] as usize);
        o.grid[l] = IQ3XXS_GRID[lo] as u64 | (IQ3XXS_GRID[hi] as u64) << 32;
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

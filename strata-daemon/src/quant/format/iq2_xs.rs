//! IQ2_XS (about 2.31 bits per value): super-blocks of 256 values, 74 bytes: f16 `d`, 32 little-endian u16 (one per
//! 8 values: a 9-bit row of [`IQ2XS_GRID`] and a 7-bit sign index into [`KSIGNS`]), then 8 bytes of 4-bit scales
//! (sub-block `i`'s first 16 values in the low nibble of byte `i`); value = `(d/8) · (2s + 1) · (±grid)` (ggml
//! `block_iq2_xs`).
//! Products pair it with Q8_K activations ([`super::iq`]).

use super::iq::{dequantize_with, dot_with, odd, Lattice, Sub};
use super::iq_grid::{IQ2XS_GRID, KSIGNS};
use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::dequant::{f16_to_f32, rd16};
use crate::quant::{BlockQ8, GgmlType};

/// Bytes per super-block.
pub const BYTES: usize = 74;

/// The IQ2_XS lattice (the decoder of the scalar kernels, of the prefill unpack and of the SIMD kernels' reference).
pub const LATTICE: Lattice = Lattice { bytes: BYTES, d, sub };

/// The IQ2_XS row.
pub const FORMAT: Format = Format {
    ty: GgmlType::IQ2_XS,
    name: "iq2_xs",
    activation: Activation::Q8K,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot_k::avx2::dot_iq2_xs,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot_k::avx2::dot_iq2_xs_x4,
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
    cuda: Some(CudaFormat { index: 17, suffix: "iq2_xs", narrow: false, prefill: Prefill::Mmq, on_demand: true }),
};

/// The super-scale: the block's f16 `d`, over 8.
#[inline(always)]
pub fn d(b: &[u8]) -> f32 {
    f16_to_f32(rd16(b, 0)) * 0.125
}

/// Sub-block `ib` (0..8) of block `b`.
#[inline(always)]
pub fn sub(b: &[u8], ib: usize) -> Sub {
    let sc = b[66 + ib] as u32;
    let mut o = Sub { sc: [odd(sc & 0xf), odd(sc >> 4)], ..Sub::default() };
    for l in 0..4 {
        let q = u16::from_le_bytes([b[2 + 8 * ib + 2 * l], b[3 + 8 * ib + 2 * l]]) as usize;
        o.grid[l] = IQ2XS_GRID[q & 511];
        o.signs |= (KSIGNS[q >> 9] as u32) << (8 * l);
    }
    o
}

fn dequantize(src: &[u8], dst: &mut [f32]) {
    dequantize_with(&LATTICE, src, dst)
}

fn dot(row: &[u8], x: &[BlockQ8]) -> f32 {
    dot_with(&LATTICE, row, x)
}

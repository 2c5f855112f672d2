//! IQ1_S (about 1.56 bits per value): super-blocks of 256 values, 50 bytes: f16 `d`, 32 bytes of the low 8 bits of
//! [`IQ1S_GRID`](super::iq_grid::IQ1S_GRID) rows (levels −1, 0, 1; one per 8 values), then per 32-value sub-block a
//! little-endian u16: the rows' high 3 bits (row `l` at bits `3l`), the 3-bit scale `s` (bits 12..=14) and the sign of
//! the offset (bit 15); value = `d · (2s + 1) · (grid ± 1/8)` (ggml `block_iq1_s`, `IQ1S_DELTA`), held as `(d/8) · (2s
//! + 1) · (8 · grid ± 1)`. Products pair it with Q8_K activations ([`super::iq`]).

use super::iq::{dequantize_with, dot_with, odd, Lattice, Sub};
use super::iq_grid::IQ1S_GRID_X8;
use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::dequant::{f16_to_f32, rd16};
use crate::quant::{BlockQ8, GgmlType};

/// Bytes per super-block.
pub const BYTES: usize = 50;

/// The IQ1_S lattice (the decoder of the scalar kernels, of the prefill unpack and of the SIMD kernels' reference).
pub const LATTICE: Lattice = Lattice { bytes: BYTES, d, sub };

/// The IQ1_S row.
pub const FORMAT: Format = Format {
    ty: GgmlType::IQ1_S,
    name: "iq1_s",
    activation: Activation::Q8K,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot_k::avx2::dot_iq1_s,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot_k::avx2::dot_iq1_s_x4,
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
    cuda: Some(CudaFormat { index: 21, suffix: "iq1_s", narrow: false, prefill: Prefill::Mmq, on_demand: true }),
};

/// The super-scale: the block's f16 `d`, over 8.
#[inline(always)]
pub fn d(b: &[u8]) -> f32 {
    f16_to_f32(rd16(b, 0)) * 0.125
}

/// Sub-block `ib` (0..8) of block `b`.
#[inline(always)]
pub fn sub(b: &[u8], ib: usize) -> Sub {
    let qh = u16::from_le_bytes([b[34 + 2 * ib], b[35 + 2 * ib]]) as usize;
    let delta = if qh & 0x8000 != 0 { -1 } else { 1 };
    let mut o = Sub { sc: [odd((qh >> 12 & 7) as u32); 2], delta: [delta; 4], ..Sub::default() };
    for l in 0..4 {
        o.grid[l] = IQ1S_GRID_X8[b[2 + 4 * ib + l] as usize | (qh >> (3 * l) & 7) << 8];
    }
    o
}

fn dequantize(src: &[u8], dst: &mut [f32]) {
    dequantize_with(&LATTICE, src, dst)
}

fn dot(row: &[u8], x: &[BlockQ8]) -> f32 {
    dot_with(&LATTICE, row, x)
}

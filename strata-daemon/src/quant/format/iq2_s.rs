//! IQ2_S (about 2.56 bits per value): super-blocks of 256 values, 82 bytes: f16 `d`, 32 bytes of the low 8 bits of
//! [`IQ2S_GRID`] rows (one per 8 values), 32 sign bytes (bit `j` negates value `j` of the 8), 8 bytes of the rows'
//! high 2 bits (sub-block `i` in byte `i`, row `l` at bits `2l`), 8 bytes of 4-bit scales as IQ2_XS's; value =
//! `(d/8) · (2s + 1) · (±grid)` (ggml `block_iq2_s`).
//! Products pair it with Q8_K activations ([`super::iq`]).

use super::iq::{dequantize_with, dot_with, odd, Lattice, Sub};
use super::iq_grid::IQ2S_GRID;
use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::dequant::{f16_to_f32, rd16};
use crate::quant::{BlockQ8, GgmlType};

/// Bytes per super-block.
pub const BYTES: usize = 82;

/// The IQ2_S lattice (the decoder of the scalar kernels, of the prefill unpack and of the SIMD kernels' reference).
pub const LATTICE: Lattice = Lattice { bytes: BYTES, d, sub };

/// The IQ2_S row.
pub const FORMAT: Format = Format {
    ty: GgmlType::IQ2_S,
    name: "iq2_s",
    activation: Activation::Q8K,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot_k::avx2::dot_iq2_s,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot_k::avx2::dot_iq2_s_x4,
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
    cuda: Some(CudaFormat { index: 18, suffix: "iq2_s", narrow: false, prefill: Prefill::Mmq, on_demand: true }),
};

/// The super-scale: the block's f16 `d`, over 8.
#[inline(always)]
pub fn d(b: &[u8]) -> f32 {
    f16_to_f32(rd16(b, 0)) * 0.125
}

/// Sub-block `ib` (0..8) of block `b` (inlined into the AVX-512 kernel, which calls it per 32 values).
#[inline(always)]
pub fn sub(b: &[u8], ib: usize) -> Sub {
    let (sc, qh) = (b[74 + ib] as u32, b[66 + ib] as usize);
    let mut o = Sub { sc: [odd(sc & 0xf), odd(sc >> 4)], ..Sub::default() };
    for l in 0..4 {
        o.grid[l] = IQ2S_GRID[b[2 + 4 * ib + l] as usize | (qh >> (2 * l) & 3) << 8];
    }
    o.signs = u32::from_le_bytes(b[34 + 4 * ib..38 + 4 * ib].try_into().expect("4 bytes"));
    o
}

fn dequantize(src: &[u8], dst: &mut [f32]) {
    dequantize_with(&LATTICE, src, dst)
}

fn dot(row: &[u8], x: &[BlockQ8]) -> f32 {
    dot_with(&LATTICE, row, x)
}

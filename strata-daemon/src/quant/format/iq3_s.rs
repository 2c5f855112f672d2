//! IQ3_S (about 3.44 bits per value): super-blocks of 256 values, 110 bytes: f16 `d`, 64 bytes of the low 8 bits of
//! [`IQ3S_GRID`] rows (4 values each), 8 bytes of their ninth bits (sub-block `i` in byte `i`, row `m` at bit `m`), 32
//! sign bytes (bit `j` negates value `j` of 8), 4 bytes of 4-bit scales (sub-block `i` in byte `i/2`, nibble `i%2`);
//! value = `d · (1 + 2s) · (±grid)` (ggml `block_iq3_s`).
//! Products pair it with Q8_K activations ([`super::iq`]).

use super::iq::{dequantize_with, dot_with, odd, Lattice, Sub};
use super::iq_grid::IQ3S_GRID;
use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::dequant::{f16_to_f32, rd16};
use crate::quant::{BlockQ8, GgmlType};

/// Bytes per super-block.
pub const BYTES: usize = 110;

/// The IQ3_S lattice (the decoder of the scalar kernels, of the prefill unpack and of the SIMD kernels' reference).
pub const LATTICE: Lattice = Lattice { bytes: BYTES, d, sub };

/// The IQ3_S row.
pub const FORMAT: Format = Format {
    ty: GgmlType::IQ3_S,
    name: "iq3_s",
    activation: Activation::Q8K,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot_k::avx2::dot_iq3_s,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot_k::avx2::dot_iq3_s_x4,
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
    cuda: Some(CudaFormat { index: 20, suffix: "iq3_s", narrow: false, prefill: Prefill::Mmq, on_demand: true }),
};

/// The super-scale: the block's f16 `d`.
#[inline(always)]
pub fn d(b: &[u8]) -> f32 {
    f16_to_f32(rd16(b, 0))
}

/// Sub-block `ib` (0..8) of block `b`.
#[inline(always)]
pub fn sub(b: &[u8], ib: usize) -> Sub {
    let (qh, sc) = (b[66 + ib] as usize, (b[106 + ib / 2] >> (4 * (ib % 2)) & 0xf) as u32);
    let mut o = Sub { sc: [odd(sc); 2], ..Sub::default() };
    let row = |m: usize| IQ3S_GRID[b[2 + 8 * ib + m] as usize | (qh >> m & 1) << 8] as u64;
    for l in 0..4 {
        o.grid[l] = row(2 * l) | row(2 * l + 1) << 32;
    }
    o.signs = u32::from_le_bytes(b[74 + 4 * ib..78 + 4 * ib].try_into().expect("4 bytes"));
    o
}

fn dequantize(src: &[u8], dst: &mut [f32]) {
    dequantize_with(&LATTICE, src, dst)
}

fn dot(row: &[u8], x: &[BlockQ8]) -> f32 {
    dot_with(&LATTICE, row, x)
}

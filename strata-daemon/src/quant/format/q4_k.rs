//! Q4_K: super-blocks of 256 values, 144 bytes: f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales and minimums of 8
//! sub-blocks of 32 ([`super::kquant::scale_min_k4`]), then 128 bytes of nibbles — per 64 values, 32 bytes whose low
//! nibbles are sub-block 2c and high nibbles sub-block 2c + 1; value = `(d · sc) · q − dmin · m` (ggml
//! `block_q4_K`).

use super::kquant::{dequantize_with, dot_with, scales_k4, Unpacked};
use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::dequant::{f16_to_f32, rd16};
use crate::quant::{BlockQ8, GgmlType};

/// Bytes per super-block.
pub const BYTES: usize = 144;

/// The Q4_K row.
pub const FORMAT: Format = Format {
    ty: GgmlType::Q4_K,
    name: "q4_k",
    activation: Activation::Q8K,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot_k::avx2::dot_q4_k,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot_k::avx2::dot_q4_k_x4,
        #[cfg(target_arch = "x86_64")]
        avx2_t4: Some(crate::quant::dot_k::avx2::dot_q4_k_t4),
        #[cfg(target_arch = "x86_64")]
        avx2_t8: None,
        wide: false,
        #[cfg(target_arch = "x86_64")]
        avx512: None,
        #[cfg(target_arch = "x86_64")]
        gemm512: Some(crate::quant::dot512::avx512::Q4_K_GEMM),
    }),
    f32_dot: None,
    f32_dot4: None,
    cuda: Some(CudaFormat { index: 10, suffix: "q4_k", narrow: false, prefill: Prefill::Mmq, on_demand: true }),
};

/// Unpacks one super-block.
pub fn unpack(b: &[u8], u: &mut Unpacked) {
    u.d = f16_to_f32(rd16(b, 0));
    u.dmin = f16_to_f32(rd16(b, 2));
    scales_k4(&b[4..16], u);
    let qs = &b[16..144];
    for c in 0..4 {
        for l in 0..32 {
            u.q[64 * c + l] = (qs[32 * c + l] & 0x0f) as i8;
            u.q[64 * c + 32 + l] = (qs[32 * c + l] >> 4) as i8;
        }
    }
}

fn dequantize(src: &[u8], dst: &mut [f32]) {
    dequantize_with(src, dst, BYTES, unpack)
}

fn dot(row: &[u8], x: &[BlockQ8]) -> f32 {
    dot_with(row, x, BYTES, unpack)
}

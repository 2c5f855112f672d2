//! Q5_K: super-blocks of 256 values, 176 bytes: f16 `d`, f16 `dmin`, 12 bytes of scales and minimums as Q4_K's, 32
//! bytes of high bits (bit k of byte l is the fifth bit of value 32k + l), then 128 bytes of low nibbles laid out as
//! Q4_K's; value = `(d · sc) · q − dmin · m` (ggml `block_q5_K`).

use super::kquant::{dequantize_with, dot_with, scales_k4, Unpacked};
use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::dequant::{f16_to_f32, rd16};
use crate::quant::{BlockQ8, GgmlType};

/// Bytes per super-block.
pub const BYTES: usize = 176;

/// The Q5_K row.
pub const FORMAT: Format = Format {
    ty: GgmlType::Q5_K,
    name: "q5_k",
    activation: Activation::Q8K,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot_k::avx2::dot_q5_k,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot_k::avx2::dot_q5_k_x4,
        #[cfg(target_arch = "x86_64")]
        avx2_t4: Some(crate::quant::dot_k::avx2::dot_q5_k_t4),
        #[cfg(target_arch = "x86_64")]
        avx2_t8: None,
        wide: false,
        #[cfg(target_arch = "x86_64")]
        avx512: None,
        #[cfg(target_arch = "x86_64")]
        gemm512: Some(crate::quant::dot512::avx512::Q5_K_GEMM),
    }),
    f32_dot: None,
    f32_dot4: None,
    cuda: Some(CudaFormat { index: 11, suffix: "q5_k", narrow: false, prefill: Prefill::Mmq, on_demand: true }),
};

/// Unpacks one super-block.
pub fn unpack(b: &[u8], u: &mut Unpacked) {
    u.d = f16_to_f32(rd16(b, 0));
    u.dmin = f16_to_f32(rd16(b, 2));
    scales_k4(&b[4..16], u);
    let (qh, qs) = (&b[16..48], &b[48..176]);
    for c in 0..4 {
        for l in 0..32 {
            let lo = (qs[32 * c + l] & 0x0f) | (((qh[l] >> (2 * c)) & 1) << 4);
            let hi = (qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
            u.q[64 * c + l] = lo as i8;
            u.q[64 * c + 32 + l] = hi as i8;
        }
    }
}

fn dequantize(src: &[u8], dst: &mut [f32]) {
    dequantize_with(src, dst, BYTES, unpack)
}

fn dot(row: &[u8], x: &[BlockQ8]) -> f32 {
    dot_with(row, x, BYTES, unpack)
}

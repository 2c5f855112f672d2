//! Q2_K: super-blocks of 256 values, 84 bytes: 16 bytes of 4-bit scale (low) and minimum (high) per 16 values, 64
//! bytes of 2-bit codes (value 128h + 32s + l in `(qs[32h + l] >> 2s) & 3`), then f16 `d` and f16 `dmin`; value =
//! `(d · sc) · q − dmin · m` (ggml `block_q2_K`).

use super::kquant::{dequantize_with, dot_with, Unpacked};
use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::dequant::{f16_to_f32, rd16};
use crate::quant::{BlockQ8, GgmlType};

/// Bytes per super-block.
pub const BYTES: usize = 84;

/// The Q2_K row.
pub const FORMAT: Format = Format {
    ty: GgmlType::Q2_K,
    name: "q2_k",
    activation: Activation::Q8K,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot_k::avx2::dot_q2_k,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot_k::avx2::dot_q2_k_x4,
        #[cfg(target_arch = "x86_64")]
        avx2_t4: None,
        #[cfg(target_arch = "x86_64")]
        avx2_t8: None,
        wide: false,
        #[cfg(target_arch = "x86_64")]
        avx512: None,
        #[cfg(target_arch = "x86_64")]
        gemm512: Some(crate::quant::gemm512::Gemm512::scalar(unpack, BYTES, true)),
    }),
    f32_dot: None,
    f32_dot4: None,
    cuda: Some(CudaFormat { index: 8, suffix: "q2_k", narrow: false, prefill: Prefill::Rows, on_demand: true }),
};

/// Unpacks one super-block.
pub fn unpack(b: &[u8], u: &mut Unpacked) {
    let (s, qs) = (&b[..16], &b[16..80]);
    u.d = f16_to_f32(rd16(b, 80));
    u.dmin = f16_to_f32(rd16(b, 82));
    for g in 0..16 {
        u.sc[g] = (s[g] & 0x0f) as i16;
        u.mn[g] = (s[g] >> 4) as i16;
    }
    for e in 0..256 {
        let (h, r) = (e / 128, e % 128);
        u.q[e] = ((qs[32 * h + r % 32] >> (2 * (r / 32))) & 3) as i8;
    }
}

fn dequantize(src: &[u8], dst: &mut [f32]) {
    dequantize_with(src, dst, BYTES, unpack)
}

fn dot(row: &[u8], x: &[BlockQ8]) -> f32 {
    dot_with(row, x, BYTES, unpack)
}

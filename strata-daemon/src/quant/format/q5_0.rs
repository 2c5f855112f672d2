//! Q5_0: blocks of 32 values, 22 bytes: an f16 scale `d`, 32 high bits `qh` (u32, little-endian: bit j is the fifth
//! bit of value j), then 16 bytes of low nibbles laid out as Q4_0's (values j and j + 16 share byte j); value =
//! `d · (q − 16)` (ggml `block_q5_0`). Products pair it with Q8_0 activations.

use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::dequant::{f16_to_f32, rd16};
use crate::quant::{BlockQ8, GgmlType};

/// The Q5_0 row.
pub const FORMAT: Format = Format {
    ty: GgmlType::Q5_0,
    name: "q5_0",
    activation: Activation::Q8_0,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot_k::avx2::dot_q5_0,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot_k::avx2::dot_q5_0_x4,
        #[cfg(target_arch = "x86_64")]
        avx2_t4: Some(crate::quant::dot_k::avx2::dot_q5_0_t4),
        #[cfg(target_arch = "x86_64")]
        avx2_t8: Some(crate::quant::dot_k::avx2::dot_q5_0_t8),
        wide: false,
        #[cfg(target_arch = "x86_64")]
        avx512: Some(crate::quant::dot512::avx512::Q5_0),
        #[cfg(target_arch = "x86_64")]
        gemm512: Some(crate::quant::dot512::avx512::Q5_0_GEMM),
    }),
    f32_dot: None,
    f32_dot4: None,
    cuda: Some(CudaFormat { index: 6, suffix: "q5_0", narrow: false, prefill: Prefill::Mmq, on_demand: true }),
};

/// The 32 codes (0..32) of one block.
#[inline]
pub(crate) fn codes(b: &[u8], qh_at: usize, qs_at: usize) -> [u8; 32] {
    let qh = u32::from_le_bytes([b[qh_at], b[qh_at + 1], b[qh_at + 2], b[qh_at + 3]]);
    let mut q = [0u8; 32];
    for j in 0..16 {
        q[j] = (b[qs_at + j] & 0x0f) | (((qh >> j) & 1) << 4) as u8;
        q[j + 16] = (b[qs_at + j] >> 4) | (((qh >> (j + 16)) & 1) << 4) as u8;
    }
    q
}

fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, out) in src.chunks_exact(22).zip(dst.chunks_exact_mut(32)) {
        let d = f16_to_f32(rd16(b, 0));
        for (o, q) in out.iter_mut().zip(codes(b, 2, 6)) {
            *o = d * (q as i32 - 16) as f32;
        }
    }
}

/// Scalar reference: `Σ_blocks d_w · d_x · Σ (q_w − 16) q_x`.
fn dot(row: &[u8], x: &[BlockQ8]) -> f32 {
    let mut acc = 0f32;
    for (b, xb) in row.chunks_exact(22).zip(x) {
        let d = f16_to_f32(rd16(b, 0));
        let q = codes(b, 2, 6);
        let s: i32 = (0..32).map(|j| (q[j] as i32 - 16) * xb.qs[j] as i32).sum();
        acc += d * xb.d * s as f32;
    }
    acc
}

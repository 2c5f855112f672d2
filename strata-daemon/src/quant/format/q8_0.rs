//! Q8_0: blocks of 32 values, 34 bytes: an f16 scale `d`, then 32 signed bytes; value = `d · q`
//! (ggml `block_q8_0`). Products pair it with Q8_0 activations.

use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::dequant::{f16_to_f32, rd16};
use crate::quant::{BlockQ8, GgmlType};

/// The Q8_0 row.
pub const FORMAT: Format = Format {
    ty: GgmlType::Q8_0,
    name: "q8_0",
    activation: Activation::Q8_0,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot::avx2::dot_q8_0,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot::avx2::dot_q8_0_x4,
        #[cfg(target_arch = "x86_64")]
        avx2_t4: Some(crate::quant::dot::avx2::dot_q8_0_t4),
        #[cfg(target_arch = "x86_64")]
        avx2_t8: None,
        wide: false,
        #[cfg(target_arch = "x86_64")]
        avx512: Some(crate::quant::dot512::avx512::Q8_0),
        #[cfg(target_arch = "x86_64")]
        gemm512: Some(crate::quant::dot512::avx512::Q8_0_GEMM),
    }),
    f32_dot: None,
    f32_dot4: None,
    cuda: Some(CudaFormat { index: 3, suffix: "q8_0", narrow: true, prefill: Prefill::Mmq, on_demand: false }),
};

fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, out) in src.chunks_exact(34).zip(dst.chunks_exact_mut(32)) {
        let d = f16_to_f32(rd16(b, 0));
        for j in 0..32 {
            out[j] = (b[2 + j] as i8) as f32 * d;
        }
    }
}

/// Scalar reference: `Σ_blocks d_w · d_x · Σ q_w q_x`.
fn dot(row: &[u8], x: &[BlockQ8]) -> f32 {
    let mut acc = 0f32;
    for (b, xb) in row.chunks_exact(34).zip(x) {
        let d = f16_to_f32(rd16(b, 0));
        let s: i32 = (0..32).map(|j| (b[2 + j] as i8) as i32 * xb.qs[j] as i32).sum();
        acc += d * xb.d * s as f32;
    }
    acc
}

//! Q4_1: blocks of 32 values, 20 bytes: an f16 scale `d` and an f16 minimum `m`, then 16 bytes of nibbles laid
//! out as Q4_0's; value = `d · q + m` (ggml `block_q4_1`). Products pair it with Q8_1 activations (the minimum
//! multiplies the activations' block sum `s`).

use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::dequant::{f16_to_f32, rd16};
use crate::quant::{BlockQ8, GgmlType};

/// The Q4_1 row.
pub const FORMAT: Format = Format {
    ty: GgmlType::Q4_1,
    name: "q4_1",
    activation: Activation::Q8_1,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot::avx2::dot_q4_1,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot::avx2::dot_q4_1_x4,
        #[cfg(target_arch = "x86_64")]
        avx2_t4: Some(crate::quant::dot::avx2::dot_q4_1_t4),
        #[cfg(target_arch = "x86_64")]
        avx2_t8: None,
        wide: true,
        #[cfg(target_arch = "x86_64")]
        avx512: None,
        #[cfg(target_arch = "x86_64")]
        gemm512: None,
    }),
    f32_dot: None,
    f32_dot4: None,
    cuda: Some(CudaFormat { index: 5, suffix: "q4_1", narrow: true, prefill: Prefill::Mmq, on_demand: false }),
};

fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, out) in src.chunks_exact(20).zip(dst.chunks_exact_mut(32)) {
        let d = f16_to_f32(rd16(b, 0));
        let m = f16_to_f32(rd16(b, 2));
        for j in 0..16 {
            out[j] = (b[4 + j] & 0x0f) as f32 * d + m;
            out[j + 16] = (b[4 + j] >> 4) as f32 * d + m;
        }
    }
}

/// Scalar reference: `Σ_blocks d_w · d_x · Σ q_w q_x + m_w · s_x`.
fn dot(row: &[u8], x: &[BlockQ8]) -> f32 {
    let mut acc = 0f32;
    for (b, xb) in row.chunks_exact(20).zip(x) {
        let d = f16_to_f32(rd16(b, 0));
        let m = f16_to_f32(rd16(b, 2));
        let mut s = 0i32;
        for j in 0..16 {
            s += (b[4 + j] & 0x0f) as i32 * xb.qs[j] as i32;
            s += (b[4 + j] >> 4) as i32 * xb.qs[j + 16] as i32;
        }
        acc += d * xb.d * s as f32 + m * xb.s;
    }
    acc
}

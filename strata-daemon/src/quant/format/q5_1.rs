//! Q5_1: blocks of 32 values, 24 bytes: an f16 scale `d`, an f16 minimum `m`, 32 high bits `qh` and 16 bytes of low
//! nibbles laid out as Q5_0's; value = `d · q + m` (ggml `block_q5_1`). Products pair it with Q8_1 activations (the
//! minimum multiplies the activations' block sum).

use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::dequant::{f16_to_f32, rd16};
use crate::quant::{BlockQ8, GgmlType};

/// The Q5_1 row.
pub const FORMAT: Format = Format {
    ty: GgmlType::Q5_1,
    name: "q5_1",
    activation: Activation::Q8_1,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot_k::avx2::dot_q5_1,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot_k::avx2::dot_q5_1_x4,
        #[cfg(target_arch = "x86_64")]
        avx2_t4: None,
        #[cfg(target_arch = "x86_64")]
        avx2_t8: None,
        wide: false,
        #[cfg(target_arch = "x86_64")]
        avx512: None,
        #[cfg(target_arch = "x86_64")]
        gemm512: None,
    }),
    f32_dot: None,
    f32_dot4: None,
    cuda: Some(CudaFormat { index: 7, suffix: "q5_1", narrow: false, prefill: Prefill::Mmq, on_demand: true }),
};

fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, out) in src.chunks_exact(24).zip(dst.chunks_exact_mut(32)) {
        let d = f16_to_f32(rd16(b, 0));
        let m = f16_to_f32(rd16(b, 2));
        for (o, q) in out.iter_mut().zip(super::q5_0::codes(b, 4, 8)) {
            *o = d * q as f32 + m;
        }
    }
}

/// Scalar reference: `Σ_blocks d_w · d_x · Σ q_w q_x + m_w · s_x`.
fn dot(row: &[u8], x: &[BlockQ8]) -> f32 {
    let mut acc = 0f32;
    for (b, xb) in row.chunks_exact(24).zip(x) {
        let d = f16_to_f32(rd16(b, 0));
        let m = f16_to_f32(rd16(b, 2));
        let q = super::q5_0::codes(b, 4, 8);
        let s: i32 = (0..32).map(|j| q[j] as i32 * xb.qs[j] as i32).sum();
        acc += d * xb.d * s as f32 + m * xb.s;
    }
    acc
}

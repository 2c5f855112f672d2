//! MXFP4 (OCP microscaling FP4, ggml type 39, gpt-oss's experts): blocks of 32 values, 17 bytes: one E8M0 exponent
//! byte `e`, then 16 bytes of 4-bit E2M1 codes laid out as Q4_0's; value = `2^(e − 128) · KVALUES[q]`, the table
//! holding the E2M1 values doubled (ggml `block_mxfp4`, `kvalues_mxfp4`, `GGML_E8M0_TO_FP32_HALF`). Products pair
//! it with Q8_0 activations.

use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::{BlockQ8, GgmlType};

/// E2M1 values times two (0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6 doubled; code 8 is −0).
pub const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// The MXFP4 row.
pub const FORMAT: Format = Format {
    ty: GgmlType::MXFP4,
    name: "mxfp4",
    activation: Activation::Q8_0,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot_k::avx2::dot_mxfp4,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot_k::avx2::dot_mxfp4_x4,
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
    cuda: Some(CudaFormat { index: 15, suffix: "mxfp4", narrow: false, prefill: Prefill::Mmq, on_demand: true }),
};

/// Half the E8M0 scale `2^(e − 127)` (the table is doubled): the f32 with exponent field `e − 1`, or the
/// subnormals `2^(e − 128)` for `e < 2` (ggml's `ggml_e8m0_to_fp32_half`).
#[inline]
pub fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { ((e - 1) as u32) << 23 };
    f32::from_bits(bits)
}

fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, out) in src.chunks_exact(17).zip(dst.chunks_exact_mut(32)) {
        let d = e8m0_half(b[0]);
        for (o, q) in out.iter_mut().zip(super::iq4_nl::levels(&b[1..17], &KVALUES)) {
            *o = d * q as f32;
        }
    }
}

/// Scalar reference: `Σ_blocks e8m0_half(e) · d_x · Σ KVALUES[q_w] q_x`.
fn dot(row: &[u8], x: &[BlockQ8]) -> f32 {
    let mut acc = 0f32;
    for (b, xb) in row.chunks_exact(17).zip(x) {
        let q = super::iq4_nl::levels(&b[1..17], &KVALUES);
        let s: i32 = (0..32).map(|j| q[j] as i32 * xb.qs[j] as i32).sum();
        acc += e8m0_half(b[0]) * xb.d * s as f32;
    }
    acc
}

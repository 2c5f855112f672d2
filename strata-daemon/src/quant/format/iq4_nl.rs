//! IQ4_NL: blocks of 32 values, 18 bytes: an f16 scale `d`, then 16 bytes of 4-bit indices laid out as Q4_0's (value
//! j in the low nibble of byte j, value j + 16 in the high nibble) into a fixed non-linear table of 16 signed levels
//! ([`KVALUES`]); value = `d · KVALUES[q]` (ggml `block_iq4_nl`, `kvalues_iq4nl`). Products pair it with Q8_0
//! activations.

use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::dequant::{f16_to_f32, rd16};
use crate::quant::{BlockQ8, GgmlType};

/// The 16 levels of IQ4_NL and IQ4_XS (ggml's `kvalues_iq4nl`).
pub const KVALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// The IQ4_NL row.
pub const FORMAT: Format = Format {
    ty: GgmlType::IQ4_NL,
    name: "iq4_nl",
    activation: Activation::Q8_0,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot_k::avx2::dot_iq4_nl,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot_k::avx2::dot_iq4_nl_x4,
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
    cuda: Some(CudaFormat { index: 13, suffix: "iq4_nl", narrow: false, prefill: Prefill::Mmq, on_demand: true }),
};

/// The 32 levels of one block's 16 index bytes, in value order.
#[inline]
pub(crate) fn levels(qs: &[u8], table: &[i8; 16]) -> [i8; 32] {
    let mut q = [0i8; 32];
    for j in 0..16 {
        q[j] = table[(qs[j] & 0x0f) as usize];
        q[j + 16] = table[(qs[j] >> 4) as usize];
    }
    q
}

fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, out) in src.chunks_exact(18).zip(dst.chunks_exact_mut(32)) {
        let d = f16_to_f32(rd16(b, 0));
        for (o, q) in out.iter_mut().zip(levels(&b[2..18], &KVALUES)) {
            *o = d * q as f32;
        }
    }
}

/// Scalar reference: `Σ_blocks d_w · d_x · Σ KVALUES[q_w] q_x`.
fn dot(row: &[u8], x: &[BlockQ8]) -> f32 {
    let mut acc = 0f32;
    for (b, xb) in row.chunks_exact(18).zip(x) {
        let q = levels(&b[2..18], &KVALUES);
        let s: i32 = (0..32).map(|j| q[j] as i32 * xb.qs[j] as i32).sum();
        acc += f16_to_f32(rd16(b, 0)) * xb.d * s as f32;
    }
    acc
}

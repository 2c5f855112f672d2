//! Q6_K: super-blocks of 256 values, 210 bytes: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 signed
//! 8-bit scales (one per 16 values), then f16 `d`. In each half h (128 values): value 128h + k (k < 64) has low
//! nibble `ql[64h + k] & 15`, value 128h + 64 + k has `ql[64h + k] >> 4`; value 128h + 32s + l has high bits
//! `(qh[32h + l] >> 2s) & 3`; value = `(d · sc) · (q − 32)` (ggml `block_q6_K`).

use super::kquant::{dequantize_with, dot_with, Unpacked};
use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::dequant::{f16_to_f32, rd16};
use crate::quant::{BlockQ8, GgmlType};

/// Bytes per super-block.
pub const BYTES: usize = 210;

/// The Q6_K row.
pub const FORMAT: Format = Format {
    ty: GgmlType::Q6_K,
    name: "q6_k",
    activation: Activation::Q8K,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot_k::avx2::dot_q6_k,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot_k::avx2::dot_q6_k_x4,
        #[cfg(target_arch = "x86_64")]
        avx2_t4: Some(crate::quant::dot_k::avx2::dot_q6_k_t4),
        #[cfg(target_arch = "x86_64")]
        avx2_t8: None,
        wide: false,
        #[cfg(target_arch = "x86_64")]
        avx512: None,
        #[cfg(target_arch = "x86_64")]
        gemm512: Some(crate::quant::dot512::avx512::Q6_K_GEMM),
    }),
    f32_dot: None,
    f32_dot4: None,
    cuda: Some(CudaFormat { index: 12, suffix: "q6_k", narrow: false, prefill: Prefill::Mmq, on_demand: true }),
};

/// Unpacks one super-block.
pub fn unpack(b: &[u8], u: &mut Unpacked) {
    let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
    u.d = f16_to_f32(rd16(b, 208));
    u.dmin = 0.0;
    for g in 0..16 {
        u.sc[g] = sc[g] as i8 as i16;
        u.mn[g] = 0;
    }
    for h in 0..2 {
        for k in 0..64 {
            let e0 = 128 * h + k;
            let e1 = 128 * h + 64 + k;
            let hb = |e: usize| (qh[32 * h + (e % 128) % 32] >> (2 * ((e % 128) / 32))) & 3;
            u.q[e0] = (((ql[64 * h + k] & 0x0f) | (hb(e0) << 4)) as i8) - 32;
            u.q[e1] = (((ql[64 * h + k] >> 4) | (hb(e1) << 4)) as i8) - 32;
        }
    }
}

fn dequantize(src: &[u8], dst: &mut [f32]) {
    dequantize_with(src, dst, BYTES, unpack)
}

fn dot(row: &[u8], x: &[BlockQ8]) -> f32 {
    dot_with(row, x, BYTES, unpack)
}

//! Q3_K: super-blocks of 256 values, 110 bytes: 32 bytes of high-bit masks (bit k of byte l belongs to value
//! 32k + l), 64 bytes of 2-bit codes (value 128h + 32s + l in `(qs[32h + l] >> 2s) & 3`), 12 bytes of 16 packed
//! 6-bit scales (low 4 bits: byte i for i < 8, the high nibble of byte i − 8 above; top 2 bits: byte 8 + i % 4 at
//! bit 2·(i / 4)), stored + 32, then f16 `d`; value = `(d · sc) · (q − 4 · (1 − hbit))` (ggml `block_q3_K`).

use super::kquant::{dequantize_with, dot_with, Unpacked};
use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::dequant::{f16_to_f32, rd16};
use crate::quant::{BlockQ8, GgmlType};

/// Bytes per super-block.
pub const BYTES: usize = 110;

/// The Q3_K row.
pub const FORMAT: Format = Format {
    ty: GgmlType::Q3_K,
    name: "q3_k",
    activation: Activation::Q8K,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot_k::avx2::dot_q3_k,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot_k::avx2::dot_q3_k_x4,
        #[cfg(target_arch = "x86_64")]
        avx2_t4: None,
        #[cfg(target_arch = "x86_64")]
        avx2_t8: None,
        wide: false,
        #[cfg(target_arch = "x86_64")]
        avx512: None,
        #[cfg(target_arch = "x86_64")]
        gemm512: Some(crate::quant::gemm512::Gemm512::scalar(unpack, BYTES, false)),
    }),
    f32_dot: None,
    f32_dot4: None,
    cuda: Some(CudaFormat { index: 9, suffix: "q3_k", narrow: false, prefill: Prefill::Mmq, on_demand: true }),
};

/// Unpacks one super-block.
pub fn unpack(b: &[u8], u: &mut Unpacked) {
    let (hm, qs, s) = (&b[..32], &b[32..96], &b[96..108]);
    u.d = f16_to_f32(rd16(b, 108));
    u.dmin = 0.0;
    for i in 0..16 {
        let lo = if i < 8 { s[i] & 0x0f } else { s[i - 8] >> 4 };
        let hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        u.sc[i] = (lo | (hi << 4)) as i16 - 32;
        u.mn[i] = 0;
    }
    for e in 0..256 {
        let (h, r) = (e / 128, e % 128);
        let (sh, l) = (r / 32, r % 32);
        let q = (qs[32 * h + l] >> (2 * sh)) & 3;
        let hbit = (hm[e % 32] >> (e / 32)) & 1;
        u.q[e] = q as i8 - if hbit == 0 { 4 } else { 0 };
    }
}

fn dequantize(src: &[u8], dst: &mut [f32]) {
    dequantize_with(src, dst, BYTES, unpack)
}

fn dot(row: &[u8], x: &[BlockQ8]) -> f32 {
    dot_with(row, x, BYTES, unpack)
}

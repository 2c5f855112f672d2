//! IQ4_XS: super-blocks of 256 values, 136 bytes: f16 `d`, a u16 of the scales' high 2 bits (sub-block i at bits
//! 2i), 4 bytes of their low 4 bits (sub-block i in byte i/2, nibble i%2), then per 32-value sub-block 16 bytes of
//! IQ4_NL indices (low nibbles values 0..16, high nibbles 16..32); value = `(d · (ls − 32)) · KVALUES[q]` (ggml
//! `block_iq4_xs`). Products pair it with Q8_K activations, as the K-quants.

use super::iq4_nl::{levels, KVALUES};
use super::kquant::{dequantize_with, dot_with, Unpacked};
use super::{Activation, CudaFormat, Format, Prefill, Q8Dot};
use crate::quant::dequant::{f16_to_f32, rd16};
use crate::quant::{BlockQ8, GgmlType};

/// Bytes per super-block.
pub const BYTES: usize = 136;

/// The IQ4_XS row.
pub const FORMAT: Format = Format {
    ty: GgmlType::IQ4_XS,
    name: "iq4_xs",
    activation: Activation::Q8K,
    dequantize,
    q8: Some(Q8Dot {
        scalar: dot,
        #[cfg(target_arch = "x86_64")]
        avx2: crate::quant::dot_k::avx2::dot_iq4_xs,
        #[cfg(target_arch = "x86_64")]
        avx2_x4: crate::quant::dot_k::avx2::dot_iq4_xs_x4,
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
    cuda: Some(CudaFormat { index: 14, suffix: "iq4_xs", narrow: false, prefill: Prefill::Mmq, on_demand: true }),
};

/// The 6-bit scale of sub-block `i` (0..8), offset removed (−32..31).
#[inline]
pub fn scale(b: &[u8], i: usize) -> i16 {
    let h = u16::from_le_bytes([b[2], b[3]]);
    let lo = (b[4 + i / 2] >> (4 * (i % 2))) & 0x0f;
    let hi = ((h >> (2 * i)) & 3) as u8;
    (lo | (hi << 4)) as i16 - 32
}

/// Unpacks one super-block (as the K-quants', no minimums).
pub fn unpack(b: &[u8], u: &mut Unpacked) {
    u.d = f16_to_f32(rd16(b, 0));
    u.dmin = 0.0;
    for i in 0..8 {
        let s = scale(b, i);
        u.sc[2 * i] = s;
        u.sc[2 * i + 1] = s;
        u.mn[2 * i] = 0;
        u.mn[2 * i + 1] = 0;
        u.q[32 * i..32 * i + 32].copy_from_slice(&levels(&b[8 + 16 * i..24 + 16 * i], &KVALUES));
    }
}

fn dequantize(src: &[u8], dst: &mut [f32]) {
    dequantize_with(src, dst, BYTES, unpack)
}

fn dot(row: &[u8], x: &[BlockQ8]) -> f32 {
    dot_with(row, x, BYTES, unpack)
}

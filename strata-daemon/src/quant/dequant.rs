//! Scalar dequantization (the reference path).

use super::{GgmlType, QuantError};

/// IEEE half (binary16) bits to f32.
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// bfloat16 bits to f32 (the upper half of an f32).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

#[inline]
pub(crate) fn rd16(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

/// Dequantizes `src` (whole blocks of type `ty`) into `dst`
/// (`dst.len()` elements; `src.len()` must be `ty.row_bytes(dst.len())`).
///
/// Errors: [`QuantError::Unsupported`] for formats without a kernel,
/// [`QuantError::Length`] when the lengths disagree.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    if !ty.is_supported() {
        return Err(QuantError::Unsupported(ty));
    }
    let n = dst.len();
    if n % ty.block_size() != 0 || src.len() != ty.row_bytes(n) {
        return Err(QuantError::Length(format!("{ty:?}: {} bytes do not hold {n} elements", src.len())));
    }
    match ty {
        GgmlType::F32 => {
            for (i, d) in dst.iter_mut().enumerate() {
                *d = f32::from_le_bytes(src[4 * i..4 * i + 4].try_into().unwrap());
            }
        }
        GgmlType::F16 => {
            for (i, d) in dst.iter_mut().enumerate() {
                *d = f16_to_f32(rd16(src, 2 * i));
            }
        }
        GgmlType::BF16 => {
            for (i, d) in dst.iter_mut().enumerate() {
                *d = bf16_to_f32(rd16(src, 2 * i));
            }
        }
        GgmlType::Q8_0 => {
            for (b, out) in src.chunks_exact(34).zip(dst.chunks_exact_mut(32)) {
                let d = f16_to_f32(rd16(b, 0));
                for j in 0..32 {
                    out[j] = (b[2 + j] as i8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_0 => {
            for (b, out) in src.chunks_exact(18).zip(dst.chunks_exact_mut(32)) {
                let d = f16_to_f32(rd16(b, 0));
                for j in 0..16 {
                    out[j] = ((b[2 + j] & 0x0f) as i32 - 8) as f32 * d;
                    out[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (b, out) in src.chunks_exact(20).zip(dst.chunks_exact_mut(32)) {
                let d = f16_to_f32(rd16(b, 0));
                let m = f16_to_f32(rd16(b, 2));
                for j in 0..16 {
                    out[j] = (b[4 + j] & 0x0f) as f32 * d + m;
                    out[j + 16] = (b[4 + j] >> 4) as f32 * d + m;
                }
            }
        }
        _ => unreachable!(),
    }
    Ok(())
}

//! Dequantization of a row through the format registry ([`super::format`]), and the half-float helpers.

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
    let Some(fmt) = super::format::lookup(ty) else {
        return Err(QuantError::Unsupported(ty));
    };
    let n = dst.len();
    if !n.is_multiple_of(ty.block_size()) || src.len() != ty.row_bytes(n) {
        return Err(QuantError::Length(format!("{ty:?}: {} bytes do not hold {n} elements", src.len())));
    }
    (fmt.dequantize)(src, dst);
    Ok(())
}

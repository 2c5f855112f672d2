//! F32: 4-byte IEEE floats, one element per block.

use super::{Activation, CudaFormat, Format, Prefill};
use crate::quant::GgmlType;

/// The F32 row.
pub const FORMAT: Format = Format {
    ty: GgmlType::F32,
    name: "f32",
    activation: Activation::F32,
    dequantize,
    q8: None,
    f32_dot: Some(crate::quant::fdot::dot_f32),
    f32_dot4: Some(crate::quant::fdot::dot4_f32),
    cuda: Some(CudaFormat { index: 0, suffix: "f32", narrow: false, prefill: Prefill::Float, on_demand: false }),
};

fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (d, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes(b.try_into().expect("4 bytes"));
    }
}

//! F16: IEEE binary16, one element per block.

use super::{Activation, CudaFormat, Format, Prefill};
use crate::quant::dequant::{f16_to_f32, rd16};
use crate::quant::GgmlType;

/// The F16 row.
pub const FORMAT: Format = Format {
    ty: GgmlType::F16,
    name: "f16",
    activation: Activation::F32,
    dequantize,
    q8: None,
    f32_dot: Some(crate::quant::fdot::dot_f16),
    f32_dot4: Some(crate::quant::fdot::dot4_f16),
    cuda: Some(CudaFormat { index: 1, suffix: "f16", narrow: false, prefill: Prefill::Float, on_demand: false }),
};

fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (i, d) in dst.iter_mut().enumerate() {
        *d = f16_to_f32(rd16(src, 2 * i));
    }
}

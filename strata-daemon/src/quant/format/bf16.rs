//! BF16: bfloat16 (the upper half of an f32), one element per block.

use super::{Activation, CudaFormat, Format, Prefill};
use crate::quant::dequant::{bf16_to_f32, rd16};
use crate::quant::GgmlType;

/// The BF16 row.
pub const FORMAT: Format = Format {
    ty: GgmlType::BF16,
    name: "bf16",
    activation: Activation::F32,
    dequantize,
    q8: None,
    f32_dot: Some(crate::quant::fdot::dot_bf16),
    f32_dot4: Some(crate::quant::fdot::dot4_bf16),
    cuda: Some(CudaFormat { index: 2, suffix: "bf16", narrow: false, prefill: Prefill::Float, on_demand: false }),
};

fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (i, d) in dst.iter_mut().enumerate() {
        *d = bf16_to_f32(rd16(src, 2 * i));
    }
}

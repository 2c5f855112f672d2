//! GGML tensor formats: the type table, the format registry (one module per block format, [`format`]),
//! dequantization, activation quantization and dot products (scalar reference, AVX2/FMA and AVX-512 VNNI, chosen
//! at run time).
//!
//! Block layouts follow ggml (`ggml-common.h` in the ggml/llama.cpp
//! repositories): e.g. Q4_0 = f16 scale + 16 bytes of nibbles per 32 values.

pub mod amx;
mod dequant;
mod dot;
pub mod dot512;
mod dot_k;
pub mod f16;
pub mod fdot;
pub mod format;
pub mod gemm512;
pub mod prefetch;
pub mod q4_wide;
mod types;

pub use dequant::{bf16_to_f32, dequantize_row, f16_to_f32};
pub use dot::{
    amx_rows, dot_q8, dot_q8_scalar, dot_q8_x4, gemm512_of, is_q8_k, k512, q8_rows, q8_t4, q8_t8, quantize_q8,
    quantize_q8_k, simd_level, vec_dot_f32_row, wide, BlockQ8, Q8Rows, Q8Tn, SimdLevel, K512, Q8T4,
};
pub use types::GgmlType;

/// Errors from quant operations.
#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    /// The format has no kernel in this build.
    #[error("tensor type {0:?} is not supported for computation (supported: {list})", list = format::supported_list())]
    Unsupported(GgmlType),
    /// A buffer length does not match the element count.
    #[error("{0}")]
    Length(String),
}

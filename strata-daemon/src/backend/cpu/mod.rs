//! The CPU backend: matrix products and the other operations of a forward pass over the worker pool
//! ([`crate::pool`]), on the quantized kernels of [`crate::quant`].

pub mod matmul;

pub use matmul::*;

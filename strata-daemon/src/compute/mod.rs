//! Compute backends. `cpu` is always built: a spinning fork-join worker pool running the
//! quantized kernels of [`crate::quant`].

pub mod cpu;
pub mod pool;

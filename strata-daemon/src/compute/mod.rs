//! Compute backends. `cpu` is always built: a rayon worker pool running the
//! quantized kernels of [`crate::quant`].

pub mod cpu;

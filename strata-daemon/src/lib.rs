//! Strata: an inference engine for Mixture-of-Experts language models whose
//! experts do not all fit in VRAM (see `DESIGN.md`).
//!
//! Modules: [`api`] (the transport-neutral control API), [`gguf`] (file format), [`quant`] (GGML block formats and CPU
//! kernels), [`model`] (architectures, tokenizer, chat template),
//! [`backend`] (the backend interface, CPU and CUDA), [`engine`] (decode loop, sampler, requests),
//! [`service`] (gRPC control plane), [`tiers`] (expert placement).
#![warn(missing_docs)]

pub mod api;
pub mod arch;
pub mod backend;
pub mod engine;
pub mod gguf;
pub mod model;
pub mod pool;
pub mod quant;
pub mod service;
pub mod tiers;

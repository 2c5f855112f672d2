//! The model: the tokenizer built from GGUF metadata, the chat template, and the forward pass written once
//! over the backend interface ([`crate::backend`]). Hyper-parameters and located weights are in
//! [`crate::arch`]; the KV cache is the backend's ([`crate::backend::kv`]).

pub mod chat;
pub mod forward;
pub mod moe_copy;
pub mod perplexity;
pub mod placement;
pub mod tokenizer;
pub mod tool_calls;
pub mod tools;

pub use crate::arch::config::{ModelConfig, ModelError};
pub use crate::backend::kv::KvCache;
pub use forward::{Logits, Model};
pub use tokenizer::Tokenizer;

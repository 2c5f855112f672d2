//! Model architectures (hyper-parameters from GGUF metadata), the tokenizer
//! built from GGUF metadata, the chat template, and the forward pass.

pub mod chat;
pub mod config;
pub mod forward;
pub mod kv;
pub mod moe_copy;
pub mod perplexity;
pub mod tokenizer;

pub use config::{ModelConfig, ModelError};
pub use forward::{Logits, Model};
pub use kv::KvCache;
pub use tokenizer::Tokenizer;

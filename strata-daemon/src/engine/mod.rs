//! Decode loop, sampler, request queue and counters.
//!
//! One engine thread owns the model and the KV cache and runs requests one at
//! a time from a FIFO queue; the service talks to it over channels.

pub mod request;
pub mod routing_dump;
pub mod sampler;
pub mod stats;
pub mod stream_text;
mod worker;

pub use request::{FinishReason, GenerateParams, RequestError};
pub use stats::{Counters, Stats, Totals};
pub use worker::{Engine, EngineConfig, Event, Job, TierCheck, TierCheckError, TierCheckResult};

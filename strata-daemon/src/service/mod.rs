//! Front ends: the gRPC control plane (the `strata.v1.Strata` service on a Unix socket, with standard gRPC health
//! and reflection) and the OpenAI-compatible HTTP API (`--http-listen`).

pub mod config;
pub mod errors;
pub mod grpc;
pub mod http;
pub mod socket;

pub use grpc::StrataService;

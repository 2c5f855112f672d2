//! gRPC control plane: the `strata.v1.Strata` service, the Unix socket it
//! listens on, and standard gRPC health and reflection.

pub mod grpc;
pub mod socket;

pub use grpc::StrataService;

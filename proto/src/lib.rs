//! Generated protobuf messages and tonic client/server for the Strata control
//! plane (`proto/strata.proto`, package `strata.v1`).
#![allow(missing_docs, clippy::all)]

/// Package `strata.v1`: messages, `strata_client::StrataClient`, `strata_server::StrataServer`.
pub mod v1 {
    tonic::include_proto!("strata.v1");
}

/// Encoded `FileDescriptorSet` of `strata.proto`, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/strata_descriptor.bin"));

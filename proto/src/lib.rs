//! Generated protobuf messages and tonic client/server for the Strata control
//! plane (`proto/strata.proto`, package `strata.v1`).
#![allow(missing_docs, clippy::all)]

/// Package `strata.v1`: messages, `strata_client::StrataClient`, `strata_server::StrataServer`.
pub mod v1 {
    tonic::include_proto!("strata.v1");
}

/// Encoded `FileDescriptorSet` of `strata.proto`, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/strata_descriptor.bin"));

/// Default socket path: `$XDG_RUNTIME_DIR/strata.sock`, or
/// `/tmp/strata-<uid>.sock` when `XDG_RUNTIME_DIR` is not set. The system
/// service uses `/run/strata/strata.sock` (set in its unit file).
pub fn default_socket_path() -> std::path::PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => std::path::PathBuf::from(d).join("strata.sock"),
        _ => {
            // The owner of /proc/self is this process's uid.
            let uid = std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m)).unwrap_or(0);
            std::path::PathBuf::from(format!("/tmp/strata-{uid}.sock"))
        }
    }
}

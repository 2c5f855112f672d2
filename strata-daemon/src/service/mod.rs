//! gRPC control plane.

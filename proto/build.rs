//! Compiles `strata.proto` with protox (pure Rust, no `protoc`) and generates the
//! tonic/prost code; also writes the file descriptor set for gRPC reflection.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let proto = proto_dir.join("strata.proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    let fds = protox::compile([&proto], [&proto_dir])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("strata_descriptor.bin"), prost::Message::encode_to_vec(&fds))?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(fds)?;
    Ok(())
}

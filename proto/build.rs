//! Compiles `sandbox/v1/sandbox.proto` with protox (pure Rust), so no system `protoc` is needed.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "sandbox/v1/sandbox.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["."])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    // The descriptor set also feeds server reflection, so grpcurl works without the file.
    std::fs::write(out.join("sandbox_descriptor.bin"), prost::Message::encode_to_vec(&fds))?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(fds)?;
    Ok(())
}

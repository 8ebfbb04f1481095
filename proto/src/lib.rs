//! Generated types and gRPC stubs for the `sandbox.v1` API (see `proto/sandbox/v1/sandbox.proto`).

/// The `sandbox.v1` package.
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("sandbox.v1");
}

/// Encoded `FileDescriptorSet` of the API, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/sandbox_descriptor.bin"));

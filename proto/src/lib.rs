//! lockstep-proto: the gRPC API of lockstep, package `lockstep.v1` (`proto/lockstep/v1/`).
//!
//! - `Lockstep`: the front-end service (Generate, Chat, Abort, GetPair, ListModels).
//! - `Worker`: between the router and `lockstep worker` processes, and between workers (the
//!   verified KV push).
//!
//! [`FILE_DESCRIPTOR_SET`] serves gRPC reflection.

#![allow(missing_docs)] // Generated code; the .proto files carry the documentation.
#![allow(clippy::all)]

/// Package `lockstep.v1`.
pub mod v1 {
    tonic::include_proto!("lockstep.v1");
}

/// The encoded descriptors of every `lockstep.v1` file, for reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("lockstep_descriptor");

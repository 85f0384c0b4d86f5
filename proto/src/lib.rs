//! lockstep-proto: the gRPC API of lockstep, package `lockstep.v1` (`proto/lockstep/v1/`).
//!
//! - `Lockstep`: the front-end service (Generate, Chat, Abort, GetPair, ListModels).
//! - `Worker`: between the router and `lockstep worker` processes, and between workers (the
//!   verified KV push).
//!
//! [`FILE_DESCRIPTOR_SET`] serves gRPC reflection. The router and the workers meet only here
//! (`docs/ARCHITECTURE.md`).

#![allow(clippy::all)]

/// Package `lockstep.v1` (generated; the .proto files carry the documentation).
#[allow(missing_docs)]
pub mod v1 {
    tonic::include_proto!("lockstep.v1");
}

/// The encoded descriptors of every `lockstep.v1` file, for reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("lockstep_descriptor");

/// Largest gRPC message either side of the worker API sends or accepts (one KV page of a large
/// model is a few MiB).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

//! lockstep-worker: `lockstep worker`, the embedded engine behind the worker service (`lockstep.v1.Worker`), so
//! prefill and decode run as separate processes on separate machines with lockstep's integrity
//! guarantees across the network.
//!
//! A prefill worker computes a pair's KV and pushes it, with its manifest, **directly to the
//! decode worker the router chose** (`PushKv`, a client stream: manifest, then pages); it reports
//! the manifest digest to the router. The decode worker holds a pushed set in the pair's room
//! until the router's `Decode` call claims it, then the engine verifies it (pair, model, token
//! count, every page's checksum) before it touches the pool, and reports the digest of what it
//! imported. The router compares the two digests (it trusts neither side alone).
//!
//! Freeing what a lost peer leaves behind: a `Decode` or `Prefill` call whose caller goes away is
//! aborted in the engine at once (its pages freed); a pushed set nobody claims, or a `Decode`
//! waiting for a set that never comes, is dropped after `worker.lease_ms`; an `Abort` drops both
//! immediately.

//!
//! Modules: [`config`] (the worker's file), [`service`] (the gRPC service), [`rooms`] (where
//! pushed sets wait), [`kvmac`] (the per-pair manifest MAC), [`push`] and [`data`] (the KV data plane, both ends), [`pb`] (wire
//! conversions), [`run`] (listeners and background tasks). The router never depends on this crate
//! (nor this crate on the router): they meet only through `lockstep-proto`. The crate map:
//! `docs/ARCHITECTURE.md`.

pub mod config;
pub mod data;
#[doc(hidden)]
pub mod fuzzing;
pub mod kvmac;
pub mod pb;
pub mod push;
pub mod rooms;
pub mod run;
pub mod service;

pub use config::{KvTransport, Role, WorkerFile, WorkerSection};
pub use run::RunningWorker;
pub use service::WorkerService;

//! lockstep-router: the router of lockstep, a sidecar proxy and router for disaggregated LLM inference.
//!
//! It pairs the prefill and decode halves of every request ([`pair`]), keeps them in one
//! lifecycle, aborts both together on any failure, and releases decode output only after the
//! commit barrier has verified the prefill. The crate map, a request's path
//! through the code and where each guarantee is enforced: `docs/ARCHITECTURE.md`.

pub mod admin;
pub mod admission;
pub mod app;
pub mod backend;
#[doc(hidden)]
pub mod fuzzing;
pub mod http;
pub mod idempotency;
pub(crate) mod members;
pub mod models;
pub mod pair;
pub mod state;
pub mod stored;

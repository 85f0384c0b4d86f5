//! lockstep-core: what every layer of lockstep shares and that uses nothing of theirs: the pair's
//! id, sides, sampling and decode-output types ([`vocab`]), the typed error with its one mapping
//! to HTTP status, gRPC code and OpenAI error body ([`error`]), the configuration file's types and
//! their validation ([`config`]), the Prometheus metrics ([`metrics`]) and the audit log
//! ([`audit`]). The crate map: `docs/ARCHITECTURE.md`.

pub mod audit;
pub mod config;
pub mod error;
pub mod generation;
pub mod ids;
pub mod metrics;

//! lockstep-serve: what every lockstep process (the router and the workers) needs to serve,
//! and nothing of either: the accept loop ([`accept`]), TLS on listeners ([`tls`]), signals
//! ([`signals`]), background tasks ([`tasks`]), logs and traces ([`telemetry`]), the TOML loader
//! with per-section validation ([`toml_file`]), the engine section both processes read
//! ([`engine_section`]) and the model-file fetch ([`model_file`]).
//!
//! The crate map and a request's path through the code: `docs/ARCHITECTURE.md`.

pub mod accept;
pub mod engine_section;
pub mod model_file;
pub mod signals;
pub mod tasks;
pub mod telemetry;
pub mod tls;
pub mod toml_file;

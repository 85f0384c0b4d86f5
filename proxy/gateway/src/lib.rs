//! lockstep-gateway: the roles lockstep plays behind a Kubernetes Gateway (the Gateway API
//! Inference Extension, llm-d's layout): the endpoint picker Envoy asks where each request goes
//! ([`picker`], `lockstep epp`), and the prefill/decode sidecar in front of each decode engine
//! that runs the pair with the prefill the picker named ([`sidecar`], `lockstep sidecar`).
//!
//! Each is a [`lockstep_router::state::Role`]: the router runs the request, the role changes only
//! the phases it must (what the headers name, which prefill a pair uses, what the HTTP listener
//! serves, what readiness needs). The router never names either.

pub mod picker;
pub mod sidecar;

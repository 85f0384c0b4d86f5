//! Test support for lockstep's end-to-end tests: a PD-faithful SGLang mock ([`sglang_mock`]), a
//! shared word-level tokenizer ([`tokenizer`]), and a harness that starts lockstep in process in
//! front of the mock ([`harness`]).

pub mod client;
pub mod embed_mock;
pub mod embedded;
pub mod engine_publisher;
pub mod fuzz;
pub mod gateway;
pub mod harness;
pub mod kube_api;
pub mod kv_publisher;
pub mod naive_front;
pub mod postgres;
pub mod redis;
pub mod sglang_mock;
pub mod stops;
pub mod tokenizer;
mod vllm_chunks;
pub mod vllm_mock;

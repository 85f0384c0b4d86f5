//! lockstep-engine: lockstep's embedded inference engine.
//!
//! - [`pool`]: a paged KV pool whose pages carry `(owner, epoch)` tags; readers reach pages only
//!   through page tables of tagged refs, so a reused page can never be read by a stale or foreign
//!   table. Scrub and verify policies, all-or-nothing allocation, tenant-salted prefix sharing.
//! - [`transfer`]: verified KV export/import with a checksummed manifest (xxh3-64 per page, fused
//!   with the copy).
//! - [`attention`]: CPU paged attention (decode batch and causal prefill, GQA, rayon).
//! - [`cuda`]: the CUDA backend (cudarc, NVRTC kernels, cuBLAS): device page pool with tags on
//!   the device, the forward pass on the GPU, device checksums; `auto | cpu | cuda:N`.
//!
//! - [`gguf`] and [`quant`]: the GGUF reader (v2/v3, memory-mapped) and dequantisation
//!   (F32, F16, BF16, Q4_0, Q4_1, Q8_0) the model loader builds on; [`tokenizer`]: the model
//!   file's tokenizer and chat template.
//! - [`model`]: the llama forward pass over a ragged batch, with quantised AVX2 matmuls.
//! - [`synthetic`]: a GGUF writer and seeded random llama models of any shape (for checks where
//!   the real model file cannot travel).
//! - [`bundle`]: a model file loaded once (network, tokenizer, fingerprint); [`device`]: where an
//!   engine computes (CPU or CUDA, one enum the scheduler drives).
//! - [`sample`]: sampling and stop conditions; [`engine`]: the continuous-batching engine (its
//!   scheduler thread in `engine/scheduler.rs`);
//!   [`pd`]: prefill and decode engines in one process with a verified transfer between them.
//!
//! Prefix sharing shares only full pages, so no sequence ever extends a shared page: the
//! copy-before-extend case cannot arise.
//!
//! Where the engine sits among lockstep's crates: `docs/ARCHITECTURE.md`.

pub mod attention;
pub mod bundle;
pub mod cpu;
pub mod cuda;
pub mod device;
pub mod embed;
pub mod engine;
pub mod error;
pub mod gguf;
pub mod grammar;
mod matmul;
pub mod model;
pub mod pd;
pub mod pool;
pub mod quant;
pub mod sample;
pub mod synthetic;
pub mod tokenizer;
pub mod transfer;

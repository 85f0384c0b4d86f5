//! lockstep-engine: the memory core of lockstep's embedded engine.
//!
//! - [`pool`]: a paged KV pool whose pages carry `(owner, epoch)` tags; readers reach pages only
//!   through page tables of tagged refs, so a reused page can never be read by a stale or foreign
//!   table. Scrub and verify policies, all-or-nothing allocation, tenant-salted prefix sharing.
//! - [`transfer`]: verified KV export/import with a checksummed manifest (xxh3-64 per page, fused
//!   with the copy).
//! - [`attention`]: CPU paged attention (decode batch and causal prefill, GQA, rayon), behind the
//!   [`backend::AttentionBackend`] interface the CUDA backend will implement too.
//!
//! Prefix sharing shares only full pages, so no sequence ever extends a shared page: the
//! copy-before-extend case cannot arise.

pub mod attention;
pub mod backend;
pub mod pool;
pub mod transfer;

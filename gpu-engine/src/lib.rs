//! lockstep-engine: the memory core of lockstep's embedded engine.
//!
//! - [`pool`]: a paged KV pool whose pages carry `(owner, epoch)` tags; readers reach pages only
//!   through page tables of tagged refs, so a reused page can never be read by a stale or foreign
//!   table. Scrub and verify policies, all-or-nothing allocation, tenant-salted prefix sharing.
//! - [`transfer`]: verified KV export/import with a checksummed manifest.
//!
//! Paged attention, the model and the CUDA backend build on these (see the engine issues).

pub mod attention;
pub mod pool;
pub mod transfer;

//! The compute interface the engine's model code calls, so the same model runs on the CPU
//! backend here and on the CUDA backend (a later issue) unchanged. Both read K and V only through
//! the pool's tagged page tables.

use crate::attention::{decode_attention, prefill_attention};
use crate::pool::{IntegrityError, PagePool, Sequence};

/// Paged attention over a [`PagePool`].
pub trait AttentionBackend: Send + Sync {
    /// A short name for logs (`cpu`, `cuda:0`).
    fn name(&self) -> String;
    /// Decode attention: one query per sequence; `q`/`out` are `batch × heads × head_dim`.
    fn decode(
        &self,
        pool: &PagePool,
        seqs: &[&Sequence],
        layer: usize,
        heads: usize,
        q: &[f32],
        out: &mut [f32],
    ) -> Result<(), IntegrityError>;
    /// Causal prefill attention for positions `start..start + n`; `q`/`out` are `n × heads × head_dim`.
    // Mirrors the kernel's launch parameters one to one.
    #[allow(clippy::too_many_arguments)]
    fn prefill(
        &self,
        pool: &PagePool,
        seq: &Sequence,
        layer: usize,
        heads: usize,
        start: usize,
        q: &[f32],
        out: &mut [f32],
    ) -> Result<(), IntegrityError>;
}

/// The CPU backend: rayon over (sequence, head) pairs.
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

#[allow(clippy::too_many_arguments)]
impl AttentionBackend for CpuBackend {
    fn name(&self) -> String {
        "cpu".into()
    }
    fn decode(
        &self,
        pool: &PagePool,
        seqs: &[&Sequence],
        layer: usize,
        heads: usize,
        q: &[f32],
        out: &mut [f32],
    ) -> Result<(), IntegrityError> {
        decode_attention(pool, seqs, layer, heads, q, out)
    }
    fn prefill(
        &self,
        pool: &PagePool,
        seq: &Sequence,
        layer: usize,
        heads: usize,
        start: usize,
        q: &[f32],
        out: &mut [f32],
    ) -> Result<(), IntegrityError> {
        prefill_attention(pool, seq, layer, heads, start, q, out)
    }
}

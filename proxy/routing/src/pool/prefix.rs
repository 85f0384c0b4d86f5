//! The prefix-aware policy's memory: per worker, the chained hashes of the token blocks routed
//! there (least recently routed forgotten first).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};

use lockstep_core::config::PrefixRouting;

/// The blocks one worker is predicted to hold: block hash → when it was last routed there,
/// and the reverse, for forgetting the least recently routed first.
/// One worker's remembered blocks: hash -> routing tick, and tick -> hash for eviction.
#[derive(Debug, Default, Clone)]
pub(super) struct Blocks {
    pub(super) by_hash: HashMap<u64, u64>,
    by_age: BTreeMap<u64, u64>,
}

impl Blocks {
    /// Leading blocks of `hashes` present.
    pub(super) fn matched(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.by_hash.contains_key(h))
            .count()
    }
    pub(super) fn insert(&mut self, hashes: &[u64], tick: &AtomicU64, capacity: usize) {
        for h in hashes {
            let t = tick.fetch_add(1, Ordering::Relaxed);
            if let Some(old) = self.by_hash.insert(*h, t) {
                self.by_age.remove(&old);
            }
            self.by_age.insert(t, *h);
        }
        while self.by_hash.len() > capacity.max(1) {
            match self.by_age.pop_first() {
                Some((_, h)) => {
                    self.by_hash.remove(&h);
                }
                None => break,
            }
        }
    }
}

/// The prefix-aware policy's view of the workers' caches (approximate: what was routed where).
/// Every worker's blocks, keyed by its URL (so a member that joins, leaves or moves in the list
/// keeps or drops exactly its own), and the predicted-hit counters.
#[derive(Debug, Default)]
pub(super) struct PrefixIndex {
    pub(super) cfg: PrefixRouting,
    pub(super) workers: dashmap::DashMap<String, Blocks>,
    pub(super) tick: AtomicU64,
    /// Prompt tokens routed with a key, and how many of them were predicted cached.
    pub(super) routed_tokens: AtomicU64,
    pub(super) predicted_hit_tokens: AtomicU64,
}

/// The prefix rule over `(load, matched, size)` per candidate, `matched` out of `wanted`: the
/// one holding the most (ties: the less loaded), unless load is out of balance or none holds
/// `cache_threshold` of it; then the least loaded (ties: the one holding least).
pub(super) fn choose(
    stats: &[(usize, usize, usize)],
    wanted: usize,
    cfg: &lockstep_core::config::PrefixRouting,
) -> usize {
    let (min_load, max_load) = stats
        .iter()
        .fold((usize::MAX, 0), |(lo, hi), s| (lo.min(s.0), hi.max(s.0)));
    let imbalanced = max_load - min_load > cfg.balance_abs_threshold
        && max_load as f64 > cfg.balance_rel_threshold * min_load as f64;
    let best = (0..stats.len())
        .max_by_key(|&i| (stats[i].1, std::cmp::Reverse(stats[i].0)))
        .unwrap_or(0);
    if !imbalanced && wanted > 0 && stats[best].1 as f64 >= cfg.cache_threshold * wanted as f64 {
        best
    } else {
        (0..stats.len())
            .min_by_key(|&i| (stats[i].0, stats[i].2))
            .unwrap_or(0)
    }
}

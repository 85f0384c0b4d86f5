//! The registry of live pairs (invariant 1: one id, one owner).

use std::sync::Arc;
use std::time::Instant;

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;

use super::PairId;

/// Where a live pair is in its lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairState {
    /// Both halves dispatched, waiting for the commit barrier.
    Dispatched,
    /// The barrier passed: tokens are flowing to the client.
    Committed,
    /// Failure seen, both halves being aborted.
    Aborting,
}

/// What the registry knows of a live pair (never content).
#[derive(Debug, Clone)]
pub struct PairInfo {
    /// Model name.
    pub model: Arc<str>,
    /// Prefill worker URL.
    pub prefill: String,
    /// Decode worker URL.
    pub decode: String,
    /// When the pair was dispatched.
    pub started: Instant,
    /// Current state.
    pub state: PairState,
}

/// All live pairs, keyed by id.
#[derive(Debug, Default)]
pub struct PairRegistry {
    live: DashMap<PairId, PairInfo>,
}

impl PairRegistry {
    /// Registers a pair under a fresh id that no live pair holds; the guard removes it on drop.
    pub fn register(self: &Arc<Self>, info: PairInfo) -> PairGuard {
        loop {
            let id = PairId::random();
            if let Entry::Vacant(v) = self.live.entry(id) {
                v.insert(info);
                return PairGuard {
                    id,
                    registry: self.clone(),
                };
            }
        }
    }

    /// Registers under a chosen id; `None` when that id is live (collision check, tests).
    pub fn register_as(self: &Arc<Self>, id: PairId, info: PairInfo) -> Option<PairGuard> {
        match self.live.entry(id) {
            Entry::Vacant(v) => {
                v.insert(info);
                Some(PairGuard {
                    id,
                    registry: self.clone(),
                })
            }
            Entry::Occupied(_) => None,
        }
    }

    /// Number of live pairs.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Whether no pair is live.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// A snapshot of one live pair.
    pub fn get(&self, id: PairId) -> Option<PairInfo> {
        self.live.get(&id).map(|e| e.clone())
    }

    /// Ids of all live pairs.
    pub fn ids(&self) -> Vec<PairId> {
        self.live.iter().map(|e| *e.key()).collect()
    }
}

/// Ownership of one registry entry; dropping it removes the entry.
#[derive(Debug)]
pub struct PairGuard {
    id: PairId,
    registry: Arc<PairRegistry>,
}

impl PairGuard {
    /// The pair's id.
    pub fn id(&self) -> PairId {
        self.id
    }
    /// Moves the pair to `state`.
    pub fn set_state(&self, state: PairState) {
        if let Some(mut e) = self.registry.live.get_mut(&self.id) {
            e.state = state;
        }
    }
}

impl Drop for PairGuard {
    fn drop(&mut self) {
        self.registry.live.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> PairInfo {
        PairInfo {
            model: "m".into(),
            prefill: "p".into(),
            decode: "d".into(),
            started: Instant::now(),
            state: PairState::Dispatched,
        }
    }

    #[test]
    fn ids_are_unique_while_live_and_freed_on_drop() {
        let r = Arc::new(PairRegistry::default());
        let g = r.register_as(PairId::from_raw(7), info()).expect("vacant");
        assert!(
            r.register_as(PairId::from_raw(7), info()).is_none(),
            "collision must be refused"
        );
        let many: Vec<_> = (0..1000).map(|_| r.register(info())).collect();
        assert_eq!(r.len(), 1001);
        assert!(many.iter().all(|g| g.id().raw() < (1 << 63)));
        g.set_state(PairState::Committed);
        assert_eq!(
            r.get(PairId::from_raw(7)).map(|i| i.state),
            Some(PairState::Committed)
        );
        drop(g);
        drop(many);
        assert!(r.is_empty());
        assert!(r.register_as(PairId::from_raw(7), info()).is_some());
    }
}

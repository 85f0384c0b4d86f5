//! The registry of live pairs (invariant 1: one id, one owner).

use std::sync::Arc;
use std::time::Instant;

use std::sync::atomic::{AtomicU8, Ordering};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use tokio_util::sync::CancellationToken;

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

impl PairState {
    /// `dispatched`, `committed` or `aborting`.
    pub fn as_str(self) -> &'static str {
        match self {
            PairState::Dispatched => "dispatched",
            PairState::Committed => "committed",
            PairState::Aborting => "aborting",
        }
    }
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
    /// The tenant whose request it is (`None` when lockstep runs without tenants).
    pub tenant: Option<Arc<str>>,
}

/// Why a live pair was told to stop from outside its task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CancelReason {
    /// lockstep is shutting down (drain).
    Shutdown,
    /// An operator aborted it (admin API).
    Operator,
    /// Its own client asked (gRPC `Abort`).
    Client,
}

#[derive(Debug)]
struct Live {
    info: PairInfo,
    cancel: CancellationToken,
    reason: Arc<AtomicU8>,
}

/// All live pairs, keyed by id.
#[derive(Debug, Default)]
pub struct PairRegistry {
    live: DashMap<PairId, Live>,
    /// Abort calls still on their way to workers (pairs already gone from `live`): a drain waits
    /// for them, or a shutdown would cancel them and leave the halves held.
    aborts: Arc<std::sync::atomic::AtomicUsize>,
    /// Set by a drain: no failed pair is retried on a new one after it.
    draining: std::sync::atomic::AtomicBool,
}

/// Counts one pair's abort calls as in flight while alive.
#[derive(Debug)]
pub struct AbortsInFlight(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for AbortsInFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

impl PairRegistry {
    /// Counts a pair's abort calls as in flight until the guard drops.
    pub fn aborts_started(&self) -> AbortsInFlight {
        self.aborts
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        AbortsInFlight(self.aborts.clone())
    }

    /// Marks the process as draining (the one flag: admission refuses new requests, `/ready`
    /// fails, failed pairs are no longer retried).
    pub fn set_draining(&self) {
        self.draining
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Whether a drain has begun.
    pub fn is_draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Pairs whose abort calls have not all answered (or timed out) yet.
    pub fn aborts_in_flight(&self) -> usize {
        self.aborts.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Registers a pair under a fresh id that no live pair holds; the guard removes it on drop.
    pub fn register(self: &Arc<Self>, info: PairInfo) -> PairGuard {
        loop {
            let id = PairId::random();
            if let Entry::Vacant(v) = self.live.entry(id) {
                return self.guard(id, v, info);
            }
        }
    }

    /// Registers under a chosen id; `None` when that id is live (collision check, tests).
    pub fn register_as(self: &Arc<Self>, id: PairId, info: PairInfo) -> Option<PairGuard> {
        match self.live.entry(id) {
            Entry::Vacant(v) => Some(self.guard(id, v, info)),
            Entry::Occupied(_) => None,
        }
    }

    fn guard(
        self: &Arc<Self>,
        id: PairId,
        slot: dashmap::mapref::entry::VacantEntry<'_, PairId, Live>,
        info: PairInfo,
    ) -> PairGuard {
        let cancel = CancellationToken::new();
        let reason = Arc::new(AtomicU8::new(0));
        slot.insert(Live {
            info,
            cancel: cancel.clone(),
            reason: reason.clone(),
        });
        PairGuard {
            id,
            registry: self.clone(),
            cancel,
            reason,
        }
    }

    /// Tells one live pair to abort (both halves, by its own task). False when not live.
    pub fn cancel(&self, id: PairId, why: CancelReason) -> bool {
        match self.live.get(&id) {
            Some(e) => {
                Self::fire(&e, why);
                true
            }
            None => false,
        }
    }

    /// Tells every live pair in a state `which` accepts to abort; returns how many.
    pub fn cancel_where(&self, which: impl Fn(PairState) -> bool, why: CancelReason) -> usize {
        let mut n = 0;
        for e in self.live.iter() {
            if which(e.info.state) && !e.cancel.is_cancelled() {
                Self::fire(&e, why);
                n += 1;
            }
        }
        n
    }

    fn fire(e: &Live, why: CancelReason) {
        let code = match why {
            CancelReason::Shutdown => 1,
            CancelReason::Operator => 2,
            CancelReason::Client => 3,
        };
        let _ = e
            .reason
            .compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire);
        e.cancel.cancel();
    }

    /// Snapshots of every live pair.
    pub fn snapshot(&self) -> Vec<(PairId, PairInfo)> {
        self.live
            .iter()
            .map(|e| (*e.key(), e.info.clone()))
            .collect()
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
        self.live.get(&id).map(|e| e.info.clone())
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
    cancel: CancellationToken,
    reason: Arc<AtomicU8>,
}

impl PairGuard {
    /// The pair's id.
    pub fn id(&self) -> PairId {
        self.id
    }
    /// Moves the pair to `state`.
    pub fn set_state(&self, state: PairState) {
        if let Some(mut e) = self.registry.live.get_mut(&self.id) {
            e.info.state = state;
        }
    }
    /// Resolves when the pair is told to abort from outside; gives the reason.
    pub async fn cancelled(&self) -> CancelReason {
        self.cancel.cancelled().await;
        match self.reason.load(Ordering::Acquire) {
            2 => CancelReason::Operator,
            3 => CancelReason::Client,
            _ => CancelReason::Shutdown,
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
            tenant: None,
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

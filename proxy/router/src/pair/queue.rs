//! Fair queueing when the workers are full (`models[].queue`): instead of 503 the moment every
//! worker of a side is at `max_pairs_per_worker`, a request waits in its model's queue for a
//! slot, up to `queue.max_wait_ms` (then 503 `workers_busy` with `Retry-After`). The queue is
//! ordered by strict priority bands (`tenants[].priority`, higher first, like GIE's
//! InferenceObjective priority), and within a band by weighted fair queueing across tenants
//! (`tenants[].weight`): each entry's tag is its tenant's previous tag, or the queue's virtual
//! time when that is later, plus `1 / weight`, so a tenant with many requests waiting is served
//! at its share, never ahead of a lighter tenant's first request. A tenant may have at most
//! `queue.max_per_tenant` requests waiting. The head of the queue tries for a slot first; it is
//! woken when a slot frees (the pools' `freed` notifications) or every few milliseconds. A
//! request behind it tries only once every request ahead of it has tried and found no slot since
//! the last slot freed ([`Ticket::may_try`]): a head that cannot use the free slots (pinned to a
//! saturated prefill, in a sidecar) does not block requests that can, and a freed slot still goes
//! to the first in order that can take it. A request arriving while others wait takes its place
//! behind them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The queue of one model.
#[derive(Debug, Default)]
pub struct FairQueue {
    inner: Mutex<Inner>,
    /// Told when a request found no slot: the one behind it may try.
    turn: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct Inner {
    /// The tag of the entry served last.
    virtual_time: f64,
    /// Each tenant's latest tag.
    last_tag: HashMap<Arc<str>, f64>,
    waiting: Vec<Entry>,
    next_id: u64,
    /// Counts the slots seen freed: a request stuck in an earlier round may take a new slot.
    round: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    id: u64,
    priority: i32,
    tag: f64,
    tenant: Arc<str>,
    /// The round in which it last tried and found no slot.
    stuck_in: Option<u64>,
}

/// A place in the queue; leaving it (dropping the ticket) lets the next one be the head.
#[derive(Debug)]
pub struct Ticket<'a> {
    queue: &'a FairQueue,
    id: u64,
}

impl FairQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether anyone is waiting.
    pub fn has_waiters(&self) -> bool {
        !self.lock().waiting.is_empty()
    }

    /// Requests waiting, by tenant.
    pub fn depth(&self) -> HashMap<Arc<str>, usize> {
        let mut out = HashMap::new();
        for e in &self.lock().waiting {
            *out.entry(e.tenant.clone()).or_default() += 1;
        }
        out
    }

    /// A place for a request of `tenant` (`weight` ≥ 1, `priority`); `None` when the tenant
    /// already has `max_per_tenant` waiting.
    pub fn join(
        &self,
        tenant: &Arc<str>,
        weight: u32,
        priority: i32,
        max_per_tenant: usize,
    ) -> Option<Ticket<'_>> {
        let mut q = self.lock();
        let mine = q.waiting.iter().filter(|e| e.tenant == *tenant).count();
        if mine >= max_per_tenant {
            return None;
        }
        let start = q
            .last_tag
            .get(tenant)
            .copied()
            .unwrap_or(0.0)
            .max(q.virtual_time);
        let tag = start + 1.0 / f64::from(weight.max(1));
        q.last_tag.insert(tenant.clone(), tag);
        q.next_id += 1;
        let id = q.next_id;
        q.waiting.push(Entry {
            id,
            priority,
            tag,
            tenant: tenant.clone(),
            stuck_in: None,
        });
        Some(Ticket { queue: self, id })
    }

    /// The order entries are served in: the highest priority, then the smallest tag, then the
    /// oldest (`Less`: `a` first).
    fn order(a: &Entry, b: &Entry) -> std::cmp::Ordering {
        b.priority
            .cmp(&a.priority)
            .then(a.tag.total_cmp(&b.tag))
            .then(a.id.cmp(&b.id))
    }

    /// The entry served next.
    fn head(q: &Inner) -> Option<u64> {
        q.waiting
            .iter()
            .min_by(|a, b| Self::order(a, b))
            .map(|e| e.id)
    }

    /// A slot freed: every request may try again, in order.
    pub fn slot_freed(&self) {
        self.lock().round += 1;
    }

    /// Told when a request ahead found no slot (see [`Ticket::may_try`]).
    pub fn turn(&self) -> &tokio::sync::Notify {
        &self.turn
    }
}

impl Ticket<'_> {
    /// Whether this request is at the head of the queue.
    pub fn is_head(&self) -> bool {
        FairQueue::head(&self.queue.lock()) == Some(self.id)
    }

    /// Whether this request may try for a slot now: every request ahead of it tried and found
    /// none since the last slot freed (the head always may).
    pub fn may_try(&self) -> bool {
        let q = self.queue.lock();
        let Some(me) = q.waiting.iter().find(|e| e.id == self.id) else {
            return false;
        };
        q.waiting
            .iter()
            .filter(|e| FairQueue::order(e, me).is_lt())
            .all(|e| e.stuck_in == Some(q.round))
    }

    /// It tried and found no slot this round: the requests behind it may try (they are told).
    pub fn found_none(&self) {
        let mut q = self.queue.lock();
        let round = q.round;
        if let Some(e) = q.waiting.iter_mut().find(|e| e.id == self.id) {
            e.stuck_in = Some(round);
        }
        drop(q);
        self.queue.turn.notify_waiters();
    }

    /// It got its slot: the queue's virtual time moves to its tag.
    pub fn served(&self) {
        let mut q = self.queue.lock();
        if let Some(e) = q.waiting.iter().find(|e| e.id == self.id) {
            q.virtual_time = q.virtual_time.max(e.tag);
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut q = self.queue.lock();
        q.waiting.retain(|e| e.id != self.id);
        if q.waiting.is_empty() {
            // Nobody waits: tags start afresh (a tenant idle for long gets no credit either way).
            q.last_tag.clear();
        }
        drop(q);
        // One that waited on this one's turn may try now.
        self.queue.turn.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> Arc<str> {
        s.into()
    }

    /// Serves the queue's head until it is empty, returning the tenants in order.
    fn drain(q: &FairQueue, mut tickets: Vec<(Arc<str>, Ticket<'_>)>) -> Vec<String> {
        let mut order = Vec::new();
        while !tickets.is_empty() {
            let i = tickets
                .iter()
                .position(|(_, t)| t.is_head())
                .expect("a head");
            let (who, t) = tickets.remove(i);
            t.served();
            drop(t);
            order.push(who.to_string());
        }
        assert!(!q.has_waiters());
        order
    }

    #[test]
    fn a_heavy_tenant_cannot_starve_a_light_one_and_weights_set_the_share() {
        let q = FairQueue::default();
        let (heavy, light) = (name("heavy"), name("light"));
        let mut t = Vec::new();
        for _ in 0..6 {
            t.push((heavy.clone(), q.join(&heavy, 1, 0, 16).expect("room")));
        }
        for _ in 0..2 {
            t.push((light.clone(), q.join(&light, 1, 0, 16).expect("room")));
        }
        let order = drain(&q, t);
        // The light tenant's two come second and fourth, not after all six heavy ones.
        let light_at: Vec<usize> = order
            .iter()
            .enumerate()
            .filter(|(_, w)| *w == "light")
            .map(|(i, _)| i)
            .collect();
        assert_eq!(light_at, [1, 3], "{order:?}");
        // Weight 2 gets two turns for one.
        let (a, b) = (name("a"), name("b"));
        let mut t = Vec::new();
        for _ in 0..4 {
            t.push((a.clone(), q.join(&a, 2, 0, 16).expect("room")));
            t.push((b.clone(), q.join(&b, 1, 0, 16).expect("room")));
        }
        let order = drain(&q, t);
        assert_eq!(
            &order[..3].iter().filter(|w| *w == "a").count(),
            &2,
            "{order:?}"
        );
    }

    #[test]
    fn priority_bands_are_strict_and_each_tenant_has_a_bound() {
        let q = FairQueue::default();
        let (low, high) = (name("low"), name("high"));
        let t = vec![
            (low.clone(), q.join(&low, 1, 0, 2).expect("room")),
            (low.clone(), q.join(&low, 1, 0, 2).expect("room")),
            (high.clone(), q.join(&high, 1, 5, 2).expect("room")),
        ];
        assert!(q.join(&low, 1, 0, 2).is_none(), "the tenant's bound");
        assert_eq!(q.depth()[&low], 2);
        assert_eq!(drain(&q, t), ["high", "low", "low"]);
    }

    /// The head blocks no one: a request behind a head that found no slot may try, and a slot
    /// freed goes back to the head first.
    #[test]
    fn a_head_that_finds_no_slot_lets_the_next_try() {
        let q = FairQueue::default();
        let (a, b, c) = (name("a"), name("b"), name("c"));
        let first = q.join(&a, 1, 0, 4).expect("room");
        let second = q.join(&b, 1, 0, 4).expect("room");
        let third = q.join(&c, 1, 0, 4).expect("room");
        assert!(first.may_try() && first.is_head());
        assert!(!second.may_try(), "the head has not tried yet");
        first.found_none();
        assert!(second.may_try(), "the head found none: the next may try");
        assert!(!third.may_try(), "the second has not tried yet");
        second.found_none();
        assert!(third.may_try());
        // A slot frees: the head tries first again.
        q.slot_freed();
        assert!(first.may_try());
        assert!(!second.may_try() && !third.may_try());
        // The head leaves: the second is head and may try.
        drop(first);
        assert!(second.is_head() && second.may_try());
    }
}

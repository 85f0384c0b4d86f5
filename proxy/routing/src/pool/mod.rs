//! Worker pools (each worker an [`Upstream`]): selection policies, RAII load guards, members
//! that join and leave at run time (their checks: the `members` module, a layer up).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use arc_swap::ArcSwap;
use rand::Rng;

mod endpoint;
mod kv_events;
mod kv_feed;
mod label;
mod pair_pick;
mod prefix;
mod source;
mod upstream;

pub use endpoint::{Endpoint, Origin};
pub use kv_events::{KvEvent, decode_batch};
pub use kv_feed::EventStats;
pub use source::{MemberChange, MemberFeed, WorkerSource};
pub use upstream::{LoadGuard, Upstream};

pub use label::worker_label;
pub use pair_pick::{PairPick, PrefillChoice, PrefillPin, host_port, pick_pair, pick_within};
#[cfg(test)]
use prefix::Blocks;
use prefix::PrefixIndex;

use lockstep_core::config::{PolicyKind, PoolConfig, WorkerConfig};

/// What the prefix-aware policy routes on: the prompt's token ids and its tenant's salt.
#[derive(Debug, Clone, Copy)]
pub struct RouteKey<'a> {
    /// The prompt.
    pub tokens: &'a [u32],
    /// The tenant's prefix-cache salt ([`lockstep_tenancy::tenant::cache_salt`]).
    pub salt: u64,
}

/// The workers of one side of a model, with their selection policy. Its members can change at
/// run time ([`WorkerPool::join`], [`WorkerPool::leave`]): a pick sees one membership, whole.
#[derive(Debug)]
pub struct WorkerPool {
    workers: ArcSwap<Vec<Arc<Upstream>>>,
    policy: PolicyKind,
    max_pairs: usize,
    next: AtomicUsize,
    prefix: PrefixIndex,
    /// The next member's ordinal.
    ordinals: AtomicUsize,
    /// The credentials every member is called with (the pool's `api_key`, `admin_api_key`).
    auth: (Option<http::HeaderValue>, Option<http::HeaderValue>),
    /// The bootstrap port of a member whose entry names none (the pool's `bootstrap_port`).
    bootstrap_port: Option<u16>,
    /// Told when a member's slot frees.
    freed: Arc<tokio::sync::Notify>,
    /// What the workers' engines report holding (`prefix_events`; `None` for other policies).
    events: Option<kv_feed::EventIndex>,
    /// The topic subscribed to, and where a member's publisher is when its entry names none.
    events_topic: String,
    /// What a KV event publisher may make the pool's readers hold.
    events_limits: lockstep_zmtp::Limits,
    /// Each worker's data-parallel ranks, each publishing on its own ports.
    events_ranks: u16,
    events_ports: (Option<u16>, Option<u16>),
}

impl WorkerPool {
    /// Carries over, from the pool of the configuration this one replaces, each same-URL
    /// worker's pair count (shared: pairs started before the reload still count against
    /// `max_pairs_per_worker`, and give their slot back when they end) and health. Called
    /// before the pool is shared.
    pub fn carry_from(&mut self, old: &WorkerPool) {
        let old_members = old.workers();
        let taken = self.workers.swap(Arc::new(Vec::new()));
        let mut list = Arc::try_unwrap(taken).unwrap_or_else(|shared| (*shared).clone());
        for w in &mut list {
            if let (Some(o), Some(w)) =
                (old_members.iter().find(|o| o.url == w.url), Arc::get_mut(w))
            {
                w.in_flight = o.in_flight.clone();
                w.healthy
                    .store(o.healthy.load(Ordering::Acquire), Ordering::Release);
            }
            // What the prefix policy predicted this worker holds, by its URL; what its engine
            // reported (the new pool's subscription goes on from the same sequence number).
            if let Some(b) = old.prefix.workers.get(&w.url) {
                self.prefix.workers.insert(w.url.clone(), b.clone());
            }
            if let (Some(new), Some(old)) = (&self.events, &old.events) {
                for r in 0..self.events_ranks {
                    if let Some((key, b)) = old.workers.remove(&kv_feed::rank_key(&w.url, r)) {
                        new.workers.insert(key, b);
                    }
                }
            }
        }
        self.workers = ArcSwap::from_pointee(list);
    }

    /// A pool from configuration.
    pub fn new(cfg: &PoolConfig) -> WorkerPool {
        let auth = (cfg.auth(), cfg.admin_auth());
        let freed = Arc::new(tokio::sync::Notify::new());
        let events = cfg.kv_events.clone().unwrap_or_default();
        let ports = (events.port, events.replay_port);
        WorkerPool {
            events: (cfg.policy == PolicyKind::PrefixEvents).then(kv_feed::EventIndex::default),
            events_topic: events.topic,
            events_limits: lockstep_zmtp::Limits {
                max_message: events.max_message_bytes,
                ..lockstep_zmtp::Limits::default()
            },
            events_ports: ports,
            events_ranks: events.dp_size.max(1),
            workers: ArcSwap::from_pointee(
                cfg.workers
                    .iter()
                    .enumerate()
                    .map(|(i, w)| {
                        Arc::new(Self::member(&auth, cfg.bootstrap_port, &freed, w, i, ports))
                    })
                    .collect(),
            ),
            policy: cfg.policy,
            max_pairs: cfg.max_pairs_per_worker,
            next: AtomicUsize::new(0),
            prefix: PrefixIndex {
                cfg: cfg.prefix,
                ..PrefixIndex::default()
            },
            ordinals: AtomicUsize::new(cfg.workers.len()),
            auth,
            bootstrap_port: cfg.bootstrap_port,
            freed,
        }
    }

    fn member(
        auth: &(Option<http::HeaderValue>, Option<http::HeaderValue>),
        bootstrap_port: Option<u16>,
        freed: &Arc<tokio::sync::Notify>,
        w: &WorkerConfig,
        ordinal: usize,
        (port, replay_port): (Option<u16>, Option<u16>),
    ) -> Upstream {
        let u = Upstream::new(w);
        let at = |p: Option<u16>| p.map(|p| format!("tcp://{}:{p}", u.host));
        Upstream {
            kv_events: u.kv_events.clone().or_else(|| at(port)),
            kv_events_replay: u.kv_events_replay.clone().or_else(|| at(replay_port)),
            freed: freed.clone(),
            auth: auth.0.clone(),
            admin_auth: auth.1.clone(),
            ordinal,
            bootstrap_port: u.bootstrap_port.or(bootstrap_port),
            ..u
        }
    }

    /// Adds a worker at run time (a pod that appeared). It is not verified: it gets no pairs
    /// until its backend's check passes for it together with the verified members
    /// (`backend::probe::fold_member`). `None` when its URL is already a member.
    pub fn join(&self, cfg: &WorkerConfig) -> Option<Arc<Upstream>> {
        self.join_carrying(cfg, None)
    }

    /// Joins the workers that joined `old` at run time and are still members (unless the
    /// configuration now lists them), each with its pair count and health: a reload keeps them,
    /// checked again with the new set before they take pairs.
    pub fn carry_joined(&self, old: &WorkerPool) {
        for o in old.workers().iter().filter(|o| o.joined()) {
            self.join_carrying(&o.config(), Some(o));
        }
    }

    fn join_carrying(
        &self,
        cfg: &WorkerConfig,
        carried: Option<&Upstream>,
    ) -> Option<Arc<Upstream>> {
        let url = cfg.url.trim_end_matches('/');
        let mut added = None;
        self.workers.rcu(|list| {
            added = None;
            if list.iter().any(|w| w.url == url) {
                return list.clone();
            }
            let ordinal = self.ordinals.fetch_add(1, Ordering::Relaxed);
            let mut w = Self::member(
                &self.auth,
                self.bootstrap_port,
                &self.freed,
                cfg,
                ordinal,
                self.events_ports,
            );
            if let Some(c) = carried {
                w.in_flight = c.in_flight.clone();
                w.healthy = AtomicBool::new(c.healthy.load(Ordering::Acquire));
                w.named = AtomicBool::new(c.named());
            }
            w.verified = AtomicBool::new(false);
            w.joined = AtomicBool::new(true);
            let w = Arc::new(w);
            added = Some(w.clone());
            let mut next = (**list).clone();
            next.push(w);
            Arc::new(next)
        });
        added
    }

    /// Removes the worker at `url` (a pod gone): it takes no new pairs, pairs it runs finish, and
    /// what the prefix policy predicted it holds is dropped. `None` when it is not a member.
    pub fn leave(&self, url: &str) -> Option<Arc<Upstream>> {
        let url = url.trim_end_matches('/');
        let mut gone = None;
        self.workers.rcu(|list| {
            gone = list.iter().find(|w| w.url == url).cloned();
            Arc::new(list.iter().filter(|w| w.url != url).cloned().collect())
        });
        let w = gone?;
        w.left.store(true, Ordering::Release);
        self.prefix.workers.remove(url);
        if let Some(e) = &self.events {
            for r in 0..self.events_ranks {
                e.workers.remove(&kv_feed::rank_key(url, r));
            }
        }
        Some(w)
    }

    /// Prompt tokens routed by the prefix-aware policy, and how many of them it predicted the
    /// chosen worker holds (the predicted hit rate is their ratio).
    pub fn prefix_prediction(&self) -> (u64, u64) {
        (
            self.prefix.routed_tokens.load(Ordering::Relaxed),
            self.prefix.predicted_hit_tokens.load(Ordering::Relaxed),
        )
    }

    /// The prefix-aware choice among `candidates` (two or more): the worker predicted to hold the
    /// longest prefix of the prompt (ties: the less loaded), unless load is out of balance or no
    /// worker holds enough of it; then the least-loaded (ties: the one predicted to hold least).
    /// Records the prompt's blocks as now held by the chosen worker.
    fn pick_prefix<'w>(
        &self,
        candidates: &[&'w Arc<Upstream>],
        key: &RouteKey,
    ) -> &'w Arc<Upstream> {
        let cfg = &self.prefix.cfg;
        let hashes = lockstep_engine::pool::block_hashes(key.tokens, cfg.block_tokens, key.salt);
        let stats: Vec<(usize, usize, usize)> = candidates
            .iter()
            .map(|w| {
                let (matched, size) = self
                    .prefix
                    .workers
                    .get(&w.url)
                    .map(|b| (b.matched(&hashes), b.by_hash.len()))
                    .unwrap_or((0, 0));
                (w.in_flight(), matched, size)
            })
            .collect();
        let chosen = prefix::choose(&stats, hashes.len(), cfg);
        let w = candidates[chosen];
        self.prefix
            .workers
            .entry(w.url.clone())
            .or_default()
            .insert(&hashes, &self.prefix.tick, cfg.capacity_blocks);
        let block = cfg.block_tokens as u64;
        self.prefix
            .routed_tokens
            .fetch_add(key.tokens.len() as u64, Ordering::Relaxed);
        self.prefix
            .predicted_hit_tokens
            .fetch_add(stats[chosen].1 as u64 * block, Ordering::Relaxed);
        w
    }

    /// The members now (one membership, whole; later joins and leaves do not change it).
    pub fn workers(&self) -> Arc<Vec<Arc<Upstream>>> {
        self.workers.load_full()
    }

    /// Told when a member's slot frees (requests waiting for one listen).
    pub fn freed(&self) -> &Arc<tokio::sync::Notify> {
        &self.freed
    }

    /// The member at `url`, if it is one.
    pub fn member_at(&self, url: &str) -> Option<Arc<Upstream>> {
        self.workers.load().iter().find(|w| w.url == url).cloned()
    }

    /// Whether at least one worker takes new pairs (healthy, not draining).
    pub fn any_healthy(&self) -> bool {
        self.workers.load().iter().any(|w| w.accepts_pairs())
    }

    /// Whether workers would take pairs but every one is at `max_pairs_per_worker`.
    pub fn all_busy(&self) -> bool {
        let workers = self.workers.load();
        self.max_pairs > 0
            && workers.iter().any(|w| w.accepts_pairs())
            && workers
                .iter()
                .filter(|w| w.accepts_pairs())
                .all(|w| w.in_flight() >= self.max_pairs)
    }

    /// Picks a healthy worker with a free slot (avoiding `avoid` when another one exists) and
    /// takes the slot. `key` is what the prefix-aware policy routes on (other policies ignore it).
    pub fn pick(&self, avoid: Option<&Arc<Upstream>>, key: Option<&RouteKey>) -> Option<LoadGuard> {
        let max = self.max_pairs;
        let open = |w: &Arc<Upstream>| w.accepts_pairs() && (max == 0 || w.in_flight() < max);
        let workers = self.workers.load();
        // Fast path: one worker, no allocation.
        if let [only] = workers.as_slice() {
            return if only.accepts_pairs() {
                LoadGuard::try_new(only.clone(), max)
            } else {
                None
            };
        }
        let healthy: Vec<&Arc<Upstream>> = workers.iter().filter(|w| open(w)).collect();
        let candidates: Vec<&Arc<Upstream>> = match avoid {
            Some(a) if healthy.len() > 1 => healthy
                .iter()
                .copied()
                .filter(|w| !Arc::ptr_eq(w, a))
                .collect(),
            _ => healthy,
        };
        let chosen = match candidates.len() {
            0 => return None,
            1 => candidates[0],
            n => match self.policy {
                PolicyKind::RoundRobin => candidates[self.next.fetch_add(1, Ordering::Relaxed) % n],
                PolicyKind::LeastLoad => {
                    let mut rng = rand::rng();
                    let a = rng.random_range(0..n);
                    let mut b = rng.random_range(0..n - 1);
                    if b >= a {
                        b += 1;
                    }
                    let (wa, wb) = (candidates[a], candidates[b]);
                    if wb.in_flight() < wa.in_flight() {
                        wb
                    } else {
                        wa
                    }
                }
                PolicyKind::PrefixAware | PolicyKind::PrefixEvents => match key {
                    Some(k) if self.events.is_some() => self.pick_reported(&candidates, k),
                    Some(k) => self.pick_prefix(&candidates, k),
                    None => candidates[self.next.fetch_add(1, Ordering::Relaxed) % n],
                },
            },
        };
        LoadGuard::try_new(chosen.clone(), max)
    }
}

#[cfg(test)]
mod tests;

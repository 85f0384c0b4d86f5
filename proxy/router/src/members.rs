//! A model's workers at run time: one task per model follows its source of membership changes
//! ([`lockstep_routing::pool::WorkerSource`]), and one task per member checks that member:
//! - a member not verified (it did not answer the deployment check, or it joined at run time)
//!   is probed ([`crate::backend::check::probe_member`]), then checked together with the
//!   verified members ([`crate::backend::check::fold_member`]), first half a second after it
//!   appears and then backing off to every health interval, until it passes; until then it gets
//!   no pairs, and when it passes the model's limits tighten to the set's. Probes run
//!   concurrently (at most [`CONCURRENT_PROBES`] a model), so one slow or silent address holds
//!   up no other member; the fold that follows runs under the verified set's lock, so no two
//!   members pass without being checked together;
//! - a prefill named by a request (`lockstep sidecar`) never changes the model's limits: it is
//!   refused unless it accepts every prompt the model admits (its prompt limit at least the
//!   configured `max_prompt_tokens`, else the verified members'), and its own limit is kept on
//!   it;
//! - every member's health: the backend's probe (`GET /health`, or the worker service's `Health`
//!   for lockstep workers), unhealthy after `failure_threshold` failures in a row, healthy again
//!   after `success_threshold` successes;
//! - a member that leaves takes no new pairs (those it runs finish), its checks stop, its backend
//!   forgets what it kept for it ([`PdBackend::forget`]).
//!
//! Dropping the model (a reload, shutdown) aborts the model's task and with it every member's.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::task::{AbortHandle, JoinSet};

use crate::backend::check::{Probed, fold_member, probe_member};
use crate::backend::{PdBackend, UpstreamClient};
use crate::state::WorkerLimits;
use lockstep_core::config::{ModelConfig, WorkerConfig};
use lockstep_core::ids::Side;
use lockstep_routing::pool::{MemberChange, Upstream, WorkerPool, WorkerSource};

/// What a model's member tasks share.
pub(crate) struct Members {
    /// The model's configuration (health settings, the deployment check's limits).
    pub model: ModelConfig,
    /// Its backend: the probes, the health checks, what it forgets.
    pub backend: Arc<dyn PdBackend>,
    /// The upstream client health checks go through.
    pub client: UpstreamClient,
    /// The limits admission applies; they tighten as workers pass their check.
    pub limits: Arc<WorkerLimits>,
    /// The prefill pool.
    pub prefill: Arc<WorkerPool>,
    /// The decode pool.
    pub decode: Arc<WorkerPool>,
    /// The verified members with what each reported: a worker checked later is checked with
    /// them.
    pub verified: Mutex<Vec<Probed>>,
    /// Bounds the probes of members in flight at once ([`CONCURRENT_PROBES`]).
    pub probing: tokio::sync::Semaphore,
}

/// Most deployment probes of one model's members in flight at once.
pub(crate) const CONCURRENT_PROBES: usize = 32;

/// The first re-check of a member that is not verified, ms; it doubles up to the health interval.
const FIRST_RECHECK_MS: u64 = 500;

impl Members {
    fn pool(&self, side: Side) -> &Arc<WorkerPool> {
        match side {
            Side::Prefill => &self.prefill,
            Side::Decode => &self.decode,
        }
    }

    /// Checks every member, then applies each change `source` sends, for as long as the model
    /// serves (the caller aborts the task).
    pub async fn run(self: Arc<Self>, mut source: WorkerSource) {
        let mut tasks = JoinSet::new();
        let mut handles: HashMap<(Side, String), AbortHandle> = HashMap::new();
        for side in [Side::Prefill, Side::Decode] {
            for w in self.pool(side).workers().iter() {
                let h = tasks.spawn(self.clone().watch(side, w.clone()));
                handles.insert((side, w.url.clone()), h);
            }
        }
        // The members the latest `Replace` of each side listed: a discovery source's. Members
        // joined one by one (the admin API, a sidecar's named prefill) are not its to remove.
        let mut listed: HashSet<(Side, String)> = HashSet::new();
        let mut open = true;
        loop {
            tokio::select! {
                change = source.next(), if open => match change {
                    Some(c) => self.apply(c, &mut tasks, &mut handles, &mut listed),
                    // No more changes: the members stay checked.
                    None => open = false,
                },
                // Reaps member tasks that ended (aborted when their member left).
                Some(_) = tasks.join_next() => {}
                else => std::future::pending::<()>().await,
            }
        }
    }

    fn apply(
        self: &Arc<Self>,
        change: MemberChange,
        tasks: &mut JoinSet<()>,
        handles: &mut HashMap<(Side, String), AbortHandle>,
        listed: &mut HashSet<(Side, String)>,
    ) {
        let name = &self.model.name;
        match change {
            MemberChange::Join { side, worker } => match self.pool(side).join(&worker) {
                Some(w) => {
                    tracing::info!(model = %name, side = side.as_str(), worker = %w.url, "worker joined: it gets pairs once it passes the deployment check");
                    let h = tasks.spawn(self.clone().watch(side, w.clone()));
                    handles.insert((side, w.url.clone()), h);
                }
                None => {
                    tracing::debug!(model = %name, side = side.as_str(), worker = %worker.url, "worker already a member")
                }
            },
            MemberChange::Named { worker } => match self.prefill.join(&worker) {
                Some(w) => {
                    // Marked before its checks start: its first check already knows.
                    w.set_named(true);
                    tracing::info!(model = %name, worker = %w.url, "prefill named by a request joined: it gets pairs once it passes the deployment check");
                    let h = tasks.spawn(self.clone().watch(Side::Prefill, w.clone()));
                    handles.insert((Side::Prefill, w.url.clone()), h);
                }
                None => {
                    tracing::debug!(model = %name, worker = %worker.url, "named prefill already a member")
                }
            },
            MemberChange::Leave { side, url } => {
                listed.remove(&(side, url.trim_end_matches('/').to_string()));
                self.leave(side, &url, handles);
            }
            MemberChange::Replace { side, workers } => {
                let want: HashMap<String, WorkerConfig> = workers
                    .into_iter()
                    .map(|w| (w.url.trim_end_matches('/').to_string(), w))
                    .collect();
                let mine = |url: &str| listed.contains(&(side, url.to_string()));
                for w in self.pool(side).workers().iter().filter(|w| w.joined()) {
                    let keep = want
                        .get(&w.url)
                        .is_some_and(|c| c.bootstrap_port == w.bootstrap_port);
                    if !keep && (mine(&w.url) || want.contains_key(&w.url)) {
                        self.leave(side, &w.url, handles);
                    }
                }
                listed.retain(|(s, _)| *s != side);
                listed.extend(want.keys().map(|u| (side, u.clone())));
                for worker in want.into_values() {
                    self.apply(MemberChange::Join { side, worker }, tasks, handles, listed);
                }
            }
        }
    }

    fn leave(&self, side: Side, url: &str, handles: &mut HashMap<(Side, String), AbortHandle>) {
        let Some(w) = self.pool(side).leave(url) else {
            tracing::debug!(model = %self.model.name, side = side.as_str(), worker = %url, "worker not a member");
            return;
        };
        if let Some(h) = handles.remove(&(side, w.url.clone())) {
            h.abort();
        }
        self.gone(side, &w);
    }

    /// What a worker that left takes with it: its place in the verified set (its metric series
    /// go at the next scrape, which writes the members of the moment), and (when no pool of the model still has it) what the backend kept for its URL.
    fn gone(&self, side: Side, w: &Upstream) {
        let other = match side {
            Side::Prefill => &self.decode,
            Side::Decode => &self.prefill,
        };
        let still_member = other.member_at(&w.url).is_some();
        if !still_member {
            self.backend.forget(&w.url);
        }
        let mut verified = self.verified.lock().unwrap_or_else(|p| p.into_inner());
        verified.retain(|p| !(p.url == w.url && p.side == side));
        drop(verified);
        tracing::info!(model = %self.model.name, side = side.as_str(), worker = %w.url, in_flight = w.in_flight(), "worker left: no new pairs; those it runs finish");
    }

    /// One member's checks, every health interval, until it leaves (and its KV events).
    async fn watch(self: Arc<Self>, side: Side, w: Arc<Upstream>) {
        // Its KV events, where the pool routes on them, for as long as it is checked.
        let events = self.pool(side).clone().follow_events(w.clone());
        tokio::select! {
            () = self.check(side, &w) => {}
            () = events => {}
        }
    }

    async fn check(&self, side: Side, w: &Arc<Upstream>) {
        let cfg = &self.model.health;
        let interval = Duration::from_millis(cfg.interval_ms);
        // A member not verified is checked again soon (workers that come up after lockstep, the
        // usual order on Kubernetes), then less often.
        let mut recheck = Duration::from_millis(FIRST_RECHECK_MS).min(interval);
        let mut first = true;
        loop {
            if !first {
                let wait = if w.is_verified() {
                    interval
                } else {
                    let r = recheck;
                    recheck = (recheck * 2).min(interval);
                    r
                };
                tokio::time::sleep(wait).await;
            }
            first = false;
            if w.has_left() {
                return;
            }
            if !w.is_verified() {
                self.verify(side, w).await;
            }
            let ok = self
                .backend
                .health(&self.client, &w.url, Duration::from_millis(cfg.timeout_ms))
                .await;
            w.record_health(ok, cfg);
        }
    }

    /// Checks a member not verified together with the verified ones; on a pass it takes pairs
    /// and the model's limits tighten to the set's (a named prefill's never do).
    async fn verify(&self, side: Side, w: &Upstream) {
        let name = &self.model.name;
        let probed = {
            let Ok(_slot) = self.probing.acquire().await else {
                return;
            };
            probe_member(&*self.backend, &self.model, side, &w.config()).await
        };
        // Folded and recorded under the verified set's lock: each member that passes was checked
        // with every other one that passed.
        let outcome = probed.and_then(|me| {
            let mut verified = self.verified.lock().unwrap_or_else(|p| p.into_inner());
            let d = fold_member(&self.model, &me, &verified)?;
            if w.named() {
                self.named_floor(&me)?;
            }
            if w.has_left() {
                return Ok(None);
            }
            verified.retain(|p| !(p.url == me.url && p.side == side));
            let own = me.report.max_prompt_tokens;
            verified.push(me);
            Ok(Some((d, own)))
        });
        match outcome {
            Ok(None) => {}
            Ok(Some((d, own))) => {
                if w.named() {
                    // What a request's prefill reports limits only the pairs pinned to it.
                    w.set_own_prompt_limit(own);
                } else {
                    // Limits only tighten: admission stays within every verified worker's.
                    self.limits.tighten(&d);
                }
                w.checked(Ok(()));
                tracing::info!(model = %name, worker = %w.url, named = w.named(), kv_capacity = d.kv_capacity, prompt_limit = ?d.max_prompt_tokens, "worker verified: it takes pairs");
            }
            Err(e) => {
                tracing::warn!(model = %name, worker = %w.url, error = %e, "worker not verified: it gets no pairs");
                w.checked(Err(e));
            }
        }
    }

    /// A named prefill must accept every prompt the model admits: a prompt limit under the
    /// configured `max_prompt_tokens` (else under what the verified members established) is
    /// refused, so one request's prefill cannot lower what any other request gets.
    fn named_floor(&self, me: &Probed) -> Result<(), String> {
        let Some(limit) = me.report.max_prompt_tokens else {
            return Ok(());
        };
        let floor = match self.model.max_prompt_tokens {
            0 => self.limits.prompt_limit(),
            n => Some(n),
        };
        match floor {
            Some(f) if limit < f => Err(format!(
                "it reports a prompt limit of {limit} tokens, under the {f} this model admits: a prefill named by a request may not lower the model's limits"
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::check::{ProbeError, WorkerReport};
    use crate::backend::{
        DecodeStream, Deployment, Dispatch, HalfError, PrefillReport, UpstreamClient,
    };
    use futures_util::future::BoxFuture;
    use lockstep_core::config::PoolConfig;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Records what the member tasks ask of a backend; a worker on port 9 never passes its check.
    #[derive(Default)]
    struct Recorder {
        forgotten: Mutex<Vec<String>>,
        health: Mutex<Vec<String>>,
        probes: AtomicUsize,
        /// Every probe fails while set (a worker not up yet).
        down: std::sync::atomic::AtomicBool,
    }

    impl PdBackend for Arc<Recorder> {
        fn prefill(&self, _: &Dispatch) -> BoxFuture<'static, Result<PrefillReport, HalfError>> {
            unreachable!("no pairs here")
        }
        fn decode(&self, _: &Dispatch) -> DecodeStream {
            unreachable!("no pairs here")
        }
        fn abort(&self, _: &Dispatch, _: Side) -> BoxFuture<'static, Result<(), HalfError>> {
            unreachable!("no pairs here")
        }
        fn forget(&self, url: &str) {
            self.forgotten.lock().expect("lock").push(url.into());
        }
        fn probe_worker<'a>(
            &'a self,
            _: &'a ModelConfig,
            _: Side,
            w: &'a WorkerConfig,
        ) -> BoxFuture<'a, Result<WorkerReport, ProbeError>> {
            self.probes.fetch_add(1, Ordering::Relaxed);
            let refused = w.url.ends_with(":9") || self.down.load(Ordering::Relaxed);
            Box::pin(async move {
                if refused {
                    Err(ProbeError::Unreachable("down".into()))
                } else {
                    Ok(WorkerReport {
                        kv_tokens: Some(3000),
                        ..WorkerReport::default()
                    })
                }
            })
        }
        fn health(&self, _: &UpstreamClient, url: &str, _: Duration) -> BoxFuture<'static, bool> {
            self.health.lock().expect("lock").push(url.into());
            Box::pin(std::future::ready(true))
        }
    }

    /// Waits (5 s at most) until `f` holds.
    async fn until(f: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !f() {
            assert!(std::time::Instant::now() < deadline, "timed out");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn worker(url: &str) -> WorkerConfig {
        WorkerConfig {
            url: url.into(),
            bootstrap_port: None,
            bootstrap_host: None,
            kv_events: None,
            kv_events_replay: None,
        }
    }

    fn members(rec: &Arc<Recorder>) -> Arc<Members> {
        members_checked_every(rec, 10)
    }

    fn members_checked_every(rec: &Arc<Recorder>, interval_ms: u64) -> Arc<Members> {
        let model = lockstep_core::config::test_model(
            "http://a:1",
            "http://a:1",
            &format!("[models.health]\ninterval_ms = {interval_ms}"),
        );
        let pool = |p: &PoolConfig| Arc::new(WorkerPool::new(p));
        Arc::new(Members {
            prefill: pool(&model.prefill),
            decode: pool(&model.decode),
            backend: Arc::new(rec.clone()),
            client: UpstreamClient::with_ca(Duration::from_secs(1), None).expect("client"),
            limits: Arc::new(WorkerLimits::new(&Deployment::capacity(4000))),
            verified: Mutex::new(Vec::new()),
            probing: tokio::sync::Semaphore::new(CONCURRENT_PROBES),
            model,
        })
    }

    /// A discovery source's whole list replaces only what it listed before: a member joined
    /// on its own (the admin API, a sidecar's named prefill) stays.
    #[tokio::test]
    async fn a_replace_leaves_members_joined_one_by_one_alone() {
        let rec = Arc::new(Recorder::default());
        let m = members(&rec);
        let (feed, source) = lockstep_routing::pool::MemberFeed::new();
        let task = tokio::spawn(m.clone().run(source));
        let send = |c| assert!(feed.send(c));
        let member = |url: &str| m.prefill.member_at(url).is_some();
        send(MemberChange::Join {
            side: Side::Prefill,
            worker: worker("http://named:8000"),
        });
        send(MemberChange::Replace {
            side: Side::Prefill,
            workers: vec![worker("http://pod-1:8000"), worker("http://pod-2:8000")],
        });
        until(|| member("http://pod-1:8000") && member("http://pod-2:8000")).await;
        send(MemberChange::Replace {
            side: Side::Prefill,
            workers: vec![worker("http://pod-2:8000")],
        });
        until(|| !member("http://pod-1:8000")).await;
        assert!(member("http://pod-2:8000"));
        assert!(
            member("http://named:8000"),
            "a member joined on its own was removed by a discovery list"
        );
        // The configured worker is never touched.
        assert!(member("http://a:1"));
        // A list that names a member settles its settings (a new bootstrap port: leave, join).
        let mut moved = worker("http://named:8000");
        moved.bootstrap_port = Some(9000);
        send(MemberChange::Replace {
            side: Side::Prefill,
            workers: vec![moved],
        });
        until(|| {
            m.prefill
                .member_at("http://named:8000")
                .is_some_and(|w| w.bootstrap_port == Some(9000))
        })
        .await;
        until(|| !member("http://pod-2:8000")).await;
        task.abort();
    }

    #[tokio::test]
    async fn joins_are_checked_and_a_left_worker_is_forgotten_once_no_pool_has_it() {
        let rec = Arc::new(Recorder::default());
        let m = members(&rec);
        let (feed, source) = lockstep_routing::pool::MemberFeed::new();
        let task = tokio::spawn(m.clone().run(source));
        let send = |c| assert!(feed.send(c));
        send(MemberChange::Join {
            side: Side::Decode,
            worker: worker("http://b:2"),
        });
        send(MemberChange::Join {
            side: Side::Decode,
            worker: worker("http://c:9"),
        });
        let member = |url: &str| m.decode.member_at(url);
        until(|| member("http://b:2").is_some_and(|w| w.is_verified())).await;
        // The unreachable one stays unverified, probed again and again; the limits tightened
        // to what the verified one reported.
        let probes = rec.probes.load(Ordering::Relaxed);
        until(|| rec.probes.load(Ordering::Relaxed) > probes + 2).await;
        assert!(member("http://c:9").is_some_and(|w| !w.is_verified()));
        let cap = m
            .limits
            .kv_capacity
            .load(std::sync::atomic::Ordering::Acquire);
        assert_eq!(cap, 3000);
        assert_eq!(m.verified.lock().expect("lock").len(), 1);
        // The worker in both pools leaves the decode pool only: not forgotten.
        send(MemberChange::Leave {
            side: Side::Decode,
            url: "http://a:1".into(),
        });
        send(MemberChange::Leave {
            side: Side::Decode,
            url: "http://b:2".into(),
        });
        until(|| member("http://b:2").is_none() && member("http://a:1").is_none()).await;
        assert_eq!(*rec.forgotten.lock().expect("lock"), ["http://b:2"]);
        assert!(m.verified.lock().expect("lock").is_empty());
        // A left member's health checks stop; the others' go on.
        let checks = |url: &str| {
            let h = rec.health.lock().expect("lock");
            h.iter().filter(|u| *u == url).count()
        };
        tokio::time::sleep(Duration::from_millis(30)).await;
        let (b, c) = (checks("http://b:2"), checks("http://c:9"));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(checks("http://b:2"), b, "a left member is still checked");
        assert!(checks("http://c:9") > c, "a member is no longer checked");
        task.abort();
    }

    /// A worker that comes up after lockstep (the usual order on Kubernetes) is checked again
    /// within about a second, not after a health interval.
    #[tokio::test(start_paused = true)]
    async fn a_worker_not_up_yet_is_checked_again_soon() {
        let rec = Arc::new(Recorder::default());
        rec.down.store(true, Ordering::Relaxed);
        let m = members_checked_every(&rec, 10_000);
        let (feed, source) = lockstep_routing::pool::MemberFeed::new();
        let task = tokio::spawn(m.clone().run(source));
        assert!(feed.send(MemberChange::Join {
            side: Side::Decode,
            worker: worker("http://late:2"),
        }));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let w = m.decode.member_at("http://late:2").expect("a member");
        assert!(!w.is_verified());
        rec.down.store(false, Ordering::Relaxed);
        // Checked at 0.5 s (still down then? no: up now) and passes well before 10 s.
        tokio::time::sleep(Duration::from_millis(1_600)).await;
        assert!(w.is_verified(), "not checked again within 1.7 s");
        task.abort();
    }

    /// What a prefill named by a request reports never lowers the model's limits; one that
    /// reports a prompt limit under the model's is refused.
    #[tokio::test]
    async fn a_named_prefill_never_lowers_the_models_limits() {
        let rec = Arc::new(Recorder::default());
        let m = members(&rec);
        let before = m.limits.prompt_limit();
        let (feed, source) = lockstep_routing::pool::MemberFeed::new();
        let task = tokio::spawn(m.clone().run(source));
        assert!(feed.send(MemberChange::Named {
            worker: worker("http://named:8000"),
        }));
        until(|| {
            m.prefill
                .member_at("http://named:8000")
                .is_some_and(|w| w.is_verified() && w.named())
        })
        .await;
        // It reported a capacity of 3000 under the configured 4000: kept to itself.
        let cap = m
            .limits
            .kv_capacity
            .load(std::sync::atomic::Ordering::Acquire);
        assert_eq!(cap, 4000);
        assert_eq!(m.limits.prompt_limit(), before);
        task.abort();
    }
}

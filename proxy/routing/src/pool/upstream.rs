//! One worker as the router sees it ([`Upstream`]: its address, health, load, what its checks
//! found) and the guard that holds one of its pair slots ([`LoadGuard`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use super::endpoint::{self, Endpoint, Origin};
use super::label::worker_label;
use lockstep_core::config::{HealthConfig, WorkerConfig};

/// One worker as the router sees it (an upstream): its URL, health, load and draining flag.
#[derive(Debug)]
pub struct Upstream {
    /// Base URL without a trailing slash.
    pub url: String,
    /// Host part of the URL.
    pub host: String,
    /// SGLang bootstrap port (prefill workers).
    pub bootstrap_port: Option<u16>,
    /// Host the decode reaches this prefill's bootstrap server at.
    pub bootstrap_host: String,
    /// `Authorization` of ordinary calls, from the pool's `api_key`.
    pub auth: Option<http::HeaderValue>,
    /// `Authorization` of admin calls (aborts), from `admin_api_key` or `api_key`.
    pub admin_auth: Option<http::HeaderValue>,
    /// `url` taken apart once, where it is an origin alone ([`Upstream::endpoint`]).
    pub(super) origin: Option<Origin>,
    /// Its place in the pool, kept while it is a member: `prefill-2` in metrics and API answers
    /// ([`worker_label`]), whoever joins or leaves after it.
    pub(super) ordinal: usize,
    pub(super) in_flight: Arc<AtomicUsize>,
    pub(super) healthy: AtomicBool,
    pub(super) verified: AtomicBool,
    pub(super) draining: AtomicBool,
    /// It joined at run time ([`WorkerPool::join`]), not from the configuration: a reload keeps it.
    pub(super) joined: AtomicBool,
    /// A request named it (`lockstep sidecar`'s `x-prefiller-host-port`): what it reports limits
    /// only the pairs pinned to it, never the model's.
    pub(super) named: AtomicBool,
    /// The longest prompt it reported accepting (`u64::MAX`: none reported); read for a named
    /// prefill, whose report does not tighten the model's limits.
    pub(super) own_prompt_limit: AtomicU64,
    /// It left the pool: no new pairs; its checks stop.
    pub(super) left: AtomicBool,
    pub(super) fails: AtomicU32,
    pub(super) oks: AtomicU32,
    /// Why its last deployment check failed (cleared when one passes).
    pub(super) check_error: std::sync::Mutex<Option<String>>,
    /// Told when one of its slots frees (its pool's: requests waiting for a slot listen).
    pub(super) freed: Arc<tokio::sync::Notify>,
    /// Its engine's KV event publisher (ZMQ PUB), and the replay ROUTER beside it.
    pub kv_events: Option<String>,
    /// The replay endpoint.
    pub kv_events_replay: Option<String>,
}

impl Upstream {
    /// A worker from its configuration; healthy until checks say otherwise.
    pub fn new(cfg: &WorkerConfig) -> Upstream {
        let url = cfg.url.trim_end_matches('/').to_string();
        let host = url
            .parse::<http::Uri>()
            .ok()
            .and_then(|u| u.host().map(str::to_string))
            .unwrap_or_default();
        Upstream {
            bootstrap_host: cfg.bootstrap_host.clone().unwrap_or_else(|| host.clone()),
            host,
            bootstrap_port: cfg.bootstrap_port,
            auth: None,
            admin_auth: None,
            origin: Origin::of(&url),
            url,
            ordinal: 0,
            in_flight: Arc::new(AtomicUsize::new(0)),
            healthy: AtomicBool::new(true),
            verified: AtomicBool::new(true),
            draining: AtomicBool::new(false),
            joined: AtomicBool::new(false),
            named: AtomicBool::new(false),
            own_prompt_limit: AtomicU64::new(u64::MAX),
            left: AtomicBool::new(false),
            fails: AtomicU32::new(0),
            oks: AtomicU32::new(0),
            check_error: std::sync::Mutex::new(None),
            freed: Arc::default(),
            kv_events: cfg.kv_events.clone(),
            kv_events_replay: cfg.kv_events_replay.clone(),
        }
    }

    /// `extra` plus this worker's `Authorization` (`admin`: the admin credential).
    pub fn headers(
        &self,
        mut extra: Vec<(http::HeaderName, http::HeaderValue)>,
        admin: bool,
    ) -> Vec<(http::HeaderName, http::HeaderValue)> {
        let auth = if admin { &self.admin_auth } else { &self.auth };
        if let Some(v) = auth {
            extra.push((http::header::AUTHORIZATION, v.clone()));
        }
        extra
    }

    /// `path` (absolute: `/generate`) on this worker, addressed without formatting its URL.
    pub fn endpoint(&self, path: &'static str) -> Result<Endpoint, String> {
        endpoint::endpoint(self.origin.as_ref(), &self.url, path)
    }

    /// Pairs currently using this worker.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Whether the worker passes its health checks, and its backend verified it (an SGLang
    /// worker that did not answer the deployment check is not, until it answers and passes).
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire) && self.is_verified()
    }

    /// Whether the backend verified this worker's settings (true unless it could not yet).
    pub fn is_verified(&self) -> bool {
        self.verified.load(Ordering::Acquire)
    }

    /// Why the worker's last deployment check failed (`None` when none did, or one passed since).
    pub fn check_error(&self) -> Option<String> {
        self.check_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Records the outcome of a deployment check of this worker: verified, or why not.
    pub fn checked(&self, outcome: Result<(), String>) {
        let ok = outcome.is_ok();
        *self.check_error.lock().unwrap_or_else(|p| p.into_inner()) = outcome.err();
        self.set_verified(ok);
    }

    /// Marks the worker verified or not.
    pub fn set_verified(&self, on: bool) {
        self.verified.store(on, Ordering::Release);
    }

    /// Whether an operator is draining it (no new pairs; running ones finish).
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Starts or ends a drain.
    pub fn set_draining(&self, on: bool) {
        self.draining.store(on, Ordering::Release);
    }

    /// Whether the worker gets new pairs: a member, healthy and not draining.
    pub fn accepts_pairs(&self) -> bool {
        self.is_healthy() && !self.is_draining() && !self.has_left()
    }

    /// Whether it left its pool ([`WorkerPool::leave`]); pairs it runs finish.
    pub fn has_left(&self) -> bool {
        self.left.load(Ordering::Acquire)
    }

    /// Whether it joined at run time rather than from the configuration.
    pub fn joined(&self) -> bool {
        self.joined.load(Ordering::Acquire)
    }

    /// Marks it as joined at run time (a reload keeps it in the pool).
    pub fn set_joined(&self, on: bool) {
        self.joined.store(on, Ordering::Release);
    }

    /// Whether a request named it (a sidecar's prefill from `x-prefiller-host-port`).
    pub fn named(&self) -> bool {
        self.named.load(Ordering::Acquire)
    }

    /// Marks it as named by a request.
    pub fn set_named(&self, on: bool) {
        self.named.store(on, Ordering::Release);
    }

    /// The longest prompt it reported accepting, where it reported one.
    pub fn own_prompt_limit(&self) -> Option<u64> {
        Some(self.own_prompt_limit.load(Ordering::Acquire)).filter(|l| *l != u64::MAX)
    }

    /// Records the longest prompt it reported accepting.
    pub fn set_own_prompt_limit(&self, limit: Option<u64>) {
        self.own_prompt_limit
            .store(limit.unwrap_or(u64::MAX), Ordering::Release);
    }

    /// Its name in metrics and API answers on `side`: `prefill-2` ([`worker_label`]).
    pub fn label(&self, side: &str) -> String {
        worker_label(side, self.ordinal)
    }

    /// The configuration it was built from (to carry a joined worker over a reload).
    pub fn config(&self) -> WorkerConfig {
        WorkerConfig {
            url: self.url.clone(),
            bootstrap_port: self.bootstrap_port,
            bootstrap_host: Some(self.bootstrap_host.clone()),
            kv_events: self.kv_events.clone(),
            kv_events_replay: self.kv_events_replay.clone(),
        }
    }

    /// Records one health-check result, applying the consecutive thresholds.
    pub fn record_health(&self, ok: bool, cfg: &HealthConfig) {
        if ok {
            self.fails.store(0, Ordering::Release);
            let n = self.oks.fetch_add(1, Ordering::AcqRel) + 1;
            if n >= cfg.success_threshold && !self.healthy.load(Ordering::Acquire) {
                tracing::info!(worker = %self.url, "worker healthy again");
                self.healthy.store(true, Ordering::Release);
            }
        } else {
            self.oks.store(0, Ordering::Release);
            let n = self.fails.fetch_add(1, Ordering::AcqRel) + 1;
            if n >= cfg.failure_threshold && self.healthy.load(Ordering::Acquire) {
                tracing::warn!(worker = %self.url, failures = n, "worker marked unhealthy");
                self.healthy.store(false, Ordering::Release);
            }
        }
    }
}

/// Counts a pair against a worker while alive; dropping it gives the slot back.
#[derive(Debug)]
pub struct LoadGuard(Arc<Upstream>);

impl LoadGuard {
    /// Takes a slot on `worker`.
    pub fn new(worker: Arc<Upstream>) -> LoadGuard {
        worker.in_flight.fetch_add(1, Ordering::AcqRel);
        LoadGuard(worker)
    }
    /// The worker this guard counts against.
    pub fn worker(&self) -> &Arc<Upstream> {
        &self.0
    }
}

impl LoadGuard {
    /// Takes a slot only while the worker has fewer than `max` pairs (0: no limit); atomic, so
    /// concurrent picks never exceed it.
    pub fn try_new(worker: Arc<Upstream>, max: usize) -> Option<LoadGuard> {
        if max == 0 {
            return Some(LoadGuard::new(worker));
        }
        worker
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| LoadGuard(worker))
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0.freed.notify_waiters();
    }
}

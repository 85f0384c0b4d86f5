//! Worker pools: selection policies, RAII load guards and background health checks.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use rand::Rng;

use crate::config::{HealthConfig, PolicyKind, PoolConfig, WorkerConfig};

/// One upstream worker and its live state.
#[derive(Debug)]
pub struct Worker {
    /// Base URL without a trailing slash.
    pub url: String,
    /// Host part of the URL.
    pub host: String,
    /// SGLang bootstrap port (prefill workers).
    pub bootstrap_port: Option<u16>,
    /// Host the decode reaches this prefill's bootstrap server at.
    pub bootstrap_host: String,
    in_flight: AtomicUsize,
    healthy: AtomicBool,
    draining: AtomicBool,
    fails: AtomicU32,
    oks: AtomicU32,
}

impl Worker {
    /// A worker from its configuration; healthy until checks say otherwise.
    pub fn new(cfg: &WorkerConfig) -> Worker {
        let url = cfg.url.trim_end_matches('/').to_string();
        let host = url
            .parse::<http::Uri>()
            .ok()
            .and_then(|u| u.host().map(str::to_string))
            .unwrap_or_default();
        Worker {
            bootstrap_host: cfg.bootstrap_host.clone().unwrap_or_else(|| host.clone()),
            host,
            url,
            bootstrap_port: cfg.bootstrap_port,
            in_flight: AtomicUsize::new(0),
            healthy: AtomicBool::new(true),
            draining: AtomicBool::new(false),
            fails: AtomicU32::new(0),
            oks: AtomicU32::new(0),
        }
    }

    /// Pairs currently using this worker.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Whether the worker passes its health checks.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    /// Whether an operator is draining it (no new pairs; running ones finish).
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Starts or ends a drain.
    pub fn set_draining(&self, on: bool) {
        self.draining.store(on, Ordering::Release);
    }

    /// Whether the worker gets new pairs: healthy and not draining.
    pub fn accepts_pairs(&self) -> bool {
        self.is_healthy() && !self.is_draining()
    }

    /// Records one health-check result, applying the consecutive thresholds.
    pub fn record_health(&self, ok: bool, cfg: &HealthConfig) {
        if ok {
            self.fails.store(0, Ordering::Release);
            let n = self.oks.fetch_add(1, Ordering::AcqRel) + 1;
            if n >= cfg.success_threshold && !self.is_healthy() {
                tracing::info!(worker = %self.url, "worker healthy again");
                self.healthy.store(true, Ordering::Release);
            }
        } else {
            self.oks.store(0, Ordering::Release);
            let n = self.fails.fetch_add(1, Ordering::AcqRel) + 1;
            if n >= cfg.failure_threshold && self.is_healthy() {
                tracing::warn!(worker = %self.url, failures = n, "worker marked unhealthy");
                self.healthy.store(false, Ordering::Release);
            }
        }
    }
}

/// Counts a pair against a worker while alive; dropping it gives the slot back.
#[derive(Debug)]
pub struct LoadGuard(Arc<Worker>);

impl LoadGuard {
    /// Takes a slot on `worker`.
    pub fn new(worker: Arc<Worker>) -> LoadGuard {
        worker.in_flight.fetch_add(1, Ordering::AcqRel);
        LoadGuard(worker)
    }
    /// The worker this guard counts against.
    pub fn worker(&self) -> &Arc<Worker> {
        &self.0
    }
}

impl LoadGuard {
    /// Takes a slot only while the worker has fewer than `max` pairs (0: no limit); atomic, so
    /// concurrent picks never exceed it.
    pub fn try_new(worker: Arc<Worker>, max: usize) -> Option<LoadGuard> {
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
    }
}

/// The workers of one side of a model, with their selection policy.
#[derive(Debug)]
pub struct WorkerPool {
    workers: Vec<Arc<Worker>>,
    policy: PolicyKind,
    max_pairs: usize,
    next: AtomicUsize,
}

impl WorkerPool {
    /// A pool from configuration.
    pub fn new(cfg: &PoolConfig) -> WorkerPool {
        WorkerPool {
            workers: cfg
                .workers
                .iter()
                .map(|w| Arc::new(Worker::new(w)))
                .collect(),
            policy: cfg.policy,
            max_pairs: cfg.max_pairs_per_worker,
            next: AtomicUsize::new(0),
        }
    }

    /// All workers.
    pub fn workers(&self) -> &[Arc<Worker>] {
        &self.workers
    }

    /// Whether at least one worker takes new pairs (healthy, not draining).
    pub fn any_healthy(&self) -> bool {
        self.workers.iter().any(|w| w.accepts_pairs())
    }

    /// Whether workers would take pairs but every one is at `max_pairs_per_worker`.
    pub fn all_busy(&self) -> bool {
        self.max_pairs > 0
            && self.workers.iter().any(|w| w.accepts_pairs())
            && self
                .workers
                .iter()
                .filter(|w| w.accepts_pairs())
                .all(|w| w.in_flight() >= self.max_pairs)
    }

    /// Picks a healthy worker with a free slot (avoiding `avoid` when another one exists) and
    /// takes the slot.
    pub fn pick(&self, avoid: Option<&Arc<Worker>>) -> Option<LoadGuard> {
        let max = self.max_pairs;
        let open = |w: &Arc<Worker>| w.accepts_pairs() && (max == 0 || w.in_flight() < max);
        // Fast path: one worker, no allocation.
        if let [only] = self.workers.as_slice() {
            return if only.accepts_pairs() {
                LoadGuard::try_new(only.clone(), max)
            } else {
                None
            };
        }
        let healthy: Vec<&Arc<Worker>> = self.workers.iter().filter(|w| open(w)).collect();
        let candidates: Vec<&Arc<Worker>> = match avoid {
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
            },
        };
        LoadGuard::try_new(chosen.clone(), max)
    }
}

/// Runs health checks for `workers` forever (the caller aborts the task on shutdown).
pub async fn health_loop(
    client: crate::backend::UpstreamClient,
    workers: Vec<Arc<Worker>>,
    cfg: HealthConfig,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(cfg.interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let checks = workers.iter().map(|w| {
            let client = client.clone();
            let cfg = &cfg;
            async move {
                let ok = client
                    .health(&w.url, Duration::from_millis(cfg.timeout_ms))
                    .await;
                w.record_health(ok, cfg);
            }
        });
        futures_util::future::join_all(checks).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_limit_per_worker_is_never_exceeded() {
        let p = WorkerPool::new(&PoolConfig {
            max_pairs_per_worker: 2,
            ..PoolConfig {
                policy: PolicyKind::LeastLoad,
                workers: (0..2)
                    .map(|i| WorkerConfig {
                        url: format!("http://127.0.0.1:{}", 2000 + i),
                        bootstrap_port: None,
                        bootstrap_host: None,
                    })
                    .collect(),
                max_pairs_per_worker: 0,
            }
        });
        let held: Vec<LoadGuard> = (0..4).map(|_| p.pick(None).expect("a slot")).collect();
        assert!(p.workers().iter().all(|w| w.in_flight() == 2));
        assert!(p.pick(None).is_none() && p.all_busy());
        drop(held);
        assert!(!p.all_busy() && p.pick(None).is_some());
        // Concurrent takers never exceed the limit.
        let w = p.workers()[0].clone();
        let got: Vec<Option<LoadGuard>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..16)
                .map(|_| s.spawn(|| LoadGuard::try_new(w.clone(), 3)))
                .collect();
            hs.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        assert_eq!(got.iter().filter(|g| g.is_some()).count(), 3);
    }

    fn pool(n: usize, policy: PolicyKind) -> WorkerPool {
        WorkerPool::new(&PoolConfig {
            policy,
            workers: (0..n)
                .map(|i| WorkerConfig {
                    url: format!("http://127.0.0.1:{}", 1000 + i),
                    bootstrap_port: None,
                    bootstrap_host: None,
                })
                .collect(),
            max_pairs_per_worker: 0,
        })
    }

    #[test]
    fn round_robin_cycles_and_guards_count() {
        let p = pool(3, PolicyKind::RoundRobin);
        let g: Vec<_> = (0..6).map(|_| p.pick(None).expect("worker")).collect();
        let urls: Vec<_> = g.iter().map(|g| g.worker().url.clone()).collect();
        assert_eq!(urls[0..3], urls[3..6]);
        assert_ne!(urls[0], urls[1]);
        assert!(p.workers().iter().all(|w| w.in_flight() == 2));
        drop(g);
        assert!(p.workers().iter().all(|w| w.in_flight() == 0));
    }

    #[test]
    fn least_load_prefers_idle_worker() {
        let p = pool(2, PolicyKind::LeastLoad);
        let busy: Vec<_> = (0..5)
            .map(|_| LoadGuard::new(p.workers()[0].clone()))
            .collect();
        for _ in 0..20 {
            let g = p.pick(None).expect("worker");
            assert_eq!(g.worker().url, p.workers()[1].url);
        }
        drop(busy);
    }

    #[test]
    fn unhealthy_after_threshold_and_back() {
        let p = pool(2, PolicyKind::RoundRobin);
        let cfg = HealthConfig {
            interval_ms: 1,
            timeout_ms: 1,
            failure_threshold: 2,
            success_threshold: 2,
        };
        let w = &p.workers()[0];
        w.record_health(false, &cfg);
        assert!(w.is_healthy());
        w.record_health(false, &cfg);
        assert!(!w.is_healthy());
        for _ in 0..10 {
            assert_eq!(
                p.pick(None).expect("worker").worker().url,
                p.workers()[1].url
            );
        }
        w.record_health(true, &cfg);
        assert!(!w.is_healthy());
        w.record_health(true, &cfg);
        assert!(w.is_healthy());
        p.workers()[1].record_health(false, &cfg);
        p.workers()[1].record_health(false, &cfg);
        w.record_health(false, &cfg);
        w.record_health(false, &cfg);
        assert!(p.pick(None).is_none());
    }

    #[test]
    fn avoid_skips_failed_worker_when_possible() {
        let p = pool(2, PolicyKind::RoundRobin);
        let bad = p.workers()[0].clone();
        for _ in 0..6 {
            assert_eq!(
                p.pick(Some(&bad)).expect("worker").worker().url,
                p.workers()[1].url
            );
        }
        let one = pool(1, PolicyKind::RoundRobin);
        let only = one.workers()[0].clone();
        assert!(one.pick(Some(&only)).is_some());
    }
}

//! Tenant limits shared by every replica in front of the same workers (`[shared] redis_url`).
//! Without it each replica keeps its own limits, and N replicas give a tenant N times its limit.
//!
//! What is shared, in one Redis, per tenant (keyed by its `id`, else its name):
//! - the request rate (`requests_per_second`, `burst`): a GCRA arrival time;
//! - the concurrent pairs (`max_concurrent_pairs`): one lease per running request, in a sorted
//!   set by expiry. Each replica renews its leases every third of `lease_ttl_ms`, so a replica
//!   that dies gives its slots back within `lease_ttl_ms`;
//! - the token budget (`tokens_per_minute`): the tokens available and when, refilled at the rate.
//!
//! A request takes all three in one Lua script (`claim.lua`), all or nothing, after its prompt is
//! tokenized (so the exact prompt and `max_tokens` are reserved); when its answer ends,
//! `release.lua` drops the lease and returns the tokens it did not use. A replica that dies
//! never settles: its reservations stay spent (they may have been delivered) until the budget
//! refills. Time is the store's own (`TIME`), never a replica's clock.
//!
//! The store unreachable (a failed or slow call, `timeout_ms`): one log line, the metric
//! `lockstep_shared_store_up` 0, and then `on_unavailable`: `local` (each replica enforces its
//! share, every limit divided by the replicas last seen, in its own process) or `deny` (503
//! `shared_store_unavailable`). The heartbeat keeps trying; the store back, requests go to it
//! again (those admitted locally meanwhile keep their local slots until they end).

mod idempotency;

pub use idempotency::Claim as IdempotencyClaim;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::sync::OwnedSemaphorePermit;

use crate::budget::{LimitSpec, Limits, Reservation, never_fits, rate_headers};
use lockstep_core::config::{OnUnavailable, SharedConfig};
use lockstep_core::error::LockstepError;
use lockstep_core::metrics::Metrics;

/// The connection to the shared store, this replica's presence and the leases it holds.
pub struct SharedStore {
    cfg: SharedConfig,
    conn: ConnectionManager,
    /// This replica's id in the store (random per process start).
    replica: String,
    up: AtomicBool,
    /// Replicas alive as last seen (at least `cfg.replicas`, at least 1).
    replicas: AtomicU32,
    /// Whether `replicas` is a count anyone gave: configured (`shared.replicas`), or seen in
    /// the store at least once. Until then `on_unavailable = "local"` cannot divide a limit
    /// safely, and refuses as `deny` does.
    count_known: AtomicBool,
    /// Leases this replica holds, by lease-set key.
    held: Mutex<HashMap<String, HashSet<String>>>,
    seq: AtomicU64,
    metrics: Arc<Metrics>,
    /// Each tenant's share of its limits while the store is gone (`on_unavailable = "local"`),
    /// by tenant key and limits; emptied when the store is back.
    local: Mutex<HashMap<(String, LimitSpec), Arc<Limits>>>,
    claim: redis::Script,
    release: redis::Script,
    renew: redis::Script,
}

impl std::fmt::Debug for SharedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedStore")
            .field("replica", &self.replica)
            .field("up", &self.up)
            .finish_non_exhaustive()
    }
}

/// `claim.lua`'s reply: fits, what did not, retry after (ms), requests left, tokens left, until
/// the budget is full (ms).
type Reply = (i64, String, i64, i64, i64, i64);

/// What a claim of the store answered.
#[derive(Debug)]
struct Answer {
    ok: bool,
    what: String,
    retry_ms: i64,
    requests_left: i64,
    tokens_left: i64,
}

/// The Redis client of `cfg`: `redis://`, or `rediss://` (TLS, rustls) trusting the system's
/// roots or `shared.ca_file`'s.
fn client(cfg: &SharedConfig) -> Result<redis::Client, String> {
    let url = cfg.redis_url.trim();
    let client = match &cfg.ca_file {
        Some(ca) => {
            let pem =
                std::fs::read(ca).map_err(|e| format!("shared.ca_file: {}: {e}", ca.display()))?;
            redis::Client::build_with_tls(
                url,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem),
                },
            )
        }
        None => redis::Client::open(url),
    };
    client.map_err(|e| format!("shared.redis_url: {e}"))
}

impl SharedStore {
    /// Connects lazily to `cfg.redis_url` and starts the heartbeat (presence, lease renewal,
    /// reconnection). A store that cannot be reached at start is not fatal: the replica starts
    /// as `on_unavailable` says and joins when the store answers.
    pub async fn start(cfg: &SharedConfig, metrics: Arc<Metrics>) -> Result<Arc<Self>, String> {
        let client = client(cfg)?;
        let timeout = Duration::from_millis(cfg.timeout_ms);
        let conn_cfg = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(cfg.lease_ttl_ms / 3));
        let conn = ConnectionManager::new_lazy_with_config(client, conn_cfg)
            .map_err(|e| format!("shared.redis_url: {e}"))?;
        let store = Arc::new(SharedStore {
            cfg: cfg.clone(),
            conn,
            replica: format!("{:016x}", rand::random::<u64>()),
            up: AtomicBool::new(true),
            replicas: AtomicU32::new(cfg.replicas.max(1)),
            count_known: AtomicBool::new(cfg.replicas > 0),
            held: Mutex::new(HashMap::new()),
            seq: AtomicU64::new(0),
            metrics,
            local: Mutex::new(HashMap::new()),
            claim: redis::Script::new(include_str!("claim.lua")),
            release: redis::Script::new(include_str!("release.lua")),
            renew: redis::Script::new(include_str!("renew.lua")),
        });
        store.metrics.shared.shared_store_up.set(1);
        store.heartbeat().await;
        let weak = Arc::downgrade(&store);
        tokio::spawn(heartbeats(
            weak,
            Duration::from_millis(cfg.lease_ttl_ms / 3),
        ));
        Ok(store)
    }

    /// The settings it runs with.
    pub fn config(&self) -> &SharedConfig {
        &self.cfg
    }

    /// Whether the store answered its latest call.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Replicas alive as last seen.
    pub fn replicas(&self) -> u32 {
        self.replicas.load(Ordering::Relaxed)
    }

    fn key(&self, tenant: &str, what: &str) -> String {
        format!("{}:{{{tenant}}}:{what}", self.cfg.key_prefix)
    }

    fn mark_up(&self) {
        if !self.up.swap(true, Ordering::AcqRel) {
            self.lock_local().clear();
            tracing::info!(
                replicas = self.replicas(),
                "shared store reachable again: tenant limits are shared across replicas"
            );
        }
        self.metrics.shared.shared_store_up.set(1);
    }

    fn mark_down(&self, e: &str) {
        self.metrics.shared.shared_store_errors.inc();
        self.metrics.shared.shared_store_up.set(0);
        if self.up.swap(false, Ordering::AcqRel) {
            match self.cfg.on_unavailable {
                OnUnavailable::Local => tracing::warn!(
                    error = e,
                    replicas = self.replicas(),
                    "shared store unreachable: each replica now enforces its share of every tenant limit (the limit / replicas) locally"
                ),
                OnUnavailable::Deny => tracing::warn!(
                    error = e,
                    "shared store unreachable: requests of limited tenants are refused (on_unavailable = \"deny\")"
                ),
            }
        }
    }

    fn lock_local(&self) -> std::sync::MutexGuard<'_, HashMap<(String, LimitSpec), Arc<Limits>>> {
        self.local.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_held(&self) -> std::sync::MutexGuard<'_, HashMap<String, HashSet<String>>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `inv` against the store within `timeout_ms`; a failure marks the store down.
    async fn call<T: redis::FromRedisValue>(
        &self,
        inv: redis::ScriptInvocation<'_>,
    ) -> Result<T, String> {
        let mut conn = self.conn.clone();
        let timeout = Duration::from_millis(self.cfg.timeout_ms);
        let r = match tokio::time::timeout(timeout, inv.invoke_async(&mut conn)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {} ms", self.cfg.timeout_ms)),
        };
        match &r {
            Ok(_) => self.mark_up(),
            Err(e) => self.mark_down(e),
        }
        r
    }

    /// Presence and lease renewal; learns how many replicas are alive.
    async fn heartbeat(&self) {
        let held: Vec<(String, Vec<String>)> = self
            .lock_held()
            .iter()
            .filter(|(_, l)| !l.is_empty())
            .map(|(k, l)| (k.clone(), l.iter().cloned().collect()))
            .collect();
        let mut inv = self.renew.prepare_invoke();
        inv.key(format!("{}:replicas", self.cfg.key_prefix))
            .arg(&self.replica)
            .arg(self.cfg.lease_ttl_ms);
        for (k, leases) in &held {
            inv.key(k).arg(leases.len());
            for l in leases {
                inv.arg(l);
            }
        }
        if let Ok(n) = self.call::<u32>(inv).await {
            let n = n.max(self.cfg.replicas).max(1);
            self.replicas.store(n, Ordering::Relaxed);
            self.count_known.store(true, Ordering::Release);
            self.metrics.shared.shared_replicas.set(i64::from(n));
        }
    }

    /// This replica's share of `spec` while the store is gone: each limit divided by the
    /// replicas last seen (never below 1 where the limit is set).
    fn local_share(&self, key: &str, spec: LimitSpec) -> Arc<Limits> {
        let n = self.replicas().max(1);
        let share = |x: u32| if x == 0 { 0 } else { (x / n).max(1) };
        let (rps, burst, pairs, tpm) = spec;
        self.lock_local()
            .entry((key.to_string(), spec))
            .or_insert_with(|| {
                Arc::new(Limits::new((
                    share(rps),
                    share(burst),
                    share(pairs),
                    if tpm == 0 {
                        0
                    } else {
                        (tpm / u64::from(n)).max(1)
                    },
                )))
            })
            .clone()
    }
}

/// The heartbeat task: stops when the store is dropped.
async fn heartbeats(store: Weak<SharedStore>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(s) = store.upgrade() else { return };
        s.heartbeat().await;
    }
}

/// One tenant's limits in the shared store.
pub struct SharedLimits {
    store: Arc<SharedStore>,
    /// The tenant's key in the store (its `id`, else its name).
    key: String,
    name: Arc<str>,
    spec: LimitSpec,
    /// What the store said last: tokens left and when, until full, requests left.
    view: Mutex<View>,
}

#[derive(Debug, Clone, Copy)]
struct View {
    tokens_left: f64,
    at: Instant,
    requests_left: u32,
}

impl std::fmt::Debug for SharedLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedLimits")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

/// What a claim took: a slot and tokens in the store, or (the store gone, `on_unavailable =
/// "local"`) this replica's share of them.
#[derive(Debug)]
pub enum Claimed {
    /// In the store.
    Store(Claim),
    /// In this process.
    Local {
        /// The concurrent-pair slot.
        slot: Option<OwnedSemaphorePermit>,
        /// The token reservation.
        tokens: Option<Reservation>,
    },
}

/// A request's lease and token reservation in the shared store, released when it drops.
#[derive(Debug)]
pub struct Claim {
    limits: Arc<SharedLimits>,
    lease: Option<String>,
    reserved: u64,
    used: AtomicU64,
}

impl SharedLimits {
    /// `spec` of tenant `name` (store key `key`) in `store`.
    pub fn new(store: &Arc<SharedStore>, key: &str, name: &str, spec: LimitSpec) -> Arc<Self> {
        Arc::new(SharedLimits {
            store: store.clone(),
            key: key.to_string(),
            name: name.into(),
            spec,
            view: Mutex::new(View {
                tokens_left: spec.3 as f64,
                at: Instant::now(),
                requests_left: spec.1.max(spec.0),
            }),
        })
    }

    fn lock_view(&self) -> std::sync::MutexGuard<'_, View> {
        self.view.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The tokens a request of `n` (prompt + `max_tokens`) reserves: `n` where a token budget is
    /// set, else 0; 429 when it can never fit.
    pub fn check_fits(&self, n: u64) -> Result<u64, LockstepError> {
        let tpm = self.spec.3;
        if tpm == 0 {
            return Ok(0);
        }
        match never_fits(n, tpm, &self.name) {
            Some(e) => Err(e),
            None => Ok(n),
        }
    }

    /// Takes one request, one concurrent slot and `tokens` (all or none), in the store or as
    /// `on_unavailable` says.
    pub async fn claim(self: &Arc<Self>, tokens: u64) -> Result<Claimed, LockstepError> {
        let store = &self.store;
        if store.is_up()
            && let Ok(c) = self.claim_in_store(tokens).await
        {
            return c.map(Claimed::Store);
        }
        // `local` divides each limit by the replicas; with no count configured and none seen in
        // the store yet, there is nothing safe to divide by: refuse as `deny` does.
        let local = store.cfg.on_unavailable == OnUnavailable::Local
            && store.count_known.load(Ordering::Acquire);
        match local {
            false => Err(LockstepError::SharedStoreUnavailable {
                message: format!(
                    "tenant `{}`: the store its limits are shared through cannot be reached; try again shortly",
                    self.name
                ),
            }),
            true => {
                let local = store.local_share(&self.key, self.spec);
                let slot = local.take_permit(&self.name)?;
                let tokens = match &local.tokens {
                    Some(b) if tokens > 0 => Some(b.reserve(tokens, &self.name)?),
                    _ => None,
                };
                Ok(Claimed::Local { slot, tokens })
            }
        }
    }

    /// The claim in the store: `Err(())` where the store failed to answer.
    async fn claim_in_store(
        self: &Arc<Self>,
        tokens: u64,
    ) -> Result<Result<Claim, LockstepError>, ()> {
        let store = &self.store;
        let (rps, burst, pairs, tpm) = self.spec;
        let lease = (pairs > 0).then(|| {
            let n = store.seq.fetch_add(1, Ordering::Relaxed);
            format!("{}:{n}", store.replica)
        });
        let leases = store.key(&self.key, "pairs");
        let mut inv = store.claim.prepare_invoke();
        inv.key(store.key(&self.key, "requests"))
            .key(&leases)
            .key(store.key(&self.key, "tokens"))
            .arg(rps)
            .arg(burst)
            .arg(pairs)
            .arg(lease.as_deref().unwrap_or(""))
            .arg(store.cfg.lease_ttl_ms)
            .arg(tokens)
            .arg(tpm);
        let (ok, what, retry_ms, requests_left, tokens_left, _reset_ms): Reply =
            store.call(inv).await.map_err(|_| ())?;
        let a = Answer {
            ok: ok == 1,
            what,
            retry_ms,
            requests_left,
            tokens_left,
        };
        self.saw(&a);
        if !a.ok {
            return Ok(Err(self.refusal(&a, tokens)));
        }
        if let Some(l) = &lease {
            store
                .lock_held()
                .entry(leases)
                .or_default()
                .insert(l.clone());
        }
        Ok(Ok(Claim {
            limits: self.clone(),
            lease,
            reserved: tokens,
            used: AtomicU64::new(0),
        }))
    }

    fn saw(&self, a: &Answer) {
        let mut v = self.lock_view();
        if a.tokens_left >= 0 {
            v.tokens_left = a.tokens_left as f64;
            v.at = Instant::now();
        }
        if a.requests_left >= 0 {
            v.requests_left = u32::try_from(a.requests_left).unwrap_or(0);
        }
    }

    fn refusal(&self, a: &Answer, tokens: u64) -> LockstepError {
        let retry_after_s = (a.retry_ms.max(0) as u64).div_ceil(1000).max(1);
        let name = &self.name;
        match a.what.as_str() {
            "tokens" => LockstepError::TokensExhausted {
                message: format!(
                    "tenant `{name}`: token budget of {} per minute reached across replicas ({} available, {tokens} needed: prompt + max_tokens)",
                    self.spec.3,
                    a.tokens_left.max(0)
                ),
                retry_after_s,
            },
            "pairs" => LockstepError::RateLimited {
                message: format!(
                    "tenant `{name}`: {} concurrent requests already running across replicas",
                    self.spec.2
                ),
                retry_after_s,
            },
            _ => LockstepError::RateLimited {
                message: format!("tenant `{name}`: request rate limit reached across replicas"),
                retry_after_s,
            },
        }
    }

    /// The `x-ratelimit-*` headers: from what the store said last (the tokens refilled since
    /// at the budget's rate), or this replica's share while the store is gone.
    pub fn rate_headers(&self) -> Vec<(&'static str, String)> {
        if !self.store.is_up()
            && let Some(l) = self.store.lock_local().get(&(self.key.clone(), self.spec))
        {
            return l.rate_headers();
        }
        let v = *self.lock_view();
        let tpm = self.spec.3 as f64;
        let left = (v.tokens_left + v.at.elapsed().as_secs_f64() * tpm / 60.0).min(tpm);
        let reset = if tpm > 0.0 {
            Duration::from_secs_f64((tpm - left).max(0.0) * 60.0 / tpm)
        } else {
            Duration::ZERO
        };
        rate_headers(self.spec, Some((left as u64, reset)), v.requests_left)
    }

    /// Drops `lease` and returns `back` tokens (in the background; a store that cannot be
    /// reached lets the lease expire and keeps the tokens spent).
    fn release(self: Arc<Self>, lease: Option<String>, back: u64) {
        let leases = self.store.key(&self.key, "pairs");
        if let Some(l) = &lease {
            let mut held = self.store.lock_held();
            if let Some(set) = held.get_mut(&leases) {
                set.remove(l);
                if set.is_empty() {
                    held.remove(&leases);
                }
            }
        }
        if lease.is_none() && (back == 0 || self.spec.3 == 0) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(async move {
            let store = &self.store;
            let mut inv = store.release.prepare_invoke();
            inv.key(&leases)
                .key(store.key(&self.key, "tokens"))
                .arg(lease.as_deref().unwrap_or(""))
                .arg(back)
                .arg(self.spec.3);
            if let Ok((left, _reset_ms)) = store.call::<(i64, i64)>(inv).await {
                self.saw(&Answer {
                    ok: true,
                    what: String::new(),
                    retry_ms: 0,
                    requests_left: -1,
                    tokens_left: left,
                });
            }
        });
    }
}

impl Claim {
    /// Records that `total` of the reserved tokens were spent so far; never more than reserved.
    pub fn spent(&self, total: u64) {
        self.used
            .fetch_max(total.min(self.reserved), Ordering::AcqRel);
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let back = self.reserved - self.used.load(Ordering::Acquire);
        self.limits.clone().release(self.lease.take(), back);
    }
}

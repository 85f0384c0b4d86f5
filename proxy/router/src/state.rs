//! The router's shared state: the served models (one generation, swapped whole on reload), the
//! live pairs, tenants and the process-wide counters the front ends read.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use futures_util::future::BoxFuture;
use http::HeaderMap;
use lockstep_engine::pd::Pd;
use tokio::task::JoinHandle;

use crate::backend::UpstreamClient;
use crate::pair::{ModelPairs, PairRegistry, PairStats};
use lockstep_core::audit::Audit;
use lockstep_core::config::ModelConfig;
use lockstep_core::error::LockstepError;
use lockstep_core::metrics::Metrics;
use lockstep_prompt::codec::PromptCodec;
use lockstep_routing::pool::PrefillPin;

/// One served model.
#[derive(Debug)]
pub struct ModelRuntime {
    /// The name clients use.
    pub name: Arc<str>,
    /// Its configuration.
    pub cfg: ModelConfig,
    /// Tokenizer and chat template.
    pub codec: Arc<PromptCodec>,
    /// Its pair lifecycle and pools.
    pub pairs: Arc<ModelPairs>,
    /// The embedded engines, for `backend = "embedded"`.
    pub engine: Option<Arc<Pd>>,
    /// The embedding workers of an embeddings model (`[models.embed]`).
    pub embed: Option<Arc<lockstep_routing::pool::WorkerPool>>,
    pub(crate) limits: Arc<WorkerLimits>,
    /// Where membership changes for its remote pools go (the admin API's add and remove);
    /// `None` for the embedded engine.
    pub members: Option<lockstep_routing::pool::MemberFeed>,
}

/// The limits the workers report, as admission applies them: set by the deployment check and
/// only ever lowered after it (a worker verified later may report less).
#[derive(Debug)]
pub struct WorkerLimits {
    pub(crate) kv_capacity: AtomicU64,
    /// `u64::MAX`: the workers report no prompt limit.
    prompt_limit: AtomicU64,
    /// The longest KV lease the workers reported (ms; 0: none reported).
    kv_lease_ms: AtomicU64,
}

impl WorkerLimits {
    /// The limits of a deployment check.
    pub fn new(d: &crate::backend::Deployment) -> WorkerLimits {
        WorkerLimits {
            kv_capacity: AtomicU64::new(d.kv_capacity),
            prompt_limit: AtomicU64::new(d.max_prompt_tokens.unwrap_or(u64::MAX)),
            kv_lease_ms: AtomicU64::new(d.kv_lease_ms.unwrap_or(0)),
        }
    }

    /// The longest prompt the verified workers accept, where they report one.
    pub(crate) fn prompt_limit(&self) -> Option<u64> {
        Some(self.prompt_limit.load(Ordering::Acquire)).filter(|l| *l != u64::MAX)
    }

    /// Lowers the limits to `d`'s where they are lower.
    pub fn tighten(&self, d: &crate::backend::Deployment) {
        self.kv_capacity.fetch_min(d.kv_capacity, Ordering::AcqRel);
        if let Some(p) = d.max_prompt_tokens {
            self.prompt_limit.fetch_min(p, Ordering::AcqRel);
        }
        if let Some(l) = d.kv_lease_ms {
            self.kv_lease_ms.fetch_max(l, Ordering::AcqRel);
        }
    }
}

impl ModelRuntime {
    /// Whether this model's backend sends the prompt's ids as JSON (so admission may write them
    /// once, off the async threads, for a long prompt).
    pub fn ids_as_json(&self) -> bool {
        self.pairs.backend.capabilities().ids_as_json
    }
    /// The KV capacity admission uses: the configured one, or less when workers reported less.
    pub fn kv_capacity(&self) -> u64 {
        self.limits.kv_capacity.load(Ordering::Acquire)
    }

    /// The longest prompt the workers accept, where they report one.
    pub fn worker_prompt_limit(&self) -> Option<u64> {
        self.limits.prompt_limit()
    }

    /// The longest an aborted pair's KV can stay held on its workers after the failure, by
    /// backend: SGLang, lockstep's abort confirmation (`abort_confirm_ms`) plus SGLang's own
    /// notice of a client that went away (4 s for a non-streamed half, 2 s after a stream);
    /// vLLM, the prefill's KV lease (`vllm.kv_lease_ms`; the decode's dropped request is its
    /// abort); lockstep workers, the longest room lease they report (the Abort RPC frees at
    /// once when it lands; a worker it cannot reach lets go at its lease); the embedded engine
    /// frees at its next step.
    pub fn stranded_kv_bound(&self) -> std::time::Duration {
        use std::time::Duration;
        match self.cfg.backend {
            lockstep_core::config::BackendKind::Sglang => {
                self.cfg.timeouts.abort_confirm() + Duration::from_secs(4)
            }
            lockstep_core::config::BackendKind::Vllm => {
                Duration::from_millis(self.cfg.vllm.kv_lease_ms)
            }
            lockstep_core::config::BackendKind::Lockstep => {
                match self.limits.kv_lease_ms.load(Ordering::Acquire) {
                    // Not reported yet: the worker's default lease.
                    0 => Duration::from_secs(30),
                    l => Duration::from_millis(l),
                }
            }
            lockstep_core::config::BackendKind::Embedded => Duration::ZERO,
        }
    }
}

/// One generation of served models. Reload builds a new one and swaps it in atomically; pairs in
/// flight keep the `ModelRuntime` they started with.
#[derive(Debug, Default)]
pub struct Models {
    /// Models by name.
    pub by_name: BTreeMap<String, Arc<ModelRuntime>>,
    /// The tenants of the same configuration: swapped in with the models, in one store, so no
    /// request sees one configuration's models with another's tenants.
    pub tenants: Arc<lockstep_tenancy::tenant::Tenants>,
    pub(crate) health: Vec<JoinHandle<()>>,
}

impl Drop for Models {
    fn drop(&mut self) {
        for t in &self.health {
            t.abort();
        }
    }
}

/// Shared state of the front ends.
#[derive(Debug)]
pub struct AppState {
    /// The current generation of models, with the tenants.
    pub models: ArcSwap<Models>,
    /// Live pairs of all models.
    pub registry: Arc<PairRegistry>,
    /// Outcome counters of all models.
    pub stats: Arc<PairStats>,
    /// Prometheus metrics.
    pub metrics: Arc<Metrics>,
    /// The audit log (`server.audit_log`; a reload keeps the one opened at start).
    pub audit: Arc<Audit>,
    /// Largest accepted body.
    pub max_body_bytes: usize,
    /// Bound on receiving a body (`server.body_timeout_ms`).
    pub body_timeout: std::time::Duration,
    /// The configuration file (admin reload re-reads it); `None` for the built-in one.
    pub config_path: Option<std::path::PathBuf>,
    /// Worker URLs an operator is draining (re-applied to the workers of a reloaded config).
    pub drained: dashmap::DashSet<String>,
    /// The client every upstream call goes through (pooled, per connection thread).
    pub client: UpstreamClient,
    /// Long prompts tokenizing on the blocking pool at once (one per core).
    pub(crate) tokenize_slots: Arc<tokio::sync::Semaphore>,
    /// Admissions that compile a grammar, at once (one per core).
    pub(crate) compile_slots: Arc<tokio::sync::Semaphore>,
    /// Embedded-engine embeddings computed at once (one: the engines' threads share the cores).
    pub(crate) embed_slots: tokio::sync::Semaphore,
    /// The threads long prompts tokenize on, below the async threads' priority.
    pub(crate) tokenize_threads: Arc<rayon::ThreadPool>,
    /// Held for the whole of a reload: reloads run one at a time.
    pub(crate) reload_lock: tokio::sync::Mutex<()>,
    /// The process role this router serves in ([`Role`]: the router's own, or a gateway role's).
    pub role: Arc<dyn Role>,
    /// Stored responses and conversations (`[state]`).
    pub responses: crate::stored::ResponseState,
    /// Requests with an `Idempotency-Key` header (`[idempotency]`).
    pub idempotency: crate::idempotency::Idempotency,
}

impl AppState {
    /// Every metric in the Prometheus text format. The gauges are collected here, in one place,
    /// from the live models now (workers and pools of a reloaded-away configuration disappear):
    /// per-worker in-flight pairs and health, per-engine KV pages, and the counters kept by the
    /// engines and pools (prefix-cache hits, prefix routing) caught up.
    pub fn render_metrics(&self) -> String {
        let m = &self.metrics;
        m.workers.worker_inflight.reset();
        m.workers.worker_healthy.reset();
        m.engines.kv_pages.reset();
        m.pairs.stranded_kv_bound_seconds.reset();
        m.workers.kv_capacity_tokens.reset();
        for model in self.models.load().by_name.values() {
            let name = &*model.name;
            m.workers
                .kv_capacity_tokens
                .with_label_values(&[name])
                .set(i64::try_from(model.kv_capacity()).unwrap_or(i64::MAX));
            m.pairs
                .stranded_kv_bound_seconds
                .with_label_values(&[name])
                .set(model.stranded_kv_bound().as_secs_f64());
            if let Some((hit, miss)) = model.codec.segment_cache_counts() {
                for (result, n) in [("hit", hit), ("miss", miss)] {
                    catch_up(
                        &m.admission
                            .tokenizer_cache_bytes
                            .with_label_values(&[name, result]),
                        n,
                    );
                }
            }
            if let Some(pd) = &model.engine {
                for (engine, e) in pd.engines() {
                    let s = e.stats();
                    let total = s.total_pages.load(Ordering::Relaxed) as i64;
                    let free = s.free_pages.load(Ordering::Relaxed) as i64;
                    m.engines
                        .kv_pages
                        .with_label_values(&[name, engine, "free"])
                        .set(free);
                    m.engines
                        .kv_pages
                        .with_label_values(&[name, engine, "used"])
                        .set(total - free);
                    // The engine counts; the counter catches up (a reloaded engine restarts at 0
                    // and the counter waits until it passes the old count).
                    catch_up(
                        &m.engines
                            .prefix_cache_hit_tokens
                            .with_label_values(&[name, engine]),
                        s.prefix_hit_tokens.load(Ordering::Relaxed) as u64,
                    );
                    catch_up(
                        &m.engines
                            .kv_import_shared_tokens
                            .with_label_values(&[name, engine]),
                        s.import_shared_tokens.load(Ordering::Relaxed) as u64,
                    );
                }
            }
            for (side, pool) in [
                ("prefill", &model.pairs.prefill),
                ("decode", &model.pairs.decode),
            ] {
                let (routed, hit) = pool.prefix_prediction();
                catch_up(
                    &m.workers
                        .prefix_routed_tokens
                        .with_label_values(&[name, side]),
                    routed,
                );
                catch_up(
                    &m.workers
                        .prefix_predicted_hit_tokens
                        .with_label_values(&[name, side]),
                    hit,
                );
                let ev = pool.event_stats();
                for (result, n) in [
                    ("applied", ev.batches),
                    ("unreadable", ev.errors),
                    ("too_large", ev.too_large),
                ] {
                    catch_up(
                        &m.workers
                            .kv_event_batches
                            .with_label_values(&[name, side, result]),
                        n,
                    );
                }
                catch_up(
                    &m.workers.kv_event_gaps.with_label_values(&[name, side]),
                    ev.gaps,
                );
                m.workers
                    .kv_event_blocks
                    .with_label_values(&[name, side])
                    .set(ev.blocks as i64);
                for w in pool.workers().iter() {
                    let label = w.label(side);
                    let labels = [name, side, label.as_str()];
                    m.workers
                        .worker_inflight
                        .with_label_values(&labels)
                        .set(w.in_flight() as i64);
                    m.workers
                        .worker_healthy
                        .with_label_values(&labels)
                        .set(i64::from(w.is_healthy()));
                }
            }
        }
        m.render()
    }
}

/// Brings a counter up to a count kept elsewhere (a component rebuilt by a reload restarts at 0:
/// the counter waits until the new count passes it).
fn catch_up(c: &prometheus::IntCounter, now: u64) {
    if now > c.get() {
        c.inc_by(now - c.get());
    }
}

/// What a role read off one request's headers ([`Role::on_headers`]), carried with the caller to
/// the role's later phases; `None` when it read nothing.
pub type RoleData = Option<Arc<dyn std::any::Any + Send + Sync>>;

/// A process role: how `lockstep serve` (the router's own role, [`Router`]) and the
/// gateway roles (`lockstep sidecar` and `lockstep epp`, in `lockstep-gateway`) differ. A role is
/// found again from the state by upcasting to `dyn Any` (`&*state.role as &dyn Any`). The
/// router calls the phases at fixed points of a request and of the process; each has a default,
/// the router's own behaviour, and a role overrides only the phases it changes (the shape of
/// Pingora's `ProxyHttp`). The router never names a role.
///
/// Phases, in the order a request meets them:
/// 1. [`Role::on_headers`]: after the API key names the tenant, before any body is read;
/// 2. [`Role::pin_prefill`]: after the prompt is known to fit and the tenant's limits are
///    taken, before the pair is made;
///
/// and for the process: [`Role::http_routes`] (the HTTP listener), [`Role::serves_grpc`] (the
/// gRPC front end beside it), [`Role::needs_prefill_workers`] (readiness).
pub trait Role: std::any::Any + Send + Sync + std::fmt::Debug {
    /// The role's name, for logs.
    fn name(&self) -> &'static str;

    /// Phase 1: what the role reads from a request's headers (an error refuses the request,
    /// counted once). Default: nothing.
    fn on_headers(&self, _headers: &HeaderMap) -> Result<RoleData, LockstepError> {
        Ok(None)
    }

    /// Phase 2: the prefill the pair of an admitted request on `model` uses, from what
    /// [`Role::on_headers`] read (`data`); `prompt_tokens`: the prompt's length. Default: the
    /// prefill pool's policy picks ([`PrefillPin::Pool`]).
    fn pin_prefill<'a>(
        &'a self,
        _model: &'a Arc<ModelRuntime>,
        _data: &'a RoleData,
        _prompt_tokens: usize,
    ) -> BoxFuture<'a, Result<PrefillPin, LockstepError>> {
        Box::pin(async { Ok(PrefillPin::Pool) })
    }

    /// The routes of the HTTP listener (`with_metrics`: `/metrics` is served there, not moved to
    /// the admin listener); the router adds the fallback and the request span. Default (`None`):
    /// the router's own (`http::default_routes`: the generation APIs, `/v1/models`, `/health`,
    /// `/ready`, `/metrics`).
    fn http_routes(
        &self,
        _state: &Arc<AppState>,
        _with_metrics: bool,
    ) -> Option<axum::Router<Arc<AppState>>> {
        None
    }

    /// Whether the gRPC front end (`lockstep.v1`, health, reflection) shares the HTTP listener.
    /// Default: yes.
    fn serves_grpc(&self) -> bool {
        true
    }

    /// Whether a model is ready only with a healthy prefill worker. Default: yes.
    fn needs_prefill_workers(&self) -> bool {
        true
    }
}

/// The router's own role (`lockstep serve`): every phase at its default.
#[derive(Debug, Clone, Copy, Default)]
pub struct Router;

impl Role for Router {
    fn name(&self) -> &'static str {
        "router"
    }
}

//! Building a running lockstep from a configuration: models, pools, backends, health checks,
//! the deployment check against what workers report, and the HTTP server.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use lockstep_engine::engine::{EngineConfig, ModelBundle, WhenFull};
use lockstep_engine::pd::{Fault, FaultPlan, Pd};
use lockstep_engine::pool::{KvDtype, ScrubPolicy, VerifyMode};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::admission::Admission;
use crate::audit::Audit;
use crate::backend::embedded::EmbeddedBackend;
use crate::backend::sglang::SglangBackend;
use crate::backend::{PdBackend, UpstreamClient};
use crate::config::{
    BackendKind, Config, EngineMode, EngineSection, FaultKind, ModelConfig, PoolConfig, ScrubKind,
    WhenFullKind, WorkerConfig, deployment_check,
};
use crate::metrics::Metrics;
use crate::pair::{PairRegistry, PairRuntime, PairStats};
use crate::pool::{WorkerPool, health_loop};
use crate::tenant::Tenants;

/// One served model.
#[derive(Debug)]
pub struct ModelRuntime {
    /// The name clients use.
    pub name: Arc<str>,
    /// Its configuration.
    pub cfg: ModelConfig,
    /// Tokenizer and chat template.
    pub admission: Arc<Admission>,
    /// Its pair lifecycle and pools.
    pub pairs: Arc<PairRuntime>,
    /// The embedded engines, for `backend = "embedded"`.
    pub engine: Option<Arc<Pd>>,
    kv_capacity: AtomicU64,
}

impl std::fmt::Debug for PairRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PairRuntime")
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

impl ModelRuntime {
    /// The KV capacity admission uses: the configured one, or less when workers reported less.
    pub fn kv_capacity(&self) -> u64 {
        self.kv_capacity.load(Ordering::Acquire)
    }
}

/// One generation of served models. Reload builds a new one and swaps it in atomically; pairs in
/// flight keep the `ModelRuntime` they started with.
#[derive(Debug, Default)]
pub struct Models {
    /// Models by name.
    pub by_name: BTreeMap<String, Arc<ModelRuntime>>,
    health: Vec<JoinHandle<()>>,
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
    /// The current generation of models.
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
    /// Set while shutting down: `/ready` fails.
    pub draining: AtomicBool,
    /// Tenants and their keys and limits (swapped on reload).
    pub tenants: ArcSwap<Tenants>,
    /// The configuration file (admin reload re-reads it); `None` for the built-in one.
    pub config_path: Option<std::path::PathBuf>,
    /// Worker URLs an operator is draining (re-applied to the workers of a reloaded config).
    pub drained: dashmap::DashSet<String>,
    client: UpstreamClient,
}

/// The capacity a worker reports (SGLang `/get_server_info` → `max_total_num_tokens`).
pub async fn probe_capacity(client: &UpstreamClient, base: &str) -> Option<u64> {
    let url = format!("{base}/get_server_info");
    let (status, body) = tokio::time::timeout(Duration::from_secs(2), client.get_collect(&url))
        .await
        .ok()?
        .ok()?;
    if !(200..300).contains(&status) {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
    v.get("max_total_num_tokens")
        .or_else(|| v.pointer("/internal_states/0/max_total_num_tokens"))
        .and_then(serde_json::Value::as_u64)
}

/// Invariant 6 against live workers: the effective capacity is the smaller of the configured one
/// and every capacity a worker reports. Returns it, or every problem found.
pub async fn check_deployment(client: &UpstreamClient, m: &ModelConfig) -> Result<u64, String> {
    if m.backend == BackendKind::Lockstep {
        return crate::backend::lockstep::check_deployment(client.connect_timeout(), m).await;
    }
    let mut capacity = m.kv_capacity_tokens;
    let mut source = "configured kv_capacity_tokens".to_string();
    for w in m.prefill.workers.iter().chain(&m.decode.workers) {
        match probe_capacity(client, w.url.trim_end_matches('/')).await {
            Some(reported) if reported < capacity => {
                capacity = reported;
                source = format!("reported by worker {}", w.url);
            }
            Some(_) => {}
            None => {
                tracing::warn!(model = %m.name, worker = %w.url, "worker did not report a KV capacity; using the configured one")
            }
        }
    }
    deployment_check(&m.name, m.context_window, m.headroom, capacity, &source)?;
    Ok(capacity)
}

/// Reloads the models and tenants of `st` from `cfg`: validate, deployment check against the
/// workers, build, then swap atomically (SIGHUP and the admin API). On any problem the running
/// configuration stays and the reasons are returned. Pairs in flight finish on the configuration
/// they started with; workers an operator drains stay drained.
pub async fn reload_state(st: &AppState, cfg: Config) -> Result<(), String> {
    let models = build_models(
        &cfg,
        &st.client,
        &st.registry,
        &st.stats,
        &st.metrics,
        &st.audit,
    )
    .await?;
    for m in models.by_name.values() {
        for w in m
            .pairs
            .prefill
            .workers()
            .iter()
            .chain(m.pairs.decode.workers())
        {
            w.set_draining(st.drained.contains(&w.url));
        }
    }
    let names: Vec<_> = models.by_name.keys().cloned().collect();
    st.models.store(Arc::new(models));
    st.tenants.store(Arc::new(Tenants::new(&cfg.tenants)));
    tracing::info!(models = ?names, "configuration reloaded");
    Ok(())
}

/// Serves `app` on `listener` (HTTP/1.1 and h2c on one port, or HTTPS with HTTP/1.1 and h2 when
/// `tls` is set) until `stop` fires, then lets open connections finish (bounded: 10 s). A client
/// that has not completed its TLS handshake and request headers within `header_timeout` is
/// disconnected (slow-header attacks), and small SSE frames are not held back by Nagle.
pub(crate) async fn serve_http(
    listener: TcpListener,
    app: axum::Router,
    header_timeout: Duration,
    tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
    stop: tokio::sync::oneshot::Receiver<()>,
) {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    // h2 (gRPC, KV pushes of many MiB): windows and frames sized for bulk streams, so a
    // sender is never stalled waiting for window updates on a fast link.
    builder
        .http2()
        .timer(TokioTimer::new())
        .initial_stream_window_size(8 << 20)
        .initial_connection_window_size(16 << 20)
        .max_frame_size(1 << 20);
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    // TLS handshakes run in their own tasks and hand the stream back here, so every connection is
    // watched by the one graceful-shutdown owner.
    let (tls_tx, mut tls_rx) =
        tokio::sync::mpsc::channel::<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>(64);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                match &acceptor {
                    None => {
                        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
                        let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc);
                        let conn = graceful.watch(conn.into_owned());
                        tokio::spawn(async move {
                            let _ = conn.await;
                        });
                    }
                    Some(acceptor) => {
                        let (acceptor, tx) = (acceptor.clone(), tls_tx.clone());
                        tokio::spawn(async move {
                            match tokio::time::timeout(header_timeout, acceptor.accept(stream)).await {
                                Ok(Ok(t)) => {
                                    let _ = tx.send(t).await;
                                }
                                Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                                Err(_) => tracing::debug!("TLS handshake timed out"),
                            }
                        });
                    }
                }
            }
            Some(tls) = tls_rx.recv() => {
                let svc = hyper_util::service::TowerToHyperService::new(app.clone());
                let conn = builder.serve_connection_with_upgrades(TokioIo::new(tls), svc);
                let conn = graceful.watch(conn.into_owned());
                tokio::spawn(async move {
                    let _ = conn.await;
                });
            }
            _ = &mut stop => break,
        }
    }
    drop(listener);
    let _ = tokio::time::timeout(Duration::from_secs(10), graceful.shutdown()).await;
}

/// A running lockstep: its state, address and background tasks.
#[derive(Debug)]
pub struct Lockstep {
    /// Shared state.
    pub state: Arc<AppState>,
    /// Where the HTTP listener is bound.
    pub http_addr: SocketAddr,
    /// Where the admin listener is bound, when configured.
    pub admin_addr: Option<SocketAddr>,
    tasks: ServerTasks,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    admin_shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    drain_grace: Duration,
    health: tonic_health::server::HealthReporter,
}

/// Builds every model of `cfg`: deployment check against the workers, tokenizer and template,
/// pools, backend, health checks. Lists every problem rather than build a partial set.
async fn build_models(
    cfg: &Config,
    client: &UpstreamClient,
    registry: &Arc<PairRegistry>,
    stats: &Arc<PairStats>,
    metrics: &Arc<Metrics>,
    audit: &Arc<Audit>,
) -> Result<Models, String> {
    let problems = cfg.problems();
    if !problems.is_empty() {
        return Err(problems.join("\n"));
    }
    let mut models = Models::default();
    let mut errors = Vec::new();
    for m in &cfg.models {
        let built = match m.backend {
            BackendKind::Sglang | BackendKind::Vllm => build_remote(m, client).await,
            BackendKind::Embedded => build_embedded(m).await,
            BackendKind::Lockstep => build_lockstep(m, client).await,
        };
        let Built {
            capacity,
            admission,
            backend,
            prefill,
            decode,
            engine,
        } = match built {
            Ok(b) => b,
            Err(e) => {
                errors.push(e);
                continue;
            }
        };
        if engine.is_none() {
            let workers = prefill
                .workers()
                .iter()
                .chain(decode.workers())
                .cloned()
                .collect();
            models.health.push(tokio::spawn(health_loop(
                client.clone(),
                workers,
                m.health.clone(),
            )));
        }
        let name: Arc<str> = m.name.as_str().into();
        let pairs = Arc::new(PairRuntime {
            model: name.clone(),
            backend,
            prefill,
            decode,
            registry: registry.clone(),
            timeouts: m.timeouts.clone(),
            retry: m.retry.clone(),
            stats: stats.clone(),
            metrics: metrics.clone(),
            audit: audit.clone(),
        });
        tracing::info!(model = %name, context_window = m.context_window, kv_capacity = capacity, "model ready");
        models.by_name.insert(
            m.name.clone(),
            Arc::new(ModelRuntime {
                name,
                cfg: m.clone(),
                admission,
                pairs,
                engine,
                kv_capacity: AtomicU64::new(capacity),
            }),
        );
    }
    if errors.is_empty() {
        Ok(models)
    } else {
        Err(errors.join("\n"))
    }
}

/// What one model's backend needs, built.
struct Built {
    capacity: u64,
    admission: Arc<Admission>,
    backend: Arc<dyn PdBackend>,
    prefill: Arc<WorkerPool>,
    decode: Arc<WorkerPool>,
    engine: Option<Arc<Pd>>,
}

/// A remote-worker model: deployment check against the workers, tokenizer and template files.
async fn build_remote(m: &ModelConfig, client: &UpstreamClient) -> Result<Built, String> {
    let capacity = check_deployment(client, m).await?;
    let admission = Admission::load(m)?;
    Ok(Built {
        capacity,
        admission,
        backend: match m.backend {
            BackendKind::Vllm => Arc::new(crate::backend::vllm::VllmBackend::new(
                client.clone(),
                &m.name,
                m.vllm.clone(),
            )),
            _ => Arc::new(SglangBackend::new(client.clone())),
        },
        prefill: Arc::new(WorkerPool::new(&m.prefill)),
        decode: Arc::new(WorkerPool::new(&m.decode)),
        engine: None,
    })
}

/// A `lockstep`-worker model: deployment check through the workers' `Capacity` (KV capacity,
/// roles, one model across all of them); tokenizer and template from files or the model file.
async fn build_lockstep(m: &ModelConfig, client: &UpstreamClient) -> Result<Built, String> {
    let capacity = check_deployment(client, m).await?;
    let admission = match &m.engine {
        None => Admission::load(m)?,
        Some(e) => {
            let (e, name) = (e.clone(), m.name.clone());
            tokio::task::spawn_blocking(move || {
                let path = crate::fetch::ensure_model(&e)
                    .map_err(|err| format!("model `{name}`: {err}"))?;
                let g = lockstep_engine::gguf::open(&path)
                    .map_err(|err| format!("model `{name}`: {}: {err}", path.display()))?;
                let t = lockstep_engine::tokenizer::ModelTokenizer::from_gguf(&g)
                    .map_err(|err| format!("model `{name}`: {}: {err}", path.display()))?;
                model_file_admission(&name, &t)
            })
            .await
            .map_err(|err| format!("model `{}`: tokenizer load panicked: {err}", m.name))??
        }
    };
    Ok(Built {
        capacity,
        admission,
        backend: Arc::new(crate::backend::lockstep::LockstepBackend::new(
            client.connect_timeout(),
        )),
        prefill: Arc::new(WorkerPool::new(&m.prefill)),
        decode: Arc::new(WorkerPool::new(&m.decode)),
        engine: None,
    })
}

/// Admission from a model file's own tokenizer and chat template, so the router and the engine
/// count and render alike.
fn model_file_admission(
    name: &str,
    t: &lockstep_engine::tokenizer::ModelTokenizer,
) -> Result<Arc<Admission>, String> {
    let template = t
        .chat_template
        .clone()
        .ok_or_else(|| format!("model `{name}`: the model file has no chat template"))?;
    Admission::new(
        name,
        t.inner.clone(),
        template,
        t.decode(&[t.bos]),
        t.decode(&[t.eos]),
    )
}

/// The engine settings of a section.
pub fn engine_config(e: &EngineSection) -> EngineConfig {
    EngineConfig {
        pages: e.kv_pages,
        page_size: e.page_size,
        dtype: KvDtype::F16,
        scrub: match e.scrub {
            ScrubKind::None => ScrubPolicy::None,
            ScrubKind::OnFree => ScrubPolicy::OnFree,
        },
        verify: VerifyMode::Always,
        max_batch_tokens: e.max_batch_tokens,
        max_running: e.max_running,
        when_full: match e.when_full {
            WhenFullKind::Wait => WhenFull::Wait,
            WhenFullKind::Refuse => WhenFull::Refuse,
        },
        prefix_cache: e.prefix_cache,
    }
}

/// An embedded model: fetch (if absent) and verify the file, load it, start the engines; the
/// router's tokenizer and chat template are the model file's own. Capacity is one pool's tokens.
async fn build_embedded(m: &ModelConfig) -> Result<Built, String> {
    let e = m
        .engine
        .clone()
        .ok_or_else(|| format!("model `{}`: no [models.engine] section", m.name))?;
    let name = m.name.clone();
    let (pd, admission) = tokio::task::spawn_blocking(move || {
        let path = crate::fetch::ensure_model(&e).map_err(|err| format!("model `{name}`: {err}"))?;
        let device = e
            .device
            .parse::<lockstep_engine::cuda::DeviceChoice>()
            .map_err(|err| format!("model `{name}`: engine.{err}"))?;
        let bundle = Arc::new(
            ModelBundle::open_on(&path, device).map_err(|err| format!("model `{name}`: {err}"))?,
        );
        tracing::info!(model = %name, device = %bundle.device(), "embedded engine device");
        let admission = model_file_admission(&name, &bundle.tokenizer)?;
        let cfg = engine_config(&e);
        let faults = e.fault.map(|f| FaultPlan {
            fault: match f {
                FaultKind::CorruptPage => Fault::CorruptPage,
                FaultKind::DropPage => Fault::DropPage,
                FaultKind::SwapPages => Fault::SwapPages,
                FaultKind::RejectWithDecoy => Fault::RejectWithDecoy,
            },
            every: e.fault_every,
        });
        if faults.is_some() {
            tracing::warn!(model = %name, fault = ?e.fault, "KV transfer FAULT INJECTION is on: unsafe, for tests only");
        }
        let pd = match e.mode {
            EngineMode::Split => Pd::split(bundle, cfg, cfg, faults),
            EngineMode::Unified => Pd::unified(bundle, cfg),
        }
        .map_err(|err| format!("model `{name}`: engine: {err}"))?;
        tracing::info!(model = %name, mode = ?e.mode, file = %path.display(), kv_pages = e.kv_pages, page_size = e.page_size, "embedded engine ready (cpu)");
        Ok::<_, String>((Arc::new(pd), admission))
    })
    .await
    .map_err(|err| format!("model `{}`: engine start panicked: {err}", m.name))??;
    let capacity = m.configured_capacity();
    deployment_check(
        &m.name,
        m.context_window,
        m.headroom,
        capacity,
        "the embedded engine's KV pool",
    )?;
    let pool = |side: &str| {
        Arc::new(WorkerPool::new(&PoolConfig {
            policy: Default::default(),
            workers: vec![WorkerConfig {
                url: format!("embedded://{}/{side}", m.name),
                bootstrap_port: None,
                bootstrap_host: None,
            }],
            max_pairs_per_worker: 0,
            prefix: Default::default(),
        }))
    };
    Ok(Built {
        capacity,
        admission,
        backend: Arc::new(EmbeddedBackend::new(pd.clone())),
        prefill: pool("prefill"),
        decode: pool("decode"),
        engine: Some(pd),
    })
}

impl Lockstep {
    /// Builds everything from `cfg`, runs the deployment check against the workers, binds the
    /// listener and starts serving. Fails (naming every problem) rather than start unsafe.
    pub async fn start(cfg: Config) -> Result<Lockstep, String> {
        let client = UpstreamClient::with_ca(
            Duration::from_millis(cfg.server.connect_timeout_ms),
            cfg.server.upstream_ca_file.as_deref(),
        )?;
        let registry = Arc::new(PairRegistry::default());
        let stats = Arc::new(PairStats::default());
        let metrics = Arc::new(Metrics::new());
        let audit = Arc::new(Audit::open(&cfg.server.audit_log)?);
        let models = build_models(&cfg, &client, &registry, &stats, &metrics, &audit).await?;
        let state = Arc::new(AppState {
            models: ArcSwap::from_pointee(models),
            registry,
            stats,
            metrics,
            audit,
            max_body_bytes: cfg.server.max_body_bytes,
            draining: AtomicBool::new(false),
            tenants: ArcSwap::from_pointee(Tenants::new(&cfg.tenants)),
            config_path: cfg.source.clone(),
            drained: dashmap::DashSet::new(),
            client,
        });
        let listener = TcpListener::bind(cfg.server.http_listen)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", cfg.server.http_listen))?;
        let http_addr = listener.local_addr().map_err(|e| e.to_string())?;
        let mut tasks = Vec::new();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        // The gRPC front end shares the listener (h2c, or h2 by ALPN under TLS).
        let (grpc, health) = crate::http::grpc::services(state.clone());
        crate::http::grpc::set_serving(&health, true).await;
        let app = crate::http::router(state.clone()).merge(grpc);
        let header_timeout = Duration::from_millis(cfg.server.header_timeout_ms);
        let tls = match (&cfg.server.tls_cert_file, &cfg.server.tls_key_file) {
            (Some(c), Some(k)) => Some(crate::tls::server_config(c, k)?),
            _ => None,
        };
        tasks.push(tokio::spawn(serve_http(
            listener,
            app,
            header_timeout,
            tls.clone(),
            rx,
        )));
        let (admin_tx, admin_rx) = tokio::sync::oneshot::channel::<()>();
        let admin_addr = match cfg.server.admin_listen {
            None => None,
            Some(addr) => {
                let key = crate::tenant::parse_sha256_hex(&cfg.server.admin_key_sha256)
                    .ok_or("server.admin_key_sha256: 64 lowercase hex digits required")?;
                let l = TcpListener::bind(addr)
                    .await
                    .map_err(|e| format!("cannot listen on {addr} (admin): {e}"))?;
                let bound = l.local_addr().map_err(|e| e.to_string())?;
                let router = crate::admin::router(crate::admin::AdminState {
                    app: state.clone(),
                    key_sha256: key,
                });
                // The admin server is spawned first so the main server stays the last task
                // (shutdown awaits that one).
                tasks.insert(
                    0,
                    tokio::spawn(serve_http(l, router, header_timeout, tls.clone(), admin_rx)),
                );
                tracing::info!(%bound, "admin API listening");
                Some(bound)
            }
        };
        tracing::info!(%http_addr, "lockstep listening (HTTP/1.1 and h2c)");
        Ok(Lockstep {
            state,
            http_addr,
            admin_addr,
            tasks: ServerTasks(tasks),
            shutdown: Some(tx),
            admin_shutdown: Some(admin_tx),
            drain_grace: Duration::from_millis(cfg.server.drain_grace_ms),
            health,
        })
    }

    /// Reloads the models from `cfg`: validate, deployment check against the workers, build, then
    /// swap atomically. On any problem the running configuration stays and the reasons are
    /// returned. Pairs in flight finish on the configuration they started with. `server.*`
    /// settings (listener, body limit, threads) need a restart.
    pub async fn reload(&self, cfg: Config) -> Result<(), String> {
        reload_state(&self.state, cfg).await
    }

    /// Drains: `/ready` fails and new requests get 503 at once; every pair that has not
    /// committed is aborted on both halves now (its client gets an error); committed streams may
    /// finish within `grace`; whatever is still live then is aborted on both halves too. Returns
    /// when no pair is live (bounded: grace + 5 s for the aborts to land).
    pub async fn drain(&self, grace: Duration) {
        use crate::pair::{CancelReason, PairState};
        let st = &self.state;
        st.draining.store(true, Ordering::Release);
        crate::http::grpc::set_serving(&self.health, false).await;
        let live = st.registry.len();
        tracing::info!(
            live_pairs = live,
            grace_ms = grace.as_millis() as u64,
            "draining: committed streams may finish, the rest are aborted"
        );
        let start = tokio::time::Instant::now();
        // Uncommitted pairs are aborted at once; repeated, so a pair registered by a request that
        // raced the flag is caught too.
        while !st.registry.is_empty() && start.elapsed() < grace {
            st.registry
                .cancel_where(|s| s != PairState::Committed, CancelReason::Shutdown);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let late = st.registry.cancel_where(|_| true, CancelReason::Shutdown);
        if late > 0 {
            tracing::warn!(pairs = late, "drain grace over: aborting committed streams");
        }
        let bound = tokio::time::Instant::now() + Duration::from_secs(5);
        while !st.registry.is_empty() && tokio::time::Instant::now() < bound {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if !st.registry.is_empty() {
            tracing::error!(
                pairs = st.registry.len(),
                "pairs still live after the drain"
            );
        }
    }

    /// Drains (see [`Lockstep::drain`]) within `server.drain_grace_ms`, then stops accepting, lets
    /// the last responses end and stops background tasks.
    pub async fn shutdown(mut self) {
        self.drain(self.drain_grace).await;
        if let Some(tx) = self.admin_shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.tasks.finish().await;
    }
}

/// A server's background tasks, the serving task last. Dropping aborts them all.
#[derive(Debug, Default)]
pub(crate) struct ServerTasks(pub(crate) Vec<JoinHandle<()>>);

impl ServerTasks {
    /// Once the server was told to stop: waits for the serving task (bounded: 10 s), then
    /// aborts the others.
    pub(crate) async fn finish(&mut self) {
        if let Some(server) = self.0.pop() {
            let _ = tokio::time::timeout(Duration::from_secs(10), server).await;
        }
        for t in self.0.drain(..) {
            t.abort();
        }
    }
}

impl Drop for ServerTasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

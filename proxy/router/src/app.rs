//! A running lockstep router: built from a configuration, serving its HTTP (and gRPC) listener
//! and its admin listener, drained and shut down on request.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use lockstep_runtime::accept::{ConnLimits, serve_http};
use lockstep_runtime::tasks::ServerTasks;
use tokio::net::TcpListener;

use crate::backend::UpstreamClient;
use crate::models::{build_models, reload_state};
use crate::pair::{PairRegistry, PairStats};
use crate::state::AppState;
use lockstep_core::audit::Audit;
use lockstep_core::config::Config;
use lockstep_core::metrics::Metrics;
use lockstep_tenancy::tenant::Tenants;

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

impl Lockstep {
    /// Builds everything from `cfg`, runs the deployment check against the workers, binds the
    /// listener and starts serving as the router's own role (`lockstep serve`). Fails
    /// (naming every problem) rather than start unsafe.
    pub async fn start(cfg: Config) -> Result<Lockstep, String> {
        // The gateway roles' tables would be ignored here: refused, not dropped.
        for (table, role) in [
            ("sidecar", cfg.sidecar.is_some()),
            ("epp", cfg.epp.is_some()),
        ] {
            if role {
                return Err(format!(
                    "[{table}] is read by `lockstep {table}` (lockstep-gateway); the router's own role would ignore it"
                ));
            }
        }
        Lockstep::start_as(cfg, Arc::new(crate::state::Router)).await
    }

    /// [`Lockstep::start`] in the process role `role` (its phases: [`crate::state::Role`]).
    pub async fn start_as(
        cfg: Config,
        role: Arc<dyn crate::state::Role>,
    ) -> Result<Lockstep, String> {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let state = build_state(&cfg, role, cores).await?;
        let threads = conn_threads(&cfg, cores)?;
        let listener = TcpListener::bind(cfg.server.http_listen)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", cfg.server.http_listen))?;
        let http_addr = listener.local_addr().map_err(|e| e.to_string())?;
        let mut tasks = Vec::new();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        // The gRPC front end shares the listener (h2c, or h2 by ALPN under TLS).
        let grpc_limits = crate::http::grpc::GrpcLimits {
            max_long_streams: cfg.server.grpc_max_long_streams,
            stream_lifetime: Duration::from_millis(cfg.server.grpc_stream_lifetime_ms),
        };
        let (grpc, health) = crate::http::grpc::services(state.clone(), grpc_limits);
        crate::http::grpc::set_serving(&health, true).await;
        let app = crate::http::router(state.clone(), !cfg.server.metrics_on_admin);
        // A role may serve no gRPC front end (`lockstep epp`: its HTTP listener has its own
        // health, readiness and metrics only; nothing there may drive an engine).
        let app = if state.role.serves_grpc() {
            app.merge(grpc)
        } else {
            app
        };
        let header_timeout = Duration::from_millis(cfg.server.header_timeout_ms);
        let tls = match (&cfg.server.tls_cert_file, &cfg.server.tls_key_file) {
            (Some(c), Some(k)) => Some(lockstep_runtime::tls::ServerTls::Fixed(
                lockstep_runtime::tls::server_config(c, k)?,
            )),
            _ => None,
        };
        let limits = ConnLimits {
            header_timeout,
            max_connections: cfg.server.max_connections,
            idle_timeout: Duration::from_millis(cfg.server.idle_timeout_ms),
            max_concurrent_streams: Some(cfg.server.max_concurrent_streams),
        };
        tasks.push(tokio::spawn(serve_http(
            listener,
            app,
            limits,
            tls.clone(),
            threads,
            rx,
        )));
        let (admin_tx, admin_rx) = tokio::sync::oneshot::channel::<()>();
        let admin_addr = match cfg.server.admin_listen {
            None => None,
            Some(addr) => {
                let (bound, task) =
                    serve_admin(&cfg, addr, &state, limits, tls.clone(), admin_rx).await?;
                // The admin server is spawned first so the main server stays the last task
                // (shutdown awaits that one).
                tasks.insert(0, task);
                Some(bound)
            }
        };
        tracing::info!(
            %http_addr,
            role = state.role.name(),
            connections = ?cfg.server.connections,
            "lockstep listening (HTTP/1.1 and h2c)"
        );
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
    /// when no pair is live and every abort call has answered (bounded: grace + 5 s for the
    /// aborts to land), so a shutdown never cancels an abort on its way to a worker.
    pub async fn drain(&self, grace: Duration) {
        use crate::pair::{CancelReason, PairState};
        let st = &self.state;
        // One flag: admission refuses, `/ready` fails and no failed pair is retried from here.
        st.registry.set_draining();
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
        let busy = || !st.registry.is_empty() || st.registry.aborts_in_flight() > 0;
        while busy() && tokio::time::Instant::now() < bound {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if busy() {
            tracing::error!(
                pairs = st.registry.len(),
                aborts_in_flight = st.registry.aborts_in_flight(),
                "pairs or abort calls still live after the drain"
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

/// The shared state of a router started from `cfg` in `role`: the upstream client, the models
/// (deployment-checked), the tenants with their shared store, the registry, metrics, audit log
/// and the tokenizer threads (`cores` of them).
async fn build_state(
    cfg: &Config,
    role: Arc<dyn crate::state::Role>,
    cores: usize,
) -> Result<Arc<AppState>, String> {
    let client = UpstreamClient::with_ca(
        Duration::from_millis(cfg.server.connect_timeout_ms),
        cfg.server.upstream_ca_file.as_deref(),
    )?;
    let registry = Arc::new(PairRegistry::default());
    let stats = Arc::new(PairStats::default());
    if let Some(s) = &cfg.server.cache_salt_secret {
        lockstep_tenancy::tenant::set_salt_secret(s.expose().as_bytes());
    }
    let metrics = Arc::new(Metrics::new());
    let audit = Arc::new(Audit::open(&cfg.server.audit_log)?);
    let mut models = build_models(cfg, &client, &registry, &stats, &metrics, &audit, None).await?;
    let shared = match &cfg.shared {
        Some(s) => Some(lockstep_tenancy::shared::SharedStore::start(s, metrics.clone()).await?),
        None => None,
    };
    models.tenants = Arc::new(Tenants::shared(&cfg.tenants, shared));
    let responses = crate::stored::ResponseState::open(&cfg.state).await?;
    let tokenize_threads = lockstep_prompt::background::threads(cores)
        .map_err(|e| format!("cannot start the tokenizer threads: {e}"))?;
    crate::backend::warm_ids_json();
    let idempotency =
        crate::idempotency::Idempotency::new(cfg.idempotency.clone(), metrics.clone());
    let state = Arc::new(AppState {
        models: ArcSwap::from_pointee(models),
        registry,
        stats,
        metrics,
        audit,
        max_body_bytes: cfg.server.max_body_bytes,
        body_timeout: Duration::from_millis(cfg.server.body_timeout_ms),
        config_path: cfg.source.clone(),
        drained: dashmap::DashSet::new(),
        client,
        reload_lock: tokio::sync::Mutex::new(()),
        tokenize_slots: Arc::new(tokio::sync::Semaphore::new(cores)),
        compile_slots: Arc::new(tokio::sync::Semaphore::new(cores)),
        embed_slots: tokio::sync::Semaphore::new(1),
        tokenize_threads: Arc::new(tokenize_threads),
        role,
        responses,
        idempotency,
    });
    Ok(state)
}

/// The connection threads (`server.connections = "pinned"`): `server.worker_threads` of them
/// (0: one per core), each polling its event loop for `server.busy_poll_us` before it sleeps.
fn conn_threads(
    cfg: &Config,
    cores: usize,
) -> Result<Option<Arc<lockstep_runtime::threads::ConnThreads>>, String> {
    Ok(match cfg.server.connections {
        lockstep_core::config::Connections::Shared => None,
        lockstep_core::config::Connections::Pinned => {
            let n = match cfg.server.worker_threads {
                0 => cores,
                n => n,
            };
            let busy_poll = (cfg.server.busy_poll_us > 0)
                .then(|| Duration::from_micros(cfg.server.busy_poll_us));
            let (t, polling) = lockstep_runtime::threads::ConnThreads::start_polling(
                n,
                "lockstep-conn",
                busy_poll,
            )
            .map_err(|e| format!("cannot start the connection threads: {e}"))?;
            if let Some(b) = busy_poll {
                if polling == n {
                    tracing::info!(
                        "connection threads: {n}, each polling up to {} µs before it sleeps",
                        b.as_micros()
                    );
                } else {
                    tracing::warn!(
                        "connection threads: busy polling asked for, but {} of {n} threads' event loops could not be found to poll; those run without",
                        n - polling
                    );
                }
            }
            Some(Arc::new(t))
        }
    })
}

/// The admin API on `addr` (`server.admin_listen`), behind `server.admin_key_sha256`: its bound
/// address and its server task, which ends when `stop` fires.
async fn serve_admin(
    cfg: &Config,
    addr: std::net::SocketAddr,
    state: &Arc<AppState>,
    limits: ConnLimits,
    tls: Option<lockstep_runtime::tls::ServerTls>,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>), String> {
    let key = lockstep_tenancy::tenant::parse_sha256_hex(&cfg.server.admin_key_sha256)
        .ok_or("server.admin_key_sha256: 64 lowercase hex digits required")?;
    let l = TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr} (admin): {e}"))?;
    let bound = l.local_addr().map_err(|e| e.to_string())?;
    let router = crate::admin::router(
        crate::admin::AdminState {
            app: state.clone(),
            key_sha256: key,
        },
        cfg.server.metrics_on_admin,
    );
    // A few operators at most: a small fixed cap.
    let task = tokio::spawn(serve_http(
        l,
        router,
        ConnLimits {
            max_connections: 64,
            ..limits
        },
        tls,
        None,
        stop,
    ));
    tracing::info!(%bound, "admin API listening");
    Ok((bound, task))
}

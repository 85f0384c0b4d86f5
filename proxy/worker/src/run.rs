//! A running worker: the service on its listener (gRPC over h2c, plus `GET /health`), the KV data
//! listener of a decode or unified worker, and the sweeper that drops expired rooms.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use lockstep_proto::MAX_MESSAGE_BYTES;
use lockstep_proto::v1::worker_server::WorkerServer;
use lockstep_runtime::accept::{ConnLimits, serve_http};
use lockstep_runtime::tasks::ServerTasks;

use crate::config::{Role, WorkerFile};
use crate::data;
use crate::service::WorkerService;

/// Bound on a connection's TLS handshake and request headers.
const HANDSHAKE: Duration = Duration::from_secs(10);

/// The worker's routes: the gRPC service and `GET /health` (for HTTP health checkers).
pub fn router(svc: Arc<WorkerService>) -> axum::Router {
    let health = svc.clone();
    let grpc = WorkerServer::from_arc(svc)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    tonic::service::Routes::new(grpc).into_axum_router().route(
        "/health",
        axum::routing::get(move || {
            let ok = health.is_serving();
            async move {
                if ok {
                    http::StatusCode::OK
                } else {
                    http::StatusCode::SERVICE_UNAVAILABLE
                }
            }
        }),
    )
}

/// A running worker.
#[derive(Debug)]
pub struct RunningWorker {
    /// The service.
    pub service: Arc<WorkerService>,
    /// Where it listens.
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    tasks: ServerTasks,
}

impl RunningWorker {
    /// Loads the engine, binds the listener, serves, and sweeps expired rooms.
    pub async fn start(role: Role, file: WorkerFile) -> Result<RunningWorker, String> {
        let f = file.clone();
        let service = tokio::task::spawn_blocking(move || WorkerService::start(role, &f))
            .await
            .map_err(|e| format!("worker start panicked: {e}"))??;
        let service = Arc::new(service);
        let listener = tokio::net::TcpListener::bind(file.worker.listen)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", file.worker.listen))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let mut tasks = Vec::new();
        if role != Role::Prefill {
            let at = file
                .worker
                .kv_listen
                .unwrap_or_else(|| SocketAddr::new(addr.ip(), 0));
            let data = tokio::net::TcpListener::bind(at)
                .await
                .map_err(|e| format!("cannot listen on {at} (KV data): {e}"))?;
            let data_addr = data.local_addr().map_err(|e| e.to_string())?;
            service.set_data_port(data_addr.port());
            let receiver = data::Receiver {
                rooms: service.rooms().clone(),
                serving: service.serving_flag().clone(),
                total_pages: service.total_pages(),
                page_bytes: service.page_bytes(),
            };
            // A slot first, then the connection: past the cap, new ones wait in the kernel's
            // accept queue.
            let slots = Arc::new(tokio::sync::Semaphore::new(
                file.worker.max_data_connections,
            ));
            let tls = service.tls().cloned();
            tasks.push(tokio::spawn(async move {
                loop {
                    let Ok(slot) = slots.clone().acquire_owned().await else {
                        return;
                    };
                    match data.accept().await {
                        Ok((c, _)) => {
                            let _ = c.set_nodelay(true);
                            let r = receiver.clone();
                            let tls = tls.clone();
                            tokio::spawn(async move {
                                match tls {
                                    None => data::serve_connection(c, r).await,
                                    Some(tls) => {
                                        let accept =
                                            tokio_rustls::TlsAcceptor::from(tls.server()).accept(c);
                                        match tokio::time::timeout(HANDSHAKE, accept).await {
                                            Ok(Ok(c)) => data::serve_connection(c, r).await,
                                            Ok(Err(e)) => {
                                                tracing::debug!(error = %e, "KV data: TLS handshake failed")
                                            }
                                            Err(_) => {
                                                tracing::debug!("KV data: TLS handshake timed out")
                                            }
                                        }
                                    }
                                }
                                drop(slot);
                            });
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "KV data accept failed");
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                }
            }));
            tracing::info!(%data_addr, "KV data listener");
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let serve = tokio::spawn(serve_http(
            listener,
            router(service.clone()),
            ConnLimits {
                header_timeout: HANDSHAKE,
                // Routers and peer workers only: a handful of long-lived h2 connections.
                max_connections: 1_024,
                idle_timeout: Duration::from_millis(file.worker.idle_timeout_ms),
                // A router multiplexes every pair of its own onto a few connections.
                max_concurrent_streams: None,
            },
            service
                .tls()
                .map(|t| lockstep_runtime::tls::ServerTls::Plane(t.clone())),
            // A handful of h2 connections whose streams must spread over the cores: the
            // shared runtime.
            None,
            rx,
        ));
        let sweeper = {
            let s = service.clone();
            let every = (s.rooms().lease() / 4).max(Duration::from_millis(50));
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                loop {
                    tick.tick().await;
                    let n = s.sweep();
                    if n > 0 {
                        tracing::warn!(
                            sets = n,
                            "dropped KV rooms whose lease ran out (peer lost mid-pair?)"
                        );
                    }
                }
            })
        };
        if service.tls().is_some() {
            tracing::info!(%addr, role = role.as_str(), "lockstep worker listening (gRPC, h2 over mutual TLS)");
        } else {
            if file.worker.insecure_plaintext {
                tracing::warn!(
                    "worker.insecure_plaintext: the worker plane is unauthenticated and unencrypted (UNSAFE)"
                );
            }
            tracing::info!(%addr, role = role.as_str(), "lockstep worker listening (gRPC, h2c)");
        }
        tasks.push(sweeper);
        tasks.push(serve);
        Ok(RunningWorker {
            service,
            addr,
            stop: Some(tx),
            tasks: ServerTasks(tasks),
        })
    }

    /// Stops serving: health fails, then the listener closes and open calls finish (bounded).
    pub async fn shutdown(mut self) {
        self.service.set_serving(false);
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.tasks.finish().await;
    }
}

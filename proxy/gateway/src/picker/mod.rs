//! `lockstep epp`: an Endpoint Picker for the Gateway API Inference Extension (its protocol:
//! gateway-api-inference-extension `docs/proposals/004-endpoint-picker-protocol`), serving
//! Envoy's `ext_proc` v3 with request and response bodies `FULL_DUPLEX_STREAMED`.
//!
//! For each request Envoy streams the headers and the body here. The picker reads the body to
//! its end, runs lockstep's admission stage on it (tenant key and limits, every field honoured or
//! refused, the prompt tokenized and refused when it cannot fit) and lockstep's pool policies
//! (tenant-salted prefix routing, least load, each worker's pair limit) to pick the decode, a
//! `lockstep sidecar` (`[models.decode]` lists the sidecars), and the prefill (`[models.prefill]`:
//! the prefill engines). It answers the headers with the destination, in the
//! `x-gateway-destination-endpoint` header and in `envoy.lb` dynamic metadata, the prefill in
//! `x-prefiller-host-port` (replacing whatever the client sent), and `clear_route_cache`; then
//! the body, unchanged, in chunks of at most 62 KiB. The response streams back through as it
//! comes; the picked workers' slots are held until it ends.
//!
//! Fail closed: a refusal, no worker, a protocol message out of order or any internal error is
//! an `ImmediateResponse` in the API's own error shape, never a pass-through; Envoy's filter is
//! configured with `failure_mode_allow: false`, so a picker that is down fails the request too.

mod exchange;
pub mod policy;
mod wire;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use lockstep_core::config::{Config, EppConfig};
use lockstep_router::app::Lockstep;
use lockstep_router::state::{AppState, Role};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

pub use wire::{DESTINATION, SERVED, SUBSET, SUBSET_NAMESPACE, fuzz_message};

/// The gRPC health service names the protocol asks for, besides the ext_proc service's own.
pub const HEALTH_SERVICES: &[&str] = &["liveness", "readiness"];

/// The ext_proc service.
#[derive(Debug, Clone)]
pub struct Picker {
    state: Arc<AppState>,
    chunk: usize,
    /// One permit per stream served (`epp.max_streams`).
    streams: Arc<tokio::sync::Semaphore>,
    /// One permit per body byte held (`epp.max_buffered_bytes`).
    buffered: Arc<tokio::sync::Semaphore>,
}

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        // Past the cap a stream is refused before any of it is read; Envoy answers the request
        // with its `status_on_error`.
        let Ok(stream) = self.streams.clone().try_acquire_owned() else {
            self.state.metrics.refusal("", "unavailable");
            return Err(Status::resource_exhausted(
                "the endpoint picker serves epp.max_streams streams already",
            ));
        };
        let inbound = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let exchange = exchange::Exchange::new(
            self.state.clone(),
            self.chunk,
            tx,
            stream,
            self.buffered.clone(),
        );
        tokio::spawn(exchange.run(inbound));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// The picker's role in the router: requests reach it through Envoy's `ext_proc` only, so its
/// HTTP listener serves the process's health, readiness and metrics and nothing that could drive
/// a worker, and no gRPC front end.
#[derive(Debug, Clone, Copy, Default)]
pub struct PickerRole;

impl Role for PickerRole {
    fn name(&self) -> &'static str {
        "epp"
    }

    fn http_routes(
        &self,
        _state: &Arc<AppState>,
        with_metrics: bool,
    ) -> Option<axum::Router<Arc<AppState>>> {
        use axum::routing::get;
        use lockstep_router::http::{health, metrics, ready};
        let r = axum::Router::new()
            .route("/health", get(health))
            .route("/ready", get(ready));
        Some(if with_metrics {
            r.route("/metrics", get(metrics))
        } else {
            r
        })
    }

    fn serves_grpc(&self) -> bool {
        false
    }
}

/// Starts `lockstep epp` from `cfg` (fitted with `Config::for_role`: its `[epp]` table): the
/// router in the picker's role (models, pools, tenants; no engine, the role allows none) and the
/// ext_proc listener over it.
pub async fn start(mut cfg: Config) -> Result<(Lockstep, RunningPicker), String> {
    // Fitted here too, whoever calls: a picker never starts an engine or another role's table.
    cfg.for_role(lockstep_core::config::Role::Epp)?;
    let epp = cfg.epp.clone().ok_or("a picker needs its [epp] table")?;
    let lockstep = Lockstep::start_as(cfg, Arc::new(PickerRole)).await?;
    match serve(lockstep.state.clone(), &epp).await {
        Ok(p) => Ok((lockstep, p)),
        Err(e) => {
            lockstep.shutdown().await;
            Err(e)
        }
    }
}

/// A running picker: its gRPC listener's address and how to stop it.
#[derive(Debug)]
pub struct RunningPicker {
    /// Where the ext_proc and health services listen.
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl RunningPicker {
    /// Stops serving (streams in progress are cut; Envoy fails their requests closed).
    pub async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), &mut self.task).await;
    }
}

/// Serves the picker as `cfg` says (`[epp]`: its listener, the largest body chunk sent back to
/// Envoy, the most streams at once) over `state` (the models, pools and tenants of a lockstep
/// started from the same configuration).
pub async fn serve(state: Arc<AppState>, cfg: &EppConfig) -> Result<RunningPicker, String> {
    let listen = cfg.grpc_listen;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("cannot listen on {listen} (epp.grpc_listen): {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let (reporter, health) = tonic_health::server::health_reporter();
    let ready = readiness(&state);
    set_health(&reporter, true, ready).await;
    let picker = Picker {
        state: state.clone(),
        chunk: cfg.body_chunk_bytes,
        streams: Arc::new(tokio::sync::Semaphore::new(cfg.max_streams)),
        buffered: Arc::new(tokio::sync::Semaphore::new(cfg.max_buffered_bytes)),
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let watch_state = state.clone();
    let watch_reporter = reporter.clone();
    // Readiness follows the pools: ready while every model has a decode and a prefill that take
    // pairs.
    let watcher = tokio::spawn(async move {
        let mut last = ready;
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let now = readiness(&watch_state);
            if now != last {
                set_health(&watch_reporter, true, now).await;
                last = now;
            }
        }
    });
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let task = tokio::spawn(async move {
        let served = tonic::transport::Server::builder()
            .add_service(health)
            .add_service(ExternalProcessorServer::new(picker))
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            })
            .await;
        watcher.abort();
        if let Err(e) = served {
            tracing::error!(error = %e, "the endpoint picker's listener stopped");
        }
    });
    tracing::info!(%addr, "endpoint picker listening (Envoy ext_proc v3, gRPC health)");
    Ok(RunningPicker {
        addr,
        stop: Some(stop),
        task,
    })
}

fn readiness(state: &AppState) -> bool {
    let models = state.models.load();
    !state.registry.is_draining()
        && models
            .by_name
            .values()
            .all(|m| m.pairs.decode.any_healthy() && m.pairs.prefill.any_healthy())
}

async fn set_health(r: &tonic_health::server::HealthReporter, alive: bool, ready: bool) {
    use tonic_health::ServingStatus::{NotServing, Serving};
    let of = |on: bool| if on { Serving } else { NotServing };
    r.set_service_status("liveness", of(alive)).await;
    r.set_service_status("readiness", of(ready)).await;
    r.set_service_status("envoy.service.ext_proc.v3.ExternalProcessor", of(ready))
        .await;
    r.set_service_status("", of(ready)).await;
}

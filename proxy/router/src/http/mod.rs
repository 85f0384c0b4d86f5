//! The HTTP front end: OpenAI-compatible and SGLang-native routes, health and readiness.

mod generate;
pub mod grpc;
mod openai;
mod respond;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http::{HeaderMap, Method, Uri};
use http_body_util::{BodyExt, Limited};
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::error::LockstepError;
use crate::state::{AppState, ModelRuntime};

/// The router of all HTTP routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/models", get(models))
        .route("/generate", post(generate::generate))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(axum::middleware::from_fn(trace_request))
        .with_state(state)
}

/// One `request` span per HTTP request, child of the client's `traceparent` when it sent one.
async fn trace_request(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    use tracing::Instrument;
    let span = tracing::info_span!(
        "request",
        otel.name = %format!("{} {}", req.method(), req.uri().path()),
        http.method = %req.method(),
        http.route = %req.uri().path(),
    );
    lockstep_serve::telemetry::adopt_parent(&span, req.headers());
    next.run(req).instrument(span).await
}

/// A request refused before any pair was dispatched: counted by model (empty when the request
/// named no known model yet) and error code, then answered.
pub(crate) fn refused(state: &AppState, model: &str, e: LockstepError) -> Response {
    state
        .metrics
        .admission_refusals
        .with_label_values(&[model, e.code()])
        .inc();
    e.into_response()
}

async fn not_found(method: Method, uri: Uri) -> Response {
    LockstepError::RouteNotFound {
        method: method.to_string(),
        path: uri.path().to_string(),
    }
    .into_response()
}

async fn health() -> Response {
    axum::Json(json!({ "status": "ok" })).into_response()
}

/// Ready when not draining and every model has a healthy prefill and a healthy decode worker.
async fn ready(State(state): State<Arc<AppState>>) -> Response {
    let mut not_ready = Vec::new();
    if state.draining.load(Ordering::Acquire) {
        not_ready.push("draining".to_string());
    }
    for m in state.models.load().by_name.values() {
        for (side, pool) in [("prefill", &m.pairs.prefill), ("decode", &m.pairs.decode)] {
            if !pool.any_healthy() {
                not_ready.push(format!("model `{}` has no healthy {side} worker", m.name));
            }
        }
    }
    if not_ready.is_empty() {
        axum::Json(json!({ "status": "ready" })).into_response()
    } else {
        (
            http::StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({ "status": "not_ready", "reasons": not_ready })),
        )
            .into_response()
    }
}

/// Prometheus text exposition. The per-worker and per-pool gauges are read from the live models
/// now (workers and pools of a reloaded-away configuration disappear).
async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let m = &state.metrics;
    m.worker_inflight.reset();
    m.worker_healthy.reset();
    m.kv_pages.reset();
    for model in state.models.load().by_name.values() {
        let name = &*model.name;
        if let Some(pd) = &model.engine {
            for (engine, e) in pd.engines() {
                let s = e.stats();
                let total = s.total_pages.load(Ordering::Relaxed) as i64;
                let free = s.free_pages.load(Ordering::Relaxed) as i64;
                m.kv_pages
                    .with_label_values(&[name, engine, "free"])
                    .set(free);
                m.kv_pages
                    .with_label_values(&[name, engine, "used"])
                    .set(total - free);
                // The engine counts; the counter catches up (a reloaded engine restarts at 0
                // and the counter waits until it passes the old count).
                catch_up(
                    &m.prefix_cache_hit_tokens.with_label_values(&[name, engine]),
                    s.prefix_hit_tokens.load(Ordering::Relaxed) as u64,
                );
            }
        }
        for (side, pool) in [
            ("prefill", &model.pairs.prefill),
            ("decode", &model.pairs.decode),
        ] {
            let (routed, hit) = pool.prefix_prediction();
            catch_up(
                &m.prefix_routed_tokens.with_label_values(&[name, side]),
                routed,
            );
            catch_up(
                &m.prefix_predicted_hit_tokens
                    .with_label_values(&[name, side]),
                hit,
            );
            for w in pool.workers() {
                let labels = [name, side, w.url.as_str()];
                m.worker_inflight
                    .with_label_values(&labels)
                    .set(w.in_flight() as i64);
                m.worker_healthy
                    .with_label_values(&labels)
                    .set(i64::from(w.is_healthy()));
            }
        }
    }
    (
        [(
            http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        m.render(),
    )
        .into_response()
}

/// Brings a counter up to a count kept elsewhere (a component rebuilt by a reload restarts at 0:
/// the counter waits until the new count passes it).
fn catch_up(c: &prometheus::IntCounter, now: u64) {
    if now > c.get() {
        c.inc_by(now - c.get());
    }
}

async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let tenant = match state.tenants.load().authenticate(&headers) {
        Ok(t) => t,
        Err(e) => return refused(&state, "", e),
    };
    let data: Vec<_> = state
        .models
        .load()
        .by_name
        .values()
        .filter(|m| tenant.as_ref().is_none_or(|t| t.allows(&m.name)))
        .map(|m| {
            json!({
                "id": &*m.name,
                "object": "model",
                "created": 0,
                "owned_by": "lockstep",
                "max_model_len": m.cfg.context_window,
            })
        })
        .collect();
    axum::Json(json!({ "object": "list", "data": data })).into_response()
}

/// Reads the body within the configured limit and parses it as `T`, mapping every failure to a
/// stable error code: 413 `body_too_large`, 400 `invalid_json` or 400 `invalid_request` (with the
/// offending field as `param`).
pub(crate) async fn read_json<T: DeserializeOwned>(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<T, LockstepError> {
    let limit = state.max_body_bytes;
    let declared = headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        linger(body).await;
        return Err(LockstepError::BodyTooLarge { limit });
    }
    let mut body = body;
    let mut buf = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| LockstepError::InvalidJson {
            message: format!("cannot read body: {e}"),
        })?;
        if let Ok(data) = frame.into_data() {
            if buf.len() + data.len() > limit {
                linger(body).await;
                return Err(LockstepError::BodyTooLarge { limit });
            }
            buf.extend_from_slice(&data);
        }
    }
    let bytes: Bytes = buf.freeze();
    if std::str::from_utf8(&bytes).is_err() {
        return Err(LockstepError::InvalidJson {
            message: "body is not valid UTF-8".into(),
        });
    }
    let de = &mut serde_json::Deserializer::from_slice(&bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_data() {
            LockstepError::InvalidRequest {
                message: format!("`{path}`: {inner}"),
                param: (path != ".").then_some(path),
            }
        } else {
            LockstepError::InvalidJson {
                message: inner.to_string(),
            }
        }
    })
}

/// Reads and discards what is left of a refused body (bounded in bytes and time) before the error
/// is sent, so the client, still writing, gets the 413 instead of a broken pipe (nginx calls
/// this a lingering close).
pub(crate) async fn linger(body: Body) {
    const DRAIN_BYTES: usize = 16 * 1024 * 1024;
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        Limited::new(body, DRAIN_BYTES).collect(),
    )
    .await;
}

/// Finds a model by name; `None` picks the only model when exactly one is configured.
pub(crate) fn find_model(
    state: &AppState,
    name: Option<&str>,
) -> Result<Arc<ModelRuntime>, LockstepError> {
    let models = state.models.load();
    let models = &models.by_name;
    match name {
        Some(n) => models
            .get(n)
            .cloned()
            .ok_or_else(|| LockstepError::ModelNotFound {
                model: n.to_string(),
            }),
        None if models.len() == 1 => {
            models
                .values()
                .next()
                .cloned()
                .ok_or(LockstepError::ModelNotFound {
                    model: String::new(),
                })
        }
        None => Err(LockstepError::InvalidRequest {
            message: "`model` is required when several models are served".into(),
            param: Some("model".into()),
        }),
    }
}

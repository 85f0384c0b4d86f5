//! The HTTP front end: OpenAI-compatible and SGLang-native routes, health and readiness.

pub(crate) mod anthropic;
mod apis;
mod choices;
mod content;
mod embeddings;
mod extract;
mod fields;
pub(crate) mod generate;
pub mod grpc;
mod grpc_guard;
mod idempotency;
mod idempotency_shared;
mod logprob_params;
mod logprobs;
pub(crate) mod openai;
mod openai_out;
mod openai_shape;
mod openapi;
pub(crate) mod other_fields;
mod respond;
pub(crate) mod responses;
mod responses_out;
pub mod routes;
mod sampling;
mod stored;
mod tokenize;

pub(crate) mod tools;
mod tools_generic;
mod tools_parse;

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use http::{Method, Uri};
use serde_json::json;

use crate::state::AppState;
use extract::Authenticated;
use lockstep_core::error::LockstepError;

pub use apis::Api;

/// The router of all HTTP routes: the role's ([`crate::state::Role::http_routes`]), else the
/// router's own ([`default_routes`]); unknown routes are 404 `route_not_found`, and each request
/// gets its span.
pub fn router(state: Arc<AppState>, with_metrics: bool) -> Router {
    let r = state
        .role
        .http_routes(&state, with_metrics)
        .unwrap_or_else(|| default_routes(&state, with_metrics));
    r.fallback(not_found)
        .layer(axum::middleware::from_fn(trace_request))
        .with_state(state)
}

/// The router's own routes, every one from the table ([`routes::ROUTES`]): the generation APIs
/// and `/ready` ([`generation_routes`]), `/v1/models`, the tokenizer endpoints, stored
/// responses and conversations, `/health`, `/openapi.json`, and `/metrics` unless
/// `server.metrics_on_admin` moves it behind the admin key.
pub fn default_routes(state: &Arc<AppState>, with_metrics: bool) -> Router<Arc<AppState>> {
    use routes::Group;
    routes::ROUTES
        .iter()
        .filter(|r| r.group == Group::Other || (r.group == Group::Metrics && with_metrics))
        .fold(generation_routes(state), |r, route| {
            r.route(route.path, (route.handler)())
        })
}

/// The generation APIs ([`Api`]), each answer with the tenant's rate headers, and `/ready`.
pub fn generation_routes(state: &Arc<AppState>) -> Router<Arc<AppState>> {
    use routes::Group;
    let of = |group: Group| {
        routes::ROUTES
            .iter()
            .filter(move |r| r.group == group)
            .fold(Router::new(), |r, route| {
                r.route(route.path, (route.handler)())
            })
    };
    let generation = of(Group::Generation)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            idempotency::idempotent,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            rate_headers,
        ));
    generation.merge(of(Group::Ready))
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
    lockstep_runtime::telemetry::adopt_parent(&span, req.headers());
    next.run(req).instrument(span).await
}

/// OpenAI's `x-ratelimit-*` headers on every answer of a generation route, success or error,
/// for a caller whose tenant has a token budget or a request rate ([`Tenant::rate_headers`]):
/// what is left after this request's reservation.
///
/// [`Tenant::rate_headers`]: lockstep_tenancy::tenant::Tenant::rate_headers
async fn rate_headers(
    State(state): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let tenant = state
        .models
        .load()
        .tenants
        .authenticate(req.headers())
        .ok()
        .flatten();
    let mut resp = next.run(req).await;
    for (k, v) in tenant.iter().flat_map(|t| t.rate_headers()) {
        if let Ok(v) = http::HeaderValue::from_str(&v) {
            resp.headers_mut().insert(k, v);
        }
    }
    resp
}

async fn not_found(method: Method, uri: Uri) -> Response {
    LockstepError::RouteNotFound {
        method: method.to_string(),
        path: uri.path().to_string(),
    }
    .into_response()
}

/// `GET /health`: the process is up.
pub async fn health() -> Response {
    axum::Json(json!({ "status": "ok" })).into_response()
}

/// Ready when not draining, every model has a healthy prefill and a healthy decode worker, and
/// every embedded engine thread is alive.
pub async fn ready(State(state): State<Arc<AppState>>) -> Response {
    let mut not_ready = Vec::new();
    if state.registry.is_draining() {
        not_ready.push("draining".to_string());
    }
    for m in state.models.load().by_name.values() {
        for (side, pool) in [("prefill", &m.pairs.prefill), ("decode", &m.pairs.decode)] {
            // A role may not need prefill workers (a sidecar's are named by its requests:
            // none may be known yet).
            let optional = side == "prefill" && !state.role.needs_prefill_workers();
            if !optional && !pool.any_healthy() {
                not_ready.push(format!("model `{}` has no healthy {side} worker", m.name));
            }
        }
        for (name, e) in m.engine.iter().flat_map(|pd| pd.engines()) {
            if !e.is_alive() {
                not_ready.push(format!("model `{}`: its {name} engine has stopped", m.name));
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

/// Prometheus text exposition ([`AppState::render_metrics`]).
pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.render_metrics(),
    )
        .into_response()
}

async fn models(
    State(state): State<Arc<AppState>>,
    Authenticated(tenant): Authenticated,
) -> Response {
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

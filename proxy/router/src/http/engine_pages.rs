//! `lockstep sidecar`: the local engine's own pages, passed through. An endpoint picker and
//! discovery check the worker behind each sidecar (SGLang's `/server_info`, vLLM's `/v1/models`
//! and `/metrics`, `/health`), so these answer as the engine answers; lockstep's own metrics move
//! to `/lockstep/metrics` (or the admin listener with `server.metrics_on_admin`).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::Uri;

use crate::error::LockstepError;
use crate::state::AppState;

/// The paths passed to the engine.
pub(crate) const ENGINE_PAGES: &[&str] = &[
    "/health",
    "/v1/models",
    "/metrics",
    "/server_info",
    "/get_server_info",
    "/get_model_info",
    "/model_info",
    "/version",
];

/// `r` with the engine's pages, and lockstep's metrics at `/lockstep/metrics` (`with_metrics`).
pub(crate) fn routes(mut r: Router<Arc<AppState>>, with_metrics: bool) -> Router<Arc<AppState>> {
    for p in ENGINE_PAGES {
        r = r.route(p, get(engine_page));
    }
    if with_metrics {
        r = r.route("/lockstep/metrics", get(super::metrics));
    }
    r
}

/// `GET` of one page of the local engine (the model's decode worker), answered as it answered:
/// status, `Content-Type`, body. The engine unreachable: 503 `unavailable`, so a prober sees a
/// worker it cannot use.
async fn engine_page(State(state): State<Arc<AppState>>, uri: Uri) -> Response {
    let models = state.models.load();
    let Some(engine) = models
        .by_name
        .values()
        .next()
        .and_then(|m| m.pairs.decode.workers().first().cloned())
    else {
        return unreachable_engine("no decode worker is configured".into());
    };
    let path = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
    let url = format!("{}{path}", engine.url);
    let headers = engine.headers(Vec::new(), false);
    match state.client.get_page(&url, &headers).await {
        Ok((status, kind, body)) => {
            let status =
                http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::BAD_GATEWAY);
            let mut r = (status, body).into_response();
            if let Some(k) = kind {
                r.headers_mut().insert(http::header::CONTENT_TYPE, k);
            }
            r
        }
        Err(e) => unreachable_engine(format!("{e:?}")),
    }
}

fn unreachable_engine(why: String) -> Response {
    LockstepError::Unavailable {
        message: format!("the local engine cannot be reached: {why}"),
    }
    .into_response()
}

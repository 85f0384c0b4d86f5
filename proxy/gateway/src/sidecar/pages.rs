//! `lockstep sidecar`: the local engine's own pages, passed through. An endpoint picker and
//! discovery check the worker behind each sidecar (SGLang's `/server_info`, vLLM's `/v1/models`
//! and `/metrics`, `/health`), so these answer as the engine answers; lockstep's own metrics move
//! to `/lockstep/metrics` (or the admin listener with `server.metrics_on_admin`).
//!
//! The engine's pages are the engine's, so they are held as its API is:
//! - `/health` is open (probes);
//! - every other page needs a tenant key, or the engine's own key (`[models.decode] api_key`,
//!   which a picker sharing the sidecars' configuration sends); open only when neither is
//!   configured. Checked on the headers, before the engine is called;
//! - `/server_info` and `/get_server_info` pass on only what the deployment check reads
//!   ([`lockstep_router::backend::sglang_info::SERVER_INFO_FIELDS`]): SGLang returns every server
//!   argument there, its `api_key` and `admin_api_key` included (sgl-project/sglang#30166);
//! - the engine's `/metrics` moves off this listener with `server.metrics_on_admin`, as
//!   lockstep's does.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::Uri;
use sha2::Digest;

use lockstep_core::error::LockstepError;
use lockstep_router::state::AppState;

/// The paths passed to the engine (`/metrics` besides, unless `server.metrics_on_admin`).
pub const ENGINE_PAGES: &[&str] = &[
    "/health",
    "/v1/models",
    "/server_info",
    "/get_server_info",
    "/get_model_info",
    "/model_info",
    "/version",
];

/// The pages whose JSON is cut to [`lockstep_router::backend::sglang_info::SERVER_INFO_FIELDS`].
const SERVER_INFO_PAGES: &[&str] = &["/server_info", "/get_server_info"];

/// `r` with the engine's pages, and lockstep's metrics at `/lockstep/metrics` and the engine's
/// at `/metrics` (`with_metrics`: not moved to the admin listener).
pub fn routes(mut r: Router<Arc<AppState>>, with_metrics: bool) -> Router<Arc<AppState>> {
    for p in ENGINE_PAGES {
        r = r.route(p, get(engine_page));
    }
    if with_metrics {
        r = r
            .route("/metrics", get(engine_page))
            .route("/lockstep/metrics", get(lockstep_router::http::metrics));
    }
    r
}

/// Whether the caller may read the engine's pages: `/health` always; else a tenant key, or the
/// engine's own key; anyone only when neither is configured.
fn may_read(
    state: &AppState,
    engine_key: Option<&str>,
    headers: &http::HeaderMap,
    path: &str,
) -> Result<(), LockstepError> {
    if path == "/health" {
        return Ok(());
    }
    let bearer = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let digest = |k: &str| -> [u8; 32] { sha2::Sha256::digest(k.as_bytes()).into() };
    if let (Some(want), Some(got)) = (engine_key, bearer)
        && digest(want) == digest(got)
    {
        return Ok(());
    }
    match state.models.load().tenants.authenticate(headers)? {
        Some(_) => Ok(()),
        None if engine_key.is_none() => Ok(()),
        None => Err(LockstepError::Unauthorized {
            message: "the engine's pages need an API key (Authorization: Bearer KEY)".into(),
        }),
    }
}

/// `GET` of one page of the local engine (the model's decode worker), answered as it answered:
/// status, `Content-Type`, body. The engine unreachable: 503 `unavailable`, so a prober sees a
/// worker it cannot use.
async fn engine_page(
    State(state): State<Arc<AppState>>,
    headers: http::HeaderMap,
    uri: Uri,
) -> Response {
    let models = state.models.load();
    let Some(model) = models.by_name.values().next() else {
        return unreachable_engine("no model is configured".into());
    };
    let engine_key = model.cfg.decode.api_key.as_ref().map(|k| k.expose());
    if let Err(e) = may_read(&state, engine_key, &headers, uri.path()) {
        return e.into_response();
    }
    let Some(engine) = model.pairs.decode.workers().first().cloned() else {
        return unreachable_engine("no decode worker is configured".into());
    };
    drop(models);
    let path = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
    let url = format!("{}{path}", engine.url);
    let headers = engine.headers(Vec::new(), false);
    match state.client.get_page(&url, &headers).await {
        Ok((status, kind, body)) => {
            let status =
                http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::BAD_GATEWAY);
            if SERVER_INFO_PAGES.contains(&uri.path()) && status.is_success() {
                // Only what the deployment check reads: never the engine's keys.
                return match serde_json::from_slice::<serde_json::Value>(&body) {
                    Ok(v) => (
                        status,
                        axum::Json(lockstep_router::backend::sglang_info::allowed_server_info(
                            &v,
                        )),
                    )
                        .into_response(),
                    Err(_) => unreachable_engine("its server info is not JSON".into()),
                };
            }
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

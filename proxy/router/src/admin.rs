//! The admin API, on its own listener (`server.admin_listen`) behind its own key
//! (`server.admin_key_sha256`, sent as `Authorization: Bearer KEY`):
//!
//! - `GET /admin/pairs`: live pairs (id, model, state, workers, age): never content.
//! - `POST /admin/pairs/{id}/abort`: aborts one pair on both halves (its client gets an error).
//! - `GET /admin/workers`: every worker with side, health, drain state and in-flight pairs.
//! - `POST /admin/workers/drain`, `/admin/workers/undrain` with `{"url": ...}`: a drained worker
//!   gets no new pairs, running ones finish (kept across reloads).
//! - `POST /admin/workers/add` with `{"model", "side", "url"}` (and `bootstrap_port`,
//!   `bootstrap_host` as in the configuration): a worker joins the model's pool at run time; it
//!   gets pairs once it passes the deployment check with the other workers (`GET /admin/workers`
//!   shows it `verified`). A reload keeps it. 202: the change is queued to the model.
//! - `POST /admin/workers/remove` with `{"model", "side", "url"}`: the worker leaves the pool; it
//!   takes no new pairs, those it runs finish. 202.
//! - `POST /admin/reload`: re-reads the configuration file and applies it as SIGHUP does
//!   (validate, deployment check, atomic swap); 422 with the reasons when refused.
//!
//! Errors use the same OpenAI-style body and codes as the front end.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::{HeaderMap, StatusCode};
use serde::Deserialize;
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::models::reload_state;
use crate::pair::{CancelReason, PairId};
use crate::state::AppState;
use lockstep_core::error::LockstepError;
use lockstep_core::ids::Side;
use lockstep_routing::pool::MemberChange;

/// What the admin handlers share.
#[derive(Debug, Clone)]
pub struct AdminState {
    /// The front end's state.
    pub app: Arc<AppState>,
    /// sha256 of the admin key.
    pub key_sha256: [u8; 32],
}

/// The admin router (with `/metrics` when `server.metrics_on_admin` is set).
pub fn router(state: AdminState, with_metrics: bool) -> Router {
    let r = Router::new();
    let r = if with_metrics {
        r.route(
            "/metrics",
            get(|State(st): State<AdminState>| crate::http::metrics(State(st.app))),
        )
    } else {
        r
    };
    r.route("/admin/pairs", get(pairs))
        .route("/admin/pairs/{id}/abort", post(abort_pair))
        .route("/admin/workers", get(workers))
        .route("/admin/workers/drain", post(drain_worker))
        .route("/admin/workers/undrain", post(undrain_worker))
        .route("/admin/workers/add", post(add_worker))
        .route("/admin/workers/remove", post(remove_worker))
        .route("/admin/reload", post(reload))
        .fallback(|| async {
            LockstepError::RouteNotFound {
                method: "?".into(),
                path: "admin".into(),
            }
            .into_response()
        })
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth))
        .with_state(state)
}

async fn auth(
    State(st): State<AdminState>,
    headers: HeaderMap,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let key = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let ok = key.is_some_and(|k| {
        let h: [u8; 32] = Sha256::digest(k.as_bytes()).into();
        // Constant-time comparison of the digests.
        h.iter()
            .zip(&st.key_sha256)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    });
    if !ok {
        return LockstepError::Unauthorized {
            message: "admin API: missing or wrong admin key".into(),
        }
        .into_response();
    }
    next.run(req).await
}

async fn pairs(State(st): State<AdminState>) -> Response {
    let list: Vec<_> = st
        .app
        .registry
        .snapshot()
        .into_iter()
        .map(|(id, i)| {
            json!({
                "pair_id": id.to_string(),
                "model": &*i.model,
                "state": i.state.as_str(),
                "prefill": i.prefill,
                "decode": i.decode,
                "age_ms": i.started.elapsed().as_millis() as u64,
            })
        })
        .collect();
    axum::Json(json!({ "pairs": list })).into_response()
}

async fn abort_pair(State(st): State<AdminState>, Path(id): Path<String>) -> Response {
    let Ok(raw) = id.parse::<u64>() else {
        return LockstepError::InvalidRequest {
            message: format!("`{id}` is not a pair id"),
            param: Some("id".into()),
        }
        .into_response();
    };
    let id = PairId::from_raw(raw);
    if st.app.registry.cancel(id, CancelReason::Operator) {
        tracing::warn!(pair = %id, "pair aborted by an operator");
        axum::Json(json!({ "pair_id": id.to_string(), "aborted": true })).into_response()
    } else {
        (
            StatusCode::NOT_FOUND,
            axum::Json(json!({ "error": { "message": format!("no live pair {id}"), "type": "invalid_request_error", "code": "not_found", "param": "id" } })),
        )
            .into_response()
    }
}

async fn workers(State(st): State<AdminState>) -> Response {
    let mut list = Vec::new();
    for m in st.app.models.load().by_name.values() {
        for (side, pool) in [("prefill", &m.pairs.prefill), ("decode", &m.pairs.decode)] {
            for w in pool.workers().iter() {
                list.push(json!({
                    "model": &*m.name,
                    "side": side,
                    "url": w.url,
                    "label": w.label(side),
                    "healthy": w.is_healthy(),
                    "verified": w.is_verified(),
                    "joined": w.joined(),
                    "draining": w.is_draining(),
                    "in_flight": w.in_flight(),
                }));
            }
        }
    }
    axum::Json(json!({ "workers": list })).into_response()
}

#[derive(Debug, Deserialize)]
struct WorkerRef {
    url: String,
}

fn set_drain(st: &AdminState, body: &[u8], on: bool) -> Response {
    let w: WorkerRef = match serde_json::from_slice(body) {
        Ok(w) => w,
        Err(e) => {
            return LockstepError::InvalidRequest {
                message: format!("expected {{\"url\": ...}}: {e}"),
                param: Some("url".into()),
            }
            .into_response();
        }
    };
    let url = w.url.trim_end_matches('/');
    let mut hit = 0;
    for m in st.app.models.load().by_name.values() {
        for pool in [&m.pairs.prefill, &m.pairs.decode] {
            for wk in pool.workers().iter().filter(|x| x.url == url) {
                wk.set_draining(on);
                hit += 1;
            }
        }
    }
    if on {
        st.app.drained.insert(url.to_string());
    } else {
        st.app.drained.remove(url);
    }
    if hit == 0 {
        return LockstepError::InvalidRequest {
            message: format!("no worker with url `{url}`"),
            param: Some("url".into()),
        }
        .into_response();
    }
    tracing::info!(worker = %url, draining = on, "worker drain changed by an operator");
    axum::Json(json!({ "url": url, "draining": on })).into_response()
}

async fn drain_worker(State(st): State<AdminState>, body: axum::body::Bytes) -> Response {
    set_drain(&st, &body, true)
}

async fn undrain_worker(State(st): State<AdminState>, body: axum::body::Bytes) -> Response {
    set_drain(&st, &body, false)
}

/// A worker to add to or remove from a model's pool.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Membership {
    model: String,
    side: String,
    url: String,
    #[serde(default)]
    bootstrap_port: Option<u16>,
    #[serde(default)]
    bootstrap_host: Option<String>,
}

fn bad(message: String, param: &str) -> LockstepError {
    LockstepError::InvalidRequest {
        message,
        param: Some(param.into()),
    }
}

/// Reads a membership change and checks it against the model it names.
fn membership(st: &AdminState, body: &[u8], join: bool) -> Result<(Side, String), LockstepError> {
    let req: Membership = serde_json::from_slice(body).map_err(|e| {
        bad(
            format!(
                "expected {{\"model\": ..., \"side\": \"prefill\" | \"decode\", \"url\": ...}}: {e}"
            ),
            "url",
        )
    })?;
    let side = match req.side.as_str() {
        "prefill" => Side::Prefill,
        "decode" => Side::Decode,
        other => {
            return Err(bad(
                format!("side must be `prefill` or `decode`, not `{other}`"),
                "side",
            ));
        }
    };
    let models = st.app.models.load();
    let Some(m) = models.by_name.get(&req.model) else {
        return Err(LockstepError::ModelNotFound { model: req.model });
    };
    let Some(feed) = &m.members else {
        return Err(bad(
            format!(
                "model `{}` runs on the embedded engine: it has no worker pools",
                req.model
            ),
            "model",
        ));
    };
    let url = req.url.trim_end_matches('/').to_string();
    let worker = lockstep_core::config::WorkerConfig {
        url: url.clone(),
        bootstrap_port: req.bootstrap_port,
        bootstrap_host: req.bootstrap_host,
        kv_events: None,
        kv_events_replay: None,
    };
    let change = if join {
        let problems = m.cfg.joining_problems(side == Side::Prefill, &worker);
        if !problems.is_empty() {
            return Err(bad(problems.join("\n"), "url"));
        }
        MemberChange::Join { side, worker }
    } else {
        MemberChange::Leave {
            side,
            url: url.clone(),
        }
    };
    if !feed.send(change) {
        return Err(LockstepError::Unavailable {
            message: "the model is being replaced; try again".into(),
        });
    }
    Ok((side, url))
}

/// Queues a membership change; 202 with what was queued.
fn change_members(st: &AdminState, body: &[u8], join: bool) -> Response {
    let (side, url) = match membership(st, body, join) {
        Ok(changed) => changed,
        Err(e) => return e.into_response(),
    };
    let what = if join { "joining" } else { "leaving" };
    tracing::info!(worker = %url, side = side.as_str(), change = what, "worker membership changed by an operator");
    (
        StatusCode::ACCEPTED,
        axum::Json(json!({ "url": url, "side": side.as_str(), what: true })),
    )
        .into_response()
}

async fn add_worker(State(st): State<AdminState>, body: axum::body::Bytes) -> Response {
    change_members(&st, &body, true)
}

async fn remove_worker(State(st): State<AdminState>, body: axum::body::Bytes) -> Response {
    change_members(&st, &body, false)
}

async fn reload(State(st): State<AdminState>) -> Response {
    let Some(path) = st.app.config_path.clone() else {
        return (
            StatusCode::CONFLICT,
            axum::Json(json!({ "error": { "message": "lockstep runs the built-in configuration: there is no file to reload", "type": "invalid_request_error", "code": "no_config_file", "param": null } })),
        )
            .into_response();
    };
    let result = match lockstep_core::config::Config::load(&path) {
        Ok(cfg) => reload_state(&st.app, cfg).await,
        Err(e) => Err(e.to_string()),
    };
    match result {
        Ok(()) => axum::Json(json!({ "reloaded": true, "config": path.display().to_string() }))
            .into_response(),
        Err(reasons) => {
            tracing::error!(config = %path.display(), "reload refused, keeping the running configuration:\n{reasons}");
            (
                StatusCode::UNPROCESSABLE_ENTITY,
                axum::Json(json!({ "error": { "message": reasons, "type": "invalid_request_error", "code": "reload_refused", "param": null } })),
            )
                .into_response()
        }
    }
}

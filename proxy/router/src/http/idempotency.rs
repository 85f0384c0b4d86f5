//! `Idempotency-Key` on the generation APIs (the IETF httpapi draft's semantics, as Stripe uses
//! them), per tenant, within `[idempotency] window_secs`:
//! - the first request with a key runs, and its answer is produced by a task of its own: the
//!   client reads it as it comes, and so does any repeat, so a client whose connection dropped
//!   can retry and get the same answer without a second generation;
//! - a repeat with the same body (method, path and bytes) is answered from the first: replayed
//!   whole when it finished, joined from its first event while it runs (`Idempotent-Replayed:
//!   true` on both);
//! - the same key with another body is 422 `idempotency_key_reused`;
//! - an answer that cannot be given again is 409: `idempotent_answer_not_kept` (over
//!   `max_answer_bytes`, or dropped to keep `max_total_bytes`), `idempotent_request_in_progress`
//!   (running on another replica, `Retry-After: 1`);
//! - an answer that a retry may change (5xx, 408, 429, a body cut short) is not kept: the key is
//!   forgotten, and a retry runs again.
//!
//! With `[shared]`, the replicas coordinate through Redis: a key is claimed there first, a
//! finished answer within `max_answer_bytes` is written there for the other replicas to replay.
//! The key is authenticated on the headers (its tenant) before the body is read; a request
//! without a valid key goes on to be refused as any other.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::BodyExt;
use sha2::{Digest, Sha256};

use super::extract::read_body;
use crate::idempotency::{Entry, Head, Idempotency, Lookup, Piece};
use crate::state::AppState;
use lockstep_core::error::LockstepError;

/// The header.
pub(crate) const HEADER: &str = "idempotency-key";

/// Longest a repeat waits for the first request's answer to begin.
const WAIT_HEAD: Duration = Duration::from_secs(600);

/// The key: 1 to 255 visible ASCII characters, bare or as a structured-field string (`"..."`).
fn parse_key(v: &http::HeaderValue) -> Result<String, LockstepError> {
    let bad = || LockstepError::InvalidRequest {
        message: "`Idempotency-Key` is 1 to 255 visible ASCII characters".into(),
        param: Some("Idempotency-Key".into()),
    };
    let s = v.to_str().map_err(|_| bad())?.trim();
    let s = s
        .strip_prefix('"')
        .and_then(|s| s.strip_suffix('"'))
        .unwrap_or(s);
    if s.is_empty() || s.len() > 255 || !s.bytes().all(|b| b.is_ascii_graphic() || b == b' ') {
        return Err(bad());
    }
    Ok(s.to_string())
}

/// The request's fingerprint: its method, path and body.
fn fingerprint(method: &http::Method, path: &str, body: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(method.as_str().as_bytes());
    h.update([0]);
    h.update(path.as_bytes());
    h.update([0]);
    h.update(body);
    h.finalize().into()
}

/// Whether a retry may get another answer than this status: then it is not kept.
fn passing(status: http::StatusCode) -> bool {
    status.is_server_error()
        || status == http::StatusCode::TOO_MANY_REQUESTS
        || status == http::StatusCode::REQUEST_TIMEOUT
}

/// The headers a replay repeats (hop-by-hop and length ones left out).
fn kept_headers(h: &http::HeaderMap) -> Vec<(http::HeaderName, http::HeaderValue)> {
    h.iter()
        .filter(|(k, _)| {
            !matches!(
                k.as_str(),
                "content-length" | "transfer-encoding" | "connection" | "keep-alive"
            )
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// `e` in the shape of the API at `path` (Anthropic's on `/v1/messages`, OpenAI's elsewhere).
fn refuse(path: &str, e: LockstepError) -> Response {
    match super::Api::of(path) {
        Some(api) => {
            let body = api.error_body(&e);
            e.into_response_with(body)
        }
        None => e.into_response(),
    }
}

/// The middleware on the generation routes.
pub(crate) async fn idempotent(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    let Some(raw) = req.headers().get(HEADER).cloned() else {
        return next.run(req).await;
    };
    let idem = &state.idempotency;
    let path = req.uri().path().to_string();
    if !idem.cfg.enabled {
        let e = LockstepError::Unsupported {
            message: "`Idempotency-Key` is not honoured here (`[idempotency] enabled = false`)"
                .into(),
            param: Some("Idempotency-Key".into()),
        };
        return refuse(&path, e);
    }
    let key = match parse_key(&raw) {
        Ok(k) => k,
        Err(e) => return refuse(&path, e),
    };
    let tenant = match state.models.load().tenants.authenticate(req.headers()) {
        Ok(t) => t.map(|t| t.name.to_string()).unwrap_or_default(),
        // Refused by the route as any request without a valid key, body unread.
        Err(_) => return next.run(req).await,
    };
    let (parts, body) = req.into_parts();
    let bytes = match read_body(&state, &parts.headers, body).await {
        Ok(b) => b,
        Err(e) => return refuse(&path, e),
    };
    let fp = fingerprint(&parts.method, parts.uri.path(), &bytes);
    match idem.lookup(&tenant, &key, fp) {
        Lookup::Mismatch => {
            idem.count("mismatch");
            refuse(&path, LockstepError::IdempotencyKeyReused { key })
        }
        Lookup::Seen(entry) => from_entry(idem, entry, &path).await,
        Lookup::New(entry) => {
            let shared = state.models.load().tenants.shared_store();
            if let Some(store) = shared {
                match super::idempotency_shared::claim(&store, &tenant, &key, &fp, idem).await {
                    Ok(None) => {}
                    Ok(Some(answer)) => {
                        idem.abandon(&tenant, &key, &entry);
                        return answer;
                    }
                    Err(e) => {
                        idem.abandon(&tenant, &key, &entry);
                        return refuse(&path, e);
                    }
                }
            }
            idem.count("first");
            let req = Request::from_parts(parts, Body::from(bytes));
            first(state.clone(), entry, (tenant, key, fp), req, next).await
        }
    }
}

/// A repeat, answered from the first request's entry.
async fn from_entry(idem: &Idempotency, entry: Arc<Entry>, path: &str) -> Response {
    let not_kept = || {
        LockstepError::IdempotencyConflict {
        message: "the answer to this Idempotency-Key was not kept (too large, or dropped to keep the bound); it is not generated twice: use a new key".into(),
        retry: false,
    }
    };
    if entry.dropped() {
        idem.count("not_kept");
        return refuse(path, not_kept());
    }
    let running = !entry.done();
    let Some(head) = entry.wait_head(WAIT_HEAD).await else {
        idem.count("not_kept");
        return refuse(path, not_kept());
    };
    idem.count(if running { "joined" } else { "replayed" });
    let body = futures_util::stream::unfold(Some((entry, 0usize)), |open| async move {
        let (entry, i) = open?;
        match entry.piece(i).await {
            Piece::Chunk(c) => Some((Ok(c), Some((entry, i + 1)))),
            Piece::End => None,
            Piece::Dropped => Some((
                Err(std::io::Error::other(
                    "the answer was dropped while it was replayed",
                )),
                None,
            )),
        }
    });
    head.response(Body::from_stream(body), true)
}

/// The first request with a key: its answer produced by a task of its own, read by this client
/// through a channel and kept in the entry for repeats. When this client goes away the task
/// goes on while the answer can be kept (a retry will read it); one that cannot be kept stops
/// (its pair is aborted), and the key is forgotten.
async fn first(
    state: Arc<AppState>,
    entry: Arc<Entry>,
    (tenant, key, fp): (String, String, [u8; 32]),
    req: Request,
    next: Next,
) -> Response {
    let (head_tx, head_rx) = tokio::sync::oneshot::channel();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    let task_state = state.clone();
    tokio::spawn(async move {
        let idem = &task_state.idempotency;
        let resp = next.run(req).await;
        let (parts, mut body) = resp.into_parts();
        let head = Head {
            status: parts.status,
            headers: kept_headers(&parts.headers),
        };
        let passes = passing(parts.status);
        if passes {
            idem.forget(&tenant, &key, &entry);
        }
        idem.set_head(&entry, head.clone());
        let _ = head_tx.send(head.clone());
        let mut client = Some(tx);
        let mut whole = true;
        while let Some(frame) = body.frame().await {
            let data = match frame {
                Ok(f) => match f.into_data() {
                    Ok(d) => d,
                    Err(_) => continue,
                },
                Err(e) => {
                    whole = false;
                    if let Some(c) = client.take() {
                        let _ = c.send(Err(std::io::Error::other(e.to_string()))).await;
                    }
                    break;
                }
            };
            let kept = idem.push(&entry, data.clone());
            if let Some(c) = &client
                && c.send(Ok(data)).await.is_err()
            {
                client = None;
            }
            if client.is_none() && !kept {
                // Nobody can have the rest: stop (the pair is aborted with the body).
                whole = false;
                break;
            }
        }
        idem.finish(&entry);
        let shared = task_state.models.load().tenants.shared_store();
        if !whole || passes {
            idem.forget(&tenant, &key, &entry);
            if let Some(store) = shared {
                super::idempotency_shared::release(&store, &tenant, &key).await;
            }
        } else if let Some(store) = shared {
            super::idempotency_shared::finished(&store, &tenant, &key, &fp, &entry, idem).await;
        }
    });
    let Ok(head) = head_rx.await else {
        return LockstepError::Unavailable {
            message: "the answer to this Idempotency-Key request ended before it began".into(),
        }
        .into_response();
    };
    let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    }));
    head.response(body, false)
}

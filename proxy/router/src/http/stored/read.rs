//! Reading stored responses back: `GET /v1/responses/{id}` (the object, or with `stream=true`
//! a background response's stream from `starting_after`), `DELETE`, `input_items`, and
//! `POST .../cancel`. Each call authenticates the caller first; another tenant's response is
//! answered as one that does not exist.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Value, json};

use super::{Owner, PageQuery, json, list, query};
use crate::http::openai::bad;
use crate::http::respond::event_stream as sse_head;
use crate::stored::Stored;
use lockstep_core::error::LockstepError;

fn not_found(id: &str) -> LockstepError {
    LockstepError::NotFound {
        kind: "response",
        id: id.to_string(),
    }
}

/// `GET /v1/responses/{id}`: the stored object; with `stream=true`, a background response's
/// events after `starting_after` (every one without it), live while it runs.
pub(crate) async fn retrieve(
    Owner { stored, tenant }: Owner,
    Path(id): Path<String>,
    q: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Response {
    let r = async {
        let q = query(q)?;
        let mut stream = false;
        let mut after = -1;
        for (k, v) in &q {
            match k.as_str() {
                "stream" => {
                    stream = match v.as_str() {
                        "true" => true,
                        "false" => false,
                        _ => return Err(bad("stream", "`stream` is true or false".into())),
                    }
                }
                "starting_after" => {
                    after = v
                        .parse::<i64>()
                        .ok()
                        .filter(|n| *n >= 0)
                        .ok_or_else(|| bad("starting_after", "a sequence number".into()))?;
                }
                "include_obfuscation" if v == "false" => {}
                _ => {
                    return Err(LockstepError::Unsupported {
                        message: format!("query parameter `{k}` is not supported here"),
                        param: Some(k.clone()),
                    });
                }
            }
        }
        let r = stored.store.response(&tenant, &id).await?;
        let r = r.ok_or_else(|| not_found(&id))?;
        if stream && !r.background {
            return Err(bad(
                "stream",
                "only a background response's stream is kept to be read again".into(),
            ));
        }
        Ok((stream, after, r.body))
    }
    .await;
    match r {
        Ok((true, after, _)) => event_stream(stored, tenant, id, after),
        Ok((false, _, body)) => axum::Json(body).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `DELETE /v1/responses/{id}`: gone from every read; a background one running here stops.
pub(crate) async fn delete(Owner { stored, tenant }: Owner, Path(id): Path<String>) -> Response {
    json(
        async {
            if !stored.store.delete_response(&tenant, &id).await? {
                return Err(not_found(&id));
            }
            stored.stop(&id);
            Ok(json!({ "id": id, "object": "response", "deleted": true }))
        }
        .await,
    )
}

/// `GET /v1/responses/{id}/input_items`: the request's input items, in pages.
pub(crate) async fn input_items(
    Owner { stored, tenant }: Owner,
    Path(id): Path<String>,
    q: Result<Query<PageQuery>, QueryRejection>,
) -> Response {
    json(
        async {
            let q = query(q)?;
            let (limit, desc) = q.checked()?;
            let r = stored.store.response(&tenant, &id).await?;
            let mut items = r.ok_or_else(|| not_found(&id))?.input_items;
            if desc {
                items.reverse();
            }
            let from = match &q.after {
                None => 0,
                Some(a) => {
                    let at = items.iter().position(|i| i["id"].as_str() == Some(a));
                    at.ok_or_else(|| bad("after", format!("no input item `{a}`")))? + 1
                }
            };
            let rest: Vec<Value> = items.into_iter().skip(from).collect();
            let has_more = rest.len() > usize::try_from(limit).unwrap_or(usize::MAX);
            let page = rest.into_iter().take(usize::try_from(limit).unwrap_or(0));
            Ok(list(page.collect(), has_more))
        }
        .await,
    )
}

/// `POST /v1/responses/{id}/cancel`: a running background response is cancelled (its pair
/// aborted, here or on the replica running it, whose next write finds it cancelled); a finished
/// one is answered as it is. Only background responses can be cancelled.
pub(crate) async fn cancel(Owner { stored, tenant }: Owner, Path(id): Path<String>) -> Response {
    json(
        async {
            let r = stored.store.response(&tenant, &id).await?;
            let r = r.ok_or_else(|| not_found(&id))?;
            if !r.background {
                return Err(bad(
                    "id",
                    "only a response created with `background: true` can be cancelled".into(),
                ));
            }
            let mut body = r.body;
            if !matches!(r.status.as_str(), "queued" | "in_progress") {
                return Ok(body);
            }
            body["status"] = json!("cancelled");
            if stored.store.cancel_response(&tenant, &id, &body).await? {
                stored.stop(&id);
                return Ok(body);
            }
            // It finished meanwhile: as it is now.
            let now = stored.store.response(&tenant, &id).await?;
            Ok(now.ok_or_else(|| not_found(&id))?.body)
        }
        .await,
    )
}

/// Longest a resumed stream waits for the next event before it ends with an error.
const IDLE: Duration = Duration::from_secs(600);

/// How often a reader looks for new events of a response running on another replica.
const POLL: Duration = Duration::from_millis(200);

/// A background response's stored events after `after`, as SSE, live while it runs: woken by
/// this process's writes, polling for another replica's. Ends after the terminal event, when
/// the response is no longer running and every event was sent, or with an `error` event.
pub(crate) fn event_stream(
    stored: Arc<Stored>,
    tenant: String,
    id: String,
    after: i64,
) -> Response {
    let start = (stored, tenant, id, after, Instant::now());
    let body = futures_util::stream::unfold(Some(start), |open| async move {
        let (stored, tenant, id, mut cursor, idle) = open?;
        loop {
            let waiter = stored.waiter(&id);
            let woken = waiter.as_ref().map(|w| w.notified());
            let read = stored.store.events_after(&tenant, &id, cursor, 256).await;
            let (status, events) = match read {
                Ok(Some(x)) => x,
                Ok(None) => return None,
                Err(e) => return Some((Ok(error_event(&e)), None)),
            };
            if let Some(last) = events.last() {
                cursor = last.seq;
                let done = events.iter().any(|e| super::ends_stream(&e.name));
                let mut out = String::new();
                for e in &events {
                    out.push_str("event: ");
                    out.push_str(&e.name);
                    out.push_str("\ndata: ");
                    out.push_str(&e.data);
                    out.push_str("\n\n");
                }
                let next = (!done).then_some((stored, tenant, id, cursor, Instant::now()));
                return Some((Ok::<_, std::convert::Infallible>(Bytes::from(out)), next));
            }
            if !matches!(status.as_str(), "queued" | "in_progress") {
                return None;
            }
            if idle.elapsed() > IDLE {
                let e = LockstepError::Unavailable {
                    message: format!(
                        "no event of background response `{id}` for {} s",
                        IDLE.as_secs()
                    ),
                };
                return Some((Ok(error_event(&e)), None));
            }
            match woken {
                Some(w) => {
                    let _ = tokio::time::timeout(POLL, w).await;
                }
                None => tokio::time::sleep(POLL).await,
            }
        }
    });
    sse_head(Response::builder())
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| crate::http::respond::build_failed().into_response())
}

/// An `error` event in the Responses stream's shape.
fn error_event(e: &LockstepError) -> Bytes {
    let v = json!({ "type": "error", "code": e.code(), "message": e.to_string(), "param": null });
    Bytes::from(format!("event: error\ndata: {v}\n\n"))
}

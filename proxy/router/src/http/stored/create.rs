//! `POST /v1/responses` with its state: the earlier items resolved before admission, then the
//! response stored as it runs (in the foreground, or in the background with every stream event
//! stored for resumption). An answer that says it is stored is stored: the final write happens
//! before the final event or the whole answer goes out, and a write that fails turns the answer
//! into 503 `state_unavailable` (a stream ends with `response.failed`).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::StreamExt;
use serde_json::Value;

use super::owner;
use crate::admission::{Admitted, Refusal, admit_decoded, parse_json};
use crate::http::extract::authorized_body;
use crate::http::respond::{self, Asked, Render, commit, serve_pair, sse_named};
use crate::http::responses::{Plan, ResponsesRequest, input_items};
use crate::http::responses_out::ResponsesShape;
use crate::state::AppState;
use crate::stored::{ResponseState, Stored};
use lockstep_core::error::LockstepError;
use lockstep_state::{Event, Finish, NewResponse};

/// What a stored response keeps besides its object.
struct Keep {
    store: Arc<Stored>,
    tenant: String,
    prior: Vec<Value>,
    input_items: Vec<Value>,
    conversation: Option<String>,
    background: bool,
}

/// `POST /v1/responses`.
pub(crate) async fn create(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let (caller, bytes) = match authorized_body(&state, req).await {
        Ok(x) => x,
        Err(r) => return r.into_response(),
    };
    let refuse = |e| Refusal::count_for(&state, "", caller.tenant.as_deref(), e).into_response();
    let mut r: ResponsesRequest = match parse_json(&bytes) {
        Ok(r) => r,
        Err(e) => return refuse(e),
    };
    let keep = match plan(&state, owner(&caller), &mut r, &bytes).await {
        Ok(k) => k,
        Err(e) => return refuse(e),
    };
    let (admitted, shape) = match admit_decoded(&state, caller, r, bytes.len()).await {
        Ok(x) => x,
        Err(r) => return r.into_response(),
    };
    match keep {
        None => serve_pair(admitted, shape).await,
        Some(k) if k.background => background(k, admitted, shape).await,
        Some(k) => foreground(k, admitted, shape).await,
    }
}

/// The conversation a request names: its id, or `{"id": ...}`.
fn conversation_id(v: &Value) -> Result<String, LockstepError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Object(o) => match (o.get("id"), o.len()) {
            (Some(Value::String(s)), 1) => Ok(s.clone()),
            _ => Err(crate::http::openai::bad(
                "conversation",
                "`conversation` is an id or `{\"id\": ...}`".into(),
            )),
        },
        _ => Err(crate::http::openai::bad(
            "conversation",
            "`conversation` is an id or `{\"id\": ...}`".into(),
        )),
    }
}

/// Resolves the request's state into its [`Plan`] (`None`: nothing is stored and nothing read).
async fn plan(
    state: &AppState,
    tenant: String,
    r: &mut ResponsesRequest,
    bytes: &[u8],
) -> Result<Option<Keep>, LockstepError> {
    let conversation = match r.conversation.as_ref().filter(|c| !c.is_null()) {
        Some(c) => Some(conversation_id(c)?),
        None => None,
    };
    let background = r.background == Some(true);
    let asks = r.store == Some(true)
        || r.previous_response_id.is_some()
        || conversation.is_some()
        || background;
    let stored = match (&state.responses, asks) {
        (ResponseState::On(s), _) => s.clone(),
        // Not asked for (`store` left out or false, nothing to read): served without state, and
        // the answer says `store: false`. Asked for where state is off: the admission refuses
        // by the field (no plan).
        (ResponseState::Off, _) | (ResponseState::Down(_), false) => return Ok(None),
        (ResponseState::Down(why), true) => {
            return Err(LockstepError::StateUnavailable {
                message: why.clone(),
            });
        }
    };
    let store = r.store.unwrap_or(true);
    let bad = crate::http::openai::bad;
    if background && !store {
        return Err(bad(
            "background",
            "a background response is stored: `store` must not be false".into(),
        ));
    }
    if conversation.is_some() && !store {
        return Err(bad(
            "conversation",
            "a response in a conversation is stored: `store` must not be false".into(),
        ));
    }
    let prior = match (&r.previous_response_id, &conversation) {
        (Some(_), Some(_)) => {
            return Err(bad(
                "previous_response_id",
                "give `previous_response_id` or `conversation`, not both".into(),
            ));
        }
        (Some(prev), None) => {
            let found = stored.store.response(&tenant, prev).await?;
            let p = found.ok_or_else(|| LockstepError::NotFound {
                kind: "response",
                id: prev.clone(),
            })?;
            p.context.ok_or_else(|| {
                bad(
                    "previous_response_id",
                    format!(
                        "response `{prev}` is {}: only a completed or incomplete response can be continued",
                        p.status
                    ),
                )
            })?
        }
        (None, Some(c)) => {
            stored
                .store
                .all_items(&tenant, c)
                .await?
                .ok_or_else(|| LockstepError::NotFound {
                    kind: "conversation",
                    id: c.clone(),
                })?
        }
        (None, None) => Vec::new(),
    };
    let raw: Value = serde_json::from_slice(bytes).map_err(|e| LockstepError::InvalidJson {
        message: e.to_string(),
    })?;
    let items = input_items(raw.get("input").unwrap_or(&Value::Null))?;
    let plan = Plan {
        id: lockstep_state::new_id("resp"),
        store,
        background,
        prior: prior.clone(),
        input_items: items.clone(),
        previous_response_id: r.previous_response_id.clone(),
        conversation: conversation.clone(),
    };
    r.plan = Some(plan);
    if !store {
        // Chained from a stored response, not stored itself.
        return Ok(None);
    }
    Ok(Some(Keep {
        store: stored,
        tenant,
        prior,
        input_items: items,
        conversation,
        background,
    }))
}

fn now() -> u64 {
    u64::try_from(lockstep_state::now_s()).unwrap_or(0)
}

/// An output item as history: log-probabilities left out (they are not input).
fn as_history(item: &Value) -> Value {
    let mut item = item.clone();
    if let Some(parts) = item.get_mut("content").and_then(Value::as_array_mut) {
        for p in parts {
            if let Some(o) = p.as_object_mut() {
                o.remove("logprobs");
            }
        }
    }
    item
}

impl Keep {
    /// Stores the response as it starts.
    async fn insert(&self, shape: &ResponsesShape, body: &Value) -> Result<(), LockstepError> {
        let r = NewResponse {
            id: shape.id(),
            tenant: &self.tenant,
            created_at: lockstep_state::now_s(),
            status: body["status"].as_str().unwrap_or("in_progress"),
            background: self.background,
            body,
            input_items: &self.input_items,
            conversation: self.conversation.as_deref(),
        };
        self.store.store.insert_response(&r).await
    }

    /// Stores the finished response `body` with its context (and its items in its
    /// conversation).
    async fn finish(&self, id: &str, body: &Value) -> Result<bool, LockstepError> {
        let output: Vec<Value> = body["output"]
            .as_array()
            .map(|o| o.iter().map(as_history).collect())
            .unwrap_or_default();
        let mut context = self.prior.clone();
        context.extend(self.input_items.iter().cloned());
        context.extend(output.iter().cloned());
        let mut items = self.input_items.clone();
        items.extend(output);
        let f = Finish {
            status: body["status"].as_str().unwrap_or("completed"),
            body,
            context: &context,
            conversation_items: &items,
        };
        self.store.store.finish_response(&self.tenant, id, &f).await
    }

    /// Stores a failure (best effort: the failure is answered whatever happens here).
    async fn fail(&self, id: &str, body: &Value) {
        if let Err(e) = self.finish(id, body).await {
            tracing::warn!(response = id, "cannot store the response's failure: {e}");
        }
    }
}

/// The events as SSE bytes.
fn sse(events: &[(String, Value)]) -> Bytes {
    let mut out = String::new();
    for (name, v) in events {
        sse_named(&mut out, name, v);
    }
    Bytes::from(out)
}

/// The finished response object a terminal event carries.
fn terminal(events: &[(String, Value)]) -> Option<&Value> {
    events
        .iter()
        .rev()
        .find(|(n, _)| super::ends_stream(n))
        .map(|(_, v)| &v["response"])
}

/// A foreground response stored as running: if its answer is dropped before it ends (the
/// client went away, which aborts its pair), it is stored as failed rather than left running.
struct Unfinished {
    keep: Arc<Keep>,
    id: String,
    failed: Option<Value>,
}

impl Unfinished {
    /// It ended and was stored: nothing left to do.
    fn done(&mut self) {
        self.failed = None;
    }
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        let (Some(body), Ok(rt)) = (self.failed.take(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        let (keep, id) = (self.keep.clone(), std::mem::take(&mut self.id));
        rt.spawn(async move { keep.fail(&id, &body).await });
    }
}

/// A stored response in the foreground: answered as it runs, stored before it ends.
async fn foreground(keep: Keep, admitted: Admitted, shape: ResponsesShape) -> Response {
    let mut shape = shape.journaled();
    let (model, created) = (admitted.model.name.to_string(), now());
    let id = shape.id().to_string();
    if let Err(e) = keep
        .insert(&shape, &shape.pending(&model, created, "in_progress"))
        .await
    {
        return e.into_response();
    }
    let keep = Arc::new(keep);
    let gone = LockstepError::Unavailable {
        message: "the client went away before the response finished; its pair was aborted".into(),
    };
    let mut guard = Unfinished {
        keep: keep.clone(),
        id: id.clone(),
        failed: Some(shape.failed(&model, created, &gone)),
    };
    let fail = |e: &LockstepError, shape: &ResponsesShape| shape.failed(&model, created, e);
    let asked = match Asked::of(&admitted, &mut shape) {
        Ok(a) => a,
        Err(e) => {
            guard.done();
            keep.fail(&id, &fail(&e, &shape)).await;
            return shape.error(e);
        }
    };
    let committed = match commit(admitted).await {
        Ok(c) => c,
        Err(e) => {
            guard.done();
            keep.fail(&id, &fail(&e, &shape)).await;
            return shape.error(e);
        }
    };
    let pair_id = committed.pair_id;
    let (mut p, chunks) = committed.answer(asked);
    let mut chunks = Box::pin(chunks);
    if !shape.streams() {
        while let Some(next) = chunks.next().await {
            let c = match next {
                Ok(c) => c,
                Err(e) => {
                    guard.done();
                    keep.fail(&id, &fail(&e, &shape)).await;
                    return shape.error(e);
                }
            };
            p.absorb(&c);
            if let Some(finish) = c.finish {
                let body = shape.full(&p, finish);
                let stored = keep.finish(&id, &body).await;
                guard.done();
                if let Err(e) = stored {
                    return e.into_response();
                }
                let head = respond::json_head(Response::builder());
                return respond::answer(head, pair_id, Body::from(body.to_string()));
            }
        }
        return respond::build_failed().into_response();
    }
    let body = futures_util::stream::unfold(Some((chunks, p, shape, guard)), |open| async move {
        let (mut chunks, mut p, mut shape, mut guard) = open?;
        let (mut events, last) = match chunks.next().await? {
            Ok(c) => {
                p.absorb(&c);
                let _ = shape.chunk(&p, &c);
                (shape.take_events(), c.finish.is_some())
            }
            Err(e) => {
                let _ = shape.stream_error(&p, &e);
                (shape.take_events(), true)
            }
        };
        if let Some(body) = terminal(&events).cloned() {
            let stored = guard.keep.finish(&guard.id, &body).await;
            guard.done();
            if let Err(e) = stored {
                // The answer would say it is stored: it ends as failed instead.
                let _ = shape.stream_error(&p, &e);
                let failed = shape.take_events();
                if let Some(at) = events.iter().position(|(n, _)| super::ends_stream(n)) {
                    events.truncate(at);
                }
                events.extend(failed);
            }
        }
        let bytes = Ok::<_, std::convert::Infallible>(sse(&events));
        Some((bytes, (!last).then_some((chunks, p, shape, guard))))
    });
    respond::answer(
        respond::event_stream(Response::builder()),
        pair_id,
        Body::from_stream(body),
    )
}

/// A background response: stored as `queued` and answered at once (or its stream read from the
/// database as it is stored); the pair runs in a task of its own that outlives the request.
async fn background(keep: Keep, admitted: Admitted, shape: ResponsesShape) -> Response {
    let shape = shape.journaled();
    let (model, created) = (admitted.model.name.to_string(), now());
    let id = shape.id().to_string();
    let queued = shape.pending(&model, created, "queued");
    if let Err(e) = keep.insert(&shape, &queued).await {
        return e.into_response();
    }
    let (stored, tenant, streams) = (keep.store.clone(), keep.tenant.clone(), shape.streams());
    stored.start(&id);
    let task = tokio::spawn(run_background(keep, admitted, shape, model, created));
    stored.set_task(&id, task.abort_handle());
    if streams {
        return super::read::event_stream(stored, tenant, id, -1);
    }
    axum::Json(queued).into_response()
}

/// Runs a background response's pair, storing each chunk's events as they come and the
/// response when it ends. A cancel (here: the task is aborted; on another replica: the next
/// write finds it no longer running) drops the pair, which aborts both halves.
async fn run_background(
    keep: Keep,
    admitted: Admitted,
    mut shape: ResponsesShape,
    model: String,
    created: u64,
) {
    let id = shape.id().to_string();
    let running = shape.pending(&model, created, "in_progress");
    let outcome = async {
        let asked = Asked::of(&admitted, &mut shape)?;
        let committed = commit(admitted).await?;
        let (mut p, chunks) = committed.answer(asked);
        let mut chunks = Box::pin(chunks);
        while let Some(next) = chunks.next().await {
            let c = next?;
            p.absorb(&c);
            let _ = shape.chunk(&p, &c);
            let events = shape.take_events();
            if !store_events(&keep, &id, &running, &events).await? {
                return Ok(None);
            }
            if let Some(body) = terminal(&events) {
                return Ok(Some(body.clone()));
            }
        }
        Err(respond::build_failed())
    }
    .await;
    match outcome {
        Ok(Some(body)) => {
            if let Err(e) = keep.finish(&id, &body).await {
                tracing::warn!(response = %id, "cannot store the finished background response: {e}");
            }
        }
        // Cancelled or deleted meanwhile: nothing more is written.
        Ok(None) => {}
        Err(e) => {
            shape.fail_event(&model, created, &e);
            let failed = shape.take_events();
            if let Ok(true) = store_events(&keep, &id, &running, &failed).await {
                keep.fail(&id, &shape.failed(&model, created, &e)).await;
            }
        }
    }
    keep.store.ended(&id);
}

/// Stores a chunk's events (`false`: the response is no longer running) and wakes its readers.
async fn store_events(
    keep: &Keep,
    id: &str,
    running: &Value,
    events: &[(String, Value)],
) -> Result<bool, LockstepError> {
    let rows: Vec<Event> = events
        .iter()
        .map(|(name, v)| Event {
            seq: v["sequence_number"].as_i64().unwrap_or(0),
            name: name.clone(),
            data: v.to_string(),
        })
        .collect();
    let live = keep.store.store.append_events(id, running, &rows).await?;
    keep.store.stored(id);
    Ok(live)
}

//! Turning a pair's events into the client's response shape: OpenAI chat, OpenAI completion or
//! SGLang-native, streamed (SSE) or not. Nothing is written before the pair commits.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Value, json};

use crate::admission::Admitted;
use crate::backend::{DecodeChunk, FinishReason};
use crate::error::LockstepError;
use crate::pair::{PairEvent, PairId};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Completion,
    Generate,
}

/// What the client asked for: which API shape, streamed or not, usage on the stream or not.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    api: Api,
    stream: bool,
    include_usage: bool,
}

impl Shape {
    pub(crate) fn chat(stream: bool, include_usage: bool) -> Shape {
        Shape {
            api: Api::Chat,
            stream,
            include_usage,
        }
    }
    pub(crate) fn completion(stream: bool, include_usage: bool) -> Shape {
        Shape {
            api: Api::Completion,
            stream,
            include_usage,
        }
    }
    pub(crate) fn generate(stream: bool) -> Shape {
        Shape {
            api: Api::Generate,
            stream,
            include_usage: false,
        }
    }
}

/// A pair that passed the commit barrier: its events, id and the tenant's permit (held as long as
/// the response lives).
pub(crate) struct Committed {
    pub(crate) rx: tokio::sync::mpsc::Receiver<PairEvent>,
    pub(crate) pair_id: PairId,
    pub(crate) prompt_tokens: u64,
    pub(crate) permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// Starts the pair of an admitted request and waits for the commit barrier. Shared by every
/// front end (HTTP shapes and gRPC). Dropping the future before it returns drops the pair's
/// receiver: both halves abort.
pub(crate) async fn commit(admitted: Admitted) -> Result<Committed, LockstepError> {
    let Admitted {
        model,
        ids,
        sampling,
        caller,
    } = admitted;
    let (mut rx, _task) = model.pairs.start(
        ids.into(),
        sampling.into(),
        caller.tenant.map(|t| t.name.clone()),
    );
    match rx.recv().await {
        Some(PairEvent::Committed {
            pair_id,
            prompt_tokens,
        }) => Ok(Committed {
            rx,
            pair_id,
            prompt_tokens,
            permit: caller.permit,
        }),
        Some(PairEvent::Failed(e)) => Err(e),
        Some(PairEvent::Chunk(_)) | None => Err(LockstepError::Unavailable {
            message: "pair ended without an outcome".into(),
        }),
    }
}

/// Starts the admitted request's pair, waits for the commit barrier, then answers in the client's
/// shape.
pub(crate) async fn serve_pair(admitted: Admitted, shape: Shape) -> Response {
    let model = admitted.model.name.clone();
    let Committed {
        rx,
        pair_id,
        prompt_tokens,
        permit,
    } = match commit(admitted).await {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let mut w = Writer {
        shape,
        model: model.to_string(),
        pair_id,
        prompt_tokens,
        created: now(),
        text: String::new(),
        completion_tokens: 0,
        started: false,
    };
    let mut rx = rx;
    if shape.stream {
        let body =
            // The tenant's permit travels with the stream: released when the stream ends.
            futures_util::stream::unfold((rx, w, false, permit), |(mut rx, mut w, done, permit)| async move {
                if done {
                    return None;
                }
                match rx.recv().await {
                    Some(PairEvent::Chunk(c)) => {
                        let last = c.finish.is_some();
                        let out = w.stream_chunk(&c);
                        Some((Ok::<_, Infallible>(out), (rx, w, last, permit)))
                    }
                    Some(PairEvent::Failed(e)) => Some((Ok(sse(&e.body())), (rx, w, true, permit))),
                    // The task ended without a finish or an error: fail closed, never `[DONE]`.
                    Some(PairEvent::Committed { .. }) | None => {
                        let e = LockstepError::DecodeFailed {
                            pair_id: w.pair_id,
                            message: "pair ended without finishing".into(),
                        };
                        Some((Ok(sse(&e.body())), (rx, w, true, permit)))
                    }
                }
            });
        return Response::builder()
            .header(http::header::CONTENT_TYPE, "text/event-stream")
            .header(http::header::CACHE_CONTROL, "no-cache")
            .header("x-lockstep-pair-id", pair_id.to_string())
            .body(Body::from_stream(body))
            .unwrap_or_else(|_| {
                LockstepError::Unavailable {
                    message: "response build failed".into(),
                }
                .into_response()
            });
    }
    loop {
        match rx.recv().await {
            Some(PairEvent::Chunk(c)) => {
                w.absorb(&c);
                if let Some(finish) = c.finish {
                    let mut resp = axum::Json(w.full(finish)).into_response();
                    if let Ok(v) = http::HeaderValue::from_str(&pair_id.to_string()) {
                        resp.headers_mut().insert("x-lockstep-pair-id", v);
                    }
                    return resp;
                }
            }
            Some(PairEvent::Failed(e)) => return e.into_response(),
            Some(PairEvent::Committed { .. }) | None => {
                return LockstepError::DecodeFailed {
                    pair_id,
                    message: "pair ended without finishing".into(),
                }
                .into_response();
            }
        }
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

struct Writer {
    shape: Shape,
    model: String,
    pair_id: PairId,
    prompt_tokens: u64,
    created: u64,
    text: String,
    completion_tokens: u64,
    started: bool,
}

impl Writer {
    fn absorb(&mut self, c: &DecodeChunk) {
        self.text.push_str(&c.delta);
        self.completion_tokens = self.completion_tokens.max(c.completion_tokens);
    }

    fn id(&self) -> String {
        match self.shape.api {
            Api::Chat => format!("chatcmpl-{}", self.pair_id),
            _ => format!("cmpl-{}", self.pair_id),
        }
    }

    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens.saturating_add(self.completion_tokens),
        })
    }

    fn native_meta(&self, finish: Option<FinishReason>) -> Value {
        let finish = finish.map(|f| match f {
            FinishReason::Length => json!({ "type": "length", "length": self.completion_tokens }),
            FinishReason::Stop => json!({ "type": "stop" }),
        });
        json!({
            "id": self.pair_id.to_string(),
            "finish_reason": finish,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        })
    }

    /// The non-streamed answer.
    fn full(&self, finish: FinishReason) -> Value {
        match self.shape.api {
            Api::Chat => json!({
                "id": self.id(), "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{ "index": 0, "message": { "role": "assistant", "content": self.text },
                              "logprobs": null, "finish_reason": finish.as_str() }],
                "usage": self.usage(),
            }),
            Api::Completion => json!({
                "id": self.id(), "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{ "index": 0, "text": self.text, "logprobs": null, "finish_reason": finish.as_str() }],
                "usage": self.usage(),
            }),
            Api::Generate => {
                json!({ "text": self.text, "meta_info": self.native_meta(Some(finish)) })
            }
        }
    }

    /// SSE events for one chunk; the last chunk also carries usage (when asked) and `[DONE]`.
    fn stream_chunk(&mut self, c: &DecodeChunk) -> Bytes {
        self.absorb(c);
        let mut out = String::new();
        let finish = c.finish.map(FinishReason::as_str);
        let mut push = |v: Value| {
            out.push_str("data: ");
            out.push_str(&v.to_string());
            out.push_str("\n\n");
        };
        match self.shape.api {
            Api::Chat => {
                let base = |delta: Value, finish: Option<&str>| {
                    json!({ "id": self.id(), "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                            "choices": [{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish }] })
                };
                if !self.started {
                    push(base(json!({ "role": "assistant", "content": "" }), None));
                }
                if !c.delta.is_empty() {
                    push(base(json!({ "content": c.delta }), None));
                }
                if finish.is_some() {
                    push(base(json!({}), finish));
                }
            }
            Api::Completion => {
                if !c.delta.is_empty() || finish.is_some() {
                    push(
                        json!({ "id": self.id(), "object": "text_completion", "created": self.created, "model": self.model,
                                 "choices": [{ "index": 0, "text": c.delta, "logprobs": null, "finish_reason": finish }] }),
                    );
                }
            }
            Api::Generate => {
                push(json!({ "text": self.text, "meta_info": self.native_meta(c.finish) }))
            }
        }
        self.started = true;
        if finish.is_some() {
            if self.shape.include_usage {
                let object = if self.shape.api == Api::Chat {
                    "chat.completion.chunk"
                } else {
                    "text_completion"
                };
                push(
                    json!({ "id": self.id(), "object": object, "created": self.created, "model": self.model,
                             "choices": [], "usage": self.usage() }),
                );
            }
            out.push_str("data: [DONE]\n\n");
        }
        Bytes::from(out)
    }
}

//! Turning a pair's events into the client's response shape, streamed (SSE) or not: OpenAI chat,
//! OpenAI completion and SGLang-native here ([`Shape`]); the Responses API and Anthropic Messages
//! in their own modules, each a [`Render`]. Nothing is written before the pair commits.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Value, json};

use super::tools::{self, ToolStream};
use crate::admission::Admitted;
use crate::backend::{DecodeChunk, FinishReason};
use crate::config::ToolParserKind;
use crate::error::LockstepError as Error;
use crate::error::LockstepError;
use crate::pair::{PairEvent, PairId};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Completion,
    Generate,
}

/// What the client asked for: which API shape, streamed or not, usage on the stream or not,
/// and whether tool calls are parsed from the answer (chat).
#[derive(Debug)]
pub(crate) struct Shape {
    api: Api,
    stream: bool,
    include_usage: bool,
    /// Whether the stream's first event went out.
    started: bool,
    /// The model's tool-call parser and the stream's split between content and calls.
    tools: Option<ToolStream>,
}

impl Shape {
    pub(crate) fn chat(stream: bool, include_usage: bool) -> Shape {
        Shape {
            api: Api::Chat,
            stream,
            include_usage,
            started: false,
            tools: None,
        }
    }
    pub(crate) fn completion(stream: bool, include_usage: bool) -> Shape {
        Shape {
            api: Api::Completion,
            stream,
            include_usage,
            started: false,
            tools: None,
        }
    }
    /// Chat whose answer is parsed for tool calls in `kind`'s format.
    pub(crate) fn with_tools(mut self, kind: Option<ToolParserKind>) -> Shape {
        self.tools = kind.map(ToolStream::new);
        self
    }
    pub(crate) fn generate(stream: bool) -> Shape {
        Shape {
            api: Api::Generate,
            stream,
            include_usage: false,
            started: false,
            tools: None,
        }
    }
}

/// A pair that passed the commit barrier: its events, id and the tenant's permit (held as long as
/// the response lives).
pub(crate) struct Committed {
    pub(crate) rx: tokio::sync::mpsc::Receiver<PairEvent>,
    pub(crate) pair_id: PairId,
    pub(crate) prompt_tokens: u64,
    pub(crate) cached_tokens: u64,
    pub(crate) permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// Starts the pair of an admitted request and waits for the commit barrier. Shared by every
/// front end (HTTP shapes and gRPC). Dropping the future before it returns drops the pair's
/// receiver: both halves abort.
pub(crate) async fn commit(admitted: Admitted) -> Result<Committed, LockstepError> {
    let Admitted {
        model,
        ids,
        ids_json,
        sampling,
        caller,
    } = admitted;
    let (mut rx, _task) = model.pairs.start(
        ids.into(),
        ids_json,
        sampling.into(),
        caller.tenant.map(|t| t.name.clone()),
    );
    match rx.recv().await {
        Some(PairEvent::Committed {
            pair_id,
            prompt_tokens,
            cached_tokens,
        }) => Ok(Committed {
            rx,
            pair_id,
            prompt_tokens,
            cached_tokens,
            permit: caller.permit,
        }),
        Some(PairEvent::Failed(e)) => Err(e),
        Some(PairEvent::Chunk(_)) | None => Err(LockstepError::Unavailable {
            message: "pair ended without an outcome".into(),
        }),
    }
}

/// How one API answers: its whole response, its stream events and its errors. The pair's
/// progress ([`Progress`]) is kept by [`serve_pair`]; a renderer only shapes it.
pub(crate) trait Render: Send + 'static {
    /// Whether the client asked for a stream.
    fn stream(&self) -> bool;
    /// The non-streamed answer once the pair finished.
    fn full(&self, p: &Progress, finish: FinishReason) -> Value;
    /// [`Render::full`] written as JSON (a renderer may write it without building the `Value`).
    fn full_json(&self, p: &Progress, finish: FinishReason) -> serde_json::Result<Vec<u8>> {
        serde_json::to_vec(&self.full(p, finish))
    }
    /// SSE bytes for one chunk, already absorbed into `p`; the last chunk ends the stream.
    fn chunk(&mut self, p: &Progress, c: &DecodeChunk) -> Bytes;
    /// The SSE bytes that end a committed stream with this failure (never a success ending).
    fn stream_error(&mut self, p: &Progress, e: &Error) -> Bytes {
        let _ = p;
        sse(&e.body())
    }
    /// The answer to a failure before anything was sent (the status and this API's error body).
    fn error(&self, e: Error) -> Response {
        e.into_response()
    }
}

/// A pair's answer: `head` with the pair id header, and `body`.
fn answer(head: http::response::Builder, pair_id: PairId, body: Body) -> Response {
    head.header("x-lockstep-pair-id", pair_id.to_string())
        .body(body)
        .unwrap_or_else(|_| build_failed().into_response())
}

/// The error for an answer that could not be built.
fn build_failed() -> LockstepError {
    LockstepError::Unavailable {
        message: "response build failed".into(),
    }
}

/// What a committed pair produced so far.
pub(crate) struct Progress {
    /// The model's name.
    pub(crate) model: String,
    /// The pair answering.
    pub(crate) pair_id: PairId,
    /// The verified prompt token count.
    pub(crate) prompt_tokens: u64,
    /// Of those, tokens the prefill reused from its cache (0 without a tenant).
    pub(crate) cached_tokens: u64,
    /// Seconds since the epoch at commit.
    pub(crate) created: u64,
    /// The text so far.
    pub(crate) text: String,
    /// Completion tokens so far.
    pub(crate) completion_tokens: u64,
    /// The stop string that ended generation, once one did and the worker said which.
    pub(crate) matched_stop: Option<String>,
}

impl Progress {
    fn absorb(&mut self, c: &DecodeChunk) {
        self.text.push_str(&c.delta);
        self.completion_tokens = self.completion_tokens.max(c.completion_tokens);
        if c.matched_stop.is_some() {
            self.matched_stop.clone_from(&c.matched_stop);
        }
    }
}

/// Starts the admitted request's pair, waits for the commit barrier, then answers in the client's
/// shape.
pub(crate) async fn serve_pair<R: Render>(admitted: Admitted, shape: R) -> Response {
    let model = admitted.model.name.clone();
    let Committed {
        rx,
        pair_id,
        prompt_tokens,
        cached_tokens,
        permit,
    } = match commit(admitted).await {
        Ok(c) => c,
        Err(e) => return shape.error(e),
    };
    let mut p = Progress {
        model: model.to_string(),
        pair_id,
        prompt_tokens,
        cached_tokens,
        created: now(),
        text: String::new(),
        completion_tokens: 0,
        matched_stop: None,
    };
    let mut rx = rx;
    if shape.stream() {
        let body =
            // The tenant's permit travels with the stream: released when the stream ends.
            futures_util::stream::unfold((rx, p, shape, false, permit), |(mut rx, mut p, mut shape, done, permit)| async move {
                if done {
                    return None;
                }
                let (out, last) = match rx.recv().await {
                    Some(PairEvent::Chunk(c)) => {
                        p.absorb(&c);
                        (shape.chunk(&p, &c), c.finish.is_some())
                    }
                    Some(PairEvent::Failed(e)) => (shape.stream_error(&p, &e), true),
                    // The task ended without a finish or an error: fail closed, never a success
                    // ending.
                    Some(PairEvent::Committed { .. }) | None => {
                        let e = Error::DecodeFailed {
                            pair_id: p.pair_id,
                            message: "pair ended without finishing".into(),
                        };
                        (shape.stream_error(&p, &e), true)
                    }
                };
                Some((Ok::<_, Infallible>(out), (rx, p, shape, last, permit)))
            });
        return answer(
            Response::builder()
                .header(http::header::CONTENT_TYPE, "text/event-stream")
                .header(http::header::CACHE_CONTROL, "no-cache"),
            pair_id,
            Body::from_stream(body),
        );
    }
    loop {
        match rx.recv().await {
            Some(PairEvent::Chunk(c)) => {
                p.absorb(&c);
                if let Some(finish) = c.finish {
                    let Ok(json) = shape.full_json(&p, finish) else {
                        return shape.error(build_failed());
                    };
                    return answer(
                        Response::builder().header(http::header::CONTENT_TYPE, "application/json"),
                        pair_id,
                        Body::from(json),
                    );
                }
            }
            Some(PairEvent::Failed(e)) => return shape.error(e),
            Some(PairEvent::Committed { .. }) | None => {
                return shape.error(LockstepError::DecodeFailed {
                    pair_id,
                    message: "pair ended without finishing".into(),
                });
            }
        }
    }
}

/// Seconds since the Unix epoch.
pub(crate) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// One SSE `data:` event.
pub(crate) fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// One SSE event with a type line (`event: NAME`), as the Responses and Messages APIs send.
pub(crate) fn sse_named(out: &mut String, name: &str, v: &Value) {
    out.push_str("event: ");
    out.push_str(name);
    out.push_str("\ndata: ");
    out.push_str(&v.to_string());
    out.push_str("\n\n");
}

/// Usage in the OpenAI chat and completion shape; cached prompt tokens under
/// `prompt_tokens_details`.
fn usage(p: &Progress) -> Value {
    json!({
        "prompt_tokens": p.prompt_tokens,
        "completion_tokens": p.completion_tokens,
        "total_tokens": p.prompt_tokens.saturating_add(p.completion_tokens),
        "prompt_tokens_details": { "cached_tokens": p.cached_tokens },
    })
}

impl Shape {
    fn id(&self, p: &Progress) -> String {
        match self.api {
            Api::Chat => format!("chatcmpl-{}", p.pair_id),
            _ => format!("cmpl-{}", p.pair_id),
        }
    }

    fn native(p: &Progress, finish: Option<FinishReason>) -> NativeAnswer<'_> {
        NativeAnswer {
            text: &p.text,
            meta_info: NativeMeta {
                id: p.pair_id.to_string(),
                finish_reason: finish.map(|f| match f {
                    FinishReason::Length => NativeFinish::Length {
                        length: p.completion_tokens,
                    },
                    FinishReason::Stop => NativeFinish::Stop {
                        matched: p.matched_stop.as_deref(),
                    },
                }),
                prompt_tokens: p.prompt_tokens,
                completion_tokens: p.completion_tokens,
                cached_tokens: p.cached_tokens,
            },
        }
    }
}

/// SGLang's native answer (and stream event): `{text, meta_info}`, written straight from the
/// pair's progress, with no `Value` built.
#[derive(serde::Serialize)]
struct NativeAnswer<'a> {
    text: &'a str,
    meta_info: NativeMeta<'a>,
}

/// The `meta_info` of a [`NativeAnswer`], in SGLang's key order.
#[derive(serde::Serialize)]
struct NativeMeta<'a> {
    id: String,
    finish_reason: Option<NativeFinish<'a>>,
    prompt_tokens: u64,
    completion_tokens: u64,
    cached_tokens: u64,
}

/// SGLang's `finish_reason` object: `{"type": "length", "length": n}` or `{"type": "stop"}`,
/// with `matched` where the worker named the stop string.
#[derive(serde::Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
enum NativeFinish<'a> {
    Length {
        length: u64,
    },
    Stop {
        #[serde(skip_serializing_if = "Option::is_none")]
        matched: Option<&'a str>,
    },
}

impl Render for Shape {
    fn stream(&self) -> bool {
        self.stream
    }

    fn full_json(&self, p: &Progress, finish: FinishReason) -> serde_json::Result<Vec<u8>> {
        match self.api {
            Api::Generate => serde_json::to_vec(&Self::native(p, Some(finish))),
            _ => serde_json::to_vec(&self.full(p, finish)),
        }
    }

    fn full(&self, p: &Progress, finish: FinishReason) -> Value {
        match self.api {
            Api::Chat => {
                let parsed = self
                    .tools
                    .as_ref()
                    .and_then(|t| tools::parse(t.kind, &p.text));
                let mut message = json!({ "role": "assistant", "content": p.text });
                let mut reason = finish.as_str();
                if let Some((content, calls)) = parsed {
                    message["content"] = if content.is_empty() {
                        Value::Null
                    } else {
                        json!(content)
                    };
                    message["tool_calls"] =
                        json!(tools::tool_calls_json(&p.pair_id.to_string(), &calls));
                    if finish == FinishReason::Stop {
                        reason = "tool_calls";
                    }
                }
                json!({
                    "id": self.id(p), "object": "chat.completion", "created": p.created, "model": p.model,
                    "choices": [{ "index": 0, "message": message, "logprobs": null, "finish_reason": reason }],
                    "usage": usage(p),
                })
            }
            Api::Completion => json!({
                "id": self.id(p), "object": "text_completion", "created": p.created, "model": p.model,
                "choices": [{ "index": 0, "text": p.text, "logprobs": null, "finish_reason": finish.as_str() }],
                "usage": usage(p),
            }),
            Api::Generate => json!(Self::native(p, Some(finish))),
        }
    }

    /// SSE events for one chunk; the last chunk also carries usage (when asked) and `[DONE]`.
    fn chunk(&mut self, p: &Progress, c: &DecodeChunk) -> Bytes {
        let mut out = String::new();
        let finish = c.finish.map(FinishReason::as_str);
        let mut push = |v: Value| {
            out.push_str("data: ");
            out.push_str(&v.to_string());
            out.push_str("\n\n");
        };
        let id = self.id(p);
        match self.api {
            Api::Chat => {
                let base = |delta: Value, finish: Option<&str>| {
                    json!({ "id": id, "object": "chat.completion.chunk", "created": p.created, "model": p.model,
                            "choices": [{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish }] })
                };
                if !self.started {
                    push(base(json!({ "role": "assistant", "content": "" }), None));
                }
                let content = match &mut self.tools {
                    Some(t) => t.push(&c.delta),
                    None => c.delta.clone(),
                };
                if !content.is_empty() {
                    push(base(json!({ "content": content }), None));
                }
                if let Some(f) = c.finish {
                    let mut reason = f.as_str();
                    if let Some(t) = &mut self.tools {
                        let (rest, calls) = t.finish();
                        if !rest.is_empty() {
                            push(base(json!({ "content": rest }), None));
                        }
                        if !calls.is_empty() {
                            let mut deltas = tools::tool_calls_json(&p.pair_id.to_string(), &calls);
                            for (i, d) in deltas.iter_mut().enumerate() {
                                d["index"] = json!(i);
                            }
                            push(base(json!({ "tool_calls": deltas }), None));
                            if f == FinishReason::Stop {
                                reason = "tool_calls";
                            }
                        }
                    }
                    push(base(json!({}), Some(reason)));
                }
            }
            Api::Completion => {
                if !c.delta.is_empty() || finish.is_some() {
                    push(
                        json!({ "id": id, "object": "text_completion", "created": p.created, "model": p.model,
                                 "choices": [{ "index": 0, "text": c.delta, "logprobs": null, "finish_reason": finish }] }),
                    );
                }
            }
            Api::Generate => push(json!(Self::native(p, c.finish))),
        }
        self.started = true;
        if finish.is_some() {
            if self.include_usage {
                let object = if self.api == Api::Chat {
                    "chat.completion.chunk"
                } else {
                    "text_completion"
                };
                push(
                    json!({ "id": id, "object": object, "created": p.created, "model": p.model,
                             "choices": [], "usage": usage(p) }),
                );
            }
            out.push_str("data: [DONE]\n\n");
        }
        Bytes::from(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn progress(matched: Option<&str>) -> Progress {
        Progress {
            model: "m".into(),
            pair_id: PairId::from_raw(42),
            prompt_tokens: 7,
            cached_tokens: 2,
            created: 1,
            text: "a \"quoted\"\n é".into(),
            completion_tokens: 3,
            matched_stop: matched.map(str::to_owned),
        }
    }

    /// The native answer is written straight from the progress; it must be SGLang's shape,
    /// key for key and in SGLang's order, for every finish.
    #[test]
    fn the_native_answer_is_sglangs_shape() {
        let shape = Shape::generate(false);
        let id = PairId::from_raw(42).to_string();
        for (finish, matched, want) in [
            (
                FinishReason::Length,
                None,
                json!({ "type": "length", "length": 3 }),
            ),
            (FinishReason::Stop, None, json!({ "type": "stop" })),
            (
                FinishReason::Stop,
                Some("</s>"),
                json!({ "type": "stop", "matched": "</s>" }),
            ),
        ] {
            let p = progress(matched);
            let want = json!({ "text": "a \"quoted\"\n é", "meta_info": {
                "id": id, "finish_reason": want, "prompt_tokens": 7, "completion_tokens": 3,
                "cached_tokens": 2 } });
            let written = shape.full_json(&p, finish).expect("written");
            assert_eq!(
                String::from_utf8(written).expect("utf-8"),
                want.to_string(),
                "{finish:?} {matched:?}"
            );
            assert_eq!(shape.full(&p, finish), want);
        }
    }
}

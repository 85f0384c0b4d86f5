//! Turning a pair's events into the client's response shape, streamed (SSE) or not: OpenAI chat,
//! OpenAI completion and SGLang-native here ([`OpenAiShape`]); the Responses API and Anthropic Messages
//! in their own modules, each a [`Render`]. Nothing is written before the pair commits.

use std::borrow::Cow;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::StreamExt;
use serde_json::{Map, Value, json};

use super::openai_out::{
    Answer, AnswerId, ChatChoice, ChatDelta, Delta, Message, TextChoice, Usage, push_event,
};
use super::tools::{self, ToolStream};
use crate::admission::{Admitted, PromptCodec};
use crate::backend::{DecodeChunk, FinishReason, TokenLogprobs};
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
pub(crate) struct OpenAiShape {
    api: Api,
    stream: bool,
    include_usage: bool,
    /// Whether the stream's first event went out.
    started: bool,
    /// The model's tool-call parser and the stream's split between content and calls.
    tools: Option<ToolStream>,
    /// Log-probabilities, where the request asked for them.
    logprobs: Option<Logprobs>,
    /// A completion's `echo`: the prompt, put before the text (as its text once the model's
    /// tokenizer is known).
    echo: Option<Echo>,
}

/// The prompt a completion with `echo` repeats.
#[derive(Debug)]
pub(crate) enum Echo {
    /// The prompt's text.
    Text(String),
    /// Token ids, decoded when the tokenizer is known ([`Render::vocab`]).
    Ids(Vec<u32>),
}

impl Echo {
    fn text(&self) -> &str {
        match self {
            Echo::Text(t) => t,
            Echo::Ids(_) => "",
        }
    }
}

/// What an answer with log-probabilities keeps: the tokens' bytes come from the model's
/// tokenizer; in a stream, the tokens not yet sent (a chunk whose text is held back sends no
/// event) and the completion's text offset so far; for `/generate`, the top count
/// (`top_logprobs_num`) and whether entries carry token texts (`return_text_in_logprobs`).
#[derive(Debug, Default)]
pub(crate) struct Logprobs {
    pub(crate) codec: Option<Arc<PromptCodec>>,
    pub(crate) pending: Vec<(u32, TokenLogprobs)>,
    pub(crate) offset: usize,
    pub(crate) top: u32,
    pub(crate) texts: bool,
}

impl OpenAiShape {
    pub(crate) fn chat(stream: bool, include_usage: bool) -> OpenAiShape {
        OpenAiShape {
            api: Api::Chat,
            stream,
            include_usage,
            started: false,
            tools: None,
            logprobs: None,
            echo: None,
        }
    }
    pub(crate) fn completion(stream: bool, include_usage: bool) -> OpenAiShape {
        OpenAiShape {
            api: Api::Completion,
            stream,
            include_usage,
            started: false,
            tools: None,
            logprobs: None,
            echo: None,
        }
    }
    /// An answer with each token's log-probabilities (`Some`: the request asked for them).
    pub(crate) fn with_logprobs(mut self, top: Option<u32>) -> OpenAiShape {
        self.logprobs = top.map(|top| Logprobs {
            top,
            ..Logprobs::default()
        });
        self
    }

    /// A completion that repeats its prompt before its text (`echo`).
    pub(crate) fn with_echo(mut self, echo: Echo) -> OpenAiShape {
        self.echo = Some(echo);
        self
    }

    /// The text of a whole completion: the prompt first where it is echoed.
    fn completion_text<'a>(&self, p: &'a Progress) -> Cow<'a, str> {
        match &self.echo {
            Some(e) => Cow::Owned(format!("{}{}", e.text(), p.text)),
            None => Cow::Borrowed(&p.text),
        }
    }

    /// `/generate`'s `return_text_in_logprobs`.
    pub(crate) fn with_logprob_texts(mut self, texts: bool) -> OpenAiShape {
        if let Some(l) = self.logprobs.as_mut() {
            l.texts = texts;
        }
        self
    }
    /// Chat whose answer is parsed for calls to the declared tools in their parser's format.
    pub(crate) fn with_tools(mut self, tools: Option<tools::ToolParse>) -> OpenAiShape {
        self.tools = tools.map(ToolStream::new);
        self
    }
    pub(crate) fn generate(stream: bool) -> OpenAiShape {
        OpenAiShape {
            api: Api::Generate,
            stream,
            include_usage: false,
            started: false,
            tools: None,
            logprobs: None,
            echo: None,
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
    pub(crate) permit: crate::tenant::Held,
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
        prefill,
    } = admitted;
    let (mut rx, _task) = model.pairs.start(
        ids.into(),
        ids_json,
        sampling.into(),
        caller.tenant.clone(),
        prefill,
    );
    match rx.recv().await {
        Some(PairEvent::Committed {
            pair_id,
            prompt_tokens,
            cached_tokens,
        }) => {
            let mut permit = caller.permit;
            permit.committed(prompt_tokens);
            Ok(Committed {
                rx,
                pair_id,
                prompt_tokens,
                cached_tokens,
                permit,
            })
        }
        Some(PairEvent::Failed(e)) => Err(e),
        Some(PairEvent::Chunk(_)) | None => Err(LockstepError::Unavailable {
            message: "pair ended without an outcome".into(),
        }),
    }
}

/// A committed pair's answer as every front end reads it (HTTP shapes and gRPC): its chunks up
/// to and including the one that finishes, or the error that ends it. A pair whose task ends
/// without a finish or an error ends with an error: fail closed, so no front end can end a
/// committed answer as a success unless a chunk said it finished. What the tenant's request holds
/// travels with the stream (released when it ends or is dropped), its token reservation charged
/// with the completion tokens each chunk delivers.
pub(crate) fn committed_chunks(
    rx: tokio::sync::mpsc::Receiver<PairEvent>,
    pair_id: PairId,
    permit: crate::tenant::Held,
    logprobs: Option<u32>,
) -> impl futures_util::Stream<Item = Result<DecodeChunk, LockstepError>> + Send + 'static {
    futures_util::stream::unfold(Some((rx, permit, 0)), move |open| async move {
        let (mut rx, permit, before) = open?;
        let item = match rx.recv().await {
            Some(PairEvent::Chunk(c)) => {
                match logprobs.map_or(Ok(()), |k| super::logprobs::check(pair_id, k, &c, before)) {
                    Ok(()) => {
                        permit.delivered(c.completion_tokens);
                        let (last, now) = (c.finish.is_some(), c.completion_tokens);
                        return Some((Ok(c), (!last).then_some((rx, permit, now))));
                    }
                    Err(e) => e,
                }
            }
            Some(PairEvent::Failed(e)) => e,
            Some(PairEvent::Committed { .. }) | None => LockstepError::DecodeFailed {
                pair_id,
                message: "pair ended without finishing".into(),
            },
        };
        Some((Err(item), None))
    })
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
    /// The model's tokenizer, given before the first chunk (for the token texts of
    /// log-probabilities).
    fn vocab(&mut self, codec: &Arc<PromptCodec>) {
        let _ = codec;
    }
}

/// A pair's answer: `head` with the pair id header, and `body`.
fn answer(head: http::response::Builder, pair_id: PairId, body: Body) -> Response {
    head.header(
        http::HeaderName::from_static("x-lockstep-pair-id"),
        pair_id.to_string(),
    )
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
    /// Each token's id and log-probabilities so far, where the request asked for them.
    pub(crate) logprobs: Vec<(u32, TokenLogprobs)>,
}

impl Progress {
    /// The usage so far, in OpenAI's shape.
    pub(crate) fn usage(&self) -> Usage {
        Usage::new(
            self.prompt_tokens,
            self.completion_tokens,
            self.cached_tokens,
        )
    }

    fn absorb(&mut self, c: &DecodeChunk) {
        self.text.push_str(&c.delta);
        self.logprobs
            .extend(c.token_ids.iter().copied().zip(c.logprobs.iter().cloned()));
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
    let (codec, logprobs) = (admitted.model.codec.clone(), admitted.sampling.logprobs);
    let mut shape = shape;
    shape.vocab(&codec);
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
        logprobs: Vec::new(),
    };
    let chunks = committed_chunks(rx, pair_id, permit, logprobs);
    if shape.stream() {
        let body = chunks.scan((p, shape), |(p, shape), next| {
            let out = match next {
                Ok(c) => {
                    p.absorb(&c);
                    shape.chunk(p, &c)
                }
                Err(e) => shape.stream_error(p, &e),
            };
            std::future::ready(Some(Ok::<_, Infallible>(out)))
        });
        return answer(
            Response::builder()
                .header(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("text/event-stream"),
                )
                .header(
                    http::header::CACHE_CONTROL,
                    http::HeaderValue::from_static("no-cache"),
                ),
            pair_id,
            Body::from_stream(body),
        );
    }
    let mut chunks = std::pin::pin!(chunks);
    while let Some(next) = chunks.next().await {
        let c = match next {
            Ok(c) => c,
            Err(e) => return shape.error(e),
        };
        p.absorb(&c);
        if let Some(finish) = c.finish {
            let Ok(json) = shape.full_json(&p, finish) else {
                return shape.error(build_failed());
            };
            return answer(
                Response::builder().header(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("application/json"),
                ),
                pair_id,
                Body::from(json),
            );
        }
    }
    // The chunks end with a finish or an error: never here.
    shape.error(build_failed())
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

impl OpenAiShape {
    fn id(&self, p: &Progress) -> AnswerId {
        let prefix = match self.api {
            Api::Chat => "chatcmpl-",
            _ => "cmpl-",
        };
        AnswerId {
            prefix,
            pair: p.pair_id,
        }
    }

    /// The whole answer's `logprobs` (`None`: not asked for).
    fn full_logprobs(&self, p: &Progress) -> Option<Value> {
        let codec = self.logprobs.as_ref()?.codec.as_ref()?;
        match self.api {
            Api::Chat => Some(super::logprobs::chat(codec, &p.logprobs)),
            Api::Completion => Some(super::logprobs::completion(codec, &p.logprobs, &mut 0)),
            Api::Generate => None,
        }
    }

    /// The `logprobs` of the tokens not sent yet, for the event about to go out (`None`: not
    /// asked for, or none waiting).
    fn take_pending(&mut self) -> Option<Value> {
        let l = self.logprobs.as_mut().filter(|l| !l.pending.is_empty())?;
        let codec = l.codec.clone()?;
        let tokens = std::mem::take(&mut l.pending);
        match self.api {
            Api::Chat => Some(super::logprobs::chat(&codec, &tokens)),
            Api::Completion => Some(super::logprobs::completion(&codec, &tokens, &mut l.offset)),
            Api::Generate => None,
        }
    }

    /// The tool calls in a finished chat answer's text (with the text around them), where
    /// the model's calls are parsed and the text has some.
    fn tool_calls(&self, p: &Progress) -> Option<(String, Vec<tools::Call>)> {
        self.tools
            .as_ref()
            .and_then(|t| tools::parse(&t.tools, &p.text))
    }

    /// An answer or chunk of this shape around `choices`.
    fn answer<'a, C>(&self, p: &'a Progress, object: &'static str, choices: C) -> Answer<'a, C> {
        Answer {
            id: self.id(p),
            object,
            created: p.created,
            model: &p.model,
            choices,
            usage: None,
        }
    }

    fn native<'a>(&self, p: &'a Progress, finish: Option<FinishReason>) -> NativeAnswer<'a> {
        let logprobs = self.logprobs.as_ref().and_then(|l| {
            let codec = l.codec.as_ref()?;
            Some(super::logprobs::sglang(codec, &p.logprobs, l.top, l.texts))
        });
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
                logprobs,
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
    /// With `return_logprob`: SGLang's `input_token_logprobs`, `output_token_logprobs`, ...
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    logprobs: Option<Map<String, Value>>,
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

impl Render for OpenAiShape {
    fn stream(&self) -> bool {
        self.stream
    }

    fn vocab(&mut self, codec: &Arc<PromptCodec>) {
        if let Some(l) = self.logprobs.as_mut() {
            l.codec = Some(codec.clone());
        }
        if let Some(Echo::Ids(ids)) = &self.echo {
            self.echo = Some(Echo::Text(codec.decode(ids)));
        }
    }

    fn full_json(&self, p: &Progress, finish: FinishReason) -> serde_json::Result<Vec<u8>> {
        fn with_usage<C: serde::Serialize>(p: &Progress, mut a: Answer<'_, C>) -> JsonBytes {
            a.usage = Some(p.usage());
            serde_json::to_vec(&a)
        }
        type JsonBytes = serde_json::Result<Vec<u8>>;
        match self.api {
            Api::Generate => serde_json::to_vec(&self.native(p, Some(finish))),
            // An answer with tool calls is built as a value (rare, and its calls are values).
            Api::Chat if self.tool_calls(p).is_some() => serde_json::to_vec(&self.full(p, finish)),
            Api::Chat => with_usage(
                p,
                self.answer(
                    p,
                    "chat.completion",
                    [ChatChoice {
                        index: 0,
                        message: Message {
                            role: "assistant",
                            content: &p.text,
                        },
                        logprobs: self.full_logprobs(p),
                        finish_reason: finish.as_str(),
                    }],
                ),
            ),
            Api::Completion => with_usage(
                p,
                self.answer(
                    p,
                    "text_completion",
                    [TextChoice {
                        index: 0,
                        text: &self.completion_text(p),
                        logprobs: self.full_logprobs(p),
                        finish_reason: Some(finish.as_str()),
                    }],
                ),
            ),
        }
    }

    fn full(&self, p: &Progress, finish: FinishReason) -> Value {
        let usage = json!(p.usage());
        match self.api {
            Api::Chat => {
                let mut message = json!({ "role": "assistant", "content": p.text });
                let mut reason = finish.as_str();
                if let Some((content, calls)) = self.tool_calls(p) {
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
                    "choices": [{ "index": 0, "message": message, "logprobs": self.full_logprobs(p), "finish_reason": reason }],
                    "usage": usage,
                })
            }
            Api::Completion => json!({
                "id": self.id(p), "object": "text_completion", "created": p.created, "model": p.model,
                "choices": [{ "index": 0, "text": self.completion_text(p), "logprobs": self.full_logprobs(p), "finish_reason": finish.as_str() }],
                "usage": usage,
            }),
            Api::Generate => json!(self.native(p, Some(finish))),
        }
    }

    /// SSE events for one chunk; the last chunk also carries usage (when asked) and `[DONE]`.
    fn chunk(&mut self, p: &Progress, c: &DecodeChunk) -> Bytes {
        let mut out = Vec::with_capacity(256 + 2 * c.delta.len());
        let finish = c.finish.map(FinishReason::as_str);
        // `/generate` streams whole answers so far: its events read the progress instead.
        if let Some(l) = self.logprobs.as_mut().filter(|_| self.api != Api::Generate) {
            l.pending
                .extend(c.token_ids.iter().copied().zip(c.logprobs.iter().cloned()));
        }
        match self.api {
            Api::Chat => {
                // The text and the calls first: they need the tool stream, mutably.
                let content: Cow<'_, str> = match &mut self.tools {
                    Some(t) => Cow::Owned(t.push(&c.delta)),
                    None => Cow::Borrowed(&c.delta),
                };
                let mut reason = None;
                let (mut rest, mut calls) = (String::new(), Vec::new());
                if let Some(f) = c.finish {
                    let mut r = f.as_str();
                    if let Some(t) = &mut self.tools {
                        let (text, found) = t.finish();
                        rest = text;
                        if !found.is_empty() {
                            calls = tools::tool_calls_json(&p.pair_id.to_string(), &found);
                            for (i, d) in calls.iter_mut().enumerate() {
                                d["index"] = json!(i);
                            }
                            if f == FinishReason::Stop {
                                r = "tool_calls";
                            }
                        }
                    }
                    reason = Some(r);
                }
                // The waiting tokens' log-probabilities go with the first text event, else
                // with the finishing one.
                let lp_content = (!content.is_empty()).then(|| self.take_pending()).flatten();
                let lp_rest = (reason.is_some() && !rest.is_empty())
                    .then(|| self.take_pending())
                    .flatten();
                let lp_end = reason.is_some().then(|| self.take_pending()).flatten();
                let mut event =
                    |delta: Delta<'_>, logprobs: Option<Value>, finish_reason: Option<&str>| {
                        let choice = ChatDelta {
                            index: 0,
                            delta,
                            logprobs,
                            finish_reason,
                        };
                        push_event(&mut out, &self.answer(p, "chat.completion.chunk", [choice]));
                    };
                if !self.started {
                    let start = Delta::Start {
                        role: "assistant",
                        content: "",
                    };
                    event(start, None, None);
                }
                if !content.is_empty() {
                    event(Delta::Content { content: &content }, lp_content, None);
                }
                if let Some(r) = reason {
                    if !rest.is_empty() {
                        event(Delta::Content { content: &rest }, lp_rest, None);
                    }
                    if !calls.is_empty() {
                        event(Delta::Tools { tool_calls: &calls }, None, None);
                    }
                    event(Delta::End {}, lp_end, Some(r));
                }
            }
            Api::Completion => {
                // The first event of an echoed completion starts with the prompt (as vLLM's).
                let text: Cow<'_, str> = match self.echo.as_ref().filter(|_| !self.started) {
                    Some(e) => Cow::Owned(format!("{}{}", e.text(), c.delta)),
                    None => Cow::Borrowed(&c.delta),
                };
                if !text.is_empty() || finish.is_some() {
                    let choice = TextChoice {
                        index: 0,
                        text: &text,
                        logprobs: self.take_pending(),
                        finish_reason: finish,
                    };
                    push_event(&mut out, &self.answer(p, "text_completion", [choice]));
                }
            }
            Api::Generate => push_event(&mut out, &self.native(p, c.finish)),
        }
        self.started = true;
        if finish.is_some() {
            if self.include_usage {
                let object = if self.api == Api::Chat {
                    "chat.completion.chunk"
                } else {
                    "text_completion"
                };
                let mut last = self.answer(p, object, [(); 0]);
                last.usage = Some(p.usage());
                push_event(&mut out, &last);
            }
            out.extend_from_slice(b"data: [DONE]\n\n");
        }
        Bytes::from(out)
    }
}

#[cfg(test)]
#[path = "respond_tests.rs"]
mod tests;

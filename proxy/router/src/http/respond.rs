//! Turning a pair's events into the client's response shape, streamed (SSE) or not: the commit
//! barrier, the committed chunks every front end reads, and the [`Render`] each API's shape
//! implements (OpenAI chat and completion and SGLang-native in `openai_shape.rs`, the Responses
//! API and Anthropic Messages in their own modules). Nothing is written before the pair commits.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::StreamExt;
use serde_json::Value;

use super::openai_out::Usage;
use crate::admission::Admitted;
use crate::backend::{DecodeChunk, FinishReason, TokenLogprobs};
use crate::pair::{PairEvent, PairId};
use lockstep_core::error::LockstepError as Error;
use lockstep_core::error::LockstepError;
use lockstep_prompt::PromptCodec;

/// A pair that passed the commit barrier: its events, id and the tenant's permit (held as long as
/// the response lives).
pub(crate) struct Committed {
    pub(crate) rx: tokio::sync::mpsc::Receiver<PairEvent>,
    pub(crate) pair_id: PairId,
    pub(crate) prompt_tokens: u64,
    pub(crate) cached_tokens: u64,
    pub(crate) permit: lockstep_tenancy::tenant::Held,
    /// The prompt's log-probabilities the prefill reported (SGLang's), for the first chunk.
    pub(crate) prompt_logprobs: Option<Vec<TokenLogprobs>>,
}

/// Starts the pair of an admitted request and waits for the commit barrier. Shared by every
/// front end (HTTP shapes and gRPC). Dropping the future before it returns drops the pair's
/// receiver: both halves abort.
pub(crate) async fn commit(admitted: Admitted) -> Result<Committed, LockstepError> {
    let (launch, permit) = Launch::of(admitted);
    launch.commit(permit).await
}

/// What starts one pair of an admitted request (each choice's, where it asked for several).
#[derive(Clone)]
pub(crate) struct Launch {
    pub(crate) model: Arc<crate::state::ModelRuntime>,
    pub(crate) ids: Arc<[u32]>,
    pub(crate) ids_json: Option<Bytes>,
    pub(crate) sampling: Arc<crate::backend::SamplingParams>,
    pub(crate) tenant: Option<Arc<lockstep_tenancy::tenant::Tenant>>,
    pub(crate) prefill: lockstep_routing::pool::PrefillPin,
}

impl Launch {
    /// The pair an admitted request starts, and what its first choice holds of the tenant's
    /// limits.
    pub(crate) fn of(admitted: Admitted) -> (Launch, lockstep_tenancy::tenant::Held) {
        let Admitted {
            model,
            ids,
            ids_json,
            sampling,
            caller,
            prefill,
            further: _,
        } = admitted;
        let launch = Launch {
            model,
            ids: ids.into(),
            ids_json,
            sampling: sampling.into(),
            tenant: caller.tenant.clone(),
            prefill,
        };
        (launch, caller.permit)
    }

    /// Starts the pair and waits for its commit barrier; `permit` lives as long as its answer.
    pub(crate) async fn commit(
        self,
        mut permit: lockstep_tenancy::tenant::Held,
    ) -> Result<Committed, LockstepError> {
        let (mut rx, _task) = self.model.pairs.start(
            self.ids,
            self.ids_json,
            self.sampling,
            self.tenant,
            self.prefill,
        );
        match rx.recv().await {
            Some(PairEvent::Committed {
                pair_id,
                prompt_tokens,
                cached_tokens,
                prompt_logprobs,
            }) => {
                permit.committed(prompt_tokens);
                Ok(Committed {
                    rx,
                    pair_id,
                    prompt_tokens,
                    cached_tokens,
                    permit,
                    prompt_logprobs,
                })
            }
            Some(PairEvent::Failed(e)) => Err(e),
            Some(PairEvent::Chunk(_)) | None => Err(LockstepError::Unavailable {
                message: "pair ended without an outcome".into(),
            }),
        }
    }
}

/// What an answer needs of its admitted request besides its pair: the model's name, and the
/// log-probabilities it asked for (its tokens' alternatives; its prompt's, with the prompt).
#[derive(Clone)]
pub(crate) struct Asked {
    model: String,
    prompt_ids: Vec<u32>,
    scored: Option<u32>,
    logprobs: Option<u32>,
}

impl Asked {
    /// What `admitted` asked, with `shape` checked against its prompt (`Err`: the refusal) and
    /// given the model's tokenizer.
    pub(crate) fn of<R: Render>(
        admitted: &Admitted,
        shape: &mut R,
    ) -> Result<Asked, LockstepError> {
        shape.fits_prompt(admitted.ids.len())?;
        shape.vocab(&admitted.model.codec);
        let scored = admitted.sampling.prompt_logprobs;
        Ok(Asked {
            model: admitted.model.name.to_string(),
            prompt_ids: scored.map(|_| admitted.ids.clone()).unwrap_or_default(),
            scored,
            logprobs: admitted.sampling.logprobs,
        })
    }
}

impl Committed {
    /// The answer's progress so far (nothing yet) and its chunks as [`committed_chunks`] reads
    /// them, checked for what `asked` asked.
    pub(crate) fn answer(
        self,
        asked: Asked,
    ) -> (
        Progress,
        impl futures_util::Stream<Item = Result<DecodeChunk, LockstepError>> + Send + 'static,
    ) {
        let p = Progress {
            model: asked.model,
            pair_id: self.pair_id,
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            created: now(),
            text: String::new(),
            completion_tokens: 0,
            matched_stop: None,
            logprobs: Vec::new(),
            prompt: (asked.prompt_ids, Vec::new()),
        };
        let prompt = asked.scored.map(|k| PromptScores {
            k,
            n: self.prompt_tokens.saturating_sub(1),
            reported: self.prompt_logprobs,
        });
        let chunks = committed_chunks(self.rx, self.pair_id, self.permit, asked.logprobs, prompt);
        (p, chunks)
    }
}

/// What a request asked of its prompt's log-probabilities: `k` alternatives for each of the `n`
/// prompt tokens after the first, and the entries its prefill reported (SGLang's; the embedded
/// engine's come with the first chunk).
pub(crate) struct PromptScores {
    pub(crate) k: u32,
    pub(crate) n: u64,
    pub(crate) reported: Option<Vec<TokenLogprobs>>,
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
    permit: lockstep_tenancy::tenant::Held,
    logprobs: Option<u32>,
    prompt: Option<PromptScores>,
) -> impl futures_util::Stream<Item = Result<DecodeChunk, LockstepError>> + Send + 'static {
    let (check, reported) = match prompt {
        Some(p) => (Some((p.k, p.n)), p.reported),
        None => (None, None),
    };
    futures_util::stream::unfold(Some((rx, permit, 0, reported)), move |open| async move {
        let (mut rx, permit, before, mut reported) = open?;
        let item = match rx.recv().await {
            Some(PairEvent::Chunk(mut c)) => {
                // The prefill's report of the prompt (SGLang) goes out with the first chunk.
                if c.prompt_logprobs.is_none() {
                    c.prompt_logprobs = reported.take();
                }
                let checked = logprobs
                    .map_or(Ok(()), |k| super::logprobs::check(pair_id, k, &c, before))
                    .and_then(|()| match check {
                        Some((k, n)) if before == 0 => {
                            super::logprobs::check_prompt(pair_id, k, n, &c)
                        }
                        _ => Ok(()),
                    });
                match checked {
                    Ok(()) => {
                        permit.delivered(c.completion_tokens);
                        let (last, now) = (c.finish.is_some(), c.completion_tokens);
                        return Some((Ok(c), (!last).then_some((rx, permit, now, None))));
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
    /// Checks what the request asked against its prompt's token count, before the pair starts
    /// (`/generate`'s `logprob_start_len` must lie within the prompt).
    fn fits_prompt(&self, tokens: usize) -> Result<(), Error> {
        let _ = tokens;
        Ok(())
    }
    /// The model's tokenizer, given before the first chunk (for the token texts of
    /// log-probabilities).
    fn vocab(&mut self, codec: &Arc<PromptCodec>) {
        let _ = codec;
    }
}

/// A pair's answer: `head` with the pair id header, and `body`.
pub(crate) fn answer(head: http::response::Builder, pair_id: PairId, body: Body) -> Response {
    head.header(
        http::HeaderName::from_static("x-lockstep-pair-id"),
        pair_id.to_string(),
    )
    .body(body)
    .unwrap_or_else(|_| build_failed().into_response())
}

/// `head` for an SSE answer: `text/event-stream`, not cached.
pub(crate) fn event_stream(head: http::response::Builder) -> http::response::Builder {
    head.header(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/event-stream"),
    )
    .header(
        http::header::CACHE_CONTROL,
        http::HeaderValue::from_static("no-cache"),
    )
}

/// `head` for a JSON answer.
pub(crate) fn json_head(head: http::response::Builder) -> http::response::Builder {
    head.header(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    )
}

/// The error for an answer that could not be built.
pub(crate) fn build_failed() -> LockstepError {
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
    /// The prompt's ids and the log-probabilities of its tokens after the first, where the
    /// request asked for them (empty otherwise).
    pub(crate) prompt: super::logprobs::ScoredPrompt,
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

    pub(crate) fn absorb(&mut self, c: &DecodeChunk) {
        if let Some(p) = &c.prompt_logprobs {
            self.prompt.1.clone_from(p);
        }
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
    let mut shape = shape;
    let asked = match Asked::of(&admitted, &mut shape) {
        Ok(a) => a,
        Err(e) => return shape.error(e),
    };
    let committed = match commit(admitted).await {
        Ok(c) => c,
        Err(e) => return shape.error(e),
    };
    let pair_id = committed.pair_id;
    let (mut p, chunks) = committed.answer(asked);
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
            event_stream(Response::builder()),
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
            return answer(json_head(Response::builder()), pair_id, Body::from(json));
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

//! The OpenAI chat and completion answers and SGLang's native one ([`OpenAiShape`]), whole or as
//! SSE chunks: text, tool calls (chat), log-probabilities, a completion's echoed prompt.

use std::borrow::Cow;
use std::sync::Arc;

use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::openai_out::{
    Answer, AnswerId, ChatChoice, ChatDelta, Delta, Message, TextChoice, push_event,
};
use super::respond::{Progress, Render};
use super::tools::{self, ToolStream};
use crate::backend::{DecodeChunk, FinishReason, TokenLogprobs};
use lockstep_prompt::PromptCodec;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Completion,
    Generate,
}

/// What the client asked for: which API shape, streamed or not, usage on the stream or not,
/// and whether tool calls are parsed from the answer (chat); with several choices (`n`), which
/// one this shape writes.
#[derive(Debug, Clone)]
pub(crate) struct OpenAiShape {
    api: Api,
    /// Choices the request asked for (`n`); with more than one, each choice's shape writes its
    /// own events and the stream's ending is written once ([`OpenAiShape::ending`]).
    choices: u32,
    /// The choice this shape writes (its `index`).
    index: u32,
    /// The answer's id where it is not this choice's own pair's (the first choice's pair names
    /// an answer of several).
    answer: Option<crate::pair::PairId>,
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
#[derive(Debug, Clone)]
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
#[derive(Debug, Default, Clone)]
pub(crate) struct Logprobs {
    pub(crate) codec: Option<Arc<PromptCodec>>,
    pub(crate) pending: Vec<(u32, TokenLogprobs)>,
    pub(crate) offset: usize,
    pub(crate) top: u32,
    pub(crate) texts: bool,
    /// `/generate`'s `logprob_start_len`: the prompt's entries from this position.
    pub(crate) start: Option<usize>,
}

impl OpenAiShape {
    fn new(api: Api, stream: bool, include_usage: bool) -> OpenAiShape {
        OpenAiShape {
            api,
            choices: 1,
            index: 0,
            answer: None,
            stream,
            include_usage,
            started: false,
            tools: None,
            logprobs: None,
            echo: None,
        }
    }
    pub(crate) fn chat(stream: bool, include_usage: bool) -> OpenAiShape {
        OpenAiShape::new(Api::Chat, stream, include_usage)
    }
    pub(crate) fn completion(stream: bool, include_usage: bool) -> OpenAiShape {
        OpenAiShape::new(Api::Completion, stream, include_usage)
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

    /// `/generate`'s `logprob_start_len` (`None`: the output's entries only).
    pub(crate) fn with_logprob_start(mut self, start: Option<usize>) -> OpenAiShape {
        if let Some(l) = self.logprobs.as_mut() {
            l.start = start;
        }
        self
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
        OpenAiShape::new(Api::Generate, stream, false)
    }

    /// An answer of `n` choices (chat and completions' `n`).
    pub(crate) fn with_choices(mut self, n: u32) -> OpenAiShape {
        self.choices = n.max(1);
        self
    }

    /// Choices asked for.
    pub(crate) fn choices(&self) -> u32 {
        self.choices
    }

    /// The shape of choice `index` of an answer named by the pair `answer`.
    pub(crate) fn for_choice(&self, index: u32, answer: crate::pair::PairId) -> OpenAiShape {
        OpenAiShape {
            index,
            answer: Some(answer),
            ..self.clone()
        }
    }

    /// What ends a stream: the usage event where asked (`usage`: every choice's), then `[DONE]`.
    pub(crate) fn ending(&self, p: &Progress, usage: super::openai_out::Usage) -> Vec<u8> {
        let mut out = Vec::new();
        if self.include_usage {
            let object = if self.api == Api::Chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            };
            let mut last = self.answer(p, object, [(); 0]);
            last.usage = Some(usage);
            push_event(&mut out, &last);
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        out
    }
}

impl OpenAiShape {
    fn id(&self, p: &Progress) -> AnswerId {
        let prefix = match self.api {
            Api::Chat => "chatcmpl-",
            _ => "cmpl-",
        };
        AnswerId {
            prefix,
            pair: self.answer.unwrap_or(p.pair_id),
        }
    }

    /// The whole answer's `logprobs` (`None`: not asked for).
    fn full_logprobs(&self, p: &Progress) -> Option<Value> {
        let codec = self.logprobs.as_ref()?.codec.as_ref()?;
        match self.api {
            Api::Chat => Some(super::logprobs::chat(codec, &p.logprobs)),
            Api::Completion if !p.prompt.0.is_empty() => Some(super::logprobs::completion_echoed(
                codec,
                &p.prompt,
                &p.logprobs,
                &mut 0,
            )),
            Api::Completion => Some(super::logprobs::completion(codec, &p.logprobs, &mut 0)),
            Api::Generate => None,
        }
    }

    /// The `logprobs` of the tokens not sent yet, for the event about to go out (`None`: not
    /// asked for, or none waiting).
    fn take_pending(&mut self, p: &Progress) -> Option<Value> {
        // An echoed completion's first event carries the prompt's entries before its tokens'.
        let echoed = !self.started && !p.prompt.0.is_empty();
        let l = self
            .logprobs
            .as_mut()
            .filter(|l| echoed || !l.pending.is_empty())?;
        let codec = l.codec.clone()?;
        let tokens = std::mem::take(&mut l.pending);
        match self.api {
            Api::Completion if echoed => Some(super::logprobs::completion_echoed(
                &codec,
                &p.prompt,
                &tokens,
                &mut l.offset,
            )),
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
            let prompt = l.start.map(|s| (s, &p.prompt));
            Some(super::logprobs::sglang(
                codec,
                &p.logprobs,
                prompt,
                l.top,
                l.texts,
            ))
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
    fn fits_prompt(&self, tokens: usize) -> Result<(), lockstep_core::error::LockstepError> {
        match self.logprobs.as_ref().and_then(|l| l.start) {
            // As SGLang 0.5.23's scheduler refuses it (`scheduler.py`: "is higher than the
            // number of input tokens").
            Some(s) if s > tokens => Err(lockstep_core::error::LockstepError::InvalidRequest {
                message: format!(
                    "`logprob_start_len` {s} is higher than the number of input tokens {tokens}"
                ),
                param: Some("logprob_start_len".into()),
            }),
            _ => Ok(()),
        }
    }

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
                        index: self.index,
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
                        index: self.index,
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
                    "choices": [{ "index": self.index, "message": message, "logprobs": self.full_logprobs(p), "finish_reason": reason }],
                    "usage": usage,
                })
            }
            Api::Completion => json!({
                "id": self.id(p), "object": "text_completion", "created": p.created, "model": p.model,
                "choices": [{ "index": self.index, "text": self.completion_text(p), "logprobs": self.full_logprobs(p), "finish_reason": finish.as_str() }],
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
                let lp_content = (!content.is_empty())
                    .then(|| self.take_pending(p))
                    .flatten();
                let lp_rest = (reason.is_some() && !rest.is_empty())
                    .then(|| self.take_pending(p))
                    .flatten();
                let lp_end = reason.is_some().then(|| self.take_pending(p)).flatten();
                let mut event =
                    |delta: Delta<'_>, logprobs: Option<Value>, finish_reason: Option<&str>| {
                        let choice = ChatDelta {
                            index: self.index,
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
                        index: self.index,
                        text: &text,
                        logprobs: self.take_pending(p),
                        finish_reason: finish,
                    };
                    push_event(&mut out, &self.answer(p, "text_completion", [choice]));
                }
            }
            Api::Generate => push_event(&mut out, &self.native(p, c.finish)),
        }
        self.started = true;
        // With several choices the stream ends once, after every choice finished.
        if finish.is_some() && self.choices == 1 {
            out.extend(self.ending(p, p.usage()));
        }
        Bytes::from(out)
    }
}

#[cfg(test)]
#[path = "openai_shape_tests.rs"]
mod tests;

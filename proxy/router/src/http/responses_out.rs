//! The Responses API's answers: the `response` object, and its stream of typed events
//! (`response.created` ... `response.completed`). Output items are a `message` (the text) and,
//! where the request had tools, one `function_call` item per call the model made.

use std::sync::Arc;

use bytes::Bytes;
use serde_json::{Value, json};

use super::openai_shape::Logprobs;
use super::respond::{Progress, Render, sse_named};
use super::tools::{self, Call, ToolStream};
use crate::backend::{DecodeChunk, FinishReason};
use lockstep_core::error::LockstepError;
use lockstep_prompt::PromptCodec;

/// How a Responses answer looks: one `response` object, or its stream of typed events.
#[derive(Debug)]
pub(crate) struct ResponsesShape {
    /// The response's id (`resp_` + random); its items' ids are made from it.
    id: String,
    stream: bool,
    /// The next event's `sequence_number`.
    seq: u64,
    /// Request settings the response object repeats.
    echo: Value,
    /// The model's tool-call parser and the stream's split between text and calls.
    tools: Option<ToolStream>,
    /// Whether the stream opened its message item.
    opened: bool,
    /// Where the request included log-probabilities: the model's tokenizer (for the token
    /// texts) and, in a stream, the tokens whose entries no delta carried yet.
    logprobs: Option<Logprobs>,
    /// Where the events are kept as well as written (a stored response's): each event's type
    /// and object, until taken.
    journal: Option<Vec<(String, Value)>>,
}

impl ResponsesShape {
    pub(crate) fn new(
        id: String,
        stream: bool,
        echo: Value,
        tools: Option<super::tools::ToolParse>,
    ) -> ResponsesShape {
        ResponsesShape {
            id,
            journal: None,
            stream,
            seq: 0,
            echo,
            tools: tools.map(ToolStream::new),
            opened: false,
            logprobs: None,
        }
    }

    /// Output text with each token's log-probabilities (`Some`: `include` asked for them).
    pub(crate) fn with_logprobs(mut self, top: Option<u32>) -> ResponsesShape {
        self.logprobs = top.map(|_| Logprobs::default());
        self
    }

    /// The `logprobs` list of the whole output text (empty where not asked for).
    fn all_logprobs(&self, p: &Progress) -> Value {
        match self.logprobs.as_ref().and_then(|l| l.codec.as_ref()) {
            Some(codec) => json!(super::logprobs::entries(codec, &p.logprobs)),
            None => json!([]),
        }
    }

    /// The `logprobs` list of the tokens no delta carried yet.
    fn pending_logprobs(&mut self) -> Value {
        match &mut self.logprobs {
            Some(Logprobs {
                codec: Some(codec),
                pending,
                ..
            }) => {
                let tokens = std::mem::take(pending);
                json!(super::logprobs::entries(codec, &tokens))
            }
            _ => json!([]),
        }
    }
}

impl ResponsesShape {
    /// The response's id.
    pub(crate) fn id(&self) -> &str {
        &self.id
    }

    /// Whether the client asked for a stream.
    pub(crate) fn streams(&self) -> bool {
        self.stream
    }

    /// Keeps every event (type and object) until [`ResponsesShape::take_events`].
    pub(crate) fn journaled(mut self) -> ResponsesShape {
        self.journal = Some(Vec::new());
        self
    }

    /// The events kept since the last call.
    pub(crate) fn take_events(&mut self) -> Vec<(String, Value)> {
        self.journal
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// The response object before its pair commits (`queued` or `in_progress`).
    pub(crate) fn pending(&self, model: &str, created: u64, status: &str) -> Value {
        self.object(created, model, status, json!([]), None, Value::Null)
    }

    /// The response object when its pair failed before it finished.
    pub(crate) fn failed(&self, model: &str, created: u64, e: &LockstepError) -> Value {
        let error = json!({ "code": e.code(), "message": e.to_string() });
        self.object(created, model, "failed", json!([]), None, error)
    }

    /// Ends the stream with `response.failed` for a failure outside any pair's progress (before
    /// it committed): kept in the journal like every event.
    pub(crate) fn fail_event(&mut self, model: &str, created: u64, e: &LockstepError) {
        let r = self.failed(model, created, e);
        self.event(
            &mut String::new(),
            "response.failed",
            json!({ "response": r }),
        );
    }

    fn suffix(&self) -> &str {
        self.id.strip_prefix("resp_").unwrap_or(&self.id)
    }

    fn msg_id(&self) -> String {
        format!("msg_{}", self.suffix())
    }
}

fn usage(p: &Progress) -> Value {
    json!({
        "input_tokens": p.prompt_tokens,
        "input_tokens_details": { "cached_tokens": p.cached_tokens },
        "output_tokens": p.completion_tokens,
        "output_tokens_details": { "reasoning_tokens": 0 },
        "total_tokens": p.prompt_tokens.saturating_add(p.completion_tokens),
    })
}

fn message_item(id: &str, status: &str, content: Value) -> Value {
    json!({ "type": "message", "id": id, "status": status, "role": "assistant", "content": content })
}

fn text_part(text: &str, logprobs: Value) -> Value {
    json!({ "type": "output_text", "text": text, "annotations": [], "logprobs": logprobs })
}

fn call_item(suffix: &str, i: usize, c: &Call, status: &str, arguments: &str) -> Value {
    json!({ "type": "function_call", "id": format!("fc_{suffix}_{i}"), "call_id": format!("call_{suffix}_{i}"),
            "name": c.name, "arguments": arguments, "status": status })
}

impl ResponsesShape {
    /// The response object in a given state.
    fn response(
        &self,
        p: &Progress,
        status: &str,
        output: Value,
        finish: Option<FinishReason>,
        error: Value,
    ) -> Value {
        let mut r = self.object(p.created, &p.model, status, output, finish, error);
        if finish.is_some() {
            r["usage"] = usage(p);
        }
        r
    }

    /// The response object; `usage` is filled in by the caller once known.
    fn object(
        &self,
        created: u64,
        model: &str,
        status: &str,
        output: Value,
        finish: Option<FinishReason>,
        error: Value,
    ) -> Value {
        let mut r = json!({
            "id": self.id,
            "object": "response",
            "created_at": created,
            "status": status,
            "error": error,
            "incomplete_details": match finish {
                Some(FinishReason::Length) => json!({ "reason": "max_output_tokens" }),
                _ => Value::Null,
            },
            "model": model,
            "output": output,
            "parallel_tool_calls": false,
            "tool_choice": if self.tools.is_some() { "auto" } else { "none" },
            "tools": [],
            "store": false,
            "background": false,
            "previous_response_id": null,
            "metadata": {},
            "usage": Value::Null,
        });
        if let (Some(r), Some(e)) = (r.as_object_mut(), self.echo.as_object()) {
            r.extend(e.clone());
        }
        r
    }

    /// The text and calls of the whole output.
    fn split(&self, p: &Progress) -> (String, Vec<Call>) {
        self.tools
            .as_ref()
            .and_then(|t| tools::parse(&t.tools, &p.text))
            .unwrap_or_else(|| (p.text.clone(), Vec::new()))
    }

    /// The output items: the message (unless the output was only calls), then each call.
    fn items(&self, p: &Progress, text: &str, calls: &[Call]) -> Vec<Value> {
        let mut out = Vec::new();
        if !text.is_empty() || calls.is_empty() {
            let part = text_part(text, self.all_logprobs(p));
            out.push(message_item(&self.msg_id(), "completed", json!([part])));
        }
        out.extend(
            calls
                .iter()
                .enumerate()
                .map(|(i, c)| call_item(self.suffix(), i, c, "completed", &c.arguments)),
        );
        out
    }

    fn finished(&self, p: &Progress, finish: FinishReason, text: &str, calls: &[Call]) -> Value {
        let status = match finish {
            FinishReason::Stop => "completed",
            FinishReason::Length => "incomplete",
        };
        let items = self.items(p, text, calls);
        self.response(p, status, json!(items), Some(finish), Value::Null)
    }

    fn event(&mut self, out: &mut String, name: &str, mut v: Value) {
        v["type"] = json!(name);
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        sse_named(out, name, &v);
        if let Some(j) = self.journal.as_mut() {
            j.push((name.to_string(), v));
        }
    }

    /// The message item's events for `delta`, opening the item first.
    fn text_delta(&mut self, out: &mut String, p: &Progress, delta: &str) {
        let msg_id = self.msg_id();
        let at = |v: Value, _: &Progress| {
            let mut v = v;
            v["item_id"] = json!(msg_id);
            v["output_index"] = json!(0);
            v["content_index"] = json!(0);
            v
        };
        if !self.opened {
            self.opened = true;
            let item = message_item(&msg_id, "in_progress", json!([]));
            self.event(
                out,
                "response.output_item.added",
                json!({ "output_index": 0, "item": item }),
            );
            self.event(
                out,
                "response.content_part.added",
                at(json!({ "part": text_part("", json!([])) }), p),
            );
        }
        if !delta.is_empty() {
            let logprobs = self.pending_logprobs();
            self.event(
                out,
                "response.output_text.delta",
                at(json!({ "delta": delta, "logprobs": logprobs }), p),
            );
        }
    }
}

impl Render for ResponsesShape {
    fn stream(&self) -> bool {
        self.stream
    }

    fn full(&self, p: &Progress, finish: FinishReason) -> Value {
        let (text, calls) = self.split(p);
        self.finished(p, finish, &text, &calls)
    }

    fn vocab(&mut self, codec: &Arc<PromptCodec>) {
        if let Some(l) = self.logprobs.as_mut() {
            l.codec = Some(codec.clone());
        }
    }

    fn chunk(&mut self, p: &Progress, c: &DecodeChunk) -> Bytes {
        let mut out = String::new();
        if let Some(Logprobs { pending, .. }) = self.logprobs.as_mut() {
            pending.extend(c.token_ids.iter().copied().zip(c.logprobs.iter().cloned()));
        }
        if self.seq == 0 {
            let r = self.response(p, "in_progress", json!([]), None, Value::Null);
            self.event(&mut out, "response.created", json!({ "response": r }));
            self.event(&mut out, "response.in_progress", json!({ "response": r }));
        }
        let content = match &mut self.tools {
            Some(t) => t.push(&c.delta),
            None => c.delta.clone(),
        };
        if !content.is_empty() || (self.tools.is_none() && !self.opened) {
            self.text_delta(&mut out, p, &content);
        }
        let Some(f) = c.finish else {
            return Bytes::from(out);
        };
        let (rest, calls) = match &mut self.tools {
            Some(t) => t.finish(),
            None => (String::new(), Vec::new()),
        };
        if !rest.is_empty() || (calls.is_empty() && !self.opened) {
            self.text_delta(&mut out, p, &rest);
        }
        let (text, calls) = if calls.is_empty() {
            (p.text.clone(), calls)
        } else {
            (self.split(p).0, calls)
        };
        let at = |v: Value, id: &str| {
            let mut v = v;
            v["item_id"] = json!(id);
            v["output_index"] = json!(0);
            v["content_index"] = json!(0);
            v
        };
        let msg_id = self.msg_id();
        if self.opened {
            let all = self.all_logprobs(p);
            self.event(
                &mut out,
                "response.output_text.done",
                at(json!({ "text": text, "logprobs": all }), &msg_id),
            );
            self.event(
                &mut out,
                "response.content_part.done",
                at(json!({ "part": text_part(&text, all.clone()) }), &msg_id),
            );
            let item = message_item(&msg_id, "completed", json!([text_part(&text, all)]));
            self.event(
                &mut out,
                "response.output_item.done",
                json!({ "output_index": 0, "item": item }),
            );
        }
        let base = usize::from(self.opened);
        for (i, call) in calls.iter().enumerate() {
            let index = base + i;
            let item = call_item(self.suffix(), i, call, "in_progress", "");
            let id = item["id"].clone();
            self.event(
                &mut out,
                "response.output_item.added",
                json!({ "output_index": index, "item": item }),
            );
            self.event(
                &mut out,
                "response.function_call_arguments.delta",
                json!({ "item_id": id, "output_index": index, "delta": call.arguments }),
            );
            self.event(
                &mut out,
                "response.function_call_arguments.done",
                json!({ "item_id": id, "output_index": index, "arguments": call.arguments }),
            );
            let done = call_item(self.suffix(), i, call, "completed", &call.arguments);
            self.event(
                &mut out,
                "response.output_item.done",
                json!({ "output_index": index, "item": done }),
            );
        }
        let name = match f {
            FinishReason::Stop => "response.completed",
            FinishReason::Length => "response.incomplete",
        };
        let r = self.finished(p, f, &text, &calls);
        self.event(&mut out, name, json!({ "response": r }));
        Bytes::from(out)
    }

    /// A committed stream that fails ends with `response.failed` (status `failed`, the error's
    /// stable code and message), never `response.completed`.
    fn stream_error(&mut self, p: &Progress, e: &LockstepError) -> Bytes {
        let mut out = String::new();
        let error = json!({ "code": e.code(), "message": e.to_string() });
        let r = self.response(p, "failed", json!([]), None, error);
        self.event(&mut out, "response.failed", json!({ "response": r }));
        Bytes::from(out)
    }
}

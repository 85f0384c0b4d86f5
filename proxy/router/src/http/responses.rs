//! OpenAI's Responses API, `POST /v1/responses`, stateless: `input` (text or messages),
//! `instructions`, `max_output_tokens`, `temperature`, `top_p`, `text.format` (structured
//! outputs where the backend enforces them), `stream` with the Responses event types. lockstep
//! keeps no response state, so `store: true`, `previous_response_id`, `conversation` and
//! `background` are refused with 400 rather than half-honoured. Same admission, pair lifecycle
//! and commit barrier as chat; errors in OpenAI's shape.

use axum::response::Response;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::extract::Admit;
use super::fields::{self, Known, known, refuse_unhonoured};
use super::openai::{CommonParams, bad};
use super::respond::{Progress, Render, serve_pair, sse_named};
use crate::admission::{ChatMessage, FrontRequest, Input};
use crate::backend::{DecodeChunk, FinishReason, SamplingParams};
use crate::error::LockstepError;
use crate::state::ModelRuntime;

/// `input`: one text (a user message) or a list of message items.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum InputItems {
    Text(String),
    Items(Vec<Item>),
}

/// One input item; only messages are served.
#[derive(Debug, Deserialize)]
pub(crate) struct Item {
    #[serde(rename = "type")]
    kind: Option<String>,
    role: Option<String>,
    content: Option<ItemContent>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum ItemContent {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub(crate) struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct TextConfig {
    format: Option<Value>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct ResponsesRequest {
    model: String,
    input: InputItems,
    instructions: Option<String>,
    max_output_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    #[serde(default)]
    stream: bool,
    text: Option<TextConfig>,
    /// Every other field: refused unless its value asks for nothing ([`fields`]).
    #[serde(flatten)]
    rest: Map<String, Value>,
}

const STATE: &str = "lockstep keeps no response state (stateless Responses API)";
const TOOLS: &str = "tool calling is not supported by lockstep yet";

fn no_truncation(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("disabled")
}

/// Top-level fields of `/v1/responses` beyond the ones it honours.
const RESPONSES: &[&[Known]] = &[&[
    known("store", fields::falsy, STATE),
    known("previous_response_id", fields::null, STATE),
    known("conversation", fields::null, STATE),
    known("background", fields::falsy, STATE),
    known("metadata", fields::any, ""),
    known("user", fields::any, ""),
    known("safety_identifier", fields::any, ""),
    known("prompt_cache_key", fields::any, ""),
    known("parallel_tool_calls", fields::any, ""),
    known("stream_options", fields::any, ""),
    known("tools", fields::empty, TOOLS),
    known("tool_choice", fields::no_tool_choice, TOOLS),
    known("max_tool_calls", fields::null, TOOLS),
    known(
        "include",
        fields::empty,
        "`include` asks for output lockstep does not produce",
    ),
    known(
        "top_logprobs",
        fields::zero,
        "log-probabilities are not returned by lockstep yet",
    ),
    known(
        "reasoning",
        fields::null,
        "lockstep has no reasoning control for the model's template",
    ),
    known(
        "truncation",
        no_truncation,
        "lockstep never truncates input; an over-long one is refused",
    ),
    known(
        "service_tier",
        fields::default_tier,
        "lockstep has one service tier",
    ),
    known(
        "prompt",
        fields::null,
        "stored prompt templates are not supported",
    ),
]];

const TEXT: &[&[Known]] = &[&[known(
    "verbosity",
    fields::null,
    "verbosity is not supported",
)]];

fn content_text(content: Option<ItemContent>, at: &str) -> Result<String, LockstepError> {
    match content {
        None => Err(bad(at, format!("`{at}` is required"))),
        Some(ItemContent::Text(s)) => Ok(s),
        Some(ItemContent::Parts(parts)) => {
            let mut s = String::new();
            for (j, p) in parts.into_iter().enumerate() {
                let param = format!("{at}[{j}]");
                // `annotations` and `logprobs` ride along on output text given back as history.
                let mut rest = p.rest;
                rest.retain(|k, v| {
                    !(matches!(k.as_str(), "annotations" | "logprobs") && fields::empty(v))
                });
                refuse_unhonoured(&[], &rest, &format!("{param}."))?;
                match (p.kind.as_str(), p.text) {
                    ("input_text" | "output_text" | "text", Some(t)) => s.push_str(&t),
                    (kind, _) => {
                        return Err(LockstepError::Unsupported {
                            message: format!(
                                "content part type `{kind}` is not supported (text only)"
                            ),
                            param: Some(param),
                        });
                    }
                }
            }
            Ok(s)
        }
    }
}

fn to_messages(
    instructions: Option<String>,
    input: InputItems,
) -> Result<Vec<ChatMessage>, LockstepError> {
    let mut out = Vec::new();
    if let Some(i) = instructions {
        out.push(ChatMessage {
            role: "system".into(),
            content: i,
            ..ChatMessage::default()
        });
    }
    let items = match input {
        InputItems::Text(t) => {
            out.push(ChatMessage {
                role: "user".into(),
                content: t,
                ..ChatMessage::default()
            });
            return Ok(out);
        }
        InputItems::Items(items) => items,
    };
    if items.is_empty() {
        return Err(bad("input", "`input` must not be empty".into()));
    }
    for (i, item) in items.into_iter().enumerate() {
        let at = format!("input[{i}]");
        match item.kind.as_deref() {
            None | Some("message") => {}
            Some(kind) => {
                return Err(LockstepError::Unsupported {
                    message: format!("input item type `{kind}` is not supported (messages only)"),
                    param: Some(format!("{at}.type")),
                });
            }
        }
        // `id` and `status` come back on output messages given as history.
        let mut rest = item.rest;
        rest.retain(|k, _| !matches!(k.as_str(), "id" | "status"));
        refuse_unhonoured(&[], &rest, &format!("{at}."))?;
        let role = item
            .role
            .ok_or_else(|| bad(&format!("{at}.role"), "`role` is required".into()))?;
        if !matches!(role.as_str(), "system" | "developer" | "user" | "assistant") {
            return Err(bad(&format!("{at}.role"), format!("unknown role `{role}`")));
        }
        out.push(ChatMessage {
            role: if role == "developer" {
                "system".into()
            } else {
                role
            },
            content: content_text(item.content, &format!("{at}.content"))?,
            ..ChatMessage::default()
        });
    }
    Ok(out)
}

impl FrontRequest for ResponsesRequest {
    type Shape = ResponsesShape;

    fn model(&self) -> Option<&str> {
        Some(&self.model)
    }

    fn validate(
        self,
        model: &ModelRuntime,
    ) -> Result<(Input, SamplingParams, ResponsesShape), LockstepError> {
        refuse_unhonoured(RESPONSES, &self.rest, "")?;
        let (format, constraint) = match self.text {
            None => (json!({ "type": "text" }), None),
            Some(t) => {
                refuse_unhonoured(TEXT, &t.rest, "text.")?;
                let format = t.format.unwrap_or_else(|| json!({ "type": "text" }));
                let constraint = fields::format_constraint(
                    &format,
                    "text.format",
                    "/schema",
                    model.cfg.backend,
                )?;
                (format, constraint)
            }
        };
        let params = CommonParams {
            max_tokens: None,
            max_completion_tokens: self.max_output_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: None,
            n: None,
            stream: self.stream,
            stream_options: None,
            stop: None,
            seed: None,
            frequency_penalty: None,
            presence_penalty: None,
            ignore_eos: None,
            best_of: None,
        };
        let (mut sampling, stream, _) = params.sampling(model).map_err(|e| match e {
            LockstepError::InvalidRequest { message, param }
                if param.as_deref() == Some("max_completion_tokens") =>
            {
                LockstepError::InvalidRequest {
                    message: message.replace("max_completion_tokens", "max_output_tokens"),
                    param: Some("max_output_tokens".into()),
                }
            }
            other => other,
        })?;
        sampling.constraint = constraint;
        let messages = to_messages(self.instructions.clone(), self.input)?;
        let shape = ResponsesShape {
            stream,
            seq: 0,
            echo: json!({
                "instructions": self.instructions,
                "max_output_tokens": self.max_output_tokens,
                "temperature": self.temperature.unwrap_or(1.0),
                "top_p": self.top_p.unwrap_or(1.0),
                "text": { "format": format },
            }),
        };
        Ok((Input::Chat(messages), sampling, shape))
    }
}

/// How a Responses answer looks: one `response` object, or its stream of typed events.
#[derive(Debug)]
pub(crate) struct ResponsesShape {
    stream: bool,
    /// The next event's `sequence_number`.
    seq: u64,
    /// Request settings the response object repeats.
    echo: Value,
}

fn ids(p: &Progress) -> (String, String) {
    (format!("resp_{}", p.pair_id), format!("msg_{}", p.pair_id))
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

fn output_item(p: &Progress, status: &str, content: Value) -> Value {
    json!({ "type": "message", "id": ids(p).1, "status": status, "role": "assistant", "content": content })
}

fn text_part(text: &str) -> Value {
    json!({ "type": "output_text", "text": text, "annotations": [], "logprobs": [] })
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
        let mut r = json!({
            "id": ids(p).0,
            "object": "response",
            "created_at": p.created,
            "status": status,
            "error": error,
            "incomplete_details": match finish {
                Some(FinishReason::Length) => json!({ "reason": "max_output_tokens" }),
                _ => Value::Null,
            },
            "model": p.model,
            "output": output,
            "parallel_tool_calls": false,
            "tool_choice": "none",
            "tools": [],
            "store": false,
            "previous_response_id": null,
            "metadata": {},
            "usage": if finish.is_some() { usage(p) } else { Value::Null },
        });
        if let (Some(r), Some(e)) = (r.as_object_mut(), self.echo.as_object()) {
            r.extend(e.clone());
        }
        r
    }

    fn finished(&self, p: &Progress, finish: FinishReason) -> Value {
        let status = match finish {
            FinishReason::Stop => "completed",
            FinishReason::Length => "incomplete",
        };
        let item = output_item(p, "completed", json!([text_part(&p.text)]));
        self.response(p, status, json!([item]), Some(finish), Value::Null)
    }

    fn event(&mut self, out: &mut String, name: &str, mut v: Value) {
        v["type"] = json!(name);
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        sse_named(out, name, &v);
    }
}

impl Render for ResponsesShape {
    fn stream(&self) -> bool {
        self.stream
    }

    fn full(&self, p: &Progress, finish: FinishReason) -> Value {
        self.finished(p, finish)
    }

    fn chunk(&mut self, p: &Progress, c: &DecodeChunk) -> Bytes {
        let mut out = String::new();
        let item_id = ids(p).1;
        let at = |v: Value| {
            let mut v = v;
            v["item_id"] = json!(item_id);
            v["output_index"] = json!(0);
            v["content_index"] = json!(0);
            v
        };
        if self.seq == 0 {
            let r = self.response(p, "in_progress", json!([]), None, Value::Null);
            self.event(&mut out, "response.created", json!({ "response": r }));
            self.event(&mut out, "response.in_progress", json!({ "response": r }));
            let item = output_item(p, "in_progress", json!([]));
            self.event(
                &mut out,
                "response.output_item.added",
                json!({ "output_index": 0, "item": item }),
            );
            self.event(
                &mut out,
                "response.content_part.added",
                at(json!({ "part": text_part("") })),
            );
        }
        if !c.delta.is_empty() {
            self.event(
                &mut out,
                "response.output_text.delta",
                at(json!({ "delta": c.delta, "logprobs": [] })),
            );
        }
        if let Some(f) = c.finish {
            self.event(
                &mut out,
                "response.output_text.done",
                at(json!({ "text": p.text, "logprobs": [] })),
            );
            self.event(
                &mut out,
                "response.content_part.done",
                at(json!({ "part": text_part(&p.text) })),
            );
            let item = output_item(p, "completed", json!([text_part(&p.text)]));
            self.event(
                &mut out,
                "response.output_item.done",
                json!({ "output_index": 0, "item": item }),
            );
            let name = match f {
                FinishReason::Stop => "response.completed",
                FinishReason::Length => "response.incomplete",
            };
            let r = self.finished(p, f);
            self.event(&mut out, name, json!({ "response": r }));
        }
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

/// `POST /v1/responses`.
pub(crate) async fn responses(Admit(admitted, shape): Admit<ResponsesRequest>) -> Response {
    serve_pair(admitted, shape).await
}

//! Anthropic's Messages API, `POST /v1/messages`: `system`, `messages` (text content),
//! `max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`, and
//! `output_config.format` (structured outputs, where the backend enforces them), through the same
//! admission, pair lifecycle and commit barrier as chat. Answers, stream events and errors take
//! Anthropic's shapes (`message`, `message_start` ... `message_stop`, `{"type":"error"}`), so the
//! official `anthropic` package works unchanged. Every other field is refused unless its value
//! asks for nothing ([`fields`]).

use axum::response::Response;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::extract::Admit;
use super::fields::{self, Known, known, refuse_unhonoured};
use super::openai::{CommonParams, Stop, bad, renamed};
use super::respond::{Progress, Render, serve_pair, sse_named};
use crate::admission::{FrontRequest, Input, Refusal};
use crate::backend::{DecodeChunk, FinishReason, SamplingParams};
use lockstep_core::config::ModelConfig;
use lockstep_core::error::LockstepError;
use lockstep_prompt::ChatMessage;

/// `system`: a string or a list of text blocks (read by hand: `admission::text_or`).
#[derive(Debug)]
pub(crate) enum Text {
    One(String),
    Blocks(Vec<super::content::Part>),
}
crate::admission::text_or::text_or_list_enum!(
    Text,
    One,
    Blocks(super::content::Part),
    "a string or a list of content blocks"
);

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[schemars(rename = "AnthropicMessageIn")]
pub(crate) struct Message {
    role: String,
    content: Text,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// An Anthropic Messages request; other fields are honoured where docs/api.md says and
/// refused otherwise.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub(crate) struct MessagesRequest {
    model: String,
    max_tokens: i64,
    messages: Vec<Message>,
    system: Option<Text>,
    stop_sequences: Option<Vec<String>>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    #[serde(default)]
    stream: bool,
    /// Every other field: refused unless its value asks for nothing ([`fields`]).
    #[serde(flatten)]
    rest: Map<String, Value>,
}

fn no_tool_choice(v: &Value) -> bool {
    v.is_null() || matches!(v.get("type").and_then(Value::as_str), Some("auto" | "none"))
}
fn thinking_off(v: &Value) -> bool {
    v.is_null() || v.get("type").and_then(Value::as_str) == Some("disabled")
}
fn standard_tier(v: &Value) -> bool {
    v.is_null() || matches!(v.as_str(), Some("auto" | "standard_only"))
}
fn standard_speed(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("standard")
}
fn ephemeral(v: &Value) -> bool {
    v.is_null() || v.get("type").and_then(Value::as_str) == Some("ephemeral")
}

const TOOLS: &str = "tool use is not supported by lockstep yet";

/// Top-level fields of `/v1/messages` beyond the ones it honours.
const MESSAGES: &[&[Known]] = &[&[
    known("metadata", fields::any, ""),
    known(
        "service_tier",
        standard_tier,
        "lockstep has one service tier",
    ),
    known("tools", fields::empty, TOOLS),
    known("tool_choice", no_tool_choice, TOOLS),
    known(
        "thinking",
        thinking_off,
        "extended thinking is not supported by lockstep",
    ),
    known("container", fields::null, "containers are not supported"),
    known(
        "mcp_servers",
        fields::empty,
        "MCP servers are not supported",
    ),
    known(
        "context_management",
        fields::null,
        "context management is not supported",
    ),
    // A marker on the last cacheable block: lockstep's workers cache every prompt prefix of the
    // same tenant anyway.
    known(
        "cache_control",
        ephemeral,
        "only ephemeral cache_control is known",
    ),
    known(
        "diagnostics",
        fields::null,
        "diagnostics are not returned by lockstep",
    ),
    known(
        "inference_geo",
        fields::null,
        "lockstep serves from where it runs; it cannot choose a region",
    ),
    known("speed", standard_speed, "lockstep has one speed mode"),
    known("user_profile_id", fields::any, ""),
    known(
        "workspace_id",
        fields::null,
        "lockstep chooses the tenant from the API key, not a workspace id",
    ),
]];

/// `output_config` keys beyond `format` (the structured-output format, served where the
/// backend enforces constraints).
const OUTPUT_CONFIG: &[&[Known]] = &[&[known(
    "effort",
    fields::null,
    "lockstep has no effort control for the model",
)]];

/// Fields of a content block beyond `type` and `text`. `cache_control` asks for prompt caching,
/// which lockstep's workers do for every prompt of the same tenant anyway.
const BLOCK: &[&[Known]] = &[&[
    known(
        "cache_control",
        ephemeral,
        "only ephemeral cache_control is known",
    ),
    known("citations", fields::null, "citations are not supported"),
]];

/// What Anthropic content blocks may be: text, with its ephemeral cache control.
const BLOCKS: super::content::PartRule = super::content::PartRule {
    text_types: &["text"],
    known: BLOCK,
    empty_ok: &[],
    noun: "content block",
};

fn text_of(t: Text, at: &str) -> Result<String, LockstepError> {
    match t {
        Text::One(s) => Ok(s),
        Text::Blocks(blocks) => super::content::text_of_parts(blocks, at, &BLOCKS),
    }
}

impl MessagesRequest {
    fn messages(
        system: Option<Text>,
        messages: Vec<Message>,
    ) -> Result<Vec<ChatMessage>, LockstepError> {
        if messages.is_empty() {
            return Err(bad("messages", "`messages` must not be empty".into()));
        }
        let mut out = Vec::with_capacity(messages.len() + 1);
        if let Some(s) = system {
            out.push(ChatMessage {
                role: "system".into(),
                content: text_of(s, "system")?,
                ..ChatMessage::default()
            });
        }
        let last = messages.len() - 1;
        for (i, m) in messages.into_iter().enumerate() {
            let at = format!("messages[{i}]");
            if !matches!(m.role.as_str(), "user" | "assistant") {
                return Err(bad(
                    &format!("{at}.role"),
                    format!("`role` must be `user` or `assistant`, got `{}`", m.role),
                ));
            }
            if i == last && m.role == "assistant" {
                // Anthropic continues a final assistant turn; a chat template would close it.
                return Err(LockstepError::Unsupported {
                    message: "a final assistant message (a prefilled answer) is not supported; end with a user message".into(),
                    param: Some(at),
                });
            }
            refuse_unhonoured(&[], &m.rest, &format!("{at}."))?;
            out.push(ChatMessage {
                role: m.role,
                content: text_of(m.content, &format!("{at}.content"))?,
                ..ChatMessage::default()
            });
        }
        Ok(out)
    }
}

impl FrontRequest for MessagesRequest {
    fn compiles_a_grammar(&self) -> bool {
        self.rest.get("output_config").is_some_and(|v| !v.is_null())
    }

    type Shape = MessagesShape;

    fn model(&self) -> Option<&str> {
        Some(&self.model)
    }

    fn validate(
        self,
        model: &ModelConfig,
    ) -> Result<(Input, SamplingParams, MessagesShape), LockstepError> {
        let mut rest = self.rest;
        let constraint = match rest.remove("output_config").filter(|v| !v.is_null()) {
            None => None,
            Some(Value::Object(mut oc)) => {
                let format = oc.remove("format").filter(|v| !v.is_null());
                refuse_unhonoured(OUTPUT_CONFIG, &oc, "output_config.")?;
                match format {
                    None => None,
                    Some(f) => fields::format_constraint(
                        &f,
                        "output_config.format",
                        "/schema",
                        model.backend,
                    )?,
                }
            }
            Some(_) => {
                return Err(bad(
                    "output_config",
                    "`output_config` must be an object".into(),
                ));
            }
        };
        refuse_unhonoured(MESSAGES, &rest, "")?;
        if let Some(t) = self.temperature
            && !(0.0..=1.0).contains(&t)
        {
            return Err(bad(
                "temperature",
                format!("`temperature` must be between 0 and 1, got {t}"),
            ));
        }
        if let Some(k) = self.top_k
            && k < 1
        {
            return Err(bad("top_k", format!("`top_k` must be at least 1, got {k}")));
        }
        let stop = self.stop_sequences.unwrap_or_default();
        let params = CommonParams {
            max_tokens: Some(self.max_tokens),
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            stream: self.stream,
            stop: (!stop.is_empty()).then(|| Stop::Many(stop.clone())),
            ..CommonParams::default()
        };
        let (mut sampling, stream, _) = params
            .sampling(model)
            .map_err(|e| renamed(e, "stop", "stop_sequences"))?;
        sampling.constraint = constraint;
        let messages = Self::messages(self.system, self.messages)?;
        Ok((
            Input::Chat(messages),
            sampling,
            MessagesShape {
                stream,
                started: false,
            },
        ))
    }
}

/// How a Messages answer looks: one `message`, or its stream of events.
#[derive(Debug)]
pub(crate) struct MessagesShape {
    stream: bool,
    started: bool,
}

fn stop_reason(p: &Progress, finish: FinishReason) -> (&'static str, Value) {
    match (finish, &p.matched_stop) {
        (FinishReason::Length, _) => ("max_tokens", Value::Null),
        (FinishReason::Stop, Some(s)) => ("stop_sequence", json!(s)),
        (FinishReason::Stop, None) => ("end_turn", Value::Null),
    }
}

/// Anthropic's usage: `input_tokens` counts the prompt tokens not read from cache.
fn usage(p: &Progress) -> Value {
    json!({
        "input_tokens": p.prompt_tokens.saturating_sub(p.cached_tokens),
        "cache_read_input_tokens": p.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": p.completion_tokens,
    })
}

fn message(p: &Progress, content: Value, finish: Option<FinishReason>) -> Value {
    let (reason, sequence) = match finish {
        Some(f) => {
            let (r, s) = stop_reason(p, f);
            (json!(r), s)
        }
        None => (Value::Null, Value::Null),
    };
    json!({
        "id": format!("msg_{}", p.pair_id),
        "type": "message",
        "role": "assistant",
        "model": p.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(p),
    })
}

impl Render for MessagesShape {
    fn stream(&self) -> bool {
        self.stream
    }

    fn full(&self, p: &Progress, finish: FinishReason) -> Value {
        message(p, json!([{ "type": "text", "text": p.text }]), Some(finish))
    }

    fn chunk(&mut self, p: &Progress, c: &DecodeChunk) -> Bytes {
        let mut out = String::new();
        if !self.started {
            self.started = true;
            let mut start = message(p, json!([]), None);
            start["usage"]["output_tokens"] = json!(0);
            sse_named(
                &mut out,
                "message_start",
                &json!({ "type": "message_start", "message": start }),
            );
            sse_named(
                &mut out,
                "content_block_start",
                &json!({ "type": "content_block_start", "index": 0, "content_block": { "type": "text", "text": "" } }),
            );
        }
        if !c.delta.is_empty() {
            sse_named(
                &mut out,
                "content_block_delta",
                &json!({ "type": "content_block_delta", "index": 0, "delta": { "type": "text_delta", "text": c.delta } }),
            );
        }
        if let Some(f) = c.finish {
            let (reason, sequence) = stop_reason(p, f);
            sse_named(
                &mut out,
                "content_block_stop",
                &json!({ "type": "content_block_stop", "index": 0 }),
            );
            sse_named(
                &mut out,
                "message_delta",
                &json!({ "type": "message_delta", "delta": { "stop_reason": reason, "stop_sequence": sequence },
                         "usage": { "output_tokens": p.completion_tokens } }),
            );
            sse_named(&mut out, "message_stop", &json!({ "type": "message_stop" }));
        }
        Bytes::from(out)
    }

    fn stream_error(&mut self, _p: &Progress, e: &LockstepError) -> Bytes {
        let mut out = String::new();
        sse_named(&mut out, "error", &e.anthropic_body());
        Bytes::from(out)
    }

    fn error(&self, e: LockstepError) -> Response {
        let body = e.anthropic_body();
        e.into_response_with(body)
    }
}

/// `POST /v1/messages`. Refusals, too, answer in Anthropic's error shape.
pub(crate) async fn messages(admit: Result<Admit<MessagesRequest>, Refusal>) -> Response {
    match admit {
        Ok(Admit(admitted, shape)) => serve_pair(admitted, shape).await,
        Err(Refusal(e)) => {
            let body = e.anthropic_body();
            e.into_response_with(body)
        }
    }
}

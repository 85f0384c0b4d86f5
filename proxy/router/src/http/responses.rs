//! OpenAI's Responses API, `POST /v1/responses`, stateless: `input` (text or messages),
//! `instructions`, `max_output_tokens`, `temperature`, `top_p`, `text.format` (structured
//! outputs where the backend enforces them), `stream` with the Responses event types. lockstep
//! keeps no response state, so `store: true`, `previous_response_id`, `conversation` and
//! `background` are refused with 400 rather than half-honoured. Same admission, pair lifecycle
//! and commit barrier as chat; errors in OpenAI's shape.

use axum::response::Response;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::extract::Admit;
use super::fields::{self, Known, known, refuse_unhonoured};
use super::openai::{CommonParams, bad, renamed};
use super::respond::serve_pair;
use super::responses_out::ResponsesShape;
use crate::admission::{FrontRequest, Input};
use crate::backend::SamplingParams;
use lockstep_core::config::ModelConfig;
use lockstep_core::error::LockstepError;
use lockstep_prompt::ChatMessage;

/// `input`: one text (a user message) or a list of message items (read by hand:
/// `admission::text_or`).
#[derive(Debug)]
pub(crate) enum InputItems {
    Text(String),
    Items(Vec<Item>),
}
crate::admission::text_or::text_or_list_enum!(
    InputItems,
    Text,
    Items,
    "a string or a list of input items"
);

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

/// An input message's content: a string or a list of parts (read by hand: `admission::text_or`).
#[derive(Debug)]
pub(crate) enum ItemContent {
    Text(String),
    Parts(Vec<super::content::Part>),
}
crate::admission::text_or::text_or_list_enum!(
    ItemContent,
    Text,
    Parts,
    "a string or a list of content parts"
);

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
    known("stream_options", fields::any, ""),
    known(
        "max_tool_calls",
        fields::null,
        "lockstep does not bound a response's tool calls; `max_tool_calls` must be null",
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

/// The Responses API's flat function tools (`{type, name, description, parameters, strict}`)
/// in chat's nested form, for the one tool check.
fn flat_tools(v: Option<Value>) -> Result<Option<Value>, LockstepError> {
    let Some(Value::Array(tools)) = v else {
        return Ok(v);
    };
    tools
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let Value::Object(mut o) = t else {
                return Err(bad(&format!("tools[{i}]"), "a tool is an object".into()));
            };
            let kind = o.remove("type");
            if kind.as_ref().and_then(Value::as_str) != Some("function") {
                return Err(LockstepError::Unsupported {
                    message: format!("`tools[{i}].type`: only `function` tools are supported"),
                    param: Some(format!("tools[{i}].type")),
                });
            }
            Ok(json!({ "type": "function", "function": o }))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(|v| Some(Value::Array(v)))
}

/// `{"type": "function", "name": ...}` in chat's form; the strings pass as they are.
fn flat_choice(v: Option<Value>) -> Option<Value> {
    match v {
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            Some(
                json!({ "type": "function", "function": { "name": o.get("name").cloned().unwrap_or(Value::Null) } }),
            )
        }
        other => other,
    }
}

/// A `function_call` input item (an earlier call of the model) as an assistant message, or a
/// `function_call_output` (its result) as a tool message.
fn call_item(
    at: &str,
    kind: &str,
    mut rest: Map<String, Value>,
) -> Result<ChatMessage, LockstepError> {
    let mut take = |k: &str| match rest.remove(k) {
        Some(Value::String(s)) => Ok(s),
        _ => Err(bad(&format!("{at}.{k}"), format!("`{at}.{k}` is a string"))),
    };
    let call_id = take("call_id")?;
    let id_at = format!("{at}.call_id");
    if !super::tools::valid_call_id(&call_id) {
        return Err(bad(
            &id_at,
            "a call id is 1 to 128 letters, digits, `_`, `-`, `.` or `:`".into(),
        ));
    }
    let m = if kind == "function_call" {
        let (name, args) = (take("name")?, take("arguments")?);
        let call = super::tools::history_call(
            (Some(&call_id), &id_at),
            (&name, &format!("{at}.name")),
            (&args, &format!("{at}.arguments")),
        )?;
        ChatMessage {
            role: "assistant".into(),
            tool_calls: Some(vec![call]),
            ..ChatMessage::default()
        }
    } else {
        ChatMessage {
            role: "tool".into(),
            content: take("output")?,
            tool_call_id: Some(call_id),
            ..ChatMessage::default()
        }
    };
    rest.retain(|k, _| !matches!(k.as_str(), "id" | "status"));
    refuse_unhonoured(&[], &rest, &format!("{at}."))?;
    Ok(m)
}

/// What an input message's parts may be: input or output text (output given back as history
/// may carry empty `annotations` and `logprobs`).
const ITEM_PARTS: super::content::PartRule = super::content::PartRule {
    text_types: &["input_text", "output_text", "text"],
    known: &[],
    empty_ok: &["annotations", "logprobs"],
    noun: "content part",
};

fn content_text(content: Option<ItemContent>, at: &str) -> Result<String, LockstepError> {
    match content {
        None => Err(bad(at, format!("`{at}` is required"))),
        Some(ItemContent::Text(s)) => Ok(s),
        Some(ItemContent::Parts(parts)) => super::content::text_of_parts(parts, at, &ITEM_PARTS),
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
            Some(kind @ ("function_call" | "function_call_output")) => {
                let mut rest = item.rest;
                if let Some(r) = item.role {
                    rest.insert("role".into(), json!(r));
                }
                out.push(call_item(&at, kind, rest)?);
                continue;
            }
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
    fn compiles_a_grammar(&self) -> bool {
        self.text.is_some()
            || ["tools", "tool_choice"]
                .iter()
                .any(|k| self.rest.get(*k).is_some_and(|v| !v.is_null()))
    }

    type Shape = ResponsesShape;

    fn model(&self) -> Option<&str> {
        Some(&self.model)
    }

    fn validate(
        self,
        model: &ModelConfig,
    ) -> Result<(Input, SamplingParams, ResponsesShape), LockstepError> {
        let mut rest = self.rest;
        let (tools, forced) = super::tools::request(
            flat_tools(rest.remove("tools"))?,
            flat_choice(rest.remove("tool_choice")),
            rest.remove("parallel_tool_calls"),
            model.tool_mode(),
            model.backend,
        )?;
        let logprobs = super::logprob_params::responses_logprobs(&mut rest)?;
        refuse_unhonoured(RESPONSES, &rest, "")?;
        let (format, constraint) = match self.text {
            None => (json!({ "type": "text" }), None),
            Some(t) => {
                refuse_unhonoured(TEXT, &t.rest, "text.")?;
                let format = t.format.unwrap_or_else(|| json!({ "type": "text" }));
                let constraint =
                    fields::format_constraint(&format, "text.format", "/schema", model.backend)?;
                (format, constraint)
            }
        };
        let params = CommonParams {
            max_completion_tokens: self.max_output_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            stream: self.stream,
            ..CommonParams::default()
        };
        let (mut sampling, stream, _) = params
            .sampling(model)
            .map_err(|e| renamed(e, "max_completion_tokens", "max_output_tokens"))?;
        sampling.constraint = constraint;
        sampling.logprobs = logprobs;
        let messages = to_messages(self.instructions.clone(), self.input)?;
        let (input, parser) = super::tools::settle(
            tools,
            forced,
            &mut sampling,
            "text.format",
            messages,
            model.tool_mode(),
        )?;
        let echo = json!({
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature.unwrap_or(1.0),
            "top_p": self.top_p.unwrap_or(1.0),
            "text": { "format": format },
            "top_logprobs": logprobs.unwrap_or(0),
            "parallel_tool_calls": parser.as_ref().is_none_or(|p| !p.one_call),
        });
        Ok((
            input,
            sampling,
            ResponsesShape::new(stream, echo, parser).with_logprobs(logprobs),
        ))
    }
}

/// `POST /v1/responses`.
pub(crate) async fn responses(Admit(admitted, shape): Admit<ResponsesRequest>) -> Response {
    serve_pair(admitted, shape).await
}

//! OpenAI's Responses API, `POST /v1/responses`: `input` (text or items), `instructions`,
//! `max_output_tokens`, `temperature`, `top_p`, `text.format` (structured outputs where the
//! backend enforces them), `stream` with the Responses event types. Its state (`store`,
//! `previous_response_id`, `conversation`, `background`) is resolved before admission by the
//! stored-responses front (`http::stored`), which hands the earlier items in as a [`Plan`];
//! without one (the endpoint picker, or `[state] enabled = false`) a request that asks for state
//! is refused with 400 rather than half-honoured. Same admission, pair lifecycle and commit
//! barrier as chat; errors in OpenAI's shape.

use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::fields::{self, Known, known, refuse_unhonoured};
use super::openai::{CommonParams, bad, renamed};
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
    Items(Item),
    "a string or a list of input items"
);

/// One input item: a message, a `function_call` or a `function_call_output`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
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
    Parts(super::content::Part),
    "a string or a list of content parts"
);

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub(crate) struct TextConfig {
    format: Option<Value>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// What the stored-responses front resolved for a request before admission.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    /// The response's id.
    pub(crate) id: String,
    /// Whether it is stored.
    pub(crate) store: bool,
    /// Whether it runs in the background.
    pub(crate) background: bool,
    /// The items before this request's input: the previous response's context, or the
    /// conversation's items.
    pub(crate) prior: Vec<Value>,
    /// This request's input as items, each with its id.
    pub(crate) input_items: Vec<Value>,
    /// What the response object repeats: `previous_response_id`, `conversation`.
    pub(crate) previous_response_id: Option<String>,
    pub(crate) conversation: Option<String>,
}

/// A Responses API request; other fields are honoured where docs/api.md says and refused
/// otherwise.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub(crate) struct ResponsesRequest {
    model: String,
    pub(crate) input: InputItems,
    instructions: Option<String>,
    max_output_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    #[serde(default)]
    stream: bool,
    text: Option<TextConfig>,
    pub(crate) store: Option<bool>,
    pub(crate) previous_response_id: Option<String>,
    pub(crate) conversation: Option<Value>,
    pub(crate) background: Option<bool>,
    pub(crate) metadata: Option<Value>,
    /// Every other field: refused unless its value asks for nothing ([`fields`]).
    #[serde(flatten)]
    rest: Map<String, Value>,
    /// Set by the stored-responses front: the request's state, resolved.
    #[serde(skip)]
    pub(crate) plan: Option<Plan>,
}

const STATE: &str =
    "response state is not kept here (`[state] enabled = false`, or a front that keeps none)";

impl ResponsesRequest {
    /// Without a [`Plan`]: a request asking for state is refused by the field it names.
    fn refuse_state(&self) -> Result<(), LockstepError> {
        let asked = [
            ("store", self.store == Some(true)),
            ("previous_response_id", self.previous_response_id.is_some()),
            (
                "conversation",
                self.conversation.as_ref().is_some_and(|c| !c.is_null()),
            ),
            ("background", self.background == Some(true)),
        ];
        match asked.iter().find(|(_, on)| *on) {
            Some((param, _)) => Err(LockstepError::Unsupported {
                message: format!("`{param}`: {STATE}"),
                param: Some((*param).into()),
            }),
            None => Ok(()),
        }
    }
}

fn no_truncation(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("disabled")
}

/// Top-level fields of `/v1/responses` beyond the ones it honours.
const RESPONSES: &[&[Known]] = &[&[
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
        if self.plan.is_none() {
            self.refuse_state()?;
        }
        let metadata = check_metadata(self.metadata, "metadata")?;
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
        let plan = self.plan.unwrap_or_else(|| Plan {
            id: lockstep_state::new_id("resp"),
            ..Plan::default()
        });
        let input = if plan.store || !plan.prior.is_empty() {
            let all = plan.prior.iter().chain(&plan.input_items).cloned();
            InputItems::Items(
                serde_json::from_value(Value::Array(all.collect()))
                    .map_err(|e| bad("input", format!("`input`: {e}")))?,
            )
        } else {
            self.input
        };
        let messages = to_messages(self.instructions.clone(), input)?;
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
            "store": plan.store,
            "background": plan.background,
            "previous_response_id": plan.previous_response_id,
            "conversation": plan.conversation.as_ref().map(|c| json!({ "id": c })),
            "metadata": metadata,
        });
        Ok((
            input,
            sampling,
            ResponsesShape::new(plan.id, stream, echo, parser).with_logprobs(logprobs),
        ))
    }
}

/// The input items of a request (`input` as the client sent it): each an object with its
/// `type` (`message` where left out) and an id (`msg_`/`fc_`/`fco_` + random where left out),
/// a message's string content as one text part. Checked as generation reads them.
pub(crate) fn input_items(input: &Value) -> Result<Vec<Value>, LockstepError> {
    let items = match input {
        Value::String(t) => vec![json!({ "role": "user", "content": t })],
        Value::Array(items) => items.clone(),
        _ => {
            return Err(bad(
                "input",
                "`input` is a string or a list of items".into(),
            ));
        }
    };
    let items: Vec<Value> = items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            let Value::Object(mut o) = item else {
                return Err(bad(
                    &format!("input[{i}]"),
                    "an input item is an object".into(),
                ));
            };
            let kind = o
                .entry("type")
                .or_insert_with(|| json!("message"))
                .as_str()
                .unwrap_or_default()
                .to_string();
            if let Some(Value::String(t)) = o.get("content") {
                let part = if o.get("role").and_then(Value::as_str) == Some("assistant") {
                    json!({ "type": "output_text", "text": t, "annotations": [] })
                } else {
                    json!({ "type": "input_text", "text": t })
                };
                o.insert("content".into(), json!([part]));
            }
            if !o.get("id").is_some_and(Value::is_string) {
                let prefix = match kind.as_str() {
                    "function_call" => "fc",
                    "function_call_output" => "fco",
                    _ => "msg",
                };
                o.insert("id".into(), json!(lockstep_state::new_id(prefix)));
            }
            Ok(Value::Object(o))
        })
        .collect::<Result<_, _>>()?;
    check_items(&items)?;
    Ok(items)
}

/// Checks items as generation reads them (their roles, parts and calls).
pub(crate) fn check_items(items: &[Value]) -> Result<(), LockstepError> {
    if items.is_empty() {
        return Ok(());
    }
    let typed: Vec<Item> = serde_json::from_value(Value::Array(items.to_vec()))
        .map_err(|e| bad("items", format!("an item is not one lockstep reads: {e}")))?;
    to_messages(None, InputItems::Items(typed)).map(drop)
}

/// OpenAI's metadata: up to 16 string values, keys up to 64 characters and values up to 512
/// (`{}` when left out).
pub(crate) fn check_metadata(v: Option<Value>, at: &str) -> Result<Value, LockstepError> {
    let m = match v {
        None | Some(Value::Null) => return Ok(json!({})),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(bad(at, format!("`{at}` is an object of strings"))),
    };
    if m.len() > 16 {
        return Err(bad(at, format!("`{at}` holds at most 16 keys")));
    }
    for (k, v) in &m {
        let fits = k.chars().count() <= 64 && v.as_str().is_some_and(|s| s.chars().count() <= 512);
        if !fits {
            return Err(bad(
                &format!("{at}.{k}"),
                "metadata keys are up to 64 characters, values strings up to 512".into(),
            ));
        }
    }
    Ok(Value::Object(m))
}

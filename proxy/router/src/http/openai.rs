//! OpenAI-compatible `/v1/chat/completions` and `/v1/completions`.

use axum::response::Response;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::extract::Admit;
use super::fields::{self, refuse_unhonoured};
use super::openai_shape::{Echo, OpenAiShape};
use super::respond::serve_pair;
use crate::admission::{FrontRequest, Input, Prompt};
use crate::backend::SamplingParams;
use lockstep_core::config::ModelConfig;
use lockstep_core::error::LockstepError;
use lockstep_prompt::ChatMessage;

/// `stop`: one string or a list.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(untagged)]
pub(crate) enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub(crate) fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub(crate) struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Sampling fields shared by both endpoints (and built by the Responses and Messages front ends
/// from their own names: `Default` is "the request did not say").
#[derive(Debug, Default, Deserialize, schemars::JsonSchema)]
pub(crate) struct CommonParams {
    pub(super) max_tokens: Option<i64>,
    pub(super) max_completion_tokens: Option<i64>,
    pub(super) temperature: Option<f64>,
    pub(super) top_p: Option<f64>,
    pub(super) top_k: Option<i64>,
    pub(super) n: Option<i64>,
    #[serde(default)]
    pub(super) stream: bool,
    pub(super) stream_options: Option<StreamOptions>,
    pub(super) stop: Option<Stop>,
    pub(super) seed: Option<u64>,
    pub(super) frequency_penalty: Option<f64>,
    pub(super) presence_penalty: Option<f64>,
    pub(super) ignore_eos: Option<bool>,
    pub(super) best_of: Option<i64>,
}

/// A 400 `invalid_request` naming `param`.
pub(crate) fn bad(param: &str, message: String) -> LockstepError {
    LockstepError::InvalidRequest {
        message,
        param: Some(param.to_string()),
    }
}

/// `e` naming the client's own field where the shared validation named OpenAI's (`from`).
pub(crate) fn renamed(e: LockstepError, from: &str, to: &str) -> LockstepError {
    match e {
        LockstepError::InvalidRequest { message, param } if param.as_deref() == Some(from) => {
            LockstepError::InvalidRequest {
                message: message.replace(&format!("`{from}`"), &format!("`{to}`")),
                param: Some(to.into()),
            }
        }
        other => other,
    }
}

/// Most stop sequences a request may give, and the longest one, in bytes: the engine's bounds
/// (it enforces them itself for every entry point), checked here first so a request to a remote
/// backend is refused the same way.
pub(crate) use lockstep_engine::sample::{MAX_STOP_BYTES, MAX_STOPS};

/// The stop sequences of a request, bounded in number and length, none empty.
pub(crate) fn check_stop(param: &str, stop: Option<Stop>) -> Result<Vec<String>, LockstepError> {
    let stop = stop.map(Stop::into_vec).unwrap_or_default();
    if stop.len() > MAX_STOPS {
        return Err(bad(
            param,
            format!("at most {MAX_STOPS} stop sequences, got {}", stop.len()),
        ));
    }
    if let Some(s) = stop
        .iter()
        .find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return Err(bad(
            param,
            format!(
                "each stop sequence must be 1 to {MAX_STOP_BYTES} bytes, got {}",
                s.len()
            ),
        ));
    }
    Ok(stop)
}

/// Seeds must fit a signed 64-bit integer: vLLM refuses larger ones (`completion/protocol.py`)
/// and SGLang types `sampling_seed` as i64; a seed lockstep could not pass on is refused here.
pub(crate) fn check_seed(param: &str, seed: Option<u64>) -> Result<(), LockstepError> {
    match seed {
        Some(s) if s > i64::MAX as u64 => Err(bad(
            param,
            format!("`{param}` must be at most {}, got {s}", i64::MAX),
        )),
        _ => Ok(()),
    }
}

impl CommonParams {
    /// [`CommonParams::sampling`] plus the endpoint's other fields: `response_format` becomes
    /// the constraint where the backend enforces one, every other field must ask for nothing
    /// (`table`).
    pub(super) fn with_rest(
        self,
        mut rest: Map<String, Value>,
        table: &[&[fields::Known]],
        model: &ModelConfig,
    ) -> Result<(SamplingParams, bool, bool), LockstepError> {
        let constraint = fields::response_format(&mut rest, model.backend)?;
        refuse_unhonoured(table, &rest, "")?;
        let (mut sampling, stream, include_usage) = self.sampling(model)?;
        sampling.constraint = constraint;
        Ok((sampling, stream, include_usage))
    }

    /// Validates ranges and builds SGLang sampling parameters.
    pub(super) fn sampling(
        self,
        model: &ModelConfig,
    ) -> Result<(SamplingParams, bool, bool), LockstepError> {
        if let Some(n) = self.n
            && !(1..=i64::from(model.max_n)).contains(&n)
        {
            return Err(bad(
                "n",
                format!(
                    "`n` must be 1 to {} (this model's `max_n`), got {n}",
                    model.max_n
                ),
            ));
        }
        if self.best_of.is_some_and(|n| n != 1) {
            return Err(LockstepError::Unsupported {
                message: "best_of is not supported".into(),
                param: Some("best_of".into()),
            });
        }
        let (key, requested) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(v), _) => ("max_completion_tokens", Some(v)),
            (None, v) => ("max_tokens", v),
        };
        let max_new_tokens = match requested {
            None => model.default_max_tokens,
            Some(v) if v < 1 => {
                return Err(bad(key, format!("`{key}` must be at least 1, got {v}")));
            }
            Some(v) => v as u64,
        };
        super::sampling::check(
            "",
            &super::sampling::Knobs {
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
                frequency_penalty: self.frequency_penalty,
                presence_penalty: self.presence_penalty,
            },
        )?;
        check_seed("seed", self.seed)?;
        let stop = check_stop("stop", self.stop)?;
        let include_usage = self.stream_options.is_some_and(|o| o.include_usage);
        Ok((
            SamplingParams {
                max_new_tokens,
                choice: 0,
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: super::sampling::top_k(self.top_k),
                stop,
                ignore_eos: self.ignore_eos,
                frequency_penalty: self.frequency_penalty,
                presence_penalty: self.presence_penalty,
                sampling_seed: self.seed,
                constraint: None,
                resumed: 0,
                logprobs: None,
                prompt_logprobs: None,
            },
            self.stream,
            include_usage,
        ))
    }
}

/// Message content: a string or a list of typed parts (read by hand: `admission::text_or`).
#[derive(Debug)]
pub(crate) enum Content {
    Text(String),
    Parts(Vec<super::content::Part>),
}

crate::admission::text_or::text_or_list_enum!(
    Content,
    Text,
    Parts(super::content::Part),
    "a string or a list of content parts"
);

/// What chat content parts may be: text only.
const CONTENT_PARTS: super::content::PartRule = super::content::PartRule {
    text_types: &["text"],
    known: &[],
    empty_ok: &[],
    noun: "content part",
};

/// A chat message: its role, its content, and the fields of its kind (`tool_calls`,
/// `tool_call_id`, ...).
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub(crate) struct MessageIn {
    pub(super) role: String,
    pub(super) content: Option<Content>,
    #[serde(flatten)]
    pub(super) rest: Map<String, Value>,
}

/// A chat completion request: `model`, `messages`, the sampling fields, and OpenAI's other
/// fields, each honoured where docs/api.md says and refused with 400 naming it otherwise.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub(crate) struct ChatRequest {
    model: String,
    messages: Vec<MessageIn>,
    #[serde(flatten)]
    params: CommonParams,
    /// Every other field: refused unless its value asks for nothing ([`fields`]).
    #[serde(flatten)]
    rest: Map<String, Value>,
}

pub(super) fn to_messages(messages: Vec<MessageIn>) -> Result<Vec<ChatMessage>, LockstepError> {
    if messages.is_empty() {
        return Err(bad("messages", "`messages` must not be empty".into()));
    }
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            if !matches!(
                m.role.as_str(),
                "system" | "developer" | "user" | "assistant" | "tool"
            ) {
                return Err(bad(
                    &format!("messages[{i}].role"),
                    format!("unknown role `{}`", m.role),
                ));
            }
            let mut rest = m.rest;
            let tool_calls = history_calls(i, &m.role, rest.remove("tool_calls"))?;
            let tool_call_id = match rest.remove("tool_call_id") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) if m.role == "tool" && super::tools::valid_call_id(&s) => {
                    Some(s)
                }
                Some(_) => {
                    return Err(bad(
                        &format!("messages[{i}].tool_call_id"),
                        "`tool_call_id` is a call's id (1 to 128 letters, digits, `_`, `-`, `.` or `:`), on `tool` messages".into(),
                    ));
                }
            };
            refuse_unhonoured(fields::MESSAGE, &rest, &format!("messages[{i}]."))?;
            let content = match m.content {
                None => String::new(),
                Some(Content::Text(s)) => s,
                Some(Content::Parts(parts)) => {
                    let at = format!("messages[{i}].content");
                    super::content::text_of_parts(parts, &at, &CONTENT_PARTS)?
                }
            };
            Ok(ChatMessage {
                role: if m.role == "developer" {
                    "system".into()
                } else {
                    m.role
                },
                content,
                tool_calls,
                tool_call_id,
            })
        })
        .collect()
}

/// An assistant message's earlier tool calls, for the template: `{id, type, function: {name,
/// arguments}}` with the arguments parsed to an object (as chat templates read them).
fn history_calls(
    i: usize,
    role: &str,
    v: Option<Value>,
) -> Result<Option<Vec<Value>>, LockstepError> {
    let at = format!("messages[{i}].tool_calls");
    let calls = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) if a.is_empty() => return Ok(None),
        Some(Value::Array(a)) if role == "assistant" => a,
        Some(_) => {
            return Err(bad(
                &at,
                "`tool_calls` is a list, on assistant messages".into(),
            ));
        }
    };
    calls
        .into_iter()
        .enumerate()
        .map(|(j, c)| {
            let f = c.get("function");
            let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
            let args = f.and_then(|f| f.get("arguments")).and_then(Value::as_str);
            let id = match c.get("id") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.as_str()),
                Some(_) => return Err(bad(&format!("{at}[{j}].id"), "`id` is a string".into())),
            };
            let (Some(name), Some(args)) = (name, args) else {
                return Err(bad(
                    &format!("{at}[{j}]"),
                    "a tool call has `function.name` and `function.arguments` (JSON text)".into(),
                ));
            };
            super::tools::history_call(
                (id, &format!("{at}[{j}].id")),
                (name, &format!("{at}[{j}].function.name")),
                (args, &format!("{at}[{j}].function.arguments")),
            )
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

impl FrontRequest for ChatRequest {
    type Shape = OpenAiShape;

    fn choices(&self) -> u32 {
        choices(self.params.n)
    }

    fn model(&self) -> Option<&str> {
        Some(&self.model)
    }

    fn compiles_a_grammar(&self) -> bool {
        ["response_format", "tools", "tool_choice"]
            .iter()
            .any(|k| self.rest.get(*k).is_some_and(|v| !v.is_null()))
    }

    fn validate(
        self,
        model: &ModelConfig,
    ) -> Result<(Input, SamplingParams, OpenAiShape), LockstepError> {
        let mut rest = self.rest;
        let (tools, forced) = super::tools::request(
            rest.remove("tools"),
            rest.remove("tool_choice"),
            rest.remove("parallel_tool_calls"),
            model.tool_mode(),
            model.backend,
        )?;
        let logprobs = super::logprob_params::chat_logprobs(&mut rest)?;
        let n = choices(self.params.n);
        let (mut sampling, stream, include_usage) =
            self.params.with_rest(rest, fields::CHAT, model)?;
        sampling.logprobs = logprobs;
        let messages = to_messages(self.messages)?;
        let (input, parser) = super::tools::settle(
            tools,
            forced,
            &mut sampling,
            "response_format",
            messages,
            model.tool_mode(),
        )?;
        Ok((
            input,
            sampling,
            OpenAiShape::chat(stream, include_usage)
                .with_tools(parser)
                .with_logprobs(logprobs)
                .with_choices(n),
        ))
    }
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(Admit(admitted, shape): Admit<ChatRequest>) -> Response {
    serve(admitted, shape).await
}

/// One pair's answer, or one of several choices (`n`).
async fn serve(admitted: crate::admission::Admitted, shape: OpenAiShape) -> Response {
    if shape.choices() > 1 {
        super::choices::serve_choices(admitted, shape).await
    } else {
        serve_pair(admitted, shape).await
    }
}

/// `n` as a count of choices (checked by validation; a value out of range asks for one here).
fn choices(n: Option<i64>) -> u32 {
    n.and_then(|n| u32::try_from(n).ok()).unwrap_or(1).max(1)
}

/// A completion request: `model`, `prompt` (text or token ids), the sampling fields, and
/// OpenAI's other fields, each honoured where docs/api.md says and refused otherwise.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub(crate) struct CompletionRequest {
    model: String,
    prompt: Prompt,
    #[serde(flatten)]
    params: CommonParams,
    /// Every other field: refused unless its value asks for nothing ([`fields`]).
    #[serde(flatten)]
    rest: Map<String, Value>,
}

impl FrontRequest for CompletionRequest {
    type Shape = OpenAiShape;

    fn choices(&self) -> u32 {
        choices(self.params.n)
    }

    fn compiles_a_grammar(&self) -> bool {
        self.rest
            .get("response_format")
            .is_some_and(|v| !v.is_null())
    }

    fn model(&self) -> Option<&str> {
        Some(&self.model)
    }

    fn validate(
        self,
        model: &ModelConfig,
    ) -> Result<(Input, SamplingParams, OpenAiShape), LockstepError> {
        let mut rest = self.rest;
        let logprobs = super::logprob_params::completion_logprobs(&mut rest)?;
        let n = choices(self.params.n);
        let echo = match rest.remove("echo") {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::Bool(true)) => true,
            Some(v) => return Err(bad("echo", format!("`echo` is a boolean, got {v}"))),
        };
        let (mut sampling, stream, include_usage) =
            self.params.with_rest(rest, fields::COMPLETIONS, model)?;
        sampling.logprobs = logprobs;
        sampling.prompt_logprobs = logprobs.filter(|_| echo);
        let shape = OpenAiShape::completion(stream, include_usage)
            .with_logprobs(logprobs)
            .with_choices(n);
        let shape = if echo {
            shape.with_echo(match &self.prompt {
                Prompt::Text(t) => Echo::Text(t.clone()),
                Prompt::Texts(t) => Echo::Text(t.concat()),
                Prompt::Ids(ids) => Echo::Ids(ids.clone()),
                Prompt::Batches(b) => Echo::Ids(b.concat()),
            })
        } else {
            shape
        };
        Ok((Input::Prompt(self.prompt), sampling, shape))
    }
}

/// `POST /v1/completions`.
pub(crate) async fn completions(Admit(admitted, shape): Admit<CompletionRequest>) -> Response {
    serve(admitted, shape).await
}

#[cfg(test)]
mod tests {
    use super::Content;

    #[test]
    fn content_is_a_string_or_a_list_of_parts_and_nothing_else() {
        // Plain, escaped (serde_json unescapes into its scratch buffer), and long.
        for (json, want) in [
            (r#""hi""#, "hi".to_string()),
            (r#""a\nb \u00e9""#, "a\nb é".to_string()),
            (&format!("\"{}\"", "x".repeat(200_000)), "x".repeat(200_000)),
        ] {
            match serde_json::from_str::<Content>(json).expect("text") {
                Content::Text(t) => assert_eq!(t, want),
                Content::Parts(_) => panic!("parts"),
            }
        }
        let parts: Content = serde_json::from_str(
            r#"[{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}]"#,
        )
        .expect("parts");
        match parts {
            Content::Parts(p) => {
                assert_eq!(p.len(), 2);
                assert_eq!(p[0].kind, "text");
                assert_eq!(p[0].text.as_deref(), Some("a"));
                assert_eq!(p[1].kind, "image_url");
                assert!(p[1].rest.contains_key("image_url"));
            }
            Content::Text(_) => panic!("text"),
        }
        for bad in ["5", "true", r#"{"text": "hi"}"#, r#"[5]"#] {
            let e = serde_json::from_str::<Content>(bad)
                .expect_err(bad)
                .to_string();
            assert!(
                e.contains("a string or a list of content parts") || e.contains("invalid type"),
                "{bad}: {e}"
            );
        }
        // `null` is no content (the message's field is an Option).
        let none: Option<Content> = serde_json::from_str("null").expect("null");
        assert!(none.is_none());
    }
}

//! Tool calling on `/v1/chat/completions`: `tools` and `tool_choice` checked and given to the
//! model's chat template, the model's tool calls parsed from its committed output by the model's
//! parser (`models[].tool_parser`) and returned as `tool_calls` (streamed as tool-call deltas
//! once the output ends). `tool_choice: required` or a named function is enforced by
//! constraining the sampler to the parser's call format (lockstep's engine and workers); a model
//! without a parser refuses `tools`, never returning a call as plain text with a 200.

use serde_json::{Map, Value, json};

use crate::admission::{ChatMessage, Input};
use crate::backend::{Constraint, SamplingParams};
use crate::config::{BackendKind, ToolParserKind};
use crate::error::LockstepError;

fn invalid(param: &str, message: String) -> LockstepError {
    LockstepError::InvalidRequest {
        message,
        param: Some(param.into()),
    }
}

/// A request's checked tools.
#[derive(Debug)]
pub(crate) struct Tools {
    /// The definitions as the chat template reads them (`{type, function: {name, description,
    /// parameters}}`).
    pub(crate) defs: Vec<Value>,
    /// The parser of the model's calls; `None` with `tool_choice: none` (the answer is text).
    pub(crate) parse: Option<ToolParserKind>,
    /// The declared functions' names.
    pub(crate) names: Vec<String>,
}

enum Choice {
    None,
    Auto,
    Required,
    Named(String),
}

fn choice_of(v: Option<Value>) -> Result<Option<Choice>, LockstepError> {
    let bad = || {
        invalid(
            "tool_choice",
            "`tool_choice` must be `none`, `auto`, `required` or {\"type\": \"function\", \"function\": {\"name\": ...}}".into(),
        )
    };
    Ok(match v {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(match s.as_str() {
            "none" => Choice::None,
            "auto" => Choice::Auto,
            "required" => Choice::Required,
            _ => return Err(bad()),
        }),
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(bad)?;
            Some(Choice::Named(name.to_string()))
        }
        Some(_) => return Err(bad()),
    })
}

fn valid_name(n: &str) -> bool {
    (1..=64).contains(&n.len())
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Whether `id` may name a tool call: 1 to 128 ASCII letters, digits, `_`, `-`, `.` or `:`
/// (OpenAI's `call_...`, Anthropic's `toolu_...`, vLLM's and SGLang's ids all are).
pub(crate) fn valid_call_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
}

/// An earlier call of the model, from a request's history, as the chat template reads it
/// (`{id, type, function: {name, arguments}}`, the arguments parsed to an object): the name a
/// valid function name (that `tools` declares it is checked by [`settle`]), the id from the
/// safe set of [`valid_call_id`] (or none), the arguments JSON text of an object.
pub(crate) fn history_call(
    (id, id_at): (Option<&str>, &str),
    (name, name_at): (&str, &str),
    (arguments, args_at): (&str, &str),
) -> Result<Value, LockstepError> {
    if !valid_name(name) {
        return Err(invalid(
            name_at,
            "a function name is 1 to 64 letters, digits, `_` or `-`".into(),
        ));
    }
    if id.is_some_and(|id| !valid_call_id(id)) {
        return Err(invalid(
            id_at,
            "a tool call id is 1 to 128 letters, digits, `_`, `-`, `.` or `:`".into(),
        ));
    }
    let arguments = match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => {
            return Err(invalid(
                args_at,
                "the arguments are the JSON text of an object".into(),
            ));
        }
        Err(e) => return Err(invalid(args_at, format!("the arguments are not JSON: {e}"))),
    };
    Ok(
        json!({ "id": id, "type": "function", "function": { "name": name, "arguments": arguments } }),
    )
}

/// One tool definition, checked and normalised; its name and parameter schema.
fn definition(i: usize, v: Value) -> Result<(Value, String, Value), LockstepError> {
    let at = format!("tools[{i}]");
    let Value::Object(mut o) = v else {
        return Err(invalid(&at, format!("`{at}` must be an object")));
    };
    if o.remove("type").as_ref().and_then(Value::as_str) != Some("function") {
        return Err(LockstepError::Unsupported {
            message: format!("`{at}.type`: only `function` tools are supported"),
            param: Some(format!("{at}.type")),
        });
    }
    let Some(Value::Object(mut f)) = o.remove("function") else {
        return Err(invalid(
            &format!("{at}.function"),
            format!("`{at}.function` is required"),
        ));
    };
    super::fields::refuse_unhonoured(&[], &o, &format!("{at}."))?;
    let name = f
        .remove("name")
        .and_then(|n| n.as_str().map(str::to_string))
        .filter(|n| valid_name(n))
        .ok_or_else(|| {
            invalid(
                &format!("{at}.function.name"),
                "a function name is 1 to 64 letters, digits, `_` or `-`".into(),
            )
        })?;
    let params = match f.remove("parameters") {
        None | Some(Value::Null) => json!({ "type": "object", "properties": {} }),
        Some(p @ Value::Object(_)) => p,
        Some(_) => {
            return Err(invalid(
                &format!("{at}.function.parameters"),
                "`parameters` must be a JSON schema object".into(),
            ));
        }
    };
    let mut out = Map::new();
    out.insert("name".into(), json!(name));
    match f.remove("description") {
        None | Some(Value::Null) => {}
        Some(d @ Value::String(_)) => {
            out.insert("description".into(), d);
        }
        Some(_) => {
            return Err(invalid(
                &format!("{at}.function.description"),
                "`description` must be a string".into(),
            ));
        }
    }
    out.insert("parameters".into(), params.clone());
    // `strict` asks for arguments valid against the schema: what a forced call guarantees, and
    // what lockstep checks of every call it returns (the arguments must be JSON).
    f.remove("strict");
    super::fields::refuse_unhonoured(&[], &f, &format!("{at}.function."))?;
    Ok((json!({ "type": "function", "function": out }), name, params))
}

/// Checks `tools` and `tool_choice` for a model with `parser` on `backend`: the tools (none
/// when the request has none) and the constraint forcing a call, when `tool_choice` asks for one.
pub(crate) fn request(
    tools: Option<Value>,
    choice: Option<Value>,
    parser: Option<ToolParserKind>,
    backend: BackendKind,
) -> Result<(Option<Tools>, Option<Constraint>), LockstepError> {
    let defs = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(invalid("tools", "`tools` must be a list".into())),
    };
    let choice = choice_of(choice)?;
    if defs.is_empty() {
        return match choice {
            Some(Choice::Required | Choice::Named(_)) => Err(invalid(
                "tool_choice",
                "`tool_choice` asks for a call but the request has no `tools`".into(),
            )),
            _ => Ok((None, None)),
        };
    }
    let Some(kind) = parser else {
        return Err(LockstepError::Unsupported {
            message: "this model has no tool parser configured (`models[].tool_parser`), so lockstep could not return its tool calls".into(),
            param: Some("tools".into()),
        });
    };
    let mut checked = Vec::with_capacity(defs.len());
    let mut calls = Vec::with_capacity(defs.len());
    for (i, d) in defs.into_iter().enumerate() {
        let (def, name, params) = definition(i, d)?;
        if calls.iter().any(|(n, _): &(String, Value)| *n == name) {
            return Err(invalid(
                &format!("tools[{i}].function.name"),
                format!("two tools are named `{name}`"),
            ));
        }
        checked.push(def);
        calls.push((name, params));
    }
    let forced: Vec<&(String, Value)> = match &choice {
        Some(Choice::Required) => calls.iter().collect(),
        Some(Choice::Named(n)) => {
            let c: Vec<_> = calls.iter().filter(|(name, _)| name == n).collect();
            if c.is_empty() {
                return Err(invalid(
                    "tool_choice",
                    format!("`tool_choice` names `{n}`, which is not in `tools`"),
                ));
            }
            c
        }
        _ => Vec::new(),
    };
    let constraint = if forced.is_empty() {
        None
    } else {
        if !matches!(backend, BackendKind::Embedded | BackendKind::Lockstep) {
            return Err(LockstepError::Unsupported {
                message: format!(
                    "`tool_choice` that forces a call needs a backend whose sampling lockstep constrains (embedded, lockstep workers), not {}",
                    backend.as_str()
                ),
                param: Some("tool_choice".into()),
            });
        }
        let g = call_grammar(kind, &forced);
        super::fields::within_cap(&Constraint::Lark(g.clone()), "tools")?;
        let c = lockstep_engine::grammar::OutputConstraint::Lark(g.clone());
        lockstep_engine::grammar::check(&c).map_err(|m| {
            invalid(
                "tools",
                format!("a tool's parameters cannot be enforced: {m}"),
            )
        })?;
        Some(Constraint::Lark(g))
    };
    let parse = (!matches!(choice, Some(Choice::None))).then_some(kind);
    Ok((
        Some(Tools {
            defs: checked,
            parse,
            names: calls.into_iter().map(|(n, _)| n).collect(),
        }),
        constraint,
    ))
}

/// Settles a request's tools once its messages and sampling are known: a forced call becomes
/// the sampling constraint (it cannot share the answer with the structured-output format named
/// `format_param`), tool history needs a model whose template is known to render it, and the
/// prompt input carries the definitions for the template. Returns the input and the parser of
/// the answer.
pub(crate) fn settle(
    tools: Option<Tools>,
    forced: Option<Constraint>,
    sampling: &mut SamplingParams,
    format_param: &str,
    messages: Vec<ChatMessage>,
    parser: Option<ToolParserKind>,
) -> Result<(Input, Option<ToolParse>), LockstepError> {
    if forced.is_some() {
        if sampling.constraint.is_some() {
            return Err(invalid(
                format_param,
                format!(
                    "`{format_param}` and a `tool_choice` that forces a call cannot both shape the answer"
                ),
            ));
        }
        sampling.constraint = forced;
    }
    if parser.is_none() && messages.iter().any(|m| m.tool_calls.is_some()) {
        return Err(LockstepError::Unsupported {
            message: "this model has no tool parser configured (`models[].tool_parser`), so its template is not known to render tool calls".into(),
            param: Some("messages".into()),
        });
    }
    // A call in the history is to a function this request declares.
    let declared = |n: &str| {
        tools
            .as_ref()
            .is_some_and(|t| t.names.iter().any(|d| d == n))
    };
    for m in &messages {
        for c in m.tool_calls.iter().flatten() {
            let name = c["function"]["name"].as_str().unwrap_or_default();
            if !declared(name) {
                return Err(invalid(
                    "tools",
                    format!("the history has a call to `{name}`, which `tools` does not declare"),
                ));
            }
        }
    }
    Ok(match tools {
        Some(t) => {
            let parse = t.parse.map(|kind| ToolParse {
                kind,
                names: t.names.into(),
            });
            (Input::ChatTools(messages, t.defs), parse)
        }
        None => (Input::Chat(messages), None),
    })
}

/// How a chat answer's tool calls are read: the model's parser, and the functions the request
/// declared (a call to any other comes back as text).
#[derive(Debug, Clone)]
pub(crate) struct ToolParse {
    pub(crate) kind: ToolParserKind,
    pub(crate) names: std::sync::Arc<[String]>,
}

/// The grammar of one call, in the parser's format, to one of `tools`.
fn call_grammar(kind: ToolParserKind, tools: &[&(String, Value)]) -> String {
    let key = match kind {
        ToolParserKind::Llama3Json => "parameters",
        _ => "arguments",
    };
    let one = |(name, params): &&(String, Value)| {
        json!({ "type": "object", "properties": { "name": { "const": name }, key: params },
                "required": ["name", key], "additionalProperties": false })
    };
    let call = match tools {
        [t] => one(t),
        _ => json!({ "anyOf": tools.iter().map(one).collect::<Vec<_>>() }),
    };
    let bound = lockstep_engine::grammar::bound_json_whitespace;
    match kind {
        ToolParserKind::Hermes | ToolParserKind::Qwen => format!(
            "start: \"<tool_call>\\n\" %json {} \"\\n</tool_call>\"",
            bound(call)
        ),
        ToolParserKind::Llama3Json => format!("start: %json {}", bound(call)),
        ToolParserKind::Mistral => format!(
            "start: \"[TOOL_CALLS]\" %json {}",
            bound(json!({ "type": "array", "items": call, "minItems": 1, "maxItems": 1 }))
        ),
    }
}

/// One call the model made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Call {
    pub(crate) name: String,
    /// The arguments as JSON text.
    pub(crate) arguments: String,
}

/// The call in one JSON value (`name` and the arguments under `key`), if it is one.
fn call_of(v: &Value, key: &str) -> Option<Call> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = v
        .get(key)
        .or_else(|| v.get("arguments"))
        .cloned()
        .unwrap_or_else(|| json!({}));
    let arguments = match args {
        // A string already holding JSON is passed as it is.
        Value::String(s) if serde_json::from_str::<Value>(&s).is_ok() => s,
        Value::Object(_) => args.to_string(),
        _ => return None,
    };
    Some(Call { name, arguments })
}

/// The JSON values in `s` one after another, separated by whitespace or `sep`; `None` unless
/// that is all `s` holds.
fn values(s: &str, sep: char) -> Option<Vec<Value>> {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let mut it = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let v = it.next()?.ok()?;
        rest = rest[it.byte_offset()..].trim_start();
        rest = rest.strip_prefix(sep).unwrap_or(rest).trim_start();
        out.push(v);
    }
    Some(out)
}

/// The content and calls in a whole output; `None` when it holds no call, or a call to a
/// function the request did not declare (it is all content).
pub(crate) fn parse(tools: &ToolParse, text: &str) -> Option<(String, Vec<Call>)> {
    let (content, calls) = parse_calls(tools.kind, text)?;
    calls
        .iter()
        .all(|c| tools.names.contains(&c.name))
        .then_some((content, calls))
}

/// The content and calls in a whole output in `kind`'s format; `None` when it holds no call.
fn parse_calls(kind: ToolParserKind, text: &str) -> Option<(String, Vec<Call>)> {
    match kind {
        ToolParserKind::Hermes | ToolParserKind::Qwen => {
            let (open, close) = ("<tool_call>", "</tool_call>");
            let mut content = String::new();
            let mut calls = Vec::new();
            let mut rest = text;
            while let Some(at) = rest.find(open) {
                content.push_str(&rest[..at]);
                let after = &rest[at + open.len()..];
                let (inner, next) = match after.find(close) {
                    Some(end) => (&after[..end], &after[end + close.len()..]),
                    None => (after, ""),
                };
                let v: Value = serde_json::from_str(inner.trim()).ok()?;
                calls.push(call_of(&v, "arguments")?);
                rest = next;
            }
            content.push_str(rest);
            (!calls.is_empty()).then(|| (content.trim().to_string(), calls))
        }
        ToolParserKind::Llama3Json => {
            let t = text.trim_start();
            let t = t.strip_prefix("<|python_tag|>").unwrap_or(t);
            if !t.trim_start().starts_with('{') {
                return None;
            }
            let calls = values(t, ';')?
                .iter()
                .map(|v| call_of(v, "parameters"))
                .collect::<Option<Vec<_>>>()?;
            Some((String::new(), calls))
        }
        ToolParserKind::Mistral => {
            let t = text.trim_start();
            let t = t.strip_prefix("[TOOL_CALLS]")?;
            let calls = match serde_json::from_str::<Value>(t.trim()).ok()? {
                Value::Array(a) => a
                    .iter()
                    .map(|v| call_of(v, "arguments"))
                    .collect::<Option<Vec<_>>>()?,
                v => vec![call_of(&v, "arguments")?],
            };
            Some((String::new(), calls))
        }
    }
}

/// A streamed answer's split between content (sent as it comes) and a tool call (held from
/// where it may begin until the output ends, then parsed).
#[derive(Debug)]
pub(crate) struct ToolStream {
    pub(crate) tools: ToolParse,
    /// Text not sent yet: a tail that may begin a call, or, once one began, all of it.
    held: String,
    /// A call may have begun: nothing more is sent as content until the end.
    holding: bool,
    /// Whether anything but whitespace came yet (the JSON formats start with their call).
    started: bool,
}

impl ToolStream {
    pub(crate) fn new(tools: ToolParse) -> ToolStream {
        ToolStream {
            tools,
            held: String::new(),
            holding: false,
            started: false,
        }
    }

    /// Content to send now for this delta.
    pub(crate) fn push(&mut self, delta: &str) -> String {
        self.held.push_str(delta);
        if self.holding {
            return String::new();
        }
        match self.tools.kind {
            ToolParserKind::Hermes | ToolParserKind::Qwen => {
                let marker = "<tool_call>";
                if let Some(at) = self.held.find(marker) {
                    self.holding = true;
                    let out = self.held[..at].to_string();
                    self.held.drain(..at);
                    return out;
                }
                // Keep the longest tail that could still grow into the marker.
                let keep = (1..marker.len().min(self.held.len() + 1))
                    .rev()
                    .find(|&n| {
                        self.held.is_char_boundary(self.held.len() - n)
                            && self.held.ends_with(&marker[..n])
                    })
                    .unwrap_or(0);
                let cut = self.held.len() - keep;
                let out = self.held[..cut].to_string();
                self.held.drain(..cut);
                out
            }
            ToolParserKind::Llama3Json | ToolParserKind::Mistral => {
                if self.started {
                    return std::mem::take(&mut self.held);
                }
                let t = self.held.trim_start();
                let Some(first) = t.chars().next() else {
                    return String::new();
                };
                self.started = true;
                let call = match self.tools.kind {
                    ToolParserKind::Mistral => first == '[',
                    _ => first == '{' || first == '<',
                };
                if call {
                    self.holding = true;
                    String::new()
                } else {
                    std::mem::take(&mut self.held)
                }
            }
        }
    }

    /// At the end of the output: the content still to send, and the calls.
    pub(crate) fn finish(&mut self) -> (String, Vec<Call>) {
        let held = std::mem::take(&mut self.held);
        match self.holding.then(|| parse(&self.tools, &held)).flatten() {
            Some((content, calls)) => (content, calls),
            None => (held, Vec::new()),
        }
    }
}

/// The `tool_calls` of a response message, ids derived from the pair.
pub(crate) fn tool_calls_json(pair: &str, calls: &[Call]) -> Vec<Value> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({ "id": format!("call_{pair}_{i}"), "type": "function",
                    "function": { "name": c.name, "arguments": c.arguments } })
        })
        .collect()
}

#[cfg(test)]
#[path = "tools_tests.rs"]
mod tests;

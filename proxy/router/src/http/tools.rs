//! Tool calling on `/v1/chat/completions` and `/v1/responses`: `tools`, `tool_choice` and
//! `parallel_tool_calls` checked and given to the model's chat template, the model's tool calls
//! parsed from its committed output by the model's parser (`models[].tool_parser`) and returned
//! as `tool_calls` (streamed as tool-call deltas once the output ends). `tool_choice: required`
//! or a named function is enforced by constraining the sampler to the parser's call format
//! (lockstep's engine and workers). A model without a parser of its own is in generic mode
//! ([`super::tools_generic`]): lockstep writes the tools into the prompt and constrains the
//! answer to text or one JSON envelope of calls.

use serde_json::{Map, Value, json};

use crate::admission::Input;
use crate::backend::{Constraint, SamplingParams};
use lockstep_core::config::{BackendKind, ToolParserKind};
use lockstep_core::error::LockstepError;
use lockstep_prompt::ChatMessage;

use super::tools_generic as generic;

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
    /// Generic mode: what the system turn says of the tools (`None` with `tool_choice: none`).
    section: Option<String>,
    /// `parallel_tool_calls: false`: an answer with more than one call is no call.
    one_call: bool,
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

/// `parallel_tool_calls`: whether an answer may hold several calls. Unsaid: yes with a model's
/// own parser (OpenAI's default); one call in generic mode, as llama-server's generic format
/// does (a small model that may list calls tends to repeat one until its token limit).
fn parallel_of(v: Option<Value>, kind: ToolParserKind) -> Result<bool, LockstepError> {
    match v {
        None | Some(Value::Null) => Ok(kind != ToolParserKind::Generic),
        Some(Value::Bool(b)) => Ok(b),
        Some(v) => Err(invalid(
            "parallel_tool_calls",
            format!("`parallel_tool_calls` is a boolean, got {v}"),
        )),
    }
}

/// Checks `tools`, `tool_choice` and `parallel_tool_calls` for a model whose calls are in `kind`'s
/// format on `backend`: the tools (none when the request has none) and the constraint the answer
/// is sampled under (a forced call; in generic mode, text or calls).
pub(crate) fn request(
    tools: Option<Value>,
    choice: Option<Value>,
    parallel: Option<Value>,
    kind: ToolParserKind,
    backend: BackendKind,
) -> Result<(Option<Tools>, Option<Constraint>), LockstepError> {
    let defs = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(invalid("tools", "`tools` must be a list".into())),
    };
    let choice = choice_of(choice)?;
    let parallel = parallel_of(parallel, kind)?;
    if defs.is_empty() {
        return match choice {
            Some(Choice::Required | Choice::Named(_)) => Err(invalid(
                "tool_choice",
                "`tool_choice` asks for a call but the request has no `tools`".into(),
            )),
            _ => Ok((None, None)),
        };
    }
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
    let constraint = if kind == ToolParserKind::Generic {
        generic_constraint(&choice, &calls, &forced, parallel, backend)?
    } else if forced.is_empty() {
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
    let section = (kind == ToolParserKind::Generic && parse.is_some()).then(|| {
        let must: Option<Vec<String>> =
            (!forced.is_empty()).then(|| forced.iter().map(|(n, _)| n.clone()).collect());
        generic::system_section(&checked, must.as_deref(), parallel)
    });
    Ok((
        Some(Tools {
            defs: checked,
            parse,
            names: calls.into_iter().map(|(n, _)| n).collect(),
            section,
            one_call: !parallel,
        }),
        constraint,
    ))
}

/// Generic mode's constraint: none for `tool_choice: none`; the envelope of calls to the
/// forced tools (a JSON schema, which remote backends' grammar engines enforce too); for `auto`,
/// text or the envelope (a grammar only lockstep's engine and workers take).
fn generic_constraint(
    choice: &Option<Choice>,
    calls: &[(String, Value)],
    forced: &[&(String, Value)],
    parallel: bool,
    backend: BackendKind,
) -> Result<Option<Constraint>, LockstepError> {
    let c = match choice {
        Some(Choice::None) => return Ok(None),
        Some(Choice::Required | Choice::Named(_)) => {
            Constraint::JsonSchema(generic::envelope_schema(forced, parallel).to_string())
        }
        None | Some(Choice::Auto) => {
            if !matches!(backend, BackendKind::Embedded | BackendKind::Lockstep) {
                return Err(LockstepError::Unsupported {
                    message: format!(
                        "this model has no tool parser configured (`models[].tool_parser`), and generic tool calls with `tool_choice: auto` need a grammar of text or calls that {} does not take; configure the model's `tool_parser`, or send `tool_choice: required` or a named function",
                        backend.as_str()
                    ),
                    param: Some("tools".into()),
                });
            }
            let all: Vec<&(String, Value)> = calls.iter().collect();
            Constraint::Lark(generic::auto_grammar(generic::envelope_schema(
                &all, parallel,
            )))
        }
    };
    super::fields::within_cap(&c, "tools")?;
    let check = c
        .for_engine()
        .ok_or_else(|| invalid("tools", "no grammar".into()))?;
    lockstep_engine::grammar::check(&check).map_err(|m| {
        invalid(
            "tools",
            format!("a tool's parameters cannot be enforced: {m}"),
        )
    })?;
    Ok(Some(c))
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
    kind: ToolParserKind,
) -> Result<(Input, Option<ToolParse>), LockstepError> {
    if forced.is_some() {
        if sampling.constraint.is_some() {
            return Err(invalid(
                format_param,
                format!(
                    "`{format_param}` and `tools` (a `tool_choice` that forces a call, or generic tool calls) cannot both shape the answer"
                ),
            ));
        }
        sampling.constraint = forced;
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
    let one_call = tools.as_ref().is_some_and(|t| t.one_call);
    let parse = tools.as_ref().and_then(|t| t.parse).map(|kind| ToolParse {
        kind,
        names: tools
            .as_ref()
            .map(|t| t.names.clone())
            .unwrap_or_default()
            .into(),
        one_call,
    });
    Ok(match tools {
        _ if kind == ToolParserKind::Generic => {
            let section = tools.and_then(|t| t.section);
            (
                Input::Chat(generic::rewrite_history(messages, section.as_deref())),
                parse,
            )
        }
        Some(t) => (Input::ChatTools(messages, t.defs), parse),
        None => (Input::Chat(messages), None),
    })
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
        ToolParserKind::Generic => {
            format!(
                "start: %json {}",
                bound(generic::envelope_schema(tools, false))
            )
        }
    }
}

pub(crate) use super::tools_parse::{Call, ToolParse, ToolStream, parse, tool_calls_json};

#[cfg(test)]
#[path = "tools_tests.rs"]
mod tests;

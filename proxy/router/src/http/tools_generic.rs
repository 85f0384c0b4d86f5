//! Generic tool calling (`tool_parser = "generic"`, the default): tools for any model and any
//! chat template, with no format of the model's own to rely on.
//!
//! - **Prompt.** The tools are written into the system turn (appended to the request's system
//!   message, or a system message of their own first): each tool's definition as one line of
//!   JSON, then how to call them ([`system_section`]). Earlier calls in the history become the
//!   assistant's envelope text; tool results become one user turn per run of results, each
//!   `Result of <name> (call <id>):` and its content on the lines after ([`rewrite_history`]).
//!   The template sees only `system`, `user` and `assistant` turns of plain text.
//! - **Output.** The answer is constrained by the grammar engine (llguidance) to either plain
//!   text that does not begin with `{`, or exactly one envelope:
//!   `{"tool_calls": [{"name": "<declared tool>", "arguments": {...}}]}`, each call's arguments
//!   valid for its tool's schema, one call when `parallel_tool_calls` is false. `tool_choice:
//!   required` or a named tool allows only the envelope (a JSON schema, which SGLang's and vLLM's
//!   grammar backends enforce too); `none` writes no tools and constrains nothing; `auto` is the
//!   text-or-envelope grammar, which only lockstep's engine and workers enforce.
//! - **Reading it.** An answer whose first non-space character is `{` is the envelope and is
//!   parsed into `tool_calls`; anything else is the message's content.

use serde_json::{Value, json};

use lockstep_prompt::ChatMessage;

/// The key of the envelope's list of calls.
const KEY: &str = "tool_calls";

/// `schema` with every object that lists its `properties` and leaves `additionalProperties`
/// unsaid closed to those properties (a stricter schema: what it allows, the original allows).
/// A small model otherwise goes on writing keys it copied from the schema until its token limit.
fn closed(mut schema: Value) -> Value {
    fn close(v: &mut Value) {
        let Value::Object(o) = v else { return };
        if o.get("properties").is_some_and(Value::is_object)
            && !o.contains_key("additionalProperties")
            && !o.contains_key("patternProperties")
        {
            o.insert("additionalProperties".into(), Value::Bool(false));
        }
        for (k, sub) in o.iter_mut() {
            match (k.as_str(), sub) {
                // Maps of names to schemas.
                (
                    "properties" | "$defs" | "definitions" | "patternProperties",
                    Value::Object(m),
                ) => m.values_mut().for_each(close),
                // Lists of schemas.
                ("anyOf" | "oneOf" | "allOf" | "prefixItems", Value::Array(a)) => {
                    a.iter_mut().for_each(close)
                }
                // One schema.
                ("items" | "additionalProperties" | "not" | "if" | "then" | "else", s) => close(s),
                _ => {}
            }
        }
    }
    close(&mut schema);
    schema
}

/// The JSON schema of an envelope of calls to `tools` (name and parameter schema each): at least
/// one call, at most one unless `parallel`. Each tool's objects are [`closed`].
pub(super) fn envelope_schema(tools: &[&(String, Value)], parallel: bool) -> Value {
    let one = |(name, params): &&(String, Value)| {
        let params = closed(params.clone());
        json!({ "type": "object", "properties": { "name": { "const": name }, "arguments": params },
                "required": ["name", "arguments"], "additionalProperties": false })
    };
    let call = match tools {
        [t] => one(t),
        _ => json!({ "anyOf": tools.iter().map(one).collect::<Vec<_>>() }),
    };
    let mut calls = json!({ "type": "array", "items": call, "minItems": 1 });
    if !parallel {
        calls["maxItems"] = json!(1);
    }
    json!({ "type": "object", "properties": { KEY: calls }, "required": [KEY],
            "additionalProperties": false })
}

/// The grammar of `tool_choice: auto`: plain text that does not begin with `{` (after any
/// whitespace), or the envelope.
pub(super) fn auto_grammar(envelope: Value) -> String {
    format!(
        "start: TEXT | calls\ncalls: %json {}\nTEXT: /[ \\t\\r\\n]*([^{{ \\t\\r\\n][\\s\\S]*)?/\n",
        lockstep_engine::grammar::bound_json_whitespace(envelope)
    )
}

/// What the system turn says of the tools: their definitions and how to call them.
/// `must_call`: `None` when a call is optional, else the tools one of which must be called.
pub(super) fn system_section(
    defs: &[Value],
    must_call: Option<&[String]>,
    parallel: bool,
) -> String {
    let mut s = String::from(
        "# Tools\n\nYou can call these tools (each line: a tool's name, description and the JSON schema of its arguments):\n",
    );
    for d in defs {
        s.push_str(&d["function"].to_string());
        s.push('\n');
    }
    s.push_str("\nTo call tools, reply with only this JSON and nothing else:\n");
    s.push_str(r#"{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}"#);
    s.push('\n');
    s.push_str(if parallel {
        "Make one call unless the request needs several different ones; list each once.\n"
    } else {
        "List exactly one call.\n"
    });
    match must_call {
        None => s.push_str("To answer without a tool, reply in plain text.\n"),
        Some([one]) => s.push_str(&format!("You must call the tool `{one}` now.\n")),
        Some(_) => s.push_str("You must call a tool now.\n"),
    }
    s.push_str(
        "Tool results come back in a user turn, each after a line `Result of <tool name>:`.",
    );
    s
}

/// The envelope text of earlier calls (`{id, type, function: {name, arguments}}` each).
fn envelope_text(calls: &[Value]) -> String {
    let calls: Vec<Value> = calls
        .iter()
        .map(|c| json!({ "name": c["function"]["name"], "arguments": c["function"]["arguments"] }))
        .collect();
    json!({ KEY: calls }).to_string()
}

/// The messages as the template sees them in generic mode: `section` (if any) in the system
/// turn, earlier calls as envelope text, tool results as user turns.
pub(super) fn rewrite_history(
    messages: Vec<ChatMessage>,
    section: Option<&str>,
) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    // Each earlier call's name, by id, for the results that answer it.
    let mut names: Vec<(String, Value)> = Vec::new();
    // Whether the last message written is a run of tool results (the next one joins it).
    let mut in_results = false;
    for m in messages {
        match m.role.as_str() {
            "tool" => {
                let name = m
                    .tool_call_id
                    .as_ref()
                    .and_then(|id| names.iter().rev().find(|(i, _)| i == id))
                    .and_then(|(_, n)| n.as_str().map(str::to_string));
                let result = match (name, &m.tool_call_id) {
                    (Some(n), Some(id)) => format!("Result of {n} (call {id}):\n{}", m.content),
                    (None, Some(id)) => format!("Result of call {id}:\n{}", m.content),
                    _ => format!("Result of a tool call:\n{}", m.content),
                };
                match out.last_mut() {
                    Some(last) if in_results => {
                        last.content.push_str("\n\n");
                        last.content.push_str(&result);
                    }
                    _ => out.push(ChatMessage::text("user", result)),
                }
                in_results = true;
                continue;
            }
            _ if m.tool_calls.is_some() => {
                let calls = m.tool_calls.unwrap_or_default();
                for c in &calls {
                    if let Some(id) = c["id"].as_str() {
                        names.push((id.to_string(), c["function"]["name"].clone()));
                    }
                }
                let env = envelope_text(&calls);
                let content = match m.content.trim() {
                    "" => env,
                    text => format!("{text}\n{env}"),
                };
                out.push(ChatMessage::text(m.role, content));
            }
            _ => out.push(m),
        }
        in_results = false;
    }
    if let Some(section) = section {
        match out.first_mut() {
            Some(first) if first.role == "system" => {
                first.content = format!("{}\n\n{section}", first.content.trim_end());
            }
            _ => out.insert(0, ChatMessage::text("system", section)),
        }
    }
    out
}

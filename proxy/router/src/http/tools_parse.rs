//! Reading a model's tool calls from its committed output, whole ([`parse`]) and streamed
//! ([`ToolStream`]), in each parser's format; the calls as a response's `tool_calls`.

use serde_json::{Value, json};

use lockstep_core::config::ToolParserKind;

/// How a chat answer's tool calls are read: the model's parser, and the functions the request
/// declared (a call to any other comes back as text).
#[derive(Debug, Clone)]
pub(crate) struct ToolParse {
    pub(crate) kind: ToolParserKind,
    pub(crate) names: std::sync::Arc<[String]>,
    /// `parallel_tool_calls: false`: more than one call is no call (all of it is text).
    pub(crate) one_call: bool,
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
    (calls.iter().all(|c| tools.names.contains(&c.name)) && !(tools.one_call && calls.len() > 1))
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
        ToolParserKind::Generic => Some((String::new(), parse_envelope(text)?)),
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
#[derive(Debug, Clone)]
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
            ToolParserKind::Llama3Json | ToolParserKind::Mistral | ToolParserKind::Generic => {
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
                    ToolParserKind::Generic => first == '{',
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

/// The calls in a whole generic-mode answer: `None` unless it is one envelope (after leading
/// whitespace) whose calls each are a call ([`call_of`]).
fn parse_envelope(text: &str) -> Option<Vec<Call>> {
    let t = text.trim_start();
    if !t.starts_with('{') {
        return None;
    }
    let Value::Object(mut o) = serde_json::from_str::<Value>(t).ok()? else {
        return None;
    };
    let Some(Value::Array(calls)) = o.remove("tool_calls") else {
        return None;
    };
    if !o.is_empty() || calls.is_empty() {
        return None;
    }
    calls.iter().map(|c| call_of(c, "arguments")).collect()
}

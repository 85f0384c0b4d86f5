//! The string-or-parts content rule, one for every API: a content field is a string, or a list
//! of typed parts of which only text parts are served. The parts' texts are joined in order; a
//! part of another type, or one carrying a field not honoured, is refused by name (400
//! `unsupported` with the part's path), never dropped. Each API names its text types and what
//! else a part may carry ([`PartRule`]).

use serde::Deserialize;
use serde_json::{Map, Value};

use super::fields::{Known, empty, refuse_unhonoured};
use lockstep_core::error::LockstepError;

/// One content part (OpenAI) or content block (Anthropic): its type, its text, and every other
/// field it carries.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub(crate) struct Part {
    #[serde(rename = "type")]
    pub(super) kind: String,
    pub(super) text: Option<String>,
    #[serde(flatten)]
    pub(super) rest: Map<String, Value>,
}

/// What one API accepts in a list of parts.
pub(crate) struct PartRule {
    /// The types whose `text` is served.
    pub text_types: &'static [&'static str],
    /// The other fields a part may carry (`refuse_unhonoured`'s table).
    pub known: &'static [&'static [Known]],
    /// Fields passed over when empty (output given back as history carries them).
    pub empty_ok: &'static [&'static str],
    /// What the API calls a part, for the refusal: "content part", "content block".
    pub noun: &'static str,
}

/// The text of `parts` at the request path `at` (`messages[2].content`), by `rule`.
pub(crate) fn text_of_parts(
    parts: Vec<Part>,
    at: &str,
    rule: &PartRule,
) -> Result<String, LockstepError> {
    let mut s = String::new();
    for (j, p) in parts.into_iter().enumerate() {
        let param = format!("{at}[{j}]");
        let mut rest = p.rest;
        rest.retain(|k, v| !(rule.empty_ok.contains(&k.as_str()) && empty(v)));
        refuse_unhonoured(rule.known, &rest, &format!("{param}."))?;
        match (p.kind.as_str(), p.text) {
            (kind, Some(t)) if rule.text_types.contains(&kind) => s.push_str(&t),
            (kind, _) => {
                return Err(LockstepError::Unsupported {
                    message: format!("{} type `{kind}` is not supported (text only)", rule.noun),
                    param: Some(param),
                });
            }
        }
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{Part, PartRule, text_of_parts};
    const RULE: PartRule = PartRule {
        text_types: &["text", "input_text"],
        known: &[],
        empty_ok: &["annotations"],
        noun: "content part",
    };

    fn parts(v: serde_json::Value) -> Vec<Part> {
        serde_json::from_value(v).expect("parts")
    }

    fn refused(v: serde_json::Value) -> (String, Option<String>) {
        let e = text_of_parts(parts(v), "messages[0].content", &RULE).expect_err("refused");
        assert_eq!(e.status(), 400, "{e}");
        let param = e.body()["error"]["param"].as_str().map(str::to_string);
        (e.to_string(), param)
    }

    #[test]
    fn text_parts_are_joined_and_anything_else_is_refused_by_name() {
        let ok = parts(json!([
            {"type": "text", "text": "a"},
            {"type": "input_text", "text": "b", "annotations": []},
        ]));
        let text = text_of_parts(ok, "messages[0].content", &RULE).expect("text");
        assert_eq!(text, "ab");
        let (message, param) = refused(json!([
            {"type": "text", "text": "a"},
            {"type": "image_url"},
        ]));
        assert!(
            message.contains("content part type `image_url`"),
            "{message}"
        );
        assert_eq!(param.as_deref(), Some("messages[0].content[1]"));
        // A field not honoured is refused, even on a text part; an empty one passed over is not.
        let (_, param) = refused(json!([{"type": "text", "text": "a", "annotations": ["x"]}]));
        assert_eq!(param.as_deref(), Some("messages[0].content[0].annotations"));
        let (_, param) = refused(json!([{"type": "text", "text": "a", "cache": 1}]));
        assert_eq!(param.as_deref(), Some("messages[0].content[0].cache"));
        // A text type without its text is refused too.
        let (_, param) = refused(json!([{"type": "text"}]));
        assert_eq!(param.as_deref(), Some("messages[0].content[0]"));
    }
}

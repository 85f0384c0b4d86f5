//! Never drop a field: every request field a front end's typed request did not take lands in a
//! `rest` map, and is accepted only where its value asks for nothing (a default, an empty list,
//! an id for the provider's records); anything else is a 400 `unsupported` naming the field, so
//! a client asking for JSON mode, tools or log-probabilities never gets free text with a 200.

use serde_json::{Map, Value};

use crate::backend::Constraint;
use lockstep_core::config::BackendKind;
use lockstep_core::error::LockstepError;

/// A field lockstep knows but does not forward: when its value is a no-op, and why otherwise.
pub(crate) struct Known {
    name: &'static str,
    noop: fn(&Value) -> bool,
    why: &'static str,
}

pub(crate) const fn known(
    name: &'static str,
    noop: fn(&Value) -> bool,
    why: &'static str,
) -> Known {
    Known { name, noop, why }
}

pub(crate) fn null(v: &Value) -> bool {
    v.is_null()
}
pub(crate) fn any(_: &Value) -> bool {
    true
}
pub(crate) fn falsy(v: &Value) -> bool {
    matches!(v, Value::Null | Value::Bool(false))
}
pub(crate) fn empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}
pub(crate) fn zero(v: &Value) -> bool {
    v.is_null() || v.as_f64() == Some(0.0)
}
pub(crate) fn one(v: &Value) -> bool {
    v.is_null() || v.as_f64() == Some(1.0)
}
pub(crate) fn truthy(v: &Value) -> bool {
    matches!(v, Value::Null | Value::Bool(true))
}
pub(crate) fn no_tool_choice(v: &Value) -> bool {
    matches!(v.as_str(), Some("none" | "auto")) || v.is_null()
}
pub(crate) fn text_modality(v: &Value) -> bool {
    v.is_null() || *v == Value::from(vec!["text"])
}
pub(crate) fn default_tier(v: &Value) -> bool {
    matches!(v.as_str(), Some("auto" | "default")) || v.is_null()
}

const STRUCTURED: &str = "this structured-output form is not supported; use response_format (json_object, json_schema) or, on /generate, sampling_params json_schema, regex or ebnf";
const LOGPROBS: &str = "log-probabilities of chosen token ids (`token_ids_logprob`) are not returned yet; `return_logprob` with `top_logprobs_num` is";
const LEGACY_FUNCTIONS: &str = "the legacy `functions` and `function_call` are not supported; declare `tools` and choose with `tool_choice`";
const SAMPLER: &str =
    "lockstep does not forward this sampling control yet; only its default value is accepted";
const SALT: &str = "lockstep sets the prefix-cache salt itself, from the caller's tenant";
const TRANSFER: &str =
    "lockstep sets the KV transfer parameters of both halves itself; a client cannot steer them";

/// Fields both OpenAI endpoints know beyond the ones they honour (OpenAI's, and the vLLM and
/// SGLang extensions clients send through `extra_body`).
const OPENAI: &[Known] = &[
    known("user", any, ""),
    known(
        "logit_bias",
        empty,
        "logit_bias is not applied by lockstep yet",
    ),
    known("cache_salt", null, SALT),
    known("kv_transfer_params", null, TRANSFER),
    known("guided_json", null, STRUCTURED),
    known("guided_regex", null, STRUCTURED),
    known("guided_choice", null, STRUCTURED),
    known("guided_grammar", null, STRUCTURED),
    known("structured_outputs", null, STRUCTURED),
    known("regex", null, STRUCTURED),
    known("ebnf", null, STRUCTURED),
    known("json_schema", null, STRUCTURED),
    known("min_p", zero, SAMPLER),
    known("repetition_penalty", one, SAMPLER),
    known("min_tokens", zero, SAMPLER),
    known("stop_token_ids", empty, SAMPLER),
    known("skip_special_tokens", truthy, SAMPLER),
    known("spaces_between_special_tokens", truthy, SAMPLER),
];

/// Fields of `/v1/chat/completions` beyond the ones it honours.
pub(crate) const CHAT: &[&[Known]] = &[
    OPENAI,
    &[
        known("metadata", any, ""),
        known("safety_identifier", any, ""),
        known("prompt_cache_key", any, ""),
        known(
            "store",
            falsy,
            "lockstep stores no completions; `store` must be false",
        ),
        known("functions", empty, LEGACY_FUNCTIONS),
        known("function_call", no_tool_choice, LEGACY_FUNCTIONS),
        known("modalities", text_modality, "only text output is supported"),
        known("audio", null, "audio output is not supported"),
        known("prediction", null, "predicted outputs are not supported"),
        known("web_search_options", null, "web search is not supported"),
        known(
            "reasoning_effort",
            null,
            "lockstep has no reasoning control for the model's template",
        ),
        known("verbosity", null, "verbosity is not supported"),
        known(
            "service_tier",
            default_tier,
            "lockstep has one service tier",
        ),
    ],
];

/// Fields of `/v1/completions` beyond the ones it honours.
pub(crate) const COMPLETIONS: &[&[Known]] = &[
    OPENAI,
    &[known(
        "suffix",
        null,
        "suffix (insertion) is not supported yet",
    )],
];

/// Top-level fields of SGLang's `/generate` beyond the ones it honours. The routing fields are
/// accepted and ignored: lockstep sets `rid` and `bootstrap_*` itself.
pub(crate) const GENERATE: &[&[Known]] = &[&[
    known("rid", any, ""),
    known("bootstrap_host", any, ""),
    known("bootstrap_port", any, ""),
    known("bootstrap_room", any, ""),
    known("token_ids_logprob", empty, LOGPROBS),
    known("log_metrics", any, ""),
    known(
        "return_hidden_states",
        falsy,
        "hidden states are not returned",
    ),
    known("image_data", empty, "multimodal input is not supported"),
    known("audio_data", empty, "multimodal input is not supported"),
    known("video_data", empty, "multimodal input is not supported"),
    known("lora_path", null, "LoRA adapters are not supported"),
    known(
        "custom_logit_processor",
        null,
        "custom logit processors are not supported",
    ),
    known("session_params", null, "sessions are not supported"),
    known("cache_salt", null, SALT),
]];

/// `sampling_params` keys of `/generate` beyond the ones it honours.
pub(crate) const GENERATE_SAMPLING: &[&[Known]] = &[&[
    known("regex", null, STRUCTURED),
    known("json_schema", null, STRUCTURED),
    known("ebnf", null, STRUCTURED),
    known("structural_tag", null, STRUCTURED),
    known("min_new_tokens", zero, SAMPLER),
    known("min_p", zero, SAMPLER),
    known("repetition_penalty", one, SAMPLER),
    known("stop_token_ids", empty, SAMPLER),
    known("no_stop_trim", falsy, SAMPLER),
    known("skip_special_tokens", truthy, SAMPLER),
    known("spaces_between_special_tokens", truthy, SAMPLER),
    known("logit_bias", empty, SAMPLER),
    known("custom_params", null, SAMPLER),
]];

/// Fields of one chat message beyond `role` and `content`.
pub(crate) const MESSAGE: &[&[Known]] = &[&[
    known(
        "name",
        null,
        "participant names are not rendered by the chat template",
    ),
    known(
        "function_call",
        null,
        "a message's legacy `function_call` is not supported; give its calls as `tool_calls`",
    ),
    known("refusal", null, "refusal messages are not supported"),
    known("audio", null, "audio is not supported"),
]];

/// Refuses the first field of `rest` that asks for something lockstep does not do: a known
/// field whose value is not a no-op, or a field lockstep does not know. `at` prefixes the
/// field's name in `param` (e.g. `sampling_params.`).
pub(crate) fn refuse_unhonoured(
    table: &[&[Known]],
    rest: &Map<String, Value>,
    at: &str,
) -> Result<(), LockstepError> {
    for (name, value) in rest {
        let param = format!("{at}{name}");
        let message = match table.iter().flat_map(|t| t.iter()).find(|k| k.name == name) {
            Some(k) if (k.noop)(value) => continue,
            Some(k) => format!("`{param}`: {}", k.why),
            None => format!(
                "`{param}` is not a field lockstep knows, so it cannot honour it; remove it (lockstep never drops a field silently)"
            ),
        };
        return Err(LockstepError::Unsupported {
            message,
            param: Some(param),
        });
    }
    Ok(())
}

/// Takes OpenAI's `response_format` out of `rest`: nothing for `text` (or absent), else the
/// constraint, refused where the model's backend cannot enforce it.
pub(crate) fn response_format(
    rest: &mut Map<String, Value>,
    backend: BackendKind,
) -> Result<Option<Constraint>, LockstepError> {
    match rest.remove("response_format").filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(rf) => format_constraint(&rf, "response_format", "/json_schema/schema", backend),
    }
}

/// The constraint a structured-output format asks for (`{"type": "text" | "json_object" |
/// "json_schema", ...}`, the schema at `schema_at`: chat's `response_format` nests it under
/// `json_schema`, the Responses API's `text.format` holds it directly); `param` names the field
/// in errors.
pub(crate) fn format_constraint(
    format: &Value,
    param: &str,
    schema_at: &str,
    backend: BackendKind,
) -> Result<Option<Constraint>, LockstepError> {
    let invalid = |message: String| LockstepError::InvalidRequest {
        message,
        param: Some(param.into()),
    };
    let c = match format.get("type").and_then(Value::as_str) {
        Some("text") => return Ok(None),
        Some("json_object") => Constraint::JsonObject,
        Some("json_schema") => {
            let schema = format
                .pointer(schema_at)
                .filter(|s| s.is_object() || s.is_boolean())
                .ok_or_else(|| {
                    invalid(format!(
                        "`{param}{}` must be a JSON schema object",
                        schema_at.replace('/', ".")
                    ))
                })?;
            Constraint::JsonSchema(schema.to_string())
        }
        Some(other) => {
            return Err(LockstepError::Unsupported {
                message: format!(
                    "`{param}` type `{other}` is not supported (text, json_object, json_schema)"
                ),
                param: Some(param.into()),
            });
        }
        None => return Err(invalid(format!("`{param}.type` is required"))),
    };
    enforceable(c, param, backend).map(Some)
}

/// The longest schema, regular expression or grammar lockstep accepts, in bytes, for any
/// backend (what it passes to SGLang and vLLM too): their compilation grows with the text.
pub(crate) const MAX_CONSTRAINT_BYTES: usize = 32 * 1024;

/// Refuses a constraint whose text is over [`MAX_CONSTRAINT_BYTES`].
pub(crate) fn within_cap(c: &Constraint, param: &str) -> Result<(), LockstepError> {
    let n = match c {
        Constraint::JsonObject => 0,
        Constraint::JsonSchema(t)
        | Constraint::Regex(t)
        | Constraint::Ebnf(t)
        | Constraint::Lark(t) => t.len(),
    };
    if n > MAX_CONSTRAINT_BYTES {
        return Err(LockstepError::InvalidRequest {
            message: format!(
                "`{param}` is {n} bytes; schemas, regular expressions and grammars are at most {MAX_CONSTRAINT_BYTES}"
            ),
            param: Some(param.into()),
        });
    }
    Ok(())
}

/// Takes SGLang's `json_schema`, `regex` and `ebnf` out of `/generate`'s `sampling_params`:
/// at most one, refused where the model's backend cannot enforce it.
pub(crate) fn native_constraint(
    rest: &mut Map<String, Value>,
    backend: BackendKind,
) -> Result<Option<Constraint>, LockstepError> {
    let mut found = None;
    for key in ["json_schema", "regex", "ebnf"] {
        let Some(v) = rest.remove(key).filter(|v| !v.is_null()) else {
            continue;
        };
        let param = format!("sampling_params.{key}");
        let bad = |message: String| LockstepError::InvalidRequest {
            message,
            param: Some(param.clone()),
        };
        let text = v
            .as_str()
            .ok_or_else(|| bad(format!("`{param}` must be a string")))?
            .to_string();
        let c = match key {
            "json_schema" => {
                serde_json::from_str::<Value>(&text)
                    .map_err(|e| bad(format!("`{param}` is not JSON: {e}")))?;
                Constraint::JsonSchema(text)
            }
            "regex" => Constraint::Regex(text),
            _ => Constraint::Ebnf(text),
        };
        if found.is_some() {
            return Err(bad(
                "give one of json_schema, regex and ebnf, not several".into()
            ));
        }
        found = Some(enforceable(c, &param, backend)?);
    }
    Ok(found)
}

/// `c`, if the backend's workers enforce it: SGLang and vLLM natively (their grammar backends
/// judge it), lockstep's engine and workers through `llguidance`, where it is compiled here first
/// so a malformed one is a 400 before any worker sees it. Otherwise a 400: answering free text
/// to a request for JSON would be failing open.
fn enforceable(
    c: Constraint,
    param: &str,
    backend: BackendKind,
) -> Result<Constraint, LockstepError> {
    within_cap(&c, param)?;
    match backend {
        BackendKind::Sglang | BackendKind::Vllm => Ok(c),
        own => match c.for_engine() {
            Some(oc) => match lockstep_engine::grammar::check(&oc) {
                Ok(()) => Ok(c),
                Err(m) => Err(LockstepError::InvalidRequest {
                    message: format!("`{param}`: {m}"),
                    param: Some(param.into()),
                }),
            },
            None => Err(LockstepError::Unsupported {
                message: format!(
                    "`{param}`: the {} backend enforces JSON schemas and regular expressions; EBNF grammars are enforced by SGLang workers",
                    own.as_str()
                ),
                param: Some(param.into()),
            }),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(table: &[&[Known]], v: Value) -> Result<(), String> {
        let rest = v.as_object().cloned().unwrap_or_default();
        refuse_unhonoured(table, &rest, "").map_err(|e| match e {
            LockstepError::Unsupported { param, .. } => param.unwrap_or_default(),
            other => panic!("{other:?}"),
        })
    }

    #[test]
    fn no_op_values_pass_and_the_rest_is_refused_by_name() {
        for ok in [
            json!({"user": "u1", "function_call": "none", "store": false, "repetition_penalty": 1.0}),
            json!({}),
        ] {
            assert_eq!(check(CHAT, ok.clone()), Ok(()), "{ok}");
        }
        for (bad, param) in [
            (
                json!({"functions": [{"name": "f", "parameters": {}}]}),
                "functions",
            ),
            (json!({"function_call": {"name": "f"}}), "function_call"),
            (json!({"store": true}), "store"),
            (json!({"logit_bias": {"5": 10}}), "logit_bias"),
            (json!({"repetition_penalty": 1.3}), "repetition_penalty"),
            (json!({"cache_salt": "mine"}), "cache_salt"),
            (json!({"temprature": 0.5}), "temprature"),
        ] {
            assert_eq!(check(CHAT, bad.clone()), Err(param.to_string()), "{bad}");
        }
        assert_eq!(
            check(GENERATE, json!({"rid": "x", "bootstrap_room": 5})),
            Ok(())
        );
        assert_eq!(
            check(GENERATE, json!({"token_ids_logprob": [5]})),
            Err("token_ids_logprob".into())
        );
        assert_eq!(
            check(GENERATE_SAMPLING, json!({"regex": "a+"})),
            Err("regex".into())
        );
        assert_eq!(
            check(COMPLETIONS, json!({"suffix": "x"})),
            Err("suffix".into())
        );
        assert_eq!(check(MESSAGE, json!({"name": "bob"})), Err("name".into()));
    }

    #[test]
    fn each_no_op_predicate_takes_exactly_its_no_op_values() {
        let vals = [
            json!(null),
            json!(false),
            json!(true),
            json!(0),
            json!(1),
            json!([]),
            json!(["x"]),
            json!({}),
            json!({"a": 1}),
            json!("auto"),
            json!("default"),
            json!("none"),
            json!("flex"),
            json!(["text"]),
            json!(["text", "audio"]),
        ];
        let takes = |f: fn(&Value) -> bool| -> Vec<String> {
            vals.iter().filter(|v| f(v)).map(Value::to_string).collect()
        };
        assert_eq!(takes(null), ["null"]);
        assert_eq!(takes(falsy), ["null", "false"]);
        assert_eq!(takes(truthy), ["null", "true"]);
        assert_eq!(takes(empty), ["null", "[]", "{}"]);
        assert_eq!(takes(zero), ["null", "0"]);
        assert_eq!(takes(one), ["null", "1"]);
        assert_eq!(takes(no_tool_choice), ["null", "\"auto\"", "\"none\""]);
        assert_eq!(takes(text_modality), ["null", "[\"text\"]"]);
        assert_eq!(takes(default_tier), ["null", "\"auto\"", "\"default\""]);
        assert_eq!(takes(any).len(), vals.len());
    }

    #[test]
    fn structured_output_fields_become_the_constraint_they_name() {
        let take = |v: Value| {
            let mut rest = v.as_object().cloned().unwrap_or_default();
            let c = response_format(&mut rest, BackendKind::Sglang).map_err(|e| e.to_string());
            assert!(
                !rest.contains_key("response_format"),
                "taken out of the rest"
            );
            c
        };
        assert_eq!(take(json!({})), Ok(None));
        assert_eq!(take(json!({"response_format": null})), Ok(None));
        assert_eq!(take(json!({"response_format": {"type": "text"}})), Ok(None));
        assert_eq!(
            take(json!({"response_format": {"type": "json_object"}})),
            Ok(Some(Constraint::JsonObject))
        );
        assert_eq!(
            take(
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string"}}}})
            ),
            Ok(Some(Constraint::JsonSchema(r#"{"type":"string"}"#.into())))
        );
        assert!(
            take(json!({"response_format": {"type": "json_schema", "json_schema": {}}})).is_err()
        );
        // A boolean schema is a schema too (JSON Schema's `true`: anything).
        assert_eq!(
            take(
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": true}}})
            ),
            Ok(Some(Constraint::JsonSchema("true".into())))
        );
        let native = |v: Value| {
            let mut rest = v.as_object().cloned().unwrap_or_default();
            native_constraint(&mut rest, BackendKind::Sglang).map_err(|e| e.to_string())
        };
        assert_eq!(native(json!({"regex": null})), Ok(None));
        assert_eq!(
            native(json!({"regex": "a+"})),
            Ok(Some(Constraint::Regex("a+".into())))
        );
        assert_eq!(
            native(json!({"json_schema": "{\"type\":\"object\"}"})),
            Ok(Some(Constraint::JsonSchema("{\"type\":\"object\"}".into())))
        );
        assert_eq!(
            native(json!({"ebnf": "root ::= \"a\""})),
            Ok(Some(Constraint::Ebnf("root ::= \"a\"".into())))
        );
        assert!(native(json!({"json_schema": "not json"})).is_err());
        assert!(native(json!({"regex": "a", "ebnf": "b"})).is_err());
    }

    #[test]
    fn the_constraint_cap_is_inclusive_at_its_limit() {
        let at = |n: usize| within_cap(&Constraint::Regex("a".repeat(n)), "regex");
        assert!(at(MAX_CONSTRAINT_BYTES).is_ok());
        assert!(at(MAX_CONSTRAINT_BYTES - 1).is_ok());
        assert!(at(0).is_ok());
        let e = at(MAX_CONSTRAINT_BYTES + 1).expect_err("over the cap");
        assert!(
            matches!(&e, LockstepError::InvalidRequest { param: Some(p), .. } if p == "regex"),
            "{e:?}"
        );
        assert!(within_cap(&Constraint::JsonObject, "x").is_ok());
        assert_eq!(MAX_CONSTRAINT_BYTES, 32 * 1024);
    }
}

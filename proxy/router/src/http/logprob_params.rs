//! What a request asks of log-probabilities, in each front end's own fields: chat's `logprobs` and
//! `top_logprobs`, completions' `logprobs`, the Responses API's `include` and `top_logprobs`,
//! SGLang's `return_logprob` family, gRPC's `SamplingParams.logprobs`. Each is bounded (0 to 20
//! alternatives). Every backend returns them (lockstep's engine and workers natively, SGLang and
//! vLLM passed through), and the answer checks one entry per delivered token.

use serde_json::{Map, Value};

use crate::backend::MAX_TOP_LOGPROBS;
use lockstep_core::error::LockstepError;

/// A `0..=20` count of top log-probabilities at `param` (`None` when absent or null).
fn top_count(rest: &mut Map<String, Value>, param: &str) -> Result<Option<u32>, LockstepError> {
    match rest.remove(param) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(k) if k <= MAX_TOP_LOGPROBS as u64 => Ok(Some(k as u32)),
            _ => Err(LockstepError::InvalidRequest {
                message: format!(
                    "`{param}` must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {v}"
                ),
                param: Some(param.into()),
            }),
        },
    }
}

/// Chat's `logprobs` (a boolean) and `top_logprobs` (0 to 20, only with `logprobs: true`, as
/// OpenAI and vLLM require): how many top alternatives each token lists, `None` for none.
pub(crate) fn chat_logprobs(rest: &mut Map<String, Value>) -> Result<Option<u32>, LockstepError> {
    let on = match rest.remove("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(v) => {
            return Err(LockstepError::InvalidRequest {
                message: format!("`logprobs` is a boolean on chat completions, got {v}"),
                param: Some("logprobs".into()),
            });
        }
    };
    switched_top(rest, on, "`logprobs: true`")
}

/// `top_logprobs` (0 to 20) of a request whose `switch` field turns log-probabilities `on`: the
/// top count, `None` when off; a top count above 0 while off is a 400 saying what it `needs`.
fn switched_top(
    rest: &mut Map<String, Value>,
    on: bool,
    needs: &str,
) -> Result<Option<u32>, LockstepError> {
    let top = top_count(rest, "top_logprobs")?;
    if !on {
        return match top {
            Some(k) if k > 0 => Err(LockstepError::InvalidRequest {
                message: format!("`top_logprobs` needs {needs}"),
                param: Some("top_logprobs".into()),
            }),
            _ => Ok(None),
        };
    }
    Ok(Some(top.unwrap_or(0)))
}

/// gRPC's `SamplingParams.logprobs` (set: 0 to 20 alternatives per token).
pub(crate) fn grpc_logprobs(k: u32) -> Result<u32, LockstepError> {
    if k as usize > MAX_TOP_LOGPROBS {
        return Err(LockstepError::InvalidRequest {
            message: format!("`logprobs` must be from 0 to {MAX_TOP_LOGPROBS}, got {k}"),
            param: Some("logprobs".into()),
        });
    }
    Ok(k)
}

/// Completions' `logprobs`: an integer 0 to 20, the top alternatives each token lists besides
/// itself (`None` when absent or null).
pub(crate) fn completion_logprobs(
    rest: &mut Map<String, Value>,
) -> Result<Option<u32>, LockstepError> {
    top_count(rest, "logprobs")
}

/// The Responses API's `include` (only `message.output_text.logprobs` is produced; anything
/// else is refused by name) and `top_logprobs` (0 to 20, only with that `include`): how many
/// top alternatives each token lists, `None` for no log-probabilities.
pub(crate) fn responses_logprobs(
    rest: &mut Map<String, Value>,
) -> Result<Option<u32>, LockstepError> {
    const LOGPROBS: &str = "message.output_text.logprobs";
    let on = match rest.remove("include") {
        None | Some(Value::Null) => false,
        Some(Value::Array(items)) => {
            if let Some(other) = items.iter().find(|i| i.as_str() != Some(LOGPROBS)) {
                return Err(LockstepError::Unsupported {
                    message: format!(
                        "`include` asks for {other}, which lockstep does not produce; it produces `{LOGPROBS}`"
                    ),
                    param: Some("include".into()),
                });
            }
            !items.is_empty()
        }
        Some(v) => {
            return Err(LockstepError::InvalidRequest {
                message: format!("`include` is a list of strings, got {v}"),
                param: Some("include".into()),
            });
        }
    };
    switched_top(rest, on, &format!("`include: [\"{LOGPROBS}\"]`"))
}

/// `/generate`'s `return_logprob`, `top_logprobs_num` (0 to 20), `logprob_start_len` and
/// `return_text_in_logprobs`, as SGLang reads them: the top count (`None`: no log-probabilities)
/// and whether entries carry token texts. SGLang reads the others only with `return_logprob`, so
/// without it they ask for nothing. A `logprob_start_len` inside the prompt asks for the prompt's
/// log-probabilities, which lockstep does not compute yet: a 400, never an empty list.
/// SGLang's `return_logprob` family: the top count (`None`: not asked), whether entries carry
/// token texts, and `logprob_start_len` (`Some`: the prompt's entries from that position).
pub(crate) fn generate_logprobs(
    rest: &mut Map<String, Value>,
) -> Result<(Option<u32>, bool, Option<usize>), LockstepError> {
    let flag = |rest: &mut Map<String, Value>, k: &str| match rest.remove(k) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(b),
        Some(v) => Err(LockstepError::InvalidRequest {
            message: format!("`{k}` is a boolean, got {v}"),
            param: Some(k.into()),
        }),
    };
    let on = flag(rest, "return_logprob")?;
    let text = flag(rest, "return_text_in_logprobs")?;
    let top = top_count(rest, "top_logprobs_num")?;
    let start = rest.remove("logprob_start_len").filter(|v| !v.is_null());
    if !on {
        return Ok((None, false, None));
    }
    let start = match start.as_ref().map(|v| v.as_i64()) {
        None | Some(Some(-1)) => None,
        Some(Some(s)) if s >= 0 => Some(s as usize),
        _ => {
            return Err(LockstepError::InvalidRequest {
                message: "`logprob_start_len` is -1 (the output's only) or a prompt position"
                    .into(),
                param: Some("logprob_start_len".into()),
            });
        }
    };
    Ok((Some(top.unwrap_or(0)), text, start))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn logprobs_are_read_bounded_and_checked() {
        let chat = |v: Value| {
            let mut rest = v.as_object().cloned().unwrap_or_default();
            let got = chat_logprobs(&mut rest);
            assert!(
                !rest.contains_key("logprobs") && !rest.contains_key("top_logprobs"),
                "taken"
            );
            got.map_err(|e| (e.code(), e.to_string()))
        };
        assert_eq!(chat(json!({})), Ok(None));
        assert_eq!(
            chat(json!({"logprobs": false, "top_logprobs": 0})),
            Ok(None)
        );
        assert_eq!(chat(json!({"logprobs": true})), Ok(Some(0)));
        assert_eq!(
            chat(json!({"logprobs": true, "top_logprobs": 20})),
            Ok(Some(20))
        );
        for bad in [
            json!({"logprobs": true, "top_logprobs": 21}),
            json!({"logprobs": true, "top_logprobs": -1}),
            json!({"logprobs": true, "top_logprobs": 2.5}),
            json!({"logprobs": 1}),
            json!({"top_logprobs": 2}),
        ] {
            let e = chat(bad.clone()).expect_err("refused");
            assert_eq!(e.0, "invalid_request", "{bad}: {e:?}");
        }
        let completion = |v: Value| {
            let mut rest = v.as_object().cloned().unwrap_or_default();
            completion_logprobs(&mut rest).map_err(|e| e.code())
        };
        assert_eq!(completion(json!({"logprobs": 0})), Ok(Some(0)));
        assert_eq!(completion(json!({"logprobs": 5})), Ok(Some(5)));
        assert_eq!(completion(json!({"logprobs": null})), Ok(None));
        assert_eq!(
            completion(json!({"logprobs": true})),
            Err("invalid_request")
        );
        assert_eq!(completion(json!({"logprobs": 21})), Err("invalid_request"));
        let responses = |v: Value| {
            let mut rest = v.as_object().cloned().unwrap_or_default();
            responses_logprobs(&mut rest).map_err(|e| e.code())
        };
        let include = json!(["message.output_text.logprobs"]);
        assert_eq!(responses(json!({"include": []})), Ok(None));
        assert_eq!(responses(json!({"include": include})), Ok(Some(0)));
        assert_eq!(
            responses(json!({"include": include, "top_logprobs": 3})),
            Ok(Some(3))
        );
        assert_eq!(
            responses(json!({"top_logprobs": 3})),
            Err("invalid_request")
        );
        assert_eq!(
            responses(json!({"include": ["file_search_call.results"]})),
            Err("unsupported")
        );
        assert_eq!(
            responses(json!({"include": "message.output_text.logprobs"})),
            Err("invalid_request")
        );
        let generate = |v: Value| {
            let mut rest = v.as_object().cloned().unwrap_or_default();
            let got = generate_logprobs(&mut rest).map_err(|e| e.code());
            assert!(rest.is_empty(), "every logprob field taken: {rest:?}");
            got
        };
        assert_eq!(generate(json!({})), Ok((None, false, None)));
        // Read by SGLang only with `return_logprob`: without it, nothing is asked.
        assert_eq!(
            generate(json!({"top_logprobs_num": 3, "logprob_start_len": 0})),
            Ok((None, false, None))
        );
        assert_eq!(
            generate(json!({"return_logprob": true, "logprob_start_len": -1})),
            Ok((Some(0), false, None))
        );
        assert_eq!(
            generate(
                json!({"return_logprob": true, "top_logprobs_num": 5, "return_text_in_logprobs": true})
            ),
            Ok((Some(5), true, None))
        );
        for (bad, code) in [
            (
                json!({"return_logprob": true, "logprob_start_len": -2}),
                "invalid_request",
            ),
            (
                json!({"return_logprob": true, "logprob_start_len": "a"}),
                "invalid_request",
            ),
            (
                json!({"return_logprob": true, "top_logprobs_num": 21}),
                "invalid_request",
            ),
            (json!({"return_logprob": "yes"}), "invalid_request"),
        ] {
            assert_eq!(generate(bad.clone()), Err(code), "{bad}");
        }
        assert_eq!(
            generate(json!({"return_logprob": true, "logprob_start_len": 3})),
            Ok((Some(0), false, Some(3)))
        );
        assert_eq!(grpc_logprobs(20).map_err(|e| e.code()), Ok(20));
        assert_eq!(
            grpc_logprobs(21).map_err(|e| e.code()),
            Err("invalid_request")
        );
    }
}

//! Entry points for the fuzz targets (`fuzz/`, run by `bench/fuzz.sh`) and for the replay of their
//! corpora under `cargo test` (`tests/tests/fuzz_replay.rs`): each feeds untrusted bytes to one of
//! the router's parsers the way the server does, and must return, whatever the bytes. Not an API.

use std::sync::Arc;

use bytes::Bytes;
use serde_json::Value;

use crate::admission::{Caller, admit};
use crate::backend::Side;
use crate::state::AppState;

/// A request body through the whole admission stage of `state` (parse, field pass, model,
/// template, tokenize, fit): the first byte picks the route (chat, completions, `/generate`).
pub async fn admission(state: &Arc<AppState>, data: &[u8]) {
    use crate::http::{generate::GenerateRequest, openai::ChatRequest, openai::CompletionRequest};
    let Some((&route, body)) = data.split_first() else {
        return;
    };
    let caller = || anonymous(state);
    match route % 3 {
        0 => {
            if let Ok(r) = serde_json::from_slice::<ChatRequest>(body) {
                let _ = admit(state, caller(), r).await;
            }
        }
        1 => {
            if let Ok(r) = serde_json::from_slice::<CompletionRequest>(body) {
                let _ = admit(state, caller(), r).await;
            }
        }
        _ => {
            if let Ok(r) = serde_json::from_slice::<GenerateRequest>(body) {
                let _ = admit(state, caller(), r).await;
            }
        }
    }
}

/// A body through the whole admission stage of `state` as `/v1/responses` reads it: parse,
/// input items, tools and their history, template, tokenize, fit.
pub async fn responses(state: &Arc<AppState>, data: &[u8]) {
    if let Ok(r) = serde_json::from_slice::<crate::http::responses::ResponsesRequest>(data) {
        let _ = admit(state, anonymous(state), r).await;
    }
}

/// A body through the whole admission stage of `state` as `/v1/messages` reads it.
pub async fn messages(state: &Arc<AppState>, data: &[u8]) {
    if let Ok(r) = serde_json::from_slice::<crate::http::anthropic::MessagesRequest>(data) {
        let _ = admit(state, anonymous(state), r).await;
    }
}

/// A caller of a server without tenants.
fn anonymous(state: &AppState) -> Caller {
    Caller {
        catalog: state.models.load_full(),
        tenant: None,
        permit: lockstep_tenancy::tenant::Held::default(),
        role_data: None,
    }
}

/// A model's output through the tool-call parsers: the first byte picks the parser, the rest is
/// the text, cut into stream deltas at 0xFF bytes (lossily decoded). Whatever they return, every
/// call names a declared function and carries JSON arguments, and the streamed reading (the
/// deltas one by one) finds the same calls as the whole text.
pub fn tool_output(data: &[u8]) {
    use crate::http::tools::{ToolParse, ToolStream, parse};
    use lockstep_core::config::ToolParserKind;
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let kind = [
        ToolParserKind::Hermes,
        ToolParserKind::Qwen,
        ToolParserKind::Llama3Json,
        ToolParserKind::Mistral,
        ToolParserKind::Generic,
    ][usize::from(pick % 5)];
    let tools = ToolParse {
        kind,
        names: vec!["get_weather".to_string(), "a".into(), "f".into()].into(),
        one_call: pick & 0x80 != 0,
    };
    let deltas: Vec<String> = rest
        .split(|b| *b == 0xFF)
        .map(|d| String::from_utf8_lossy(d).into_owned())
        .collect();
    let whole: String = deltas.concat();
    let mut stream = ToolStream::new(tools.clone());
    let mut sent = String::new();
    for d in &deltas {
        sent.push_str(&stream.push(d));
    }
    let (tail, calls) = stream.finish();
    for c in &calls {
        assert!(tools.names.contains(&c.name), "an undeclared call: {c:?}");
        assert!(
            serde_json::from_str::<Value>(&c.arguments).is_ok(),
            "arguments that are not JSON: {c:?}"
        );
    }
    match parse(&tools, &whole) {
        Some((_, whole_calls)) if whole.starts_with(sent.as_str()) => {
            assert_eq!(calls, whole_calls, "streamed and whole readings differ");
        }
        Some(_) => {}
        None => {
            assert!(
                calls.is_empty(),
                "calls found only when streamed: {calls:?}"
            );
            assert_eq!(format!("{sent}{tail}"), whole, "text lost or changed");
        }
    }
}

/// Output constraints as a front end receives them, through the checks admission runs (size caps,
/// then compilation): the first byte picks a JSON schema, a regular expression or a Lark grammar,
/// the rest is its text. Must return within the fuzzer's time limit, whatever the text.
pub fn grammar(data: &[u8]) {
    use lockstep_engine::grammar::{OutputConstraint, check};
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest).into_owned();
    let c = match pick % 3 {
        0 => OutputConstraint::JsonSchema(text),
        1 => OutputConstraint::Regex(text),
        _ => OutputConstraint::Lark(text),
    };
    let _ = check(&c);
}

/// An upstream's SSE body, cut into frames at every 0xFF byte, read event by event to its end.
pub async fn sse(data: &[u8]) {
    use http_body_util::StreamBody;
    let frames: Vec<Result<hyper::body::Frame<Bytes>, std::io::Error>> = data
        .split(|b| *b == 0xFF)
        .map(|f| Ok(hyper::body::Frame::data(Bytes::copy_from_slice(f))))
        .collect();
    let mut r = crate::backend::sse::SseReader::new(
        StreamBody::new(futures_util::stream::iter(frames)),
        Side::Decode,
    );
    for _ in 0..10_000 {
        match r.next_data().await {
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => return,
        }
    }
}

/// An upstream's JSON answer through every SGLang and vLLM response check, and its text through
/// the vLLM `/metrics` label reader.
pub fn upstream_json(data: &[u8]) {
    use crate::backend::{sglang, sglang_answer, vllm, vllm_check};
    let _ = sglang::error_message(data);
    if let Ok(a) = sglang_answer::Answer::parse(Side::Decode, data, "fuzz") {
        for side in [Side::Prefill, Side::Decode] {
            let _ = sglang::inspect(side, &a);
        }
        let _ = sglang::prefill_report(&a, "0000000000000000001");
    }
    if let Ok(v) = serde_json::from_slice::<Value>(data) {
        for side in [Side::Prefill, Side::Decode] {
            let _ = vllm::finish_of(side, &v);
        }
        let _ = vllm::error_in(&v);
        let _ = vllm::usage(&v, "prompt_tokens");
    }
    for line in String::from_utf8_lossy(data).lines() {
        let _ = vllm_check::label(line, "block_size");
    }
}

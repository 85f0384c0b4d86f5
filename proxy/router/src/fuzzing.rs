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
    let caller = || Caller {
        catalog: state.models.load_full(),
        tenant: None,
        permit: None,
    };
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
    use crate::backend::{sglang, sglang_answer, vllm, vllm_probe};
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
        let _ = vllm_probe::label(line, "block_size");
    }
}

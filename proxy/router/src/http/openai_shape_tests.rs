//! Tests of the OpenAI and SGLang-native answer shapes, and of the committed chunks they read.

use super::super::respond::committed_chunks;
use super::*;
use futures_util::StreamExt;
use lockstep_core::config::ToolParserKind;

use crate::pair::{PairEvent, PairId};
use lockstep_core::error::LockstepError;

/// Hermes calls to the one declared tool, `get_weather`.
fn hermes() -> tools::ToolParse {
    tools::ToolParse {
        kind: ToolParserKind::Hermes,
        names: vec!["get_weather".to_string()].into(),
        one_call: false,
    }
}

fn progress(matched: Option<&str>) -> Progress {
    Progress {
        model: "m".into(),
        pair_id: PairId::from_raw(42),
        prompt_tokens: 7,
        cached_tokens: 2,
        created: 1,
        text: "a \"quoted\"\n é".into(),
        completion_tokens: 3,
        matched_stop: matched.map(str::to_owned),
        logprobs: Vec::new(),
        prompt: (Vec::new(), Vec::new()),
    }
}

/// The native answer is written straight from the progress; it must be SGLang's shape,
/// key for key and in SGLang's order, for every finish.
#[test]
fn the_native_answer_is_sglangs_shape() {
    let shape = OpenAiShape::generate(false);
    let id = PairId::from_raw(42).to_string();
    for (finish, matched, want) in [
        (
            FinishReason::Length,
            None,
            json!({ "type": "length", "length": 3 }),
        ),
        (FinishReason::Stop, None, json!({ "type": "stop" })),
        (
            FinishReason::Stop,
            Some("</s>"),
            json!({ "type": "stop", "matched": "</s>" }),
        ),
    ] {
        let p = progress(matched);
        let want = json!({ "text": "a \"quoted\"\n é", "meta_info": {
            "id": id, "finish_reason": want, "prompt_tokens": 7, "completion_tokens": 3,
            "cached_tokens": 2 } });
        let written = shape.full_json(&p, finish).expect("written");
        assert_eq!(
            String::from_utf8(written).expect("utf-8"),
            want.to_string(),
            "{finish:?} {matched:?}"
        );
        assert_eq!(shape.full(&p, finish), want);
    }
}

fn chunk(delta: &str, finish: Option<FinishReason>, completion_tokens: u64) -> DecodeChunk {
    DecodeChunk {
        delta: delta.into(),
        token_ids: Vec::new(),
        prompt_tokens: None,
        kv_digest: None,
        completion_tokens,
        finish,
        matched_stop: None,
        logprobs: Vec::new(),
        prompt_logprobs: None,
    }
}

/// The `data:` payloads of an SSE body (none for a chunk that sends nothing), each event
/// checked to be one `data:` line.
fn events(body: &[u8]) -> Vec<String> {
    let text = std::str::from_utf8(body).expect("utf-8");
    assert!(text.is_empty() || text.ends_with("\n\n"), "{text:?}");
    text.split_terminator("\n\n")
        .map(|e| e.strip_prefix("data: ").expect("a data event").to_string())
        .collect()
}

/// A stream through `shape`: each chunk absorbed into the progress, then rendered.
fn stream(shape: &mut OpenAiShape, chunks: &[DecodeChunk]) -> Vec<String> {
    let mut p = progress(None);
    p.text.clear();
    p.completion_tokens = 0;
    chunks
        .iter()
        .flat_map(|c| {
            p.absorb(c);
            events(&shape.chunk(&p, c))
        })
        .collect()
}

/// Chat stream chunks, byte for byte: OpenAI's keys in OpenAI's order, the text escaped, the
/// role first, an empty chunk silent, the finish alone, usage last when asked.
#[test]
fn chat_stream_chunks_are_openais_shape_byte_for_byte() {
    let pair = PairId::from_raw(42);
    let head = format!(
        r#"{{"id":"chatcmpl-{pair}","object":"chat.completion.chunk","created":1,"model":"m","#
    );
    let choice = |delta: &str, finish: &str| {
        format!(
            r#"{head}"choices":[{{"index":0,"delta":{delta},"logprobs":null,"finish_reason":{finish}}}]}}"#
        )
    };
    let usage = r#""usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9,"prompt_tokens_details":{"cached_tokens":2}}"#;
    let chunks = [
        chunk("Hel", None, 1),
        chunk("", None, 1),
        chunk("lo \"x\"\n\u{e9}", Some(FinishReason::Stop), 2),
    ];
    for include_usage in [false, true] {
        let got = stream(&mut OpenAiShape::chat(true, include_usage), &chunks);
        let mut want = vec![
            choice(r#"{"role":"assistant","content":""}"#, "null"),
            choice(r#"{"content":"Hel"}"#, "null"),
            choice(
                r#"{"content":"lo \"x\"\n\u00e9"}"#.replace("\\u00e9", "\u{e9}").as_str(),
                "null",
            ),
            choice("{}", r#""stop""#),
        ];
        if include_usage {
            want.push(format!(r#"{head}"choices":[],{usage}}}"#));
        }
        want.push("[DONE]".into());
        assert_eq!(got, want, "include_usage {include_usage}");
    }
    // A stream cut by length says so.
    let got = stream(
        &mut OpenAiShape::chat(true, false),
        &[chunk("a", Some(FinishReason::Length), 1)],
    );
    assert_eq!(got[2], choice("{}", r#""length""#));
}

#[test]
fn completion_stream_chunks_are_openais_shape_byte_for_byte() {
    let pair = PairId::from_raw(42);
    let head =
        format!(r#"{{"id":"cmpl-{pair}","object":"text_completion","created":1,"model":"m","#);
    let choice = |text: &str, finish: &str| {
        format!(
            r#"{head}"choices":[{{"index":0,"text":"{text}","logprobs":null,"finish_reason":{finish}}}]}}"#
        )
    };
    let got = stream(
        &mut OpenAiShape::completion(true, true),
        &[
            chunk("", None, 0),
            chunk("one", None, 1),
            chunk("", Some(FinishReason::Length), 2),
        ],
    );
    let usage = r#""usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9,"prompt_tokens_details":{"cached_tokens":2}}"#;
    assert_eq!(
        got,
        [
            choice("one", "null"),
            choice("", r#""length""#),
            format!(r#"{head}"choices":[],{usage}}}"#),
            "[DONE]".to_string(),
        ]
    );
}

/// The typed answers are what their `Value` forms say, byte for byte, with and without tool
/// calls (those are written from the value).
#[test]
fn full_answers_written_directly_match_their_values() {
    let calls = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    for (shape, text) in [
        (OpenAiShape::chat(false, false), "a \"quoted\"\n é"),
        (OpenAiShape::completion(false, false), "a \"quoted\"\n é"),
        (
            OpenAiShape::chat(false, false).with_tools(Some(hermes())),
            "no calls here",
        ),
        (
            OpenAiShape::chat(false, false).with_tools(Some(hermes())),
            calls,
        ),
    ] {
        for finish in [FinishReason::Stop, FinishReason::Length] {
            let mut p = progress(None);
            p.text = text.into();
            let written = shape.full_json(&p, finish).expect("written");
            let value = shape.full(&p, finish);
            assert_eq!(
                String::from_utf8(written).expect("utf-8"),
                value.to_string(),
                "{shape:?} {finish:?}"
            );
        }
    }
    let mut p = progress(None);
    p.text = calls.into();
    let shape = OpenAiShape::chat(false, false).with_tools(Some(hermes()));
    let v = shape.full(&p, FinishReason::Stop);
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(v["choices"][0]["message"]["content"], "Let me check.");
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );
    let id = format!("chatcmpl-{}", PairId::from_raw(42));
    let plain = OpenAiShape::chat(false, false).full_json(&progress(None), FinishReason::Stop);
    assert_eq!(
        String::from_utf8(plain.expect("written")).expect("utf-8"),
        format!(
            r#"{{"id":"{id}","object":"chat.completion","created":1,"model":"m","choices":[{{"index":0,"message":{{"role":"assistant","content":"a \"quoted\"\n é"}},"logprobs":null,"finish_reason":"stop"}}],"usage":{{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10,"prompt_tokens_details":{{"cached_tokens":2}}}}}}"#
        )
    );
}

/// A streamed tool call: the text before it, then the call (with its index), then the finish
/// as `tool_calls`.
#[test]
fn a_streamed_tool_call_comes_as_its_own_delta() {
    let mut shape = OpenAiShape::chat(true, false).with_tools(Some(hermes()));
    let got = stream(
        &mut shape,
        &[
            chunk(
                "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", ",
                None,
                1,
            ),
            chunk(
                "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
                Some(FinishReason::Stop),
                2,
            ),
        ],
    );
    let v: Vec<Value> = got[..got.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("json"))
        .collect();
    let deltas: Vec<&Value> = v.iter().map(|e| &e["choices"][0]["delta"]).collect();
    assert_eq!(deltas[0], &json!({ "role": "assistant", "content": "" }));
    let text: String = deltas
        .iter()
        .filter_map(|d| d["content"].as_str())
        .collect();
    assert_eq!(text.trim_end(), "Let me check.");
    let call = deltas
        .iter()
        .find_map(|d| d.get("tool_calls"))
        .expect("a tool_calls delta");
    assert_eq!(call[0]["index"], 0);
    assert_eq!(call[0]["function"]["name"], "get_weather");
    let last = v.last().expect("events");
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(last["choices"][0]["delta"], json!({}));
    assert_eq!(got.last().map(String::as_str), Some("[DONE]"));
}

/// What every front end reads of a committed pair: its chunks up to the finished one, or the
/// error that ends it; a pair that ends without finishing is an error, never a quiet end.
#[tokio::test]
async fn a_committed_answer_ends_with_a_finish_or_an_error_never_quietly() {
    let id = PairId::from_raw(7);
    let read = |events: Vec<PairEvent>| async move {
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        for e in events {
            tx.send(e).await.expect("room");
        }
        drop(tx);
        committed_chunks(
            rx,
            id,
            lockstep_tenancy::tenant::Held::default(),
            None,
            None,
        )
        .collect::<Vec<_>>()
        .await
    };
    // A finish ends it: nothing after is read.
    let got = read(vec![
        PairEvent::Chunk(chunk("t", None, 1)),
        PairEvent::Chunk(chunk("t", Some(FinishReason::Stop), 2)),
        PairEvent::Chunk(chunk("t", None, 3)),
    ])
    .await;
    let ns: Vec<u64> = got
        .iter()
        .map(|c| c.as_ref().expect("chunk").completion_tokens)
        .collect();
    assert_eq!(ns, [1, 2]);
    // The task ends without a finish: the last item is the pair's failure.
    for events in [
        vec![PairEvent::Chunk(chunk("t", None, 1))],
        vec![],
        vec![
            PairEvent::Chunk(chunk("t", None, 1)),
            PairEvent::Committed {
                prompt_logprobs: None,
                pair_id: id,
                prompt_tokens: 1,
                cached_tokens: 0,
            },
        ],
    ] {
        let n = events
            .iter()
            .filter(|e| matches!(e, PairEvent::Chunk(_)))
            .count();
        let got = read(events).await;
        let last = got.last().expect("an item").as_ref().expect_err("an error");
        assert!(
            matches!(last, LockstepError::DecodeFailed { pair_id, .. } if *pair_id == id),
            "{last:?}"
        );
        assert_eq!(got.len(), n + 1, "each chunk, then the error, then nothing");
    }
    // A failure is passed on as it is, and ends the answer.
    let got = read(vec![
        PairEvent::Failed(LockstepError::Unavailable {
            message: "x".into(),
        }),
        PairEvent::Chunk(chunk("t", Some(FinishReason::Stop), 1)),
    ])
    .await;
    assert_eq!(got.len(), 1);
    assert!(matches!(got[0], Err(LockstepError::Unavailable { .. })));
}

//! Tests of the SGLang backend's answer reading and stream modes.

use super::*;
use serde_json::json;

/// `v` read as SGLang's answer is read.
fn read(v: Value) -> Answer {
    Answer::parse(Side::Decode, v.to_string().as_bytes(), "test").expect("an answer")
}

fn answer(meta: Value) -> Answer {
    read(json!({ "text": "x", "output_ids": [1], "meta_info": meta }))
}

fn event(text: &str, ids: &[u32], completion: u64) -> Answer {
    read(
        json!({ "text": text, "output_ids": ids, "meta_info": { "completion_tokens": completion, "finish_reason": null } }),
    )
}

#[test]
fn both_stream_modes_give_the_same_deltas_and_ids() {
    let want: Vec<(String, Vec<u32>)> = vec![
        ("red".into(), vec![1]),
        (" green".into(), vec![2]),
        (" blue".into(), vec![3, 4]),
    ];
    let mut c = StreamText::new(StreamMode::Cumulative);
    let got: Vec<(String, Vec<u32>)> = [
        event("red", &[1], 1),
        event("red green", &[1, 2], 2),
        event("red green blue", &[1, 2, 3, 4], 4),
    ]
    .iter()
    .map(|e| c.delta(e).expect("cumulative"))
    .collect();
    assert_eq!(got, want);
    let mut i = StreamText::new(StreamMode::Incremental);
    let got: Vec<(String, Vec<u32>)> = [
        event("red", &[1], 1),
        event(" green", &[2], 2),
        event(" blue", &[3, 4], 4),
    ]
    .iter()
    .map(|e| i.delta(e).expect("incremental"))
    .collect();
    assert_eq!(got, want);
    // An abort event (no ids, count 0) after them leaves the ids seen as they were.
    assert_eq!(
        c.delta(&event("red green blue", &[], 0)).expect("abort"),
        (String::new(), vec![])
    );
    assert_eq!(c.ids_seen, 4);
}

#[test]
fn a_stream_in_the_other_mode_fails_instead_of_garbling() {
    // Incremental events read as cumulative: the ids give it away on the second event even
    // where the text alone would have been sliced into garbage.
    let mut c = StreamText::new(StreamMode::Cumulative);
    c.delta(&event("red", &[1], 1))
        .expect("first event fits both");
    let e = c
        .delta(&event(" green and more", &[2], 2))
        .expect_err("mode mismatch");
    assert!(e.contains("Cumulative"), "{e}");
    // Cumulative events read as incremental: would repeat text; refused.
    let mut i = StreamText::new(StreamMode::Incremental);
    i.delta(&event("red", &[1], 1)).expect("first");
    assert!(i.delta(&event("red green", &[1, 2], 2)).is_err());
    // An abort event (no ids, count 0) passes to inspect(), which reports it.
    assert!(i.delta(&event("", &[], 0)).is_ok());
}

#[test]
fn a_kv_checksum_mismatch_is_an_integrity_failure_in_band_or_as_a_status() {
    let ev = read(
        json!({ "text": "", "output_ids": [], "meta_info": { "finish_reason":
        { "type": "abort", "message": "KV checksum mismatch", "status_code": 500, "err_type": null } } }),
    );
    let e = inspect(Side::Decode, &ev).expect_err("abort");
    assert!(matches!(e.failure, HalfFailure::Integrity(_)), "{e:?}");
    let body = br#"{"object":"error","message":"KV checksum mismatch","type":"500","param":null,"code":500}"#;
    assert!(matches!(
        status_failure(500, body),
        HalfFailure::Integrity(_)
    ));
    // Other aborts stay what they were.
    let other = read(
        json!({ "meta_info": { "finish_reason": { "type": "abort", "message": "Abort request" } } }),
    );
    assert!(matches!(
        inspect(Side::Decode, &other).expect_err("abort").failure,
        HalfFailure::InBandAbort(_)
    ));
    assert!(matches!(
        status_failure(503, br#"{"error":{"message":"busy"}}"#),
        HalfFailure::Status { status: 503, .. }
    ));
}

#[test]
fn answers_skip_fields_lockstep_does_not_read_and_refuse_wrong_types() {
    let full = read(json!({ "text": "hi", "output_ids": [5, 6], "meta_info": {
        "id": "7", "prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 1,
        "finish_reason": { "type": "stop", "matched": "." },
        "output_token_logprobs": [[-0.1, 5, null], [-0.2, 6, null]], "e2e_latency": 0.5 },
        "extra": { "nested": [1, 2] } }));
    assert_eq!(
        inspect(Side::Decode, &full).expect("ok"),
        Some(FinishReason::Stop)
    );
    assert_eq!(full.output_ids.as_ref().map(Vec::len), Some(2));
    assert_eq!(prefill_report(&full, "7").expect("ours").prompt_tokens, 3);
    for bad in [
        json!({ "meta_info": { "prompt_tokens": "3" } }),
        json!({ "meta_info": { "prompt_tokens": -1 } }),
        json!({ "text": 5, "meta_info": {} }),
        json!({ "output_ids": 2, "meta_info": {} }),
        json!({ "meta_info": { "id": 7 } }),
        json!({ "meta_info": "done" }),
        json!([1, 2]),
    ] {
        let e = Answer::parse(Side::Prefill, bad.to_string().as_bytes(), "not JSON")
            .expect_err(&bad.to_string());
        assert_eq!(e.side, Side::Prefill);
        assert!(
            matches!(&e.failure, HalfFailure::Protocol(m) if m.starts_with("not JSON: ")),
            "{bad}: {e:?}"
        );
    }
    // Absent and null read alike: no meta_info is a protocol failure, an error is a refusal.
    let e = inspect(Side::Decode, &read(json!({ "meta_info": null }))).expect_err("no meta");
    assert!(
        matches!(&e.failure, HalfFailure::Protocol(m) if m == "no meta_info"),
        "{e:?}"
    );
    let e = inspect(
        Side::Decode,
        &read(json!({ "error": { "message": "x" }, "meta_info": {} })),
    )
    .expect_err("error");
    assert!(matches!(e.failure, HalfFailure::InBandAbort(_)), "{e:?}");
    assert!(
        inspect(
            Side::Decode,
            &read(json!({ "error": null, "meta_info": {} }))
        )
        .is_ok()
    );
}

#[test]
fn a_prefill_answer_fails_closed_unless_finished_and_ours() {
    let ok = answer(json!({ "id": "7", "prompt_tokens": 5, "cached_tokens": 2,
                            "finish_reason": { "type": "length", "length": 0 } }));
    let r = prefill_report(&ok, "7").expect("finished, ours");
    assert_eq!((r.prompt_tokens, r.cached_tokens), (5, Some(2)));
    // No id (older releases): accepted on the other checks.
    let no_id = answer(json!({ "prompt_tokens": 5, "finish_reason": { "type": "length" } }));
    assert!(prefill_report(&no_id, "7").is_ok());
    for (bad, why) in [
        (
            answer(json!({ "id": "7", "prompt_tokens": 5, "finish_reason": null })),
            "no finish_reason",
        ),
        (
            answer(json!({ "id": "7", "prompt_tokens": 5 })),
            "no finish_reason",
        ),
        (
            answer(json!({ "id": "8", "prompt_tokens": 5, "finish_reason": { "type": "length" } })),
            "not this pair",
        ),
        (
            answer(json!({ "id": "7", "finish_reason": { "type": "length" } })),
            "prompt_tokens",
        ),
        (
            answer(
                json!({ "id": "7", "prompt_tokens": 5, "finish_reason": { "type": "abort", "message": "m" } }),
            ),
            "m",
        ),
    ] {
        let e = prefill_report(&bad, "7").expect_err(why).to_string();
        assert!(e.contains(why), "{why}: {e}");
    }
}

/// What a lookup in the parsed JSON value finds for a `finish_reason`: its kind (`type`, or the
/// value itself when a string), `message` and `matched`, each only where it is a string.
fn looked_up(fr: &Value) -> (Option<&str>, Option<&str>, Option<&str>) {
    let kind = fr
        .get("type")
        .and_then(Value::as_str)
        .or_else(|| fr.as_str());
    let s = |k: &str| fr.get(k).and_then(Value::as_str);
    (kind, s("message"), s("matched"))
}

#[test]
fn a_finish_reason_reads_as_a_lookup_in_its_parsed_value_would() {
    let mut shapes = vec![
        json!("stop"),
        json!("length"),
        json!(""),
        json!(7),
        json!(-7),
        json!(1.5),
        json!(true),
        json!([]),
        json!(["stop", { "type": "stop" }]),
        json!({}),
        json!({ "length": 3 }),
        json!({ "type": "weird \"quoted\" \u{e9}" }),
        json!({ "type": "stop", "matched": 128009 }),
        json!({ "type": "stop", "matched": "\n\n" }),
        json!({ "type": "stop", "matched": null }),
        json!({ "type": "stop", "matched": ["x"] }),
        json!({ "type": "abort", "message": { "nested": ["a", 1] } }),
        json!({ "type": 5, "message": "m" }),
        json!({ "type": null }),
        json!({ "Type": "stop" }),
        json!({ "extra": { "type": "stop" }, "type": "length", "status_code": 500 }),
    ];
    for kind in ["stop", "length", "abort"] {
        for message in [json!(null), json!("gone"), json!(3), json!({ "m": 1 })] {
            for matched in [json!("."), json!(13), json!([1]), json!(false)] {
                shapes.push(json!({ "type": kind, "message": message, "matched": matched }));
            }
        }
    }
    for fr in &shapes {
        let a = answer(json!({ "finish_reason": fr }));
        let f = a
            .meta_info
            .as_ref()
            .and_then(|m| m.finish_reason.as_ref())
            .unwrap_or_else(|| panic!("{fr} is read"));
        let got = (
            f.kind.as_deref(),
            f.message.as_deref(),
            f.matched.as_deref(),
        );
        assert_eq!(got, looked_up(fr), "{fr}");
    }
    // A repeated key: the last one counts, as in the parsed value.
    let twice = br#"{"meta_info":{"finish_reason":{"type":"abort","message":"a","type":"stop"}}}"#;
    let a = Answer::parse(Side::Decode, twice, "test").expect("an answer");
    assert_eq!(
        inspect(Side::Decode, &a).expect("ok"),
        Some(FinishReason::Stop)
    );
    // `null` is no finish at all; anything unreadable is not an answer.
    assert_eq!(
        inspect(Side::Decode, &answer(json!({ "finish_reason": null }))).expect("ok"),
        None
    );
    for bad in [
        &br#"{"meta_info":{"finish_reason":{"type":"stop""#[..],
        br#"{"meta_info":{"finish_reason":{"type":}}}"#,
        br#"{"meta_info":{"finish_reason":[1,}}}"#,
    ] {
        assert!(Answer::parse(Side::Decode, bad, "test").is_err());
    }
}

/// SGLang's log-probability lists follow the stream mode (0.5.23 `tokenizer_manager.py`
/// `_slice_streaming_output_meta_info`): cumulative by default, where each event's new tokens get
/// the entries past the ones delivered; the event's own entries alone in incremental mode, where
/// a list of any other length (a cumulative one included) fails the event. Each entry names its
/// token; a list that is short, names another token, or lacks the alternatives fails the event.
#[test]
fn log_probabilities_are_read_as_each_stream_mode_sends_them() {
    let lp_event = |ids: &[u32], listed: &[u32], completion: usize, top: bool| {
        let entries: Vec<Value> = listed
            .iter()
            .map(|&id| json!([-(id as f32) / 4.0, id, null]))
            .collect();
        let mut meta = json!({ "completion_tokens": completion, "finish_reason": null,
                               "output_token_logprobs": entries });
        if top {
            meta["output_top_logprobs"] = listed
                .iter()
                .map(|&id| json!([[-(id as f32) / 4.0, id, null], [null, id + 100, null]]))
                .collect();
        }
        read(json!({ "text": "", "output_ids": ids, "meta_info": meta }))
    };
    for mode in [StreamMode::Cumulative, StreamMode::Incremental] {
        let mut s = StreamText::new(mode);
        let events = match mode {
            StreamMode::Cumulative => [
                lp_event(&[1], &[1], 1, true),
                lp_event(&[1, 2, 3], &[1, 2, 3], 3, true),
            ],
            StreamMode::Incremental => [
                lp_event(&[1], &[1], 1, true),
                lp_event(&[2, 3], &[2, 3], 3, true),
            ],
        };
        let mut got = Vec::new();
        for e in &events {
            let (_, ids) = s.delta(e).expect("ids");
            got.extend(s.logprobs(e, &ids, 2).expect("entries"));
        }
        assert_eq!(got.len(), 3, "{mode:?}");
        assert_eq!(got[2].logprob, -0.75);
        assert_eq!(got[2].top, vec![(3, -0.75), (103, f32::NEG_INFINITY)]);
    }
    // An incremental event whose lists are cumulative is not this stream's.
    let mut s = StreamText::new(StreamMode::Incremental);
    let first = lp_event(&[1], &[1], 1, false);
    let (_, ids) = s.delta(&first).expect("ids");
    s.logprobs(&first, &ids, 0).expect("entries");
    let second = lp_event(&[2, 3], &[1, 2, 3], 3, false);
    let (_, ids) = s.delta(&second).expect("ids");
    assert!(s.logprobs(&second, &ids, 0).is_err());
    let mut s = StreamText::new(StreamMode::Cumulative);
    // Fewer entries than tokens.
    let e = read(
        json!({ "text": "", "output_ids": [1, 2], "meta_info": { "completion_tokens": 2, "output_token_logprobs": [[-1.0, 1, null]] } }),
    );
    let (_, ids) = s.delta(&e).expect("ids");
    assert!(s.logprobs(&e, &ids, 0).is_err());
    // An entry naming another token.
    let mut s = StreamText::new(StreamMode::Cumulative);
    let e = read(
        json!({ "text": "", "output_ids": [5], "meta_info": { "completion_tokens": 1, "output_token_logprobs": [[-1.0, 6, null]] } }),
    );
    let (_, ids) = s.delta(&e).expect("ids");
    assert!(s.logprobs(&e, &ids, 0).is_err());
    // Alternatives asked for and missing.
    let mut s = StreamText::new(StreamMode::Cumulative);
    let e = lp_event(&[1], &[1], 1, false);
    let (_, ids) = s.delta(&e).expect("ids");
    assert!(s.logprobs(&e, &ids, 2).is_err());
    assert_eq!(s.logprobs(&e, &ids, 0).expect("none asked").len(), 1);
}

/// A prefill's prompt entries (`logprob_start_len: 0`): one per prompt token, each naming it,
/// the first without a value; returned for the tokens after the first; else not this prompt's.
#[test]
fn prompt_log_probabilities_must_name_the_prompt() {
    let answer = |entries: Value, tops: Value| {
        read(
            json!({ "text": "", "meta_info": { "input_token_logprobs": entries,
                                                "input_top_logprobs": tops } }),
        )
    };
    let good = answer(
        json!([[null, 5, null], [-1.5, 6, null], [-0.5, 7, null]]),
        json!([null, [[-1.0, 9, null]], [[-0.5, 7, null]]]),
    );
    let got = good.prompt_logprobs(&[5, 6, 7], 1).expect("read");
    assert_eq!(got.len(), 2);
    assert_eq!(
        (got[0].logprob, got[0].top.clone()),
        (-1.5, vec![(9, -1.0)])
    );
    assert!(
        good.prompt_logprobs(&[5, 6, 7], 0)
            .expect("no alternatives")[1]
            .top
            .is_empty()
    );
    // Another token, another length, alternatives asked and missing.
    assert!(good.prompt_logprobs(&[5, 6, 8], 1).is_err());
    assert!(good.prompt_logprobs(&[5, 6], 1).is_err());
    let bare = answer(json!([[null, 5, null], [-1.5, 6, null]]), Value::Null);
    assert!(bare.prompt_logprobs(&[5, 6], 1).is_err());
    assert!(bare.prompt_logprobs(&[5, 6], 0).is_ok());
}

//! Log-probabilities through SGLang (the P/D mock, which follows SGLang 0.5.23's
//! `add_logprob_to_meta_info`): both halves are asked (`return_logprob`, `top_logprobs_num`),
//! the decode's lists become each token's entry (cumulative in SGLang's default stream mode, this
//! event's alone with `--incremental-streaming-output`: every test runs in both), every entry must
//! name its token, and every front end renders them: `/generate` in SGLang's own shape,
//! completions and chat in OpenAI's, streamed and not.

use std::time::Duration;

use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS};
use lockstep_tests::sglang_mock::{Fault, MockConfig, Role, mock_logprob, mock_top};
use serde_json::{Value, json};

const PROMPT: &str = "red green blue yellow";

/// `/generate`'s `output_token_logprobs` as (logprob, id), and the alternatives' ids per token.
fn generate_entries(meta: &Value) -> (Vec<(f64, u32)>, Vec<Vec<u32>>) {
    let lps = meta["output_token_logprobs"]
        .as_array()
        .expect("output_token_logprobs")
        .iter()
        .map(|e| {
            (
                e[0].as_f64().expect("a value"),
                e[1].as_u64().expect("an id") as u32,
            )
        })
        .collect();
    let tops = meta["output_top_logprobs"]
        .as_array()
        .expect("output_top_logprobs")
        .iter()
        .map(|t| {
            t.as_array()
                .expect("a list")
                .iter()
                .map(|e| e[1].as_u64().expect("an id") as u32)
                .collect()
        })
        .collect();
    (lps, tops)
}

/// A stack whose SGLang decode streams in `incremental` mode (`--incremental-streaming-output`)
/// or SGLang's default cumulative one.
async fn stack(incremental: bool) -> Stack {
    if !incremental {
        return Stack::start().await;
    }
    let mock = MockConfig {
        server_args: vec![(Role::Decode, "incremental_streaming_output", json!(true))],
        ..MockConfig::default()
    };
    Stack::start_with(mock, "", TEST_TIMEOUTS).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_log_probabilities_reach_every_front_end_checked() {
    every_front_end(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_log_probabilities_reach_every_front_end_from_an_incremental_stream() {
    every_front_end(true).await;
}

async fn every_front_end(incremental: bool) {
    let stack = stack(incremental).await;
    // `/generate`, whole: the mock's value for each output token, its two alternatives.
    let body = json!({"text": PROMPT, "return_logprob": true, "top_logprobs_num": 2,
                      "sampling_params": {"max_new_tokens": 5, "temperature": 0}});
    let a = stack.post("/generate", body.clone()).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let (lps, tops) = generate_entries(&a.json()["meta_info"]);
    assert_eq!(lps.len(), 5, "{}", a.body);
    for ((lp, id), top) in lps.iter().zip(&tops) {
        assert!(
            (lp - f64::from(mock_logprob(*id))).abs() < 1e-6,
            "{id}: {lp}"
        );
        let want: Vec<u32> = mock_top(*id, 2).into_iter().map(|(t, _)| t).collect();
        assert_eq!(top, &want);
    }
    // Both halves were asked: SGLang's prefill computes the first token's entry.
    let sent = stack.mock.requests();
    assert_eq!(sent.len(), 2);
    for (role, b) in &sent {
        assert_eq!(
            (b["return_logprob"].clone(), b["top_logprobs_num"].clone()),
            (json!(true), json!(2)),
            "{role:?}"
        );
    }
    // Streamed: the last event's lists are the same.
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let s = stack.post("/generate", stream_body).await;
    assert_eq!(s.status, 200, "{}", s.body);
    let last = s.objects(true).pop().expect("events");
    assert_eq!(generate_entries(&last["meta_info"]), (lps.clone(), tops));

    // Completions on the same text: the same values, token by token, streamed and not.
    for stream in [false, true] {
        let c = stack
            .post(
                "/v1/completions",
                json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                   "logprobs": 2, "stream": stream}),
            )
            .await;
        assert_eq!(c.status, 200, "{}", c.body);
        let got: Vec<f64> = c
            .objects(stream)
            .iter()
            .filter_map(|o| o.pointer("/choices/0/logprobs/token_logprobs"))
            .flat_map(|l| l.as_array().cloned().unwrap_or_default())
            .map(|v| v.as_f64().expect("a value"))
            .collect();
        let want: Vec<f64> = lps.iter().map(|(lp, _)| *lp).collect();
        assert_eq!(got.len(), want.len(), "stream={stream}: {}", c.body);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-6, "stream={stream}: {got:?} {want:?}");
        }
    }

    // Chat: one entry per completion token, two alternatives each.
    let c = stack.post(
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
               "logprobs": true, "top_logprobs": 2}),
    )
    .await;
    assert_eq!(c.status, 200, "{}", c.body);
    let v = c.json();
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("entries");
    assert_eq!(
        content.len() as u64,
        v["usage"]["completion_tokens"].as_u64().expect("usage")
    );
    assert!(
        content
            .iter()
            .all(|e| e["top_logprobs"].as_array().map(Vec::len) == Some(2))
    );
}

/// Entries that do not fit the answer fail it: one naming another token than the output's, or
/// none from a prefill that was not asked (a real SGLang decode then reports a zero for the
/// first token, which lockstep cannot tell from a true value, so it always asks both halves).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_log_probabilities_of_another_token_fail_the_answer() {
    for incremental in [false, true] {
        another_token(incremental).await;
    }
}

async fn another_token(incremental: bool) {
    let stack = stack(incremental).await;
    stack.mock.set_fault(Fault::DecodeLogprobOtherToken);
    for stream in [false, true] {
        let a = stack
            .post(
                "/v1/chat/completions",
                json!({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                   "max_tokens": 4, "logprobs": true, "stream": stream}),
            )
            .await;
        assert!(
            a.status >= 500 || (stream && a.error_code().is_some()),
            "stream={stream}: {} {}",
            a.status,
            a.body
        );
        assert!(!a.body.contains("[DONE]"), "{}", a.body);
        assert!(a.error_code().is_some(), "{}", a.body);
    }
    // Without log-probabilities the same worker answers.
    let a = stack.post(
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.body);
}

/// The clients people use read SGLang's log-probabilities through lockstep
/// (`tests/python/mock_logprobs_clients.py`: openai 3.57, litellm, langchain-openai).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_clients_read_sglang_log_probabilities() {
    let Some(python) = lockstep_tests::client::clients_python() else {
        return;
    };
    let stack = Stack::start().await;
    lockstep_tests::client::run_python_checks_in(
        &python,
        "mock_logprobs_clients.py",
        &stack.url,
        MODEL,
        &[],
        Duration::from_secs(120),
        "all mock log-probability client checks passed",
    )
    .await;
}

/// The prompt's log-probabilities on SGLang are the prefill's (it runs the prompt; the decode
/// only gets its KV): `logprob_start_len: 0` goes to the prefill half alone, its
/// `input_token_logprobs` must name the prompt's tokens, and they come back as completions'
/// `echo` with `logprobs` and as `/generate`'s `input_token_logprobs`; another token fails the
/// answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_prompt_log_probabilities_come_from_the_prefill_checked() {
    for incremental in [false, true] {
        prompt_entries(incremental).await;
    }
}

async fn prompt_entries(incremental: bool) {
    let stack = stack(incremental).await;
    let g = stack.post(
        "/generate",
        json!({"text": PROMPT, "return_logprob": true, "top_logprobs_num": 2, "logprob_start_len": 0,
               "sampling_params": {"max_new_tokens": 2, "temperature": 0}}),
    )
    .await;
    assert_eq!(g.status, 200, "{}", g.body);
    let meta = &g.json()["meta_info"];
    let input = meta["input_token_logprobs"]
        .as_array()
        .expect("input")
        .clone();
    let n = meta["prompt_tokens"].as_u64().expect("n") as usize;
    assert_eq!(input.len(), n, "{meta}");
    assert!(
        input[0][0].is_null() && meta["input_top_logprobs"][0].is_null(),
        "{meta}"
    );
    for e in &input[1..] {
        let id = e[1].as_u64().expect("id") as u32;
        assert!((e[0].as_f64().expect("v") - f64::from(mock_logprob(id))).abs() < 1e-6);
    }
    let sent = stack.mock.requests();
    let start_of = |role: &str| {
        sent.iter()
            .find(|(r, _)| format!("{r:?}") == role)
            .map(|(_, b)| b["logprob_start_len"].clone())
    };
    assert_eq!(start_of("Prefill"), Some(json!(0)));
    assert_eq!(
        start_of("Decode"),
        Some(Value::Null),
        "the decode is not asked"
    );
    for stream in [false, true] {
        let c = stack.post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "echo": true,
                   "logprobs": 2, "stream": stream}),
        )
        .await;
        assert_eq!(c.status, 200, "{}", c.body);
        let values: Vec<Value> = c
            .objects(stream)
            .iter()
            .filter_map(|o| o.pointer("/choices/0/logprobs/token_logprobs"))
            .flat_map(|l| l.as_array().cloned().unwrap_or_default())
            .collect();
        assert_eq!(values.len(), n + 2, "stream={stream}: {}", c.body);
        assert!(values[0].is_null());
        for (v, e) in values[1..n].iter().zip(&input[1..]) {
            assert_eq!(v.as_f64(), e[0].as_f64(), "stream={stream}");
        }
    }
    stack.mock.set_fault(Fault::PrefillLogprobOtherToken);
    let c = stack
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "echo": true, "logprobs": 1}),
        )
        .await;
    assert!(
        c.status >= 500 && c.error_code().is_some(),
        "{} {}",
        c.status,
        c.body
    );
}

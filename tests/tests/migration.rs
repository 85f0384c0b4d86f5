//! Decode migration through the SGLang mock (`[models.failover]`): a decode stream that breaks
//! after commit continues on a new pair whose prompt is the client's prompt and the tokens
//! delivered, proven by the same barrier, so the client gets the text it would have had, with
//! no gap, no duplicate and one usage total, on every API, streamed and not. And what never
//! migrates: an integrity violation mid-stream, a client that went away, an output constraint
//! SGLang cannot resume, a tokenizer whose text is not the concatenation of its tokens', and
//! any of it with `max_migrations = 0`.
//!
//! The mock's decode output here is a function of the sequence alone (`continuation_lag`: each
//! token the one a fixed distance back), as a real model's greedy output is, and its tokenizer
//! is byte-level (a character of several bytes is several tokens, held back by the mock's
//! detokenizer until whole, as SGLang's is).

use std::time::Duration;

use lockstep_tests::client::{Answer, TestClient};
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS, wait_for};
use lockstep_tests::sglang_mock::{Fault, MockConfig, Role};
use lockstep_tests::tokenizer;
use serde_json::{Value, json};

const FAILOVER: &str = "[models.failover]\nmax_migrations = 1\n";
const PROMPT: &str = "red green blue black white cat dog";
const MAX_TOKENS: u64 = 12;

/// The APIs, each as (name, path, body) for `prompt`, whole and streamed.
fn requests(prompt: &str, extra: &[(&str, Value)]) -> Vec<(String, &'static str, Value)> {
    let mut out = Vec::new();
    for stream in [false, true] {
        let msgs = json!([{ "role": "user", "content": prompt }]);
        let mut all = vec![
            (
                "generate",
                "/generate",
                json!({ "text": prompt, "stream": stream,
                        "sampling_params": { "max_new_tokens": MAX_TOKENS } }),
            ),
            (
                "completions",
                "/v1/completions",
                json!({ "model": MODEL, "prompt": prompt, "stream": stream, "max_tokens": MAX_TOKENS,
                        "stream_options": if stream { json!({ "include_usage": true }) } else { Value::Null } }),
            ),
            (
                "chat",
                "/v1/chat/completions",
                json!({ "model": MODEL, "messages": msgs, "stream": stream, "max_tokens": MAX_TOKENS,
                        "stream_options": if stream { json!({ "include_usage": true }) } else { Value::Null } }),
            ),
            (
                "responses",
                "/v1/responses",
                json!({ "model": MODEL, "input": prompt, "stream": stream, "max_output_tokens": MAX_TOKENS }),
            ),
            (
                "messages",
                "/v1/messages",
                json!({ "model": MODEL, "messages": msgs, "stream": stream, "max_tokens": MAX_TOKENS }),
            ),
        ];
        for (name, path, body) in all.drain(..) {
            let mut body = body;
            if let Some(o) = body.as_object_mut() {
                o.retain(|_, v| !v.is_null());
                for (k, v) in extra {
                    o.insert(k.to_string(), v.clone());
                }
            }
            out.push((format!("{name} stream={stream}"), path, body));
        }
    }
    out
}

/// What a client got: the text, the completion-token total the answer reports, and whether a
/// stream ended as a complete one does (`[DONE]`, or Anthropic's and the Responses API's last
/// event) with no error in it.
#[derive(Debug, PartialEq)]
struct Got {
    text: String,
    completion_tokens: Option<u64>,
    prompt_tokens: Option<u64>,
    complete: bool,
}

fn got(path: &str, stream: bool, a: &Answer) -> Got {
    let objects = a.objects(stream);
    let mut g = Got {
        text: String::new(),
        completion_tokens: None,
        prompt_tokens: None,
        complete: !stream,
    };
    for v in &objects {
        if v.get("error").is_some_and(|e| !e.is_null()) || v["type"] == "error" {
            g.complete = false;
            return g;
        }
        let usage = v
            .get("usage")
            .or_else(|| v.pointer("/response/usage"))
            .or_else(|| v.pointer("/message/usage"))
            .or_else(|| v.get("meta_info"))
            .filter(|u| u.is_object());
        if let Some(u) = usage {
            for (k, slot) in [
                (
                    ["completion_tokens", "output_tokens"],
                    &mut g.completion_tokens,
                ),
                (["prompt_tokens", "input_tokens"], &mut g.prompt_tokens),
            ] {
                if let Some(n) = k.iter().find_map(|k| u.get(*k).and_then(Value::as_u64)) {
                    *slot = Some(n);
                }
            }
        }
        match path {
            // Cumulative text on every event, SGLang's way.
            "/generate" => g.text = v["text"].as_str().unwrap_or_default().to_string(),
            "/v1/completions" | "/v1/chat/completions" => {
                for p in [
                    "/choices/0/text",
                    "/choices/0/message/content",
                    "/choices/0/delta/content",
                ] {
                    g.text
                        .push_str(v.pointer(p).and_then(Value::as_str).unwrap_or_default());
                }
            }
            "/v1/responses" if stream => {
                if v["type"] == "response.output_text.delta" {
                    g.text.push_str(v["delta"].as_str().unwrap_or_default());
                }
                // Cut by `max_output_tokens`, the Responses API says `incomplete`.
                if v["type"] == "response.completed" || v["type"] == "response.incomplete" {
                    g.complete = true;
                }
            }
            "/v1/responses" => {
                for o in v["output"].as_array().into_iter().flatten() {
                    for c in o["content"].as_array().into_iter().flatten() {
                        g.text.push_str(c["text"].as_str().unwrap_or_default());
                    }
                }
            }
            _ if stream => {
                if v["type"] == "content_block_delta" {
                    g.text
                        .push_str(v["delta"]["text"].as_str().unwrap_or_default());
                }
                if v["type"] == "message_stop" {
                    g.complete = true;
                }
            }
            _ => {
                for c in v["content"].as_array().into_iter().flatten() {
                    g.text.push_str(c["text"].as_str().unwrap_or_default());
                }
            }
        }
    }
    if stream && a.body.contains("data: [DONE]") {
        g.complete = true;
    }
    g
}

async fn stack(cfg: MockConfig, model_extra: &str, audit: &std::path::Path) -> Stack {
    Stack::start_with_tokenizer(
        tokenizer::build_byte_level(),
        cfg,
        &format!("audit_log = \"{}\"", audit.display()),
        model_extra,
        TEST_TIMEOUTS,
    )
    .await
}

/// The mock with its output `lag` tokens back in the sequence.
fn lagged(lag: usize) -> MockConfig {
    MockConfig {
        continuation_lag: Some(lag),
        ..MockConfig::default()
    }
}

fn lag_mock() -> MockConfig {
    lagged(5)
}

async fn send(stack: &Stack, path: &str, body: &Value) -> Answer {
    TestClient::default()
        .post(
            &format!("{}{path}", stack.url),
            body,
            Duration::from_secs(20),
        )
        .await
}

/// `lockstep_migrations_total` by outcome, summed over reasons.
async fn migrations(stack: &Stack, outcome: &str) -> f64 {
    let m = TestClient::default()
        .get(&format!("{}/metrics", stack.url), Duration::from_secs(5))
        .await;
    m.body
        .lines()
        .filter(|l| l.starts_with("lockstep_migrations_total{"))
        .filter(|l| l.contains(&format!("outcome=\"{outcome}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The `input_ids` of every decode request the mock received from `from` on.
fn decode_prompts(stack: &Stack, from: usize) -> Vec<Vec<u64>> {
    let before = stack.mock.requests()[..from]
        .iter()
        .filter(|(role, _)| *role == Role::Decode)
        .count();
    stack.mock.prompts(Role::Decode).split_off(before)
}

fn audit_lines(path: &std::path::Path, event: &str) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == event)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_cut_mid_stream_resumes_on_a_new_pair_with_the_text_it_would_have_had() {
    let dir = tempfile::tempdir().expect("tempdir");
    let audit = dir.path().join("audit.jsonl");
    let s = stack(lag_mock(), FAILOVER, &audit).await;
    for (what, path, body) in requests(PROMPT, &[]) {
        let stream = body["stream"] == json!(true);
        s.mock.set_fault(Fault::None);
        let a0 = send(&s, path, &body).await;
        let want = got(path, stream, &a0);
        assert!(
            want.complete && want.text.len() > 8,
            "{what}: reference {want:?}: {}",
            a0.body
        );
        assert_eq!(want.completion_tokens, Some(MAX_TOKENS), "{what}");
        let (before, resumed) = (s.mock.request_count(), migrations(&s, "resumed").await);
        s.mock.set_fault(Fault::DecodeCutOnce(4));
        let a = send(&s, path, &body).await;
        assert_eq!(a.status, 200, "{what}: {}", a.body);
        // The same text, whole: no gap, no duplicate; one usage total, the client's prompt.
        assert_eq!(got(path, stream, &a), want, "{what}: {}", a.body);
        assert_eq!(migrations(&s, "resumed").await, resumed + 1.0, "{what}");
        // The new pair's prompt is the old one's and the four tokens delivered.
        let prompts = decode_prompts(&s, before);
        assert_eq!(prompts.len(), 2, "{what}: two pairs: {prompts:?}");
        assert_eq!(prompts[1].len(), prompts[0].len() + 4, "{what}");
        assert_eq!(prompts[1][..prompts[0].len()], prompts[0][..], "{what}");
        assert!(
            s.wait_all_idle(Duration::from_secs(3)).await,
            "{what}: left behind"
        );
    }
    // Each migration's audit line names the pair it replaced and what it carried.
    let lines = audit_lines(&audit, "pair_migrated");
    assert_eq!(lines.len(), 10, "{lines:?}");
    for l in &lines {
        assert_eq!(l["carried_tokens"], 4, "{l}");
        assert!(
            l["migrated_from"]
                .as_str()
                .is_some_and(|f| f != l["pair_id"]),
            "{l}"
        );
        assert_eq!(l["reason"], "decode_failed", "{l}");
    }
    // The old pair's halves were both aborted.
    let from: Vec<String> = lines
        .iter()
        .filter_map(|l| l["migrated_from"].as_str().map(str::to_string))
        .collect();
    let rid = |id: &str| format!("{:0>19}", id);
    assert!(
        wait_for(Duration::from_secs(3), || {
            let aborts = s.mock.aborts();
            from.iter().all(|id| {
                [Role::Prefill, Role::Decode]
                    .iter()
                    .all(|r| aborts.iter().any(|a| a.rid == rid(id) && a.role == *r))
            })
        })
        .await,
        "{:?}",
        s.mock.aborts()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_character_split_across_tokens_is_generated_again_not_lost() {
    let dir = tempfile::tempdir().expect("tempdir");
    let audit = dir.path().join("audit.jsonl");
    // Lag 8 over two 4-byte characters the tokenizer never merged: the output repeats their
    // bytes, one token each; the mock's detokenizer holds a character back until it is whole.
    let s = stack(lagged(8), FAILOVER, &audit).await;
    let body = json!({ "model": MODEL, "prompt": "🦀🦉", "stream": true, "max_tokens": 16 });
    let want = got(
        "/v1/completions",
        true,
        &send(&s, "/v1/completions", &body).await,
    );
    assert_eq!(want.text, "🦀🦉🦀🦉", "{want:?}");
    // Cut after 6 tokens: the client has the first character (4 tokens) and half the second.
    for (cut, carried) in [(6, 4), (2, 0)] {
        s.mock.set_fault(Fault::DecodeCutOnce(cut));
        let a = send(&s, "/v1/completions", &body).await;
        assert_eq!(
            got("/v1/completions", true, &a),
            want,
            "cut at {cut}: {}",
            a.body
        );
        let lines = audit_lines(&audit, "pair_migrated");
        assert_eq!(
            lines.last().map(|l| l["carried_tokens"].clone()),
            Some(json!(carried))
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_never_migrates_fails_as_before() {
    let dir = tempfile::tempdir().expect("tempdir");
    let audit = dir.path().join("audit.jsonl");
    let s = stack(lag_mock(), FAILOVER, &audit).await;
    let body =
        json!({ "model": MODEL, "prompt": PROMPT, "stream": true, "max_tokens": MAX_TOKENS });
    let json_mode = {
        let mut b = body.clone();
        b["response_format"] = json!({ "type": "json_object" });
        b
    };
    for (what, fault, body, code) in [
        // The stream turns into another request's: never retried into a leak.
        (
            "integrity",
            Fault::DecodeCountChangesAt(3),
            &body,
            "integrity_violation",
        ),
        // SGLang cannot start a grammar mid-way.
        (
            "json mode",
            Fault::DecodeCutOnce(3),
            &json_mode,
            "decode_failed",
        ),
    ] {
        let (before, resumed, failed) = (
            s.mock.request_count(),
            migrations(&s, "resumed").await,
            migrations(&s, "failed").await,
        );
        s.mock.set_fault(fault);
        let a = send(&s, "/v1/completions", body).await;
        assert_eq!(a.status, 200, "{what}: {}", a.body);
        assert_eq!(a.error_code().as_deref(), Some(code), "{what}: {}", a.body);
        assert!(!a.body.contains("[DONE]"), "{what}: {}", a.body);
        assert_eq!(decode_prompts(&s, before).len(), 1, "{what}: one pair only");
        assert_eq!(migrations(&s, "resumed").await, resumed, "{what}");
        assert_eq!(migrations(&s, "failed").await, failed, "{what}");
        s.mock.set_fault(Fault::None);
        assert!(
            s.wait_all_idle(Duration::from_secs(3)).await,
            "{what}: left behind"
        );
    }
    assert!(audit_lines(&audit, "pair_migrated").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_is_not_migrated() {
    let dir = tempfile::tempdir().expect("tempdir");
    let audit = dir.path().join("audit.jsonl");
    let cfg = MockConfig {
        token_delay: Duration::from_millis(40),
        ..lag_mock()
    };
    let s = stack(cfg, FAILOVER, &audit).await;
    let before = s.mock.request_count();
    let body = json!({ "model": MODEL, "prompt": PROMPT, "stream": true, "max_tokens": 40 });
    // Read the head and a little of the stream, then hang up.
    let addr = s.url.trim_start_matches("http://").to_string();
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut c = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        let text = body.to_string();
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{text}",
            text.len()
        );
        c.write_all(req.as_bytes()).await.expect("write");
        let mut buf = vec![0u8; 4096];
        let mut seen = String::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while seen.matches("data:").count() < 3 && tokio::time::Instant::now() < deadline {
            let n = tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf))
                .await
                .expect("reads in time")
                .expect("read");
            assert!(n > 0, "closed early: {seen}");
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
        assert!(seen.contains("200"), "{seen}");
    }
    assert!(s.wait_all_idle(Duration::from_secs(3)).await, "left behind");
    assert_eq!(decode_prompts(&s, before).len(), 1, "one pair only");
    assert_eq!(
        migrations(&s, "resumed").await + migrations(&s, "failed").await,
        0.0
    );
    assert!(audit_lines(&audit, "pair_migrated").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_failover_or_a_byte_level_tokenizer_a_cut_stream_fails() {
    let dir = tempfile::tempdir().expect("tempdir");
    let audit = dir.path().join("audit.jsonl");
    let body =
        json!({ "model": MODEL, "prompt": PROMPT, "stream": true, "max_tokens": MAX_TOKENS });
    // `max_migrations = 0`: today's behaviour.
    let off = stack(
        lag_mock(),
        "[models.failover]\nmax_migrations = 0\n",
        &audit,
    )
    .await;
    // A word-level tokenizer joins words with spaces: the text of a continuation is not what
    // follows the text, so nothing delivered can be carried.
    let words =
        Stack::start_with_tokenizer(tokenizer::build(), lag_mock(), "", FAILOVER, TEST_TIMEOUTS)
            .await;
    for (what, s) in [("max_migrations 0", &off), ("word-level", &words)] {
        let before = s.mock.request_count();
        s.mock.set_fault(Fault::DecodeCutOnce(3));
        let a = send(s, "/v1/completions", &body).await;
        assert_eq!(
            a.error_code().as_deref(),
            Some("decode_failed"),
            "{what}: {}",
            a.body
        );
        assert!(!a.body.contains("[DONE]"), "{what}");
        assert_eq!(decode_prompts(s, before).len(), 1, "{what}: one pair only");
        assert!(
            s.wait_all_idle(Duration::from_secs(3)).await,
            "{what}: left behind"
        );
    }
}

/// What a gRPC `Generate` stream gave: text, token ids, the completion counts of its deltas,
/// and the usage of its `Finished`.
#[derive(Debug, Default, PartialEq)]
struct GrpcGot {
    text: String,
    ids: Vec<u32>,
    counts: Vec<u32>,
    completion_tokens: Option<u32>,
}

async fn grpc_generate(url: &str, prompt: &str, max_tokens: u32) -> Result<GrpcGot, String> {
    use lockstep_proto::v1 as pb;
    use lockstep_proto::v1::lockstep_client::LockstepClient;
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .expect("endpoint")
        .connect()
        .await
        .expect("h2c connect");
    let mut client = LockstepClient::new(channel);
    let req = pb::GenerateRequest {
        model: MODEL.into(),
        prompt: Some(pb::generate_request::Prompt::Text(prompt.into())),
        sampling: Some(pb::SamplingParams {
            max_tokens: Some(max_tokens),
            temperature: Some(0.0),
            ..Default::default()
        }),
    };
    let mut stream = client
        .generate(req)
        .await
        .map_err(|s| s.to_string())?
        .into_inner();
    let mut g = GrpcGot::default();
    while let Some(ev) = stream.message().await.map_err(|s| s.to_string())? {
        match ev.event {
            Some(pb::generate_response::Event::Delta(d)) => {
                g.text.push_str(&d.text);
                g.ids.extend(d.token_ids);
                g.counts.push(d.completion_tokens);
            }
            Some(pb::generate_response::Event::Finished(f)) => {
                g.completion_tokens = f.usage.map(|u| u.completion_tokens);
            }
            _ => {}
        }
    }
    Ok(g)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_streams_migrate_with_each_token_id_once_and_counts_that_never_go_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let audit = dir.path().join("audit.jsonl");
    let s = stack(lagged(8), FAILOVER, &audit).await;
    let want = grpc_generate(&s.url, "🦀🦉", 16).await.expect("reference");
    assert_eq!(want.text, "🦀🦉🦀🦉", "{want:?}");
    assert_eq!(want.ids.len(), 16);
    // Cut after 6 tokens: the client has 4 tokens' text and 6 tokens' ids; the new pair
    // generates the other 2 again, and the client gets each id once.
    s.mock.set_fault(Fault::DecodeCutOnce(6));
    let got = grpc_generate(&s.url, "🦀🦉", 16).await.expect("migrated");
    assert_eq!((&got.text, &got.ids), (&want.text, &want.ids), "{got:?}");
    assert_eq!(got.completion_tokens, Some(16));
    assert!(
        got.counts.windows(2).all(|w| w[0] <= w[1]),
        "{:?}",
        got.counts
    );
    let lines = audit_lines(&audit, "pair_migrated");
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["carried_tokens"], 4);
}

//! Every fault of the PD mock × {stream, non-stream} × {/generate, /v1/completions,
//! /v1/chat/completions}: the client gets an error (never a success with a failed pair's content),
//! no other request's content appears, both halves were aborted and released, and afterwards
//! lockstep's registry is empty and its load counters are zero.
//!
//! The mock's own KV wait is SGLang's 300 s; the client's error must arrive within 1 s, so only lockstep's
//! abort can explain it.

use std::time::{Duration, Instant};

use lockstep_tests::client::{self, Answer, ENDPOINTS, Endpoint, TestClient};
use lockstep_tests::harness::{MODEL, Stack};
use lockstep_tests::sglang_mock::{self, Fault, Role};
use serde_json::{Value, json};

/// Words of an earlier tenant's prompt: they must never appear in a failed pair's answer.
const SECRET: &str = "secret password billing account customer tenant";
const SECRET_WORDS: [&str; 4] = ["secret", "password", "billing", "customer"];
/// The faulty request's own prompt.
const PROMPT: &str = "red green blue";

fn request(ep: Endpoint, prompt: &str, stream: bool, max_tokens: u64) -> (&'static str, Value) {
    client::request(ep, MODEL, prompt, stream, max_tokens, &[])
}

async fn call(
    stack: &Stack,
    ep: Endpoint,
    prompt: &str,
    stream: bool,
    max_tokens: u64,
) -> (Answer, Duration) {
    let (path, body) = request(ep, prompt, stream, max_tokens);
    let t = Instant::now();
    let a = TestClient::default()
        .post(
            &format!("{}{path}", stack.url),
            &body,
            Duration::from_secs(20),
        )
        .await;
    (a, t.elapsed())
}

/// Seeds the mock's KV pool with another tenant's prompt (a successful pair), so stale pages hold it.
async fn seed_secret(stack: &Stack) {
    stack.mock.set_fault(Fault::None);
    let (a, _) = call(stack, Endpoint::Completions, SECRET, false, 4).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(
        a.body.contains("secret"),
        "the seed echoes its own prompt: {}",
        a.body
    );
    assert!(stack.wait_all_idle(Duration::from_secs(10)).await);
}

async fn assert_fault(fault: Fault, expected_codes: &[&str]) {
    let stack = Stack::start().await;
    for ep in ENDPOINTS {
        for stream in [false, true] {
            seed_secret(&stack).await;
            let before = stack.mock.request_count();
            stack.mock.set_fault(fault);
            let (a, took) = call(&stack, ep, PROMPT, stream, 12).await;
            let answered = Instant::now();
            let case = format!("{fault:?} {ep:?} stream={stream}");
            // An error: an error status, or on a committed stream an error event and no [DONE].
            let code = a.error_code();
            if a.status == 200 {
                assert!(stream, "{case}: non-stream answered 200: {}", a.body);
                assert!(
                    code.is_some(),
                    "{case}: committed stream without an error event: {}",
                    a.body
                );
                assert!(
                    !a.body.contains("[DONE]"),
                    "{case}: failed stream ended with [DONE]"
                );
            } else {
                assert!(a.status >= 400, "{case}: status {}", a.status);
            }
            let code = code.unwrap_or_default();
            assert!(
                expected_codes.contains(&code.as_str()),
                "{case}: code `{code}` not in {expected_codes:?}: {}",
                a.body
            );
            assert!(took < Duration::from_secs(1), "{case}: error took {took:?}");
            for w in SECRET_WORDS {
                assert!(
                    !a.body.contains(w),
                    "{case}: another tenant's content `{w}` leaked: {}",
                    a.body
                );
            }
            // No worker address in what the client reads.
            for url in [stack.mock.prefill_url(), stack.mock.decode_url()] {
                let host_port = url.trim_start_matches("http://");
                assert!(
                    !a.body.contains(host_port),
                    "{case}: a worker address reached the client: {}",
                    a.body
                );
            }
            // Both halves of every pair this request dispatched were aborted, and released, by
            // lockstep: sooner than the mock's own release of a half whose client went away (2 s
            // after the response ended, as SGLang's), which would otherwise explain it.
            stack.mock.set_fault(Fault::None);
            let bound = sglang_mock::STREAM_GONE_AFTER
                .saturating_sub(answered.elapsed())
                .saturating_sub(Duration::from_millis(300));
            assert!(
                stack.wait_all_idle(bound).await,
                "{case}: left behind: live {:?}, open rooms {}, free pages {}/{}, lockstep idle {}",
                stack.mock.live_halves(),
                stack.mock.open_rooms(),
                stack.mock.free_pages(),
                stack.mock.total_pages(),
                stack.lockstep_idle()
            );
            let reqs = stack.mock.requests();
            let rids: std::collections::BTreeSet<String> = reqs[before..]
                .iter()
                .filter_map(|(_, v)| v.get("rid").and_then(Value::as_str).map(str::to_string))
                .collect();
            if fault != Fault::PrefillReset {
                assert!(!rids.is_empty(), "{case}: nothing dispatched");
            }
            // Abort calls run in the background (they never delay the client): wait for them, bounded.
            let all_aborted = || {
                let aborts = stack.mock.aborts();
                rids.iter().all(|rid| {
                    [Role::Prefill, Role::Decode]
                        .iter()
                        .all(|role| aborts.iter().any(|r| &r.rid == rid && r.role == *role))
                })
            };
            let deadline = Instant::now() + Duration::from_secs(3);
            while !all_aborted() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(
                all_aborted(),
                "{case}: not every half of {rids:?} was aborted: {:?}",
                stack.mock.aborts()
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_4xx() {
    assert_fault(Fault::PrefillStatus(400), &["prefill_rejected"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_5xx() {
    assert_fault(Fault::PrefillStatus(500), &["prefill_rejected"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_in_band_abort_with_decoy_is_the_incident() {
    assert_fault(Fault::PrefillInBandAbortDecoy, &["prefill_rejected"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_never_answers() {
    assert_fault(Fault::PrefillHang, &["timeout"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_resets_connection() {
    assert_fault(Fault::PrefillReset, &["prefill_rejected"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_count_mismatch() {
    assert_fault(Fault::PrefillCountMismatch, &["integrity_violation"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_error() {
    assert_fault(Fault::DecodeStatus(500), &["decode_failed"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_hang() {
    assert_fault(Fault::DecodeHang, &["timeout"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_stream_cut() {
    assert_fault(Fault::DecodeCut(3), &["decode_failed"]).await;
}

/// SGLang's KV checksum (on in the mock, as lockstep requires) catches a corrupted transfer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_corrupted_in_transfer() {
    assert_fault(Fault::KvCorrupt, &["integrity_violation"]).await;
}

/// SGLang always reports the decode's prompt count; a decode that does not is not verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_without_a_prompt_count() {
    assert_fault(Fault::DecodeNoCount, &["integrity_violation"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_count_mismatch() {
    assert_fault(Fault::DecodeCountMismatch, &["integrity_violation"]).await;
}

/// Slow halves within the deadlines succeed, with the caller's own content only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_halves_succeed_with_own_content() {
    let stack = Stack::start().await;
    for ep in ENDPOINTS {
        for stream in [false, true] {
            seed_secret(&stack).await;
            stack.mock.set_fault(Fault::Slow {
                prefill_ms: 150,
                token_ms: 30,
            });
            let (a, _) = call(&stack, ep, PROMPT, stream, 6).await;
            let case = format!("{ep:?} stream={stream}");
            assert_eq!(a.status, 200, "{case}: {}", a.body);
            assert!(a.error_code().is_none(), "{case}: {}", a.body);
            assert!(
                a.body.contains("green"),
                "{case}: own content missing: {}",
                a.body
            );
            for w in SECRET_WORDS {
                assert!(!a.body.contains(w), "{case}: leaked `{w}`");
            }
            if stream {
                assert!(
                    a.body.trim_end().ends_with("data: [DONE]"),
                    "{case}: {}",
                    a.body
                );
            }
            assert!(
                stack.wait_all_idle(Duration::from_secs(10)).await,
                "{case}: not idle"
            );
        }
    }
}

/// The mock reproduces the incident when no lockstep stands in front of it: a naive PD router
/// (both halves, status codes only) returns another tenant's prompt. This is what makes the fault
/// tests above meaningful.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mock_reproduces_the_incident_without_lockstep() {
    let stack = Stack::start().await;
    seed_secret(&stack).await;
    stack.mock.set_fault(Fault::PrefillInBandAbortDecoy);
    let tok = lockstep_tests::tokenizer::build();
    let ids = tok
        .encode(PROMPT, false)
        .expect("encode")
        .get_ids()
        .to_vec();
    let body = |stream: bool| json!({ "input_ids": ids, "rid": "naive-1", "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 4242u64, "stream": stream, "sampling_params": { "max_new_tokens": 6 } });
    let c = TestClient::default();
    let (pu, du, b) = (
        format!("{}/generate", stack.mock.prefill_url()),
        format!("{}/generate", stack.mock.decode_url()),
        body(false),
    );
    let (p, d) = tokio::join!(
        c.post(&pu, &b, Duration::from_secs(5)),
        c.post(&du, &b, Duration::from_secs(5))
    );
    assert_eq!(p.status, 200, "the in-band abort hides inside a 200");
    assert_eq!(
        p.json().pointer("/meta_info/finish_reason/type"),
        Some(&json!("abort"))
    );
    assert_eq!(d.status, 200, "{}", d.body);
    assert!(
        SECRET_WORDS.iter().any(|w| d.body.contains(w)),
        "decode answered from stale pages: {}",
        d.body
    );
}

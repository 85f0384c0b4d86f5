//! Reload: parse → validate (deployment check against the workers included) → swap atomically.
//! An invalid config is refused with its reasons and the old one keeps serving; pairs in flight
//! finish on the configuration they started with.

use std::time::{Duration, Instant};

use lockstep_core::config::Config;
use lockstep_router::pair::PairState;
use lockstep_tests::client::TestClient;
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS};
use lockstep_tests::sglang_mock::Fault;
use serde_json::json;

async fn prompt_of(stack: &Stack, words: usize) -> lockstep_tests::client::Answer {
    let body = json!({"model": MODEL, "prompt": "red ".repeat(words), "max_tokens": 2});
    TestClient::default()
        .post(
            &format!("{}/v1/completions", stack.url),
            &body,
            Duration::from_secs(5),
        )
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_reload_keeps_the_old_config_and_valid_reload_applies() {
    let stack = Stack::start().await;
    // The mock reports 64 pages x 16 tokens = 1024 tokens of KV; a 2000-token window cannot fit.
    let text = stack
        .config_text("", TEST_TIMEOUTS)
        .replace("context_window = 512", "context_window = 2000")
        .replace("kv_capacity_tokens = 1024", "kv_capacity_tokens = 4096");
    let err = stack
        .lockstep
        .reload(Config::parse(&text).expect("parses"))
        .await
        .expect_err("must be refused");
    assert!(
        err.contains("2000") && err.contains("1024") && err.contains(MODEL),
        "{err}"
    );
    // Still the old limits: 505 + 2 fits 512, 511 + 2 does not.
    assert_eq!(prompt_of(&stack, 505).await.status, 200);
    let a = prompt_of(&stack, 511).await;
    assert_eq!(
        a.error_code().as_deref(),
        Some("context_length_exceeded"),
        "{}",
        a.body
    );
    assert!(a.body.contains("512"));

    // A valid reload applies at once.
    let text = stack
        .config_text("", TEST_TIMEOUTS)
        .replace("context_window = 512", "context_window = 256");
    stack
        .lockstep
        .reload(Config::parse(&text).expect("parses"))
        .await
        .expect("valid reload");
    let a = prompt_of(&stack, 300).await;
    assert_eq!(
        a.error_code().as_deref(),
        Some("context_length_exceeded"),
        "{}",
        a.body
    );
    assert!(a.body.contains("256"), "{}", a.body);
    assert_eq!(prompt_of(&stack, 100).await.status, 200);
}

/// A pair in flight finishes on the configuration it started with: the reload takes effect at
/// once (the same request, sent again, is refused under it) while the committed pair streams on
/// to its last token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pairs_in_flight_are_unaffected_by_reload() {
    let stack = Stack::start().await;
    stack.mock.set_fault(Fault::Slow {
        prefill_ms: 0,
        token_ms: 40,
    });
    let url = format!("{}/v1/completions", stack.url);
    let body = json!({"model": MODEL, "prompt": "red green", "max_tokens": 20, "stream": true});
    let inflight = {
        let (url, body) = (url.clone(), body.clone());
        tokio::spawn(async move {
            TestClient::default()
                .post(&url, &body, Duration::from_secs(10))
                .await
        })
    };
    // Until the pair has committed (bounded), not a guessed sleep.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !stack
        .lockstep
        .state
        .registry
        .snapshot()
        .iter()
        .any(|(_, i)| i.state == PairState::Committed)
    {
        assert!(Instant::now() < deadline, "the pair never committed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A window the in-flight request (2 prompt tokens + 20) no longer fits.
    let text = stack
        .config_text("", TEST_TIMEOUTS)
        .replace("context_window = 512", "context_window = 16");
    stack
        .lockstep
        .reload(Config::parse(&text).expect("parses"))
        .await
        .expect("reload");
    let again = TestClient::default()
        .post(&url, &body, Duration::from_secs(10))
        .await;
    assert_eq!(
        again.error_code().as_deref(),
        Some("context_length_exceeded"),
        "the reload applies to new requests: {}",
        again.body
    );
    let a = inflight.await.expect("join");
    assert_eq!(a.status, 200);
    assert!(a.error_code().is_none(), "{}", a.body);
    assert!(a.body.trim_end().ends_with("data: [DONE]"), "{}", a.body);
    let chunks = a
        .sse_events()
        .iter()
        .filter(|e| e.contains("\"text\""))
        .count();
    assert_eq!(
        chunks, 20,
        "every token of the old config's request: {}",
        a.body
    );
    assert!(
        a.body.contains("\"finish_reason\":\"length\""),
        "{}",
        a.body
    );
    assert!(stack.wait_all_idle(Duration::from_secs(3)).await);
}

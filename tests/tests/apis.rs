//! The Responses API (`/v1/responses`) and Anthropic's Messages API (`/v1/messages`) in front of
//! the PD mock: the official `openai` and `anthropic` packages (`tests/python/apis_client.py`),
//! and what those packages cannot easily show: a failure after commit ends each stream in its
//! API's failure event and never its success ending, and refusals before any body is read take
//! the API's own error shape.

use std::time::Duration;

use lockstep_tests::client::{self, TestClient};
use lockstep_tests::harness::{MODEL, Stack};
use lockstep_tests::sglang_mock::Fault;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_and_anthropic_clients() {
    let stack = Stack::start().await;
    client::run_python_checks_with(
        "apis_client.py",
        &stack.url,
        MODEL,
        &[("LOCKSTEP_ECHO", "1")],
        Duration::from_secs(90),
        "all api client checks passed",
    )
    .await;
    assert!(stack.wait_all_idle(Duration::from_secs(3)).await);
}

/// The `data:` payloads of an SSE body whose `event:` line names `name`.
fn events_named(body: &str, name: &str) -> Vec<Value> {
    body.split("\n\n")
        .filter(|e| e.lines().any(|l| l == format!("event: {name}")))
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect()
}

/// A decode stream cut after commit: the Messages stream ends with an `error` event (which the
/// `anthropic` package raises), the Responses stream with `response.failed`; neither sends its
/// success ending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_after_commit_ends_each_stream_in_its_failure_event() {
    let stack = Stack::start().await;
    stack.mock.set_fault(Fault::DecodeCut(3));
    let c = TestClient::default();
    let a = c
        .post(
            &format!("{}/v1/messages", stack.url),
            &json!({"model": MODEL, "max_tokens": 20, "stream": true,
                    "messages": [{"role": "user", "content": "alpha bravo charlie"}]}),
            Duration::from_secs(10),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        events_named(&a.body, "message_start").len(),
        1,
        "{}",
        a.body
    );
    let err = events_named(&a.body, "error");
    assert_eq!(err.len(), 1, "{}", a.body);
    assert_eq!(err[0]["type"], "error");
    assert_eq!(err[0]["error"]["type"], "api_error");
    assert_eq!(err[0]["error"]["code"], "decode_failed");
    assert!(
        events_named(&a.body, "message_stop").is_empty(),
        "{}",
        a.body
    );
    assert!(
        events_named(&a.body, "message_delta").is_empty(),
        "{}",
        a.body
    );

    let r = c
        .post(
            &format!("{}/v1/responses", stack.url),
            &json!({"model": MODEL, "max_output_tokens": 20, "stream": true, "input": "alpha bravo charlie"}),
            Duration::from_secs(10),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let failed = events_named(&r.body, "response.failed");
    assert_eq!(failed.len(), 1, "{}", r.body);
    assert_eq!(failed[0]["response"]["status"], "failed");
    assert_eq!(failed[0]["response"]["error"]["code"], "decode_failed");
    for done in [
        "response.completed",
        "response.incomplete",
        "response.output_item.done",
    ] {
        assert!(events_named(&r.body, done).is_empty(), "{done}: {}", r.body);
    }
    assert!(stack.wait_all_idle(Duration::from_secs(3)).await);
}

/// Before commit, a failing pair answers each API's error status and shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_before_commit_is_an_error_status_in_each_apis_shape() {
    let stack = Stack::start().await;
    stack.mock.set_fault(Fault::PrefillStatus(500));
    let c = TestClient::default();
    for stream in [false, true] {
        let a = c
            .post(
                &format!("{}/v1/messages", stack.url),
                &json!({"model": MODEL, "max_tokens": 4, "stream": stream,
                        "messages": [{"role": "user", "content": "hi"}]}),
                Duration::from_secs(10),
            )
            .await;
        assert_eq!(a.status, 502, "{}", a.body);
        let v: Value = serde_json::from_str(&a.body).expect("json");
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], "api_error", "{v}");
        assert_eq!(v["error"]["code"], "prefill_rejected", "{v}");
        let r = c
            .post(
                &format!("{}/v1/responses", stack.url),
                &json!({"model": MODEL, "max_output_tokens": 4, "stream": stream, "input": "hi"}),
                Duration::from_secs(10),
            )
            .await;
        assert_eq!(r.status, 502, "{}", r.body);
        assert_eq!(r.error_code().as_deref(), Some("prefill_rejected"));
    }
}

/// Refusals made before the request is understood (its JSON, a missing required field) take
/// Anthropic's error shape on `/v1/messages` too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_refusals_take_anthropics_shape() {
    let stack = Stack::start().await;
    let c = TestClient::default();
    let url = format!("{}/v1/messages", stack.url);
    let bad_json = c
        .send_raw("POST", &url, "{not json", Duration::from_secs(5))
        .await;
    assert_eq!(bad_json.status, 400, "{}", bad_json.body);
    let v: Value = serde_json::from_str(&bad_json.body).expect("json");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert_eq!(v["error"]["code"], "invalid_json", "{v}");
    let missing = c
        .post(
            &url,
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
            Duration::from_secs(5),
        )
        .await;
    assert_eq!(missing.status, 400, "{}", missing.body);
    let v: Value = serde_json::from_str(&missing.body).expect("json");
    assert_eq!(v["type"], "error");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("max_tokens")),
        "{v}"
    );
}

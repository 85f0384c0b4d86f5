//! Lifecycle behaviours around the fault matrix: client disconnects, retries, health checks,
//! readiness and h2c.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use lockstep_tests::client::TestClient;
use lockstep_tests::harness::{MODEL, Stack, wait_for};
use lockstep_tests::sglang_mock::{Fault, MockConfig, Role};
use serde_json::{Value, json};

const LONG_TIMEOUTS: &str = "total_ms = 30000\nprefill_ms = 20000\nfirst_token_ms = 20000\nidle_ms = 20000\nabort_ms = 1000";

fn both_aborted(stack: &Stack) -> bool {
    let rids: Vec<String> = stack
        .mock
        .requests()
        .iter()
        .filter_map(|(_, v)| v["rid"].as_str().map(str::to_string))
        .collect();
    let aborts = stack.mock.aborts();
    !rids.is_empty()
        && rids.iter().all(|rid| {
            [Role::Prefill, Role::Decode]
                .iter()
                .all(|r| aborts.iter().any(|a| &a.rid == rid && a.role == *r))
        })
}

/// Every dispatched half was aborted, and then nothing is left in the mock or in lockstep.
async fn assert_released(stack: &Stack, case: &str) {
    assert!(
        wait_for(Duration::from_secs(2), || both_aborted(stack)).await,
        "{case}: aborts: {:?}",
        stack.mock.aborts()
    );
    assert!(
        stack.wait_all_idle(Duration::from_secs(2)).await,
        "{case}: live: {:?}",
        stack.mock.live_halves()
    );
}

/// A client that leaves mid-stream makes lockstep abort both halves at once (long before the
/// decode would have finished, and with deadlines far away).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_stream_aborts_both() {
    let stack = Stack::start_with(MockConfig::default(), "", LONG_TIMEOUTS).await;
    stack.mock.set_fault(Fault::Slow {
        prefill_ms: 0,
        token_ms: 100,
    });
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let body = json!({"model": MODEL, "prompt": "red green", "stream": true, "max_tokens": 100});
    let req = http::Request::post(format!("{}/v1/completions", stack.url))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let resp = client.request(req).await.expect("response");
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let first = body.frame().await.expect("a frame").expect("ok frame");
    assert!(first.into_data().is_ok_and(|d| !d.is_empty()));
    let left_at = Instant::now();
    drop(body);
    drop(client);
    assert_released(&stack, "").await;
    assert!(
        left_at.elapsed() < Duration::from_secs(3),
        "released long before the 10 s the decode needed"
    );
    assert_eq!(
        stack
            .lockstep
            .state
            .stats
            .completed
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

/// A client that leaves while the pair waits at the barrier (prefill still computing) aborts both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_before_commit_aborts_both() {
    let stack = Stack::start_with(MockConfig::default(), "", LONG_TIMEOUTS).await;
    stack.mock.set_fault(Fault::PrefillHang);
    let c = TestClient::default();
    let url = format!("{}/v1/chat/completions", stack.url);
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]});
    let gave_up = tokio::time::timeout(
        Duration::from_millis(300),
        c.post(&url, &body, Duration::from_secs(30)),
    )
    .await;
    assert!(
        gave_up.is_err(),
        "the prefill hangs, so the client gives up first"
    );
    drop(c);
    assert_released(&stack, "").await;
}

/// A 503 before work began is retried on a new pair; both halves of the failed pair are aborted
/// first, and when no retry remains the client gets the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_uses_a_new_pair_and_aborts_the_old_one() {
    let stack = Stack::start().await;
    stack.mock.set_fault(Fault::PrefillStatus(503));
    let a = TestClient::default()
        .post(
            &format!("{}/v1/completions", stack.url),
            &json!({"model": MODEL, "prompt": "red"}),
            Duration::from_secs(5),
        )
        .await;
    assert_eq!(a.status, 502, "{}", a.body);
    assert_eq!(a.error_code().as_deref(), Some("prefill_rejected"));
    let prefill_rids: Vec<String> = stack
        .mock
        .requests()
        .iter()
        .filter(|(r, _)| *r == Role::Prefill)
        .filter_map(|(_, v)| v["rid"].as_str().map(str::to_string))
        .collect();
    assert_eq!(
        prefill_rids.len(),
        2,
        "one attempt and one retry (max_retries = 1)"
    );
    assert_ne!(
        prefill_rids[0], prefill_rids[1],
        "the retry is a new pair with a new id"
    );
    assert!(
        wait_for(Duration::from_secs(2), || both_aborted(&stack)).await,
        "aborts: {:?}",
        stack.mock.aborts()
    );
    assert!(stack.wait_all_idle(Duration::from_secs(2)).await);
    assert_eq!(
        stack
            .lockstep
            .state
            .stats
            .retries
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );

    // A 4xx is not safe to retry.
    stack.mock.set_fault(Fault::PrefillStatus(400));
    let before = stack.mock.request_count();
    let a = TestClient::default()
        .post(
            &format!("{}/v1/completions", stack.url),
            &json!({"model": MODEL, "prompt": "red"}),
            Duration::from_secs(5),
        )
        .await;
    assert_eq!(a.status, 502);
    let after: Vec<(Role, Value)> = stack.mock.requests()[before..].to_vec();
    assert_eq!(
        after.iter().filter(|(r, _)| *r == Role::Prefill).count(),
        1,
        "no retry after a 400"
    );
}

/// A prefill worker that refuses connections is skipped by the retry, which picks the other one.
/// (It answered the deployment check, then went away.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_failure_retries_on_another_worker() {
    let stack = Stack::start().await;
    let doomed = lockstep_tests::sglang_mock::PdMock::start(
        Default::default(),
        lockstep_tests::tokenizer::build(),
    )
    .await
    .expect("second mock");
    let live = format!(
        "{{ url = \"{}\", bootstrap_port = 8998 }}",
        stack.mock.prefill_url()
    );
    let dead = format!(
        "{{ url = \"{}\", bootstrap_port = 8998 }}",
        doomed.prefill_url()
    );
    let text = stack
        .config_text("", lockstep_tests::harness::TEST_TIMEOUTS)
        .replace(&format!("[{live}]"), &format!("[{dead}, {live}]"));
    let cfg = lockstep_core::config::Config::parse(&text).expect("config");
    assert_eq!(cfg.models[0].prefill.workers.len(), 2);
    let ls = lockstep_router::app::Lockstep::start(cfg)
        .await
        .expect("start");
    // The worker goes away: its port refuses connections from now on.
    drop(doomed);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let url = format!("http://{}/v1/completions", ls.http_addr);
    for _ in 0..4 {
        let a = TestClient::default()
            .post(
                &url,
                &json!({"model": MODEL, "prompt": "red green", "max_tokens": 2}),
                Duration::from_secs(5),
            )
            .await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    assert!(
        ls.state
            .stats
            .retries
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1,
        "round robin hit the dead worker at least once"
    );
}

/// Health checks take an unhealthy worker out (no new pairs, /ready fails) and bring it back. The
/// mock's `/health` takes 1 s, as SGLang 0.5.23's does: workers stay healthy through several
/// checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_checks_gate_readiness_and_routing() {
    let stack = Stack::start().await;
    let c = TestClient::default();
    // Three checks of 1 s each (failure_threshold is 2): a timeout shorter than SGLang's /health
    // would have marked both workers unhealthy by now.
    tokio::time::sleep(Duration::from_millis(3_200)).await;
    assert_eq!(
        c.get(&format!("{}/ready", stack.url), Duration::from_secs(2))
            .await
            .status,
        200
    );
    stack.mock.set_healthy(Role::Decode, false);
    let url = format!("{}/ready", stack.url);
    let mut last = 0;
    for _ in 0..200 {
        last = c.get(&url, Duration::from_secs(2)).await.status;
        if last == 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(last, 503, "decode unhealthy after 2 failed checks");
    let before = stack.mock.request_count();
    let a = c
        .post(
            &format!("{}/v1/completions", stack.url),
            &json!({"model": MODEL, "prompt": "red"}),
            Duration::from_secs(2),
        )
        .await;
    assert_eq!(
        (a.status, a.error_code().as_deref()),
        (503, Some("no_healthy_worker"))
    );
    assert_eq!(
        stack.mock.request_count(),
        before,
        "nothing dispatched without a healthy pair"
    );
    assert_eq!(
        c.get(&format!("{}/health", stack.url), Duration::from_secs(2))
            .await
            .status,
        200,
        "alive regardless"
    );
    stack.mock.set_healthy(Role::Decode, true);
    for _ in 0..200 {
        last = c.get(&url, Duration::from_secs(2)).await.status;
        if last == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(last, 200);
}

/// HTTP/2 with prior knowledge (h2c) is served on the same listener as HTTP/1.1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_on_the_same_listener() {
    let stack = Stack::start().await;
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new());
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "alpha"}], "max_tokens": 4});
    let req = http::Request::post(format!("{}/v1/chat/completions", stack.url))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let resp = client.request(req).await.expect("h2 response");
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    let v: Value = serde_json::from_slice(&bytes).expect("json");
    assert!(
        v.pointer("/choices/0/message/content")
            .and_then(Value::as_str)
            .is_some_and(|s| s.contains("alpha"))
    );
}

/// The idle deadline (gap between decode chunks) and the total deadline each abort both halves,
/// after commit too: a stream gets one error event and no `[DONE]`, a JSON answer a 504.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_total_deadlines_abort_both() {
    for (timeouts, phase_hint) in [
        (
            "total_ms = 20000\nprefill_ms = 5000\nfirst_token_ms = 5000\nidle_ms = 150\nabort_ms = 1000",
            "idle",
        ),
        (
            "total_ms = 600\nprefill_ms = 5000\nfirst_token_ms = 5000\nidle_ms = 5000\nabort_ms = 1000",
            "total",
        ),
    ] {
        for stream in [false, true] {
            let stack = Stack::start_with(MockConfig::default(), "", timeouts).await;
            // 300 ms between tokens: past the idle deadline, and 40 tokens outlast the total one.
            stack.mock.set_fault(Fault::Slow {
                prefill_ms: 0,
                token_ms: 300,
            });
            let body =
                json!({"model": MODEL, "prompt": "red green", "stream": stream, "max_tokens": 40});
            let t = Instant::now();
            let a = TestClient::default()
                .post(
                    &format!("{}/v1/completions", stack.url),
                    &body,
                    Duration::from_secs(10),
                )
                .await;
            let case = format!("{phase_hint} stream={stream}");
            assert!(
                t.elapsed() < Duration::from_secs(3),
                "{case}: took {:?}",
                t.elapsed()
            );
            assert_eq!(
                a.error_code().as_deref(),
                Some("timeout"),
                "{case}: {}",
                a.body
            );
            assert!(
                a.body.contains(phase_hint),
                "{case}: the message names the deadline: {}",
                a.body
            );
            if stream {
                assert!(!a.body.contains("[DONE]"), "{case}");
            } else {
                assert_eq!(a.status, 504, "{case}");
            }
            assert_released(&stack, &case).await;
        }
    }
}

/// An abort that overtakes its half: the decode server registers the request only 300 ms after it
/// arrived, so the first `/abort_request` finds no such rid and is dropped (as SGLang drops it).
/// lockstep keeps the aborted half's request open and sends the abort again until the half's own
/// answer ends; the decode is released instead of waiting 300 s for KV that never comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_that_overtakes_its_half_is_sent_again() {
    let cfg = MockConfig {
        decode_register_delay: Duration::from_millis(300),
        ..MockConfig::default()
    };
    let stack = Stack::start_with(cfg, "", LONG_TIMEOUTS).await;
    stack.mock.set_fault(Fault::PrefillStatus(500));
    let a = TestClient::default()
        .post(
            &format!("{}/v1/completions", stack.url),
            &json!({"model": MODEL, "prompt": "red", "stream": true}),
            Duration::from_secs(5),
        )
        .await;
    assert_eq!(a.status, 502, "{}", a.body);
    // Past the registration delay the decode half exists on the server; it must be released
    // well before SGLang's own notice of the dropped request (2 s after its stream ended) would
    // have done it.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(
        stack.wait_all_idle(Duration::from_millis(900)).await,
        "live: {:?}, aborts: {:?}",
        stack.mock.live_halves(),
        stack.mock.aborts()
    );
    let decode_aborts: Vec<_> = stack
        .mock
        .aborts()
        .into_iter()
        .filter(|a| a.role == Role::Decode)
        .collect();
    assert!(
        decode_aborts.len() >= 2 && !decode_aborts[0].released_live,
        "the first abort overtook the half: {decode_aborts:?}"
    );
    assert!(
        decode_aborts.last().is_some_and(|a| a.released_live),
        "a later abort released it: {decode_aborts:?}"
    );
    let m = TestClient::default()
        .get(&format!("{}/metrics", stack.url), Duration::from_secs(5))
        .await
        .body;
    let resent = format!("lockstep_abort_resent_total{{model=\"{MODEL}\",side=\"decode\"}}");
    assert!(m.contains(&resent), "{m}");
}

/// An abort that never takes (here every `/abort_request` is refused 401: the worker wants an
/// admin key lockstep lacks) is sent again until `abort_confirm_ms`, then the half is dropped and
/// counted unconfirmed: lockstep holds nothing past the bound, and the metric says a half may be
/// stranded on the worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_that_never_takes_is_counted_unconfirmed_at_the_bound() {
    let cfg = MockConfig {
        admin_api_key: Some("k-admin".into()),
        ..MockConfig::default()
    };
    let timeouts = format!("{LONG_TIMEOUTS}\nabort_confirm_ms = 1000");
    let stack = Stack::start_with(cfg, "", &timeouts).await;
    stack.mock.set_fault(Fault::PrefillStatus(500));
    let failed_at = Instant::now();
    let a = TestClient::default()
        .post(
            &format!("{}/v1/completions", stack.url),
            &json!({"model": MODEL, "prompt": "red", "stream": true}),
            Duration::from_secs(5),
        )
        .await;
    assert_eq!(a.status, 502, "{}", a.body);
    let registry = &stack.lockstep.state.registry;
    assert!(
        wait_for(Duration::from_secs(3), || registry.aborts_in_flight() == 0).await,
        "the confirmation is bounded"
    );
    let took = failed_at.elapsed();
    assert!(
        took >= Duration::from_millis(900),
        "kept open until the bound: {took:?}"
    );
    assert!(
        stack
            .mock
            .live_halves()
            .iter()
            .any(|(r, _)| *r == Role::Decode),
        "the worker still holds the decode (its aborts were refused)"
    );
    let m = TestClient::default()
        .get(&format!("{}/metrics", stack.url), Duration::from_secs(5))
        .await
        .body;
    let unconfirmed =
        format!("lockstep_abort_unconfirmed_total{{model=\"{MODEL}\",side=\"decode\"}} 1");
    assert!(m.contains(&unconfirmed), "{m}");
    // The stranded-KV bound for SGLang: the confirmation (1 s) plus SGLang's notice of a client
    // that went away (at most 4 s); the worker lets go of the half within it.
    let bound = format!("lockstep_stranded_kv_bound_seconds{{model=\"{MODEL}\"}} 5");
    assert!(m.contains(&bound), "{m}");
    let left = Duration::from_secs(5).saturating_sub(failed_at.elapsed());
    assert!(
        stack.wait_all_idle(left).await,
        "released within the bound: {:?}",
        stack.mock.live_halves()
    );
}

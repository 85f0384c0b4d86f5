//! Pools whose members change at run time, through the admin API (`POST /admin/workers/add`,
//! `/admin/workers/remove`): a worker that joins gets no pairs until it passes the deployment
//! check together with the verified workers; one that leaves takes no new pairs while the pair it
//! runs finishes; a reload keeps the joined workers; bad changes are refused with the reason.

use std::time::Duration;

use lockstep_tests::client::{self, Answer, Endpoint, TestClient};
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS, wait_for};
use lockstep_tests::sglang_mock::{Fault, MockConfig, PdMock, Role};
use lockstep_tests::tokenizer;
use serde_json::{Value, json};

const KEY: Option<&str> = Some("admin-key");

async fn start() -> Stack {
    Stack::start_with_admin(&TEST_TIMEOUTS.replace("total_ms = 5000", "total_ms = 20000")).await
}

async fn complete(stack: &Stack, prompt: &str, stream: bool, max_tokens: u64) -> Answer {
    let (path, body) = client::request(
        Endpoint::Completions,
        MODEL,
        prompt,
        stream,
        max_tokens,
        &[],
    );
    TestClient::default()
        .post(
            &format!("{}{path}", stack.url),
            &body,
            Duration::from_secs(20),
        )
        .await
}

fn decode_pool(stack: &Stack) -> Vec<(String, String, bool, bool)> {
    stack.pool("decode")
}

async fn change(stack: &Stack, path: &str, body: Value) -> (u16, Value) {
    stack.admin("POST", path, KEY, body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joined_worker_takes_pairs_only_once_it_passes_the_check_with_the_others() {
    let stack = start().await;
    let url = stack.mock.decode_url();
    let url = url.trim_end_matches('/');
    // A second SGLang deployment whose decode runs another KV page size: the fold checks it
    // against the verified workers and refuses it.
    let other = PdMock::start(MockConfig::default(), tokenizer::build())
        .await
        .expect("second mock");
    other.set_server_arg(Role::Decode, "page_size", json!(32));
    let misfit = other.decode_url();
    let misfit = misfit.trim_end_matches('/').to_string();
    let (status, body) = change(
        &stack,
        "/admin/workers/add",
        json!({ "model": MODEL, "side": "decode", "url": misfit }),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["joining"], true, "{body}");
    // It joins, is probed, and stays unverified.
    assert!(
        wait_for(Duration::from_secs(5), || {
            decode_pool(&stack)
                .iter()
                .any(|(u, l, v, j)| *u == misfit && l == "decode-1" && !v && *j)
        })
        .await,
        "{:?}",
        decode_pool(&stack)
    );
    assert!(
        wait_for(Duration::from_secs(5), || other.info_calls() >= 2).await,
        "the joined worker is probed every health interval until it passes"
    );
    // Requests keep going to the verified decode only.
    for i in 0..4 {
        let a = complete(&stack, &format!("red green {i}"), false, 2).await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    assert_eq!(
        other.request_count(),
        0,
        "an unverified worker got a request"
    );
    // The verified decode leaves: the misfit is all that is left, and gets nothing.
    let (status, body) = change(
        &stack,
        "/admin/workers/remove",
        json!({ "model": MODEL, "side": "decode", "url": url }),
    )
    .await;
    assert_eq!((status, &body["leaving"]), (202, &json!(true)), "{body}");
    assert!(
        wait_for(Duration::from_secs(5), || decode_pool(&stack).len() == 1).await,
        "{:?}",
        decode_pool(&stack)
    );
    let before = stack.mock.request_count();
    let a = complete(&stack, "red green", false, 2).await;
    assert_eq!(
        (a.status, a.error_code().as_deref()),
        (503, Some("no_healthy_worker")),
        "{}",
        a.body
    );
    assert_eq!(
        stack.mock.request_count(),
        before,
        "a left worker got a request"
    );
    assert_eq!(other.request_count(), 0);
    // It comes back: checked with the set (it agrees with the prefill), verified, serving; its
    // name is new (`decode-2`), the misfit keeps `decode-1`.
    let (status, _) = change(
        &stack,
        "/admin/workers/add",
        json!({ "model": MODEL, "side": "decode", "url": url }),
    )
    .await;
    assert_eq!(status, 202);
    assert!(
        wait_for(Duration::from_secs(5), || {
            decode_pool(&stack)
                .iter()
                .any(|(u, l, v, _)| u == url && l == "decode-2" && *v)
        })
        .await,
        "{:?}",
        decode_pool(&stack)
    );
    let a = complete(&stack, "red green", false, 2).await;
    assert_eq!(a.status, 200, "{}", a.body);
    // A second add of a member changes nothing.
    let (status, _) = change(
        &stack,
        "/admin/workers/add",
        json!({ "model": MODEL, "side": "decode", "url": url }),
    )
    .await;
    assert_eq!(status, 202);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(decode_pool(&stack).len(), 2, "{:?}", decode_pool(&stack));
    // A reload: the configuration lists the decode that left and came back, so it is a
    // configured member again; the misfit, still joined, is kept and checked again: unverified.
    let (status, body) = stack.admin("POST", "/admin/reload", KEY, Value::Null).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        wait_for(Duration::from_secs(5), || {
            decode_pool(&stack)
                .iter()
                .any(|(u, l, v, j)| u == url && l == "decode-0" && *v && !j)
        })
        .await,
        "{:?}",
        decode_pool(&stack)
    );
    let pool = decode_pool(&stack);
    assert_eq!(pool.len(), 2, "{pool:?}");
    assert!(
        pool.iter().any(|(u, _, v, j)| *u == misfit && !v && *j),
        "{pool:?}"
    );
    let a = complete(&stack, "red green", false, 2).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(other.request_count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_leaves_finishes_the_pair_it_runs() {
    let stack = start().await;
    stack.mock.set_fault(Fault::Slow {
        prefill_ms: 0,
        token_ms: 50,
    });
    let s = stack.url.clone();
    let (path, body) = client::request(Endpoint::Completions, MODEL, "red green", true, 20, &[]);
    let stream = tokio::spawn(async move {
        TestClient::default()
            .post(&format!("{s}{path}"), &body, Duration::from_secs(20))
            .await
    });
    let registry = stack.lockstep.state.registry.clone();
    assert!(wait_for(Duration::from_secs(5), || !registry.is_empty()).await);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let url = stack.mock.decode_url();
    let (status, _) = change(
        &stack,
        "/admin/workers/remove",
        json!({ "model": MODEL, "side": "decode", "url": url }),
    )
    .await;
    assert_eq!(status, 202);
    assert!(wait_for(Duration::from_secs(5), || decode_pool(&stack).is_empty()).await);
    let a = stream.await.expect("task");
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(a.body.contains("[DONE]"), "{}", a.body);
    assert!(!a.body.contains("\"error\""), "{}", a.body);
    assert!(stack.wait_all_idle(Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_membership_changes_are_refused_with_the_reason() {
    let stack = start().await;
    let cases = [
        (
            json!({ "model": "nope", "side": "decode", "url": "http://127.0.0.1:1" }),
            404,
            "model_not_found",
            "nope",
        ),
        (
            json!({ "model": MODEL, "side": "middle", "url": "http://127.0.0.1:1" }),
            400,
            "invalid_request",
            "`middle`",
        ),
        (
            json!({ "model": MODEL, "side": "decode", "url": "ftp://x" }),
            400,
            "invalid_request",
            "expected an http:// or https://host:port URL",
        ),
        (
            json!({ "model": MODEL, "side": "decode", "url": "http://127.0.0.1:1", "extra": 1 }),
            400,
            "invalid_request",
            "extra",
        ),
        (
            json!({ "model": MODEL, "side": "decode" }),
            400,
            "invalid_request",
            "url",
        ),
    ];
    for (body, status, code, why) in cases {
        let (got, answer) = change(&stack, "/admin/workers/add", body.clone()).await;
        assert_eq!(
            (got, answer["error"]["code"].as_str()),
            (status, Some(code)),
            "{body}: {answer}"
        );
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(why), "{body}: {message}");
    }
    // Nothing changed, and a key is needed.
    assert_eq!(decode_pool(&stack).len(), 1);
    let (got, _) = stack
        .admin(
            "POST",
            "/admin/workers/add",
            None,
            json!({ "model": MODEL, "side": "decode", "url": "http://127.0.0.1:1" }),
        )
        .await;
    assert_eq!(got, 401);
    assert_eq!(decode_pool(&stack).len(), 1);
}

//! The admin API on its own listener and key: list live pairs (no content), abort one (both
//! halves, the client gets an error), list workers, drain and undrain a worker (it gets no new
//! pairs; the drain survives a reload), reload the configuration file (applied, or refused with
//! the reasons and the old one kept).

use std::time::{Duration, Instant};

use lockstep_tenancy::tenant::key_hash_hex;
use lockstep_tests::client::{self, Answer, Endpoint, TestClient};
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS};
use lockstep_tests::sglang_mock::{Fault, MockConfig, Role};
use serde_json::{Value, json};

async fn admin(
    stack: &Stack,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Value,
) -> (u16, Value) {
    stack.admin(method, path, key, body).await
}

const KEY: Option<&str> = Some("admin-key");

async fn complete(stack: &Stack, prompt: &str) -> Answer {
    let (path, body) = client::request(Endpoint::Completions, MODEL, prompt, false, 2, &[]);
    TestClient::default()
        .post(
            &format!("{}{path}", stack.url),
            &body,
            Duration::from_secs(10),
        )
        .await
}

async fn start() -> Stack {
    Stack::start_with_admin(
        &TEST_TIMEOUTS
            .replace("idle_ms = 500", "idle_ms = 3000")
            .replace("total_ms = 5000", "total_ms = 20000"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_list_and_abort_pairs() {
    let stack = start().await;
    for key in [None, Some("user-key")] {
        let (status, body) = admin(&stack, "GET", "/admin/pairs", key, Value::Null).await;
        assert_eq!(status, 401, "{body}");
        assert_eq!(body["error"]["code"], "invalid_api_key");
    }
    // A slow committed stream to look at and abort.
    stack.mock.set_fault(Fault::Slow {
        prefill_ms: 0,
        token_ms: 100,
    });
    let (path, body) = client::request(
        Endpoint::Completions,
        MODEL,
        "secret words here",
        true,
        30,
        &[],
    );
    let url = format!("{}{path}", stack.url);
    let stream = tokio::spawn(async move {
        TestClient::default()
            .post(&url, &body, Duration::from_secs(20))
            .await
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    let pair = loop {
        let (status, body) = admin(&stack, "GET", "/admin/pairs", KEY, Value::Null).await;
        assert_eq!(status, 200);
        if let Some(p) = body["pairs"]
            .as_array()
            .and_then(|a| a.first())
            .filter(|p| p["state"] == "committed")
        {
            break p.clone();
        }
        assert!(Instant::now() < deadline, "the stream commits: {body}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // Metadata only: exactly these fields, no prompt or output text anywhere.
    let mut keys: Vec<&str> = pair
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        ["age_ms", "decode", "model", "pair_id", "prefill", "state"]
    );
    assert!(!pair.to_string().contains("secret"));
    assert_eq!(pair["model"], MODEL);
    assert_eq!(pair["prefill"], stack.mock.prefill_url());
    let id = pair["pair_id"].as_str().expect("id").to_string();
    let (status, body) = admin(
        &stack,
        "POST",
        &format!("/admin/pairs/{id}/abort"),
        KEY,
        Value::Null,
    )
    .await;
    assert_eq!((status, &body["aborted"]), (200, &json!(true)), "{body}");
    // The client's stream ends with an error event, never [DONE]; both halves were aborted.
    let a = stream.await.expect("task");
    assert!(a.body.contains("aborted by an operator"), "{}", a.body);
    assert!(!a.body.contains("[DONE]"), "{}", a.body);
    assert!(stack.wait_all_idle(Duration::from_secs(5)).await);
    let roles: Vec<Role> = stack.mock.aborts().iter().map(|r| r.role).collect();
    assert!(
        roles.contains(&Role::Prefill) && roles.contains(&Role::Decode),
        "{roles:?}"
    );
    let m = stack.lockstep.state.metrics.render();
    assert!(m.contains("reason=\"operator\""), "{m}");
    // Unknown and malformed ids.
    let (status, _) = admin(
        &stack,
        "POST",
        &format!("/admin/pairs/{id}/abort"),
        KEY,
        Value::Null,
    )
    .await;
    assert_eq!(status, 404);
    let (status, body) = admin(&stack, "POST", "/admin/pairs/xyz/abort", KEY, Value::Null).await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (400, &json!("invalid_request"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_drain_workers_and_reload_the_config_file() {
    let stack = start().await;
    let (status, body) = admin(&stack, "GET", "/admin/workers", KEY, Value::Null).await;
    assert_eq!(status, 200);
    let workers = body["workers"].as_array().expect("list");
    assert_eq!(workers.len(), 2, "{body}");
    assert!(
        workers
            .iter()
            .all(|w| w["healthy"] == true && w["draining"] == false && w["in_flight"] == 0)
    );
    // Drain the decode worker: no new pairs (the only one), not ready; undrain: serving again.
    let decode = stack.mock.decode_url();
    let (status, _) = admin(
        &stack,
        "POST",
        "/admin/workers/drain",
        KEY,
        json!({ "url": decode }),
    )
    .await;
    assert_eq!(status, 200);
    let a = complete(&stack, "red green").await;
    assert_eq!(
        (a.status, a.error_code().as_deref()),
        (503, Some("no_healthy_worker")),
        "{}",
        a.body
    );
    let ready = TestClient::default()
        .get(&format!("{}/ready", stack.url), Duration::from_secs(5))
        .await;
    assert_eq!(ready.status, 503);
    let (status, _) = admin(
        &stack,
        "POST",
        "/admin/workers/drain",
        KEY,
        json!({ "url": "http://nowhere" }),
    )
    .await;
    assert_eq!(status, 400);

    // A reload keeps the drain, and applies the new file: a smaller context window.
    let text = std::fs::read_to_string(&stack.config_path).expect("config");
    std::fs::write(
        &stack.config_path,
        text.replace("context_window = 512", "context_window = 256"),
    )
    .expect("write");
    let (status, body) = admin(&stack, "POST", "/admin/reload", KEY, Value::Null).await;
    assert_eq!(status, 200, "{body}");
    let (_, body) = admin(&stack, "GET", "/admin/workers", KEY, Value::Null).await;
    let drained: Vec<&Value> = body["workers"]
        .as_array()
        .expect("list")
        .iter()
        .filter(|w| w["draining"] == true)
        .collect();
    assert_eq!(drained.len(), 1, "{body}");
    assert_eq!(drained[0]["url"], decode.as_str());
    let (status, _) = admin(
        &stack,
        "POST",
        "/admin/workers/undrain",
        KEY,
        json!({ "url": decode }),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(complete(&stack, "red green").await.status, 200);
    let long = "word ".repeat(300);
    let a = complete(&stack, &long).await;
    assert_eq!(
        (a.status, a.error_code().as_deref()),
        (400, Some("context_length_exceeded")),
        "{}",
        a.body
    );

    // An invalid file is refused with its reasons; the running configuration stays.
    let text = std::fs::read_to_string(&stack.config_path).expect("config");
    std::fs::write(
        &stack.config_path,
        text.replace("context_window = 256", "context_window = 0"),
    )
    .expect("write");
    let (status, body) = admin(&stack, "POST", "/admin/reload", KEY, Value::Null).await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"]["code"], "reload_refused");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("context_window")),
        "{body}"
    );
    assert_eq!(complete(&stack, "red green").await.status, 200);
    assert_eq!(
        complete(&stack, &long).await.status,
        400,
        "still the 256-token window"
    );
}

/// `server.metrics_on_admin`: `/metrics` leaves the API listener (404 there) and is served on the
/// admin listener behind the admin key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_can_move_behind_the_admin_key() {
    let server = format!(
        "admin_listen = \"127.0.0.1:0\"\nadmin_key_sha256 = \"{}\"\nmetrics_on_admin = true",
        key_hash_hex("admin-key")
    );
    let stack = Stack::start_full(MockConfig::default(), &server, "", TEST_TIMEOUTS).await;
    assert_eq!(complete(&stack, "red").await.status, 200);
    let public = TestClient::default()
        .get(&format!("{}/metrics", stack.url), Duration::from_secs(5))
        .await;
    assert_eq!(public.status, 404, "{}", public.body);
    let addr = stack.lockstep.admin_addr.expect("admin listener");
    let url = format!("http://{addr}/metrics");
    let anonymous = TestClient::default()
        .get(&url, Duration::from_secs(5))
        .await;
    assert_eq!(anonymous.status, 401);
    let a = TestClient::default()
        .send_with(
            "GET",
            &url,
            &[("authorization", "Bearer admin-key")],
            String::new(),
            Duration::from_secs(5),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(
        a.body.contains("lockstep_pairs_started_total"),
        "{}",
        a.body
    );
}

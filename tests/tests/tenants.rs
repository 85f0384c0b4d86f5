//! Tenants over HTTP: a missing or unknown API key gets 401 (with `WWW-Authenticate`), a model the
//! tenant may not use 403, the tenant's concurrency and rate limits 429 with `Retry-After`;
//! `/v1/models` lists only what the key may use; the audit log names the tenant of an aborted
//! pair; the official `openai` client's key is what lockstep checks.

use std::time::Duration;

use lockstep_tenancy::tenant::key_hash_hex;
use lockstep_tests::client::{self, Answer, Endpoint, TestClient};
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS};
use lockstep_tests::sglang_mock::{Fault, MockConfig, Role};
use serde_json::Value;

fn tenants(audit: &std::path::Path) -> String {
    format!(
        r#"audit_log = "{audit}"

[[tenants]]
name = "acme"
api_keys_sha256 = ["{acme}", "{acme2}"]
models = ["{MODEL}"]
requests_per_second = 1
burst = 3
max_concurrent_pairs = 1

[[tenants]]
name = "viewer"
api_keys_sha256 = ["{viewer}"]
models = []
"#,
        audit = audit.display(),
        acme = key_hash_hex("acme-key"),
        acme2 = key_hash_hex("acme-rotated-key"),
        viewer = key_hash_hex("viewer-key"),
    )
}

/// One `[[tenants]]` entry: `name`, holding API key `key`, with `extra` TOML lines.
fn tenant_entry(name: &str, key: &str, extra: &str) -> String {
    format!(
        "\n[[tenants]]\nname = \"{name}\"\napi_keys_sha256 = [\"{}\"]\n{extra}\n",
        key_hash_hex(key)
    )
}

async fn send(stack: &Stack, key: Option<&str>, stream: bool, max_tokens: u64) -> Answer {
    let (path, body) = client::request(
        Endpoint::Completions,
        MODEL,
        "red green blue",
        stream,
        max_tokens,
        &[],
    );
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    TestClient::default()
        .send_with(
            "POST",
            &format!("{}{path}", stack.url),
            &headers,
            body.to_string(),
            Duration::from_secs(20),
        )
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_models_and_limits_are_enforced_per_tenant() {
    let dir = tempfile::tempdir().expect("tempdir");
    let audit = dir.path().join("audit.jsonl");
    let stack = Stack::start_full(MockConfig::default(), &tenants(&audit), "", TEST_TIMEOUTS).await;

    // No key, an unknown key: 401, and nothing reached a worker.
    for key in [None, Some("wrong-key")] {
        let a = send(&stack, key, false, 2).await;
        assert_eq!(a.status, 401, "{}", a.body);
        assert_eq!(a.error_code().as_deref(), Some("invalid_api_key"));
        assert_eq!(
            a.headers.get("www-authenticate").map(|v| v.as_bytes()),
            Some(&b"Bearer"[..])
        );
    }
    assert_eq!(stack.mock.request_count(), 0);
    // A tenant without the model: 403.
    let a = send(&stack, Some("viewer-key"), false, 2).await;
    assert_eq!(a.status, 403, "{}", a.body);
    assert_eq!(a.error_code().as_deref(), Some("model_not_allowed"));
    // /v1/models: per key.
    let models = |key: &'static str| {
        let url = format!("{}/v1/models", stack.url);
        async move {
            let a = TestClient::default()
                .send_with(
                    "GET",
                    &url,
                    &[("x-api-key", key)],
                    "",
                    Duration::from_secs(5),
                )
                .await;
            a.json()["data"].as_array().map(|d| d.len()).unwrap_or(0)
        }
    };
    assert_eq!(
        (models("acme-key").await, models("viewer-key").await),
        (1, 0)
    );

    // acme may run one request at a time: a slow stream holds the slot, a second is refused.
    stack.mock.set_fault(Fault::Slow {
        prefill_ms: 0,
        token_ms: 50,
    });
    let slow = {
        let url = stack.url.clone();
        let (path, body) = client::request(
            Endpoint::Completions,
            MODEL,
            "red green blue",
            true,
            10,
            &[],
        );
        tokio::spawn(async move {
            let a = TestClient::default()
                .send_with(
                    "POST",
                    &format!("{url}{path}"),
                    &[("authorization", "Bearer acme-key")],
                    body.to_string(),
                    Duration::from_secs(20),
                )
                .await;
            (a.status, a.body)
        })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while stack.lockstep.state.registry.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the slow stream started"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let busy = send(&stack, Some("acme-rotated-key"), false, 2).await;
    assert_eq!(busy.status, 429, "{}", busy.body);
    assert_eq!(busy.error_code().as_deref(), Some("rate_limit_exceeded"));
    assert_eq!(
        busy.headers.get("retry-after").map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    assert!(busy.body.contains("concurrent"), "{}", busy.body);
    let (status, body) = slow.await.expect("task");
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("[DONE]"),
        "the permit was held, not the stream cut: {body}"
    );
    // The slot is free again; the burst (3) is then spent by this request, and the next is
    // refused by the rate with a retry hint.
    stack.mock.set_fault(Fault::DecodeStatus(500));
    let failed = send(&stack, Some("acme-key"), false, 2).await;
    assert_eq!(failed.status, 502, "{}", failed.body);
    // Quick requests until the rate refuses one (at 1/s after a burst of 3 it must, within a
    // few; bounded so a broken limiter fails rather than loops).
    let mut limited = None;
    let mut sent = 0;
    while limited.is_none() && sent < 6 {
        let a = send(&stack, Some("acme-key"), false, 2).await;
        sent += 1;
        if a.status == 429 {
            limited = Some(a);
        } else {
            assert_eq!(a.status, 502, "{}", a.body);
        }
    }
    let limited = limited.expect("the rate limit refused a request");
    assert!(limited.body.contains("rate limit"), "{}", limited.body);
    let retry: u64 = limited
        .headers
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("Retry-After");
    assert_eq!(retry, 1);
    assert!(stack.wait_all_idle(Duration::from_secs(10)).await);
    // The audit line of the failed pair names its tenant.
    let text = std::fs::read_to_string(&audit).expect("audit");
    assert_eq!(
        text.lines().count(),
        sent,
        "one line per failed pair: {text}"
    );
    for l in text.lines() {
        let line: Value = serde_json::from_str(l).expect("json");
        assert_eq!(line["tenant"], "acme");
        assert_eq!(line["reason"], "decode_failed");
    }
    // Refusals are counted by code.
    let m = stack.lockstep.state.metrics.render();
    for (code, n) in [
        ("invalid_api_key", 2),
        ("model_not_allowed", 1),
        ("rate_limit_exceeded", 2),
    ] {
        let total: u64 = m
            .lines()
            .filter(|l| {
                l.starts_with("lockstep_admission_refusals_total")
                    && l.contains(&format!("code=\"{code}\""))
            })
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<u64>().ok())
            .sum();
        assert_eq!(total, n, "{code}: {m}");
    }
    // And by tenant, where the key named one (an unknown key names none).
    for (tenant, code, n) in [
        ("acme", "rate_limit_exceeded", 2),
        ("viewer", "model_not_allowed", 1),
    ] {
        let line =
            format!("lockstep_tenant_refusals_total{{code=\"{code}\",tenant=\"{tenant}\"}} {n}");
        assert!(m.lines().any(|l| l == line), "{line}: {m}");
    }
    assert!(
        !m.contains("lockstep_tenant_refusals_total{code=\"invalid_api_key\""),
        "{m}"
    );
}

/// The official `openai` client sends its key as `Authorization: Bearer`; a wrong key surfaces
/// as its `AuthenticationError`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_client_authenticates_with_its_api_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let stack = Stack::start_full(
        MockConfig::default(),
        &tenants(&dir.path().join("a.jsonl")),
        "",
        TEST_TIMEOUTS,
    )
    .await;
    client::run_python_checks(
        "openai_tenants.py",
        &stack.url,
        MODEL,
        Duration::from_secs(60),
        "TENANT CHECKS OK",
    )
    .await;
}

/// The admission stage's order: a tenant's limits are taken before its body is parsed, so a
/// tenant over its rate gets 429 even for a body that would have been refused as malformed (the
/// body is never read into the parser), and a refused request reaches no worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_limits_come_before_the_body_is_parsed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = format!(
        "audit_log = \"{}\"\n{}",
        dir.path().join("a.jsonl").display(),
        tenant_entry("tight", "tight-key", "requests_per_second = 1\nburst = 1")
    );
    let stack = Stack::start_full(MockConfig::default(), &config, "", TEST_TIMEOUTS).await;
    let post = |body: &'static str| {
        let url = format!("{}/v1/completions", stack.url);
        async move {
            TestClient::default()
                .send_with(
                    "POST",
                    &url,
                    &[("authorization", "Bearer tight-key")],
                    body,
                    Duration::from_secs(10),
                )
                .await
        }
    };
    // The one request of the burst: past the limits, then refused by the parser.
    let first = post("{not json").await;
    assert_eq!(first.status, 400, "{}", first.body);
    assert_eq!(first.error_code().as_deref(), Some("invalid_json"));
    // The next, within the second: the rate refuses it before its body is looked at.
    let second = post("{not json").await;
    assert_eq!(second.status, 429, "{}", second.body);
    assert_eq!(second.error_code().as_deref(), Some("rate_limit_exceeded"));
    assert!(second.headers.get("retry-after").is_some());
    assert_eq!(stack.mock.request_count(), 0);
}

/// SGLang namespaces its radix cache by `cache_salt`: lockstep sends the tenant's salt on both
/// halves of every pair, so two tenants' identical prompts never share cached KV on either
/// worker, and one tenant's repeats may.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_halves_carry_the_tenants_cache_salt() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = format!(
        "audit_log = \"{}\"\n{}{}",
        dir.path().join("a.jsonl").display(),
        tenant_entry("red", "red-key", ""),
        tenant_entry("blue", "blue-key", "")
    );
    let stack = Stack::start_full(MockConfig::default(), &config, "", TEST_TIMEOUTS).await;
    for key in ["red-key", "blue-key", "red-key"] {
        let a = send(&stack, Some(key), false, 2).await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    let salts: Vec<(Role, String, String)> = stack
        .mock
        .requests()
        .into_iter()
        .map(|(role, v)| {
            (
                role,
                v["rid"].as_str().expect("rid").to_string(),
                v["cache_salt"]
                    .as_str()
                    .expect("cache_salt is sent")
                    .to_string(),
            )
        })
        .collect();
    assert_eq!(salts.len(), 6, "{salts:?}");
    // Per pair, both halves carry the same salt.
    let per_pair: std::collections::BTreeMap<String, Vec<&str>> =
        salts
            .iter()
            .fold(Default::default(), |mut m, (_, rid, salt)| {
                m.entry(rid.clone()).or_insert_with(Vec::new).push(salt);
                m
            });
    assert_eq!(per_pair.len(), 3);
    for (rid, s) in &per_pair {
        assert!(s.len() == 2 && s[0] == s[1], "pair {rid}: {s:?}");
    }
    let expect = |t: &str| format!("{:016x}", lockstep_tenancy::tenant::cache_salt(Some(t)));
    let sent: std::collections::BTreeSet<&str> = salts.iter().map(|(_, _, s)| s.as_str()).collect();
    assert_eq!(
        sent,
        [expect("red"), expect("blue")]
            .iter()
            .map(String::as_str)
            .collect(),
        "one salt per tenant"
    );
    assert!(salts.iter().any(|(r, ..)| *r == Role::Prefill));
}

/// SGLang's prefix-cache report is not told to tenants (second security review, finding 9):
/// nothing lockstep checks proves a deployment keys its radix cache by `cache_salt`, so a
/// tenant's repeated prompt, a hit the prefill reports (the mock's radix cache follows SGLang's,
/// per salt), is counted in the metrics and answered with `cached_tokens` 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_prefix_hits_stay_in_the_metrics() {
    let config = tenant_entry("red", "red-key", "");
    let stack = Stack::start_full(MockConfig::default(), &config, "", TEST_TIMEOUTS).await;
    let prompt = "red green blue ".repeat(16);
    for _ in 0..2 {
        let a = TestClient::default()
            .send_with(
                "POST",
                &format!("{}/v1/completions", stack.url),
                &[("authorization", "Bearer red-key")],
                serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}).to_string(),
                Duration::from_secs(20),
            )
            .await;
        assert_eq!(a.status, 200, "{}", a.body);
        let told = a.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        assert_eq!(told, 0, "{}", a.body);
    }
    let metrics = stack.lockstep.state.render_metrics();
    let reported: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("lockstep_worker_cached_tokens_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(reported >= 16.0, "the prefill reported its hit: {reported}");
}

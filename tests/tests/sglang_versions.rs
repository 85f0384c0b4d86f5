//! The SGLang settings and versions users meet, each run against the mock configured as such a
//! server (its `/server_info` and behaviour follow SGLang 0.5.23's source, see
//! `lockstep_tests::sglang_mock`): cumulative and incremental streams; the KV checksum on, off
//! and mismatched; the settings lockstep refuses to serve with, each with its reason; and the
//! workers' own prompt limit applied at admission.

use std::time::Duration;

use lockstep_core::config::Config;
use lockstep_router::app::Lockstep;
use lockstep_tests::client::{self, ENDPOINTS, Endpoint, TestClient};
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS, config_text};
use lockstep_tests::sglang_mock::{Fault, MockConfig, PdMock, Role};
use serde_json::{Value, json};

const PROMPT: &str = "red green blue black white";

/// The text an answer carries, whatever the endpoint and mode (SSE deltas joined).
fn answer_text(ep: Endpoint, stream: bool, body: &str, events: &[String]) -> String {
    let pick = |v: &Value| -> String {
        let p = match ep {
            Endpoint::Generate => "/text",
            Endpoint::Completions => "/choices/0/text",
            Endpoint::Chat if stream => "/choices/0/delta/content",
            Endpoint::Chat => "/choices/0/message/content",
        };
        v.pointer(p)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    if !stream {
        return pick(&serde_json::from_str(body).unwrap_or(Value::Null));
    }
    events
        .iter()
        .filter(|e| e.as_str() != "[DONE]")
        .map(|e| pick(&serde_json::from_str(e).unwrap_or(Value::Null)))
        .collect()
}

/// The test prompt to `ep` at `url`, 6 tokens, streamed or not.
async fn ask(url: &str, ep: Endpoint, stream: bool) -> lockstep_tests::client::Answer {
    let (path, body) = client::request(ep, MODEL, PROMPT, stream, 6, &[]);
    TestClient::default()
        .post(&format!("{url}{path}"), &body, Duration::from_secs(10))
        .await
}

fn mock_with(args: Vec<(Role, &'static str, Value)>) -> MockConfig {
    MockConfig {
        server_args: args,
        ..MockConfig::default()
    }
}

/// Every endpoint, streamed and not, through one stack: the texts, in a fixed order.
async fn texts(stack: &Stack) -> Vec<String> {
    let mut out = Vec::new();
    for ep in ENDPOINTS {
        for stream in [false, true] {
            let a = ask(&stack.url, ep, stream).await;
            let case = format!("{ep:?} stream={stream}");
            assert_eq!(a.status, 200, "{case}: {}", a.body);
            assert!(a.error_code().is_none(), "{case}: {}", a.body);
            let text = answer_text(ep, stream, &a.body, &a.sse_events());
            assert!(!text.is_empty(), "{case}: no text: {}", a.body);
            out.push(text);
        }
    }
    out
}

/// SGLang streams cumulative text by default and disjoint deltas with
/// `--incremental-streaming-output`; lockstep reads the mode from `/server_info` and gives the
/// same answers in both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cumulative_and_incremental_streams_give_the_same_answers() {
    let cumulative = Stack::start().await;
    let want = texts(&cumulative).await;
    // The mock echoes the prompt: the answer is the caller's own words, whole.
    assert!(want[0].contains("red green blue"), "{want:?}");
    let incremental = Stack::start_with(
        mock_with(vec![(
            Role::Decode,
            "incremental_streaming_output",
            json!(true),
        )]),
        "",
        TEST_TIMEOUTS,
    )
    .await;
    assert_eq!(texts(&incremental).await, want);
}

/// A worker restarted in the other stream mode after the check fails its pairs with an error
/// instead of garbling the text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_in_an_unverified_mode_fails_closed() {
    let stack = Stack::start().await;
    stack
        .mock
        .set_server_arg(Role::Decode, "incremental_streaming_output", json!(true));
    for ep in ENDPOINTS {
        for stream in [false, true] {
            let a = ask(&stack.url, ep, stream).await;
            let case = format!("{ep:?} stream={stream}");
            assert_eq!(
                a.error_code().as_deref(),
                Some("decode_failed"),
                "{case}: {}",
                a.body
            );
            assert!(!a.body.contains("[DONE]"), "{case}: {}", a.body);
        }
    }
    assert!(stack.wait_all_idle(Duration::from_secs(10)).await);
}

/// Starts lockstep in front of `mock` with `model_extra`; the error when it refuses.
async fn start_error(mock: &PdMock, model_extra: &str) -> Option<String> {
    let dir = tempfile::tempdir().expect("tempdir");
    let tok = dir.path().join("tokenizer.json");
    lockstep_tests::tokenizer::write(&tok).expect("tokenizer");
    let text = config_text(mock, &tok, model_extra, TEST_TIMEOUTS);
    let cfg = Config::parse(&text).expect("config");
    Lockstep::start(cfg).await.err()
}

async fn mock(args: Vec<(Role, &'static str, Value)>) -> PdMock {
    PdMock::start(mock_with(args), lockstep_tests::tokenizer::build())
        .await
        .expect("mock")
}

/// lockstep serves SGLang only with the KV checksum on at both ends and the layouts it needs
/// equal; each refusal names the worker and the reason. `require_kv_checksum = false` waives
/// the checksum (and `Config::warnings`, which `lockstep check` prints, calls it UNSAFE).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deployment_check_refuses_what_would_leave_kv_unverified() {
    let cases: Vec<(Role, &'static str, Value, &str)> = vec![
        (
            Role::Decode,
            "disaggregation_enable_kv_checksum",
            json!(false),
            "--disaggregation-enable-kv-checksum",
        ),
        (
            Role::Prefill,
            "disaggregation_enable_kv_checksum",
            json!(false),
            "--disaggregation-enable-kv-checksum",
        ),
        (Role::Decode, "page_size", json!(64), "page_size = 64"),
        (Role::Decode, "tp_size", json!(2), "tp_size = 2"),
        (
            Role::Decode,
            "skip_tokenizer_init",
            json!(true),
            "skip_tokenizer_init",
        ),
        (
            Role::Prefill,
            "disaggregation_mode",
            json!("null"),
            "disaggregation_mode",
        ),
        (
            Role::Decode,
            "disaggregation_transfer_backend",
            json!("fake"),
            "`fake`",
        ),
        (
            Role::Prefill,
            "disaggregation_bootstrap_port",
            json!(9000),
            "port 9000",
        ),
    ];
    for (role, key, value, why) in cases {
        let m = mock(vec![(role, key, value.clone())]).await;
        let e = start_error(&m, "")
            .await
            .unwrap_or_else(|| panic!("{key} = {value} on {role:?} was accepted"));
        assert!(e.contains(why), "{key}: {e}");
        assert_eq!(m.request_count(), 0, "nothing was dispatched");
    }
    // Waived: the checksum may be off, a corrupted transfer then goes unnoticed (what SGLang
    // without its checksum gives; nothing else verifies SGLang's KV content).
    let waiver = "[models.sglang]\nrequire_kv_checksum = false";
    let m = mock(vec![(
        Role::Decode,
        "disaggregation_enable_kv_checksum",
        json!(false),
    )])
    .await;
    assert_eq!(start_error(&m, waiver).await, None);
    // What the waiver costs: with the checksum off at one end SGLang verifies nothing, and a
    // corrupted transfer is served as a 200 with the wrong content (the mock's decode echoes
    // the KV it read: one token of the prompt came through altered).
    let waived = Stack::start_with(
        mock_with(vec![(
            Role::Decode,
            "disaggregation_enable_kv_checksum",
            json!(false),
        )]),
        waiver,
        TEST_TIMEOUTS,
    )
    .await;
    waived.mock.set_fault(Fault::KvCorrupt);
    let (path, body) = client::request(Endpoint::Generate, MODEL, PROMPT, false, 5, &[]);
    let a = TestClient::default()
        .post(
            &format!("{}{path}", waived.url),
            &body,
            Duration::from_secs(10),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    let text = a.json()["text"].as_str().unwrap_or_default().to_string();
    assert_ne!(text, PROMPT, "the corrupted KV shows in the answer: {text}");
    assert!(text.ends_with("green blue black white"), "{text}");
    let text = config_text(&m, std::path::Path::new("/t.json"), waiver, TEST_TIMEOUTS);
    let warnings = Config::parse(&text).expect("config").warnings();
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("require_kv_checksum") && w.contains("UNSAFE")),
        "{warnings:?}"
    );
}

/// lockstep started before its workers: configured for a prefill and a decode on two free
/// loopback ports nothing listens on yet.
async fn start_before_workers() -> (
    Lockstep,
    std::net::SocketAddr,
    std::net::SocketAddr,
    tempfile::TempDir,
) {
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
    };
    let (p, d) = (free(), free());
    let placeholder = mock(vec![]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let tok = dir.path().join("tokenizer.json");
    lockstep_tests::tokenizer::write(&tok).expect("tokenizer");
    let text = config_text(&placeholder, &tok, "", TEST_TIMEOUTS)
        .replace(&placeholder.prefill_url(), &format!("http://{p}"))
        .replace(&placeholder.decode_url(), &format!("http://{d}"));
    drop(placeholder);
    let ls = Lockstep::start(Config::parse(&text).expect("config"))
        .await
        .expect("starts without its workers");
    (ls, p, d, dir)
}

/// Workers that do not answer yet (lockstep started first, as it may be in a cluster) get no
/// pairs until they answer and pass the deployment check: requests get `no_healthy_worker` and
/// `/ready` fails; once the workers are up and verified, the model serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_that_answer_later_serve_once_verified() {
    let (ls, p, d, _dir) = start_before_workers().await;
    let url = format!("http://{}", ls.http_addr);
    let c = TestClient::default();
    assert_eq!(
        c.get(&format!("{url}/ready"), Duration::from_secs(2))
            .await
            .status,
        503
    );
    let a = ask(&url, Endpoint::Completions, false).await;
    assert_eq!(
        a.error_code().as_deref(),
        Some("no_healthy_worker"),
        "{}",
        a.body
    );
    // The workers come up where the configuration points.
    let m = PdMock::start_on(
        MockConfig::default(),
        lockstep_tests::tokenizer::build(),
        p,
        d,
    )
    .await
    .expect("mock on the configured ports");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut last = 0;
    while tokio::time::Instant::now() < deadline {
        last = c
            .get(&format!("{url}/ready"), Duration::from_secs(2))
            .await
            .status;
        if last == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(last, 200, "verified and ready");
    let a = ask(&url, Endpoint::Completions, false).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(m.request_count() >= 2);
}

/// A worker that comes up with settings lockstep refuses stays out of rotation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_answers_later_with_the_checksum_off_stays_out() {
    let (ls, p, d, _dir) = start_before_workers().await;
    let url = format!("http://{}", ls.http_addr);
    let m = PdMock::start_on(
        mock_with(vec![(
            Role::Decode,
            "disaggregation_enable_kv_checksum",
            json!(false),
        )]),
        lockstep_tests::tokenizer::build(),
        p,
        d,
    )
    .await
    .expect("mock");
    // Until lockstep has probed the workers twice, so the first probe's verdict is in (bounded):
    // a check that never probed, or that let the worker in, fails here or below.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while m.info_calls() < 4 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "lockstep probed {} times",
            m.info_calls()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let a = ask(&url, Endpoint::Completions, false).await;
    assert_eq!(
        a.error_code().as_deref(),
        Some("no_healthy_worker"),
        "{}",
        a.body
    );
    let ready = TestClient::default()
        .get(&format!("{url}/ready"), Duration::from_secs(2))
        .await;
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert_eq!(m.request_count(), 0, "no pair reached the refused worker");
}

/// The checksum on at both ends: a corrupted transfer is SGLang's "KV checksum mismatch" abort,
/// which lockstep reports as `integrity_violation` (stream or not, every endpoint), audits and
/// counts, with both halves aborted and nothing held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checksum_mismatch_is_an_integrity_violation() {
    let stack = Stack::start().await;
    stack.mock.set_fault(Fault::KvCorrupt);
    for ep in ENDPOINTS {
        for stream in [false, true] {
            let before = stack.mock.request_count();
            let a = ask(&stack.url, ep, stream).await;
            let case = format!("{ep:?} stream={stream}");
            assert_eq!(
                a.error_code().as_deref(),
                Some("integrity_violation"),
                "{case}: {}",
                a.body
            );
            assert!(
                !a.body.contains("red"),
                "{case}: content leaked: {}",
                a.body
            );
            assert!(stack.wait_all_idle(Duration::from_secs(10)).await, "{case}");
            let rid = stack.mock.requests()[before]
                .1
                .get("rid")
                .and_then(Value::as_str)
                .map(str::to_string)
                .expect("dispatched");
            let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
            let both = || {
                let a = stack.mock.aborts();
                [Role::Prefill, Role::Decode]
                    .iter()
                    .all(|r| a.iter().any(|x| x.rid == rid && x.role == *r))
            };
            while !both() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(
                both(),
                "{case}: both halves aborted: {:?}",
                stack.mock.aborts()
            );
        }
    }
    let metrics = TestClient::default()
        .get(&format!("{}/metrics", stack.url), Duration::from_secs(5))
        .await
        .body;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("lockstep_integrity_violations_total") && l.ends_with(" 6")),
        "{metrics}"
    );
}

/// SGLang refuses `len(input_ids) >= max_req_input_len`; lockstep applies that limit at
/// admission (a clear 400 before any worker is asked), not the looser KV capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_uses_the_workers_prompt_limit() {
    let stack = Stack::start_with(
        mock_with(vec![(Role::Decode, "max_req_input_len", json!(12))]),
        "",
        TEST_TIMEOUTS,
    )
    .await;
    let ids = |n: usize| json!({ "input_ids": (0..n).map(|i| 40 + i as u32).collect::<Vec<_>>(), "sampling_params": { "max_new_tokens": 2 } });
    let c = TestClient::default();
    let url = format!("{}/generate", stack.url);
    let a = c.post(&url, &ids(11), Duration::from_secs(10)).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let before = stack.mock.request_count();
    let a = c.post(&url, &ids(12), Duration::from_secs(10)).await;
    assert_eq!(a.status, 400, "{}", a.body);
    assert_eq!(a.error_code().as_deref(), Some("context_length_exceeded"));
    assert!(a.body.contains("at most 11 tokens"), "{}", a.body);
    assert_eq!(stack.mock.request_count(), before, "not dispatched");
}

/// Workers started with `--api-key` and `--admin-api-key` answer 401 to everything but
/// `/health`: without the pool's keys lockstep refuses to start, saying which key; with them,
/// every call carries the right one (the API key on `/server_info` and `/generate`, the admin
/// key on `/abort_request`) and nothing is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_credentials_reach_every_call() {
    let m = PdMock::start(
        MockConfig {
            api_key: Some("k-user".into()),
            admin_api_key: Some("k-admin".into()),
            ..MockConfig::default()
        },
        lockstep_tests::tokenizer::build(),
    )
    .await
    .expect("mock");
    let e = start_error(&m, "").await.expect("refused without keys");
    assert!(e.contains("401") && e.contains("api_key"), "{e}");
    let dir = tempfile::tempdir().expect("tempdir");
    let tok = dir.path().join("tokenizer.json");
    lockstep_tests::tokenizer::write(&tok).expect("tokenizer");
    let keys = "api_key = \"k-user\"\nadmin_api_key = \"k-admin\"\nworkers =";
    let text = config_text(&m, &tok, "", TEST_TIMEOUTS).replace("workers =", keys);
    let cfg = Config::parse(&text).expect("config");
    // Keys never show in the configuration's debug form (logs).
    assert!(!format!("{cfg:?}").contains("k-user"));
    let ls = Lockstep::start(cfg).await.expect("starts with the keys");
    let refused_before = m.unauthorized().len();
    let url = format!("http://{}", ls.http_addr);
    for stream in [false, true] {
        let (path, body) = client::request(Endpoint::Chat, MODEL, PROMPT, stream, 4, &[]);
        let a = TestClient::default()
            .post(&format!("{url}{path}"), &body, Duration::from_secs(10))
            .await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    // A failed pair's aborts reach both workers with the admin key and release what they hold.
    m.set_fault(Fault::DecodeStatus(500));
    let before = m.request_count();
    let (path, body) = client::request(Endpoint::Generate, MODEL, PROMPT, false, 4, &[]);
    let a = TestClient::default()
        .post(&format!("{url}{path}"), &body, Duration::from_secs(10))
        .await;
    assert_eq!(
        a.error_code().as_deref(),
        Some("decode_failed"),
        "{}",
        a.body
    );
    let rid = m.requests()[before]
        .1
        .get("rid")
        .and_then(Value::as_str)
        .map(str::to_string)
        .expect("dispatched");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while m.aborts().iter().filter(|r| r.rid == rid).count() < 2
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        m.aborts().iter().filter(|r| r.rid == rid).count(),
        2,
        "{:?}",
        m.aborts()
    );
    assert!(m.wait_idle(Duration::from_secs(10)).await, "released");
    assert_eq!(
        m.unauthorized().len(),
        refused_before,
        "refused: {:?}",
        m.unauthorized()
    );
}

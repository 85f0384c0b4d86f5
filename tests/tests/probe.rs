//! `lockstep probe` end to end: through a naive PD front over the SGLang mock with the incident's
//! fault it finds another request's secret (exit 1); through lockstep over the same mock and
//! fault it finds none (exit 0) and nothing is left behind; it catches an over-long prompt
//! answered as if it fit; it tells "nothing answered" (exit 2) from "answered badly"; and it
//! speaks lockstep's gRPC API and serves its metrics while it runs.

use std::time::Duration;

use lockstep_probe::{ProbeArgs, Report};
use lockstep_tests::client::TestClient;
use lockstep_tests::harness::{Stack, TEST_TIMEOUTS};
use lockstep_tests::naive_front;
use lockstep_tests::sglang_mock::{Fault, MockConfig, PdMock};
use lockstep_tests::tokenizer;

fn args(target: &str) -> ProbeArgs {
    ProbeArgs {
        target: target.to_string(),
        model: None,
        api_keys: Vec::new(),
        api_key_file: None,
        endpoints: Vec::new(),
        duration: None,
        once: true,
        concurrency: 4,
        long_prompt_words: None,
        metrics_listen: None,
        grpc: false,
    }
}

/// Probes for `secs` seconds, switching the mock to the incident's fault after `healthy`.
async fn probe_through_fault(a: ProbeArgs, mock: &PdMock, healthy: Duration) -> Report {
    let run = tokio::spawn(lockstep_probe::probe(a));
    tokio::time::sleep(healthy).await;
    mock.set_fault(Fault::PrefillInBandAbortDecoy);
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("probe ends in time")
        .expect("probe task")
}

/// The naive PD front over the SGLang mock, both on the canary tokenizer.
async fn naive() -> (PdMock, naive_front::NaiveFront) {
    let tok = tokenizer::build_canary();
    let mock = PdMock::start(MockConfig::default(), tok.clone())
        .await
        .expect("mock");
    let front = naive_front::start(mock.prefill_url(), mock.decode_url(), tok).await;
    (mock, front)
}

/// lockstep in front of the SGLang mock, both on the canary tokenizer.
async fn canary_stack() -> Stack {
    Stack::start_with_tokenizer(
        tokenizer::build_canary(),
        MockConfig::default(),
        "",
        "",
        TEST_TIMEOUTS,
    )
    .await
}

/// Column `n` (counting the row name's two words) of the report's row `row`: 3 is `completed`,
/// 6 `leaks`.
fn row_column(report: &str, row: &str, n: usize) -> u64 {
    report
        .lines()
        .find(|l| l.starts_with(row))
        .and_then(|l| l.split_whitespace().nth(n))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn rows_completed(report: &str, row: &str) -> u64 {
    row_column(report, row, 3)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probe_finds_the_incident_through_a_naive_front_and_nothing_through_lockstep() {
    // The naive front: healthy traffic fills the mock's pages with secrets, then the fault makes
    // decodes read stale pages, and another request's secret comes back with a 200.
    let (mock, front) = naive().await;
    let mut a = args(&front.url);
    a.once = false;
    a.duration = Some(4);
    let r = probe_through_fault(a, &mock, Duration::from_millis(1500)).await;
    assert_eq!(r.code, 1, "{}", r.text);
    // Chat leaks too (counted in its rows: the listed leaks are only the first 20 found).
    assert!(
        ["chat json", "chat stream"]
            .iter()
            .map(|row| row_column(&r.text, row, 6))
            .sum::<u64>()
            > 0,
        "{}",
        r.text
    );
    assert!(
        r.text.contains("generate json") && r.text.contains("skipped: answered 404"),
        "{}",
        r.text
    );
    drop(front);

    // lockstep over the same kind of mock and the same fault: errors, never foreign content.
    let stack = canary_stack().await;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("free port");
        l.local_addr().expect("addr").port()
    };
    let mut a = args(&stack.url);
    a.once = false;
    a.duration = Some(4);
    a.metrics_listen = Some(format!("127.0.0.1:{port}").parse().expect("addr"));
    let run = tokio::spawn(lockstep_probe::probe(a));
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // Served while the probe runs.
    let m = TestClient::default()
        .get(
            &format!("http://127.0.0.1:{port}/metrics"),
            Duration::from_secs(5),
        )
        .await;
    assert_eq!(m.status, 200);
    assert!(
        m.body.contains("lockstep_probe_requests_total{endpoint="),
        "{}",
        m.body
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    stack.mock.set_fault(Fault::PrefillInBandAbortDecoy);
    let r = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("probe ends in time")
        .expect("probe task");
    assert_eq!(r.code, 0, "{}", r.text);
    assert!(
        r.text
            .contains("leaks (another request's secret in an answer): 0"),
        "{}",
        r.text
    );
    // It did probe: short requests completed before the fault, and the fault was refused.
    assert!(rows_completed(&r.text, "chat json") > 0, "{}", r.text);
    assert!(
        r.text.contains("http_5xx") || r.text.contains("http_4xx"),
        "{}",
        r.text
    );
    // lockstep's over-long refusals: its /v1/models gives max_model_len (512), so 513 words.
    assert!(
        r.text.contains("over-long prompts: 513 words"),
        "{}",
        r.text
    );
    assert!(
        r.text.contains("0 completed (each a failure)"),
        "{}",
        r.text
    );
    // Nothing is held afterwards, by lockstep or the workers: under this fault an abort can
    // overtake its decode request on another connection, and lockstep sends it again until the
    // half's answer ends.
    assert!(
        stack.wait_all_idle(Duration::from_secs(10)).await,
        "live: {:?}, aborts: {:?}",
        stack.mock.live_halves(),
        stack
            .mock
            .aborts()
            .iter()
            .filter(|a| !a.released_live)
            .count()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_long_prompt_answered_as_if_it_fit_fails_the_probe() {
    let (_mock, front) = naive().await;
    let mut a = args(&front.url);
    a.concurrency = 1;
    a.long_prompt_words = Some(600);
    let r = lockstep_probe::probe(a.clone()).await;
    assert_eq!(r.code, 1, "{}", r.text);
    assert!(
        !r.text.contains("0 completed (each a failure)"),
        "{}",
        r.text
    );
    assert!(
        r.text
            .contains("leaks (another request's secret in an answer): 0"),
        "{}",
        r.text
    );
    // The same prompts through lockstep (context window 512) are refused: exit 0.
    let stack = canary_stack().await;
    a.target = stack.url.clone();
    let r = lockstep_probe::probe(a).await;
    assert_eq!(r.code, 0, "{}", r.text);
    assert!(
        r.text.contains("0 completed (each a failure)"),
        "{}",
        r.text
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_2_only_when_nothing_answered() {
    // A port nobody listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("free port");
        l.local_addr().expect("addr").port()
    };
    let mut a = args(&format!("http://127.0.0.1:{port}"));
    a.model = Some("m".into());
    let r = lockstep_probe::probe(a).await;
    assert_eq!(r.code, 2, "{}", r.text);
    assert!(r.text.contains("no response ever arrived"), "{}", r.text);

    // A server whose model list is not JSON and which serves none of the endpoints: it answered,
    // so with --model given this is not "unreachable", but nothing was verified (exit 3).
    let app = axum::Router::new().route(
        "/v1/models",
        axum::routing::get(|| async { "<html>not a model list</html>" }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let mut a = args(&url);
    a.model = Some("m".into());
    let r = lockstep_probe::probe(a).await;
    assert_eq!(r.code, 3, "{}", r.text);
    assert!(
        r.text.contains("chat json") && r.text.contains("skipped"),
        "{}",
        r.text
    );
    assert!(r.text.contains("NOT VERIFIED"), "{}", r.text);
    // Without --model it cannot probe, but the target answered: not exit 2, and not "no leak".
    let r = lockstep_probe::probe(args(&url)).await;
    assert_eq!(r.code, 3, "{}", r.text);
    assert!(r.text.contains("give --model"), "{}", r.text);
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probe_speaks_locksteps_grpc_api() {
    let stack = canary_stack().await;
    let mut a = args(&stack.url);
    a.grpc = true;
    let r = lockstep_probe::probe(a).await;
    assert_eq!(r.code, 0, "{}", r.text);
    assert!(rows_completed(&r.text, "chat grpc") > 0, "{}", r.text);
    assert!(rows_completed(&r.text, "generate grpc") > 0, "{}", r.text);
    assert!(
        r.text.contains("over-long prompts: 513 words"),
        "{}",
        r.text
    );
    assert!(r.text.contains("grpc_refused"), "{}", r.text);
    assert!(stack.wait_all_idle(Duration::from_secs(10)).await);
}

/// A prober that verified nothing fails loudly (second security review, finding 5): against
/// lockstep with tenants, without a key every request is a 401, and the probe exits 3 naming the
/// endpoints it never verified, not 0 and "no foreign content"; with the key read from a file (not
/// argv) it verifies every endpoint and exits 0; an endpoint the target does not serve fails the
/// run unless the operator leaves it out with `--endpoint`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_that_verified_nothing_exits_3() {
    let key = "probe-tenant-key";
    let tenants = format!(
        "\n[[tenants]]\nname = \"ops\"\napi_keys_sha256 = [\"{}\"]\n",
        lockstep_tenancy::tenant::key_hash_hex(key)
    );
    let stack = Stack::start_with_tokenizer(
        tokenizer::build_canary(),
        MockConfig::default(),
        &tenants,
        "",
        TEST_TIMEOUTS,
    )
    .await;
    let mut a = args(&stack.url);
    a.model = Some(lockstep_tests::harness::MODEL.into());
    let r = lockstep_probe::probe(a.clone()).await;
    assert_eq!(r.code, 3, "{}", r.text);
    assert!(r.text.contains("NOT VERIFIED"), "{}", r.text);
    for row in [
        "chat json",
        "chat stream",
        "completions json",
        "generate stream",
    ] {
        assert!(r.text.contains(row), "{row}: {}", r.text);
    }
    assert_eq!(r.totals.completed, 0, "{}", r.text);
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("keys");
    std::fs::write(&file, format!("# the ops tenant\n\n{key}\n")).expect("write keys");
    a.api_key_file = Some(file);
    let r = lockstep_probe::probe(a.clone()).await;
    assert_eq!(r.code, 0, "{}", r.text);
    assert!(r.text.contains("no foreign content seen"), "{}", r.text);
    assert!(stack.wait_all_idle(Duration::from_secs(10)).await);

    // The naive front serves chat and completions, not `/generate`: exit 3 while generate is
    // expected, 0 once `--endpoint` names what it serves.
    let (_mock, front) = naive().await;
    let mut a = args(&front.url);
    a.model = Some("m".into());
    a.concurrency = 1;
    let r = lockstep_probe::probe(a.clone()).await;
    assert_eq!(r.code, 3, "{}", r.text);
    assert!(
        r.text
            .contains("NOT VERIFIED: no request completed on generate json, generate stream"),
        "{}",
        r.text
    );
    a.endpoints = vec![
        lockstep_probe::plan::Api::Chat,
        lockstep_probe::plan::Api::Completions,
    ];
    let r = lockstep_probe::probe(a).await;
    assert_eq!(r.code, 0, "{}", r.text);
    assert!(!r.text.contains("generate"), "{}", r.text);
    assert!(rows_completed(&r.text, "chat json") > 0, "{}", r.text);
}

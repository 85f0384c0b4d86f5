//! What an operator sees: `/metrics` (validated by `promtool check metrics`) counts every pair's
//! outcome by reason and side, refusals, integrity violations, the barrier wait, first-token and
//! inter-token latency and the abort-both latency, and shows each worker's load and health; the
//! audit log has one JSON line per aborted pair and per integrity event with ids, workers and
//! timings, and never a word of any prompt.

use std::time::Duration;

use lockstep_tests::client::{self, Endpoint, TestClient};
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS};
use lockstep_tests::sglang_mock::{Fault, MockConfig};
use serde_json::Value;

const SECRET: &str = "secret password billing account";

/// The value of one sample (`name{labels}`); a missing series fails the test (a metric that
/// disappeared must not read as 0).
fn sample(text: &str, name_and_labels: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            (k == name_and_labels).then(|| v.parse().ok())?
        })
        .unwrap_or_else(|| panic!("no series `{name_and_labels}` in:\n{text}"))
}

/// Every sample of a metric name (any labels).
fn samples(text: &str, name: &str) -> Vec<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            let base = k.split('{').next()?;
            (base == name).then(|| v.parse::<f64>().ok())?
        })
        .collect()
}

/// The sum of every sample of a metric name; a metric with no series fails the test.
fn total(text: &str, name: &str) -> f64 {
    let all = samples(text, name);
    assert!(!all.is_empty(), "no series of `{name}` in:\n{text}");
    all.iter().sum()
}

async fn scrape(stack: &Stack) -> String {
    let a = TestClient::default()
        .get(&format!("{}/metrics", stack.url), Duration::from_secs(5))
        .await;
    assert_eq!(a.status, 200);
    a.body
}

fn promtool(text: &str) {
    use std::io::Write;
    let child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            assert!(
                std::env::var("LOCKSTEP_REQUIRE_PROMTOOL").as_deref() != Ok("1"),
                "promtool required: {e}"
            );
            eprintln!("skipped promtool: {e}");
            return;
        }
    };
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("promtool runs");
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn call(stack: &Stack, ep: Endpoint, prompt: &str, stream: bool, max_tokens: u64) -> u16 {
    let (path, body) = client::request(ep, MODEL, prompt, stream, max_tokens, &[]);
    TestClient::default()
        .post(
            &format!("{}{path}", stack.url),
            &body,
            Duration::from_secs(20),
        )
        .await
        .status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_audit_log_account_for_every_pair() {
    let dir = tempfile::tempdir().expect("tempdir");
    let audit = dir.path().join("logs/audit.jsonl");
    let stack = Stack::start_full(
        MockConfig::default(),
        &format!("audit_log = \"{}\"", audit.display()),
        "",
        TEST_TIMEOUTS,
    )
    .await;
    let m0 = scrape(&stack).await;
    promtool(&m0);
    assert_eq!(total(&m0, "lockstep_pairs_started_total"), 0.0);
    assert_eq!(
        sample(
            &m0,
            &format!(
                "lockstep_worker_healthy{{model=\"{MODEL}\",side=\"prefill\",worker=\"prefill-0\"}}",
            )
        ),
        1.0
    );
    // Workers are named by their place in the configuration, never by their address.
    for url in [stack.mock.prefill_url(), stack.mock.decode_url()] {
        let host = url.trim_start_matches("http://").to_string();
        assert!(!m0.contains(&host), "{host} in /metrics");
    }

    // Three successes (one streamed), all carrying the secret words.
    for (ep, stream) in [
        (Endpoint::Completions, false),
        (Endpoint::Chat, true),
        (Endpoint::Generate, false),
    ] {
        assert_eq!(call(&stack, ep, SECRET, stream, 4).await, 200);
    }
    // Refused before dispatch: over the context window, and an unknown model.
    let long = "word ".repeat(600);
    assert_eq!(
        call(&stack, Endpoint::Completions, &long, false, 4).await,
        400
    );
    let unknown = TestClient::default()
        .post(
            &format!("{}/v1/completions", stack.url),
            &serde_json::json!({"model": "nope", "prompt": "x"}),
            Duration::from_secs(5),
        )
        .await;
    assert_eq!(unknown.status, 404);
    // Failures: an integrity violation on each side's count, and a decode error.
    for fault in [
        Fault::PrefillCountMismatch,
        Fault::DecodeCountMismatch,
        Fault::DecodeStatus(500),
    ] {
        stack.mock.set_fault(fault);
        assert_ne!(
            call(&stack, Endpoint::Completions, SECRET, false, 4).await,
            200
        );
    }
    stack.mock.set_fault(Fault::None);
    assert!(stack.wait_all_idle(Duration::from_secs(10)).await);
    // The abort-both latency is observed when both aborts are answered: let them land.
    let mut m = scrape(&stack).await;
    for _ in 0..50 {
        if samples(&m, "lockstep_abort_both_seconds_count")
            .iter()
            .sum::<f64>()
            >= 3.0
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        m = scrape(&stack).await;
    }
    promtool(&m);
    let model = format!("model=\"{MODEL}\"");
    let started = sample(&m, &format!("lockstep_pairs_started_total{{{model}}}"));
    let completed = sample(&m, &format!("lockstep_pairs_completed_total{{{model}}}"));
    let aborted = total(&m, "lockstep_pairs_aborted_total");
    assert_eq!((started, completed, aborted), (6.0, 3.0, 3.0), "{m}");
    for (reason, side, n) in [("integrity", "none", 2.0), ("decode_failed", "decode", 1.0)] {
        assert_eq!(
            sample(
                &m,
                &format!(
                    "lockstep_pairs_aborted_total{{{model},reason=\"{reason}\",side=\"{side}\"}}"
                )
            ),
            n,
            "{reason}/{side}: {m}"
        );
    }
    for kind in ["prefill_prompt_count", "decode_prompt_count"] {
        assert_eq!(
            sample(
                &m,
                &format!("lockstep_integrity_violations_total{{kind=\"{kind}\",{model}}}")
            ),
            1.0,
            "{kind}: {m}"
        );
    }
    assert_eq!(
        sample(
            &m,
            &format!(
                "lockstep_admission_refusals_total{{code=\"context_length_exceeded\",{model}}}"
            )
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        sample(
            &m,
            "lockstep_admission_refusals_total{code=\"model_not_found\",model=\"\"}"
        ),
        1.0,
        "{m}"
    );
    // One barrier wait and one first token per committed pair; inter-token gaps after that.
    for h in [
        "lockstep_commit_barrier_wait_seconds_count",
        "lockstep_time_to_first_token_seconds_count",
    ] {
        assert_eq!(sample(&m, &format!("{h}{{{model}}}")), 3.0, "{h}: {m}");
    }
    assert!(
        sample(
            &m,
            &format!("lockstep_inter_token_seconds_count{{{model}}}")
        ) >= 3.0
    );
    assert_eq!(
        sample(&m, &format!("lockstep_abort_both_seconds_count{{{model}}}")),
        3.0,
        "{m}"
    );
    assert_eq!(total(&m, "lockstep_worker_inflight_pairs"), 0.0);

    // The audit log: one pair_aborted line per aborted pair, an integrity_violation line per
    // integrity failure, metadata only.
    let text = std::fs::read_to_string(&audit).expect("audit log written");
    for w in ["secret", "password", "billing"] {
        assert!(!text.contains(w), "prompt content in the audit log: {text}");
    }
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    let of = |ev: &str| lines.iter().filter(|l| l["event"] == ev).count();
    assert_eq!(
        (of("pair_aborted"), of("integrity_violation")),
        (3, 2),
        "{text}"
    );
    for l in &lines {
        assert_eq!(l["model"], MODEL);
        assert_eq!(l["prefill_worker"], stack.mock.prefill_url());
        assert_eq!(l["decode_worker"], stack.mock.decode_url());
        assert!(
            l["pair_id"]
                .as_str()
                .is_some_and(|p| p.parse::<u64>().is_ok()),
            "{l}"
        );
        assert!(l["ts_ms"].as_u64().is_some_and(|t| t > 1_700_000_000_000));
        assert!(l["timings"]["since_request_ms"].as_u64().is_some(), "{l}");
        assert_eq!(l["committed"], false);
    }
    let decode_failed = lines
        .iter()
        .find(|l| l["reason"] == "decode_failed")
        .expect("decode failure audited");
    assert_eq!(decode_failed["side"], "decode");
    assert_eq!(decode_failed["error_code"], "decode_failed");
    let kinds: Vec<&str> = lines
        .iter()
        .filter(|l| l["event"] == "integrity_violation")
        .filter_map(|l| l["integrity_kind"].as_str())
        .collect();
    assert!(kinds.contains(&"prefill_prompt_count") && kinds.contains(&"decode_prompt_count"));
}

//! Draining (what SIGTERM does): `/ready` fails and new requests get 503 at once; a pair that has
//! not committed is aborted on both halves and its client gets an error; a committed stream
//! finishes within the grace period, or is aborted on both halves when the grace runs out;
//! afterwards nothing is left half-done: no live pair in lockstep, no live half in the workers.

use std::time::{Duration, Instant};

use lockstep_router::pair::PairState;
use lockstep_tests::client::{self, Answer, Endpoint, TestClient};
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS};
use lockstep_tests::sglang_mock::{Fault, MockConfig, Role};

fn post(
    stack: &Stack,
    prompt: &str,
    stream: bool,
    max_tokens: u64,
) -> tokio::task::JoinHandle<Answer> {
    let (path, body) = client::request(
        Endpoint::Completions,
        MODEL,
        prompt,
        stream,
        max_tokens,
        &[],
    );
    let url = format!("{}{path}", stack.url);
    tokio::spawn(async move {
        TestClient::default()
            .post(&url, &body, Duration::from_secs(20))
            .await
    })
}

/// Waits (bounded) until lockstep has `n` live pairs of which `committed` have committed.
async fn wait_pairs(stack: &Stack, n: usize, committed: usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let snap = stack.lockstep.state.registry.snapshot();
        let c = snap
            .iter()
            .filter(|(_, i)| i.state == PairState::Committed)
            .count();
        if snap.len() == n && c == committed {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "expected {n} live pairs ({committed} committed), have {snap:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The mock and lockstep, with deadlines long enough for a 2-second slow stream.
async fn start() -> Stack {
    Stack::start_full(
        MockConfig::default(),
        "",
        "",
        &TEST_TIMEOUTS
            .replace("idle_ms = 500", "idle_ms = 2000")
            .replace("total_ms = 5000", "total_ms = 15000"),
    )
    .await
}

/// A committed slow stream (20 tokens, 100 ms apart) and an uncommitted pair (prefill hangs).
async fn two_pairs(
    stack: &Stack,
) -> (
    tokio::task::JoinHandle<Answer>,
    tokio::task::JoinHandle<Answer>,
) {
    stack.mock.set_fault(Fault::Slow {
        prefill_ms: 0,
        token_ms: 100,
    });
    let committed = post(stack, "red green blue", true, 20);
    wait_pairs(stack, 1, 1).await;
    stack.mock.set_fault(Fault::PrefillHang);
    let waiting = post(stack, "one two three", false, 4);
    wait_pairs(stack, 2, 1).await;
    (committed, waiting)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_lets_committed_streams_finish_and_aborts_the_rest() {
    let stack = start().await;
    let (committed, waiting) = two_pairs(&stack).await;
    let t = Instant::now();
    let drain = {
        let ready_url = format!("{}/ready", stack.url);
        let lockstep = &stack.lockstep;
        let during = async {
            // The uncommitted pair's client gets its error at once.
            let w = waiting.await.expect("task");
            let waited = t.elapsed();
            // While draining: not ready, and a new request is refused with 503.
            let r = TestClient::default()
                .get(&ready_url, Duration::from_secs(5))
                .await;
            let (path, body) = client::request(Endpoint::Completions, MODEL, "late", false, 2, &[]);
            let late = TestClient::default()
                .post(
                    &format!("{}{path}", stack.url),
                    &body,
                    Duration::from_secs(5),
                )
                .await;
            (w, waited, r, late)
        };
        let ((w, waited, ready, late), ()) =
            tokio::join!(during, lockstep.drain(Duration::from_secs(10)));
        (w, waited, ready, late)
    };
    let (w, waited, ready, late) = drain;
    assert_eq!(w.status, 503, "{}", w.body);
    assert_eq!(w.error_code().as_deref(), Some("unavailable"), "{}", w.body);
    assert!(
        waited < Duration::from_secs(1),
        "aborted at once, took {waited:?}"
    );
    assert_eq!(ready.status, 503);
    assert!(ready.body.contains("draining"), "{}", ready.body);
    assert_eq!(late.status, 503, "{}", late.body);
    assert!(late.body.contains("draining"), "{}", late.body);
    // The committed stream ran to its end.
    let a = committed.await.expect("task");
    assert_eq!(a.status, 200);
    let events = a.sse_events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{}",
        a.body
    );
    assert!(!a.body.contains("\"error\""), "{}", a.body);
    // Nothing half-done: no live pair, both halves of the aborted pair released in the mock.
    assert!(stack.lockstep_idle());
    assert!(stack.mock.wait_idle(Duration::from_secs(5)).await);
    let aborted: Vec<Role> = stack.mock.aborts().iter().map(|r| r.role).collect();
    assert!(
        aborted.contains(&Role::Prefill) && aborted.contains(&Role::Decode),
        "{aborted:?}"
    );
    let m = stack.lockstep.state.metrics.render();
    assert!(
        m.contains(&format!(
            "lockstep_pairs_aborted_total{{model=\"{MODEL}\",reason=\"shutdown\",side=\"none\"}} 1"
        )),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_aborts_committed_streams_when_the_grace_runs_out() {
    let stack = start().await;
    let (committed, waiting) = two_pairs(&stack).await;
    let t = Instant::now();
    stack.lockstep.drain(Duration::from_millis(300)).await;
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "drain bounded by its grace, took {took:?}"
    );
    assert_eq!(waiting.await.expect("task").status, 503);
    // The cut stream ends with an error event, never [DONE].
    let a = committed.await.expect("task");
    assert_eq!(a.status, 200);
    assert!(a.body.contains("\"error\""), "{}", a.body);
    assert!(!a.body.contains("[DONE]"), "{}", a.body);
    assert!(stack.lockstep_idle());
    assert!(stack.mock.wait_idle(Duration::from_secs(5)).await);
}

/// A drain returns only once the abort calls of the pairs it ended have reached the workers:
/// a shutdown right after it never cancels an abort on its way (the worker would hold the half;
/// a real SGLang decode waits 300 s for KV that never comes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_waits_for_the_abort_calls_to_land() {
    let stack = Stack::start_full(
        MockConfig {
            // Each abort takes 600 ms to land (within `abort_ms` = 1000).
            abort_delay: Duration::from_millis(600),
            ..MockConfig::default()
        },
        "",
        "",
        TEST_TIMEOUTS,
    )
    .await;
    stack.mock.set_fault(Fault::PrefillHang);
    let client = post(&stack, "red green blue", false, 4);
    wait_pairs(&stack, 1, 0).await;
    // The pair is registered before its halves are sent: wait (bounded) for the prefill to
    // arrive at the mock.
    let sent = Instant::now() + Duration::from_secs(5);
    while stack.mock.requests().is_empty() {
        assert!(Instant::now() < sent, "the prefill never reached the mock");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rid = stack.mock.requests()[0]
        .1
        .get("rid")
        .and_then(serde_json::Value::as_str)
        .map(str::to_string)
        .expect("dispatched");
    let started = Instant::now();
    stack.lockstep.drain(Duration::from_secs(5)).await;
    let aborted: Vec<Role> = stack
        .mock
        .aborts()
        .iter()
        .filter(|a| a.rid == rid)
        .map(|a| a.role)
        .collect();
    assert!(
        aborted.contains(&Role::Prefill) && aborted.contains(&Role::Decode),
        "both aborts landed before the drain returned ({:?} after {:?})",
        aborted,
        started.elapsed()
    );
    assert!(started.elapsed() >= Duration::from_millis(500), "it waited");
    assert_eq!(stack.lockstep.state.registry.aborts_in_flight(), 0);
    let a = client.await.expect("client");
    assert!(a.status >= 500, "{}", a.body);
}

/// A drain that begins while a failed pair waits out its retry backoff stops the retry: the
/// client gets the failure, and no new pair reaches the workers after the drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_during_a_retry_backoff_starts_no_new_pair() {
    let stack = Stack::start().await;
    let text = std::fs::read_to_string(&stack.config_path).expect("config");
    assert!(text.contains("backoff_ms = 5"));
    std::fs::write(
        &stack.config_path,
        text.replace("backoff_ms = 5", "backoff_ms = 600"),
    )
    .expect("write");
    stack
        .lockstep
        .reload(lockstep_core::config::Config::load(&stack.config_path).expect("loads"))
        .await
        .expect("reloads");
    stack.mock.set_fault(Fault::PrefillStatus(503));
    let prefills = || {
        stack
            .mock
            .requests()
            .iter()
            .filter(|(r, _)| *r == Role::Prefill)
            .count()
    };
    let answer = post(&stack, "red", false, 2);
    let deadline = Instant::now() + Duration::from_secs(5);
    while prefills() == 0 {
        assert!(
            Instant::now() < deadline,
            "the first attempt reaches the prefill"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The first attempt failed (503, retry-safe); the retry waits 600 ms. Drain now.
    tokio::time::sleep(Duration::from_millis(50)).await;
    stack.lockstep.drain(Duration::from_secs(2)).await;
    let a = answer.await.expect("task");
    assert_eq!(a.status, 502, "{}", a.body);
    assert_eq!(prefills(), 1, "no retry after the drain began");
}

//! The soak: sustained canary traffic (`lockstep probe`: several tenants, every API and mode,
//! clients that leave mid-stream, over-long prompts) through lockstep over two backends at once:
//! the SGLang PD mock, which for about 5% of the time injects one of its faults (every kind,
//! in turn), and the embedded engine on the real model. It passes only with no foreign content
//! in any answer, no over-long prompt answered, nothing left at the end (lockstep's registry and
//! load counters, the mock's halves, rooms and pages, the engine's pages), and the process's RSS
//! and open file descriptors within 10% of their values after the warm-up half. The p99 of each
//! half is printed (the drift).
//!
//! `LOCKSTEP_SOAK_SECS` (default 60, what CI runs) is the whole run; `LOCKSTEP_SOAK_CONCURRENCY`
//! (default 32) the requests in flight against the mock. `bench/soak.sh` runs it longer and
//! wider.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lockstep_probe::{ProbeArgs, Report};
use lockstep_tests::harness::Stack;
use lockstep_tests::sglang_mock::{Fault, MockConfig, PdMock};

fn env_u64(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn args(target: &str, secs: u64, concurrency: usize) -> ProbeArgs {
    ProbeArgs {
        target: target.to_string(),
        model: None,
        api_keys: Vec::new(),
        duration: Some(secs),
        once: false,
        concurrency,
        long_prompt_words: None,
        metrics_listen: None,
        grpc: false,
    }
}

/// Every fault the mock can inject, in turn.
const FAULTS: [Fault; 12] = [
    Fault::PrefillStatus(500),
    Fault::PrefillStatus(503),
    Fault::PrefillInBandAbortDecoy,
    Fault::PrefillHang,
    Fault::PrefillReset,
    Fault::PrefillCountMismatch,
    Fault::DecodeStatus(500),
    Fault::DecodeHang,
    Fault::DecodeCut(3),
    Fault::DecodeCountMismatch,
    Fault::DecodeNoCount,
    Fault::KvCorrupt,
];

/// This process's resident set (kB) and open file descriptors.
fn rss_and_fds() -> (u64, u64) {
    let rss = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0);
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
    (rss, fds)
}

/// One fault for 50 ms of every second, every kind in turn, until `stop`; how many were on.
async fn inject(mock: &PdMock, stop: &AtomicBool) -> usize {
    let mut n = 0usize;
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(950)).await;
        mock.set_fault(FAULTS[n % FAULTS.len()]);
        n += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
        mock.set_fault(Fault::None);
    }
    n
}

/// One half of the soak: both probes for `secs`, the fault injector running meanwhile.
async fn half(
    mock: &Stack,
    engine_url: &str,
    secs: u64,
    concurrency: usize,
) -> (Report, Report, usize) {
    let stop = AtomicBool::new(false);
    let probes = async {
        let r = tokio::join!(
            lockstep_probe::probe(args(&mock.url, secs, concurrency)),
            lockstep_probe::probe(args(engine_url, secs, 2)),
        );
        stop.store(true, Ordering::Relaxed);
        r
    };
    let ((a, b), n) = tokio::join!(probes, inject(&mock.mock, &stop));
    (a, b, n)
}

fn check(what: &str, r: &Report) {
    println!("--- {what}\n{}", r.text);
    assert_eq!(r.code, 0, "{what}: {}", r.text);
    assert_eq!(r.totals.leaks, 0, "{what}: {}", r.text);
    assert!(r.totals.completed > 0, "{what}: {}", r.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_leaves_nothing_and_leaks_nothing() {
    let secs = env_u64("LOCKSTEP_SOAK_SECS", 60).max(4);
    let concurrency = env_u64("LOCKSTEP_SOAK_CONCURRENCY", 32) as usize;
    let mock = Stack::start_with_tokenizer(
        lockstep_tests::tokenizer::build_canary(),
        MockConfig {
            total_pages: 256,
            ..MockConfig::default()
        },
        "",
        "",
        "total_ms = 5000\nprefill_ms = 1000\nfirst_token_ms = 1500\nidle_ms = 1000\nabort_ms = 1000",
    )
    .await;
    let Some(engine) = lockstep_tests::embedded::start("").await else {
        return;
    };
    // About 5% of the time one fault is on (50 ms of every second), every kind in turn.
    let (w1, w2, f1) = half(&mock, &engine.url, secs / 2, concurrency).await;
    // Post-warm-up: both idle again, then measured.
    assert!(
        mock.wait_all_idle(Duration::from_secs(10)).await,
        "after the warm-up half: {:?}",
        mock.mock.live_halves()
    );
    engine.wait_released().await;
    let warm = rss_and_fds();
    let (s1, s2, f2) = half(&mock, &engine.url, secs - secs / 2, concurrency).await;
    let faults = f1 + f2;
    assert!(
        mock.wait_all_idle(Duration::from_secs(10)).await,
        "at the end: {:?}",
        mock.mock.live_halves()
    );
    engine.wait_released().await;
    let end = rss_and_fds();
    for (what, r) in [
        ("mock, warm-up", &w1),
        ("engine, warm-up", &w2),
        ("mock, second half", &s1),
        ("engine, second half", &s2),
    ] {
        check(what, r);
    }
    let pairs = [&w1, &w2, &s1, &s2]
        .iter()
        .map(|r| r.totals.sent)
        .sum::<u64>();
    let p99 = |r: &Report| {
        r.totals
            .p99
            .map_or("-".to_string(), |v| format!("{:.0} ms", v * 1e3))
    };
    println!(
        "soak: {secs} s, {pairs} requests, {faults} fault windows; mock p99 {} -> {}, engine p99 {} -> {}; RSS {} -> {} kB, fds {} -> {}",
        p99(&w1),
        p99(&s1),
        p99(&w2),
        p99(&s2),
        warm.0,
        end.0,
        warm.1,
        end.1
    );
    assert!(
        end.0 <= warm.0 + warm.0 / 10,
        "RSS grew past 10%: {} -> {} kB",
        warm.0,
        end.0
    );
    assert!(
        end.1 <= warm.1 + warm.1 / 10 + 2,
        "open files grew past 10%: {} -> {}",
        warm.1,
        end.1
    );
}

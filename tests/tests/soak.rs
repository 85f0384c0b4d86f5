//! The soak: sustained canary traffic (`lockstep probe`: several tenants, every API and mode,
//! clients that leave mid-stream, over-long prompts) through lockstep over four backends at once:
//! the SGLang PD mock, which for about 5% of the time injects one of its faults (every kind, in
//! turn), the vLLM PD mock, the embedded engine on the real model, and `lockstep worker`s (one
//! prefill, one decode, KV pushed between them) on the real model. It passes only with no
//! foreign content in any answer, no over-long prompt answered, nothing left at the end
//! (lockstep's registries and load counters, the mocks' halves, rooms, pages and blocks, the
//! engine's and the workers' pages and waiting KV), the process's RSS within 10% of its value
//! after the warm-up (the first two thirds), and its open files within 10% plus two per request
//! that can be in flight (pooled keep-alive connections). The p99 of each part is printed (the
//! drift).
//!
//! `LOCKSTEP_SOAK_SECS` (default 75, what CI runs) is the whole run; `LOCKSTEP_SOAK_CONCURRENCY`
//! (default 32) the requests in flight against the mock. `bench/soak.sh` runs it longer and
//! wider.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lockstep_core::config::Config;
use lockstep_probe::{ProbeArgs, Report};
use lockstep_router::app::Lockstep;
use lockstep_tests::embedded::small_worker;
use lockstep_tests::harness::Stack;
use lockstep_tests::sglang_mock::{Fault, MockConfig, PdMock};
use lockstep_tests::vllm_mock::{VllmMock, VllmMockConfig};
use lockstep_worker::{Role, RunningWorker};

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
        api_key_file: None,
        endpoints: Vec::new(),
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

/// lockstep in front of the vLLM PD mock (NixlConnector), both speaking the canary vocabulary.
async fn vllm_stack() -> (VllmMock, Lockstep, tempfile::TempDir) {
    let tok = lockstep_tests::tokenizer::build_canary();
    let mock = VllmMock::start(VllmMockConfig::default(), tok.clone())
        .await
        .expect("vLLM mock");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, tok.to_string(true).expect("tokenizer json")).expect("write");
    let text = format!(
        r#"
[server]
http_listen = "127.0.0.1:0"

[[models]]
name = "vllm-pd"
backend = "vllm"
context_window = 256
kv_capacity_tokens = 1024
default_max_tokens = 8
tokenizer = "{tok}"
chat_template = {{ inline = '{tpl}' }}

[models.vllm]
connector = "nixl"
block_size = 16

[models.prefill]
workers = [{{ url = "{p}" }}]

[models.decode]
workers = [{{ url = "{d}" }}]

[models.timeouts]
total_ms = 10000
prefill_ms = 3000
first_token_ms = 1500
idle_ms = 1500
"#,
        tok = path.display(),
        tpl = lockstep_tests::tokenizer::CHAT_TEMPLATE,
        p = mock.prefill_url(),
        d = mock.decode_url(),
    );
    let cfg = Config::parse(&text).expect("config parses");
    let lockstep = Lockstep::start(cfg).await.expect("lockstep starts");
    (mock, lockstep, dir)
}

/// lockstep in front of one prefill and one decode `lockstep worker` (in process, on the real
/// model): the distributed backend, KV pushed between the workers.
async fn workers_stack(model: &std::path::Path) -> (Vec<RunningWorker>, Lockstep) {
    let (p, d) = (
        small_worker(Role::Prefill, model).await,
        small_worker(Role::Decode, model).await,
    );
    let text = format!(
        r#"
[server]
http_listen = "127.0.0.1:0"

[[models]]
name = "workers"
backend = "lockstep"
context_window = 512
kv_capacity_tokens = 768
default_max_tokens = 16

[models.engine]
gguf = "{model}"
fetch_pip = ""

[models.prefill]
workers = [{{ url = "http://{p}" }}]

[models.decode]
workers = [{{ url = "http://{d}" }}]

[models.timeouts]
total_ms = 60000
prefill_ms = 30000
first_token_ms = 40000
idle_ms = 20000
"#,
        model = model.display(),
        p = p.addr,
        d = d.addr,
    );
    let cfg = Config::parse(&text).expect("config parses");
    let lockstep = Lockstep::start(cfg).await.expect("router starts");
    (vec![p, d], lockstep)
}

/// Whether a worker holds nothing: no request running or waiting, every page free, no pushed
/// KV waiting in a room.
fn worker_idle(w: &RunningWorker) -> bool {
    let s = w.service.engine_stats();
    s.running.load(Ordering::Relaxed) == 0
        && s.waiting.load(Ordering::Relaxed) == 0
        && s.free_pages.load(Ordering::Relaxed) == s.total_pages.load(Ordering::Relaxed)
        && w.service.pending_kv_bytes() == 0
}

/// One part of the soak: the probes for `secs`, the fault injector running meanwhile.
async fn half(
    mock: &Stack,
    urls: [&str; 3],
    secs: u64,
    concurrency: usize,
) -> ([Report; 4], usize) {
    let [vllm_url, engine_url, workers_url] = urls;
    let stop = AtomicBool::new(false);
    let probes = async {
        let r = tokio::join!(
            lockstep_probe::probe(args(&mock.url, secs, concurrency)),
            lockstep_probe::probe(args(vllm_url, secs, concurrency / 2)),
            lockstep_probe::probe(args(engine_url, secs, 2)),
            lockstep_probe::probe(args(workers_url, secs, 2)),
        );
        stop.store(true, Ordering::Relaxed);
        r
    };
    let ((a, b, c, d), n) = tokio::join!(probes, inject(&mock.mock, &stop));
    ([a, b, c, d], n)
}

/// Waits (bounded) until the vLLM mock holds nothing.
async fn vllm_idle(mock: &VllmMock) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !mock.is_idle() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    mock.is_idle()
}

fn check(what: &str, r: &Report) {
    println!("--- {what}\n{}", r.text);
    assert_eq!(r.code, 0, "{what}: {}", r.text);
    assert_eq!(r.totals.leaks, 0, "{what}: {}", r.text);
    assert!(r.totals.completed > 0, "{what}: {}", r.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_leaves_nothing_and_leaks_nothing() {
    let secs = env_u64("LOCKSTEP_SOAK_SECS", 75).max(4);
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
    let (vllm, vllm_lockstep, _dir) = vllm_stack().await;
    let vllm_url = format!("http://{}", vllm_lockstep.http_addr);
    let model = lockstep_tests::embedded::model_path().expect("the model, as the engine has it");
    let (workers, workers_lockstep) = workers_stack(&model).await;
    let workers_url = format!("http://{}", workers_lockstep.http_addr);
    let urls = [vllm_url.as_str(), engine.url.as_str(), workers_url.as_str()];
    let idle = |when: &'static str| {
        let (mock, vllm, engine, front) = (&mock, &vllm, &engine, &vllm_lockstep);
        let (workers, workers_front) = (&workers, &workers_lockstep);
        async move {
            assert!(
                mock.wait_all_idle(Duration::from_secs(10)).await,
                "SGLang mock, {when}: {:?}",
                mock.mock.live_halves()
            );
            assert!(
                vllm_idle(vllm).await,
                "vLLM mock, {when}: {} blocks held",
                vllm.held_blocks()
            );
            assert!(
                front.state.registry.is_empty(),
                "lockstep over vLLM, {when}"
            );
            engine.wait_released().await;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while !(workers_front.state.registry.is_empty() && workers.iter().all(worker_idle))
                && tokio::time::Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(
                workers_front.state.registry.is_empty() && workers.iter().all(worker_idle),
                "lockstep workers, {when}: something is still held"
            );
        }
    };
    // About 5% of the time one fault is on (50 ms of every second), every kind in turn.
    // The warm-up is two thirds of the run: the allocator and the connection pools settle.
    let warm_secs = secs * 2 / 3;
    let (warmup, f1) = half(&mock, urls, warm_secs, concurrency).await;
    // Post-warm-up: all idle again, then measured.
    idle("after the warm-up half").await;
    let warm = rss_and_fds();
    let (second, f2) = half(&mock, urls, secs - warm_secs, concurrency).await;
    let faults = f1 + f2;
    idle("at the end").await;
    let end = rss_and_fds();
    for (half, reports) in [("warm-up", &warmup), ("second half", &second)] {
        for (backend, r) in ["SGLang mock", "vLLM mock", "engine", "lockstep workers"]
            .iter()
            .zip(reports)
        {
            check(&format!("{backend}, {half}"), r);
        }
    }
    let pairs = warmup
        .iter()
        .chain(&second)
        .map(|r| r.totals.sent)
        .sum::<u64>();
    let p99 = |r: &Report| {
        r.totals
            .p99
            .map_or("-".to_string(), |v| format!("{:.0} ms", v * 1e3))
    };
    println!(
        "soak: {secs} s, {pairs} requests, {faults} fault windows; p99 SGLang mock {} -> {}, vLLM mock {} -> {}, engine {} -> {}, workers {} -> {}; RSS {} -> {} kB, fds {} -> {}",
        p99(&warmup[0]),
        p99(&second[0]),
        p99(&warmup[1]),
        p99(&second[1]),
        p99(&warmup[2]),
        p99(&second[2]),
        p99(&warmup[3]),
        p99(&second[3]),
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
    // Idle keep-alive connections stay in the pools (both ends are in this process): up to two
    // descriptors per request that can be in flight, whatever the run's length. A leak grows
    // with the requests (thousands), not with the concurrency.
    let pooled = 2 * (concurrency + concurrency / 2 + 4) as u64;
    assert!(
        end.1 <= warm.1 + warm.1 / 10 + pooled,
        "open files grew past 10% (plus {pooled} pooled): {} -> {}",
        warm.1,
        end.1
    );
}

//! What the process-level tests share: the `lockstep` binary, the model file, spawning a
//! process and reading its address, raw HTTP, and the worker's Capacity RPC.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use lockstep_proto::v1 as pb;
use lockstep_proto::v1::worker_client::WorkerClient;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tonic::transport::Channel;

pub const BIN: &str = env!("CARGO_BIN_EXE_lockstep");
pub const MODEL: &str = "smollm2";

/// The model file, or `None` (the test returns) when it was not fetched; with
/// `LOCKSTEP_REQUIRE_MODEL` set (CI) a missing model fails.
pub fn model_path() -> Option<PathBuf> {
    let p = std::env::var_os("LOCKSTEP_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            lockstep_runtime::toml_file::expand_home(
                &lockstep_runtime::engine_section::EngineSection::default().gguf,
            )
        });
    if p.is_file() {
        return Some(p);
    }
    assert!(
        std::env::var_os("LOCKSTEP_REQUIRE_MODEL").is_none(),
        "LOCKSTEP_REQUIRE_MODEL is set but the model is missing: run scripts/fetch-model.sh"
    );
    eprintln!("test model not fetched (scripts/fetch-model.sh)");
    None
}

/// A `lockstep` process, killed (by pid, through its handle) when dropped.
pub struct Proc {
    pub child: tokio::process::Child,
    pub addr: String,
}

/// Spawns `lockstep ARGS` and waits (bounded) for the log line containing `ready`, taking the
/// address it listens on from that line.
pub async fn spawn(args: &[&str], ready: &str) -> Proc {
    spawn_with(tokio::process::Command::new(BIN), args, ready).await
}

/// [`spawn`] through `command` (`lockstep` itself, or a wrapper such as `ip netns exec NS
/// lockstep`).
pub async fn spawn_with(mut command: tokio::process::Command, args: &[&str], ready: &str) -> Proc {
    let mut child = command
        .args(args)
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn lockstep");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let addr = tokio::time::timeout(Duration::from_secs(120), async {
        while let Ok(Some(l)) = lines.next_line().await {
            if l.contains(ready) {
                return Some(address_in(&l).expect("address in the ready line"));
            }
        }
        None
    })
    .await
    .expect("ready in time")
    .unwrap_or_else(|| panic!("lockstep {args:?} exited before `{ready}`"));
    // Keep draining its output so it never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Proc { child, addr }
}

/// One raw HTTP/1.1 POST; the whole answer (bounded: 90 s).
pub async fn post(addr: &str, path: &str, body: &serde_json::Value) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let body = body.to_string();
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(90), s.read_to_string(&mut out))
        .await
        .expect("answer in time")
        .expect("read");
    let status = out
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let body = out.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("");
    (status, body.to_string())
}

pub fn completion(prompt: &str, max_tokens: u64) -> serde_json::Value {
    serde_json::json!({ "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0 })
}

pub fn text_of(body: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text: {body}"))
        .to_string()
}

pub async fn client(addr: &str) -> WorkerClient<Channel> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect to worker");
    WorkerClient::new(ch).max_decoding_message_size(64 << 20)
}

pub async fn capacity(addr: &str) -> pb::CapacityResponse {
    client(addr)
        .await
        .capacity(pb::CapacityRequest {})
        .await
        .expect("capacity")
        .into_inner()
}

/// Waits (bounded) until the worker holds no page, runs nothing and keeps no pushed set.
pub async fn wait_idle(addr: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let c = capacity(addr).await;
        if c.free_pages == c.total_pages && c.running == 0 && c.pending_kv_sets == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "worker {addr} not idle: {c:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// [`wait_idle`] on every worker.
pub async fn wait_idle_all(workers: &[&Proc]) {
    for w in workers {
        wait_idle(&w.addr).await;
    }
}

/// The first `a.b.c.d:port` in a log line.
pub fn address_in(line: &str) -> Option<String> {
    let bytes = line.as_bytes();
    (0..bytes.len()).find_map(|i| {
        if i > 0 && (bytes[i - 1].is_ascii_digit() || bytes[i - 1] == b'.') {
            return None;
        }
        let cand: String = line[i..]
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
            .collect();
        let (ip, port) = cand.split_once(':')?;
        let port: String = port.chars().take_while(char::is_ascii_digit).collect();
        (ip.parse::<std::net::Ipv4Addr>().is_ok() && !port.is_empty())
            .then(|| format!("{ip}:{port}"))
    })
}

/// An SGLang 0.5.23 worker in `role` as its `/server_info` describes it (correctly set up for
/// lockstep: KV checksum on, cumulative streams), reporting `max_total_num_tokens = capacity`,
/// and its `/health`: enough for the deployment check.
pub async fn sglang_worker(
    capacity: u64,
    role: &'static str,
) -> (String, tokio::task::JoinHandle<()>) {
    use axum::routing::get;
    let app = axum::Router::new()
        .route(
            "/server_info",
            get(move || async move {
                axum::Json(serde_json::json!({
                    "disaggregation_mode": role, "disaggregation_transfer_backend": "mooncake",
                    "disaggregation_bootstrap_port": 8998, "disaggregation_enable_kv_checksum": true,
                    "page_size": 16, "kv_cache_dtype": "auto", "tp_size": 1, "pp_size": 1,
                    "max_total_num_tokens": capacity,
                }))
            }),
        )
        .route("/health", get(|| async { "ok" }));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let h = tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    (format!("http://{addr}"), h)
}

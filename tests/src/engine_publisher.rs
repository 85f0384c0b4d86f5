//! The engines' own KV-event publishers as processes (`tests/python/engine_kv_publisher.py`:
//! SGLang 0.5.23's and vLLM 0.33.0's `ZmqEventPublisher` loaded from their wheels, over libzmq),
//! so lockstep's reader is tested against the code the engines run, not only against
//! [`crate::kv_publisher`], which shares lockstep's ZMTP implementation.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;

use crate::client::python;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// Which engine's code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// SGLang 0.5.23 `srt/disaggregation/kv_events.py`.
    Sglang,
    /// vLLM 0.33.0 `vllm/distributed/kv_events.py`.
    Vllm,
}

impl Engine {
    fn name(self) -> &'static str {
        match self {
            Engine::Sglang => "sglang",
            Engine::Vllm => "vllm",
        }
    }
}

/// Where `scripts/fetch-engine-sources.py` put the engines' files, if it did and Python has
/// pyzmq and msgspec; `None` skips (a panic under `LOCKSTEP_REQUIRE_ENGINE_SRC=1`).
pub fn sources() -> Option<PathBuf> {
    let dir = std::env::var_os("LOCKSTEP_ENGINE_SRC")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/lockstep/engine-src"))
        })?;
    let files = [
        "vllm-0.33.0/vllm/distributed/kv_events.py",
        "sglang-0.5.23/sglang/srt/disaggregation/kv_events.py",
    ];
    let python = std::process::Command::new(python())
        .args(["-c", "import zmq, msgspec, pydantic"])
        .status()
        .is_ok_and(|s| s.success());
    let ok = python && files.iter().all(|f| dir.join(f).is_file());
    if !ok {
        assert!(
            std::env::var_os("LOCKSTEP_REQUIRE_ENGINE_SRC").is_none(),
            "the engines' publisher code is required: python3 scripts/fetch-engine-sources.py, \
             and pip install -r tests/python/requirements.txt"
        );
        eprintln!("skipped: no engine sources (python3 scripts/fetch-engine-sources.py)");
        return None;
    }
    Some(dir)
}

/// A running publisher process (killed, by its pid, when dropped).
pub struct EnginePublisher {
    _child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    /// Its PUB endpoint (the base one moved by its rank).
    pub endpoint: String,
    /// Its replay ROUTER endpoint.
    pub replay: String,
    /// Batches published.
    pub sent: u64,
}

impl EnginePublisher {
    /// Starts `engine`'s publisher of data-parallel rank `rank`, given the base ports (the
    /// engine's code moves them by the rank).
    pub async fn start(
        engine: Engine,
        src: &std::path::Path,
        port: u16,
        replay_port: u16,
        rank: u16,
    ) -> std::io::Result<EnginePublisher> {
        let script =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/engine_kv_publisher.py");
        let mut child = Command::new(python())
            .arg(script)
            .arg(engine.name())
            .arg(src)
            .arg(format!("tcp://127.0.0.1:{port}"))
            .arg(format!("tcp://127.0.0.1:{replay_port}"))
            .arg(rank.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()?;
        let stdin = child
            .stdin
            .take()
            .ok_or_else(|| std::io::Error::other("stdin"))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| std::io::Error::other("stdout"))?;
        let mut lines = BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .map_err(|_| std::io::Error::other("publisher not ready in 30 s"))??
            .ok_or_else(|| std::io::Error::other("publisher exited before it was ready"))?;
        let mut words = ready.split(' ');
        let (Some("ready"), Some(endpoint), Some(replay)) =
            (words.next(), words.next(), words.next())
        else {
            return Err(std::io::Error::other(format!("publisher said {ready:?}")));
        };
        Ok(EnginePublisher {
            endpoint: endpoint.to_string(),
            replay: replay.to_string(),
            _child: child,
            stdin,
            lines,
            sent: 0,
        })
    }

    /// Publishes one batch of `events` (JSON objects, `type` and the class's fields) with the
    /// engine's `publish`, and waits until it is on the socket.
    pub async fn publish(&mut self, events: Vec<Value>) {
        let line = format!("{}\n", serde_json::json!({ "events": events }));
        self.stdin
            .write_all(line.as_bytes())
            .await
            .expect("to the publisher");
        self.stdin.flush().await.expect("flush");
        let said = tokio::time::timeout(Duration::from_secs(10), self.lines.next_line())
            .await
            .expect("published within 10 s")
            .expect("read")
            .expect("a line");
        assert!(said.starts_with("published"), "{said}");
        self.sent += 1;
    }
}

/// A loopback port `p` with `p..p + n` all free now (for a publisher per rank).
pub fn free_ports(n: u16) -> u16 {
    for _ in 0..100 {
        let Ok(first) = std::net::TcpListener::bind("127.0.0.1:0") else {
            continue;
        };
        let Ok(p) = first.local_addr().map(|a| a.port()) else {
            continue;
        };
        let held: Vec<_> = (1..n)
            .map_while(|i| std::net::TcpListener::bind(("127.0.0.1", p.checked_add(i)?)).ok())
            .collect();
        if held.len() + 1 == usize::from(n) {
            return p;
        }
    }
    panic!("no {n} consecutive free loopback ports");
}

//! Chaos across processes: the router and each worker are separate `lockstep` processes in their
//! own network namespaces, joined by veth pairs, on the real model.
//!
//! ```text
//!   netns R: router (127.0.0.1), this test's clients, the chaos relay
//!      |  veth 10.213.1.1 <-> 10.213.1.2        |  veth 10.213.2.1 <-> 10.213.2.2
//!   netns P: prefill worker :9100            netns D: decode worker :9100, KV data :9200
//! ```
//!
//! The router reaches the decode worker, and the prefill worker pushes KV to it, through the
//! relay (R, 10.213.2.1:9100 and :9200), which passes bytes, delays them, stalls (holds every
//! connection and answers nothing) or cuts. Faults, each under load from clients that stream and
//! that do not: `kill -9` and a restart in place of the decode worker and of the prefill worker;
//! a partition between prefill and decode during KV pushes (the relay's KV data side stalls); the
//! decode worker's link down and up; a worker that accepts and never answers; delay; a SIGHUP
//! storm; a drain (SIGTERM) under load. For each: every answer is either the whole greedy text
//! of its own prompt (the reference run's; so no foreign content and no silent truncation) or a
//! typed error (an OpenAI error body, or an error event with no `[DONE]`) whose partial text is a
//! prefix of its own; afterwards the router holds no pair and neither worker holds a page, a
//! running request or pushed KV; and the time from the fault's end to the first good answer is
//! measured. Needs root (`ip netns`); without it the test says so and returns, unless
//! `LOCKSTEP_REQUIRE_NETNS` is set (CI). `bench/chaos.sh` runs it with more rounds
//! (`LOCKSTEP_CHAOS_ROUNDS`).

mod common;

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Prompts the clients send; the reference run gives each one's greedy answer.
const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "One, two, three,",
    "The largest ocean on Earth is",
    "Water boils at",
];
const MAX_TOKENS: u64 = 12;
const CLIENTS: usize = 4;

/// Runs `ip ARGS`; panics with its output on failure.
fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The three namespaces and their links; removed (by name) when dropped.
struct Net {
    r: String,
    p: String,
    d: String,
}

impl Net {
    /// `None` when namespaces cannot be made here (not root, no `ip`).
    fn new() -> Option<Net> {
        let id = std::process::id();
        let net = Net {
            r: format!("lsc{id}r"),
            p: format!("lsc{id}p"),
            d: format!("lsc{id}d"),
        };
        let made = Command::new("ip")
            .args(["netns", "add", &net.r])
            .output()
            .is_ok_and(|o| o.status.success());
        if !made {
            assert!(
                std::env::var_os("LOCKSTEP_REQUIRE_NETNS").is_none(),
                "LOCKSTEP_REQUIRE_NETNS is set but `ip netns add` failed (needs root and iproute2)"
            );
            eprintln!("network namespaces unavailable (needs root and iproute2): chaos skipped");
            return None;
        }
        ip(&["netns", "add", &net.p]);
        ip(&["netns", "add", &net.d]);
        ip(&["-n", &net.r, "link", "set", "lo", "up"]);
        for (k, ns) in [(1, &net.p), (2, &net.d)] {
            let (outer, inner) = (format!("r{k}"), format!("w{k}"));
            ip(&[
                "-n", &net.r, "link", "add", &outer, "type", "veth", "peer", "name", &inner,
                "netns", ns,
            ]);
            ip(&[
                "-n",
                &net.r,
                "addr",
                "add",
                &format!("10.213.{k}.1/24"),
                "dev",
                &outer,
            ]);
            ip(&["-n", &net.r, "link", "set", &outer, "up"]);
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("10.213.{k}.2/24"),
                "dev",
                &inner,
            ]);
            ip(&["-n", ns, "link", "set", &inner, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
            ip(&[
                "-n",
                ns,
                "route",
                "add",
                "default",
                "via",
                &format!("10.213.{k}.1"),
            ]);
        }
        Some(net)
    }

    /// The decode worker's link, down or up.
    fn decode_link(&self, up: bool) {
        ip(&[
            "-n",
            &self.d,
            "link",
            "set",
            "w2",
            if up { "up" } else { "down" },
        ]);
        if up {
            // The default route goes with the link; put it back.
            let _ = Command::new("ip")
                .args([
                    "-n",
                    &self.d,
                    "route",
                    "replace",
                    "default",
                    "via",
                    "10.213.2.1",
                ])
                .output();
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in [&self.r, &self.p, &self.d] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

/// What the relay does with the bytes of one listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Pass,
    /// Every write waits this long.
    Delay(u64),
    /// Connections stay open; nothing passes (a partition, or a peer that never answers).
    Stall,
    /// Every connection is closed, new ones at once.
    Cut,
}

/// Forwards `listen` to `target` as `mode` says.
async fn relay(listen: SocketAddr, target: SocketAddr, mode: watch::Receiver<Mode>) {
    let l = TcpListener::bind(listen).await.expect("relay bind");
    loop {
        let Ok((inbound, _)) = l.accept().await else {
            continue;
        };
        let mode = mode.clone();
        tokio::spawn(async move {
            if *mode.borrow() == Mode::Cut {
                return;
            }
            let Ok(Ok(outbound)) =
                tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(target)).await
            else {
                return;
            };
            pipe(inbound, outbound, mode).await;
        });
    }
}

async fn pipe(mut a: TcpStream, mut b: TcpStream, mut mode: watch::Receiver<Mode>) {
    let (mut ar, mut aw) = a.split();
    let (mut br, mut bw) = b.split();
    let (mut up, mut down) = (vec![0u8; 64 << 10], vec![0u8; 64 << 10]);
    loop {
        let m = *mode.borrow_and_update();
        let delay = match m {
            Mode::Cut => return,
            Mode::Stall => {
                if mode.changed().await.is_err() {
                    return;
                }
                continue;
            }
            Mode::Delay(ms) => ms,
            Mode::Pass => 0,
        };
        tokio::select! {
            changed = mode.changed() => if changed.is_err() { return },
            r = ar.read(&mut up) => {
                let Ok(n @ 1..) = r else { return };
                tokio::time::sleep(Duration::from_millis(delay)).await;
                if bw.write_all(&up[..n]).await.is_err() { return }
            }
            r = br.read(&mut down) => {
                let Ok(n @ 1..) = r else { return };
                tokio::time::sleep(Duration::from_millis(delay)).await;
                if aw.write_all(&down[..n]).await.is_err() { return }
            }
        }
    }
}

/// How one request ended.
#[derive(Debug)]
enum Answer {
    /// The whole greedy text of its own prompt.
    Whole,
    /// A typed error (status, stable code), with no foreign or truncated-success content.
    Typed(u16, String),
    /// The connection was refused, or closed before any byte of answer (the router stopped
    /// accepting: only while it drains).
    Refused,
}

/// Decodes an HTTP/1.1 chunked body (or returns it as is).
fn dechunk(head: &str, body: &str) -> String {
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return body.to_string();
    }
    let (mut out, mut rest) = (String::new(), body);
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}

/// One request; judges its answer against `want`, the reference text of its prompt. A `Err`
/// is a broken promise: foreign or truncated content with success, or an untyped failure.
async fn ask(router: &str, prompt: usize, stream: bool, want: &str) -> Result<Answer, String> {
    let body = serde_json::json!({
        "model": MODEL, "prompt": PROMPTS[prompt], "max_tokens": MAX_TOKENS,
        "temperature": 0, "stream": stream,
    })
    .to_string();
    let Ok(mut s) = TcpStream::connect(router).await else {
        return Ok(Answer::Refused);
    };
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut raw = String::new();
    let read = tokio::time::timeout(Duration::from_secs(60), s.read_to_string(&mut raw))
        .await
        .map_err(|_| "no answer in 60 s".to_string())?;
    if raw.is_empty() {
        // Closed or reset before a byte of answer: the router stopped accepting (a drain).
        return Ok(Answer::Refused);
    }
    read.map_err(|e| format!("read after {} bytes: {e}", raw.len()))?;
    let (head, body) = raw.split_once("\r\n\r\n").ok_or("no head")?;
    let status: u16 = head
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .ok_or("status")?;
    let body = dechunk(head, body);
    let code_of = |v: &serde_json::Value| v["error"]["code"].as_str().map(str::to_string);
    if status != 200 {
        let v: serde_json::Value =
            serde_json::from_str(&body).map_err(|e| format!("{status} untyped ({e}): {body}"))?;
        let code = code_of(&v).ok_or(format!("{status} without a code: {body}"))?;
        return Ok(Answer::Typed(status, code));
    }
    if !stream {
        let v: serde_json::Value =
            serde_json::from_str(&body).map_err(|e| format!("bad 200 ({e}): {body}"))?;
        let text = v["choices"][0]["text"].as_str().unwrap_or_default();
        return if text == want {
            Ok(Answer::Whole)
        } else {
            Err(format!("a 200 with other text: {text:?}, want {want:?}"))
        };
    }
    let (mut text, mut error, mut done) = (String::new(), None, false);
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(data).map_err(|e| format!("bad event ({e}): {data}"))?;
        if let Some(code) = code_of(&v) {
            error = Some(code);
        } else {
            text.push_str(v["choices"][0]["text"].as_str().unwrap_or_default());
        }
    }
    match (error, done) {
        (None, true) if text == want => Ok(Answer::Whole),
        (None, _) => Err(format!(
            "a stream that ended {text:?} (done {done}), want {want:?}"
        )),
        (Some(_), true) => Err("an error event followed by [DONE]".into()),
        (Some(code), false) if want.starts_with(&text) => Ok(Answer::Typed(200, code)),
        (Some(_), false) => Err(format!(
            "foreign content before an error: {text:?}, want {want:?}"
        )),
    }
}

/// What clients got: whole answers, typed errors, refused connections, broken promises.
#[derive(Default)]
struct Tally {
    whole: usize,
    typed: usize,
    refused: usize,
    broken: Vec<String>,
    /// Typed errors by status and code.
    codes: std::collections::BTreeMap<String, usize>,
}

/// Clients asking in a loop until `stop`; their tallies.
struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Tally>>,
}

impl Load {
    fn start(router: &str, want: &Arc<Vec<String>>) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..CLIENTS)
            .map(|c| {
                let (router, want, stop) = (router.to_string(), want.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut t = Tally::default();
                    let mut n = c;
                    while !stop.load(Ordering::Relaxed) && n < c + 10_000 {
                        let p = n % PROMPTS.len();
                        match ask(&router, p, n % 2 == 0, &want[p]).await {
                            Ok(Answer::Whole) => t.whole += 1,
                            Ok(Answer::Typed(status, code)) => {
                                t.typed += 1;
                                *t.codes.entry(format!("{status} {code}")).or_default() += 1;
                                // A client that backs off a little, as real ones do.
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                            Ok(Answer::Refused) => {
                                t.refused += 1;
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                            Err(e) => t.broken.push(e),
                        }
                        n += 1;
                    }
                    t
                })
            })
            .collect();
        Load { stop, tasks }
    }

    /// Stops the clients; (whole, typed) answers. Panics on a broken promise, and on a refused
    /// connection unless the router was meant to go (`refusals_allowed`).
    async fn finish(self, scenario: &str, refusals_allowed: bool) -> Tally {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Tally::default();
        for t in self.tasks {
            let t = t.await.expect("client task");
            assert!(t.broken.is_empty(), "{scenario}: {:#?}", t.broken);
            assert!(
                refusals_allowed || t.refused == 0,
                "{scenario}: the router refused connections"
            );
            all.whole += t.whole;
            all.typed += t.typed;
            all.refused += t.refused;
            for (code, n) in t.codes {
                *all.codes.entry(code).or_default() += n;
            }
        }
        all
    }
}

/// The first good answer after a fault ended: how long it took (bounded: 30 s).
async fn recovery(router: &str, want: &[String]) -> Duration {
    let t0 = Instant::now();
    loop {
        if let Ok(Answer::Whole) = ask(router, 0, false, &want[0]).await {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no recovery in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One raw GET's body.
async fn get(addr: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read");
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or_default();
    dechunk(head, body)
}

/// Waits (bounded) until the router has no pair on any worker and both workers hold nothing.
async fn settle(router: &str, workers: [&str; 2], scenario: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let metrics = get(router, "/metrics").await;
        let live: f64 = metrics
            .lines()
            .filter(|l| l.starts_with("lockstep_worker_inflight_pairs{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        if live == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{scenario}: the router still holds {live} pairs"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for w in workers {
        wait_idle(w).await;
    }
}

/// A worker in its namespace, on its fixed address there.
async fn worker(ns: &str, role: &str, config: &Path, listen: &str) -> Proc {
    let mut cmd = tokio::process::Command::new("ip");
    cmd.args(["netns", "exec", ns, BIN]);
    let cfg = config.to_str().expect("utf-8");
    let args = [
        "worker", "--role", role, "--config", cfg, "--listen", listen,
    ];
    spawn_with(cmd, &args, "worker listening").await
}

/// `kill -9` of a worker, then the same worker started again in place; recovery is measured.
async fn restart(w: &mut Proc, ns: &str, role: &str, config: &Path, listen: &str) -> bool {
    w.child.start_kill().expect("kill -9");
    let _ = w.child.wait().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    *w = worker(ns, role, config, listen).await;
    true
}

fn worker_config(dir: &Path, name: &str, model: &Path, kv_listen: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    let text = format!(
        "[worker]\nlease_ms = 1500\ninsecure_plaintext = true\n{kv_listen}\n\n[engine]\ngguf = \"{}\"\nfetch_pip = \"\"\nkv_pages = 64\npage_size = 16\nmax_batch_tokens = 128\n",
        model.display()
    );
    std::fs::write(&p, text).expect("write worker config");
    p
}

fn router_config(dir: &Path, model: &Path) -> std::path::PathBuf {
    let p = dir.join("router.toml");
    let text = format!(
        r#"
[server]
http_listen = "127.0.0.1:0"
drain_grace_ms = 4000

[worker_plane]
insecure_plaintext = true

[[models]]
name = "{MODEL}"
backend = "lockstep"
context_window = 512
kv_capacity_tokens = 768
default_max_tokens = 16

[models.engine]
gguf = "{model}"
fetch_pip = ""

[models.prefill]
workers = [{{ url = "http://10.213.1.2:9100" }}]

[models.decode]
workers = [{{ url = "http://10.213.2.1:9100" }}]

[models.timeouts]
total_ms = 20000
prefill_ms = 4000
first_token_ms = 6000
idle_ms = 3000
abort_ms = 1000

[models.retry]
max_retries = 0

[models.health]
interval_ms = 100
failure_threshold = 1
"#,
        model = model.display()
    );
    std::fs::write(&p, text).expect("write router config");
    p
}

/// What a fault must do to the clients.
enum Errors {
    /// Fail nobody.
    None,
    /// Fail somebody (else the fault was not injected under load).
    Some,
    /// Either.
    Any,
}

/// Where the faults happen: the router, the reference answers, the workers.
struct Stage<'a> {
    router: &'a str,
    want: &'a Arc<Vec<String>>,
    workers: [&'a str; 2],
}

impl Stage<'_> {
    /// Clients ask through `fault` (begun after a second of load), whose result says whether to
    /// measure recovery; then every answer is judged, the errors checked against `errors`, and
    /// the router and workers must let go of everything.
    async fn fault(
        &self,
        name: &'static str,
        errors: Errors,
        fault: impl std::future::Future<Output = bool>,
    ) -> Row {
        let load = Load::start(self.router, self.want);
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let recovered = if fault.await {
            recovery(self.router, self.want).await
        } else {
            Duration::ZERO
        };
        let tally = load.finish(name, false).await;
        match errors {
            Errors::None => assert_eq!(tally.typed, 0, "{name} must fail nobody"),
            Errors::Some => assert!(tally.typed > 0, "{name} under load must fail somebody"),
            Errors::Any => {}
        }
        settle(self.router, self.workers, name).await;
        Row {
            scenario: name,
            tally,
            recovery: recovered,
        }
    }
}

/// One fault's figures.
struct Row {
    scenario: &'static str,
    tally: Tally,
    recovery: Duration,
}

#[test]
fn faults_across_processes_give_typed_errors_and_leave_nothing() {
    let Some(model) = model_path() else { return };
    let Some(net) = Net::new() else { return };
    let r = net.r.clone();
    // Everything of this test lives in namespace R: its sockets are made on this thread.
    std::thread::spawn(move || {
        let fd = std::fs::File::open(format!("/var/run/netns/{r}")).expect("netns file");
        nix::sched::setns(fd.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(scenarios(&net, &model));
    })
    .join()
    .expect("chaos scenarios");
}

async fn scenarios(net: &Net, model: &Path) {
    let rounds: usize = std::env::var("LOCKSTEP_CHAOS_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let dir = tempfile::tempdir().expect("tempdir");
    let pcfg = worker_config(dir.path(), "prefill.toml", model, "");
    let dcfg = worker_config(
        dir.path(),
        "decode.toml",
        model,
        "kv_listen = \"10.213.2.2:9200\"",
    );
    let (p_at, d_at) = ("10.213.1.2:9100", "10.213.2.2:9100");
    let (mut p, mut d) = tokio::join!(
        worker(&net.p, "prefill", &pcfg, p_at),
        worker(&net.d, "decode", &dcfg, d_at)
    );
    let (grpc_mode, grpc_rx) = watch::channel(Mode::Pass);
    let (data_mode, data_rx) = watch::channel(Mode::Pass);
    let target = |a: &str| a.parse::<SocketAddr>().expect("addr");
    tokio::spawn(relay(target("10.213.2.1:9100"), target(d_at), grpc_rx));
    tokio::spawn(relay(
        target("10.213.2.1:9200"),
        target("10.213.2.2:9200"),
        data_rx,
    ));
    let rcfg = router_config(dir.path(), model);
    let cfg = rcfg.to_str().expect("utf-8");
    let mut router = spawn(&["serve", "--config", cfg], "lockstep listening").await;
    let ra = router.addr.clone();

    // The reference: each prompt's greedy answer with nothing wrong.
    let mut want = Vec::new();
    for prompt in PROMPTS {
        let (status, body) = post(&ra, "/v1/completions", &completion(prompt, MAX_TOKENS)).await;
        assert_eq!(status, 200, "{body}");
        want.push(text_of(&body));
    }
    let want = Arc::new(want);
    let workers = [p_at, d_at];
    let mut rows = Vec::new();

    for _ in 0..rounds {
        let at = Stage {
            router: &ra,
            want: &want,
            workers,
        };
        // Delay: every byte to and from the decode worker waits 20 ms.
        let delay = async {
            grpc_mode.send_replace(Mode::Delay(20));
            data_mode.send_replace(Mode::Delay(20));
            tokio::time::sleep(Duration::from_secs(2)).await;
            grpc_mode.send_replace(Mode::Pass);
            data_mode.send_replace(Mode::Pass);
            false
        };
        rows.push(at.fault("delay 20 ms (relay)", Errors::None, delay).await);

        // kill -9 of the decode worker mid-stream, then a restart in place.
        let kill_decode = restart(&mut d, &net.d, "decode", &dcfg, d_at);
        rows.push(
            at.fault("kill -9 decode, restart", Errors::Some, kill_decode)
                .await,
        );

        // kill -9 of the prefill worker under load, then a restart in place.
        let kill_prefill = restart(&mut p, &net.p, "prefill", &pcfg, p_at);
        rows.push(
            at.fault("kill -9 prefill, restart", Errors::Some, kill_prefill)
                .await,
        );

        // A partition between prefill and decode during KV pushes: the KV data path stalls
        // (connections stay open, nothing passes), then its connections are cut and it heals.
        let partition = async {
            data_mode.send_replace(Mode::Stall);
            tokio::time::sleep(Duration::from_secs(5)).await;
            data_mode.send_replace(Mode::Cut);
            tokio::time::sleep(Duration::from_millis(100)).await;
            data_mode.send_replace(Mode::Pass);
            true
        };
        let name = "partition prefill/decode (KV push)";
        rows.push(at.fault(name, Errors::Some, partition).await);

        // The decode worker's link down, then up (whoever was mid-request may or may not fail).
        let link = async {
            net.decode_link(false);
            tokio::time::sleep(Duration::from_secs(3)).await;
            net.decode_link(true);
            true
        };
        rows.push(
            at.fault("decode link down 3 s, up", Errors::Any, link)
                .await,
        );

        // A decode worker that accepts and never answers.
        let mute = async {
            grpc_mode.send_replace(Mode::Stall);
            tokio::time::sleep(Duration::from_secs(7)).await;
            grpc_mode.send_replace(Mode::Cut);
            tokio::time::sleep(Duration::from_millis(100)).await;
            grpc_mode.send_replace(Mode::Pass);
            true
        };
        let name = "decode accepts, never answers 7 s";
        rows.push(at.fault(name, Errors::Some, mute).await);

        // A SIGHUP storm under load: reloads change nothing in flight.
        let pid = router.child.id().expect("router pid");
        let storm = async {
            for _ in 0..20 {
                let _ = Command::new("kill")
                    .args(["-HUP", &pid.to_string()])
                    .status();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            false
        };
        rows.push(at.fault("SIGHUP x20 under load", Errors::None, storm).await);
    }

    // Drain under load: SIGTERM; answers stay whole or typed, and the router exits in time.
    let load = Load::start(&ra, &want);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let pid = router.child.id().expect("router pid");
    let t0 = Instant::now();
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let status = tokio::time::timeout(Duration::from_secs(15), router.child.wait())
        .await
        .expect("the router exits within its grace")
        .expect("wait");
    let drained = t0.elapsed();
    let t = load.finish("drain", true).await;
    assert!(status.success(), "drain exit: {status:?}");
    assert!(t.whole > 0, "answers in flight at the drain complete");
    for w in workers {
        wait_idle(w).await;
    }
    rows.push(Row {
        scenario: "SIGTERM drain under load",
        tally: t,
        recovery: drained,
    });

    eprintln!(
        "\n| fault | whole answers | typed errors (status code: count) | recovery |\n| --- | --: | --- | --: |"
    );
    for r in &rows {
        let codes: Vec<String> = r
            .tally
            .codes
            .iter()
            .map(|(c, n)| format!("{c}: {n}"))
            .collect();
        eprintln!(
            "| {} | {} | {} {} | {} ms |",
            r.scenario,
            r.tally.whole,
            r.tally.typed,
            if codes.is_empty() {
                String::new()
            } else {
                format!("({})", codes.join(", "))
            },
            r.recovery.as_millis()
        );
    }
    drop((p, d));
}

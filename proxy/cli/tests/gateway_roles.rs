//! The `lockstep sidecar` and `lockstep epp` commands of the real binary: each reads its own
//! table and refuses the other's (and `serve` refuses both); the sidecar takes llm-d's
//! routing-sidecar flags (`--port`, `--vllm-port`, `--kv-connector`) and passes the engine's
//! pages through; the picker serves health over HTTP and nothing else there.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

mod common;

const BIN: &str = env!("CARGO_BIN_EXE_lockstep");

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port()
}

fn config(dir: &Path, decode: &str, extra: &str) -> PathBuf {
    let tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/mock-tokenizer.json");
    let text = format!(
        r#"[server]
http_listen = "127.0.0.1:0"
log_level = "info"
{extra}
[[models]]
name = "m"
backend = "sglang"
context_window = 1000
kv_capacity_tokens = 4096
tokenizer = "{tok}"
chat_template = {{ inline = "{{{{ messages }}}}" }}
[models.prefill]
workers = []
bootstrap_port = 8998
[models.decode]
workers = [{{ url = "{decode}" }}]
"#,
        tok = tok.display()
    );
    let path = dir.join("lockstep.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(BIN).args(args).output().expect("run lockstep");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// A raw HTTP/1.1 GET (the CLI tests carry no HTTP client): status line and body.
async fn get(port: u16, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_string(&mut out))
        .await
        .expect("answer in time")
        .expect("read");
    out
}

/// Starts the binary on ports from [`free_port`] (`args` of the ports it is given), trying new
/// ones when another process took one between [`free_port`] and the bind (up to three times).
async fn start_on_free_ports(
    args: impl Fn(u16, u16) -> Vec<String>,
    needle: &str,
) -> (tokio::process::Child, u16, u16) {
    let mut last = String::new();
    for _ in 0..3 {
        let (a, b) = (free_port(), free_port());
        let argv = args(a, b);
        let refs: Vec<&str> = argv.iter().map(String::as_str).collect();
        match try_start(&refs, needle).await {
            Ok(child) => return (child, a, b),
            Err(e) if e.contains("cannot listen") => last = e,
            Err(e) => panic!("{e}"),
        }
    }
    panic!("{last}");
}

/// Starts the binary with `args` and waits (20 s) for `needle` in its output, or says why it
/// did not start (what it printed).
async fn try_start(args: &[&str], needle: &str) -> Result<tokio::process::Child, String> {
    use tokio::io::AsyncBufReadExt;
    let mut child = tokio::process::Command::new(BIN)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut seen = Vec::new();
    let found = tokio::time::timeout(Duration::from_secs(20), async {
        while let Ok(Some(l)) = lines.next_line().await {
            if l.contains(needle) {
                return true;
            }
            seen.push(l);
        }
        false
    })
    .await
    .unwrap_or(false);
    if !found {
        // Why it did not start: what it printed, both streams.
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            use tokio::io::AsyncReadExt;
            let _ = tokio::time::timeout(Duration::from_secs(2), e.read_to_string(&mut err)).await;
        }
        return Err(format!(
            "`{needle}` never logged by {args:?}\nstdout:\n{}\nstderr:\n{err}",
            seen.join("\n")
        ));
    }
    // Its error stream is drained too, so it never blocks on a full pipe.
    if let Some(mut e) = child.stderr.take() {
        tokio::spawn(async move {
            let _ = tokio::io::copy(&mut e, &mut tokio::io::sink()).await;
        });
    }
    // Keep draining its output so it never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(child)
}

#[test]
fn each_command_refuses_the_other_roles_tables_and_mismatched_flags() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = config(
        dir.path(),
        "http://127.0.0.1:9",
        "[sidecar]\nprefill_allow = [\"10.0.0.0/8\"]\n",
    );
    let p = path.to_str().expect("utf8");
    let (ok, out) = run(&["serve", "--config", p]);
    assert!(
        !ok && out.contains("[sidecar] is read by `lockstep sidecar`"),
        "{out}"
    );
    let (ok, out) = run(&["epp", "--config", p]);
    assert!(
        !ok && out.contains("[sidecar] is read by `lockstep sidecar`"),
        "{out}"
    );
    let (ok, out) = run(&["sidecar", "--config", p, "--kv-connector", "nixlv2"]);
    assert!(
        !ok && out.contains("--kv-connector nixlv2 does not match"),
        "{out}"
    );
    let (ok, out) = run(&["sidecar", "--help"]);
    for flag in ["--port", "--vllm-port", "--kv-connector", "--config"] {
        assert!(ok && out.contains(flag), "{flag}: {out}");
    }
    let (ok, out) = run(&["epp", "--help"]);
    assert!(ok && out.contains("--grpc-listen"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_takes_llm_ds_flags_and_passes_the_engines_pages_through() {
    let (engine, h) = common::sglang_worker(4096, "decode").await;
    let engine_port = engine.rsplit(':').next().expect("port").to_string();
    let dir = tempfile::tempdir().expect("tempdir");
    // The file's decode is a placeholder: `--vllm-port` names the engine.
    let path = config(
        dir.path(),
        "http://127.0.0.1:9",
        "[sidecar]\nprefill_allow = [\"127.0.0.1\"]\n",
    );
    let (mut child, port, _) = start_on_free_ports(
        |port, _| {
            [
                "sidecar",
                "--config",
                path.to_str().expect("utf8"),
                "--port",
                &port.to_string(),
                "--vllm-port",
                &engine_port,
                "--kv-connector",
                "sglang",
            ]
            .map(String::from)
            .to_vec()
        },
        "lockstep listening",
    )
    .await;
    let info = get(port, "/server_info").await;
    assert!(info.starts_with("HTTP/1.1 200"), "{info}");
    assert!(
        info.contains("\"disaggregation_mode\":\"decode\""),
        "{info}"
    );
    let ready = get(port, "/ready").await;
    assert!(
        ready.starts_with("HTTP/1.1 200"),
        "a sidecar needs no prefill to be ready: {ready}"
    );
    let ours = get(port, "/lockstep/metrics").await;
    assert!(ours.contains("lockstep_"), "{ours}");
    child.kill().await.expect("kill");
    h.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_serves_ext_proc_and_only_health_over_http() {
    let (prefill, hp) = common::sglang_worker(4096, "prefill").await;
    let (decode, hd) = common::sglang_worker(4096, "decode").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = config(
        dir.path(),
        &decode,
        "[epp]\ngrpc_listen = \"127.0.0.1:0\"\n",
    );
    // The picker's prefill is a configured worker.
    let text = std::fs::read_to_string(&path).expect("read").replace(
        "workers = []\nbootstrap_port = 8998",
        &format!("workers = [{{ url = \"{prefill}\", bootstrap_port = 8998 }}]"),
    );
    let config_path = path.to_str().expect("utf8").to_string();
    let (mut child, http_port, grpc_port) = start_on_free_ports(
        |http, grpc| {
            let text = text.replace(
                "127.0.0.1:0\"\nlog_level",
                &format!("127.0.0.1:{http}\"\nlog_level"),
            );
            std::fs::write(&config_path, text).expect("write");
            vec![
                "epp".into(),
                "--config".into(),
                config_path.clone(),
                "--grpc-listen".into(),
                format!("127.0.0.1:{grpc}"),
            ]
        },
        "endpoint picker listening",
    )
    .await;
    let grpc = format!("127.0.0.1:{grpc_port}");
    let ready = get(http_port, "/ready").await;
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    let metrics = get(http_port, "/metrics").await;
    assert!(metrics.contains("lockstep_"), "{metrics}");
    // Generation requests reach the picker through Envoy only.
    let chat = get(http_port, "/v1/chat/completions").await;
    assert!(chat.starts_with("HTTP/1.1 404"), "{chat}");
    assert!(
        tokio::net::TcpStream::connect(&grpc).await.is_ok(),
        "ext_proc listens on {grpc}"
    );
    child.kill().await.expect("kill");
    hp.abort();
    hd.abort();
}

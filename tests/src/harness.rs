//! Starts lockstep in process (through its library) in front of a [`PdMock`].

use std::path::PathBuf;
use std::time::Duration;

use lockstep_core::config::Config;
use lockstep_router::app::Lockstep;

use crate::sglang_mock::{MockConfig, PdMock};
use crate::tokenizer;

/// Deadlines used by the fault tests: short, so only lockstep's abort can explain a fast error
/// while the mock's own KV wait is SGLang's 300 s.
pub const TEST_TIMEOUTS: &str =
    "total_ms = 5000\nprefill_ms = 500\nfirst_token_ms = 700\nidle_ms = 500\nabort_ms = 1000";

/// A mock pair and a lockstep in front of it.
pub struct Stack {
    /// The mock workers.
    pub mock: PdMock,
    /// lockstep.
    pub lockstep: Lockstep,
    /// lockstep's base URL.
    pub url: String,
    /// The tokenizer file lockstep loads.
    pub tokenizer: PathBuf,
    /// The configuration file lockstep was started from.
    pub config_path: PathBuf,
    _dir: tempfile::TempDir,
}

/// The admin key of [`Stack::start_with_admin`].
pub const ADMIN_KEY: &str = "admin-key";

/// The model name the stack serves.
pub const MODEL: &str = "mock-pd";

/// A config for lockstep in front of `mock` with the given extra model settings.
pub fn config_text(
    mock: &PdMock,
    tokenizer: &std::path::Path,
    model_extra: &str,
    timeouts: &str,
) -> String {
    config_text_with(mock, tokenizer, "", model_extra, timeouts)
}

/// The SGLang PD mock started with `cfg` over the test tokenizer, and that tokenizer written to
/// a file in a fresh directory (kept alive by the returned `TempDir`), for a configuration
/// written by hand ([`config_text_with`]).
pub async fn mock_with_tokenizer(cfg: MockConfig) -> (tempfile::TempDir, PathBuf, PdMock) {
    let dir = tempfile::tempdir().expect("tempdir");
    let tok = tokenizer::build();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, tok.to_string(true).expect("tokenizer")).expect("write");
    let mock = PdMock::start(cfg, tok).await.expect("mock");
    (dir, path, mock)
}

/// [`config_text`] with extra `[server]` settings.
pub fn config_text_with(
    mock: &PdMock,
    tokenizer: &std::path::Path,
    server_extra: &str,
    model_extra: &str,
    timeouts: &str,
) -> String {
    format!(
        r#"
[server]
http_listen = "127.0.0.1:0"
max_body_bytes = 65536
{server_extra}

[[models]]
name = "{MODEL}"
backend = "sglang"
context_window = 512
kv_capacity_tokens = 1024
default_max_tokens = 8
tokenizer = "{tok}"
{template}{model_extra}

[models.prefill]
workers = [{{ url = "{p}", bootstrap_port = 8998 }}]

[models.decode]
workers = [{{ url = "{d}" }}]

[models.timeouts]
{timeouts}

[models.retry]
max_retries = 1
backoff_ms = 5

[models.health]
interval_ms = 100
timeout_ms = 2000
failure_threshold = 2
success_threshold = 1
"#,
        tok = tokenizer.display(),
        // A `model_extra` with its own template replaces the mock's ChatML one.
        template = if model_extra.contains("chat_template") {
            String::new()
        } else {
            format!(
                "chat_template = {{ inline = '{}' }}\n",
                tokenizer::CHAT_TEMPLATE
            )
        },
        p = mock.prefill_url(),
        d = mock.decode_url(),
    )
}

impl Stack {
    /// POSTs `body` to `path` on lockstep (10 s bound), as an open-mode client.
    pub async fn post(&self, path: &str, body: serde_json::Value) -> crate::client::Answer {
        crate::client::TestClient::default()
            .post(
                &format!("{}{path}", self.url),
                &body,
                Duration::from_secs(10),
            )
            .await
    }

    /// Starts a mock with default settings and lockstep with the test deadlines.
    pub async fn start() -> Stack {
        Stack::start_with(MockConfig::default(), "", TEST_TIMEOUTS).await
    }

    /// Starts a mock and lockstep with custom settings.
    pub async fn start_with(mock_cfg: MockConfig, model_extra: &str, timeouts: &str) -> Stack {
        Stack::start_full(mock_cfg, "", model_extra, timeouts).await
    }

    /// Starts a mock and lockstep with custom server and model settings.
    pub async fn start_full(
        mock_cfg: MockConfig,
        server_extra: &str,
        model_extra: &str,
        timeouts: &str,
    ) -> Stack {
        Stack::start_with_tokenizer(
            tokenizer::build(),
            mock_cfg,
            server_extra,
            model_extra,
            timeouts,
        )
        .await
    }

    /// [`Stack::start_full`] with another tokenizer, shared by the mock and lockstep (the
    /// canary tokenizer of the probe tests).
    pub async fn start_with_tokenizer(
        tok: tokenizers::Tokenizer,
        mock_cfg: MockConfig,
        server_extra: &str,
        model_extra: &str,
        timeouts: &str,
    ) -> Stack {
        let dir = tempfile::tempdir().expect("tempdir");
        let tok_path: PathBuf = dir.path().join("tokenizer.json");
        std::fs::write(
            &tok_path,
            tok.to_string(true).expect("tokenizer serialises"),
        )
        .expect("write tokenizer");
        let mock = PdMock::start(mock_cfg, tok).await.expect("mock starts");
        let text = config_text_with(&mock, &tok_path, server_extra, model_extra, timeouts);
        Stack::start_from(mock, dir, tok_path, text)
            .await
            .expect("lockstep starts")
    }

    /// A stack whose configuration is [`config_text_with`]'s, edited by `edit` (a decode pool
    /// from discovery instead of its worker, say); `Err`: why lockstep refused to start.
    pub async fn start_edited(
        mock_cfg: MockConfig,
        server_extra: &str,
        timeouts: &str,
        edit: impl FnOnce(&PdMock, String) -> String,
    ) -> Result<Stack, String> {
        let dir = tempfile::tempdir().expect("tempdir");
        let tok = tokenizer::build();
        let tok_path: PathBuf = dir.path().join("tokenizer.json");
        std::fs::write(
            &tok_path,
            tok.to_string(true).expect("tokenizer serialises"),
        )
        .expect("write tokenizer");
        let mock = PdMock::start(mock_cfg, tok).await.expect("mock starts");
        let text = edit(
            &mock,
            config_text_with(&mock, &tok_path, server_extra, "", timeouts),
        );
        Stack::start_from(mock, dir, tok_path, text).await
    }

    async fn start_from(
        mock: PdMock,
        dir: tempfile::TempDir,
        tok_path: PathBuf,
        text: String,
    ) -> Result<Stack, String> {
        // From a file, as in production: the admin API's reload re-reads it.
        let config_path = dir.path().join("lockstep.toml");
        std::fs::write(&config_path, &text).expect("write config");
        let cfg = Config::load(&config_path).map_err(|e| e.to_string())?;
        // A configuration with `[sidecar]` starts `lockstep sidecar`, as the command would.
        let lockstep = if cfg.sidecar.is_some() {
            lockstep_gateway::sidecar::start(cfg).await?
        } else {
            Lockstep::start(cfg).await?
        };
        let url = format!("http://{}", lockstep.http_addr);
        Ok(Stack {
            mock,
            lockstep,
            url,
            tokenizer: tok_path,
            config_path,
            _dir: dir,
        })
    }

    /// A stack whose lockstep has the admin listener, behind the key [`ADMIN_KEY`], with
    /// `timeouts`.
    pub async fn start_with_admin(timeouts: &str) -> Stack {
        let server = format!(
            "admin_listen = \"127.0.0.1:0\"\nadmin_key_sha256 = \"{}\"",
            lockstep_tenancy::tenant::key_hash_hex(ADMIN_KEY)
        );
        Stack::start_full(MockConfig::default(), &server, "", timeouts).await
    }

    /// One pool of the model as lockstep holds it now (`side`: `prefill` or `decode`): (url,
    /// label, verified, joined at run time) per member.
    pub fn pool(&self, side: &str) -> Vec<(String, String, bool, bool)> {
        let models = self.lockstep.state.models.load();
        let m = &models.by_name[MODEL];
        let pool = if side == "prefill" {
            &m.pairs.prefill
        } else {
            &m.pairs.decode
        };
        pool.workers()
            .iter()
            .map(|w| (w.url.clone(), w.label(side), w.is_verified(), w.joined()))
            .collect()
    }

    /// Calls lockstep's admin API (`key`: the bearer sent, if any); the status and the JSON body
    /// (`null` when it is not JSON).
    pub async fn admin(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: serde_json::Value,
    ) -> (u16, serde_json::Value) {
        let addr = self.lockstep.admin_addr.expect("admin listener");
        let auth = key.map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> =
            auth.iter().map(|a| ("authorization", a.as_str())).collect();
        let a = crate::client::TestClient::default()
            .send_with(
                method,
                &format!("http://{addr}{path}"),
                &headers,
                body.to_string(),
                Duration::from_secs(10),
            )
            .await;
        (
            a.status,
            serde_json::from_str(&a.body).unwrap_or(serde_json::Value::Null),
        )
    }

    /// The config text of this stack, for tests that start a second lockstep with changes.
    pub fn config_text(&self, model_extra: &str, timeouts: &str) -> String {
        config_text(&self.mock, &self.tokenizer, model_extra, timeouts)
    }

    /// True when lockstep holds nothing: no live pair, every load counter at zero.
    pub fn lockstep_idle(&self) -> bool {
        let st = &self.lockstep.state;
        st.registry.is_empty()
            && st.models.load().by_name.values().all(|m| {
                m.pairs
                    .prefill
                    .workers()
                    .iter()
                    .chain(m.pairs.decode.workers().iter())
                    .all(|w| w.in_flight() == 0)
            })
    }

    /// Waits (bounded) until both lockstep and the mock hold nothing.
    pub async fn wait_all_idle(&self, bound: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + bound;
        while tokio::time::Instant::now() < deadline {
            if self.lockstep_idle() && self.mock.is_idle() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }
}

/// Polls `f` every 10 ms until it holds or `bound` passes; its last answer.
pub async fn wait_for(bound: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + bound;
    while std::time::Instant::now() < deadline {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    f()
}

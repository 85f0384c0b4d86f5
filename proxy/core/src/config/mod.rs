//! The router's TOML configuration, one module per section, each validating itself
//! ([`Section`]); loading goes through the one loader of `lockstep-runtime`
//! ([`lockstep_runtime::toml_file`]): unknown keys are errors, errors name the file, the key path and
//! what was expected, and [`Config::problems`] lists every problem at once, so `lockstep check`
//! can show them all.

mod idempotency;
mod model;
mod plane;
mod pool;
mod schema;
mod server;
mod shared;
mod sidecar;
mod state;
mod tenant;
mod timeouts;

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use lockstep_runtime::telemetry::TelemetryConfig;
use lockstep_runtime::toml_file::{self, ConfigError, ConfigFile, Problem, Problems, Section};
use serde::Deserialize;

pub use idempotency::IdempotencyConfig;
pub use lockstep_runtime::engine_section::{
    EngineMode, EngineSection, FaultKind, ScrubKind, WhenFullKind,
};
pub use lockstep_runtime::toml_file::lines;
pub use model::{
    BackendKind, ChatTemplateConfig, ModelConfig, SglangSection, ToolParserKind, VllmConnector,
    VllmSection, deployment_check,
};
pub use plane::WorkerPlaneConfig;
pub use pool::{
    BOOTSTRAP_PORT_ANNOTATION, DiscoveryConfig, DiscoveryKind, DiscoveryScheme, HealthConfig,
    KvEventsConfig, PolicyKind, PoolConfig, PrefixRouting, WorkerConfig,
};
pub use schema::json_schema;
pub use server::{Connections, ServerConfig};
pub use shared::{OnUnavailable, SharedConfig};
pub use sidecar::{AllowedPrefills, EppConfig, Role, SidecarConfig};
pub use state::StateConfig;
pub use tenant::TenantConfig;
pub use timeouts::{FailoverConfig, QueueConfig, RetryConfig, TimeoutConfig};

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
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
    /// How the router reaches lockstep workers (`backend = "lockstep"`).
    #[serde(default)]
    pub worker_plane: WorkerPlaneConfig,
    /// `lockstep sidecar`: the prefills a request may name (`x-prefiller-host-port`).
    #[serde(default)]
    pub sidecar: Option<SidecarConfig>,
    /// `lockstep epp`: Envoy's endpoint picker.
    #[serde(default)]
    pub epp: Option<EppConfig>,
    /// Tenant limits shared with other replicas through Redis (needs a restart to change).
    #[serde(default)]
    pub shared: Option<SharedConfig>,
    /// Stored responses and conversations (needs a restart to change).
    #[serde(default)]
    pub state: StateConfig,
    /// Requests with an `Idempotency-Key` header (needs a restart to change).
    #[serde(default)]
    pub idempotency: IdempotencyConfig,
    /// The file this configuration was read from (admin reload re-reads it).
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

impl ConfigFile for Config {
    fn resolve_paths(&mut self, base: &Path) {
        // Certificates and keys are made relative to the file; `~/` is expanded everywhere.
        for p in [
            &mut self.server.tls_cert_file,
            &mut self.server.tls_key_file,
        ]
        .into_iter()
        .flatten()
        {
            toml_file::resolve(p, base);
        }
        for m in &mut self.models {
            m.resolve_paths(base);
        }
        if let Some(t) = &mut self.worker_plane.tls {
            t.resolve_paths(base);
        }
        if let Some(p) = &mut self.state.path {
            toml_file::resolve(p, base);
        }
    }

    fn problems(&self) -> Vec<Problem> {
        let mut out = Problems::default();
        if self.models.is_empty() {
            out.push("models", "at least one model is required");
        }
        self.server.validate("server", &mut out);
        self.telemetry.validate("telemetry", &mut out);
        if let Some(s) = &self.sidecar {
            s.validate("sidecar", &mut out);
        }
        if let Some(e) = &self.epp {
            e.validate("epp", &mut out);
        }
        if let Some(s) = &self.shared {
            s.validate("shared", &mut out);
        }
        self.state.validate("state", &mut out);
        self.idempotency.validate("idempotency", &mut out);
        let model_names: HashSet<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
        tenant::validate_tenants(&self.tenants, &model_names, &mut out);
        let mut names = HashSet::new();
        for (i, m) in self.models.iter().enumerate() {
            let at = format!("models[{i}] ({})", m.name);
            if m.name.trim().is_empty() {
                out.push(format!("models[{i}].name"), "must not be empty");
            }
            if !names.insert(m.name.as_str()) {
                out.push(format!("{at}.name"), "duplicate model name");
            }
            m.validate(&at, &mut out);
            if m.backend == BackendKind::Lockstep {
                self.worker_plane.validate_workers(i, m, &mut out);
            }
        }
        let mut out = out.into_vec();
        if self.sidecar.is_some() {
            // A sidecar's prefills may all be named by the requests (`x-prefiller-host-port`).
            out.retain(|p| {
                !(p.key.ends_with(".prefill.workers")
                    && p.message.starts_with("at least one worker"))
            });
        }
        out
    }

    fn set_source(&mut self, path: &Path) {
        self.source = Some(path.to_path_buf());
    }
}

/// The built-in configuration: SmolLM2 on the embedded engine (`config/default.toml`).
pub const DEFAULT_CONFIG: &str = include_str!("../../../../config/default.toml");

impl Config {
    /// Reads, parses and validates a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        toml_file::load(path)
    }

    /// The built-in configuration, paths relative to the working folder.
    pub fn builtin() -> Result<Config, ConfigError> {
        toml_file::from_text(
            DEFAULT_CONFIG,
            Path::new("."),
            Path::new("built-in configuration"),
        )
    }

    /// Parses TOML text (no path resolution, no validation); the error names the key path and
    /// what was expected.
    pub fn parse(text: &str) -> Result<Config, String> {
        toml_file::parse(text)
    }

    /// Every semantic problem, each naming its key path. Empty when the config is valid.
    pub fn problems(&self) -> Vec<Problem> {
        ConfigFile::problems(self)
    }

    /// Settings that are valid but unsafe in production (fault injection, unverified KV).
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        for m in &self.models {
            if let Some(f) = m.engine.as_ref().and_then(|e| e.fault) {
                out.push(format!(
                    "model `{}`: engine.fault = {f:?} injects KV transfer faults: UNSAFE, for tests only",
                    m.name
                ));
            }
            if m.backend == BackendKind::Lockstep
                && self.worker_plane.insecure_plaintext
                && plane::plaintext_workers(m).next().is_some()
            {
                out.push(format!(
                    "model `{}`: worker_plane.insecure_plaintext = true: its workers are reached without TLS on a non-loopback network, where anyone who reaches them can drive them: UNSAFE",
                    m.name
                ));
            }
            if m.backend == BackendKind::Sglang && !m.sglang.require_kv_checksum {
                out.push(format!(
                    "model `{}`: sglang.require_kv_checksum = false: workers may run without SGLang's KV checksum, and then nothing verifies the KV a decode reads: UNSAFE",
                    m.name
                ));
            }
        }
        out
    }
}

/// A vLLM model `m` for unit tests (window 1000, capacity 4000), its prefill at `prefill` and its
/// decode at `decode`, with `extra` TOML lines after the pools (for other crates' unit tests too).
#[doc(hidden)]
pub fn test_model(prefill: &str, decode: &str, extra: &str) -> ModelConfig {
    let text = format!(
        r#"
[[models]]
name = "m"
backend = "vllm"
context_window = 1000
kv_capacity_tokens = 4000
tokenizer = "/t.json"
chat_template = {{ inline = "x" }}
[models.prefill]
workers = [{{ url = "{prefill}" }}]
[models.decode]
workers = [{{ url = "{decode}" }}]
{extra}
"#
    );
    Config::parse(&text).expect("config").models.remove(0)
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
        let p = lines(&cfg.problems()).join("\n");
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
        let p = lines(&cfg.problems()).join("\n");
        assert!(
            p.contains("prefill.prefix") && p.contains("block_tokens"),
            "{p}"
        );
        assert!(!p.contains("decode.prefix"), "{p}");
    }

    #[test]
    fn kv_event_settings_are_checked() {
        let events = |prefill: &str| {
            let text = BASE.replace(
                "[models.prefill]\nworkers = [{ url = \"http://127.0.0.1:1\", bootstrap_port = 8998 }]",
                prefill,
            );
            lines(&Config::parse(&text).expect("parses").problems()).join("\n")
        };
        // prefix_events without a publisher, per worker or for the pool.
        let p = events(
            "[models.prefill]\npolicy = \"prefix_events\"\nworkers = [{ url = \"http://127.0.0.1:1\" }]",
        );
        assert!(p.contains("prefill.workers[0].kv_events"), "{p}");
        // An endpoint that is not tcp://HOST:PORT; KV events given to another policy.
        let p = events(
            "[models.prefill]\npolicy = \"prefix_events\"\nworkers = [{ url = \"http://127.0.0.1:1\", kv_events = \"127.0.0.1:5557\" }]",
        );
        assert!(p.contains("expected tcp://HOST:PORT"), "{p}");
        let p = events(
            "[models.prefill]\nkv_events = { port = 5557 }\nworkers = [{ url = \"http://127.0.0.1:1\" }]",
        );
        assert!(
            p.contains("prefill.kv_events") && p.contains("prefix_events"),
            "{p}"
        );
        // The pool's port serves every worker; a worker's own endpoint too.
        for ok in [
            "[models.prefill]\npolicy = \"prefix_events\"\nkv_events = { port = 5557, replay_port = 5558 }\nworkers = [{ url = \"http://127.0.0.1:1\" }]",
            "[models.prefill]\npolicy = \"prefix_events\"\nworkers = [{ url = \"http://127.0.0.1:1\", kv_events = \"tcp://127.0.0.1:5557\" }]",
            "[models.prefill]\npolicy = \"prefix_events\"\nkv_events = { dp_size = 4 }\nworkers = [{ url = \"http://127.0.0.1:1\", kv_events = \"tcp://127.0.0.1:5557\" }]",
        ] {
            let p = events(ok);
            assert!(!p.contains("kv_events"), "{p}");
        }
        // Data-parallel ranks: at least one, and the last rank's ports must exist.
        for (bad, says) in [
            (
                "kv_events = { port = 5557, dp_size = 0 }",
                "between 1 and 256",
            ),
            ("kv_events = { port = 65534, dp_size = 4 }", "passes 65535"),
        ] {
            let p = events(&format!(
                "[models.prefill]\npolicy = \"prefix_events\"\n{bad}\nworkers = [{{ url = \"http://127.0.0.1:1\" }}]"
            ));
            assert!(
                p.contains("prefill.kv_events.dp_size") && p.contains(says),
                "{p}"
            );
        }
    }

    #[test]
    fn busy_polling_is_bounded_and_needs_pinned_connections() {
        let cfg = Config::parse(&format!("[server]\nbusy_poll_us = 50\n{BASE}")).expect("parses");
        assert_eq!(cfg.server.busy_poll_us, 50);
        let p = lines(&cfg.problems()).join("\n");
        assert!(!p.contains("busy_poll_us"), "{p}");
        let cfg =
            Config::parse(&format!("[server]\nbusy_poll_us = 10001\n{BASE}")).expect("parses");
        let p = lines(&cfg.problems()).join("\n");
        assert!(
            p.contains("server.busy_poll_us") && p.contains("at most 10000"),
            "{p}"
        );
        let cfg = Config::parse(&format!(
            "[server]\nbusy_poll_us = 50\nconnections = \"shared\"\n{BASE}"
        ))
        .expect("parses");
        let p = lines(&cfg.problems()).join("\n");
        assert!(
            p.contains("server.busy_poll_us") && p.contains("pinned"),
            "{p}"
        );
        // Off by default.
        assert_eq!(Config::parse(BASE).expect("parses").server.busy_poll_us, 0);
    }

    #[test]
    fn sglang_health_timeouts_must_outlast_its_one_second_health() {
        let cfg = Config::parse(&BASE.replace(
            "[models.decode]",
            "[models.health]\ntimeout_ms = 1000\n[models.decode]",
        ))
        .expect("parses");
        let p = lines(&cfg.problems()).join("\n");
        assert!(p.contains("health.timeout_ms") && p.contains("2000"), "{p}");
        // The default is long enough.
        let cfg = Config::parse(BASE).expect("parses");
        assert!(cfg.models[0].health.timeout_ms >= model::SGLANG_MIN_HEALTH_TIMEOUT_MS);
        let p = lines(&cfg.problems()).join("\n");
        assert!(!p.contains("health"), "{p}");
    }

    #[test]
    fn vllm_mooncake_is_refused_until_lockstep_speaks_it() {
        let text = BASE
            .replace("backend = \"sglang\"", "backend = \"vllm\"")
            .replace(
                "[models.decode]",
                "[models.vllm]\nconnector = \"mooncake\"\n[models.decode]",
            );
        let p = lines(&Config::parse(&text).expect("parses").problems()).join("\n");
        assert!(
            p.contains("vllm.connector") && p.contains("not supported"),
            "{p}"
        );
        let nixl = lines(
            &Config::parse(&text.replace("mooncake", "nixl"))
                .expect("parses")
                .problems(),
        )
        .join("\n");
        assert!(!nixl.contains("connector"), "{nixl}");
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

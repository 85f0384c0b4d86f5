//! A worker's configuration file: `[worker]` (the process) and `[engine]` (the same keys as a
//! router model's `[models.engine]`), loaded and validated by the shared TOML loader.

use std::net::SocketAddr;
use std::path::Path;

use lockstep_runtime::engine_section::EngineSection;
use lockstep_runtime::tls::PlaneTlsFiles;
use lockstep_runtime::toml_file::{self, ConfigError, ConfigFile, Problem, Problems, Section};
use serde::Deserialize;

/// What a worker does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// Computes prompts' KV and pushes it to decode workers.
    Prefill,
    /// Imports pushed KV and generates.
    Decode,
    /// Both (one engine, one pool).
    Unified,
}

impl Role {
    /// `prefill`, `decode` or `unified`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Unified => "unified",
        }
    }
}

/// A worker's configuration file.
#[derive(Debug, Clone, Deserialize, Default, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkerFile {
    /// The worker process.
    #[serde(default)]
    pub worker: WorkerSection,
    /// The engine (the same keys as a model's `[models.engine]`; `mode` is ignored: the role
    /// decides).
    #[serde(default)]
    pub engine: EngineSection,
}

/// `[worker]`.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerSection {
    /// The worker service's listener (gRPC over h2c, plus `GET /health`). Bind it privately.
    pub listen: SocketAddr,
    /// How long pushed KV waits for its decode call, and a decode call for its KV, in ms.
    pub lease_ms: u64,
    /// Bound on connecting to a peer worker, in ms.
    pub connect_timeout_ms: u64,
    /// A service connection with no call in flight for this many ms is closed (h2 GOAWAY;
    /// routers and peers reconnect on their next call). Idle KV data connections close at the
    /// lease.
    pub idle_timeout_ms: u64,
    /// Log filter.
    pub log_level: String,
    /// How this worker pushes KV to decode workers: `tcp` (the decode worker's KV data listener,
    /// raw framed pages: no protobuf copies) or `grpc` (`PushKv`). `tcp` falls back to `grpc`
    /// when the decode worker has no data listener.
    pub kv_transport: KvTransport,
    /// The KV data listener of a decode or unified worker (`host:0`: any free port on that
    /// host). Absent: the `listen` address's host, any free port. Bind it privately.
    pub kv_listen: Option<SocketAddr>,
    /// Bytes of pushed KV that may wait for their decode calls at once (0: the pool's bytes);
    /// past it a push is refused as busy (retry-safe: nothing kept).
    pub max_pending_kv_bytes: u64,
    /// Open connections on the KV data listener (prefill workers pool a few each).
    pub max_data_connections: usize,
    /// Mutual TLS on the worker plane (the service listener, the KV data listener, pushes to
    /// peers): `cert_file`, `key_file`, `ca_file`. Reloaded on SIGHUP.
    pub tls: Option<PlaneTlsFiles>,
    /// Serve in plaintext on a non-loopback address. UNSAFE: anyone who reaches the worker can
    /// run prefills and decodes, abort pairs and push KV. Without it, such a worker refuses to
    /// start unless `tls` is set.
    pub insecure_plaintext: bool,
}

/// How KV pages travel from a prefill worker to a decode worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum KvTransport {
    /// Raw framed bytes on a pooled TCP connection to the decode worker's data listener.
    Tcp,
    /// The `PushKv` client stream of the worker service.
    Grpc,
}

impl Default for WorkerSection {
    fn default() -> Self {
        WorkerSection {
            listen: SocketAddr::from(([127, 0, 0, 1], 9100)),
            lease_ms: 30_000,
            connect_timeout_ms: 2_000,
            idle_timeout_ms: 300_000,
            log_level: "info".into(),
            kv_transport: KvTransport::Tcp,
            kv_listen: None,
            max_pending_kv_bytes: 0,
            max_data_connections: 256,
            tls: None,
            insecure_plaintext: false,
        }
    }
}

impl ConfigFile for WorkerFile {
    fn resolve_paths(&mut self, base: &Path) {
        self.engine.resolve_paths(base);
        if let Some(t) = &mut self.worker.tls {
            t.resolve_paths(base);
        }
    }

    fn problems(&self) -> Vec<Problem> {
        let mut out = Problems::default();
        self.worker.validate("worker", &mut out);
        self.engine.validate("engine", &mut out);
        if self.engine.embeddings {
            out.push(
                "engine.embeddings",
                "a worker serves pairs only; embeddings are a router's embedded model's",
            );
        }
        out.into_vec()
    }
}

impl WorkerFile {
    /// Reads and validates a worker configuration; relative paths are relative to the file.
    pub fn load(path: &Path) -> Result<WorkerFile, ConfigError> {
        toml_file::load(path)
    }

    /// The defaults (the default model, listening on 127.0.0.1:9100), paths relative to `base`.
    pub fn defaults(base: &Path) -> WorkerFile {
        let mut f = WorkerFile::default();
        f.resolve_paths(base);
        f
    }
}

impl WorkerSection {
    /// Why this worker may not serve as configured: plaintext on a non-loopback address without
    /// `insecure_plaintext`.
    pub fn plaintext_refusal(&self) -> Option<String> {
        if self.tls.is_some() || self.insecure_plaintext {
            return None;
        }
        let exposed: Vec<String> = std::iter::once(self.listen)
            .chain(self.kv_listen)
            .filter(|a| !a.ip().is_loopback())
            .map(|a| a.to_string())
            .collect();
        (!exposed.is_empty()).then(|| {
            format!(
                "TLS is required: the worker would listen on {} (not loopback) in plaintext, where \
                 anyone who reaches it could run and abort pairs and push KV. Set [worker.tls] \
                 (cert_file, key_file, ca_file), or insecure_plaintext = true (UNSAFE)",
                exposed.join(", ")
            )
        })
    }
}

impl Section for WorkerSection {
    fn validate(&self, at: &str, out: &mut Problems) {
        if self.lease_ms == 0 {
            out.push(format!("{at}.lease_ms"), "must be greater than 0");
        }
        if self.max_data_connections == 0 {
            out.push(
                format!("{at}.max_data_connections"),
                "must be greater than 0",
            );
        }
        if self.connect_timeout_ms == 0 {
            out.push(format!("{at}.connect_timeout_ms"), "must be greater than 0");
        }
        if self.idle_timeout_ms == 0 {
            out.push(format!("{at}.idle_timeout_ms"), "must be greater than 0");
        }
    }
}

/// The worker file's JSON Schema (draft 2020-12; `lockstep config schema --worker`), generated
/// from the types it is read into, as [`lockstep_core::config::json_schema`] is for the router's.
pub fn json_schema() -> serde_json::Value {
    let mut schema = serde_json::to_value(schemars::schema_for!(WorkerFile)).unwrap_or_default();
    schema["title"] = "lockstep worker configuration (lockstep worker --config)".into();
    schema
}

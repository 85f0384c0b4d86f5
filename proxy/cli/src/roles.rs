//! `lockstep sidecar`'s command line: llm-d's routing-sidecar flags, where they map onto the
//! configuration, so the sidecar drops into llm-d's Helm values (`--port`, `--vllm-port`,
//! `--kv-connector`), applied to the file at start and at every reload alike.

use lockstep_core::config::{BackendKind, Config, Role, VllmConnector, WorkerConfig};

/// llm-d's `--kv-connector` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvConnector {
    /// vLLM with the NixlConnector.
    Nixlv2,
    /// SGLang's disaggregation (its bootstrap server).
    Sglang,
}

/// The flags of `lockstep sidecar` that change the file's configuration.
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub struct SidecarFlags {
    /// The port the sidecar serves on (llm-d `--port`): `server.http_listen`'s port.
    #[arg(long)]
    pub port: Option<u16>,
    /// The local engine's port (llm-d `--vllm-port`, for SGLang too): the decode worker becomes
    /// `http://127.0.0.1:PORT`.
    #[arg(long)]
    pub vllm_port: Option<u16>,
    /// The engine's protocol (llm-d `--kv-connector`, also `--connector`): must agree with the
    /// model's `backend` (`nixlv2`: `vllm` with `vllm.connector = "nixl"`; `sglang`).
    #[arg(long, alias = "connector", value_enum)]
    pub kv_connector: Option<KvConnector>,
}

impl SidecarFlags {
    /// `cfg` as a sidecar runs it: the role's checks, then the flags.
    pub fn apply(&self, mut cfg: Config) -> Result<Config, String> {
        cfg.for_role(Role::Sidecar)?;
        if let Some(p) = self.port {
            cfg.server.http_listen.set_port(p);
        }
        for m in &mut cfg.models {
            if let Some(p) = self.vllm_port {
                m.decode.workers = vec![WorkerConfig {
                    url: format!("http://127.0.0.1:{p}"),
                    bootstrap_port: None,
                    bootstrap_host: None,
                    kv_events: None,
                    kv_events_replay: None,
                }];
            }
            if let Some(k) = self.kv_connector {
                let fits = match k {
                    KvConnector::Nixlv2 => {
                        m.backend == BackendKind::Vllm && m.vllm.connector == VllmConnector::Nixl
                    }
                    KvConnector::Sglang => m.backend == BackendKind::Sglang,
                };
                if !fits {
                    return Err(format!(
                        "--kv-connector {k:?} does not match model `{}` (backend {:?}): set the model's backend to match",
                        m.name, m.backend
                    )
                    .to_lowercase());
                }
            }
        }
        Ok(cfg)
    }
}

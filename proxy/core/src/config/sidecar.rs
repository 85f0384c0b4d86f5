//! The two Gateway roles' sections: `[sidecar]` (`lockstep sidecar`: the pair between the prefill
//! an endpoint picker names in `x-prefiller-host-port` and the local decode engine) and `[epp]`
//! (`lockstep epp`: Envoy's endpoint picker over `ext_proc`).

use std::net::SocketAddr;

use lockstep_runtime::toml_file::{Problems, Section};
use serde::Deserialize;

/// `[sidecar]`: which prefills a request may name, and how long a new one may take to pass its
/// deployment check.
#[derive(Debug, Clone, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SidecarConfig {
    /// Networks (CIDR, `10.0.0.0/8`, `fd00::/8`, or one address), each optionally with a port
    /// or a port range (`10.0.0.0/8:8000`, `10.0.0.0/8:8000-8010`, `[fd00::/8]:8000`), a prefill
    /// named by `x-prefiller-host-port` may be at, besides the members of the model's prefill
    /// pool (configured or discovered). Anything else is 403 `prefill_not_allowed`, before any
    /// connection is made. Empty: only pool members.
    pub prefill_allow: Vec<String>,
    /// Prefills named at run time kept as members at once (each is health-checked), a hard
    /// bound: a name is reserved before its prefill joins. Past it the idle one named longest ago
    /// leaves, and with none idle a new name is 503 `workers_busy`.
    pub max_prefills: usize,
    /// A named prefill that runs no pair and has not been named for this long leaves the pool,
    /// ms (looked at whenever a request names a prefill).
    pub prefill_idle_ms: u64,
    /// How long a request waits for a newly named prefill to pass its deployment check, ms.
    pub verify_wait_ms: u64,
}

impl Default for SidecarConfig {
    fn default() -> Self {
        SidecarConfig {
            prefill_allow: Vec::new(),
            max_prefills: 64,
            prefill_idle_ms: 300_000,
            verify_wait_ms: 5_000,
        }
    }
}

/// One `sidecar.prefill_allow` entry: a network and the ports allowed in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedPrefills {
    /// The network (an address alone is its own /32 or /128).
    pub net: ipnet::IpNet,
    /// The ports allowed, inclusive (`1..=65535` when the entry names none).
    pub ports: std::ops::RangeInclusive<u16>,
}

impl AllowedPrefills {
    /// Reads `NET`, `NET:PORT` or `NET:LOW-HIGH`, where `NET` is a CIDR or an address; an IPv6
    /// one with ports is bracketed (`[fd00::/8]:8000`).
    pub fn parse(s: &str) -> Result<AllowedPrefills, String> {
        let s = s.trim();
        let bad = || {
            format!(
                "`{s}` is not NET, NET:PORT or NET:LOW-HIGH with NET a CIDR (`10.0.0.0/8`) or an IP address (an IPv6 one with ports in brackets: `[fd00::/8]:8000`)"
            )
        };
        let (net, ports) = if let Some(rest) = s.strip_prefix('[') {
            let (net, after) = rest.split_once(']').ok_or_else(bad)?;
            match after {
                "" => (net, None),
                p => (net, Some(p.strip_prefix(':').ok_or_else(bad)?)),
            }
        } else {
            match s.split_once(':') {
                // More than one colon: an IPv6 network without ports.
                Some((_, rest)) if rest.contains(':') => (s, None),
                Some((net, p)) => (net, Some(p)),
                None => (s, None),
            }
        };
        let net = net
            .parse::<ipnet::IpNet>()
            .or_else(|_| net.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
            .map_err(|_| bad())?;
        let port = |p: &str| p.trim().parse::<u16>().ok().filter(|p| *p > 0);
        let ports = match ports {
            None => 1..=u16::MAX,
            Some(p) => match p.split_once('-') {
                Some((lo, hi)) => match (port(lo), port(hi)) {
                    (Some(lo), Some(hi)) if lo <= hi => lo..=hi,
                    _ => return Err(bad()),
                },
                None => {
                    let p = port(p).ok_or_else(bad)?;
                    p..=p
                }
            },
        };
        Ok(AllowedPrefills { net, ports })
    }
}

impl SidecarConfig {
    /// The allowed networks and their ports, parsed.
    pub fn networks(&self) -> Result<Vec<AllowedPrefills>, String> {
        self.prefill_allow
            .iter()
            .map(|s| AllowedPrefills::parse(s))
            .collect()
    }
}

impl Section for SidecarConfig {
    fn validate(&self, at: &str, out: &mut Problems) {
        if let Err(e) = self.networks() {
            out.push(format!("{at}.prefill_allow"), e);
        }
        if self.max_prefills == 0 {
            out.push(format!("{at}.max_prefills"), "must be at least 1");
        }
        if self.prefill_idle_ms == 0 {
            out.push(format!("{at}.prefill_idle_ms"), "must be at least 1");
        }
        if self.verify_wait_ms == 0 {
            out.push(format!("{at}.verify_wait_ms"), "must be at least 1");
        }
    }
}

/// `[epp]`: where the endpoint picker serves Envoy's `ext_proc` and the gRPC health services.
#[derive(Debug, Clone, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct EppConfig {
    /// The gRPC listener (h2c): `envoy.service.ext_proc.v3.ExternalProcessor` and
    /// `grpc.health.v1.Health` (`liveness`, `readiness`, the ext_proc service).
    pub grpc_listen: SocketAddr,
    /// Largest body chunk sent back to Envoy, bytes (Envoy's limit for one streamed body
    /// mutation is 64 KiB).
    pub body_chunk_bytes: usize,
    /// Most ext_proc streams (requests) served at once; past it a new stream is refused with
    /// gRPC `RESOURCE_EXHAUSTED` before any of it is read (Envoy answers the request with its
    /// `status_on_error`, 503 in `deploy/envoy/envoy.yaml`). With `server.max_body_bytes` it
    /// bounds the memory that request bodies can hold in the picker.
    pub max_streams: usize,
    /// Request body bytes all streams may hold at once while their requests are read, before
    /// each is whole and picked (then its body goes on to Envoy and is let go). Past it a
    /// request is 503 `unavailable` with `Retry-After`: whatever the streams, the picker holds
    /// no more of their bodies than this.
    pub max_buffered_bytes: usize,
}

impl Default for EppConfig {
    fn default() -> Self {
        EppConfig {
            grpc_listen: SocketAddr::from(([0, 0, 0, 0], 9002)),
            body_chunk_bytes: 62 * 1024,
            max_streams: 1024,
            max_buffered_bytes: 256 * 1024 * 1024,
        }
    }
}

impl Section for EppConfig {
    fn validate(&self, at: &str, out: &mut Problems) {
        if self.body_chunk_bytes == 0 || self.body_chunk_bytes > 62 * 1024 {
            out.push(
                format!("{at}.body_chunk_bytes"),
                "must be between 1 and 63488 (62 KiB)",
            );
        }
        if self.max_streams == 0 {
            out.push(format!("{at}.max_streams"), "must be at least 1");
        }
        if self.max_buffered_bytes < 64 * 1024 || self.max_buffered_bytes > u32::MAX as usize {
            out.push(
                format!("{at}.max_buffered_bytes"),
                "must be between 65536 and 4294967295",
            );
        }
    }
}

/// The process a configuration is started as: each reads its own tables and refuses the others'
/// (a table no process reads would be ignored silently).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `lockstep serve`: the router.
    Serve,
    /// `lockstep sidecar`: one model, its decode the local engine.
    Sidecar,
    /// `lockstep epp`: Envoy's endpoint picker.
    Epp,
}

impl super::Config {
    /// Fits the configuration to the process `role` (a `lockstep sidecar` or `lockstep epp`
    /// without its table gets the defaults), or says what does not fit it.
    pub fn for_role(&mut self, role: Role) -> Result<(), String> {
        let mut out = Vec::new();
        let foreign = |table: &str, by: &str| {
            format!("[{table}] is read by `lockstep {by}`; this process would ignore it")
        };
        match role {
            Role::Serve => {
                if self.sidecar.is_some() {
                    out.push(foreign("sidecar", "sidecar"));
                }
                if self.epp.is_some() {
                    out.push(foreign("epp", "epp"));
                }
            }
            Role::Sidecar => {
                if self.epp.is_some() {
                    out.push(foreign("epp", "epp"));
                }
                self.sidecar.get_or_insert_with(SidecarConfig::default);
                if self.models.len() != 1 {
                    out.push(
                        "models: a sidecar serves exactly one model (its local engine's)".into(),
                    );
                }
                for m in &self.models {
                    let at = format!("models ({})", m.name);
                    if !matches!(
                        m.backend,
                        super::BackendKind::Sglang | super::BackendKind::Vllm
                    ) {
                        out.push(format!(
                            "{at}.backend: a sidecar fronts an `sglang` or `vllm` engine"
                        ));
                    }
                    if m.decode.workers.len() != 1 || m.decode.discovery.is_some() {
                        out.push(format!(
                            "{at}.decode: exactly one worker, the local engine (no discovery)"
                        ));
                    }
                }
            }
            Role::Epp => {
                if self.sidecar.is_some() {
                    out.push(foreign("sidecar", "sidecar"));
                }
                self.epp.get_or_insert_with(EppConfig::default);
                for m in &self.models {
                    if !matches!(
                        m.backend,
                        super::BackendKind::Sglang | super::BackendKind::Vllm
                    ) {
                        out.push(format!("models ({}).backend: the endpoint picker routes to `lockstep sidecar`s in front of `sglang` or `vllm` engines", m.name));
                    }
                }
            }
        }
        if out.is_empty() {
            Ok(())
        } else {
            Err(out.join("\n"))
        }
    }
}

//! A model's worker pools (`[models.prefill]`, `[models.decode]`) and their health checks.

use lockstep_runtime::toml_file::{Problems, Section};

/// The annotation an SGLang prefill pod names its bootstrap port with (SMG's, and the SGLang
/// router's, convention): part of a discovered pool's configuration, read by discovery and
/// named by the deployment check when a prefill has no bootstrap port.
pub const BOOTSTRAP_PORT_ANNOTATION: &str = "sglang.ai/bootstrap-port";
use serde::Deserialize;

/// How a pool picks a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, schemars::JsonSchema)]
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
    /// The worker whose engine reported holding the longest prefix of the prompt, from the KV
    /// events it publishes (SGLang `--kv-events-config`, vLLM `--kv-events-config`), keyed
    /// by the tenant's cache salt; load balance as `prefix_aware`. Needs `kv_events`.
    PrefixEvents,
}

/// Where a pool's workers publish KV events (`policy = "prefix_events"`), for a worker whose
/// entry names none (a discovered pod: its IP with these ports).
#[derive(Debug, Clone, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KvEventsConfig {
    /// The publisher's port (the engines' default is 5557).
    #[serde(default)]
    pub port: Option<u16>,
    /// The replay ROUTER's port, asked for the batches a sequence gap lost (none: a gap drops
    /// that worker's index, rebuilt from the events that follow).
    #[serde(default)]
    pub replay_port: Option<u16>,
    /// The topic subscribed to (the engines' `topic`, default empty: every message).
    #[serde(default)]
    pub topic: String,
    /// Largest message read from a publisher or a replay, bytes (all its frames): a publisher
    /// that announces more is dropped and counted (`lockstep_kv_event_batches_total{result=
    /// "too_large"}`), then followed again later. An engine's batch of events is a few KiB.
    #[serde(default = "default_max_event_message")]
    pub max_message_bytes: usize,
    /// The engines' data-parallel size (SGLang `--dp-size`, vLLM `--data-parallel-size`): each
    /// rank publishes on the ports plus its rank, and every rank is followed. The engine deals
    /// a request to a rank lockstep does not choose, so a worker counts as holding a prefix
    /// only as far as every rank holds it.
    #[serde(default = "default_dp_size")]
    pub dp_size: u16,
}

fn default_dp_size() -> u16 {
    1
}

fn default_max_event_message() -> usize {
    4 * 1024 * 1024
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            port: None,
            replay_port: None,
            topic: String::new(),
            max_message_bytes: default_max_event_message(),
            dp_size: default_dp_size(),
        }
    }
}

/// Tuning of `policy = "prefix_aware"` (SGLang's cache-aware policy, on hashed token blocks).
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, schemars::JsonSchema)]
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
#[derive(Debug, Clone, Default, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Selection policy.
    #[serde(default)]
    pub policy: PolicyKind,
    /// The workers.
    #[serde(default)]
    pub workers: Vec<WorkerConfig>,
    /// Where the workers come from at run time, instead of `workers`:
    /// `{ kind = "kubernetes", namespace, selector, port }` (the pods the selector matches).
    #[serde(default)]
    pub discovery: Option<DiscoveryConfig>,
    /// Pairs one worker of this side may hold at once (0: no limit); over it, 503 `workers_busy`.
    #[serde(default)]
    pub max_pairs_per_worker: usize,
    /// SGLang: the bootstrap port of a prefill worker whose entry names none (a configured
    /// worker, a discovered pod without the annotation, a prefill `lockstep sidecar` is named
    /// by `x-prefiller-host-port`; the sidecar's default is SGLang's 8998).
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// Tuning of the `prefix_aware` and `prefix_events` policies.
    #[serde(default)]
    pub prefix: PrefixRouting,
    /// Where the workers' KV events come from (`prefix_events`).
    #[serde(default)]
    pub kv_events: Option<KvEventsConfig>,
    /// The workers' API key (SGLang and vLLM `--api-key`), sent as `Authorization: Bearer` on
    /// every call but `/health` (which both exempt).
    #[serde(default)]
    pub api_key: Option<Secret>,
    /// SGLang's `--admin-api-key`: sent instead of `api_key` to `/abort_request`, which then
    /// accepts only it.
    #[serde(default)]
    pub admin_api_key: Option<Secret>,
    /// Send `api_key` / `admin_api_key` to `http://` workers that are not on loopback, where
    /// anyone on the path can read it. UNSAFE; without it such a pool is refused (use
    /// `https://` workers, `server.upstream_ca_file` for a private CA).
    #[serde(default)]
    pub insecure_plaintext: bool,
}

/// A credential from the configuration: never printed (`Debug` shows `***`).
#[derive(Clone, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// The secret itself (for keying, never for printing).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The `Authorization: Bearer` value, marked sensitive (kept out of HPACK tables and logs).
    pub fn bearer(&self) -> Option<http::HeaderValue> {
        let mut v = http::HeaderValue::from_str(&format!("Bearer {}", self.0)).ok()?;
        v.set_sensitive(true);
        Some(v)
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

impl PoolConfig {
    /// The `Authorization` header of ordinary calls (`/generate`, `/v1/completions`,
    /// `/server_info`), where the pool has a key.
    pub fn auth(&self) -> Option<http::HeaderValue> {
        self.api_key.as_ref().and_then(Secret::bearer)
    }

    /// [`PoolConfig::auth`] as the extra headers of a call (none without a key).
    pub fn auth_headers(&self) -> Vec<(http::HeaderName, http::HeaderValue)> {
        self.auth()
            .map(|v| (http::header::AUTHORIZATION, v))
            .into_iter()
            .collect()
    }

    /// The `Authorization` header of admin calls (SGLang `/abort_request`: the admin key where
    /// one is set, else the API key; SGLang 0.5.23 `srt/utils/auth.py`, `ADMIN_OPTIONAL`).
    pub fn admin_auth(&self) -> Option<http::HeaderValue> {
        self.admin_api_key
            .as_ref()
            .or(self.api_key.as_ref())
            .and_then(Secret::bearer)
    }
}

/// Where a pool's workers come from (`discovery = { kind = "kubernetes", ... }`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// The source; `kubernetes`: Pods from the API server (`KUBECONFIG`, or the in-cluster
    /// service account).
    pub kind: DiscoveryKind,
    /// The namespace watched.
    pub namespace: String,
    /// The label selector, sent to the API server (`app=sglang,component=prefill`).
    pub selector: String,
    /// The port each pod's worker listens on.
    pub port: u16,
    /// `https` to call the pods over TLS (default `http`).
    #[serde(default)]
    pub scheme: DiscoveryScheme,
    /// An SGLang prefill's bootstrap port when its pod has no `sglang.ai/bootstrap-port`
    /// annotation.
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
    /// A kubeconfig file naming the API server (a cluster other than the one lockstep runs
    /// in); default: `KUBECONFIG`, else the in-cluster service account.
    #[serde(default)]
    pub kubeconfig: Option<std::path::PathBuf>,
}

/// The kinds of discovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DiscoveryKind {
    /// Pods from the Kubernetes API.
    Kubernetes,
}

/// How discovered workers are called.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DiscoveryScheme {
    /// Plain HTTP.
    #[default]
    Http,
    /// TLS (`server.upstream_ca_file` for a private CA).
    Https,
}

impl DiscoveryScheme {
    /// `http` or `https`.
    pub fn as_str(self) -> &'static str {
        match self {
            DiscoveryScheme::Http => "http",
            DiscoveryScheme::Https => "https",
        }
    }
}

/// One worker.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
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
    /// Its engine's KV event publisher, `tcp://HOST:PORT` (`prefix_events`; default: the
    /// pool's `kv_events.port` on the worker's host).
    #[serde(default)]
    pub kv_events: Option<String>,
    /// Its publisher's replay endpoint, `tcp://HOST:PORT`.
    #[serde(default)]
    pub kv_events_replay: Option<String>,
}

/// Background health checks (`GET /health`).
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
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
            // SGLang's /health takes over 1 s (see `SGLANG_MIN_HEALTH_TIMEOUT_MS`).
            timeout_ms: 5_000,
            failure_threshold: 3,
            success_threshold: 2,
        }
    }
}

impl Section for PoolConfig {
    fn validate(&self, at: &str, out: &mut Problems) {
        let r = &self.prefix;
        if r.block_tokens == 0
            || r.capacity_blocks == 0
            || !(0.0..=1.0).contains(&r.cache_threshold)
            || r.balance_rel_threshold.is_nan()
            || r.balance_rel_threshold < 1.0
        {
            out.push(format!("{at}.prefix"), "block_tokens and capacity_blocks must be positive, cache_threshold in [0, 1], balance_rel_threshold at least 1");
        }
        if self
            .kv_events
            .as_ref()
            .is_some_and(|k| k.max_message_bytes < 1024 || k.max_message_bytes > 1 << 30)
        {
            out.push(
                format!("{at}.kv_events.max_message_bytes"),
                "must be between 1024 and 1073741824 (1 GiB)",
            );
        }
        if self
            .kv_events
            .as_ref()
            .is_some_and(|k| !(1..=256).contains(&k.dp_size))
        {
            out.push(
                format!("{at}.kv_events.dp_size"),
                "must be between 1 and 256",
            );
        } else if let Some(k) = &self.kv_events {
            // Rank r publishes on the ports plus r: the last rank's must exist.
            let worker_ports = self.workers.iter().flat_map(|w| {
                [&w.kv_events, &w.kv_events_replay]
                    .into_iter()
                    .flatten()
                    .filter_map(|e| e.rsplit_once(':')?.1.parse::<u16>().ok())
            });
            let ports: Vec<u16> = [k.port, k.replay_port]
                .into_iter()
                .flatten()
                .chain(worker_ports)
                .collect();
            if ports
                .iter()
                .any(|p| u32::from(*p) + u32::from(k.dp_size) - 1 > 65535)
            {
                out.push(
                    format!("{at}.kv_events.dp_size"),
                    "the last rank's port (a publisher's port plus dp_size - 1) passes 65535",
                );
            }
        }
        if self.policy == PolicyKind::PrefixEvents {
            let port = self.kv_events.as_ref().and_then(|k| k.port);
            if self.discovery.is_some() && port.is_none() {
                out.push(format!("{at}.kv_events.port"), "policy = \"prefix_events\" with discovery needs the port each pod publishes KV events on");
            }
            for (j, w) in self.workers.iter().enumerate() {
                if w.kv_events.is_none() && port.is_none() {
                    out.push(format!("{at}.workers[{j}].kv_events"), "policy = \"prefix_events\" needs each worker's KV event publisher (`kv_events = \"tcp://HOST:PORT\"`, or the pool's kv_events.port)");
                }
            }
        } else if self.kv_events.is_some() || self.workers.iter().any(|w| w.kv_events.is_some()) {
            out.push(
                format!("{at}.kv_events"),
                "KV events are read only by policy = \"prefix_events\"",
            );
        }
        for (j, w) in self.workers.iter().enumerate() {
            for (k, e) in [
                ("kv_events", &w.kv_events),
                ("kv_events_replay", &w.kv_events_replay),
            ] {
                if let Some(e) = e
                    && !e.strip_prefix("tcp://").is_some_and(|r| {
                        r.rsplit_once(':').is_some_and(|(h, p)| {
                            !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0)
                        })
                    })
                {
                    out.push(
                        format!("{at}.workers[{j}].{k}"),
                        format!("`{e}`: expected tcp://HOST:PORT"),
                    );
                }
            }
        }
        match &self.discovery {
            None if self.workers.is_empty() => out.push(
                format!("{at}.workers"),
                "at least one worker is required (or `discovery`)",
            ),
            Some(_) if !self.workers.is_empty() => out.push(
                format!("{at}.discovery"),
                "give either `workers` or `discovery`, not both",
            ),
            Some(d) => {
                if d.namespace.is_empty() {
                    out.push(format!("{at}.discovery.namespace"), "must not be empty");
                }
                if d.selector.trim().is_empty() {
                    out.push(
                        format!("{at}.discovery.selector"),
                        "must not be empty: an empty selector would take every pod of the namespace as a worker",
                    );
                }
                if d.port == 0 {
                    out.push(format!("{at}.discovery.port"), "must be greater than 0");
                }
                if (self.api_key.is_some() || self.admin_api_key.is_some())
                    && d.scheme == DiscoveryScheme::Http
                    && !self.insecure_plaintext
                {
                    out.push(
                        format!("{at}.discovery.scheme"),
                        format!("the pool's API key would cross the network in plaintext to every pod; set scheme = \"https\", or {at}.insecure_plaintext = true (UNSAFE)"),
                    );
                }
            }
            None => {}
        }
        for (k, key) in [
            ("api_key", &self.api_key),
            ("admin_api_key", &self.admin_api_key),
        ] {
            if let Some(s) = key
                && (s.0.is_empty() || s.bearer().is_none())
            {
                out.push(
                    format!("{at}.{k}"),
                    "must be a non-empty header-safe string (visible ASCII)",
                );
            }
        }
        if (self.api_key.is_some() || self.admin_api_key.is_some()) && !self.insecure_plaintext {
            for (j, w) in self.workers.iter().enumerate() {
                let uri: Option<http::Uri> = w.url.parse().ok();
                if uri.is_some_and(|u| {
                    u.scheme_str() == Some("http") && !super::plane::is_loopback(u.host())
                }) {
                    out.push(
                        format!("{at}.workers[{j}].url"),
                        format!(
                            "`{}`: the pool's API key would cross the network in plaintext; use https:// (with server.upstream_ca_file for a private CA), or set {at}.insecure_plaintext = true (UNSAFE)",
                            w.url
                        ),
                    );
                }
            }
        }
        for (j, w) in self.workers.iter().enumerate() {
            if let Err(e) = w
                .url
                .parse::<http::Uri>()
                .map_err(|e| e.to_string())
                .and_then(|u| {
                    if matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some() {
                        Ok(())
                    } else {
                        Err("expected an http:// or https://host:port URL".to_string())
                    }
                })
            {
                out.push(
                    format!("{at}.workers[{j}].url"),
                    format!("`{}`: {e}", w.url),
                );
            }
        }
    }
}

impl Section for HealthConfig {
    fn validate(&self, at: &str, out: &mut Problems) {
        if self.interval_ms == 0
            || self.timeout_ms == 0
            || self.failure_threshold == 0
            || self.success_threshold == 0
        {
            out.push(
                at,
                "interval_ms, timeout_ms and both thresholds must be greater than 0",
            );
        }
    }
}

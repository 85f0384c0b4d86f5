//! `[server]`: listeners and process-wide limits.

use std::net::SocketAddr;
use std::path::PathBuf;

use lockstep_runtime::toml_file::{Problems, Section, is_sha256_hex};
use serde::Deserialize;

/// The largest `server.busy_poll_us`.
pub const MAX_BUSY_POLL_US: u64 = 10_000;

/// Listeners and process-wide limits.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address of the HTTP listener (HTTP/1.1 and h2c).
    pub http_listen: SocketAddr,
    /// Log filter (`info`, `debug`, `lockstep=debug,warn`, ...).
    pub log_level: String,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// Bound on receiving a request's whole body once its headers are in, in ms (a client that
    /// trickles its body gets 408 `body_timeout`).
    pub body_timeout_ms: u64,
    /// Bound on connecting to a worker, in milliseconds.
    pub connect_timeout_ms: u64,
    /// Runtime worker threads; 0 means one per core. With `connections = "pinned"`, also the
    /// number of connection threads.
    pub worker_threads: usize,
    /// Where connections to the API listener are served (see [`Connections`]).
    pub connections: Connections,
    /// With `connections = "pinned"`: each connection thread polls for up to this many µs
    /// before its event loop sleeps, so an upstream's answer or a client's next request finds
    /// it running instead of waking it (lower latency where waking an idle CPU is slow, as on
    /// most VMs; a CPU kept busy while idle). 0, the default: off. HAProxy's `busy-polling`.
    pub busy_poll_us: u64,
    /// Audit log of aborted pairs and integrity events (JSON lines): a file path (appended),
    /// `-` for stdout, empty for off. Opened at start; a reload does not move it.
    pub audit_log: String,
    /// On SIGTERM: how long committed streams may run on before they are aborted, ms.
    pub drain_grace_ms: u64,
    /// A connection that has not sent its request headers within this many ms is closed.
    pub header_timeout_ms: u64,
    /// Connections the HTTP listener holds open at once (0: no limit); past it, new ones wait
    /// in the kernel's accept queue until one closes.
    pub max_connections: usize,
    /// A connection with no request in flight for this many ms is closed (h2: GOAWAY). Keep it
    /// above the idle timeout of any load balancer in front (AWS ALB 60 s, nginx 75 s), so
    /// the balancer, not lockstep, ends idle connections.
    pub idle_timeout_ms: u64,
    /// HTTP/2 streams one connection may have open at once (the SETTINGS frame's
    /// `MAX_CONCURRENT_STREAMS`; hyper's default is 200). Bounds what one connection can hold.
    pub max_concurrent_streams: u32,
    /// gRPC health `Watch` and reflection streams (unauthenticated, and endless unless the
    /// client ends them) open at once; past it, UNAVAILABLE.
    pub grpc_max_long_streams: usize,
    /// A gRPC health `Watch` or reflection stream is ended (UNAVAILABLE, clients re-open it)
    /// after this many ms, so none keeps a connection busy for ever.
    pub grpc_stream_lifetime_ms: u64,
    /// PEM certificate chain: with `tls_key_file`, both listeners speak HTTPS.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
    /// Extra CA certificates (PEM) trusted for `https://` workers, besides the webpki roots.
    pub upstream_ca_file: Option<PathBuf>,
    /// The admin API's listener (off when absent). Bind it to a private address.
    pub admin_listen: Option<SocketAddr>,
    /// Serve `/metrics` on the admin listener (behind the admin key) instead of the API
    /// listener, so clients cannot read per-worker load and pair counts.
    pub metrics_on_admin: bool,
    /// sha256 (hex) of the admin API's key; required with `admin_listen`.
    pub admin_key_sha256: String,
    /// The secret tenants' prefix-cache salts are keyed with. Unset: random per process (a
    /// restart starts every namespace cold). Give replicas in front of the same workers the same
    /// one so their tenants' prefixes are shared.
    pub cache_salt_secret: Option<super::pool::Secret>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            http_listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            log_level: "info".into(),
            max_body_bytes: 4 * 1024 * 1024,
            body_timeout_ms: 30_000,
            connect_timeout_ms: 2_000,
            worker_threads: 0,
            connections: Connections::Pinned,
            busy_poll_us: 0,
            audit_log: String::new(),
            drain_grace_ms: 30_000,
            header_timeout_ms: 10_000,
            max_connections: 10_000,
            idle_timeout_ms: 300_000,
            max_concurrent_streams: 64,
            grpc_max_long_streams: 64,
            grpc_stream_lifetime_ms: 300_000,
            tls_cert_file: None,
            tls_key_file: None,
            upstream_ca_file: None,
            admin_listen: None,
            metrics_on_admin: false,
            cache_salt_secret: None,
            admin_key_sha256: String::new(),
        }
    }
}

/// Where the API listener's connections are served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Connections {
    /// Each connection lives on one of `worker_threads` threads with its own event loop and its
    /// own upstream connections (the one with the fewest connections when it arrives), as nginx
    /// and Envoy place connections on workers: a request never changes threads. HTTP/2 streams
    /// (gRPC) still run on the shared runtime, so one multiplexed connection uses every core.
    Pinned,
    /// Every connection on the shared work-stealing runtime: for a few very busy HTTP/1.1
    /// connections (a load balancer in front that opens only a couple), which pinned would
    /// leave on one core.
    Shared,
}

impl Section for ServerConfig {
    fn validate(&self, at: &str, out: &mut Problems) {
        if self.metrics_on_admin && self.admin_listen.is_none() {
            out.push(
                format!("{at}.metrics_on_admin"),
                "needs server.admin_listen",
            );
        }
        if self.busy_poll_us > MAX_BUSY_POLL_US {
            out.push(
                format!("{at}.busy_poll_us"),
                format!("at most {MAX_BUSY_POLL_US} (10 ms); a few tens of µs is the useful range"),
            );
        }
        if self.busy_poll_us > 0 && self.connections != Connections::Pinned {
            out.push(
                format!("{at}.busy_poll_us"),
                "needs server.connections = \"pinned\" (the shared runtime does not poll)",
            );
        }
        if !(1..=1024).contains(&self.max_concurrent_streams) {
            out.push(format!("{at}.max_concurrent_streams"), "must be 1 to 1024");
        }
        if self.grpc_max_long_streams == 0 {
            out.push(
                format!("{at}.grpc_max_long_streams"),
                "must be greater than 0",
            );
        }
        if self.grpc_stream_lifetime_ms == 0 {
            out.push(
                format!("{at}.grpc_stream_lifetime_ms"),
                "must be greater than 0",
            );
        }
        if self.connect_timeout_ms == 0 {
            out.push(format!("{at}.connect_timeout_ms"), "must be greater than 0");
        }
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            out.push(
                format!("{at}.tls_cert_file, {at}.tls_key_file"),
                "give both or neither",
            );
        }
        if self.header_timeout_ms == 0 {
            out.push(format!("{at}.header_timeout_ms"), "must be greater than 0");
        }
        if self.idle_timeout_ms == 0 {
            out.push(format!("{at}.idle_timeout_ms"), "must be greater than 0");
        }
        if self.body_timeout_ms == 0 {
            out.push(format!("{at}.body_timeout_ms"), "must be greater than 0");
        }
        if self.max_body_bytes == 0 {
            out.push(format!("{at}.max_body_bytes"), "must be greater than 0");
        }
        if self.admin_listen.is_some() && !is_sha256_hex(&self.admin_key_sha256) {
            out.push(format!("{at}.admin_key_sha256"), "required with admin_listen: 64 lowercase hex digits (the sha256 of the admin key; `lockstep hash-key`)");
        }
    }
}

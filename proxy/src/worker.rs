//! `lockstep worker`: the embedded engine behind the worker service (`lockstep.v1.Worker`), so
//! prefill and decode run as separate processes on separate machines with lockstep's integrity
//! guarantees across the network.
//!
//! A prefill worker computes a pair's KV and pushes it, with its manifest, **directly to the
//! decode worker the router chose** (`PushKv`, a client stream: manifest, then pages); it reports
//! the manifest digest to the router. The decode worker holds a pushed set in the pair's room
//! until the router's `Decode` call claims it, then the engine verifies it (pair, model, token
//! count, every page's checksum) before it touches the pool, and reports the digest of what it
//! imported. The router compares the two digests (it trusts neither side alone).
//!
//! Freeing what a lost peer leaves behind: a `Decode` or `Prefill` call whose caller goes away is
//! aborted in the engine at once (its pages freed); a pushed set nobody claims, or a `Decode`
//! waiting for a set that never comes, is dropped after `worker.lease_ms`; an `Abort` drops both
//! immediately.

use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dashmap::DashMap;
use futures_util::{Stream, StreamExt};
use lockstep_engine::engine::{Engine, EngineError, Event, Generate, ModelBundle};
use lockstep_engine::pd::{Fault, FaultPlan, KvRoom};
use lockstep_engine::pool::KvDtype;
use lockstep_engine::sample::{Finish, SamplingConfig};
use lockstep_engine::transfer::{KvManifest, KvTransfer, ModelFingerprint, PageData};
use lockstep_proto::v1 as pb;
use lockstep_proto::v1::worker_client::WorkerClient;
use lockstep_proto::v1::worker_server::{Worker, WorkerServer};
use serde::Deserialize;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status, Streaming};

use crate::config::{EngineSection, FaultKind};

/// Largest gRPC message a worker accepts (one KV page of a large model is a few MiB).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

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
#[derive(Debug, Clone, Deserialize, Default)]
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
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerSection {
    /// The worker service's listener (gRPC over h2c, plus `GET /health`). Bind it privately.
    pub listen: SocketAddr,
    /// How long pushed KV waits for its decode call, and a decode call for its KV, in ms.
    pub lease_ms: u64,
    /// Bound on connecting to a peer worker, in ms.
    pub connect_timeout_ms: u64,
    /// Log filter.
    pub log_level: String,
    /// How this worker pushes KV to decode workers: `tcp` (the decode worker's KV data listener,
    /// raw framed pages: no protobuf copies) or `grpc` (`PushKv`). `tcp` falls back to `grpc`
    /// when the decode worker has no data listener.
    pub kv_transport: KvTransport,
    /// The KV data listener of a decode or unified worker (`host:0`: any free port on that
    /// host). Absent: the `listen` address's host, any free port. Bind it privately.
    pub kv_listen: Option<SocketAddr>,
}

/// How KV pages travel from a prefill worker to a decode worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
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
            log_level: "info".into(),
            kv_transport: KvTransport::Tcp,
            kv_listen: None,
        }
    }
}

impl WorkerFile {
    /// Reads a worker configuration; relative paths are relative to the file.
    pub fn load(path: &Path) -> Result<WorkerFile, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let mut f = WorkerFile::parse(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        f.resolve_paths(path.parent().unwrap_or(Path::new(".")));
        Ok(f)
    }

    /// Parses TOML text; the error names the key path.
    pub fn parse(text: &str) -> Result<WorkerFile, String> {
        let de =
            toml::Deserializer::parse(text).map_err(|e| e.to_string().trim_end().to_string())?;
        let f: WorkerFile = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            format!("at `{path}`: {}", e.into_inner().to_string().trim_end())
        })?;
        if f.worker.lease_ms == 0 {
            return Err("worker.lease_ms must be positive".into());
        }
        Ok(f)
    }

    /// Makes the model path absolute (`~/` expanded, relative to `base`).
    pub fn resolve_paths(&mut self, base: &Path) {
        let g = crate::config::expand_home(&self.engine.gguf);
        self.engine.gguf = if g.is_relative() { base.join(g) } else { g };
    }
}

/// The worker service over one engine.
pub struct WorkerService {
    role: Role,
    engine: Engine,
    fingerprint: ModelFingerprint,
    page_size: u32,
    rooms: Arc<DashMap<u64, Arc<KvRoom>>>,
    lease: Duration,
    connect_timeout: Duration,
    peers: DashMap<String, WorkerClient<Channel>>,
    faults: Option<FaultPlan>,
    pairs: AtomicU64,
    swap_stash: Mutex<Option<PageData>>,
    serving: AtomicBool,
    transport: KvTransport,
    /// The KV data listener's port (0: none).
    data_port: std::sync::atomic::AtomicU32,
    /// Decode workers' data addresses (from their Capacity), by endpoint.
    data_addrs: DashMap<String, Option<SocketAddr>>,
    /// Idle data connections, by address.
    data_conns: DashMap<SocketAddr, Vec<tokio::net::TcpStream>>,
}

impl std::fmt::Debug for WorkerService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerService")
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

fn engine_status(e: EngineError) -> Status {
    match e {
        EngineError::Transfer(_) | EngineError::Integrity(_) => Status::data_loss(e.to_string()),
        EngineError::Full { .. } => Status::resource_exhausted(e.to_string()),
        EngineError::TooLarge { .. } | EngineError::BadRequest(_) => {
            Status::invalid_argument(e.to_string())
        }
        EngineError::Stopped => Status::aborted(e.to_string()),
        EngineError::Model(_) | EngineError::Pool(_) => Status::internal(e.to_string()),
    }
}

/// Aborts an engine request when dropped before [`AbortOnDrop::disarm`]: a call whose caller went
/// away frees its pages at once.
struct AbortOnDrop<'a> {
    engine: &'a Engine,
    id: u64,
    armed: bool,
}

impl AbortOnDrop<'_> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for AbortOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.engine.abort(self.id);
        }
    }
}

/// The manifest on the wire.
pub fn manifest_to_pb(m: &KvManifest) -> pb::KvManifest {
    pb::KvManifest {
        pair_id: m.pair_id,
        model_fingerprint: m.model.0,
        tokens: m.tokens,
        page_size: m.page_size,
        dtype: match m.dtype {
            KvDtype::F32 => 0,
            KvDtype::F16 => 1,
        },
        page_count: m.page_count,
        page_checksums: m.page_checksums.clone(),
        manifest_checksum: m.manifest_checksum,
    }
}

/// A manifest from the wire (its checksum is verified on import, not here).
pub fn manifest_from_pb(m: pb::KvManifest) -> Result<KvManifest, Status> {
    Ok(KvManifest {
        pair_id: m.pair_id,
        model: ModelFingerprint(m.model_fingerprint),
        tokens: m.tokens,
        page_size: m.page_size,
        dtype: match m.dtype {
            0 => KvDtype::F32,
            1 => KvDtype::F16,
            d => return Err(Status::invalid_argument(format!("unknown KV dtype {d}"))),
        },
        page_count: m.page_count,
        page_checksums: m.page_checksums,
        manifest_checksum: m.manifest_checksum,
    })
}

/// The messages of one KV push: the manifest, then each page.
pub fn push_messages(t: KvTransfer) -> Vec<pb::KvPush> {
    use pb::kv_push::Item;
    let mut out = Vec::with_capacity(t.pages.len() + 1);
    out.push(pb::KvPush {
        item: Some(Item::Manifest(manifest_to_pb(&t.manifest))),
    });
    out.extend(t.pages.into_iter().map(|p| pb::KvPush {
        item: Some(Item::Page(pb::KvPage {
            index: p.index,
            pair_id: p.pair_id,
            data: p.bytes,
        })),
    }));
    out
}

/// Connects lazily to a worker endpoint (`http://host:port`), h2 with no Nagle delay.
pub fn worker_channel(url: &str, connect_timeout: Duration) -> Result<Channel, String> {
    Ok(Endpoint::from_shared(url.to_string())
        .map_err(|e| format!("bad worker endpoint `{url}`: {e}"))?
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .http2_adaptive_window(true)
        .connect_lazy())
}

fn sampling_from_pb(s: Option<pb::Sampling>) -> SamplingConfig {
    let s = s.unwrap_or_default();
    SamplingConfig {
        max_tokens: s.max_tokens as usize,
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: if s.top_p > 0.0 { s.top_p } else { 1.0 },
        seed: s.seed,
        stop: s.stop,
        stop_token_ids: Vec::new(),
        ignore_eos: s.ignore_eos,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
    }
}

impl WorkerService {
    /// Loads the model and starts the engine for `role`.
    pub fn start(role: Role, file: &WorkerFile) -> Result<WorkerService, String> {
        let e = &file.engine;
        let path = crate::fetch::ensure_model(e)?;
        let device = e
            .device
            .parse::<lockstep_engine::cuda::DeviceChoice>()
            .map_err(|err| format!("engine.{err}"))?;
        let bundle = Arc::new(ModelBundle::open_on(&path, device).map_err(|e| e.to_string())?);
        tracing::info!(role = role.as_str(), device = %bundle.device(), file = %path.display(), "worker engine device");
        let fingerprint = bundle.fingerprint;
        let cfg = crate::app::engine_config(e);
        let engine = Engine::start(role.as_str(), bundle, cfg).map_err(|e| e.to_string())?;
        let faults = e.fault.map(|f| FaultPlan {
            fault: match f {
                FaultKind::CorruptPage => Fault::CorruptPage,
                FaultKind::DropPage => Fault::DropPage,
                FaultKind::SwapPages => Fault::SwapPages,
                FaultKind::RejectWithDecoy => Fault::RejectWithDecoy,
            },
            every: e.fault_every,
        });
        if faults.is_some() {
            tracing::warn!(fault = ?e.fault, "KV push FAULT INJECTION is on: unsafe, for tests only");
        }
        Ok(WorkerService {
            role,
            engine,
            fingerprint,
            page_size: e.page_size as u32,
            rooms: Arc::default(),
            lease: Duration::from_millis(file.worker.lease_ms),
            connect_timeout: Duration::from_millis(file.worker.connect_timeout_ms),
            peers: DashMap::new(),
            faults,
            pairs: AtomicU64::new(0),
            swap_stash: Mutex::new(None),
            serving: AtomicBool::new(true),
            transport: file.worker.kv_transport,
            data_port: Default::default(),
            data_addrs: DashMap::new(),
            data_conns: DashMap::new(),
        })
    }

    /// The engine's live counters.
    pub fn engine_stats(&self) -> &lockstep_engine::engine::EngineStats {
        self.engine.stats()
    }

    /// Stops taking new pairs (Health says not serving, new calls get UNAVAILABLE).
    pub fn set_serving(&self, serving: bool) {
        self.serving.store(serving, Ordering::Release);
    }

    fn admit(&self, allowed: &[Role], what: &str) -> Result<(), Status> {
        if !allowed.contains(&self.role) {
            return Err(Status::failed_precondition(format!(
                "this is a {} worker: it does not serve {what}",
                self.role.as_str()
            )));
        }
        if !self.serving.load(Ordering::Acquire) {
            return Err(Status::unavailable("worker is draining"));
        }
        Ok(())
    }

    fn room(&self, pair_id: u64) -> Arc<KvRoom> {
        self.rooms.entry(pair_id).or_default().clone()
    }

    /// Drops rooms older than the lease (their pushed KV, or the wait for it).
    pub fn sweep(&self) -> usize {
        let mut n = 0;
        self.rooms.retain(|_, r| {
            let keep = r.age() < self.lease;
            if !keep {
                r.close();
                n += 1;
            }
            keep
        });
        n
    }

    fn peer(&self, url: &str) -> Result<WorkerClient<Channel>, Status> {
        if let Some(c) = self.peers.get(url) {
            return Ok(c.clone());
        }
        let ch = worker_channel(url, self.connect_timeout).map_err(Status::invalid_argument)?;
        let c = WorkerClient::new(ch).max_encoding_message_size(MAX_MESSAGE_BYTES);
        self.peers.insert(url.to_string(), c.clone());
        Ok(c)
    }

    /// Pushes a set to a decode worker: over its data listener when it has one and this worker
    /// uses `tcp`, else through `PushKv`.
    async fn push(
        &self,
        mut peer: WorkerClient<Channel>,
        endpoint: &str,
        t: KvTransfer,
    ) -> Result<(), String> {
        if self.transport == KvTransport::Tcp
            && let Some(addr) = self.data_addr(&mut peer, endpoint).await
        {
            return self.push_tcp(addr, &t).await;
        }
        peer.push_kv(tokio_stream::iter(push_messages(t)))
            .await
            .map(|_| ())
            .map_err(|s| format!("{}: {}", s.code(), s.message()))
    }

    /// The decode worker's data address (its gRPC host, the port its Capacity names), cached.
    async fn data_addr(
        &self,
        peer: &mut WorkerClient<Channel>,
        endpoint: &str,
    ) -> Option<SocketAddr> {
        if let Some(a) = self.data_addrs.get(endpoint) {
            return *a;
        }
        let port = peer
            .capacity(pb::CapacityRequest {})
            .await
            .ok()?
            .into_inner()
            .kv_data_port;
        let addr = if port == 0 {
            None
        } else {
            let uri: http::Uri = endpoint.parse().ok()?;
            let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
            tokio::net::lookup_host((host, port as u16))
                .await
                .ok()?
                .next()
        };
        self.data_addrs.insert(endpoint.to_string(), addr);
        addr
    }

    /// One set over a pooled data connection; a pooled connection that turns out dead is
    /// replaced once by a fresh one (the receiver keeps nothing of a set it did not get whole).
    async fn push_tcp(&self, addr: SocketAddr, t: &KvTransfer) -> Result<(), String> {
        let pooled = self.data_conns.get_mut(&addr).and_then(|mut v| v.pop());
        let fresh = pooled.is_none();
        let conn = match pooled {
            Some(c) => c,
            None => self.data_connect(addr).await?,
        };
        match data_send(conn, t).await {
            Ok(c) => {
                self.data_conns.entry(addr).or_default().push(c);
                Ok(())
            }
            Err(e) if !fresh && !e.refused => {
                let c = data_send(self.data_connect(addr).await?, t)
                    .await
                    .map_err(|e| e.message)?;
                self.data_conns.entry(addr).or_default().push(c);
                Ok(())
            }
            Err(e) => Err(e.message),
        }
    }

    async fn data_connect(&self, addr: SocketAddr) -> Result<tokio::net::TcpStream, String> {
        let c = tokio::time::timeout(self.connect_timeout, tokio::net::TcpStream::connect(addr))
            .await
            .map_err(|_| format!("connecting to {addr} timed out"))?
            .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
        let _ = c.set_nodelay(true);
        Ok(c)
    }

    /// Receives sets on one data connection until it closes.
    async fn data_serve(self: Arc<Self>, mut c: tokio::net::TcpStream) {
        use tokio::io::AsyncWriteExt;
        loop {
            match tokio::time::timeout(self.lease, self.data_receive(&mut c)).await {
                Ok(Ok(None)) => return,
                Ok(Ok(Some((t, bytes)))) => {
                    if !self.serving.load(Ordering::Acquire) {
                        let _ = data_refuse(&mut c, "worker is draining").await;
                        return;
                    }
                    let pair = t.manifest.pair_id;
                    self.room(pair).put(t);
                    let mut ack = [0u8; 9];
                    ack[1..].copy_from_slice(&bytes.to_le_bytes());
                    if c.write_all(&ack).await.is_err() {
                        return;
                    }
                }
                Ok(Err(e)) => {
                    let _ = data_refuse(&mut c, &e).await;
                    return;
                }
                // A set that stalls past the lease: drop it and the connection.
                Err(_) => return,
            }
        }
    }

    /// Reads one set; `None` on a clean close before a set starts.
    async fn data_receive(
        &self,
        c: &mut tokio::net::TcpStream,
    ) -> Result<Option<(KvTransfer, u64)>, String> {
        use lockstep_engine::transfer::wire;
        use tokio::io::AsyncReadExt;
        let mut fixed = [0u8; wire::HEAD_FIXED];
        match c.read_exact(&mut fixed).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e.to_string()),
        }
        let count = wire::head_page_count(&fixed).map_err(|e| e.to_string())?;
        let total = self.engine.stats().total_pages.load(Ordering::Relaxed);
        if count as usize > total {
            return Err(format!(
                "KV set of {count} pages cannot fit this worker's {total}-page pool"
            ));
        }
        let mut head = vec![0u8; wire::head_len(count)];
        head[..wire::HEAD_FIXED].copy_from_slice(&fixed);
        c.read_exact(&mut head[wire::HEAD_FIXED..])
            .await
            .map_err(|e| e.to_string())?;
        let (manifest, sent) = wire::parse_head(&mut head.as_slice()).map_err(|e| e.to_string())?;
        if sent > manifest.page_count {
            return Err("more pages than the manifest names".into());
        }
        let mut pages = Vec::with_capacity(sent as usize);
        let mut bytes = 0u64;
        for _ in 0..sent {
            let mut ph = [0u8; wire::PAGE_HEAD];
            c.read_exact(&mut ph).await.map_err(|e| e.to_string())?;
            let (index, pair_id, len) = wire::parse_page_head(&ph);
            if len > MAX_MESSAGE_BYTES {
                return Err(format!("a {len}-byte page is over the limit"));
            }
            let mut data = Vec::with_capacity(len);
            let got = (&mut *c)
                .take(len as u64)
                .read_to_end(&mut data)
                .await
                .map_err(|e| e.to_string())?;
            if got != len {
                return Err("connection closed inside a page".into());
            }
            bytes += len as u64;
            pages.push(PageData {
                index,
                pair_id,
                bytes: data.into(),
            });
        }
        Ok(Some((KvTransfer { manifest, pages }, bytes)))
    }

    /// Pushes a set to the decode worker at `endpoint` the way a prefill does (benchmarks).
    pub async fn push_set(&self, endpoint: &str, t: KvTransfer) -> Result<(), String> {
        let peer = self.peer(endpoint).map_err(|s| s.message().to_string())?;
        self.push(peer, endpoint, t).await
    }

    fn injected_fault(&self) -> Option<Fault> {
        self.faults
            .filter(|f| {
                self.pairs
                    .fetch_add(1, Ordering::Relaxed)
                    .is_multiple_of(f.every.max(1))
            })
            .map(|f| f.fault)
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::DecodeEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Worker for WorkerService {
    async fn prefill(
        &self,
        req: Request<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillResponse>, Status> {
        self.admit(&[Role::Prefill, Role::Unified], "prefill")?;
        let r = req.into_inner();
        if r.input_ids.is_empty() {
            return Err(Status::invalid_argument("empty prompt"));
        }
        let peer = self.peer(&r.decode_endpoint)?;
        let n = r.input_ids.len();
        let head: Arc<[u32]> = r.input_ids[..n - 1].into();
        let (tx, rx) = tokio::sync::oneshot::channel::<KvTransfer>();
        let report = self.engine.prefill(
            r.pair_id,
            head,
            r.cache_salt,
            Box::new(move |t| {
                let _ = tx.send(t);
            }),
        );
        let guard = AbortOnDrop {
            engine: &self.engine,
            id: r.pair_id,
            armed: true,
        };
        let kv = report
            .await
            .map_err(|_| Status::aborted("engine stopped"))?
            .map_err(engine_status)?;
        guard.disarm();
        let mut t = rx
            .await
            .map_err(|_| Status::internal("the engine reported a prefill but sent no KV"))?;
        let fault = self.injected_fault();
        if let Some(f) = fault {
            f.apply(&mut t, &self.swap_stash);
        }
        let pushed = tokio::time::timeout(self.lease, self.push(peer, &r.decode_endpoint, t))
            .await
            .unwrap_or_else(|_| Err("timed out (lease)".into()));
        if let Err(e) = pushed {
            return Err(Status::unavailable(format!(
                "KV push to {} failed: {e}",
                r.decode_endpoint
            )));
        }
        if fault == Some(Fault::RejectWithDecoy) {
            return Err(Status::invalid_argument(
                "prefill rejected the request (injected fault; its KV went on)",
            ));
        }
        Ok(Response::new(pb::PrefillResponse {
            prompt_tokens: n as u64,
            kv_tokens: kv.tokens,
            kv_digest: kv.digest,
            cached_tokens: kv.cached,
        }))
    }

    type DecodeStream = EventStream;

    async fn decode(
        &self,
        req: Request<pb::DecodeRequest>,
    ) -> Result<Response<EventStream>, Status> {
        self.admit(&[Role::Decode, Role::Unified], "decode")?;
        let r = req.into_inner();
        if r.input_ids.is_empty() {
            return Err(Status::invalid_argument("empty prompt"));
        }
        let kv = if r.expect_kv {
            let room = self.room(r.pair_id);
            let got = tokio::time::timeout(self.lease, room.take()).await;
            self.rooms.remove(&r.pair_id);
            match got {
                Ok(Some(t)) => Some(t),
                Ok(None) => return Err(Status::aborted("pair aborted before its KV arrived")),
                Err(_) => {
                    return Err(Status::deadline_exceeded(format!(
                        "no KV arrived for pair {} within the lease ({} ms)",
                        r.pair_id,
                        self.lease.as_millis()
                    )));
                }
            }
        } else {
            None
        };
        // Dropping the receiver (the caller went away) aborts the request in the engine.
        let rx = self.engine.generate(Generate {
            id: r.pair_id,
            prompt: r.input_ids.into(),
            sampling: sampling_from_pb(r.sampling),
            kv,
            cache_salt: r.cache_salt,
        });
        let events = tokio_stream::wrappers::UnboundedReceiverStream::new(rx);
        let out = events
            .map(|ev| {
                use pb::decode_event::Event as E;
                match ev {
                    Event::Started {
                        prompt_tokens,
                        kv_digest,
                    } => Ok(pb::DecodeEvent {
                        event: Some(E::Started(pb::DecodeStarted {
                            prompt_tokens,
                            kv_digest,
                        })),
                    }),
                    Event::Token { id, text, finish } => Ok(pb::DecodeEvent {
                        event: Some(E::Token(pb::DecodeToken {
                            id,
                            text,
                            finish: match finish {
                                None => 0,
                                Some(Finish::Stop) => 1,
                                Some(Finish::Length) => 2,
                            },
                        })),
                    }),
                    Event::Failed(e) => Err(engine_status(e)),
                }
            })
            .boxed();
        Ok(Response::new(out))
    }

    async fn abort(
        &self,
        req: Request<pb::WorkerAbortRequest>,
    ) -> Result<Response<pb::WorkerAbortResponse>, Status> {
        let id = req.into_inner().pair_id;
        if let Some((_, room)) = self.rooms.remove(&id) {
            room.close();
        }
        self.engine.abort(id);
        Ok(Response::new(pb::WorkerAbortResponse {}))
    }

    async fn push_kv(
        &self,
        req: Request<Streaming<pb::KvPush>>,
    ) -> Result<Response<pb::KvPushAck>, Status> {
        use pb::kv_push::Item;
        self.admit(&[Role::Decode, Role::Unified], "KV pushes")?;
        let mut s = req.into_inner();
        let manifest = match s.message().await? {
            Some(pb::KvPush {
                item: Some(Item::Manifest(m)),
            }) => manifest_from_pb(m)?,
            _ => {
                return Err(Status::invalid_argument(
                    "a KV push starts with its manifest",
                ));
            }
        };
        let total = self.engine.stats().total_pages.load(Ordering::Relaxed);
        if manifest.page_count as usize > total {
            return Err(Status::invalid_argument(format!(
                "KV set of {} pages cannot fit this worker's {total}-page pool",
                manifest.page_count
            )));
        }
        let mut pages = Vec::with_capacity(manifest.page_count as usize);
        let mut bytes = 0u64;
        while let Some(m) = s.message().await? {
            match m.item {
                Some(Item::Page(p)) if pages.len() < manifest.page_count as usize => {
                    bytes += p.data.len() as u64;
                    pages.push(PageData {
                        index: p.index,
                        pair_id: p.pair_id,
                        bytes: p.data,
                    });
                }
                Some(Item::Page(_)) => {
                    return Err(Status::invalid_argument(
                        "more pages than the manifest names",
                    ));
                }
                _ => return Err(Status::invalid_argument("a second manifest in one push")),
            }
        }
        // Verification happens on import, against the decode call's own expectation.
        let pair = manifest.pair_id;
        self.room(pair).put(KvTransfer { manifest, pages });
        Ok(Response::new(pb::KvPushAck { bytes }))
    }

    async fn capacity(
        &self,
        _req: Request<pb::CapacityRequest>,
    ) -> Result<Response<pb::CapacityResponse>, Status> {
        let s = self.engine.stats();
        let total = s.total_pages.load(Ordering::Relaxed) as u32;
        Ok(Response::new(pb::CapacityResponse {
            role: self.role.as_str().into(),
            total_pages: total,
            free_pages: s.free_pages.load(Ordering::Relaxed) as u32,
            page_size: self.page_size,
            running: s.running.load(Ordering::Relaxed) as u32,
            waiting: s.waiting.load(Ordering::Relaxed) as u32,
            pending_kv_sets: self.rooms.iter().filter(|r| r.is_ready()).count() as u32,
            model_fingerprint: self.fingerprint.0,
            kv_capacity_tokens: u64::from(total) * u64::from(self.page_size),
            kv_data_port: self.data_port.load(Ordering::Relaxed),
        }))
    }

    async fn health(
        &self,
        _req: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthResponse>, Status> {
        Ok(Response::new(pb::HealthResponse {
            serving: self.serving.load(Ordering::Acquire),
        }))
    }
}

/// Why a data push failed: `refused` when the receiver answered with a refusal (a retry would
/// get the same), otherwise a broken connection.
struct DataError {
    refused: bool,
    message: String,
}

/// Sends one set on a data connection and reads the receiver's answer; gives the connection back
/// for reuse.
async fn data_send(
    mut c: tokio::net::TcpStream,
    t: &KvTransfer,
) -> Result<tokio::net::TcpStream, DataError> {
    use lockstep_engine::transfer::wire;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let broken = |e: std::io::Error| DataError {
        refused: false,
        message: e.to_string(),
    };
    c.write_all(&wire::head(&t.manifest, t.pages.len() as u32))
        .await
        .map_err(broken)?;
    for p in &t.pages {
        c.write_all(&wire::page_head(p)).await.map_err(broken)?;
        c.write_all(&p.bytes).await.map_err(broken)?;
    }
    let mut status = [0u8; 1];
    c.read_exact(&mut status).await.map_err(broken)?;
    if status[0] == 0 {
        let mut bytes = [0u8; 8];
        c.read_exact(&mut bytes).await.map_err(broken)?;
        return Ok(c);
    }
    let mut len = [0u8; 4];
    c.read_exact(&mut len).await.map_err(broken)?;
    let mut msg = vec![0u8; (u32::from_le_bytes(len) as usize).min(4096)];
    c.read_exact(&mut msg).await.map_err(broken)?;
    Err(DataError {
        refused: true,
        message: String::from_utf8_lossy(&msg).into_owned(),
    })
}

/// Answers a refusal on a data connection: status 1, length, message.
async fn data_refuse(c: &mut tokio::net::TcpStream, message: &str) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt;
    let m = &message.as_bytes()[..message.len().min(4096)];
    let mut out = vec![1u8];
    out.extend_from_slice(&(m.len() as u32).to_le_bytes());
    out.extend_from_slice(m);
    c.write_all(&out).await
}

/// The worker's routes: the gRPC service and `GET /health` (for HTTP health checkers).
pub fn router(svc: Arc<WorkerService>) -> axum::Router {
    let health = svc.clone();
    let grpc = WorkerServer::from_arc(svc)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    tonic::service::Routes::new(grpc).into_axum_router().route(
        "/health",
        axum::routing::get(move || {
            let ok = health.serving.load(Ordering::Acquire);
            async move {
                if ok {
                    http::StatusCode::OK
                } else {
                    http::StatusCode::SERVICE_UNAVAILABLE
                }
            }
        }),
    )
}

/// A running worker.
#[derive(Debug)]
pub struct RunningWorker {
    /// The service.
    pub service: Arc<WorkerService>,
    /// Where it listens.
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    tasks: crate::app::ServerTasks,
}

impl RunningWorker {
    /// Loads the engine, binds the listener, serves, and sweeps expired rooms.
    pub async fn start(role: Role, file: WorkerFile) -> Result<RunningWorker, String> {
        let f = file.clone();
        let service = tokio::task::spawn_blocking(move || WorkerService::start(role, &f))
            .await
            .map_err(|e| format!("worker start panicked: {e}"))??;
        let service = Arc::new(service);
        let listener = tokio::net::TcpListener::bind(file.worker.listen)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", file.worker.listen))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let mut tasks = Vec::new();
        if role != Role::Prefill {
            let at = file
                .worker
                .kv_listen
                .unwrap_or_else(|| SocketAddr::new(addr.ip(), 0));
            let data = tokio::net::TcpListener::bind(at)
                .await
                .map_err(|e| format!("cannot listen on {at} (KV data): {e}"))?;
            let data_addr = data.local_addr().map_err(|e| e.to_string())?;
            service
                .data_port
                .store(u32::from(data_addr.port()), Ordering::Relaxed);
            let s = service.clone();
            tasks.push(tokio::spawn(async move {
                loop {
                    match data.accept().await {
                        Ok((c, _)) => {
                            let _ = c.set_nodelay(true);
                            tokio::spawn(s.clone().data_serve(c));
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "KV data accept failed");
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                }
            }));
            tracing::info!(%data_addr, "KV data listener");
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let serve = tokio::spawn(crate::app::serve_http(
            listener,
            router(service.clone()),
            Duration::from_secs(10),
            None,
            rx,
        ));
        let sweeper = {
            let s = service.clone();
            let every = (s.lease / 4).max(Duration::from_millis(50));
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                loop {
                    tick.tick().await;
                    let n = s.sweep();
                    if n > 0 {
                        tracing::warn!(
                            sets = n,
                            "dropped KV rooms whose lease ran out (peer lost mid-pair?)"
                        );
                    }
                }
            })
        };
        tracing::info!(%addr, role = role.as_str(), "lockstep worker listening (gRPC, h2c)");
        tasks.push(sweeper);
        tasks.push(serve);
        Ok(RunningWorker {
            service,
            addr,
            stop: Some(tx),
            tasks: crate::app::ServerTasks(tasks),
        })
    }

    /// Stops serving: health fails, then the listener closes and open calls finish (bounded).
    pub async fn shutdown(mut self) {
        self.service.set_serving(false);
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.tasks.finish().await;
    }
}

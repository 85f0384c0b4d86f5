//! How a prefill worker pushes a pair's KV to the decode worker the router chose: over the decode
//! worker's data listener (`kv_transport = "tcp"`, pooled connections) when it has one, else
//! through the `PushKv` client stream.
//!
//! Before its first push to an endpoint the pusher asks it for its `Capacity`: it must be a
//! decode (or unified) worker of the same model, so a `decode_endpoint` naming anything else
//! (another service, another model) gets nothing. The answer (and the data address in it) is
//! cached; a push that finds the cached address dead forgets the endpoint and asks again within
//! the same push, so a decode worker restarted in place (a new data port) is reached without
//! restarting the prefill workers.

use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use lockstep_engine::transfer::{KvTransfer, ModelFingerprint};
use lockstep_proto::MAX_MESSAGE_BYTES;
use lockstep_proto::v1 as pb;
use lockstep_proto::v1::worker_client::WorkerClient;
use lockstep_runtime::tls::PlaneTls;
use tokio::io::{AsyncRead, AsyncWrite};
use tonic::Status;
use tonic::transport::Channel;

use crate::config::KvTransport;
use crate::data;
use crate::kvmac::Tag;
use crate::pb::push_messages;

/// Why a push failed.
#[derive(Debug)]
pub struct PushError {
    /// The decode worker was over a bound (pending KV, rooms): nothing was kept, a retry may
    /// pass.
    pub busy: bool,
    /// What happened (for the router's log; never shown to API clients).
    pub message: String,
}

impl PushError {
    fn other(message: String) -> PushError {
        PushError {
            busy: false,
            message,
        }
    }

    /// As the status the prefill call answers with (the endpoint goes to this worker's log, not
    /// into the status, which may reach an API client's error message).
    pub fn status(&self, endpoint: &str) -> Status {
        tracing::warn!(endpoint, error = %self.message, busy = self.busy, "KV push failed");
        let m = format!("KV push to the decode worker failed: {}", self.message);
        if self.busy {
            Status::resource_exhausted(m)
        } else {
            Status::unavailable(m)
        }
    }
}

/// Peers (and their data addresses and idle connections) one worker remembers at most.
const MAX_PEERS: usize = 4_096;

/// A data connection: plain TCP, or the plane's mutual TLS.
trait DataIo: AsyncRead + AsyncWrite + Send + Sync + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Sync + Unpin> DataIo for T {}
type DataConn = Box<dyn DataIo>;

/// A decode worker's data listener: its service host (the name its certificate carries) and the
/// port its Capacity names.
type DataAddr = (String, u16);

/// Peer clients, decode workers' checked data addresses and pooled data connections.
pub struct KvPusher {
    transport: KvTransport,
    connect_timeout: Duration,
    model: ModelFingerprint,
    tls: Option<Arc<PlaneTls>>,
    peers: DashMap<String, WorkerClient<Channel>>,
    /// Decode workers checked (role, model) and their data addresses, by endpoint.
    data_addrs: DashMap<String, Option<DataAddr>>,
    /// Idle data connections, by address.
    data_conns: DashMap<DataAddr, Vec<DataConn>>,
}

impl std::fmt::Debug for KvPusher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPusher")
            .field("transport", &self.transport)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl KvPusher {
    /// A pusher for `model`'s KV using `transport`, bounding each connect by `connect_timeout`,
    /// over the plane's mutual TLS when `tls` is set.
    pub fn new(
        transport: KvTransport,
        connect_timeout: Duration,
        model: ModelFingerprint,
        tls: Option<Arc<PlaneTls>>,
    ) -> KvPusher {
        KvPusher {
            transport,
            connect_timeout,
            model,
            tls,
            peers: DashMap::new(),
            data_addrs: DashMap::new(),
            data_conns: DashMap::new(),
        }
    }

    /// A client of the worker at `url` (one channel per peer, reused).
    pub fn peer(&self, url: &str) -> Result<WorkerClient<Channel>, Status> {
        if let Some(c) = self.peers.get(url) {
            return Ok(c.clone());
        }
        let ch =
            lockstep_runtime::tls::worker_channel(url, self.connect_timeout, self.tls.as_ref())
                .map_err(|e| {
                    tracing::warn!(error = %e, "unusable decode endpoint");
                    Status::invalid_argument(
                        "the decode endpoint is not usable here (the worker's log says why)",
                    )
                })?;
        let c = WorkerClient::new(ch).max_encoding_message_size(MAX_MESSAGE_BYTES);
        // Bounded: endpoints come from callers; past the bound, start the cache over.
        if self.peers.len() >= MAX_PEERS {
            self.peers.clear();
            self.data_addrs.clear();
            self.data_conns.clear();
        }
        self.peers.insert(url.to_string(), c.clone());
        Ok(c)
    }

    /// Pushes a set and its MAC to the decode worker at `endpoint`: over its data listener when
    /// it has one and this worker uses `tcp`, else through `PushKv`. A broken connection on the
    /// first try forgets what was cached about the endpoint and tries once more (the receiver
    /// keeps nothing of a set it did not get whole).
    pub async fn push(&self, endpoint: &str, t: &KvTransfer, tag: &Tag) -> Result<(), PushError> {
        let mut last = PushError::other("no attempt".into());
        for _ in 0..2 {
            let mut peer = self
                .peer(endpoint)
                .map_err(|s| PushError::other(s.message().to_string()))?;
            let addr = match self.data_addr(&mut peer, endpoint).await {
                Ok(a) => a,
                Err(Attempt::Final(e)) => return Err(e),
                Err(Attempt::Retry(e)) => {
                    self.forget(endpoint, None);
                    last = e;
                    continue;
                }
            };
            let sent = match &addr {
                Some(addr) if self.transport == KvTransport::Tcp => {
                    self.push_tcp(addr, t, tag).await
                }
                _ => Self::push_grpc(peer, t, tag).await,
            };
            match sent {
                Ok(()) => return Ok(()),
                Err(Attempt::Final(e)) => return Err(e),
                Err(Attempt::Retry(e)) => {
                    self.forget(endpoint, addr);
                    last = e;
                }
            }
        }
        Err(last)
    }

    /// Forgets every peer's channel, data address and idle data connection (the plane's files
    /// were reloaded: connections are opened again under the new ones).
    pub(crate) fn forget_all(&self) {
        self.peers.clear();
        self.data_addrs.clear();
        self.data_conns.clear();
    }

    /// Forgets the endpoint's channel, checked data address and idle data connections.
    fn forget(&self, endpoint: &str, addr: Option<DataAddr>) {
        self.peers.remove(endpoint);
        self.data_addrs.remove(endpoint);
        if let Some(a) = addr {
            self.data_conns.remove(&a);
        }
    }

    /// The decode worker's data address (its gRPC host, the port its Capacity names; `None`:
    /// it has no data listener), after checking it is a decode worker of this model; cached.
    async fn data_addr(
        &self,
        peer: &mut WorkerClient<Channel>,
        endpoint: &str,
    ) -> Result<Option<DataAddr>, Attempt> {
        if let Some(a) = self.data_addrs.get(endpoint) {
            return Ok(a.clone());
        }
        let mut req = tonic::Request::new(pb::CapacityRequest {});
        req.set_timeout(self.connect_timeout);
        let c = peer
            .capacity(req)
            .await
            .map_err(|s| Attempt::Retry(PushError::other(format!("capacity: {}", s.message()))))?
            .into_inner();
        if !matches!(c.role.as_str(), "decode" | "unified") || c.model_fingerprint != self.model.0 {
            return Err(Attempt::Final(PushError::other(format!(
                "not a decode worker of this model (role `{}`, model {:#x}, ours {:#x})",
                c.role, c.model_fingerprint, self.model.0
            ))));
        }
        let addr = if c.kv_data_port == 0 {
            None
        } else {
            let uri: http::Uri = endpoint
                .parse()
                .map_err(|e| Attempt::Final(PushError::other(format!("bad endpoint: {e}"))))?;
            let host = uri
                .host()
                .unwrap_or_default()
                .trim_start_matches('[')
                .trim_end_matches(']');
            Some((host.to_string(), c.kv_data_port as u16))
        };
        self.data_addrs.insert(endpoint.to_string(), addr.clone());
        Ok(addr)
    }

    async fn push_grpc(
        mut peer: WorkerClient<Channel>,
        t: &KvTransfer,
        tag: &Tag,
    ) -> Result<(), Attempt> {
        match peer
            .push_kv(tokio_stream::iter(push_messages(t.clone(), tag)))
            .await
        {
            Ok(_) => Ok(()),
            Err(s) => {
                let e = PushError {
                    busy: s.code() == tonic::Code::ResourceExhausted,
                    message: format!("{}: {}", s.code(), s.message()),
                };
                Err(if s.code() == tonic::Code::Unavailable {
                    Attempt::Retry(e)
                } else {
                    Attempt::Final(e)
                })
            }
        }
    }

    /// One set over a pooled data connection (a fresh one when none is idle).
    async fn push_tcp(&self, addr: &DataAddr, t: &KvTransfer, tag: &Tag) -> Result<(), Attempt> {
        let pooled = self.data_conns.get_mut(addr).and_then(|mut v| v.pop());
        let conn = match pooled {
            Some(c) => c,
            None => self.data_connect(addr).await.map_err(Attempt::Retry)?,
        };
        match data::send(conn, t, tag).await {
            Ok(c) => {
                self.data_conns.entry(addr.clone()).or_default().push(c);
                Ok(())
            }
            Err(e) => {
                let (refused, busy) = (e.refused, e.busy);
                let e = PushError {
                    busy,
                    message: e.message,
                };
                Err(if refused {
                    Attempt::Final(e)
                } else {
                    Attempt::Retry(e)
                })
            }
        }
    }

    async fn data_connect(&self, (host, port): &DataAddr) -> Result<DataConn, PushError> {
        let connect = async {
            Ok::<DataConn, std::io::Error>(match &self.tls {
                Some(tls) => Box::new(tls.connect(host, *port).await?),
                None => {
                    let c = tokio::net::TcpStream::connect((host.as_str(), *port)).await?;
                    c.set_nodelay(true)?;
                    Box::new(c)
                }
            })
        };
        tokio::time::timeout(self.connect_timeout, connect)
            .await
            .map_err(|_| {
                tracing::warn!(%host, port, "connecting to a KV data listener timed out");
                PushError::other("connecting to its data listener timed out".into())
            })?
            .map_err(|e| {
                tracing::warn!(%host, port, error = %e, "cannot connect to a KV data listener");
                PushError::other(format!("cannot connect to its data listener: {e}"))
            })
    }
}

/// A failed attempt: worth one more try with fresh addresses, or final.
enum Attempt {
    Retry(PushError),
    Final(PushError),
}

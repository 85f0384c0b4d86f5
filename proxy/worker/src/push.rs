//! How a prefill worker pushes a pair's KV to the decode worker the router chose: over the decode
//! worker's data listener (`kv_transport = "tcp"`, pooled connections) when it has one, else
//! through the `PushKv` client stream.

use std::net::SocketAddr;
use std::time::Duration;

use dashmap::DashMap;
use lockstep_engine::transfer::KvTransfer;
use lockstep_proto::MAX_MESSAGE_BYTES;
use lockstep_proto::v1 as pb;
use lockstep_proto::v1::worker_client::WorkerClient;
use tonic::Status;
use tonic::transport::Channel;

use crate::config::KvTransport;
use crate::data;
use crate::pb::push_messages;

/// Peer clients, decode workers' data addresses and pooled data connections.
#[derive(Debug)]
pub struct KvPusher {
    transport: KvTransport,
    connect_timeout: Duration,
    peers: DashMap<String, WorkerClient<Channel>>,
    /// Decode workers' data addresses (from their Capacity), by endpoint.
    data_addrs: DashMap<String, Option<SocketAddr>>,
    /// Idle data connections, by address.
    data_conns: DashMap<SocketAddr, Vec<tokio::net::TcpStream>>,
}

impl KvPusher {
    /// A pusher using `transport`, bounding each connect by `connect_timeout`.
    pub fn new(transport: KvTransport, connect_timeout: Duration) -> KvPusher {
        KvPusher {
            transport,
            connect_timeout,
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
        let ch = lockstep_proto::worker_channel(url, self.connect_timeout)
            .map_err(Status::invalid_argument)?;
        let c = WorkerClient::new(ch).max_encoding_message_size(MAX_MESSAGE_BYTES);
        self.peers.insert(url.to_string(), c.clone());
        Ok(c)
    }

    /// Pushes a set to a decode worker: over its data listener when it has one and this worker
    /// uses `tcp`, else through `PushKv`.
    pub async fn push(
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
        match data::send(conn, t).await {
            Ok(c) => {
                self.data_conns.entry(addr).or_default().push(c);
                Ok(())
            }
            Err(e) if !fresh && !e.refused => {
                let c = data::send(self.data_connect(addr).await?, t)
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
}

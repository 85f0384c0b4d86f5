//! The one HTTP client toward upstream workers: pooled keep-alive hyper, `http://` or `https://`
//! (rustls; trusted roots: the webpki set plus `server.upstream_ca_file`).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::rustls::pki_types::pem::PemObject;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::ReqBody;

type Connector = hyper_rustls::HttpsConnector<HttpConnector>;

type Http = Client<Connector, ReqBody>;

/// The bulk lane's pool ([`super::bulk`]).
type Bulk = Client<super::bulk::OnLane<Connector>, ReqBody>;

/// A cheap-to-clone pooled HTTP/1.1 client. On a connection thread
/// ([`lockstep_runtime::threads`]) it uses a pool of that thread's own, so a request is sent,
/// and its answer read, by the thread that serves it; elsewhere the shared pool.
#[derive(Clone, Debug)]
pub struct UpstreamClient {
    /// Behind one `Arc`: every pair clones the client for each half, and one count is cheaper
    /// than the hyper client's, the connector's and the TLS configuration's.
    s: Arc<Shared>,
}

/// What the clones of one client share.
#[derive(Debug)]
struct Shared {
    inner: Http,
    /// Requests with long bodies ([`super::bulk::BULK_BODY_BYTES`]).
    bulk: Bulk,
    connector: Connector,
    /// Names this client's pools in each connection thread's table; alive while a clone is.
    id: Arc<()>,
    connect_timeout: Duration,
    /// Mutual TLS to lockstep workers (`[worker_plane.tls]`), read at start and every reload.
    plane: Option<std::sync::Arc<lockstep_runtime::tls::PlaneTls>>,
}

/// An answer's status and whole body (bounded); `what` names the call in an error.
async fn collect(
    resp: Response<Incoming>,
    what: impl std::fmt::Display,
) -> Result<(u16, Bytes), CallError> {
    let status = resp.status().as_u16();
    let body = collect_bounded(resp.into_body())
        .await
        .map_err(|e| CallError::Transport(format!("{what}: {e}")))?;
    Ok((status, body))
}

impl CallError {
    /// The failure of `side` this call error is.
    pub(crate) fn of(self, side: super::Side) -> super::HalfError {
        let failure = match self {
            CallError::Connect(m) => super::HalfFailure::Connect(m),
            CallError::Transport(m) => super::HalfFailure::Transport(m),
        };
        super::HalfError { side, failure }
    }
}

/// Why an upstream call failed.
#[derive(Debug, Clone)]
pub enum CallError {
    /// Connecting failed: nothing was sent.
    Connect(String),
    /// The request was (maybe) sent but the exchange failed.
    Transport(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Connect(m) => write!(f, "cannot connect: {m}"),
            CallError::Transport(m) => f.write_str(m),
        }
    }
}

impl UpstreamClient {
    /// A client whose connects are bounded by `connect_timeout`, trusting the webpki roots and
    /// the CA certificates of `ca` (a PEM file, for a private PKI).
    pub fn with_ca(connect_timeout: Duration, ca: Option<&Path>) -> Result<UpstreamClient, String> {
        let mut roots = rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        if let Some(ca) = ca {
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(ca)
                .and_then(|it| it.collect())
                .map_err(|e| format!("server.upstream_ca_file {}: {e}", ca.display()))?;
            if certs.is_empty() {
                return Err(format!(
                    "server.upstream_ca_file {}: no certificate in it",
                    ca.display()
                ));
            }
            for c in certs {
                roots
                    .add(c)
                    .map_err(|e| format!("server.upstream_ca_file {}: {e}", ca.display()))?;
            }
        }
        Ok(Self::build(connect_timeout, roots))
    }

    fn build(connect_timeout: Duration, roots: rustls::RootCertStore) -> UpstreamClient {
        let mut conn = HttpConnector::new();
        conn.set_connect_timeout(Some(connect_timeout));
        conn.set_nodelay(true);
        conn.enforce_http(false);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map(|b| b.with_root_certificates(roots).with_no_client_auth());
        let tls = match tls {
            Ok(t) => t,
            // The ring provider supports the default versions; this cannot fail in practice.
            Err(e) => unreachable_tls(e),
        };
        let conn = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(conn);
        UpstreamClient {
            s: Arc::new(Shared {
                inner: pooled(conn.clone()),
                bulk: pool_settings(Client::builder(super::bulk::Executor))
                    .build(super::bulk::OnLane(conn.clone())),
                connector: conn,
                id: Arc::new(()),
                connect_timeout,
                plane: None,
            }),
        }
    }

    /// Sends `req` on this thread's pool: its own on a connection thread (made on first use),
    /// else the shared one; a long body on the bulk lane.
    fn request(&self, req: Request<ReqBody>) -> hyper_util::client::legacy::ResponseFuture {
        if req.body().len() >= super::bulk::BULK_BODY_BYTES && super::bulk::available() {
            return self.s.bulk.request(req);
        }
        if lockstep_runtime::threads::current().is_none() {
            return self.s.inner.request(req);
        }
        THREAD_POOLS.with_borrow_mut(|pools| {
            let me = Arc::as_ptr(&self.s.id);
            if let Some((_, http)) = pools.iter().find(|(id, _)| id.as_ptr() == me) {
                return http.request(req);
            }
            // A new client here: forget the pools of clients gone since (a reload's).
            pools.retain(|(id, _)| id.strong_count() > 0);
            let http = pooled(self.s.connector.clone());
            let fut = http.request(req);
            pools.push((Arc::downgrade(&self.s.id), http));
            fut
        })
    }

    /// The bound on connecting to a worker.
    pub fn connect_timeout(&self) -> Duration {
        self.s.connect_timeout
    }

    /// This client with the worker plane's TLS read from `cfg` (none where it has none).
    pub fn with_plane(
        &self,
        cfg: &lockstep_core::config::WorkerPlaneConfig,
    ) -> Result<UpstreamClient, String> {
        let plane = match &cfg.tls {
            Some(f) => Some(
                lockstep_runtime::tls::PlaneTls::load(f)
                    .map_err(|e| format!("worker_plane.{e}"))?,
            ),
            None => None,
        };
        Ok(UpstreamClient {
            s: Arc::new(Shared {
                inner: self.s.inner.clone(),
                bulk: self.s.bulk.clone(),
                connector: self.s.connector.clone(),
                id: self.s.id.clone(),
                connect_timeout: self.s.connect_timeout,
                plane,
            }),
        })
    }

    /// The worker plane's TLS, where configured.
    pub fn plane(&self) -> Option<&std::sync::Arc<lockstep_runtime::tls::PlaneTls>> {
        self.s.plane.as_ref()
    }

    /// Sends a request and returns the response head (the body streams).
    pub async fn send(
        &self,
        method: Method,
        url: &str,
        body: impl Into<ReqBody>,
    ) -> Result<Response<Incoming>, CallError> {
        self.send_with(method, url, body, &[]).await
    }

    /// [`UpstreamClient::send`] with extra headers (the trace context of the pair's half).
    pub async fn send_with(
        &self,
        method: Method,
        url: &str,
        body: impl Into<ReqBody>,
        extra: &[(http::HeaderName, http::HeaderValue)],
    ) -> Result<Response<Incoming>, CallError> {
        let uri = url
            .parse::<http::Uri>()
            .map_err(|e| CallError::Connect(format!("bad request for {url}: {e}")))?;
        let target = lockstep_routing::pool::Endpoint { uri, host: None };
        self.send_to(method, &target, body, extra).await
    }

    /// [`UpstreamClient::send_with`] to a worker's [`lockstep_routing::pool::Endpoint`]: no URL parsed,
    /// and its `Host` header shared, not formatted.
    pub async fn send_to(
        &self,
        method: Method,
        target: &lockstep_routing::pool::Endpoint,
        body: impl Into<ReqBody>,
        extra: &[(http::HeaderName, http::HeaderValue)],
    ) -> Result<Response<Incoming>, CallError> {
        let mut req = Request::new(body.into());
        *req.method_mut() = method;
        *req.uri_mut() = target.uri.clone();
        let headers = req.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        if let Some(host) = &target.host {
            headers.insert(http::header::HOST, host.clone());
        }
        for (k, v) in extra {
            headers.append(k.clone(), v.clone());
        }
        self.request(req).await.map_err(|e| {
            let msg = format!("{}: {}", target.uri, error_chain(&e));
            if e.is_connect() {
                CallError::Connect(msg)
            } else {
                CallError::Transport(msg)
            }
        })
    }

    /// POSTs JSON and collects the whole answer (status, body).
    pub async fn post_collect(
        &self,
        url: &str,
        body: impl Into<ReqBody>,
    ) -> Result<(u16, Bytes), CallError> {
        self.post_collect_with(url, body, &[]).await
    }

    /// [`UpstreamClient::post_collect`] with extra headers.
    pub async fn post_collect_with(
        &self,
        url: &str,
        body: impl Into<ReqBody>,
        extra: &[(http::HeaderName, http::HeaderValue)],
    ) -> Result<(u16, Bytes), CallError> {
        let resp = self.send_with(Method::POST, url, body, extra).await?;
        collect(resp, url).await
    }

    /// [`UpstreamClient::post_collect_with`] to a worker's [`lockstep_routing::pool::Endpoint`].
    pub async fn post_collect_to(
        &self,
        target: &lockstep_routing::pool::Endpoint,
        body: impl Into<ReqBody>,
        extra: &[(http::HeaderName, http::HeaderValue)],
    ) -> Result<(u16, Bytes), CallError> {
        let resp = self.send_to(Method::POST, target, body, extra).await?;
        collect(resp, &target.uri).await
    }

    /// GETs a URL and collects the answer.
    pub async fn get_collect(&self, url: &str) -> Result<(u16, Bytes), CallError> {
        self.get_collect_with(url, &[]).await
    }

    /// [`UpstreamClient::get_collect`] with extra headers.
    pub async fn get_collect_with(
        &self,
        url: &str,
        extra: &[(http::HeaderName, http::HeaderValue)],
    ) -> Result<(u16, Bytes), CallError> {
        let resp = self
            .send_with(Method::GET, url, Bytes::new(), extra)
            .await?;
        collect(resp, url).await
    }

    /// `GET url` read whole (bounded), with the answer's `Content-Type`: a worker's own page
    /// passed on as it is (`lockstep sidecar`'s `/server_info`, `/metrics`).
    pub async fn get_page(
        &self,
        url: &str,
        extra: &[(http::HeaderName, http::HeaderValue)],
    ) -> Result<(u16, Option<http::HeaderValue>, Bytes), CallError> {
        let resp = self
            .send_with(Method::GET, url, Bytes::new(), extra)
            .await?;
        let status = resp.status().as_u16();
        let kind = resp.headers().get(http::header::CONTENT_TYPE).cloned();
        let body = collect_bounded(resp.into_body())
            .await
            .map_err(|e| CallError::Transport(format!("{url}: {e}")))?;
        Ok((status, kind, body))
    }

    /// `GET {base}/health` answered 2xx within `timeout`.
    pub async fn health(&self, base: &str, timeout: Duration) -> bool {
        matches!(
            tokio::time::timeout(timeout, self.get_collect(&format!("{base}/health"))).await,
            Ok(Ok((s, _))) if (200..300).contains(&s)
        )
    }
}

thread_local! {
    /// A connection thread's upstream pools, one per live client.
    static THREAD_POOLS: std::cell::RefCell<Vec<(std::sync::Weak<()>, Http)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// A keep-alive pool over `conn`.
fn pooled(conn: Connector) -> Http {
    pool_settings(Client::builder(TokioExecutor::new())).build(conn)
}

/// Every pool's keep-alive settings.
fn pool_settings(
    mut b: hyper_util::client::legacy::Builder,
) -> hyper_util::client::legacy::Builder {
    b.pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(1024);
    b
}

#[cold]
fn unreachable_tls(e: rustls::Error) -> ! {
    panic!("rustls rejected its own default protocol versions: {e}")
}

/// The largest upstream answer lockstep reads whole (JSON answers, error bodies, probes); streams
/// are read event by event, each event bounded on its own (`sse.rs`).
pub(crate) const MAX_UPSTREAM_BODY: usize = 16 << 20;

/// Collects an upstream body of at most [`MAX_UPSTREAM_BODY`] bytes; a larger one is an error
/// (never buffered past the bound).
pub(crate) async fn collect_bounded<B>(body: B) -> Result<Bytes, String>
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    http_body_util::Limited::new(body, MAX_UPSTREAM_BODY)
        .collect()
        .await
        .map(|c| c.to_bytes())
        .map_err(|e| {
            format!(
                "answer unreadable or over {} MiB: {e}",
                MAX_UPSTREAM_BODY >> 20
            )
        })
}

/// An error and its sources, on one line.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn upstream_bodies_are_read_only_up_to_the_bound() {
        let small = http_body_util::Full::new(Bytes::from(vec![b'x'; 1024]));
        assert_eq!(collect_bounded(small).await.expect("small").len(), 1024);
        let huge = http_body_util::Full::new(Bytes::from(vec![b'x'; MAX_UPSTREAM_BODY + 1]));
        let e = collect_bounded(huge).await.expect_err("over the bound");
        assert!(e.contains("16 MiB"), "{e}");
    }

    /// An upstream that answers every request with the client port of the connection it came
    /// on, so a test can tell which requests shared a connection.
    async fn port_echo() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let app = axum::Router::new().route(
            "/port",
            axum::routing::get(
                |axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<
                    std::net::SocketAddr,
                >| async move { peer.port().to_string() },
            )
            // A POST answers with the port and the body's length.
            .post(
                |axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<
                    std::net::SocketAddr,
                >,
                 body: Bytes| async move { format!("{} {}", peer.port(), body.len()) },
            ),
        );
        tokio::spawn(async move {
            let svc = app.into_make_service_with_connect_info::<std::net::SocketAddr>();
            let _ = axum::serve(listener, svc).await;
        });
        format!("http://{addr}/port")
    }

    #[tokio::test]
    async fn each_connection_thread_sends_over_its_own_upstream_connections() {
        let url = port_echo().await;
        let client = UpstreamClient::with_ca(Duration::from_secs(2), None).expect("client");
        let threads =
            lockstep_runtime::threads::ConnThreads::start(2, "client-test").expect("threads");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut holds = Vec::new();
        // Held open so the two land on different threads.
        for _ in 0..2 {
            let (c, url, tx) = (client.clone(), url.clone(), tx.clone());
            let (hold, held) = tokio::sync::oneshot::channel::<()>();
            holds.push(hold);
            threads.spawn(async move {
                let mut ports = Vec::new();
                for _ in 0..3 {
                    let (status, body) = c.get_collect(&url).await.expect("answer");
                    assert_eq!(status, 200);
                    ports.push(String::from_utf8(body.to_vec()).expect("utf-8"));
                }
                let _ = tx.send((lockstep_runtime::threads::current(), ports));
                let _ = held.await;
            });
        }
        let a = rx.recv().await.expect("thread a");
        let b = rx.recv().await.expect("thread b");
        assert_ne!(a.0, b.0, "two threads");
        // Sequential calls on one thread reuse its one connection...
        for (_, ports) in [&a, &b] {
            assert!(ports.iter().all(|p| p == &ports[0]), "{ports:?}");
        }
        // ...which is not the other thread's, nor the shared pool's.
        assert_ne!(a.1[0], b.1[0]);
        let (_, shared) = client.get_collect(&url).await.expect("answer");
        let shared = String::from_utf8(shared.to_vec()).expect("utf-8");
        assert!(shared != a.1[0] && shared != b.1[0], "{shared} {a:?} {b:?}");
        drop(holds);
    }

    /// Long bodies go over the bulk lane's own connections (kept alive, whole), short ones over
    /// the thread's.
    #[tokio::test]
    async fn long_bodies_take_the_bulk_lane() {
        let url = port_echo().await;
        let client = UpstreamClient::with_ca(Duration::from_secs(2), None).expect("client");
        let threads =
            lockstep_runtime::threads::ConnThreads::start(1, "client-bulk").expect("threads");
        let (tx, rx) = tokio::sync::oneshot::channel();
        threads.spawn(async move {
            let mut answers = Vec::new();
            for len in [10, super::super::bulk::BULK_BODY_BYTES, 300 << 10, 10] {
                let body = Bytes::from(vec![b'7'; len]);
                let (status, a) = client.post_collect(&url, body).await.expect("answer");
                assert_eq!(status, 200);
                answers.push(String::from_utf8(a.to_vec()).expect("utf-8"));
            }
            let _ = tx.send(answers);
        });
        let answers = rx.await.expect("ran");
        let split: Vec<(&str, usize)> = answers
            .iter()
            .map(|a| {
                let (port, len) = a.split_once(' ').expect("port and length");
                (port, len.parse().expect("length"))
            })
            .collect();
        let lens: Vec<usize> = split.iter().map(|s| s.1).collect();
        assert_eq!(
            lens,
            [10, super::super::bulk::BULK_BODY_BYTES, 300 << 10, 10]
        );
        assert_eq!(
            split[0].0, split[3].0,
            "short bodies: the thread's connection"
        );
        assert_eq!(
            split[1].0, split[2].0,
            "long bodies: the lane's, kept alive"
        );
        assert_ne!(split[0].0, split[1].0, "{answers:?}");
    }

    #[tokio::test]
    async fn a_connection_thread_forgets_the_pools_of_dropped_clients() {
        let url = port_echo().await;
        let threads =
            lockstep_runtime::threads::ConnThreads::start(1, "client-drop").expect("threads");
        let (tx, rx) = tokio::sync::oneshot::channel();
        threads.spawn(async move {
            for _ in 0..3 {
                let client = UpstreamClient::with_ca(Duration::from_secs(2), None).expect("client");
                client.get_collect(&url).await.expect("answer");
            }
            let _ = tx.send(THREAD_POOLS.with_borrow(Vec::len));
        });
        // Each new client dropped the entries of the ones gone before it.
        assert_eq!(rx.await.expect("ran"), 1);
    }
}

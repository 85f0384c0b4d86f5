//! The accept loop of every lockstep listener (the router's API and admin listeners, a worker's
//! service): HTTP/1.1 and h2c on one port, or HTTPS with HTTP/1.1 and h2 by ALPN; graceful
//! shutdown; slow-header, slow-handshake and idle-connection bounds.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::activity::{Activity, Tracked};
use crate::threads::{ConnThreads, OnRuntime};

/// How long an idle connection asked to close may take to do so before it is dropped.
pub const IDLE_CLOSE_GRACE: Duration = Duration::from_secs(5);

/// The bounds one listener puts on its connections.
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    /// A client that has not completed its TLS handshake and HTTP/1.1 request headers within
    /// this is disconnected (slow-header attacks).
    pub header_timeout: Duration,
    /// Connections open at once (0: no limit); past it, new ones wait in the kernel's accept
    /// queue until one closes.
    pub max_connections: usize,
    /// A connection with no request in flight (a response body still streaming counts as in
    /// flight) for this long is closed gracefully: an h2 GOAWAY, or the end of an HTTP/1.1
    /// keep-alive connection. Bounds idle connections, which hold slots of `max_connections`.
    pub idle_timeout: Duration,
    /// HTTP/2 streams one connection may have open at once (`None`: hyper's default, 200).
    pub max_concurrent_streams: Option<u32>,
}

/// Serves `app` on `listener` (HTTP/1.1 and h2c on one port, or HTTPS with HTTP/1.1 and h2 when
/// `tls` is set) within `limits` until `stop` fires, then lets open connections finish
/// (bounded: 10 s). Small SSE frames are not held back by Nagle. With `threads`, each connection
/// (its TLS handshake too) lives on one of them and HTTP/2 streams run on the runtime this is
/// called on; without, everything runs on that runtime.
pub async fn serve_http(
    listener: TcpListener,
    app: axum::Router,
    limits: ConnLimits,
    tls: Option<crate::tls::ServerTls>,
    threads: Option<Arc<ConnThreads>>,
    stop: tokio::sync::oneshot::Receiver<()>,
) {
    use hyper_util::rt::TokioTimer;
    let mut builder = Builder::new(OnRuntime(tokio::runtime::Handle::current()));
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    // h2 (gRPC, KV pushes of many MiB): windows and frames sized for bulk streams, so a
    // sender is never stalled waiting for window updates on a fast link.
    // Keepalive pings find h2 peers that vanished without a FIN (a dead router, a cut link): no
    // answer within the timeout closes the connection and everything on it.
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs(20)))
        .keep_alive_timeout(Duration::from_secs(20))
        .initial_stream_window_size(8 << 20)
        .initial_connection_window_size(16 << 20)
        .max_frame_size(1 << 20)
        .max_concurrent_streams(limits.max_concurrent_streams);
    let builder = Arc::new(builder);
    // Every connection task holds a receiver: `true` asks it to close gracefully, and the
    // sender's `closed()` is when the last one has ended.
    let (closing_tx, closing_rx) = tokio::sync::watch::channel(false);
    let slots = (limits.max_connections > 0)
        .then(|| Arc::new(tokio::sync::Semaphore::new(limits.max_connections)));
    // A connection slot first, then the connection: the slot goes with it and frees when it ends.
    let accept = || async {
        let slot = match &slots {
            Some(s) => s.clone().acquire_owned().await.ok(),
            None => None,
        };
        (slot, listener.accept().await)
    };
    tokio::pin!(stop);
    loop {
        tokio::select! {
            (slot, accepted) = accept() => {
                let stream = match accepted {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let conn = Conn {
                    builder: builder.clone(),
                    app: app.clone(),
                    // The current configuration: a plane certificate reloaded since start
                    // applies to new connections.
                    tls: tls.as_ref().map(|t| tokio_rustls::TlsAcceptor::from(t.current())),
                    ca_changes: tls.as_ref().and_then(crate::tls::ServerTls::ca_changes),
                    closing: closing_rx.clone(),
                    slot,
                    limits,
                };
                match &threads {
                    None => drop(tokio::spawn(conn.run(stream))),
                    // Moved to the chosen thread's event loop: deregistered here, registered
                    // there.
                    Some(threads) => match stream.into_std() {
                        Ok(std) => threads.spawn(async move {
                            match tokio::net::TcpStream::from_std(std) {
                                Ok(s) => conn.run(s).await,
                                Err(e) => tracing::warn!(error = %e, "cannot move a connection to its thread"),
                            }
                        }),
                        Err(e) => tracing::warn!(error = %e, "cannot move a connection to its thread"),
                    },
                }
            }
            _ = &mut stop => break,
        }
    }
    drop(listener);
    drop(closing_rx);
    let _ = closing_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(10), closing_tx.closed()).await;
}

type Builder = hyper_util::server::conn::auto::Builder<OnRuntime>;

/// One accepted connection and what serving it needs.
struct Conn {
    builder: Arc<Builder>,
    app: axum::Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
    closing: tokio::sync::watch::Receiver<bool>,
    /// Its slot of `max_connections`, freed when it ends.
    slot: Option<tokio::sync::OwnedSemaphorePermit>,
    limits: ConnLimits,
    /// The worker plane's CA changes: a connection accepted under the old CA is closed.
    ca_changes: Option<tokio::sync::watch::Receiver<u64>>,
}

impl Conn {
    /// The TLS handshake (bounded by the header timeout) where configured, then the connection.
    async fn run(self, stream: tokio::net::TcpStream) {
        match self.tls.clone() {
            None => self.serve(stream).await,
            Some(acceptor) => {
                match tokio::time::timeout(self.limits.header_timeout, acceptor.accept(stream))
                    .await
                {
                    Ok(Ok(t)) => self.serve(t).await,
                    Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!("TLS handshake timed out"),
                }
            }
        }
    }

    /// Served until it ends, asked to close gracefully when the listener stops or the
    /// connection has been idle for `idle_timeout`.
    async fn serve<I>(self, io: I)
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let Conn {
            builder,
            app,
            mut closing,
            slot,
            limits,
            mut ca_changes,
            ..
        } = self;
        let ca_changed = async move {
            match ca_changes.as_mut() {
                Some(rx) => {
                    let _ = rx.changed().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::pin!(ca_changed);
        let activity = Arc::new(Activity::new());
        let svc =
            hyper_util::service::TowerToHyperService::new(Tracked::new(app, activity.clone()));
        let conn = builder
            .serve_connection_with_upgrades(hyper_util::rt::TokioIo::new(io), svc)
            .into_owned();
        tokio::pin!(conn);
        let mut asked = false;
        // Set when an idle connection is asked to close: h2's graceful close waits for the
        // client's PING answer, which a silent client never sends.
        let mut hard_stop: Option<tokio::time::Instant> = None;
        loop {
            let forced = async {
                match hard_stop {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = conn.as_mut() => break,
                _ = closing.wait_for(|c| *c), if !asked => {
                    conn.as_mut().graceful_shutdown();
                    asked = true;
                }
                _ = activity.idle_for(limits.idle_timeout), if !asked => {
                    tracing::debug!("closing an idle connection");
                    conn.as_mut().graceful_shutdown();
                    asked = true;
                    hard_stop = Some(tokio::time::Instant::now() + IDLE_CLOSE_GRACE);
                }
                _ = &mut ca_changed, if !asked => {
                    tracing::info!("closing a worker plane connection accepted under the old CA");
                    conn.as_mut().graceful_shutdown();
                    asked = true;
                    hard_stop = Some(tokio::time::Instant::now() + IDLE_CLOSE_GRACE);
                }
                _ = forced => {
                    tracing::debug!("dropping a connection that did not close");
                    break;
                }
            }
        }
        drop(slot);
        drop(closing);
    }
}

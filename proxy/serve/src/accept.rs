//! The accept loop of every lockstep listener (the router's API and admin listeners, a worker's
//! service): HTTP/1.1 and h2c on one port, or HTTPS with HTTP/1.1 and h2 by ALPN; graceful
//! shutdown; slow-header, slow-handshake and idle-connection bounds.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::activity::{Activity, Tracked};

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
}

/// Serves `app` on `listener` (HTTP/1.1 and h2c on one port, or HTTPS with HTTP/1.1 and h2 when
/// `tls` is set) within `limits` until `stop` fires, then lets open connections finish
/// (bounded: 10 s). Small SSE frames are not held back by Nagle.
pub async fn serve_http(
    listener: TcpListener,
    app: axum::Router,
    limits: ConnLimits,
    tls: Option<crate::tls::ServerTls>,
    stop: tokio::sync::oneshot::Receiver<()>,
) {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
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
        .max_frame_size(1 << 20);
    // Every connection task holds a receiver: `true` asks it to close gracefully, and the
    // sender's `closed()` is when the last one has ended.
    let (closing_tx, closing_rx) = tokio::sync::watch::channel(false);
    // TLS handshakes run in their own tasks and hand the stream back here.
    let (tls_tx, mut tls_rx) = tokio::sync::mpsc::channel::<(
        tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
        Option<tokio::sync::OwnedSemaphorePermit>,
    )>(64);
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
    // One connection's task: served until it ends, asked to close gracefully when the listener
    // stops or the connection has been idle for `idle_timeout`.
    macro_rules! spawn_conn {
        ($io:expr, $slot:expr) => {{
            let activity = Arc::new(Activity::new());
            let svc = hyper_util::service::TowerToHyperService::new(Tracked::new(
                app.clone(),
                activity.clone(),
            ));
            let conn = builder
                .serve_connection_with_upgrades(TokioIo::new($io), svc)
                .into_owned();
            let mut closing = closing_rx.clone();
            let slot = $slot;
            let idle = limits.idle_timeout;
            tokio::spawn(async move {
                tokio::pin!(conn);
                let mut asked = false;
                // Set when an idle connection is asked to close: h2's graceful close waits for
                // the client's PING answer, which a silent client never sends.
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
                        _ = activity.idle_for(idle), if !asked => {
                            tracing::debug!("closing an idle connection");
                            conn.as_mut().graceful_shutdown();
                            asked = true;
                            hard_stop = Some(tokio::time::Instant::now() + IDLE_CLOSE_GRACE);
                        }
                        _ = forced => {
                            tracing::debug!("dropping an idle connection that did not close");
                            break;
                        }
                    }
                }
                drop(slot);
                drop(closing);
            });
        }};
    }
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
                match &tls {
                    None => spawn_conn!(stream, slot),
                    Some(tls) => {
                        // The current configuration: a plane certificate reloaded since start
                        // applies to new connections.
                        let acceptor = tokio_rustls::TlsAcceptor::from(tls.current());
                        let tx = tls_tx.clone();
                        let header_timeout = limits.header_timeout;
                        tokio::spawn(async move {
                            match tokio::time::timeout(header_timeout, acceptor.accept(stream)).await {
                                Ok(Ok(t)) => {
                                    let _ = tx.send((t, slot)).await;
                                }
                                Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                                Err(_) => tracing::debug!("TLS handshake timed out"),
                            }
                        });
                    }
                }
            }
            Some((tls, slot)) = tls_rx.recv() => spawn_conn!(tls, slot),
            _ = &mut stop => break,
        }
    }
    drop(listener);
    drop(closing_rx);
    let _ = closing_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(10), closing_tx.closed()).await;
}

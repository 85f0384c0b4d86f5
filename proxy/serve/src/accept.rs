//! The accept loop of every lockstep listener (the router's API and admin listeners, a worker's
//! service): HTTP/1.1 and h2c on one port, or HTTPS with HTTP/1.1 and h2 by ALPN; graceful
//! shutdown; slow-header and slow-handshake bounds.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

/// Serves `app` on `listener` (HTTP/1.1 and h2c on one port, or HTTPS with HTTP/1.1 and h2 when
/// `tls` is set) until `stop` fires, then lets open connections finish (bounded: 10 s). A client
/// that has not completed its TLS handshake and request headers within `header_timeout` is
/// disconnected (slow-header attacks), and small SSE frames are not held back by Nagle. At most
/// `max_connections` connections are open at once (0: no limit); past it, new ones wait in the
/// kernel's accept queue until one closes.
pub async fn serve_http(
    listener: TcpListener,
    app: axum::Router,
    header_timeout: Duration,
    max_connections: usize,
    tls: Option<crate::tls::ServerTls>,
    stop: tokio::sync::oneshot::Receiver<()>,
) {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
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
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    // TLS handshakes run in their own tasks and hand the stream back here, so every connection is
    // watched by the one graceful-shutdown owner.
    let (tls_tx, mut tls_rx) = tokio::sync::mpsc::channel::<(
        tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
        Option<tokio::sync::OwnedSemaphorePermit>,
    )>(64);
    let slots =
        (max_connections > 0).then(|| Arc::new(tokio::sync::Semaphore::new(max_connections)));
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
                match &tls {
                    None => {
                        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
                        let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc);
                        let conn = graceful.watch(conn.into_owned());
                        tokio::spawn(async move {
                            let _ = conn.await;
                            drop(slot);
                        });
                    }
                    Some(tls) => {
                        // The current configuration: a plane certificate reloaded since start
                        // applies to new connections.
                        let acceptor = tokio_rustls::TlsAcceptor::from(tls.current());
                        let tx = tls_tx.clone();
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
            Some((tls, slot)) = tls_rx.recv() => {
                let svc = hyper_util::service::TowerToHyperService::new(app.clone());
                let conn = builder.serve_connection_with_upgrades(TokioIo::new(tls), svc);
                let conn = graceful.watch(conn.into_owned());
                tokio::spawn(async move {
                    let _ = conn.await;
                    drop(slot);
                });
            }
            _ = &mut stop => break,
        }
    }
    drop(listener);
    let _ = tokio::time::timeout(Duration::from_secs(10), graceful.shutdown()).await;
}

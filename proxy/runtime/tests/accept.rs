//! The accept loop's connection bounds, on a real listener over loopback: idle connections
//! (HTTP/1.1 keep-alive, h2c without streams, a client that never sends) are closed after the
//! idle timeout, and a response body still streaming keeps its connection open. Every case runs
//! three times: connections on the calling runtime, on connection threads, and on connection
//! threads that busy-poll before they sleep.

use std::time::{Duration, Instant};

use axum::body::Body;
use std::sync::Arc;

use lockstep_runtime::accept::{ConnLimits, serve_http};
use lockstep_runtime::threads::ConnThreads;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const IDLE: Duration = Duration::from_millis(400);

/// Where a test server's connections run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Shared,
    Threads,
    Polling,
}

/// Three tests of one case: on the calling runtime, on connection threads, and on connection
/// threads that busy-poll.
macro_rules! both {
    ($shared:ident) => {
        mod $shared {
            #[tokio::test]
            async fn shared() {
                super::$shared(super::Mode::Shared).await
            }
            #[tokio::test]
            async fn on_connection_threads() {
                super::$shared(super::Mode::Threads).await
            }
            #[tokio::test]
            async fn on_polling_connection_threads() {
                super::$shared(super::Mode::Polling).await
            }
        }
    };
}

/// A server whose `/slow` streams 6 chunks 150 ms apart (900 ms: longer than the idle timeout)
/// and whose `/where` says whether it ran on a connection thread; on two connection threads
/// (polling for 200 µs before they sleep in `Mode::Polling`) unless `Mode::Shared`.
async fn server(
    mode: Mode,
) -> (
    String,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let app = axum::Router::new()
        .route("/fast", axum::routing::get(|| async { "ok" }))
        .route(
            "/where",
            axum::routing::get(|| async {
                match lockstep_runtime::threads::current() {
                    Some(_) => "connection-thread",
                    None => "shared",
                }
            }),
        )
        .route(
            "/slow",
            axum::routing::get(|| async {
                let chunks = futures_util::stream::unfold(0u32, |i| async move {
                    if i == 6 {
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    Some((
                        Ok::<_, std::convert::Infallible>(format!("chunk{i};")),
                        i + 1,
                    ))
                });
                Body::from_stream(chunks)
            }),
        );
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let limits = ConnLimits {
        header_timeout: Duration::from_secs(30),
        max_connections: 16,
        idle_timeout: IDLE,
        max_concurrent_streams: None,
    };
    let threads = match mode {
        Mode::Shared => None,
        Mode::Threads => Some(ConnThreads::start(2, "accept-test").expect("threads")),
        Mode::Polling => {
            let (t, polling) =
                ConnThreads::start_polling(2, "accept-poll", Some(Duration::from_micros(200)))
                    .expect("threads");
            // Tests of this binary build runtimes at once, so a thread may not find its own
            // event loop to poll; the case must hold either way.
            assert!(polling <= 2);
            Some(t)
        }
    }
    .map(Arc::new);
    let task = tokio::spawn(serve_http(listener, app, limits, None, threads, rx));
    (addr, tx, task)
}

/// Reads until the server closes the connection (bounded: 5 s); everything read and when the
/// close came.
async fn read_to_close(c: &mut TcpStream) -> (Vec<u8>, Instant) {
    let mut all = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, c.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (all, Instant::now()),
            Ok(Ok(n)) => all.extend_from_slice(&buf[..n]),
            Err(_) => panic!(
                "connection still open after 5 s; read {:?}",
                String::from_utf8_lossy(&all)
            ),
        }
    }
}

both!(a_connection_that_never_sends_is_closed_after_the_idle_timeout);
async fn a_connection_that_never_sends_is_closed_after_the_idle_timeout(mode: Mode) {
    let (addr, stop, task) = server(mode).await;
    let t0 = Instant::now();
    let mut c = TcpStream::connect(&addr).await.expect("connect");
    let (got, closed) = read_to_close(&mut c).await;
    assert!(got.is_empty());
    let after = closed - t0;
    assert!(
        after >= IDLE - Duration::from_millis(50),
        "closed after {after:?}"
    );
    assert!(after < IDLE * 4, "closed after {after:?}");
    let _ = stop.send(());
    task.await.expect("server stopped");
}

both!(an_idle_http1_keep_alive_connection_is_closed);
async fn an_idle_http1_keep_alive_connection_is_closed(mode: Mode) {
    let (addr, stop, task) = server(mode).await;
    let mut c = TcpStream::connect(&addr).await.expect("connect");
    c.write_all(b"GET /fast HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .expect("write");
    let answered = Instant::now();
    let (got, closed) = read_to_close(&mut c).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.ends_with("ok"), "{text}");
    let after = closed - answered;
    assert!(
        after >= IDLE - Duration::from_millis(50),
        "closed after {after:?}"
    );
    let _ = stop.send(());
    task.await.expect("server stopped");
}

both!(a_response_still_streaming_keeps_its_connection);
async fn a_response_still_streaming_keeps_its_connection(mode: Mode) {
    let (addr, stop, task) = server(mode).await;
    let mut c = TcpStream::connect(&addr).await.expect("connect");
    let t0 = Instant::now();
    c.write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .expect("write");
    let (got, closed) = read_to_close(&mut c).await;
    let text = String::from_utf8_lossy(&got);
    for i in 0..6 {
        assert!(
            text.contains(&format!("chunk{i};")),
            "chunk {i} missing: {text}"
        );
    }
    // The body took 900 ms, more than twice the idle timeout; the close came an idle timeout
    // after it ended.
    assert!(closed - t0 >= Duration::from_millis(900) + IDLE - Duration::from_millis(50));
    let _ = stop.send(());
    task.await.expect("server stopped");
}

/// One h2 frame: (type, flags, payload); None at the end of the connection.
async fn frame(c: &mut TcpStream) -> Option<(u8, u8, Vec<u8>)> {
    let mut head = [0u8; 9];
    c.read_exact(&mut head).await.ok()?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let mut payload = vec![0u8; len];
    c.read_exact(&mut payload).await.ok()?;
    Some((head[3], head[4], payload))
}

/// An h2c client that sends its preface and settings, then opens no stream; it answers PINGs
/// when `answer_pings`. The frame types the server sent, and how long after the preface the
/// connection closed.
async fn h2c_without_streams(addr: &str, answer_pings: bool) -> (Vec<u8>, Duration) {
    let mut c = TcpStream::connect(addr).await.expect("connect");
    c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .expect("write");
    c.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0])
        .await
        .expect("write");
    let t0 = Instant::now();
    let mut kinds = Vec::new();
    let read = async {
        while let Some((kind, flags, payload)) = frame(&mut c).await {
            kinds.push(kind);
            // PING without ACK: answer it as a live client does.
            if kind == 6 && flags & 1 == 0 && answer_pings {
                let mut ack = vec![0, 0, 8, 6, 1, 0, 0, 0, 0];
                ack.extend_from_slice(&payload);
                if c.write_all(&ack).await.is_err() {
                    break;
                }
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("closed within 10 s");
    (kinds, t0.elapsed())
}

both!(an_h2c_connection_without_streams_gets_goaway_and_is_closed);
async fn an_h2c_connection_without_streams_gets_goaway_and_is_closed(mode: Mode) {
    let (addr, stop, task) = server(mode).await;
    let (kinds, after) = h2c_without_streams(&addr, true).await;
    assert!(
        after >= IDLE - Duration::from_millis(50),
        "closed after {after:?}"
    );
    assert!(after < IDLE * 4, "closed after {after:?}");
    assert!(kinds.contains(&7), "a GOAWAY among the frames: {kinds:?}");
    let _ = stop.send(());
    task.await.expect("server stopped");
}

both!(an_idle_h2c_client_that_ignores_goaway_is_dropped_after_the_grace);
async fn an_idle_h2c_client_that_ignores_goaway_is_dropped_after_the_grace(mode: Mode) {
    let (addr, stop, task) = server(mode).await;
    let (kinds, after) = h2c_without_streams(&addr, false).await;
    assert!(kinds.contains(&7), "a GOAWAY among the frames: {kinds:?}");
    let grace = lockstep_runtime::accept::IDLE_CLOSE_GRACE;
    assert!(
        after >= IDLE + grace - Duration::from_millis(100),
        "closed after {after:?}"
    );
    assert!(
        after < IDLE + grace + Duration::from_secs(2),
        "closed after {after:?}"
    );
    let _ = stop.send(());
    task.await.expect("server stopped");
}

both!(stopping_the_listener_ends_a_keep_alive_connection_at_once);
async fn stopping_the_listener_ends_a_keep_alive_connection_at_once(mode: Mode) {
    let (addr, stop, task) = server(mode).await;
    let mut c = TcpStream::connect(&addr).await.expect("connect");
    c.write_all(b"GET /fast HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .expect("write");
    let mut buf = [0u8; 256];
    let n = c.read(&mut buf).await.expect("answer");
    assert!(n > 0);
    let t0 = Instant::now();
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("server stopped in time")
        .expect("server task");
    let (_, closed) = read_to_close(&mut c).await;
    assert!(
        closed - t0 < IDLE,
        "closed by the stop, not the idle timeout"
    );
}

both!(requests_run_where_their_connection_lives_and_h2_streams_on_the_shared_runtime);
async fn requests_run_where_their_connection_lives_and_h2_streams_on_the_shared_runtime(
    mode: Mode,
) {
    let (addr, stop, task) = server(mode).await;
    let get = |http2: bool| {
        let addr = addr.clone();
        async move {
            use http_body_util::BodyExt;
            let client =
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                    .http2_only(http2)
                    .build_http::<http_body_util::Empty<bytes::Bytes>>();
            let uri: http::Uri = format!("http://{addr}/where").parse().expect("uri");
            let resp = client.get(uri).await.expect("answer");
            let body = resp.into_body().collect().await.expect("body").to_bytes();
            String::from_utf8(body.to_vec()).expect("utf-8")
        }
    };
    let h1 = get(false).await;
    let h2 = get(true).await;
    assert_eq!(
        h1,
        if mode != Mode::Shared {
            "connection-thread"
        } else {
            "shared"
        }
    );
    // One h2 connection multiplexes many calls: they are not pinned to its thread.
    assert_eq!(h2, "shared");
    let _ = stop.send(());
    task.await.expect("server stopped");
}

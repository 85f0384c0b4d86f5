//! The gRPC listener's bounds (second security review, finding 1), in front of the SGLang PD
//! mock: a request body that stalls is ended at `server.body_timeout_ms` (DEADLINE_EXCEEDED), one
//! over `server.max_body_bytes` is refused as it arrives (INVALID_ARGUMENT, `body_too_large`),
//! neither reaching a worker; health `Watch` streams are bounded in number
//! (`server.grpc_max_long_streams`, UNAVAILABLE past it) and in lifetime
//! (`server.grpc_stream_lifetime_ms`, ended with UNAVAILABLE), and a slot frees when one ends;
//! one connection holds at most `server.max_concurrent_streams` streams.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use lockstep_tests::harness::{Stack, TEST_TIMEOUTS};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

type Frames = tokio::sync::mpsc::Sender<Result<hyper::body::Frame<Bytes>, std::io::Error>>;
type Body = http_body_util::StreamBody<
    tokio_stream::wrappers::ReceiverStream<Result<hyper::body::Frame<Bytes>, std::io::Error>>,
>;

async fn h2c(addr: &str) -> hyper::client::conn::http2::SendRequest<Body> {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (h2, conn) = hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
        .handshake::<_, Body>(hyper_util::rt::TokioIo::new(tcp))
        .await
        .expect("h2c handshake");
    tokio::spawn(conn);
    h2
}

/// A `Generate` call whose body starts with `first` and stays open: its frame sender and its
/// answer's gRPC status (from the headers of a trailers-only answer, else the trailers).
async fn open_call(
    h2: &mut hyper::client::conn::http2::SendRequest<Body>,
    addr: &str,
    first: Vec<u8>,
) -> (Frames, tokio::task::JoinHandle<String>) {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(Ok(hyper::body::Frame::data(Bytes::from(first))))
        .await
        .expect("queued");
    let req = http::Request::post(format!("http://{addr}/lockstep.v1.Lockstep/Generate"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(http_body_util::StreamBody::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
        .expect("request");
    h2.ready().await.expect("ready");
    let answer = h2.send_request(req);
    let status = tokio::spawn(async move {
        let resp = answer.await.expect("response");
        if let Some(s) = resp.headers().get("grpc-status") {
            return s.to_str().expect("ascii").to_string();
        }
        let body = resp.into_body().collect().await.expect("body");
        body.trailers()
            .and_then(|t| t.get("grpc-status"))
            .map(|s| s.to_str().expect("ascii").to_string())
            .expect("a status")
    });
    (tx, status)
}

fn frame_head(len: u32) -> Vec<u8> {
    let mut h = vec![0u8];
    h.extend_from_slice(&len.to_be_bytes());
    h
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_bodies_and_long_streams_are_bounded() {
    let stack = Stack::start_full(
        Default::default(),
        "body_timeout_ms = 400\ngrpc_max_long_streams = 2\ngrpc_stream_lifetime_ms = 800",
        "",
        TEST_TIMEOUTS,
    )
    .await;
    let addr = stack.url.trim_start_matches("http://").to_string();
    let mut h2 = h2c(&addr).await;

    // A stalled body: 10 bytes of a declared 1,000, then nothing.
    let t0 = Instant::now();
    let mut first = frame_head(1000);
    first.extend_from_slice(&[0u8; 10]);
    let (stalled, status) = open_call(&mut h2, &addr, first).await;
    let status = tokio::time::timeout(Duration::from_secs(5), status)
        .await
        .expect("answered, though the body never ended")
        .expect("join");
    assert_eq!(status, "4", "DEADLINE_EXCEEDED");
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(380) && took < Duration::from_secs(3),
        "{took:?}"
    );
    drop(stalled);

    // Over the body bound (64 KiB here): refused as the bytes arrive, the stream still open.
    let mut big = frame_head(1 << 20);
    big.extend(std::iter::repeat_n(b'x', 70_000));
    let t0 = Instant::now();
    let (open, status) = open_call(&mut h2, &addr, big).await;
    let status = tokio::time::timeout(Duration::from_secs(5), status)
        .await
        .expect("answered")
        .expect("join");
    assert_eq!(status, "3", "INVALID_ARGUMENT (body_too_large)");
    assert!(
        t0.elapsed() < Duration::from_millis(380),
        "before the body timeout"
    );
    drop(open);
    assert_eq!(stack.mock.request_count(), 0, "no worker was called");

    // Health watches: two at once; a third is refused while both live.
    let channel = tonic::transport::Endpoint::from_shared(stack.url.clone())
        .expect("endpoint")
        .connect()
        .await
        .expect("h2c connect");
    let mut health = HealthClient::new(channel);
    let req = || HealthCheckRequest {
        service: String::new(),
    };
    let t0 = Instant::now();
    let mut a = health.watch(req()).await.expect("watch 1").into_inner();
    let mut b = health.watch(req()).await.expect("watch 2").into_inner();
    assert!(a.message().await.expect("event").is_some());
    assert!(b.message().await.expect("event").is_some());
    let third = health.watch(req()).await.expect_err("a third watch");
    assert_eq!(third.code(), tonic::Code::Unavailable, "{third:?}");
    assert!(
        third.message().contains("grpc_max_long_streams"),
        "{third:?}"
    );
    // Each is ended at its lifetime, with UNAVAILABLE (clients re-open it).
    let end = tokio::time::timeout(Duration::from_secs(5), a.message())
        .await
        .expect("ended by the server");
    let e = end.expect_err("ended with a status");
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(
        t0.elapsed() >= Duration::from_millis(780),
        "{:?}",
        t0.elapsed()
    );
    let _ = tokio::time::timeout(Duration::from_secs(5), b.message()).await;
    drop((a, b));
    // Their slots are free again.
    let mut c = health.watch(req()).await.expect("a new watch").into_inner();
    assert!(c.message().await.expect("event").is_some());
    // Unary health checks are not bounded by the slots.
    assert!(health.check(req()).await.is_ok());
    drop(c);
}

/// `server.max_concurrent_streams` bounds one connection: with two streams stalled, a third
/// call on the same connection is answered only once they have ended (at the body timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_holds_at_most_max_concurrent_streams() {
    let stack = Stack::start_full(
        Default::default(),
        "body_timeout_ms = 400\nmax_concurrent_streams = 2",
        "",
        TEST_TIMEOUTS,
    )
    .await;
    let addr = stack.url.trim_start_matches("http://").to_string();
    let mut h2 = h2c(&addr).await;
    // Let the server's SETTINGS arrive before the streams open.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut stalled = Vec::new();
    for _ in 0..2 {
        let mut first = frame_head(1000);
        first.extend_from_slice(&[0u8; 10]);
        stalled.push(open_call(&mut h2, &addr, first).await);
    }
    let t0 = Instant::now();
    // A complete call: an empty `GenerateRequest` (no prompt: INVALID_ARGUMENT).
    let (done, status) = open_call(&mut h2, &addr, frame_head(0)).await;
    drop(done);
    let status = tokio::time::timeout(Duration::from_secs(5), status)
        .await
        .expect("answered")
        .expect("join");
    assert_eq!(status, "3");
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "the third stream waited for a slot: {:?}",
        t0.elapsed()
    );
    // Each stalled one ended at the body timeout (its sender still open).
    for (tx, s) in stalled {
        let st = s.await.expect("join");
        drop(tx);
        assert_eq!(st, "4");
    }
}

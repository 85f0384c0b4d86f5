//! The gRPC listener against an anonymous attacker, on the release binary as deployed (second
//! security review, finding 1): with tenants configured, streams without a key are refused on
//! their headers, before a byte of their bodies is read, and their bodies never reach the
//! server's memory; the number of streams per connection is bounded.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;

mod common;
use common::{sglang_worker, spawn};

fn config(dir: &Path, prefill: &str, decode: &str) -> PathBuf {
    let tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/mock-tokenizer.json");
    let text = format!(
        r#"[server]
http_listen = "127.0.0.1:0"
log_level = "info"

[[tenants]]
name = "acme"
api_keys_sha256 = ["{key}"]

[[models]]
name = "m"
backend = "sglang"
context_window = 1000
kv_capacity_tokens = 4096
tokenizer = "{tok}"
chat_template = {{ inline = "{{{{ messages }}}}" }}
[models.prefill]
workers = [{{ url = "{prefill}", bootstrap_port = 8998 }}]
[models.decode]
workers = [{{ url = "{decode}" }}]
"#,
        key = lockstep_tenancy::tenant::key_hash_hex("acme-key"),
        tok = tok.display()
    );
    let path = dir.join("lockstep.toml");
    std::fs::write(&path, text).expect("write config");
    path
}

/// The resident memory of process `pid`, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("VmRSS");
    kb * 1024
}

type Body = http_body_util::StreamBody<
    tokio_stream::wrappers::ReceiverStream<Result<hyper::body::Frame<Bytes>, std::io::Error>>,
>;

/// Opens a `Generate` stream with no key whose body declares a 4 MiB message and sends its
/// first 64 KiB, then nothing: the sender of the rest, and the answer's future.
async fn anonymous_stream(
    h2: &mut hyper::client::conn::http2::SendRequest<Body>,
    authority: &str,
) -> (
    tokio::sync::mpsc::Sender<Result<hyper::body::Frame<Bytes>, std::io::Error>>,
    impl std::future::Future<Output = hyper::Result<http::Response<hyper::body::Incoming>>>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut head = vec![0u8];
    head.extend_from_slice(&(4u32 << 20).to_be_bytes());
    head.extend(std::iter::repeat_n(b'x', 64 << 10));
    tx.send(Ok(hyper::body::Frame::data(Bytes::from(head))))
        .await
        .expect("queued");
    let req = http::Request::post(format!("http://{authority}/lockstep.v1.Lockstep/Generate"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(http_body_util::StreamBody::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
        .expect("request");
    h2.ready().await.expect("ready");
    (tx, h2.send_request(req))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anonymous_grpc_streams_are_refused_before_their_bodies_are_read() {
    let (p, hp) = sglang_worker(100_000, "prefill").await;
    let (d, hd) = sglang_worker(100_000, "decode").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = config(dir.path(), &p, &d);
    let mut proc = spawn(
        &["serve", "--config", path.to_str().expect("utf8")],
        "lockstep listening",
    )
    .await;
    let pid = proc.child.id().expect("pid");
    let addr = proc.addr.clone();
    let tcp = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let (mut h2, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .initial_stream_window_size(8 << 20)
            .initial_connection_window_size(64 << 20)
            .handshake::<_, Body>(hyper_util::rt::TokioIo::new(tcp))
            .await
            .expect("h2c handshake");
    let conn = tokio::spawn(conn);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = rss(pid);
    // 64 streams (the listener's bound per connection), each answered on its headers while
    // its body is still open: UNAUTHENTICATED, trailers-only.
    let mut senders = Vec::new();
    for i in 0..64 {
        let (tx, answer) = anonymous_stream(&mut h2, &addr).await;
        let resp = tokio::time::timeout(Duration::from_secs(5), answer)
            .await
            .unwrap_or_else(|_| panic!("stream {i} answered before its body ended"))
            .expect("response");
        assert_eq!(resp.status(), 200);
        assert_eq!(
            resp.headers().get("grpc-status").map(|v| v.as_bytes()),
            Some(&b"16"[..]),
            "stream {i}: UNAUTHENTICATED on the headers: {:?}",
            resp.headers()
        );
        let _ = resp.into_body().collect().await;
        senders.push(tx);
    }
    // The rest of each declared message is offered (3 MiB a stream, 192 MiB in all): none of it
    // may be kept. A refused stream's body is dropped, so most sends fail; each try is bounded.
    let chunk = Bytes::from(vec![b'y'; 1 << 20]);
    for tx in &senders {
        for _ in 0..3 {
            let sent = tokio::time::timeout(
                Duration::from_millis(200),
                tx.send(Ok(hyper::body::Frame::data(chunk.clone()))),
            )
            .await;
            if !matches!(sent, Ok(Ok(()))) {
                break;
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = rss(pid);
    let grown = after.saturating_sub(before);
    assert!(
        grown < 32 << 20,
        "the server's memory grew by {} MiB for 64 refused streams",
        grown >> 20
    );
    // With the key, a call gets past the guard (to the model: here an unknown one, NOT_FOUND).
    drop(senders);
    let mut msg = vec![0u8];
    let body = lockstep_proto::v1::GenerateRequest {
        model: "nope".into(),
        ..Default::default()
    };
    let encoded = prost::Message::encode_to_vec(&body);
    msg.extend_from_slice(&(encoded.len() as u32).to_be_bytes());
    msg.extend_from_slice(&encoded);
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(Ok(hyper::body::Frame::data(Bytes::from(msg))))
        .await
        .expect("queued");
    drop(tx);
    let req = http::Request::post(format!("http://{addr}/lockstep.v1.Lockstep/Generate"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", "Bearer acme-key")
        .body(http_body_util::StreamBody::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
        .expect("request");
    h2.ready().await.expect("ready");
    let resp = tokio::time::timeout(Duration::from_secs(5), h2.send_request(req))
        .await
        .expect("answered")
        .expect("response");
    let status = match resp.headers().get("grpc-status") {
        Some(v) => v.as_bytes().to_vec(),
        None => {
            let collected = resp.into_body().collect().await.expect("body");
            collected
                .trailers()
                .and_then(|t| t.get("grpc-status"))
                .map(|v| v.as_bytes().to_vec())
                .expect("a status")
        }
    };
    assert!(
        matches!(status.as_slice(), b"5" | b"7"),
        "past the guard (NOT_FOUND or PERMISSION_DENIED for the model), not {:?}",
        String::from_utf8_lossy(&status)
    );
    conn.abort();
    std::process::Command::new("kill")
        .arg(pid.to_string())
        .status()
        .expect("kill");
    let _ = tokio::time::timeout(Duration::from_secs(10), proc.child.wait()).await;
    hp.abort();
    hd.abort();
}

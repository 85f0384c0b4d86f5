//! HTTPS on lockstep's listeners (`server.tls_cert_file` / `tls_key_file`): a client trusting the
//! certificate gets answers on both the API and the admin listener, over HTTP/1.1 and h2 (ALPN);
//! a plain-HTTP client on the TLS port gets no HTTP answer.

use std::sync::Arc;
use std::time::Duration;

use lockstep_tenancy::tenant::key_hash_hex;
use lockstep_tests::client;
use lockstep_tests::client::Endpoint;
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS};
use lockstep_tests::sglang_mock::MockConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::ServerName;

/// A TLS connection to `addr` offering `alpn`.
async fn connect_tls(
    roots: &rustls::RootCertStore,
    addr: std::net::SocketAddr,
    alpn: &[&[u8]],
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots.clone())
        .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from("localhost").expect("name"), tcp)
        .await
        .expect("TLS handshake")
}

/// One h2 request over TLS (ALPN `h2` only): (status, HTTP version, body).
async fn h2_over_tls(
    roots: &rustls::RootCertStore,
    addr: std::net::SocketAddr,
    path: &str,
    body: String,
) -> (u16, http::Version, String) {
    let tls = connect_tls(roots, addr, &[b"h2"]).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tls),
    )
    .await
    .expect("h2 handshake");
    tokio::spawn(conn);
    let req = http::Request::post(format!("https://localhost{path}"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .expect("request");
    let resp = tokio::time::timeout(Duration::from_secs(10), send.send_request(req))
        .await
        .expect("answered in time")
        .expect("h2 answer");
    let (status, version) = (resp.status().as_u16(), resp.version());
    let bytes = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .expect("body")
        .to_bytes();
    (
        status,
        version,
        String::from_utf8_lossy(&bytes).into_owned(),
    )
}

/// One HTTP/1.1 exchange over TLS; returns (negotiated ALPN, the whole answer).
async fn https(
    roots: &rustls::RootCertStore,
    addr: std::net::SocketAddr,
    request: &str,
    alpn: &[&[u8]],
) -> (Option<Vec<u8>>, String) {
    let mut tls = connect_tls(roots, addr, alpn).await;
    let proto = tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
    if request.is_empty() {
        return (proto, String::new());
    }
    tls.write_all(request.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut out)).await;
    (proto, String::from_utf8_lossy(&out).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_listeners_speak_https() {
    let dir = tempfile::tempdir().expect("tempdir");
    let key = rcgen::KeyPair::generate().expect("key");
    let params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).expect("params");
    let cert = params.self_signed(&key).expect("cert");
    let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_path, cert.pem()).expect("write");
    std::fs::write(&key_path, key.serialize_pem()).expect("write");
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.der().clone()).expect("root");

    let server = format!(
        "tls_cert_file = \"{}\"\ntls_key_file = \"{}\"\nadmin_listen = \"127.0.0.1:0\"\nadmin_key_sha256 = \"{}\"",
        cert_path.display(),
        key_path.display(),
        key_hash_hex("admin-key")
    );
    let stack = Stack::start_full(MockConfig::default(), &server, "", TEST_TIMEOUTS).await;
    let addr = stack.lockstep.http_addr;

    // A completion over HTTPS (HTTP/1.1).
    let (path, body) = client::request(Endpoint::Completions, MODEL, "red green", false, 2, &[]);
    let body = body.to_string();
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let (proto, answer) = https(&roots, addr, &req, &[b"http/1.1"]).await;
    assert_eq!(proto.as_deref(), Some(&b"http/1.1"[..]));
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"choices\""), "{answer}");
    // h2 is chosen by ALPN when offered, and answers over h2.
    let (proto, _) = https(&roots, addr, "", &[b"h2", b"http/1.1"]).await;
    assert_eq!(proto.as_deref(), Some(&b"h2"[..]));
    let (status, version, answer) = h2_over_tls(&roots, addr, path, body.clone()).await;
    assert_eq!((status, version), (200, http::Version::HTTP_2), "{answer}");
    assert!(answer.contains("\"choices\""), "{answer}");
    // The admin listener is HTTPS too.
    let admin = stack.lockstep.admin_addr.expect("admin");
    let (_, answer) = https(
        &roots,
        admin,
        "GET /admin/workers HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer admin-key\r\nconnection: close\r\n\r\n",
        &[b"http/1.1"],
    )
    .await;
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.contains("workers"),
        "{answer}"
    );
    // Plain HTTP on the TLS port: no HTTP answer.
    let mut tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    tcp.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut out)).await;
    // The server closes the connection (in time) and what it sent, if anything, is no HTTP:
    // a TLS alert record (type 21) at most.
    assert!(read.is_ok(), "the connection was left open");
    assert!(
        out.is_empty() || out[0] == 21,
        "plain HTTP got: {:?}",
        String::from_utf8_lossy(&out)
    );
    assert!(!out.starts_with(b"HTTP/"), "plain HTTP was served");
}

//! HTTPS on lockstep's listeners (`server.tls_cert_file` / `tls_key_file`): a client trusting the
//! certificate gets answers on both the API and the admin listener, over HTTP/1.1 and h2 (ALPN);
//! a plain-HTTP client on the TLS port gets no HTTP answer.

use std::sync::Arc;
use std::time::Duration;

use lockstep_router::tenant::key_hash_hex;
use lockstep_tests::client;
use lockstep_tests::client::Endpoint;
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS};
use lockstep_tests::sglang_mock::MockConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::ServerName;

/// One HTTP/1.1 exchange over TLS; returns (negotiated ALPN, the whole answer).
async fn https(
    roots: &rustls::RootCertStore,
    addr: std::net::SocketAddr,
    request: &str,
    alpn: &[&[u8]],
) -> (Option<Vec<u8>>, String) {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots.clone())
        .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from("localhost").expect("name"), tcp)
        .await
        .expect("TLS handshake");
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
    // h2 is offered by ALPN.
    let (proto, _) = https(&roots, addr, "", &[b"h2", b"http/1.1"]).await;
    assert_eq!(proto.as_deref(), Some(&b"h2"[..]));
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
    let _ = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut out)).await;
    assert!(
        !String::from_utf8_lossy(&out).contains("HTTP/1.1 200"),
        "plain HTTP was served"
    );
}

//! `lockstep epp` on its own wire: a gRPC client speaking Envoy's ext_proc v3 the way Envoy does
//! in `FULL_DUPLEX_STREAMED` mode, so each bound can be held to a deadline: a caller without a
//! key (or over its tenant's limits) is refused on its headers, before any of its body is read;
//! a body that does not end within `server.body_timeout_ms` is 408; streams past
//! `epp.max_streams` are refused; health paths hold no worker slot, and every other path that
//! reaches a worker needs a key.

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as In;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Out;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use lockstep_core::config::Role;
use lockstep_gateway::picker::RunningPicker;
use lockstep_router::app::Lockstep;
use lockstep_tenancy::tenant::key_hash_hex;
use lockstep_tests::gateway::{as_epp, start_role};
use lockstep_tests::harness::{MODEL, TEST_TIMEOUTS, config_text_with, mock_with_tokenizer};
use lockstep_tests::sglang_mock::{MockConfig, PdMock};
use tokio::sync::mpsc;
use tonic::Streaming;

/// How long an answer the picker owes may take.
const ANSWER: Duration = Duration::from_secs(5);

struct Picker {
    mock: PdMock,
    lockstep: Lockstep,
    picker: RunningPicker,
    _dir: tempfile::TempDir,
}

/// A picker over the SGLang mock (its decode stands for the sidecar), one tenant `acme` with
/// key `acme-key` and `tenant` settings, `server`: extra `[server]` lines, `epp`: extra `[epp]`
/// lines, `decode`: extra `[models.decode]` lines.
async fn picker(server: &str, tenant: &str, epp: &str, decode: &str) -> Picker {
    let (dir, tok_path, mock) = mock_with_tokenizer(MockConfig::default()).await;
    let base = config_text_with(&mock, &tok_path, server, "", TEST_TIMEOUTS);
    let decode_hp = mock.decode_url().trim_start_matches("http://").to_string();
    let mut text = as_epp(&base, &mock.decode_url(), &decode_hp);
    text.push_str(epp);
    let decode_table = "[models.decode]\n";
    assert!(text.contains(decode_table));
    text = text.replace(decode_table, &format!("{decode_table}{decode}\n"));
    text.push_str(&format!(
        "\n[[tenants]]\nname = \"acme\"\napi_keys_sha256 = [\"{}\"]\n{tenant}\n",
        key_hash_hex("acme-key")
    ));
    let (lockstep, picker) = start_role(&text, Role::Epp).await;
    Picker {
        mock,
        lockstep,
        picker: picker.expect("a picker"),
        _dir: dir,
    }
}

/// One ext_proc stream, as Envoy opens it.
struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
}

impl Picker {
    /// A stream carrying a request to `path` with the tenant's key and all of `body`.
    async fn keyed(&self, path: &str, body_bytes: &[u8]) -> Stream {
        let s = self.open().await.expect("a stream");
        s.send(headers(path, Some("acme-key"), false)).await;
        s.send(body(body_bytes, true)).await;
        s
    }

    async fn open(&self) -> Result<Stream, tonic::Status> {
        let url = format!("http://{}", self.picker.addr);
        let mut client = ExternalProcessorClient::connect(url)
            .await
            .expect("connects");
        let (tx, out) = mpsc::channel(64);
        let rx = client
            .process(tokio_stream::wrappers::ReceiverStream::new(out))
            .await?
            .into_inner();
        Ok(Stream { tx, rx })
    }
}

fn headers(path: &str, key: Option<&str>, end_of_stream: bool) -> ProcessingRequest {
    let mut list = vec![(":method", "POST".to_string()), (":path", path.to_string())];
    list.push(("content-type", "application/json".to_string()));
    if let Some(k) = key {
        list.push(("authorization", format!("Bearer {k}")));
    }
    ProcessingRequest {
        request: Some(In::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: list
                    .into_iter()
                    .map(|(k, v)| HeaderValue {
                        key: k.to_string(),
                        raw_value: v.into_bytes(),
                        ..HeaderValue::default()
                    })
                    .collect(),
            }),
            end_of_stream,
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(In::RequestBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn chat() -> Vec<u8> {
    serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4})
        .to_string()
        .into_bytes()
}

impl Stream {
    async fn send(&self, m: ProcessingRequest) {
        self.tx.send(m).await.expect("the stream is open");
    }

    /// The picker's next message, within [`ANSWER`].
    async fn next(&mut self) -> Out {
        let m = tokio::time::timeout(ANSWER, self.rx.message())
            .await
            .expect("the picker answers in time")
            .expect("a message, not an error")
            .expect("the stream goes on");
        m.response.expect("a response")
    }

    /// The status of the immediate response the picker ends the request with, and its body.
    async fn refused(&mut self) -> (u32, String) {
        match self.next().await {
            Out::ImmediateResponse(r) => (
                r.status.expect("a status").code as u32,
                String::from_utf8_lossy(&r.body).into_owned(),
            ),
            other => panic!("not an immediate response: {other:?}"),
        }
    }

    /// The headers the picker set in answer to the request's headers (name, value).
    async fn picked_headers(&mut self) -> Vec<(String, String)> {
        match self.next().await {
            Out::RequestHeaders(h) => h
                .response
                .and_then(|c| c.header_mutation)
                .expect("a header mutation")
                .set_headers
                .iter()
                .filter_map(|o| o.header.as_ref())
                .map(|h| {
                    (
                        h.key.clone(),
                        String::from_utf8_lossy(&h.raw_value).into_owned(),
                    )
                })
                .collect(),
            other => panic!("not a headers response: {other:?}"),
        }
    }

    /// The destination the picker answered the request's headers with.
    async fn picked(&mut self) -> String {
        let set = self.picked_headers().await;
        set.into_iter()
            .find(|(k, _)| k == lockstep_gateway::picker::DESTINATION)
            .map(|(_, v)| v)
            .expect("a destination")
    }
}

/// A caller without a key is refused on its headers: its body is never asked for, so forty
/// anonymous streams that never end their bodies hold nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_without_a_key_is_refused_on_its_headers() {
    let p = picker("", "", "", "").await;
    for path in [
        "/v1/chat/completions",
        "/v1/embeddings",
        "/lockstep.v1.Lockstep/Generate",
        "/grpc.health.v1.Health/Watch",
        "/server_info",
    ] {
        let mut s = p.open().await.expect("a stream");
        s.send(headers(path, None, false)).await;
        let (status, text) = s.refused().await;
        assert_eq!(status, 401, "{path}: {text}");
        assert!(text.contains("invalid_api_key"), "{path}: {text}");
    }
    // A wrong key too.
    let mut s = p.open().await.expect("a stream");
    s.send(headers("/v1/chat/completions", Some("nope"), false))
        .await;
    assert_eq!(s.refused().await.0, 401);
    // The health paths answered once need none.
    for path in ["/health", "/ready", "/grpc.health.v1.Health/Check"] {
        let mut s = p.open().await.expect("a stream");
        s.send(headers(path, None, true)).await;
        assert!(!s.picked().await.is_empty(), "{path}");
    }
}

/// A tenant over its concurrency limit is refused (429) on its headers, while its first request
/// is still sending its body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_limits_is_refused_on_its_headers() {
    let p = picker("", "max_concurrent_pairs = 1", "", "").await;
    let first = p.open().await.expect("a stream");
    first
        .send(headers("/v1/chat/completions", Some("acme-key"), false))
        .await;
    first.send(body(b"{\"model\"", false)).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut second = p.open().await.expect("a stream");
    second
        .send(headers("/v1/chat/completions", Some("acme-key"), false))
        .await;
    let (status, text) = second.refused().await;
    assert_eq!(status, 429, "{text}");
    assert!(text.contains("rate_limit_exceeded"), "{text}");
    drop(first);
}

/// A body that has not ended `server.body_timeout_ms` after the stream began is 408, and the
/// tenant's slot it held is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_does_not_end_in_time_is_refused() {
    let p = picker("body_timeout_ms = 300", "max_concurrent_pairs = 1", "", "").await;
    let mut s = p.open().await.expect("a stream");
    let began = std::time::Instant::now();
    s.send(headers("/v1/chat/completions", Some("acme-key"), false))
        .await;
    s.send(body(b"{\"model\": ", false)).await;
    let (status, text) = s.refused().await;
    assert_eq!(status, 408, "{text}");
    assert!(text.contains("body_timeout"), "{text}");
    assert!(began.elapsed() >= Duration::from_millis(250));
    // Headers that never come are bounded the same way.
    let mut idle = p.open().await.expect("a stream");
    assert_eq!(idle.refused().await.0, 408);
    // The slot is free: a whole request is picked.
    let mut next = p.keyed("/v1/chat/completions", &chat()).await;
    assert!(!next.picked().await.is_empty());
}

/// Past `epp.max_streams`, a stream is refused (`RESOURCE_EXHAUSTED`) before any of it is read;
/// one that ends makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_past_the_cap_are_refused() {
    let p = picker("", "", "max_streams = 2\n", "").await;
    let a = p.open().await.expect("a stream");
    a.send(headers("/v1/chat/completions", Some("acme-key"), false))
        .await;
    let b = p.open().await.expect("a stream");
    b.send(headers("/v1/chat/completions", Some("acme-key"), false))
        .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let over = p.open().await.map(|_| ()).expect_err("a third stream");
    assert_eq!(over.code(), tonic::Code::ResourceExhausted, "{over}");
    drop(a);
    // The picker sees the stream end, then frees its place.
    let deadline = std::time::Instant::now() + ANSWER;
    let mut c = loop {
        match p.open().await {
            Ok(s) => break s,
            Err(e) => {
                assert!(std::time::Instant::now() < deadline, "no room: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    c.send(headers("/v1/chat/completions", Some("acme-key"), false))
        .await;
    c.send(body(&chat(), true)).await;
    assert!(!c.picked().await.is_empty());
    drop(b);
}

/// Health and readiness hold no decode slot, even a `Watch` that stays open; every other path
/// to a worker holds one, as a generation does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_paths_hold_no_worker_slot() {
    let p = picker("", "", "", "max_pairs_per_worker = 1").await;
    let mut watches = Vec::new();
    for _ in 0..2 {
        let mut w = p
            .keyed("/grpc.health.v1.Health/Watch", &[0, 0, 0, 0, 0])
            .await;
        assert!(!w.picked().await.is_empty());
        watches.push(w);
    }
    let mut g = p.keyed("/v1/chat/completions", &chat()).await;
    let decode = g.picked().await;
    assert!(!decode.is_empty());
    // The generation holds the one slot: another path to that worker waits its turn (503).
    let mut other = p.open().await.expect("a stream");
    other
        .send(headers("/v1/models", Some("acme-key"), true))
        .await;
    let (status, text) = other.refused().await;
    assert_eq!(status, 503, "{text}");
    let _ = &p.lockstep;
    drop(watches);
}

/// The picker's HTTP listener serves its own health, readiness and metrics, and nothing that
/// drives an engine: no `lockstep.v1` gRPC, no API route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pickers_http_listener_serves_no_front_end() {
    let p = picker("", "", "", "").await;
    let url = format!("http://{}", p.lockstep.http_addr);
    let channel = tonic::transport::Endpoint::from_shared(url.clone())
        .expect("endpoint")
        .connect()
        .await
        .expect("h2c connect");
    let mut client = lockstep_proto::v1::lockstep_client::LockstepClient::new(channel);
    let e = client
        .list_models(lockstep_proto::v1::ListModelsRequest::default())
        .await
        .expect_err("no lockstep.v1 on the picker");
    assert!(e.message().contains("404 Not Found"), "{e}");
    let a = lockstep_tests::client::TestClient::default()
        .send_with(
            "POST",
            &format!("{url}/v1/chat/completions"),
            &[("authorization", "Bearer acme-key")],
            String::from_utf8(chat()).expect("utf-8"),
            ANSWER,
        )
        .await;
    assert_eq!(a.status, 404, "{}", a.body);
    let a = lockstep_tests::client::TestClient::default()
        .send_with("GET", &format!("{url}/health"), &[], String::new(), ANSWER)
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
}

/// A gRPC `Generate` or `Chat` through the picker gets both workers, the prefill named in
/// `x-prefiller-host-port` as for HTTP (an SGLang sidecar cannot serve without one); the model
/// its message names must exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_generation_gets_a_named_prefill() {
    use prost::Message;
    let p = picker("", "", "", "").await;
    let framed = |model: &str| {
        let m = lockstep_proto::v1::GenerateRequest {
            model: model.into(),
            ..Default::default()
        }
        .encode_to_vec();
        let mut b = vec![0u8];
        b.extend((m.len() as u32).to_be_bytes());
        b.extend(m);
        b
    };
    for path in [
        "/lockstep.v1.Lockstep/Generate",
        "/lockstep.v1.Lockstep/Chat",
    ] {
        let mut s = p.keyed(path, &framed(MODEL)).await;
        let prefill = s
            .picked_headers()
            .await
            .into_iter()
            .find(|(k, _)| k == "x-prefiller-host-port")
            .map(|(_, v)| v);
        assert_eq!(
            prefill.as_deref(),
            Some(p.mock.prefill_addr.to_string().as_str()),
            "{path}"
        );
    }
    let mut s = p
        .keyed("/lockstep.v1.Lockstep/Generate", &framed("no-such-model"))
        .await;
    let (status, text) = s.refused().await;
    assert_eq!(status, 404, "{text}");
    let mut s = p
        .keyed("/lockstep.v1.Lockstep/Generate", &[1, 0, 0, 0, 0])
        .await;
    assert_eq!(s.refused().await.0, 400, "a compressed message");
}

/// Whatever the streams, the bodies the picker holds while it reads them stay within
/// `epp.max_buffered_bytes`: past it a request is 503, and a body that went on frees its share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bodies_held_stay_within_the_budget() {
    let p = picker("", "", "max_buffered_bytes = 65536\n", "").await;
    let chunk = vec![b' '; 40 * 1024];
    let mut a = p.open().await.expect("a stream");
    a.send(headers("/v1/chat/completions", Some("acme-key"), false))
        .await;
    a.send(body(&chunk, false)).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut b = p.open().await.expect("a stream");
    b.send(headers("/v1/chat/completions", Some("acme-key"), false))
        .await;
    b.send(body(&chunk, false)).await;
    let (status, text) = b.refused().await;
    assert_eq!(status, 503, "{text}");
    // The first ends its body: picked, and its bytes leave the budget.
    a.send(body(&chat(), true)).await;
    assert!(!a.picked().await.is_empty());
    let mut c = p.open().await.expect("a stream");
    c.send(headers("/v1/chat/completions", Some("acme-key"), false))
        .await;
    c.send(body(&chunk, false)).await;
    c.send(body(&chat(), true)).await;
    // Whitespace then a JSON body: one request, picked.
    assert!(!c.picked().await.is_empty());
}

/// A picker never starts an engine, whoever starts it: a configuration with an embedded model
/// is refused before anything is built; and the router's own role refuses a gateway role's
/// table rather than ignore it.
#[tokio::test]
async fn a_picker_starts_no_engine_and_the_router_ignores_no_role_table() {
    let default = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/default.toml"),
    )
    .expect("config/default.toml");
    let cfg = lockstep_core::config::Config::parse(&format!(
        "{default}\n[epp]\ngrpc_listen = \"127.0.0.1:0\"\n"
    ))
    .expect("parses");
    let Err(e) = lockstep_gateway::picker::start(cfg).await else {
        panic!("a picker with an embedded model started");
    };
    assert!(e.contains("endpoint picker routes to"), "{e}");
    for table in ["[sidecar]\nprefill_allow = [\"127.0.0.1\"]", "[epp]"] {
        let cfg =
            lockstep_core::config::Config::parse(&format!("{default}\n{table}\n")).expect("parses");
        let Err(e) = Lockstep::start(cfg).await else {
            panic!("the router started with {table}");
        };
        assert!(e.contains("would ignore it"), "{e}");
    }
}

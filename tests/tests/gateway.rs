//! Behind a Gateway: the real Envoy 1.40 running `deploy/envoy/envoy.yaml`, `lockstep epp` as its
//! ext_proc endpoint picker, `lockstep sidecar` as the decode endpoint, over the SGLang and vLLM
//! mocks. Every API served, streamed and not; an over-long prompt refused at the picker with no
//! worker contacted; every prefill fault an error with both halves aborted; a prefill outside the
//! sidecar's `prefill_allow` refused; the picker down fails closed; `lockstep probe` through
//! Envoy finds no leak, where a naive sidecar following llm-d's SGLang sequence leaks under the
//! same fault.

use std::time::Duration;

use lockstep_core::config::Role;
use lockstep_gateway::picker::RunningPicker;
use lockstep_router::app::Lockstep;
use lockstep_tests::client::{Answer, TestClient};
use lockstep_tests::gateway::{Envoy, as_epp, as_sidecar, start_role};
use lockstep_tests::harness::{MODEL, TEST_TIMEOUTS, config_text_with};
use lockstep_tests::sglang_mock::{Fault, MockConfig, PdMock, Role as Half};
use lockstep_tests::vllm_mock::{VllmFault, VllmMock, VllmMockConfig, VllmRole};
use lockstep_tests::{naive_front, tokenizer};
use serde_json::{Value, json};

const BOUND: Duration = Duration::from_secs(20);

/// Envoy → `lockstep epp` → the decode endpoint (a `lockstep sidecar`, or the naive one) → the
/// SGLang mock.
struct Gateway {
    mock: PdMock,
    sidecar: Option<Lockstep>,
    _naive: Option<naive_front::NaiveFront>,
    _epp: Lockstep,
    picker: Option<RunningPicker>,
    envoy: Envoy,
    _dir: tempfile::TempDir,
}

/// `allow`: the sidecar's `prefill_allow`; `naive`: llm-d's SGLang sequence as the sidecar.
async fn gateway(tok: tokenizers::Tokenizer, allow: &str, naive: bool) -> Gateway {
    gateway_with(tok, allow, naive, "").await
}

/// [`gateway`] with `picker` appended to the picker's configuration (`[epp]` lines first, then
/// any tables).
async fn gateway_with(
    tok: tokenizers::Tokenizer,
    allow: &str,
    naive: bool,
    picker: &str,
) -> Gateway {
    gateway_on(tok, allow, naive, picker, None).await
}

/// An edit of an Envoy configuration, given the decode endpoint.
type EnvoyEdit<'a> = &'a dyn Fn(String, &str) -> String;

/// [`gateway_with`] on `deploy/envoy/envoy-metadata.yaml`, its configuration passed through
/// `edit` with the decode endpoint (`None`: `envoy.yaml` as shipped).
async fn gateway_on(
    tok: tokenizers::Tokenizer,
    allow: &str,
    naive: bool,
    picker: &str,
    edit: Option<EnvoyEdit<'_>>,
) -> Gateway {
    let dir = tempfile::tempdir().expect("tempdir");
    let tok_path = dir.path().join("tokenizer.json");
    std::fs::write(&tok_path, tok.to_string(true).expect("tokenizer")).expect("write");
    let mock = PdMock::start(MockConfig::default(), tok.clone())
        .await
        .expect("mock");
    let base = config_text_with(&mock, &tok_path, "", "", TEST_TIMEOUTS);
    let (sidecar, naive_front, endpoint) = if naive {
        let f = naive_front::start(mock.prefill_url(), mock.decode_url(), tok).await;
        let hp = f.url.trim_start_matches("http://").to_string();
        (None, Some(f), hp)
    } else {
        let text = as_sidecar(&base, &mock.prefill_url(), allow);
        let (s, _) = start_role(&text, Role::Sidecar).await;
        let hp = s.http_addr.to_string();
        (Some(s), None, hp)
    };
    let epp_text = as_epp(&base, &mock.decode_url(), &endpoint) + picker;
    let (epp, picker) = start_role(&epp_text, Role::Epp).await;
    let picker = picker.expect("a picker");
    let envoy = match edit {
        None => Envoy::start(picker.addr.port()).await,
        Some(edit) => {
            let text = lockstep_tests::gateway::envoy_config_of(
                "envoy-metadata.yaml",
                0,
                picker.addr.port(),
                0,
            );
            Envoy::start_text(edit(text, &endpoint)).await
        }
    };
    Gateway {
        mock,
        sidecar,
        _naive: naive_front,
        _epp: epp,
        picker: Some(picker),
        envoy,
        _dir: dir,
    }
}

async fn send(url: &str, path: &str, headers: &[(&str, &str)], body: &Value) -> Answer {
    TestClient::default()
        .send_with(
            "POST",
            &format!("{url}{path}"),
            headers,
            body.to_string(),
            BOUND,
        )
        .await
}

/// Every API, streamed and not, through the gateway's Envoy with `headers`: each a 200 with its
/// success's ending. How many were served.
async fn serve_every_api(g: &Gateway, headers: &[(&str, &str)]) -> usize {
    let mut served = 0;
    for stream in [false, true] {
        for (path, body, end) in every_api(stream) {
            let a = send(&g.envoy.url, path, headers, &body).await;
            assert_eq!(
                a.status,
                200,
                "{path} stream={stream}: {}\n{}",
                a.body,
                g.envoy.log()
            );
            assert!(a.body.contains(end), "{path} stream={stream}: {}", a.body);
            served += 1;
        }
    }
    served
}

/// One request per API, streamed or not: (path, body, what its success ends with).
fn every_api(stream: bool) -> Vec<(&'static str, Value, &'static str)> {
    let prompt = "hello there general";
    vec![
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "stream": stream}),
            if stream {
                "[DONE]"
            } else {
                "\"chat.completion\""
            },
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream}),
            if stream {
                "[DONE]"
            } else {
                "\"text_completion\""
            },
        ),
        (
            "/v1/messages",
            json!({"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "stream": stream}),
            if stream {
                "message_stop"
            } else {
                "\"stop_reason\""
            },
        ),
        (
            "/v1/responses",
            json!({"model": MODEL, "input": prompt, "max_output_tokens": 4, "stream": stream}),
            if stream {
                "response.incomplete"
            } else {
                "\"max_output_tokens\""
            },
        ),
        (
            "/generate",
            json!({"text": prompt, "sampling_params": {"max_new_tokens": 4}, "stream": stream}),
            if stream { "[DONE]" } else { "\"meta_info\"" },
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_api_is_served_through_envoy_the_picker_and_the_sidecar() {
    let g = gateway(tokenizer::build(), "\"127.0.0.0/8\"", false).await;
    // A client's own `x-prefiller-host-port` is replaced by the picker's choice.
    let served = serve_every_api(&g, &[("x-prefiller-host-port", "10.9.9.9:1")]).await;
    // Each request was one pair: its two halves share a room, the prefill the picker named.
    let reqs = g.mock.requests();
    let rooms = |h: Half| -> Vec<Value> {
        reqs.iter()
            .filter(|(r, _)| *r == h)
            .map(|(_, b)| b["bootstrap_room"].clone())
            .collect()
    };
    assert_eq!(rooms(Half::Prefill).len(), served);
    assert_eq!(rooms(Half::Prefill), rooms(Half::Decode));
    let picks = g._epp.state.render_metrics();
    let line = format!("lockstep_epp_picks_total{{model=\"{MODEL}\"}} {served}");
    assert!(picks.contains(&line), "{line} not in\n{picks}");
    let sidecar = g.sidecar.as_ref().expect("sidecar");
    let models = sidecar.state.models.load();
    let m = models.by_name.values().next().expect("model");
    let named: Vec<String> = m
        .pairs
        .prefill
        .workers()
        .iter()
        .map(|w| w.url.clone())
        .collect();
    assert_eq!(named, [g.mock.prefill_url()], "the sidecar's prefills");
    assert!(g.mock.wait_idle(Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_long_prompt_is_refused_at_the_picker_with_no_worker_contacted() {
    let g = gateway(tokenizer::build(), "\"127.0.0.0/8\"", false).await;
    let long = "word ".repeat(700);
    for (path, body) in [
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": long, "max_tokens": 4}),
        ),
        (
            "/v1/messages",
            json!({"model": MODEL, "messages": [{"role": "user", "content": long}], "max_tokens": 4}),
        ),
    ] {
        let a = send(&g.envoy.url, path, &[], &body).await;
        assert_eq!(a.status, 400, "{path}: {}", a.body);
        assert!(
            a.body.contains("context_length_exceeded"),
            "{path}: {}",
            a.body
        );
        if path == "/v1/messages" {
            assert_eq!(a.json()["type"], "error", "Anthropic's shape: {}", a.body);
        }
    }
    // An unknown field is refused there too, never dropped.
    let a = send(
        &g.envoy.url,
        "/v1/completions",
        &[],
        &json!({"model": MODEL, "prompt": "hi", "max_tokens": 4, "best_of": 3}),
    )
    .await;
    assert_eq!(a.status, 400, "{}", a.body);
    assert_eq!(g.mock.request_count(), 0, "a worker was contacted");
    let sidecar = g.sidecar.as_ref().expect("sidecar");
    let models = sidecar.state.models.load();
    let m = models.by_name.values().next().expect("model");
    assert!(
        m.pairs.prefill.workers().is_empty(),
        "the sidecar saw a request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_prefill_fault_behind_the_gateway_is_an_error_with_both_halves_aborted() {
    let g = gateway(tokenizer::build(), "\"127.0.0.0/8\"", false).await;
    let (path, body, _) = every_api(false).remove(0);
    assert_eq!(send(&g.envoy.url, path, &[], &body).await.status, 200);
    for fault in [
        Fault::PrefillInBandAbortDecoy,
        Fault::PrefillHang,
        Fault::PrefillCountMismatch,
        Fault::KvCorrupt,
    ] {
        g.mock.set_fault(fault);
        let before = g.mock.aborts().len();
        for stream in [false, true] {
            let (path, body, end) = every_api(stream).remove(0);
            let a = send(&g.envoy.url, path, &[], &body).await;
            assert!(
                a.error_code().is_some(),
                "{fault:?} stream={stream}: {} {}",
                a.status,
                a.body
            );
            assert!(
                !a.body.contains(end),
                "{fault:?}: a success ending: {}",
                a.body
            );
        }
        g.mock.set_fault(Fault::None);
        assert!(
            g.mock.wait_idle(Duration::from_secs(5)).await,
            "{fault:?}: the mock holds something"
        );
        // Both halves of every failed pair were aborted (the aborts go out in the background).
        if fault != Fault::KvCorrupt {
            let both = lockstep_tests::gateway::both_halves_aborted(&g.mock, before).await;
            assert!(
                both,
                "{fault:?}: not both halves aborted: {:?}",
                &g.mock.aborts()[before..]
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_outside_the_sidecars_allowed_networks_is_refused() {
    // The picker names the mock's prefill (127.0.0.1); the sidecar allows 127.0.0.2 only.
    let g = gateway(tokenizer::build(), "\"127.0.0.2/32\"", false).await;
    let (path, body, _) = every_api(false).remove(0);
    let a = send(&g.envoy.url, path, &[], &body).await;
    assert_eq!(a.status, 403, "{}", a.body);
    assert_eq!(a.error_code().as_deref(), Some("prefill_not_allowed"));
    assert_eq!(g.mock.request_count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_picker_down_envoy_fails_closed() {
    let mut g = gateway(tokenizer::build(), "\"127.0.0.0/8\"", false).await;
    let (path, body, _) = every_api(false).remove(0);
    assert_eq!(send(&g.envoy.url, path, &[], &body).await.status, 200);
    // The protocol's gRPC health services, on the ext_proc listener.
    let addr = g.picker.as_ref().expect("picker").addr;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("h2c connect");
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    for service in [
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        let r = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .expect("check")
            .into_inner();
        assert_eq!(
            r.status(),
            tonic_health::pb::health_check_response::ServingStatus::Serving,
            "{service}"
        );
    }
    let before = g.mock.request_count();
    g.picker.take().expect("picker").shutdown().await;
    for (path, body, _) in every_api(false) {
        let a = send(&g.envoy.url, path, &[], &body).await;
        assert!(a.status >= 500, "{path}: {} {}", a.status, a.body);
    }
    assert_eq!(
        g.mock.request_count(),
        before,
        "a request went past a picker that was down"
    );
}

/// Through the shipped Envoy file: a caller without a key gets its 401 while its body is still
/// on the way (the picker decides on the headers), and past `epp.max_streams` a request is 503
/// (`status_on_error`), never passed through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_refuses_on_headers_and_caps_its_streams_through_envoy() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let tenants = format!(
        "max_streams = 1\n[[tenants]]\nname = \"acme\"\napi_keys_sha256 = [\"{}\"]\n",
        lockstep_tenancy::tenant::key_hash_hex("acme-key")
    );
    let g = gateway_with(tokenizer::build(), "\"127.0.0.0/8\"", false, &tenants).await;
    let addr = g.envoy.url.trim_start_matches("http://").to_string();
    // Headers and the start of a 100 kB body that never comes.
    let partial = |key: &'static str| {
        let addr = addr.clone();
        async move {
            let mut s = tokio::net::TcpStream::connect(&addr)
                .await
                .expect("connect");
            let head = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: lockstep\r\ncontent-type: application/json\r\n{key}content-length: 100000\r\n\r\n{{\"model\": "
            );
            s.write_all(head.as_bytes()).await.expect("write");
            s
        }
    };
    let mut anonymous = partial("").await;
    let mut head = vec![0u8; 512];
    let n = tokio::time::timeout(Duration::from_secs(5), anonymous.read(&mut head))
        .await
        .expect("answered before the body ends")
        .expect("read");
    let head = String::from_utf8_lossy(&head[..n]).into_owned();
    assert!(head.starts_with("HTTP/1.1 401"), "{head}");
    // One keyed request holds the picker's one stream while its body trickles...
    let holder = partial("authorization: Bearer acme-key\r\n").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // ...so the next is 503, and nothing reached a worker.
    let (path, body, _) = every_api(false).remove(0);
    let a = send(
        &g.envoy.url,
        path,
        &[("authorization", "Bearer acme-key")],
        &body,
    )
    .await;
    assert_eq!(a.status, 503, "{}\n{}", a.body, g.envoy.log());
    assert_eq!(g.mock.request_count(), 0, "a request passed the picker");
    drop(holder);
    // Its stream ended, the cap has room again.
    let deadline = std::time::Instant::now() + BOUND;
    loop {
        let a = send(
            &g.envoy.url,
            path,
            &[("authorization", "Bearer acme-key")],
            &body,
        )
        .await;
        if a.status == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} {}",
            a.status,
            a.body
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn probe_args(target: &str) -> lockstep_probe::ProbeArgs {
    lockstep_probe::ProbeArgs {
        target: target.to_string(),
        model: Some(MODEL.into()),
        api_keys: Vec::new(),
        api_key_file: None,
        endpoints: Vec::new(),
        duration: Some(4),
        once: false,
        concurrency: 4,
        long_prompt_words: None,
        metrics_listen: None,
        grpc: false,
    }
}

/// Probes through Envoy for 4 s, the incident's fault on after 1.5 s.
async fn probe_through_fault(g: &Gateway) -> lockstep_probe::Report {
    let run = tokio::spawn(lockstep_probe::probe(probe_args(&g.envoy.url)));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    g.mock.set_fault(Fault::PrefillInBandAbortDecoy);
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("probe ends in time")
        .expect("probe task")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probe_through_envoy_finds_the_leak_of_a_naive_sidecar_and_none_of_locksteps() {
    let naive = gateway(tokenizer::build_canary(), "", true).await;
    let r = probe_through_fault(&naive).await;
    assert_eq!(r.code, 1, "{}", r.text);
    assert!(r.text.contains("LEAK on"), "{}", r.text);
    drop(naive);

    let g = gateway(tokenizer::build_canary(), "\"127.0.0.0/8\"", false).await;
    let r = probe_through_fault(&g).await;
    assert_ne!(r.code, 1, "{}", r.text);
    assert!(
        r.text
            .contains("leaks (another request's secret in an answer): 0"),
        "{}",
        r.text
    );
    assert!(
        r.text.contains("http_5xx") || r.text.contains("http_4xx"),
        "{}",
        r.text
    );
    assert!(g.mock.wait_idle(Duration::from_secs(10)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_pair_behind_the_gateway_is_served_and_stale_blocks_are_refused() {
    let mock = VllmMock::start(VllmMockConfig::default(), tokenizer::build())
        .await
        .expect("mock");
    let dir = tempfile::tempdir().expect("tempdir");
    let tok = dir.path().join("tokenizer.json");
    tokenizer::write(&tok).expect("tokenizer");
    let text = |prefill: &str, decode: &str, extra: &str| {
        lockstep_tests::gateway::vllm_text(&tok, prefill, decode, extra)
    };
    let sidecar_text = text(
        "",
        &mock.decode_url(),
        "\n[sidecar]\nprefill_allow = [\"127.0.0.1\"]\n",
    );
    let (sidecar, _) = start_role(&sidecar_text, Role::Sidecar).await;
    let epp_text = text(
        &format!("{{ url = \"{}\" }}", mock.prefill_url()),
        &format!("http://{}", sidecar.http_addr),
        "\n[epp]\ngrpc_listen = \"127.0.0.1:0\"\n",
    );
    let (_epp, picker) = start_role(&epp_text, Role::Epp).await;
    let envoy = Envoy::start(picker.as_ref().expect("picker").addr.port()).await;
    for stream in [false, true] {
        let body =
            json!({"model": "vllm-pd", "prompt": "hello there", "max_tokens": 4, "stream": stream});
        let a = send(&envoy.url, "/v1/completions", &[], &body).await;
        assert_eq!(a.status, 200, "{}\n{}", a.body, envoy.log());
    }
    let prefills = mock
        .requests()
        .iter()
        .filter(|(r, _, _)| *r == VllmRole::Prefill)
        .count();
    assert_eq!(prefills, 2, "each request paired through the named prefill");
    mock.set_fault(VllmFault::StaleReference);
    let body = json!({"model": "vllm-pd", "prompt": "hello there", "max_tokens": 4});
    let a = send(&envoy.url, "/v1/completions", &[], &body).await;
    assert!(a.status >= 500, "{}", a.body);
    assert!(a.error_code().is_some(), "{}", a.body);
    mock.set_fault(VllmFault::None);
    assert!(mock.wait_idle(Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_longer_than_one_envoy_chunk_goes_on_whole_and_no_endpoint_is_a_503() {
    let g = gateway(tokenizer::build(), "\"127.0.0.0/8\"", false).await;
    // JSON whitespace after the object: a valid body of ~63 KB, sent back to Envoy in two
    // chunks; the sidecar reads the same body.
    let body = format!(
        "{}{}",
        json!({"model": MODEL, "prompt": "hello there", "max_tokens": 4}),
        " ".repeat(63_000)
    );
    let a = TestClient::default()
        .send_with(
            "POST",
            &format!("{}/v1/completions", g.envoy.url),
            &[],
            body,
            BOUND,
        )
        .await;
    assert_eq!(a.status, 200, "{}\n{}", a.body, g.envoy.log());
    assert!(a.body.contains("text_completion"), "{}", a.body);
    // The decode engine fails its health checks: the sidecar's `/health` says so, the picker
    // takes it out, and a request gets 503 with nothing sent to a worker.
    g.mock.set_healthy(Half::Decode, false);
    let before = g.mock.request_count();
    let (path, body, _) = every_api(false).remove(0);
    let mut last = None;
    for _ in 0..100 {
        let a = send(&g.envoy.url, path, &[], &body).await;
        if a.status == 503 {
            last = Some(a);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let a = last.expect("the picker stops picking an unhealthy decode");
    assert_eq!(
        a.error_code().as_deref(),
        Some("no_healthy_worker"),
        "{}",
        a.body
    );
    let sent = g.mock.request_count() - before;
    // Requests sent before the health checks caught up were served; none after.
    let after = g.mock.request_count();
    let again = send(&g.envoy.url, path, &[], &body).await;
    assert_eq!(again.status, 503, "{}", again.body);
    assert_eq!(
        g.mock.request_count(),
        after,
        "a worker got a request ({sent} before)"
    );
    g.mock.set_healthy(Half::Decode, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_holds_tenants_to_their_key_and_limits_before_any_worker() {
    use lockstep_tenancy::tenant::key_hash_hex;
    let dir = tempfile::tempdir().expect("tempdir");
    let tok = tokenizer::build();
    let tok_path = dir.path().join("tokenizer.json");
    std::fs::write(&tok_path, tok.to_string(true).expect("tokenizer")).expect("write");
    let mock = PdMock::start(MockConfig::default(), tok)
        .await
        .expect("mock");
    let tenants = format!(
        "\n[[tenants]]\nname = \"acme\"\napi_keys_sha256 = [\"{}\"]\nrequests_per_second = 1\nburst = 2\n",
        key_hash_hex("acme-key")
    );
    // With tenants, the sidecar's engine pages need a key: the picker sends the engine's own
    // (`[models.decode] api_key`, in the configuration both share).
    let base = format!(
        "{}{tenants}",
        config_text_with(&mock, &tok_path, "", "", TEST_TIMEOUTS).replace(
            "[models.decode]\n",
            "[models.decode]\napi_key = \"engine-key\"\n"
        )
    );
    let (sidecar, _) = start_role(
        &as_sidecar(&base, &mock.prefill_url(), "\"127.0.0.0/8\""),
        Role::Sidecar,
    )
    .await;
    let text = as_epp(&base, &mock.decode_url(), &sidecar.http_addr.to_string());
    let (_epp, picker) = start_role(&text, Role::Epp).await;
    let envoy = Envoy::start(picker.as_ref().expect("picker").addr.port()).await;
    let (path, body, _) = every_api(false).remove(0);
    // No key: 401 with its challenge, from the picker.
    let a = send(&envoy.url, path, &[], &body).await;
    assert_eq!(a.status, 401, "{}", a.body);
    assert_eq!(a.error_code().as_deref(), Some("invalid_api_key"));
    assert_eq!(
        a.headers.get("www-authenticate").map(|v| v.as_bytes()),
        Some(&b"Bearer"[..])
    );
    // The key passes the picker and the sidecar; past its burst the picker answers 429.
    let auth = [("authorization", "Bearer acme-key")];
    let mut statuses = Vec::new();
    let mut limited = None;
    for _ in 0..5 {
        let a = send(&envoy.url, path, &auth, &body).await;
        statuses.push(a.status);
        if a.status == 429 {
            limited = Some(a);
            break;
        }
    }
    assert_eq!(statuses[0], 200, "{statuses:?}");
    let a = limited.unwrap_or_else(|| panic!("never limited: {statuses:?}"));
    assert_eq!(
        a.error_code().as_deref(),
        Some("rate_limit_exceeded"),
        "{}",
        a.body
    );
    assert!(a.headers.get("retry-after").is_some(), "{:?}", a.headers);
    let served = statuses.iter().filter(|s| **s == 200).count();
    let prefills = mock
        .requests()
        .iter()
        .filter(|(r, _)| *r == Half::Prefill)
        .count();
    assert_eq!(prefills, served, "a refused request reached a worker");
}

/// The example subset of `deploy/envoy/envoy-metadata.yaml`, to be replaced.
const EXAMPLE_SUBSET: &str = r#"["10.0.0.1:8000", "10.0.0.2:8000"]"#;

/// A gateway on `deploy/envoy/envoy-metadata.yaml`, its subset hint `subset(decode endpoint)`
/// (a YAML list), then `edit`ed.
async fn metadata_gateway(
    subset: impl Fn(&str) -> String,
    edit: impl Fn(String) -> String,
) -> Gateway {
    let e = |text: String, endpoint: &str| {
        assert!(text.contains(EXAMPLE_SUBSET));
        edit(text.replace(EXAMPLE_SUBSET, &subset(endpoint)))
    };
    gateway_on(tokenizer::build(), "\"127.0.0.0/8\"", false, "", Some(&e)).await
}

/// The subset of the decode endpoint alone.
fn just(endpoint: &str) -> String {
    format!("[\"{endpoint}\"]")
}

/// One completion through the gateway's Envoy.
async fn one_completion(g: &Gateway) -> Answer {
    let (path, body, _) = every_api(false).remove(1);
    send(&g.envoy.url, path, &[], &body).await
}

/// The picker's whole protocol through the real Envoy (`deploy/envoy/envoy-metadata.yaml`):
/// Envoy routes on the `envoy.lb` metadata the picker answers (no header routing in that
/// file), the subset hint a filter sets restricts the choice, and the served endpoint comes
/// back to the picker in `envoy.lb` with the response's headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_routes_on_the_pickers_metadata_within_the_subset_hint() {
    let g = metadata_gateway(just, |t| t).await;
    serve_every_api(&g, &[]).await;
    assert!(g.mock.wait_idle(BOUND).await);
}

/// An empty subset hint is a 503 (GIE proposal 004: never a choice from every endpoint), and so
/// is a subset naming none of the pool's endpoints; no worker is contacted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_or_foreign_subset_hint_is_a_503_with_no_worker_contacted() {
    for subset in ["[]", r#"["127.0.0.1:1"]"#] {
        let g = metadata_gateway(|_| subset.to_string(), |t| t).await;
        let before = g.mock.request_count();
        let a = one_completion(&g).await;
        assert_eq!(a.status, 503, "subset {subset}: {}", a.body);
        assert_eq!(
            g.mock.request_count(),
            before,
            "subset {subset}: a worker was contacted"
        );
    }
}

/// The data plane reports the endpoint that served (`envoy.lb` /
/// `x-gateway-destination-endpoint-served`, forwarded with the response's headers); one that is
/// not the endpoint picked fails the response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_served_endpoint_other_than_the_picked_one_fails_the_response() {
    let g = metadata_gateway(just, |text| {
        assert!(text.contains("\"%UPSTREAM_HOST%\""));
        text.replace("\"%UPSTREAM_HOST%\"", "\"127.0.0.9:1\"")
    })
    .await;
    let a = one_completion(&g).await;
    assert_eq!(a.status, 503, "{}", a.body);
}

/// Without `receiving_namespaces` Envoy drops the picker's `envoy.lb` metadata (what the shipped
/// file did), and a data plane routing on it has nowhere to send the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_receiving_namespace_the_pickers_metadata_is_dropped() {
    let g = metadata_gateway(just, |text| {
        let receiving = "                        receiving_namespaces:\n                          untyped: [\"envoy.lb\"]\n";
        assert!(text.contains(receiving));
        text.replace(receiving, "")
    })
    .await;
    let a = one_completion(&g).await;
    assert_ne!(a.status, 200, "{}", a.body);
}

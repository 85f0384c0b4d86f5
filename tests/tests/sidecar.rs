//! `lockstep sidecar` (a router whose configuration has `[sidecar]`) in front of the SGLang and
//! vLLM mocks: the prefill is the one `x-prefiller-host-port` names, checked before it is
//! contacted (a pool member, or an address in `prefill_allow` that passes the deployment check
//! with the local decode); the pair's whole lifecycle runs between it and the local decode; the
//! engine's own pages pass through.

use std::time::Duration;

use lockstep_core::config::Config;
use lockstep_router::app::Lockstep;
use lockstep_tests::client::TestClient;
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS};
use lockstep_tests::sglang_mock::{Fault, MockConfig, Role};
use lockstep_tests::vllm_mock::{VllmFault, VllmMock, VllmMockConfig, VllmRole};
use serde_json::{Value, json};

const BOUND: Duration = Duration::from_secs(20);
const HEADER: &str = "x-prefiller-host-port";

/// An SGLang sidecar: no configured prefill, the mock's decode as the local engine, loopback
/// allowed (`allow`: the `[sidecar]` table's `prefill_allow`).
async fn sglang_sidecar(allow: &str) -> Stack {
    sglang_sidecar_with(allow, "", "").await
}

/// [`sglang_sidecar`] with `sidecar` lines added to `[sidecar]` and `prefill` lines to
/// `[models.prefill]`.
async fn sglang_sidecar_with(allow: &str, sidecar: &str, prefill: &str) -> Stack {
    let allow = allow.to_string();
    let (sidecar, prefill_extra) = (sidecar.to_string(), prefill.to_string());
    Stack::start_edited(
        MockConfig::default(),
        "",
        TEST_TIMEOUTS,
        move |mock, text| {
            let prefill = format!(
                "workers = [{{ url = \"{}\", bootstrap_port = 8998 }}]",
                mock.prefill_url()
            );
            assert!(text.contains(&prefill));
            let text = text.replace(
                &prefill,
                &format!("workers = []\nbootstrap_port = 8998\n{prefill_extra}"),
            );
            format!(
                "{text}\n[sidecar]\nprefill_allow = [{allow}]\nverify_wait_ms = 3000\n{sidecar}\n"
            )
        },
    )
    .await
    .expect("the sidecar starts")
}

fn chat(stream: bool) -> Value {
    json!({
        "model": MODEL,
        "messages": [{ "role": "user", "content": "hello there" }],
        "max_tokens": 4,
        "stream": stream,
    })
}

async fn post(url: &str, named: Option<&str>, body: &Value) -> lockstep_tests::client::Answer {
    let headers: Vec<(&str, &str)> = named.map(|n| (HEADER, n)).into_iter().collect();
    TestClient::default()
        .send_with(
            "POST",
            &format!("{url}/v1/chat/completions"),
            &headers,
            body.to_string(),
            BOUND,
        )
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_prefill_in_the_allowed_network_is_checked_then_paired_with_the_local_decode() {
    let s = sglang_sidecar("\"127.0.0.0/8\"").await;
    let named = s.mock.prefill_addr.to_string();
    assert!(
        s.pool("prefill").is_empty(),
        "no prefill before a request names one"
    );
    for stream in [false, true] {
        let a = post(&s.url, Some(&named), &chat(stream)).await;
        assert_eq!(a.status, 200, "{}", a.body);
        if stream {
            assert!(a.body.contains("data: [DONE]"), "{}", a.body);
        } else {
            let text = a.json()["choices"][0]["message"]["content"].clone();
            assert!(text.as_str().is_some_and(|t| !t.is_empty()), "{}", a.body);
        }
    }
    // The named prefill joined the pool, verified; both halves of each pair share a room.
    let pool = s.pool("prefill");
    assert_eq!(pool.len(), 1, "{pool:?}");
    assert_eq!(pool[0].0, s.mock.prefill_url());
    assert!(pool[0].2 && pool[0].3, "verified and joined: {pool:?}");
    let reqs = s.mock.requests();
    let rooms = |r: Role| -> Vec<Value> {
        reqs.iter()
            .filter(|(role, _)| *role == r)
            .map(|(_, b)| b["bootstrap_room"].clone())
            .collect()
    };
    assert_eq!(rooms(Role::Prefill).len(), 2);
    assert_eq!(rooms(Role::Prefill), rooms(Role::Decode));
    // The decode was told the named prefill's bootstrap address.
    let decode = reqs
        .iter()
        .find(|(r, _)| *r == Role::Decode)
        .expect("a decode");
    assert_eq!(decode.1["bootstrap_host"], "127.0.0.1");
    assert_eq!(decode.1["bootstrap_port"], 8998);
    assert!(s.mock.wait_idle(Duration::from_secs(5)).await);
    assert!(s.wait_all_idle(Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_outside_the_allowed_networks_is_refused_before_any_connection() {
    let s = sglang_sidecar("\"10.1.0.0/16\"").await;
    let before = s.mock.info_calls();
    // Loopback is not allowed here; 10.9.9.9 is outside the list; a host name is never
    // resolved; none of them is contacted.
    let port = s.mock.prefill_addr.port();
    for named in [
        format!("127.0.0.1:{port}"),
        "10.9.9.9:8000".to_string(),
        format!("localhost:{port}"),
    ] {
        let started = std::time::Instant::now();
        let a = post(&s.url, Some(&named), &chat(false)).await;
        assert_eq!(a.status, 403, "{named}: {}", a.body);
        assert_eq!(
            a.error_code().as_deref(),
            Some("prefill_not_allowed"),
            "{named}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{named}: it waited on something"
        );
    }
    // A malformed header is a 400 naming it.
    let a = post(&s.url, Some("not a host"), &chat(false)).await;
    assert_eq!(a.status, 400, "{}", a.body);
    assert_eq!(a.json()["error"]["param"], HEADER);
    assert_eq!(s.mock.request_count(), 0, "a worker got a request");
    assert_eq!(s.mock.info_calls(), before, "a refused prefill was probed");
    assert!(s.pool("prefill").is_empty());
    // No header, or an empty one (llm-d's decode-only): an SGLang decode cannot serve alone,
    // so lockstep refuses clearly where llm-d would send the decode a request it cannot serve.
    for named in [None, Some(""), Some(" , 127.0.0.1:9")] {
        let a = post(&s.url, named, &chat(false)).await;
        assert_eq!(a.status, 503, "{named:?}: {}", a.body);
        assert_eq!(a.error_code().as_deref(), Some("prefill_required"));
    }
    // The refusals are counted by code.
    let m = TestClient::default()
        .get(&format!("{}/lockstep/metrics", s.url), BOUND)
        .await;
    assert_eq!(m.status, 200);
    assert!(
        m.body
            .lines()
            .any(|l| l.contains("code=\"prefill_not_allowed\"") && !l.ends_with(" 0")),
        "{}",
        m.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_prefill_that_fails_its_deployment_check_gets_no_pair() {
    let s = sglang_sidecar("\"127.0.0.0/8\"").await;
    // The decode server named as the prefill: its role is wrong for the prefill side.
    let named = s.mock.decode_addr.to_string();
    let a = post(&s.url, Some(&named), &chat(false)).await;
    assert_eq!(a.status, 503, "{}", a.body);
    assert_eq!(
        a.error_code().as_deref(),
        Some("prefill_unverified"),
        "{}",
        a.body
    );
    // The client learns which of its names failed, never why (the worker's answers, its URL).
    assert!(a.body.contains(&named), "{}", a.body);
    assert!(
        !a.body.contains("disaggregation_mode") && !a.body.contains("http://"),
        "the reason reached the client: {}",
        a.body
    );
    assert!(
        !s.mock.requests().iter().any(|(r, _)| *r == Role::Decode),
        "a decode was sent"
    );
    assert_eq!(s.mock.request_count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_prefill_fault_through_the_sidecar_ends_in_an_error_with_both_halves_aborted() {
    let s = sglang_sidecar("\"127.0.0.0/8\"").await;
    let named = s.mock.prefill_addr.to_string();
    // Verified first, on a healthy pair.
    assert_eq!(post(&s.url, Some(&named), &chat(false)).await.status, 200);
    for fault in [
        Fault::PrefillInBandAbortDecoy,
        Fault::PrefillHang,
        Fault::PrefillCountMismatch,
        Fault::KvCorrupt,
    ] {
        s.mock.set_fault(fault);
        let before = s.mock.aborts().len();
        for stream in [false, true] {
            let a = post(&s.url, Some(&named), &chat(stream)).await;
            assert!(
                a.status >= 500 || a.error_code().is_some(),
                "{fault:?} stream={stream}: {} {}",
                a.status,
                a.body
            );
            assert!(!a.body.contains("[DONE]"), "{fault:?}: a success ending");
            assert!(!a.body.contains("decoy"), "{fault:?}: the decoy leaked");
        }
        s.mock.set_fault(Fault::None);
        assert!(
            s.mock.wait_idle(Duration::from_secs(5)).await,
            "{fault:?}: the mock holds something"
        );
        // Both halves of every failed pair were aborted (the aborts go out in the background).
        if fault != Fault::KvCorrupt {
            let both = lockstep_tests::gateway::both_halves_aborted(&s.mock, before).await;
            assert!(
                both,
                "{fault:?}: not both halves aborted: {:?}",
                &s.mock.aborts()[before..]
            );
        }
    }
    assert!(s.wait_all_idle(Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_own_pages_pass_through_and_lockstep_keeps_its_metrics_beside_them() {
    let s = sglang_sidecar("\"127.0.0.0/8\"").await;
    let c = TestClient::default();
    let info = c.get(&format!("{}/server_info", s.url), BOUND).await;
    assert_eq!(info.status, 200, "{}", info.body);
    assert_eq!(
        info.json()["disaggregation_mode"],
        "decode",
        "{}",
        info.body
    );
    let health = c.get(&format!("{}/health", s.url), BOUND).await;
    assert_eq!(health.status, 200);
    s.mock.set_healthy(Role::Decode, false);
    let health = c.get(&format!("{}/health", s.url), BOUND).await;
    assert_ne!(
        health.status, 200,
        "the engine's own health, not lockstep's"
    );
    let ours = c.get(&format!("{}/lockstep/metrics", s.url), BOUND).await;
    assert!(ours.body.contains("lockstep_"), "{}", ours.body);
    // Ready needs no prefill: a sidecar's are named by its requests.
    s.mock.set_healthy(Role::Decode, true);
}

/// A vLLM sidecar: no configured prefill, the mock's decode server as the local engine.
async fn vllm_sidecar() -> (VllmMock, Lockstep, tempfile::TempDir) {
    let mock = VllmMock::start(
        VllmMockConfig::default(),
        lockstep_tests::tokenizer::build(),
    )
    .await
    .expect("mock");
    let dir = tempfile::tempdir().expect("tempdir");
    let tok = dir.path().join("tokenizer.json");
    lockstep_tests::tokenizer::write(&tok).expect("tokenizer");
    let text = lockstep_tests::gateway::vllm_text(
        &tok,
        "",
        &mock.decode_url(),
        "\n[sidecar]\nprefill_allow = [\"127.0.0.1\"]\n",
    );
    let mut cfg = Config::parse(&text).expect("config parses");
    assert!(cfg.problems().is_empty(), "{:?}", cfg.problems());
    cfg.for_role(lockstep_core::config::Role::Sidecar)
        .expect("a sidecar's configuration");
    let lockstep = lockstep_gateway::sidecar::start(cfg)
        .await
        .expect("the sidecar starts");
    (mock, lockstep, dir)
}

fn completion(stream: bool) -> Value {
    json!({ "model": "vllm-pd", "prompt": "hello there", "max_tokens": 4, "stream": stream })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_sidecar_pairs_with_the_named_prefill_and_serves_alone_without_one() {
    let (mock, lockstep, _dir) = vllm_sidecar().await;
    let url = format!("http://{}/v1/completions", lockstep.http_addr);
    let c = TestClient::default();
    let prefill = mock.prefill_addr.to_string();
    for stream in [false, true] {
        let a = c
            .send_with(
                "POST",
                &url,
                &[(HEADER, &prefill)],
                completion(stream).to_string(),
                BOUND,
            )
            .await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    let reqs = mock.requests();
    let prefills = reqs
        .iter()
        .filter(|(r, _, _)| *r == VllmRole::Prefill)
        .count();
    assert_eq!(prefills, 2, "{reqs:?}");
    assert!(
        reqs.iter()
            .filter(|(r, _, _)| *r == VllmRole::Decode)
            .all(|(_, _, b)| b["kv_transfer_params"].is_object()),
        "a paired decode without the prefill's params"
    );
    // No header, or an empty one (llm-d's decode-only): the decode serves the request alone (no
    // transfer params), its own prompt count checked.
    let before = mock.requests().len();
    for stream in [false, true] {
        let a = c
            .send_raw("POST", &url, completion(stream).to_string(), BOUND)
            .await;
        assert_eq!(a.status, 200, "{}", a.body);
        let a = c
            .send_with(
                "POST",
                &url,
                &[(HEADER, "")],
                completion(stream).to_string(),
                BOUND,
            )
            .await;
        assert_eq!(a.status, 200, "an empty header: {}", a.body);
    }
    let alone: Vec<_> = mock.requests()[before..].to_vec();
    assert_eq!(alone.len(), 4, "{alone:?}");
    for (role, _, body) in &alone {
        assert_eq!(*role, VllmRole::Decode);
        assert!(body.get("kv_transfer_params").is_none(), "{body}");
    }
    // A decode that fails alone is an error, never a success.
    mock.set_fault(VllmFault::DecodeStatus(500));
    let a = c
        .send_raw("POST", &url, completion(false).to_string(), BOUND)
        .await;
    assert!(a.status >= 500, "{}", a.body);
    mock.set_fault(VllmFault::None);
    // Stale blocks through a named prefill: refused, nothing held.
    mock.set_fault(VllmFault::StaleReference);
    let a = c
        .send_with(
            "POST",
            &url,
            &[(HEADER, &prefill)],
            completion(false).to_string(),
            BOUND,
        )
        .await;
    assert!(a.status >= 500, "{}", a.body);
    mock.set_fault(VllmFault::None);
    assert!(mock.wait_idle(Duration::from_secs(5)).await);
    // vLLM's own pages pass through.
    let models = c
        .get(&format!("http://{}/v1/models", lockstep.http_addr), BOUND)
        .await;
    assert_eq!(models.json()["data"][0]["id"], "vllm-pd", "{}", models.body);
    let metrics = c
        .get(&format!("http://{}/metrics", lockstep.http_addr), BOUND)
        .await;
    assert!(metrics.body.contains("vllm:"), "{}", metrics.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_name_their_prefill_in_metadata_and_get_the_same_lifecycle() {
    use lockstep_proto::v1 as pb;
    use lockstep_proto::v1::lockstep_client::LockstepClient;
    use tokio_stream::StreamExt;
    let s = sglang_sidecar("\"127.0.0.0/8\"").await;
    let channel = tonic::transport::Endpoint::from_shared(s.url.clone())
        .expect("endpoint")
        .connect()
        .await
        .expect("h2c connect");
    let mut client = LockstepClient::new(channel);
    let req = |named: Option<&str>| {
        let mut r = tonic::Request::new(pb::GenerateRequest {
            model: MODEL.into(),
            prompt: Some(pb::generate_request::Prompt::Text("hello there".into())),
            sampling: Some(pb::SamplingParams {
                max_tokens: Some(4),
                ..Default::default()
            }),
        });
        if let Some(n) = named {
            r.metadata_mut()
                .insert(HEADER, n.parse().expect("metadata"));
        }
        r
    };
    let named = s.mock.prefill_addr.to_string();
    let mut events = client
        .generate(req(Some(&named)))
        .await
        .expect("the pair commits")
        .into_inner();
    let mut finished = false;
    while let Some(e) = events.next().await {
        let e = e.expect("an event");
        finished |= matches!(e.event, Some(pb::generate_response::Event::Finished(_)));
    }
    assert!(finished, "the stream ends with Finished");
    let status = client
        .generate(req(None))
        .await
        .expect_err("no prefill named");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    let status = client
        .generate(req(Some("10.9.9.9:1")))
        .await
        .expect_err("outside prefill_allow");
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert!(s.mock.wait_idle(Duration::from_secs(5)).await);
}

/// A named prefill that reports a prompt limit under the model's is refused, and the model's
/// limit stays what it was for every other request; once it reports enough it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_prefill_cannot_lower_the_models_limits() {
    let s = sglang_sidecar("\"127.0.0.0/8\"").await;
    let limit = || {
        let models = s.lockstep.state.models.load();
        models.by_name[MODEL].worker_prompt_limit()
    };
    let before = limit();
    assert!(before.is_some_and(|l| l > 100), "{before:?}");
    s.mock
        .set_server_arg(Role::Prefill, "max_req_input_len", json!(2));
    let named = s.mock.prefill_addr.to_string();
    let a = post(&s.url, Some(&named), &chat(false)).await;
    assert_eq!(a.status, 503, "{}", a.body);
    assert_eq!(a.error_code().as_deref(), Some("prefill_unverified"));
    assert_eq!(
        limit(),
        before,
        "a named prefill lowered the model's prompt limit"
    );
    // Reporting as much as the decode does, it passes at its next check and serves (SGLang's
    // scheduler refuses `len >= max_req_input_len`: the limit is one under it).
    s.mock.set_server_arg(
        Role::Prefill,
        "max_req_input_len",
        json!(before.expect("a limit") + 1),
    );
    let deadline = std::time::Instant::now() + BOUND;
    loop {
        let a = post(&s.url, Some(&named), &chat(false)).await;
        if a.status == 200 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{}", a.body);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(limit(), before);
}

/// The prefill pool's API key never goes to a named prefill over plain `http://` off loopback
/// (403 before any connection), unless the pool says `insecure_plaintext`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_prefill_off_loopback_never_gets_the_key_in_plaintext() {
    let s = sglang_sidecar_with(
        "\"127.0.0.0/8\", \"10.77.0.0/16\"",
        "",
        "api_key = \"prefill-secret\"",
    )
    .await;
    let started = std::time::Instant::now();
    let a = post(&s.url, Some("10.77.0.9:30000"), &chat(false)).await;
    assert_eq!(a.status, 403, "{}", a.body);
    assert_eq!(a.error_code().as_deref(), Some("prefill_not_allowed"));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "it waited on something"
    );
    assert!(s.pool("prefill").is_empty(), "{:?}", s.pool("prefill"));
    // On loopback the key may go in plaintext, as for configured workers.
    let named = s.mock.prefill_addr.to_string();
    let a = post(&s.url, Some(&named), &chat(false)).await;
    assert_eq!(a.status, 200, "{}", a.body);
}

/// `sidecar.max_prefills` is a hard bound however many requests name new prefills at once, and
/// a named prefill that serves nothing for `prefill_idle_ms` leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_prefills_are_bounded_and_idle_ones_leave() {
    let s = sglang_sidecar_with(
        "\"127.0.0.0/8\"",
        "max_prefills = 3\nprefill_idle_ms = 300",
        "",
    )
    .await;
    let named = s.mock.prefill_addr.to_string();
    assert_eq!(post(&s.url, Some(&named), &chat(false)).await.status, 200);
    let sampler = {
        let state = s.lockstep.state.clone();
        tokio::spawn(async move {
            let mut most = 0;
            for _ in 0..400 {
                let models = state.models.load();
                let n = models.by_name[MODEL].pairs.prefill.workers().len();
                most = most.max(n);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            most
        })
    };
    // Forty requests at once, each naming a prefill of its own that nothing answers.
    let mut calls = Vec::new();
    for i in 0..40 {
        let url = s.url.clone();
        calls.push(tokio::spawn(async move {
            let n = format!("127.0.{}.{}:9", i / 200, 2 + i % 200);
            post(&url, Some(&n), &chat(false)).await
        }));
    }
    let mut codes = std::collections::BTreeSet::new();
    for c in calls {
        let a = c.await.expect("joined");
        assert_eq!(a.status, 503, "{}", a.body);
        codes.insert(a.error_code().unwrap_or_default());
    }
    assert!(codes.contains("workers_busy"), "{codes:?}");
    let most = sampler.await.expect("sampler");
    assert!(most <= 3, "{most} named prefills kept at once");
    let policy = &lockstep_gateway::sidecar::SidecarRole::of(&s.lockstep.state)
        .expect("a sidecar")
        .named;
    assert!(policy.kept() <= 3, "{}", policy.kept());
    // The served prefill, idle since, leaves once a later request looks.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let _ = post(&s.url, Some("127.0.9.9:9"), &chat(false)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while s
        .pool("prefill")
        .iter()
        .any(|w| w.0 == s.mock.prefill_url())
    {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            s.pool("prefill")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Named prefills are checked concurrently: ten addresses that accept and never answer do not
/// hold up a prefill that answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_prefills_do_not_hold_up_the_check_of_another() {
    let s = sglang_sidecar("\"127.0.0.0/8\"").await;
    let mut tarpits = Vec::new();
    let mut names = Vec::new();
    for _ in 0..10 {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        names.push(l.local_addr().expect("addr").to_string());
        tarpits.push(tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((c, _)) = l.accept().await {
                held.push(c);
            }
        }));
    }
    let mut calls = Vec::new();
    for n in names {
        let url = s.url.clone();
        calls.push(tokio::spawn(async move {
            post(&url, Some(&n), &chat(false)).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = std::time::Instant::now();
    let a = post(&s.url, Some(&s.mock.prefill_addr.to_string()), &chat(false)).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the check waited behind the silent ones: {:?}",
        started.elapsed()
    );
    for c in calls {
        let a = c.await.expect("joined");
        assert_eq!(
            a.error_code().as_deref(),
            Some("prefill_unverified"),
            "{}",
            a.body
        );
    }
    for t in tarpits {
        t.abort();
    }
}

/// The engine's pages are held as its API is: `/health` open, anything else with a tenant key or
/// the engine's own key; `/server_info` cut to what the deployment check reads (SGLang puts its
/// `api_key` and `admin_api_key` there); the engine's `/metrics` off the listener with
/// `server.metrics_on_admin`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_pages_need_a_key_and_never_show_the_engines_keys() {
    let tenants = format!(
        "\n[[tenants]]\nname = \"acme\"\napi_keys_sha256 = [\"{}\"]\n",
        lockstep_tenancy::tenant::key_hash_hex("acme-key")
    );
    let server = format!(
        "admin_listen = \"127.0.0.1:0\"\nadmin_key_sha256 = \"{}\"\nmetrics_on_admin = true",
        lockstep_tenancy::tenant::key_hash_hex("admin-key")
    );
    let s = Stack::start_edited(
        MockConfig::default(),
        &server,
        TEST_TIMEOUTS,
        |mock, text| {
            let prefill = format!(
                "workers = [{{ url = \"{}\", bootstrap_port = 8998 }}]",
                mock.prefill_url()
            );
            let text = text.replace(&prefill, "workers = []\nbootstrap_port = 8998");
            let text = text.replace(
                "[models.decode]\n",
                "[models.decode]\napi_key = \"engine-key\"\n",
            );
            format!("{text}\n[sidecar]\nprefill_allow = [\"127.0.0.0/8\"]\n{tenants}")
        },
    )
    .await
    .expect("the sidecar starts");
    s.mock
        .set_server_arg(Role::Decode, "api_key", json!("engine-key"));
    s.mock
        .set_server_arg(Role::Decode, "admin_api_key", json!("engine-admin-key"));
    let c = TestClient::default();
    let get = |path: &str, key: Option<&str>| {
        let url = format!("{}{path}", s.url);
        let auth = key.map(|k| format!("Bearer {k}"));
        let c = c.clone();
        async move {
            let headers: Vec<(&str, &str)> = auth
                .as_deref()
                .map(|a| ("authorization", a))
                .into_iter()
                .collect();
            c.send_with("GET", &url, &headers, String::new(), BOUND)
                .await
        }
    };
    assert_eq!(get("/health", None).await.status, 200);
    for path in ["/server_info", "/get_server_info", "/v1/models", "/version"] {
        let a = get(path, None).await;
        assert_eq!(a.status, 401, "{path}: {}", a.body);
        assert_eq!(get(path, Some("wrong")).await.status, 401, "{path}");
    }
    let calls = s.mock.info_calls();
    for key in ["acme-key", "engine-key"] {
        let a = get("/server_info", Some(key)).await;
        assert_eq!(a.status, 200, "{key}: {}", a.body);
        assert_eq!(a.json()["disaggregation_mode"], "decode", "{}", a.body);
        assert!(
            !a.body.contains("engine-key") && !a.body.contains("api_key"),
            "the engine's keys: {}",
            a.body
        );
    }
    assert_eq!(
        s.mock.info_calls(),
        calls + 2,
        "refused calls reached the engine"
    );
    // `metrics_on_admin`: neither the engine's metrics nor lockstep's on this listener.
    for path in ["/metrics", "/lockstep/metrics"] {
        assert_eq!(get(path, Some("acme-key")).await.status, 404, "{path}");
    }
}

//! `Idempotency-Key` on the generation APIs, through lockstep in front of the SGLang PD mock:
//! a repeat is replayed (whole) or joined (streaming) without a second generation, a client
//! whose connection dropped retries and gets the answer, another body is 422, another tenant's
//! key is its own, a large answer is not kept (409), a failure that may pass is not kept (a retry
//! runs again), and with `[shared]` the replicas coordinate through a real Redis.

use std::time::Duration;

use lockstep_tenancy::tenant::key_hash_hex;
use lockstep_tests::client::{Answer, TestClient};
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS};
use lockstep_tests::redis::RedisServer;
use lockstep_tests::sglang_mock::{Fault, MockConfig};
use serde_json::{Value, json};

const BOUND: Duration = Duration::from_secs(20);

async fn stack(mock: MockConfig, extra: &str) -> Stack {
    let tenants = format!(
        "\n[[tenants]]\nname = \"alice\"\napi_keys_sha256 = [\"{}\"]\n\n[[tenants]]\nname = \"bob\"\napi_keys_sha256 = [\"{}\"]\n{extra}",
        key_hash_hex("alice-key"),
        key_hash_hex("bob-key"),
    );
    Stack::start_edited(mock, "", TEST_TIMEOUTS, |_, text| text + &tenants)
        .await
        .expect("lockstep starts")
}

async fn post(s: &Stack, body: &Value, key: &str, idem: Option<&str>) -> Answer {
    let auth = format!("Bearer {key}");
    let mut headers = vec![("authorization", auth.as_str())];
    if let Some(k) = idem {
        headers.push(("idempotency-key", k));
    }
    TestClient::default()
        .send_with(
            "POST",
            &format!("{}/v1/chat/completions", s.url),
            &headers,
            body.to_string(),
            BOUND,
        )
        .await
}

fn chat(text: &str, stream: bool, max: u64) -> Value {
    json!({ "model": MODEL, "messages": [{ "role": "user", "content": text }],
            "max_tokens": max, "stream": stream })
}

fn replayed(a: &Answer) -> bool {
    a.headers
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

#[tokio::test]
async fn a_repeat_is_replayed_without_a_second_generation() {
    let s = stack(MockConfig::default(), "").await;
    let body = chat("alpha bravo", false, 6);
    let first = post(&s, &body, "alice-key", Some("k-1")).await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert!(!replayed(&first));
    let generated = s.mock.request_count();
    let again = post(&s, &body, "alice-key", Some("k-1")).await;
    assert_eq!(
        (again.status, again.body.as_str()),
        (200, first.body.as_str())
    );
    assert!(replayed(&again), "marked as a replay");
    assert_eq!(
        again.headers.get("x-lockstep-pair-id"),
        first.headers.get("x-lockstep-pair-id")
    );
    assert_eq!(s.mock.request_count(), generated, "no second generation");
    // The same key with another body: 422; another tenant's same key is its own.
    let other = post(&s, &chat("charlie", false, 6), "alice-key", Some("k-1")).await;
    assert_eq!(
        (other.status, other.error_code().as_deref()),
        (422, Some("idempotency_key_reused"))
    );
    let bob = post(&s, &body, "bob-key", Some("k-1")).await;
    assert_eq!(bob.status, 200);
    assert!(!replayed(&bob));
    assert!(
        s.mock.request_count() > generated,
        "bob's request generated"
    );
    // Without the header, nothing is remembered; a malformed key is a 400.
    let plain = post(&s, &body, "alice-key", None).await;
    assert!(!replayed(&plain));
    let long = "k".repeat(256);
    let bad = post(&s, &body, "alice-key", Some(&long)).await;
    assert_eq!(
        (bad.status, bad.json()["error"]["param"].as_str()),
        (400, Some("Idempotency-Key"))
    );
    let metrics = TestClient::default()
        .get(&format!("{}/metrics", s.url), BOUND)
        .await
        .body;
    for outcome in ["first", "replayed", "mismatch"] {
        assert!(
            metrics.contains(&format!(
                "lockstep_idempotent_requests_total{{outcome=\"{outcome}\"}}"
            )),
            "{outcome}"
        );
    }
}

#[tokio::test]
async fn a_repeat_of_a_running_stream_joins_it_from_its_first_event() {
    let mock = MockConfig {
        token_delay: Duration::from_millis(40),
        ..MockConfig::default()
    };
    let s = stack(mock, "").await;
    let body = chat("delta echo foxtrot", true, 12);
    let (a, b) = tokio::join!(post(&s, &body, "alice-key", Some("k-s")), async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        post(&s, &body, "alice-key", Some("k-s")).await
    });
    assert_eq!(a.status, 200);
    assert!(a.body.contains("[DONE]"), "{}", a.body);
    assert_eq!(
        b.body, a.body,
        "the repeat read the same events from the first"
    );
    assert!(replayed(&b));
    assert_eq!(
        s.mock.request_count(),
        2,
        "one pair: a prefill and a decode"
    );
}

/// The client's connection drops mid-stream; its retry with the same key gets the whole answer,
/// and the answer was generated once.
#[tokio::test]
async fn a_retry_after_a_dropped_connection_gets_the_answer() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mock = MockConfig {
        token_delay: Duration::from_millis(40),
        ..MockConfig::default()
    };
    let s = stack(mock, "").await;
    let body = chat("golf hotel", true, 15).to_string();
    let addr = s.url.trim_start_matches("http://").to_string();
    let mut conn = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer alice-key\r\nidempotency-key: k-drop\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(req.as_bytes()).await.expect("write");
    let mut buf = [0u8; 512];
    let n = tokio::time::timeout(BOUND, conn.read(&mut buf))
        .await
        .expect("an answer begins")
        .expect("read");
    assert!(n > 0);
    drop(conn);
    let body: Value = serde_json::from_str(&body).expect("json");
    let retry = post(&s, &body, "alice-key", Some("k-drop")).await;
    assert_eq!(retry.status, 200);
    assert!(replayed(&retry));
    assert!(
        retry.body.contains("[DONE]"),
        "the whole answer: {}",
        retry.body
    );
    assert_eq!(s.mock.request_count(), 2, "generated once");
    assert!(s.mock.aborts().is_empty(), "the pair was not aborted");
}

#[tokio::test]
async fn an_answer_too_large_to_keep_is_refused_a_replay_and_a_passing_failure_is_not_kept() {
    let s = stack(
        MockConfig::default(),
        "\n[idempotency]\nmax_answer_bytes = 200\nmax_total_bytes = 1000\n",
    )
    .await;
    let body = chat("india juliet kilo lima", false, 40);
    let first = post(&s, &body, "alice-key", Some("k-big")).await;
    assert_eq!(first.status, 200);
    assert!(
        first.body.len() > 200,
        "a large answer: {}",
        first.body.len()
    );
    let again = post(&s, &body, "alice-key", Some("k-big")).await;
    assert_eq!(
        (again.status, again.error_code().as_deref()),
        (409, Some("idempotent_answer_not_kept"))
    );
    // A 5xx is not kept: the retry runs again and gets its own answer.
    s.mock.set_fault(Fault::PrefillStatus(503));
    let small = chat("mike", false, 2);
    let failed = post(&s, &small, "alice-key", Some("k-fail")).await;
    assert!(failed.status >= 500, "{}", failed.body);
    s.mock.set_fault(Fault::None);
    let retried = post(&s, &small, "alice-key", Some("k-fail")).await;
    assert_eq!(retried.status, 200, "{}", retried.body);
    assert!(!replayed(&retried));
}

/// Two replicas on one Redis: a finished answer on one is replayed on the other (whose workers
/// never see the request); a request still running on one is 409 on the other, with
/// `Retry-After`; another body is 422 across replicas too.
#[tokio::test]
async fn replicas_coordinate_keys_through_redis() {
    let redis = RedisServer::start();
    let shared = format!(
        "\n[shared]\nredis_url = \"{}\"\nlease_ttl_ms = 1500\ntimeout_ms = 200\n",
        redis.url()
    );
    let mock = MockConfig {
        token_delay: Duration::from_millis(30),
        ..MockConfig::default()
    };
    let a = stack(mock.clone(), &shared).await;
    let b = stack(mock, &shared).await;
    let body = chat("november oscar", false, 4);
    let first = post(&a, &body, "alice-key", Some("k-r")).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let on_b = post(&b, &body, "alice-key", Some("k-r")).await;
    assert_eq!(
        (on_b.status, on_b.body.as_str()),
        (200, first.body.as_str())
    );
    assert!(replayed(&on_b));
    assert_eq!(b.mock.request_count(), 0, "b generated nothing");
    let other = post(&b, &chat("papa", false, 4), "alice-key", Some("k-r")).await;
    assert_eq!(other.status, 422);
    // Running on a, asked on b.
    let long = chat("quebec romeo", true, 30);
    let (running, elsewhere) = tokio::join!(post(&a, &long, "alice-key", Some("k-run")), async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        post(&b, &long, "alice-key", Some("k-run")).await
    });
    assert_eq!(running.status, 200);
    assert_eq!(
        (elsewhere.status, elsewhere.error_code().as_deref()),
        (409, Some("idempotent_request_in_progress"))
    );
    assert_eq!(
        elsewhere.headers.get("retry-after").map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    // Once it finished, b replays it.
    let later = post(&b, &long, "alice-key", Some("k-run")).await;
    assert_eq!(later.body, running.body);
}

/// On Anthropic's Messages API the refusals take Anthropic's error shape.
#[tokio::test]
async fn refusals_on_messages_take_anthropics_shape() {
    let s = stack(MockConfig::default(), "").await;
    let send = |text: &str| {
        let body = json!({ "model": MODEL, "max_tokens": 2,
                           "messages": [{ "role": "user", "content": text }] });
        let url = format!("{}/v1/messages", s.url);
        async move {
            TestClient::default()
                .send_with(
                    "POST",
                    &url,
                    &[("x-api-key", "alice-key"), ("idempotency-key", "k-m")],
                    body.to_string(),
                    BOUND,
                )
                .await
        }
    };
    assert_eq!(send("tango").await.status, 200);
    let other = send("uniform").await;
    assert_eq!(other.status, 422);
    let v = other.json();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["code"], "idempotency_key_reused");
}

#[tokio::test]
async fn with_idempotency_off_the_header_is_refused() {
    let s = stack(MockConfig::default(), "\n[idempotency]\nenabled = false\n").await;
    let a = post(&s, &chat("sierra", false, 2), "alice-key", Some("k")).await;
    assert_eq!(
        (a.status, a.error_code().as_deref()),
        (400, Some("unsupported"))
    );
}

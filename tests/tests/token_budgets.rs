//! Tenants' token budgets (`tenants[].tokens_per_minute`) over HTTP, in front of the SGLang mock:
//! each request reserves its exact prompt and `max_tokens` at admission, so concurrent requests
//! cannot overshoot; the reservation is settled on what was delivered (a failed pair gives all of
//! it back); a request that does not fit gets 429 `rate_limited` with `Retry-After`; every answer
//! carries OpenAI's `x-ratelimit-*` headers, the requests trio too where a request rate is set.

use std::time::Duration;

use lockstep_tenancy::tenant::key_hash_hex;
use lockstep_tests::client::{self, Answer, Endpoint, TestClient};
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS};
use lockstep_tests::sglang_mock::{Fault, MockConfig};

const KEY: &str = "acme-key";

async fn stack(tokens_per_minute: u64, extra: &str, mock: MockConfig) -> Stack {
    let tenants = format!(
        "\n[[tenants]]\nname = \"acme\"\napi_keys_sha256 = [\"{}\"]\ntokens_per_minute = {tokens_per_minute}\n{extra}\n",
        key_hash_hex(KEY)
    );
    Stack::start_full(mock, &tenants, "", TEST_TIMEOUTS).await
}

async fn send(stack: &Stack, ep: Endpoint, stream: bool, max_tokens: u64) -> Answer {
    let (path, body) = client::request(ep, MODEL, "red green blue", stream, max_tokens, &[]);
    TestClient::default()
        .send_with(
            "POST",
            &format!("{}{path}", stack.url),
            &[("authorization", "Bearer acme-key")],
            body.to_string(),
            Duration::from_secs(20),
        )
        .await
}

fn header(a: &Answer, name: &str) -> Option<u64> {
    a.headers.get(name)?.to_str().ok()?.parse().ok()
}

/// Prompt + completion tokens of a non-streamed OpenAI answer.
fn used(a: &Answer) -> u64 {
    a.json()["usage"]["total_tokens"].as_u64().expect("usage")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_answer_says_what_is_left_and_a_failed_pair_gives_its_reservation_back() {
    // 120 a minute: 2 a second come back, a drift of a few tokens over this test.
    let s = stack(120, "", MockConfig::default()).await;
    let mut remaining = Vec::new();
    for ep in [Endpoint::Chat, Endpoint::Completions] {
        let a = send(&s, ep, false, 8).await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(header(&a, "x-ratelimit-limit-tokens"), Some(120));
        assert!(
            a.headers.contains_key("x-ratelimit-reset-tokens"),
            "{:?}",
            a.headers
        );
        // The request rate is not limited here: no requests trio.
        assert!(!a.headers.contains_key("x-ratelimit-limit-requests"));
        remaining.push((
            header(&a, "x-ratelimit-remaining-tokens").expect("remaining"),
            used(&a),
        ));
    }
    // Settled on what was used: the second answer's remaining is the first's less its use
    // (plus what came back meanwhile).
    let ((r1, u1), (r2, u2)) = (remaining[0], remaining[1]);
    assert!(
        r1 + u1 <= 120,
        "the first answer's tokens were not spent: {remaining:?}"
    );
    assert!(r2 + u2 >= r1 && r2 + u2 <= r1 + 10, "{remaining:?}");
    // A pair that fails before anything is delivered spends nothing.
    s.mock.set_fault(Fault::PrefillStatus(500));
    let failed = send(&s, Endpoint::Completions, false, 8).await;
    assert!(failed.status >= 500, "{}", failed.body);
    assert!(
        failed.headers.contains_key("x-ratelimit-remaining-tokens"),
        "errors carry them too"
    );
    s.mock.set_fault(Fault::None);
    let after = header(&failed, "x-ratelimit-remaining-tokens").expect("remaining");
    assert!(
        after >= r2 && after <= r2 + 10,
        "{after} after {r2}: the failed pair spent tokens"
    );
    // A streamed answer carries them too.
    let a = send(&s, Endpoint::Chat, true, 8).await;
    assert_eq!(a.status, 200);
    assert!(a.headers.contains_key("x-ratelimit-remaining-tokens"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_cannot_overshoot_the_budget() {
    // Each request reserves its prompt (a few tokens) + 40; 100 a minute hold two at once.
    let slow = MockConfig {
        token_delay: Duration::from_millis(25),
        ..MockConfig::default()
    };
    let s = stack(100, "", slow).await;
    let tasks: Vec<_> = (0..5)
        .map(|_| {
            let url = s.url.clone();
            tokio::spawn(async move {
                let (path, body) = client::request(
                    Endpoint::Completions,
                    MODEL,
                    "red green blue",
                    false,
                    40,
                    &[],
                );
                TestClient::default()
                    .send_with(
                        "POST",
                        &format!("{url}{path}"),
                        &[("authorization", "Bearer acme-key")],
                        body.to_string(),
                        Duration::from_secs(20),
                    )
                    .await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.expect("task"));
    }
    let ok = answers.iter().filter(|a| a.status == 200).count();
    let limited: Vec<&Answer> = answers.iter().filter(|a| a.status == 429).collect();
    assert!(
        (1..=2).contains(&ok),
        "{ok} served at once out of a budget for 2"
    );
    assert_eq!(
        ok + limited.len(),
        5,
        "{:?}",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    let spent: u64 = answers.iter().filter(|a| a.status == 200).map(used).sum();
    assert!(spent <= 100, "{spent} tokens spent out of 100");
    for a in limited {
        assert_eq!(
            a.error_code().as_deref(),
            Some("rate_limited"),
            "{}",
            a.body
        );
        let retry = header(a, "retry-after").expect("Retry-After");
        assert!((1..=60).contains(&retry), "{retry}");
        assert!(a.headers.contains_key("x-ratelimit-remaining-tokens"));
    }
    // More than the whole budget never fits, and says so.
    let a = send(&s, Endpoint::Completions, false, 500).await;
    assert_eq!(a.status, 429);
    assert!(a.body.contains("more than its whole budget"), "{}", a.body);
    assert!(s.wait_all_idle(Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_rate_adds_the_requests_trio() {
    let s = stack(
        100_000,
        "requests_per_second = 2\nburst = 4",
        MockConfig::default(),
    )
    .await;
    let a = send(&s, Endpoint::Completions, false, 4).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(header(&a, "x-ratelimit-limit-requests"), Some(4));
    assert_eq!(header(&a, "x-ratelimit-remaining-requests"), Some(3));
    assert!(a.headers.contains_key("x-ratelimit-reset-requests"));
    let b = send(&s, Endpoint::Completions, false, 4).await;
    let left = header(&b, "x-ratelimit-remaining-requests").expect("remaining");
    assert!(left <= 3, "{left}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_answers_carry_the_budget_in_their_metadata_and_refusals_say_when_to_retry() {
    use lockstep_proto::v1 as pb;
    use lockstep_proto::v1::lockstep_client::LockstepClient;
    let s = stack(100, "", MockConfig::default()).await;
    let channel = tonic::transport::Endpoint::from_shared(s.url.clone())
        .expect("endpoint")
        .connect()
        .await
        .expect("h2c connect");
    let mut client = LockstepClient::new(channel);
    let req = |max_tokens: u32| {
        let mut r = tonic::Request::new(pb::GenerateRequest {
            model: MODEL.into(),
            prompt: Some(pb::generate_request::Prompt::Text("red green blue".into())),
            sampling: Some(pb::SamplingParams {
                max_tokens: Some(max_tokens),
                ..Default::default()
            }),
        });
        r.metadata_mut().insert(
            "authorization",
            "Bearer acme-key".parse().expect("metadata"),
        );
        r
    };
    let resp = client.generate(req(8)).await.expect("served");
    let md = resp.metadata();
    assert_eq!(
        md.get("x-ratelimit-limit-tokens")
            .and_then(|v| v.to_str().ok()),
        Some("100")
    );
    let left: u64 = md
        .get("x-ratelimit-remaining-tokens")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("remaining");
    assert!(left < 100, "the reservation shows: {left}");
    drop(resp);
    // More than the whole budget: RESOURCE_EXHAUSTED with its stable code and retry time.
    let status = client.generate(req(500)).await.expect_err("never fits");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    use tonic_types::StatusExt;
    let info = status.get_details_error_info().expect("ErrorInfo");
    assert_eq!(info.reason, "rate_limited");
    assert!(info.metadata.contains_key("retry_after_s"), "{info:?}");
}

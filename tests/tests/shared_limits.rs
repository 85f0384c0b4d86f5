//! Tenant limits shared by several lockstep replicas through a real `redis-server` (`[shared]`),
//! in front of one SGLang mock: two replicas give a tenant one token budget, not two; three
//! share its concurrent pairs and request rate; with Redis killed each replica enforces its share
//! (`on_unavailable = "local"`) or refuses (`"deny"`), and with Redis back the limits are shared
//! again. (A replica killed -9 while holding reservations: `proxy/cli/tests/shared_replicas.rs`.)

use std::time::{Duration, Instant};

use lockstep_core::config::Config;
use lockstep_router::app::Lockstep;
use lockstep_tenancy::tenant::key_hash_hex;
use lockstep_tests::client::{self, Answer, Endpoint, TestClient};
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS, wait_for};
use lockstep_tests::redis::RedisServer;
use lockstep_tests::sglang_mock::MockConfig;

/// The first replica (with the mock) and the others, all from one configuration.
struct Replicas {
    first: Stack,
    more: Vec<Lockstep>,
}

impl Replicas {
    async fn start(n: usize, limits: &str, shared: &str, mock: MockConfig) -> Replicas {
        let server = format!(
            "\n[[tenants]]\nname = \"acme\"\napi_keys_sha256 = [\"{}\"]\n{limits}\n\n[shared]\n{shared}\n",
            key_hash_hex("acme-key")
        );
        let first = Stack::start_full(mock, &server, "", TEST_TIMEOUTS).await;
        let mut more = Vec::new();
        for _ in 1..n {
            let cfg = Config::load(&first.config_path).expect("config");
            more.push(Lockstep::start(cfg).await.expect("replica starts"));
        }
        Replicas { first, more }
    }

    fn url(&self, i: usize) -> String {
        match i {
            0 => self.first.url.clone(),
            _ => format!("http://{}", self.more[i - 1].http_addr),
        }
    }

    fn len(&self) -> usize {
        1 + self.more.len()
    }

    /// A metric's value on replica `i` (its first sample).
    async fn metric(&self, i: usize, name: &str) -> Option<f64> {
        let a = TestClient::default()
            .get(&format!("{}/metrics", self.url(i)), Duration::from_secs(5))
            .await;
        a.body
            .lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    /// Waits (10 s) until every replica's `name` is `value`.
    async fn all_report(&self, name: &str, value: f64) -> bool {
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            let mut all = true;
            for i in 0..self.len() {
                all &= self.metric(i, name).await == Some(value);
            }
            if all {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }
}

fn shared(redis: &RedisServer, extra: &str) -> String {
    format!(
        "redis_url = \"{}\"\nlease_ttl_ms = 1500\ntimeout_ms = 200\n{extra}",
        redis.url()
    )
}

async fn send(url: &str, max_tokens: u64) -> Answer {
    let (path, body) = client::request(
        Endpoint::Completions,
        MODEL,
        "red green blue",
        false,
        max_tokens,
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
}

fn header(a: &Answer, name: &str) -> Option<u64> {
    a.headers.get(name)?.to_str().ok()?.parse().ok()
}

fn used(a: &Answer) -> u64 {
    a.json()["usage"]["total_tokens"].as_u64().expect("usage")
}

/// Requests of `max_tokens` to the replicas in turn until one is refused: the tokens the
/// answers used, the answers per replica, and the refusal.
async fn spend_until_refused(
    r: &Replicas,
    on: &[usize],
    max_tokens: u64,
) -> (u64, Vec<u32>, Answer) {
    let mut spent = 0;
    let mut served = vec![0; r.len()];
    for k in 0..60 {
        let i = on[k % on.len()];
        let a = send(&r.url(i), max_tokens).await;
        if a.status != 200 {
            return (spent, served, a);
        }
        spent += used(&a);
        served[i] += 1;
    }
    panic!("never refused: {spent} tokens spent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_one_token_budget() {
    let redis = RedisServer::start();
    let r = Replicas::start(
        2,
        "tokens_per_minute = 600",
        &shared(&redis, ""),
        MockConfig::default(),
    )
    .await;
    let started = Instant::now();
    // The remaining tokens one replica reports go down with what the other spent.
    let a = send(&r.url(0), 40).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let after_a = header(&a, "x-ratelimit-remaining-tokens").expect("remaining");
    let b = send(&r.url(1), 40).await;
    assert_eq!(b.status, 200, "{}", b.body);
    let after_b = header(&b, "x-ratelimit-remaining-tokens").expect("remaining");
    assert!(
        after_b + used(&b) <= after_a + 10,
        "replica 2 does not see replica 1's spend: {after_a} then {after_b}"
    );
    assert_eq!(header(&b, "x-ratelimit-limit-tokens"), Some(600));
    let (spent, served, refused) = spend_until_refused(&r, &[0, 1], 40).await;
    let spent = spent + used(&a) + used(&b);
    // 10 tokens a second come back.
    let refill = (started.elapsed().as_secs_f64() * 10.0).ceil() as u64 + 1;
    assert!(
        spent <= 600 + refill,
        "{spent} tokens delivered against one budget of 600 (+{refill} refilled): the replicas did not share it"
    );
    assert!(spent >= 600 - 100, "refused early: only {spent} spent");
    assert!(served.iter().all(|&n| n >= 2), "{served:?}");
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.error_code().as_deref(), Some("rate_limited"));
    assert!(refused.body.contains("across replicas"), "{}", refused.body);
    assert!(refused.headers.contains_key("retry-after"));
    // Both replicas refuse now: the budget is one.
    for i in 0..2 {
        let a = send(&r.url(i), 40).await;
        assert_eq!(a.status, 429, "replica {i}: {}", a.body);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_share_concurrent_pairs() {
    let redis = RedisServer::start();
    let slow = MockConfig {
        token_delay: Duration::from_millis(100),
        ..MockConfig::default()
    };
    let r = Replicas::start(3, "max_concurrent_pairs = 2", &shared(&redis, ""), slow).await;
    assert!(r.all_report("lockstep_shared_replicas", 3.0).await);
    // Two long answers on replicas 1 and 2 hold both slots.
    let long: Vec<_> = [0, 1]
        .into_iter()
        .map(|i| {
            let url = r.url(i);
            tokio::spawn(async move { send(&url, 20).await })
        })
        .collect();
    let leases = || {
        redis
            .command("ZCARD lockstep:{acme}:pairs\r\n")
            .unwrap_or_default()
    };
    assert!(
        wait_for(Duration::from_secs(10), || leases().starts_with(":2")).await,
        "{}",
        leases()
    );
    let third = send(&r.url(2), 4).await;
    assert_eq!(third.status, 429, "{}", third.body);
    assert_eq!(third.error_code().as_deref(), Some("rate_limit_exceeded"));
    assert!(
        third
            .body
            .contains("2 concurrent requests already running across replicas"),
        "{}",
        third.body
    );
    for t in long {
        let a = t.await.expect("task");
        assert_eq!(a.status, 200, "{}", a.body);
    }
    // Their leases are released when their answers end.
    assert!(
        wait_for(Duration::from_secs(5), || leases().starts_with(":0")).await,
        "{}",
        leases()
    );
    assert_eq!(send(&r.url(2), 4).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_share_the_request_rate() {
    let redis = RedisServer::start();
    let r = Replicas::start(
        3,
        "requests_per_second = 1\nburst = 3",
        &shared(&redis, ""),
        MockConfig::default(),
    )
    .await;
    // One burst of 3 for all three replicas: what each answer says is left goes down across
    // them (one request comes back a second).
    let mut left = Vec::new();
    for i in 0..3 {
        let a = send(&r.url(i), 1).await;
        assert_eq!(a.status, 200, "replica {i}: {}", a.body);
        left.push(header(&a, "x-ratelimit-remaining-requests").expect("remaining requests"));
    }
    assert!(left[0] <= 2 && left[2] < left[0], "{left:?}");
    let mut refused = None;
    for k in 0..3 {
        let a = send(&r.url(k % 3), 1).await;
        if a.status == 429 {
            refused = Some(a);
            break;
        }
    }
    let refused = refused.expect("the shared request rate refused one");
    assert_eq!(refused.error_code().as_deref(), Some("rate_limit_exceeded"));
    assert!(
        refused
            .body
            .contains("request rate limit reached across replicas"),
        "{}",
        refused.body
    );
    assert!(refused.headers.contains_key("retry-after"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_each_replica_enforces_its_share_then_shares_again() {
    let mut redis = RedisServer::start();
    let r = Replicas::start(
        2,
        "tokens_per_minute = 1200",
        &shared(&redis, ""),
        MockConfig::default(),
    )
    .await;
    assert!(r.all_report("lockstep_shared_replicas", 2.0).await);
    assert!(r.all_report("lockstep_shared_store_up", 1.0).await);
    redis.kill();
    let started = Instant::now();
    // Replica 1 alone, Redis gone: its share is 1200 / 2.
    let (spent, served, refused) = spend_until_refused(&r, &[0], 40).await;
    let refill = (started.elapsed().as_secs_f64() * 10.0).ceil() as u64 + 1;
    assert!(
        spent <= 600 + refill && spent >= 600 - 100,
        "{spent} spent on one replica without the store (share 600, +{refill} refilled)"
    );
    assert!(served[0] >= 5, "{served:?}");
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(r.metric(0, "lockstep_shared_store_up").await, Some(0.0));
    assert!(r.metric(0, "lockstep_shared_store_errors_total").await >= Some(1.0));
    // Replica 2 has its own share.
    let b = send(&r.url(1), 40).await;
    assert_eq!(b.status, 200, "{}", b.body);
    // Redis back (empty): the heartbeat finds it, and the budget is the store's again.
    redis.restart();
    assert!(r.all_report("lockstep_shared_store_up", 1.0).await);
    let a = send(&r.url(0), 40).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let left = header(&a, "x-ratelimit-remaining-tokens").expect("remaining");
    assert!(
        left > 1000,
        "{left}: after the store came back the replica still answers from its local share"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_deny_a_lost_store_refuses_limited_tenants_until_it_is_back() {
    let mut redis = RedisServer::start();
    let r = Replicas::start(
        1,
        "tokens_per_minute = 100000",
        &shared(&redis, "on_unavailable = \"deny\""),
        MockConfig::default(),
    )
    .await;
    assert_eq!(send(&r.url(0), 8).await.status, 200);
    redis.kill();
    let a = send(&r.url(0), 8).await;
    assert_eq!(a.status, 503, "{}", a.body);
    assert_eq!(a.error_code().as_deref(), Some("shared_store_unavailable"));
    assert_eq!(
        a.headers.get("retry-after").and_then(|v| v.to_str().ok()),
        Some("1")
    );
    // Refused at admission: nothing reached the workers, and nothing is left running.
    assert!(r.first.wait_all_idle(Duration::from_secs(5)).await);
    redis.restart();
    assert!(r.all_report("lockstep_shared_store_up", 1.0).await);
    let a = send(&r.url(0), 8).await;
    assert_eq!(a.status, 200, "{}", a.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_call_on_one_replica_sees_the_budget_spent_on_another() {
    use lockstep_proto::v1 as pb;
    use lockstep_proto::v1::lockstep_client::LockstepClient;
    use tonic_types::StatusExt;
    let redis = RedisServer::start();
    let r = Replicas::start(
        2,
        "tokens_per_minute = 200",
        &shared(&redis, ""),
        MockConfig::default(),
    )
    .await;
    // Replica 1 spends most of the budget over HTTP.
    let a = send(&r.url(0), 150).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert!(used(&a) > 150, "{}", a.body);
    // Replica 2's gRPC call needs more than is left.
    let channel = tonic::transport::Endpoint::from_shared(r.url(1))
        .expect("endpoint")
        .connect()
        .await
        .expect("h2c connect");
    let mut client = LockstepClient::new(channel);
    let mut req = tonic::Request::new(pb::GenerateRequest {
        model: MODEL.into(),
        prompt: Some(pb::generate_request::Prompt::Text("red green blue".into())),
        sampling: Some(pb::SamplingParams {
            max_tokens: Some(100),
            ..Default::default()
        }),
    });
    req.metadata_mut().insert(
        "authorization",
        "Bearer acme-key".parse().expect("metadata"),
    );
    let status = client
        .generate(req)
        .await
        .expect_err("over the shared budget");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("across replicas"), "{status:?}");
    let info = status.get_details_error_info().expect("ErrorInfo");
    assert_eq!(info.reason, "rate_limited");
    assert!(info.metadata.contains_key("retry_after_s"), "{info:?}");
}

/// Several choices (`n`) hold one shared lease each: two choices fill a limit of two pairs
/// across the replicas, a third request is refused on the other replica meanwhile, and three
/// choices are refused whole, leaving no lease behind and nothing dispatched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_choice_holds_its_own_shared_lease() {
    let redis = RedisServer::start();
    let slow = MockConfig {
        token_delay: Duration::from_millis(100),
        ..MockConfig::default()
    };
    let r = Replicas::start(2, "max_concurrent_pairs = 2", &shared(&redis, ""), slow).await;
    assert!(r.all_report("lockstep_shared_replicas", 2.0).await);
    let leases = || {
        redis
            .command("ZCARD lockstep:{acme}:pairs\r\n")
            .unwrap_or_default()
    };
    let with_n = |url: String, n: u32, max_tokens: u64| async move {
        let body = serde_json::json!({"model": MODEL, "prompt": "red green blue",
                                      "max_tokens": max_tokens, "n": n});
        TestClient::default()
            .send_with(
                "POST",
                &format!("{url}/v1/completions"),
                &[("authorization", "Bearer acme-key")],
                body.to_string(),
                Duration::from_secs(20),
            )
            .await
    };
    let three = with_n(r.url(0), 3, 4).await;
    assert_eq!(three.status, 429, "{}", three.body);
    // The leases its first two choices took are released (in the background, as a dropped
    // claim's are).
    assert!(
        wait_for(Duration::from_secs(5), || leases().starts_with(":0")).await,
        "{}",
        leases()
    );
    assert_eq!(r.first.mock.request_count(), 0, "nothing dispatched");
    let two = tokio::spawn(with_n(r.url(1), 2, 20));
    assert!(
        wait_for(Duration::from_secs(10), || leases().starts_with(":2")).await,
        "{}",
        leases()
    );
    let other = send(&r.url(0), 4).await;
    assert_eq!(other.status, 429, "{}", other.body);
    let two = two.await.expect("task");
    assert_eq!(two.status, 200, "{}", two.body);
    assert_eq!(two.json()["choices"].as_array().map(Vec::len), Some(2));
    assert!(
        wait_for(Duration::from_secs(5), || leases().starts_with(":0")).await,
        "{}",
        leases()
    );
}

/// `rediss://`: the limits are shared through a real `redis-server` serving TLS only, its
/// certificate checked against `shared.ca_file`; a store whose certificate does not chain to it
/// is never used (the replica says the store is down).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rediss_store_is_reached_over_tls_and_its_certificate_checked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pem = |name: &str| {
        let key = rcgen::KeyPair::generate().expect("key");
        let params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).expect("params");
        let cert = params.self_signed(&key).expect("cert");
        let (c, k) = (
            dir.path().join(format!("{name}.pem")),
            dir.path().join(format!("{name}.key")),
        );
        std::fs::write(&c, cert.pem()).expect("write");
        std::fs::write(&k, key.serialize_pem()).expect("write");
        (c, k)
    };
    let (cert, key) = pem("redis");
    let (other, _) = pem("other");
    let redis = RedisServer::start_tls(&cert, &key);
    let with_ca = |ca: &std::path::Path| {
        format!(
            "redis_url = \"{}\"\nca_file = \"{}\"\nreplicas = 1\nlease_ttl_ms = 1500\ntimeout_ms = 200\non_unavailable = \"deny\"\n",
            redis.url(),
            ca.display()
        )
    };
    let r = Replicas::start(
        2,
        "tokens_per_minute = 120",
        &with_ca(&cert),
        MockConfig::default(),
    )
    .await;
    assert!(r.all_report("lockstep_shared_store_up", 1.0).await);
    // One budget over TLS: spent across both replicas, refused once it is gone.
    let (spent, served, refused) = spend_until_refused(&r, &[0, 1], 8).await;
    assert!(spent <= 120, "{spent} tokens spent of 120");
    assert!(served.iter().all(|n| *n > 0), "{served:?}");
    assert_eq!(refused.status, 429, "{}", refused.body);
    drop(r);
    // The wrong CA: the store is never reached, and `deny` refuses.
    let r = Replicas::start(
        1,
        "tokens_per_minute = 120",
        &with_ca(&other),
        MockConfig::default(),
    )
    .await;
    let a = send(&r.url(0), 8).await;
    assert_eq!(a.status, 503, "{}", a.body);
    assert_eq!(a.error_code().as_deref(), Some("shared_store_unavailable"));
}

/// `on_unavailable = "local"` with no replica count and a store never reached: nothing safe to
/// divide the limit by, so the tenant is refused as with `deny`, never given the whole limit on
/// every replica. With a count it enforces its share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_without_a_replica_count_refuses_until_the_store_has_been_seen() {
    let closed = format!(
        "redis_url = \"redis://127.0.0.1:{}/0\"\nlease_ttl_ms = 1500\ntimeout_ms = 200\n",
        lockstep_tests::gateway::free_port()
    );
    let r = Replicas::start(1, "tokens_per_minute = 600", &closed, MockConfig::default()).await;
    let a = send(&r.url(0), 8).await;
    assert_eq!(a.status, 503, "{}", a.body);
    assert_eq!(a.error_code().as_deref(), Some("shared_store_unavailable"));
    drop(r);
    let r = Replicas::start(
        1,
        "tokens_per_minute = 600",
        &format!("{closed}replicas = 4\n"),
        MockConfig::default(),
    )
    .await;
    let a = send(&r.url(0), 8).await;
    assert_eq!(a.status, 200, "{}", a.body);
    // Its share: a quarter of the budget, less this request's tokens (a budget that refills
    // slowly, 2.5 tokens a second, so a slow machine cannot refill it before the answer).
    let left = header(&a, "x-ratelimit-remaining-tokens").expect("remaining");
    assert!(left < 150, "{left}");
}

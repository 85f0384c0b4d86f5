//! A lockstep replica (the real binary) killed -9 while it holds a tenant's shared reservations
//! (`[shared]`, a real `redis-server`): its concurrent-pair lease outlives it only until
//! `lease_ttl_ms`, then another replica admits the tenant again; the tokens it reserved are never
//! given back (they may have been delivered), so the budget is never overshot.

use std::time::{Duration, Instant};

use lockstep_core::config::Config;
use lockstep_router::app::Lockstep;
use lockstep_tenancy::tenant::key_hash_hex;
use lockstep_tests::client::{self, Answer, Endpoint, TestClient};
use lockstep_tests::harness::{MODEL, config_text_with, wait_for};
use lockstep_tests::redis::RedisServer;
use lockstep_tests::sglang_mock::{MockConfig, PdMock};

mod common;

const TIMEOUTS: &str =
    "total_ms = 60000\nprefill_ms = 5000\nfirst_token_ms = 5000\nidle_ms = 5000\nabort_ms = 1000";

async fn send(url: &str, max_tokens: u64, bound: Duration) -> Answer {
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
            bound,
        )
        .await
}

/// A field of the tenant's token budget in the store.
fn budget_available(redis: &RedisServer) -> f64 {
    let reply = redis
        .command("HGET lockstep:{acme}:tokens a\r\n")
        .unwrap_or_default();
    // A bulk string: `$N\r\nVALUE\r\n`.
    reply
        .lines()
        .nth(1)
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(f64::NAN)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_holding_reservations_frees_its_slot_after_the_lease_and_keeps_its_tokens_spent()
 {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let tok = lockstep_tests::tokenizer::build();
    let tok_path = dir.path().join("tokenizer.json");
    std::fs::write(&tok_path, tok.to_string(true).expect("tokenizer")).expect("write");
    let slow = MockConfig {
        token_delay: Duration::from_millis(100),
        ..MockConfig::default()
    };
    let mock = PdMock::start(slow, tok).await.expect("mock starts");
    let server = format!(
        "\n[[tenants]]\nname = \"acme\"\napi_keys_sha256 = [\"{}\"]\nmax_concurrent_pairs = 1\ntokens_per_minute = 600\n\n[shared]\nredis_url = \"{}\"\nlease_ttl_ms = 1500\ntimeout_ms = 200\n",
        key_hash_hex("acme-key"),
        redis.url()
    );
    let text = config_text_with(&mock, &tok_path, &server, "", TIMEOUTS);
    let path = dir.path().join("lockstep.toml");
    std::fs::write(&path, &text).expect("write config");
    let cfg_arg = path.to_str().expect("utf8").to_string();
    let mut doomed = common::spawn(&["serve", "--config", &cfg_arg], "lockstep listening").await;
    let survivor = Lockstep::start(Config::load(&path).expect("config"))
        .await
        .expect("replica starts");
    let (doomed_url, survivor_url) = (
        format!("http://{}", doomed.addr),
        format!("http://{}", survivor.http_addr),
    );

    // The doomed replica holds the tenant's one slot and 300 + prompt tokens.
    let long = tokio::spawn(async move { send(&doomed_url, 300, Duration::from_secs(60)).await });
    let leases = || {
        redis
            .command("ZCARD lockstep:{acme}:pairs\r\n")
            .unwrap_or_default()
    };
    assert!(
        wait_for(Duration::from_secs(20), || leases().starts_with(":1")).await,
        "{}",
        leases()
    );
    let held_at = Instant::now();
    let before = budget_available(&redis);
    assert!(
        before < 600.0 - 300.0,
        "{before} tokens left: nothing reserved"
    );
    let refused = send(&survivor_url, 4, Duration::from_secs(10)).await;
    assert_eq!(refused.status, 429, "{}", refused.body);

    // Killed -9: nothing settles. Its lease lives until it expires, then the slot is free.
    doomed.child.kill().await.expect("kill");
    let killed = Instant::now();
    let _ = long.await;
    let mut admitted = None;
    while killed.elapsed() < Duration::from_secs(10) {
        let a = send(&survivor_url, 4, Duration::from_secs(10)).await;
        if a.status == 200 {
            admitted = Some(a);
            break;
        }
        assert_eq!(a.status, 429, "{}", a.body);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let waited = killed.elapsed();
    let a = admitted.expect("the dead replica's lease never expired");
    assert!(
        waited <= Duration::from_millis(1500 + 1500),
        "{waited:?}: longer than the lease"
    );
    // Its reservation stayed spent: what is left is what was left while it ran, plus what
    // refilled since (10 a second), less this request's use.
    let left: f64 = a
        .headers
        .get("x-ratelimit-remaining-tokens")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("remaining tokens");
    let refilled = held_at.elapsed().as_secs_f64() * 10.0 + 2.0;
    assert!(
        left <= before + refilled,
        "{left} left after the kill, {before} while the dead replica held its reservation (+{refilled:.0} refilled): its tokens came back"
    );
    survivor.shutdown().await;
}

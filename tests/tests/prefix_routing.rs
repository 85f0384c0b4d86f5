//! Prefix-aware routing end to end, on the real model: a router (`backend = "lockstep"`,
//! `policy = "prefix_aware"` on two prefill workers) sends one tenant's repeated prompt to the
//! same prefill worker, where it really hits that worker's prefix cache (the router's prediction
//! and the worker's report agree); another tenant's identical prompt is never predicted a hit
//! and never reuses the first tenant's pages.

use std::time::Duration;

use lockstep_core::config::Config;
use lockstep_router::app::Lockstep;
use lockstep_tenancy::tenant::key_hash_hex;
use lockstep_tests::client::TestClient;
use lockstep_tests::embedded::{model_path, small_worker};
use lockstep_worker::Role;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_prefix_stays_on_one_worker_and_really_hits_its_cache() {
    let Some(model) = model_path() else { return };
    let (p1, p2, d) = (
        small_worker(Role::Prefill, &model).await,
        small_worker(Role::Prefill, &model).await,
        small_worker(Role::Decode, &model).await,
    );
    let text = format!(
        r#"
[server]
http_listen = "127.0.0.1:0"

[[models]]
name = "m"
backend = "lockstep"
context_window = 512
kv_capacity_tokens = 768
default_max_tokens = 4

[models.engine]
gguf = "{model}"
fetch_pip = ""

[models.prefill]
policy = "prefix_aware"
workers = [{{ url = "http://{p1}" }}, {{ url = "http://{p2}" }}]

[models.decode]
workers = [{{ url = "http://{d}" }}]

[[tenants]]
name = "acme"
api_keys_sha256 = ["{acme}"]

[[tenants]]
name = "globex"
api_keys_sha256 = ["{globex}"]
"#,
        model = model.display(),
        p1 = p1.addr,
        p2 = p2.addr,
        d = d.addr,
        acme = key_hash_hex("acme-key"),
        globex = key_hash_hex("globex-key"),
    );
    let cfg = Config::parse(&text).expect("parses");
    assert!(cfg.problems().is_empty(), "{:?}", cfg.problems());
    let lockstep = Lockstep::start(cfg).await.expect("router starts");
    let url = format!("http://{}", lockstep.http_addr);
    let metric = |name: &'static str| {
        let url = format!("{url}/metrics");
        async move {
            let m = TestClient::default()
                .get(&url, Duration::from_secs(5))
                .await;
            m.body
                .lines()
                .filter(|l| l.starts_with(name))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
                .sum::<u64>()
        }
    };
    let ask = |key: &'static str, prompt: Vec<u32>| {
        let url = format!("{url}/v1/completions");
        async move {
            let body = json!({ "model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0 });
            let a = TestClient::default()
                .send_with(
                    "POST",
                    &url,
                    &[
                        ("authorization", &format!("Bearer {key}")),
                        ("content-type", "application/json"),
                    ],
                    body.to_string(),
                    Duration::from_secs(60),
                )
                .await;
            assert_eq!(a.status, 200, "{}", a.body);
        }
    };
    let prefill_hits = || {
        [&p1, &p2].map(|w| {
            w.service
                .engine_stats()
                .prefix_hit_tokens
                .load(std::sync::atomic::Ordering::Relaxed)
        })
    };
    // 49 tokens: the prefill computes 48, so two full pages (32 tokens) can come from the cache.
    let shared: Vec<u32> = (0..49).map(|i| 2000 + 3 * i).collect();
    for i in 0..3 {
        ask("acme-key", shared.clone()).await;
        let hits = prefill_hits();
        assert_eq!(hits.iter().sum::<usize>(), 32 * i, "request {i}: {hits:?}");
        assert!(
            hits.contains(&0),
            "request {i}: one worker holds the prefix: {hits:?}"
        );
    }
    assert_eq!(
        metric("lockstep_prefix_predicted_hit_tokens_total{").await,
        2 * 48
    );
    assert_eq!(metric("lockstep_worker_cached_tokens_total{").await, 2 * 32);
    // Another tenant, the same prompt: no predicted hit, no reused page.
    ask("globex-key", shared.clone()).await;
    assert_eq!(
        metric("lockstep_prefix_predicted_hit_tokens_total{").await,
        2 * 48
    );
    assert_eq!(prefill_hits().iter().sum::<usize>(), 64);
    lockstep.shutdown().await;
}

//! `policy = "prefix_events"`: several lockstep replicas route from the KV events the prefill
//! engines publish (ZMQ PUB with replay, msgpack, as SGLang 0.5.23 and vLLM 0.33.0 publish them:
//! `lockstep_tests::kv_publisher`), in front of SGLang PD mocks whose prefill servers keep their
//! own prefix caches. A replica sends a prompt to the worker that holds it even when another
//! replica put it there; one tenant's prefix never attracts another tenant's request; a gap the
//! replay fills keeps the index, one it cannot fill drops it. The hit-rate comparison with
//! `prefix_aware` over 1, 2 and 4 replicas is `hit_rate_table` (`bench/kv_events.sh`).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use lockstep_core::config::Config;
use lockstep_router::app::Lockstep;
use lockstep_tenancy::tenant::key_hash_hex;
use lockstep_tests::client::TestClient;
use lockstep_tests::engine_publisher::{self, Engine, EnginePublisher, free_ports};
use lockstep_tests::harness::{MODEL, TEST_TIMEOUTS, config_text_with};
use lockstep_tests::kv_publisher::{Dialect, EngineCache};
use lockstep_tests::sglang_mock::{MockConfig, PdMock};
use lockstep_tests::tokenizer;
use serde_json::json;

const BLOCK: usize = 16;
const WORDS: [&str; 16] = [
    "alpha", "bravo", "charlie", "delta", "echo", "golf", "hotel", "india", "kilo", "lima", "mike",
    "oscar", "papa", "romeo", "tango", "zulu",
];

/// Replicas of one configuration over one SGLang PD mock with `n` prefill servers, each with
/// its own cache.
struct Fleet {
    _mock: PdMock,
    caches: Vec<Arc<EngineCache>>,
    replicas: Vec<Lockstep>,
    /// Per replica, batches applied less batches sent, once every replica follows every
    /// publisher ([`following`]): from then on each replica applies every batch sent.
    offsets: Vec<f64>,
    path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

/// The engines' side of a fleet: their events' dialect, block (page) size and data-parallel
/// ranks.
#[derive(Clone, Copy)]
struct Engines {
    dialect: Dialect,
    block: usize,
    ranks: usize,
}

impl Fleet {
    async fn start(
        replicas: usize,
        workers: usize,
        dialect: Dialect,
        policy: &str,
        capacity: usize,
    ) -> Fleet {
        let engines = Engines {
            dialect,
            block: BLOCK,
            ranks: 1,
        };
        Self::start_with(replicas, workers, engines, policy, capacity).await
    }

    async fn start_with(
        replicas: usize,
        workers: usize,
        engines: Engines,
        policy: &str,
        capacity: usize,
    ) -> Fleet {
        Self::start_full(replicas, workers, engines, policy, capacity, None).await
    }

    /// [`Fleet::start_with`]; with `publishers`, each worker's KV events are followed there
    /// (`(PUB, replay)`) instead of at its cache's own publisher.
    async fn start_full(
        replicas: usize,
        workers: usize,
        engines: Engines,
        policy: &str,
        capacity: usize,
        publishers: Option<&[(String, String)]>,
    ) -> Fleet {
        let dir = tempfile::tempdir().expect("tempdir");
        let tok = tokenizer::build();
        let tok_path = dir.path().join("tokenizer.json");
        std::fs::write(&tok_path, tok.to_string(true).expect("tokenizer")).expect("write");
        let mut mock = PdMock::start(
            MockConfig {
                total_pages: 4096,
                ..MockConfig::default()
            },
            tok,
        )
        .await
        .expect("mock");
        let mut caches = Vec::new();
        let mut entries = Vec::new();
        for _ in 0..workers {
            let c = Arc::new(
                EngineCache::start_ranked(engines.dialect, engines.block, capacity, engines.ranks)
                    .await,
            );
            let url = mock.add_prefill(c.clone()).await.expect("prefill");
            let (endpoint, replay) = match publishers {
                Some(p) => p[entries.len()].clone(),
                None => (c.publisher().endpoint.clone(), c.publisher().replay.clone()),
            };
            let events = if policy == "prefix_events" {
                format!(", kv_events = \"{endpoint}\", kv_events_replay = \"{replay}\"")
            } else {
                String::new()
            };
            entries.push(format!(
                "{{ url = \"{url}\", bootstrap_port = 8998{events} }}"
            ));
            caches.push(c);
        }
        // One salt secret for every replica, so a tenant's blocks are one namespace across them.
        let server = format!(
            "cache_salt_secret = \"fleet-secret\"\n\n[[tenants]]\nname = \"acme\"\napi_keys_sha256 = [\"{}\"]\n\n[[tenants]]\nname = \"beta\"\napi_keys_sha256 = [\"{}\"]\n",
            key_hash_hex("acme-key"),
            key_hash_hex("beta-key"),
        );
        let text = config_text_with(
            &mock,
            &tok_path,
            &server,
            "context_window = 2048\nkv_capacity_tokens = 65536",
            TEST_TIMEOUTS,
        );
        let old = format!(
            "workers = [{{ url = \"{}\", bootstrap_port = 8998 }}]",
            mock.prefill_url()
        );
        assert!(text.contains(&old));
        let text = text
            .replace("context_window = 512\nkv_capacity_tokens = 1024\n", "")
            .replace(
                &old,
                &format!(
                    "policy = \"{policy}\"\nprefix = {{ block_tokens = {BLOCK} }}\n{}workers = [{}]",
                    if engines.ranks > 1 && policy == "prefix_events" {
                        format!("kv_events = {{ dp_size = {} }}\n", engines.ranks)
                    } else {
                        String::new()
                    },
                    entries.join(", ")
                ),
            );
        let path = dir.path().join("lockstep.toml");
        std::fs::write(&path, &text).expect("config");
        let mut started = Vec::new();
        for _ in 0..replicas {
            let cfg = Config::load(&path).expect("config loads");
            started.push(Lockstep::start(cfg).await.expect("replica starts"));
        }
        Fleet {
            _mock: mock,
            caches,
            offsets: vec![0.0; started.len()],
            replicas: started,
            path,
            _dir: dir,
        }
    }

    fn url(&self, i: usize) -> String {
        format!(
            "http://{}",
            self.replicas[i % self.replicas.len()].http_addr
        )
    }

    /// One completion on replica `i` for `tenant`; the answer must be a 200.
    async fn complete(&self, i: usize, tenant: &str, prompt: &str) {
        let a = TestClient::default()
            .send_with(
                "POST",
                &format!("{}/v1/completions", self.url(i)),
                &[("authorization", &format!("Bearer {tenant}-key"))],
                json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}).to_string(),
                Duration::from_secs(20),
            )
            .await;
        assert_eq!(a.status, 200, "{}", a.body);
    }

    async fn metric(&self, i: usize, name: &str) -> f64 {
        let a = TestClient::default()
            .get(&format!("{}/metrics", self.url(i)), Duration::from_secs(5))
            .await;
        a.body
            .lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .filter(|l| !l.contains("side=\"decode\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    async fn applied(&self, i: usize) -> f64 {
        self.metric(
            i,
            "lockstep_kv_event_batches_total{model=\"mock-pd\",result=\"applied\",side=\"prefill\"}",
        )
        .await
    }

    /// Waits until every replica applied every batch sent so far.
    async fn sync(&self) {
        for i in 0..self.replicas.len() {
            let want = self.batches_sent() as f64 + self.offsets[i];
            let mut seen = 0.0;
            for _ in 0..400 {
                seen = self.applied(i).await;
                if seen >= want {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            assert!(
                seen >= want,
                "replica {i} applied {seen} KV event batches, not {want}"
            );
        }
    }

    fn hits(&self) -> Vec<u64> {
        self.caches
            .iter()
            .map(|c| c.hit_tokens.load(Ordering::Relaxed))
            .collect()
    }

    fn hit_rate(&self) -> f64 {
        let (p, h) = self.caches.iter().fold((0, 0), |(p, h), c| {
            (
                p + c.prompt_tokens.load(Ordering::Relaxed),
                h + c.hit_tokens.load(Ordering::Relaxed),
            )
        });
        h as f64 / p.max(1) as f64
    }

    fn batches_sent(&self) -> u64 {
        self.caches
            .iter()
            .flat_map(|c| &c.publishers)
            .map(|p| p.sent.load(Ordering::Relaxed))
            .sum()
    }
}

/// A prompt of `blocks` whole blocks from `seed` (the word tokenizer: one word, one token).
fn prompt(seed: usize, blocks: usize) -> String {
    (0..blocks * BLOCK)
        .map(|i| WORDS[(seed * 7 + i * (seed % 5 + 1) + i / 3) % WORDS.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

/// Waits until every replica is following every publisher (a PUB drops what it sends before a
/// subscriber is connected): every cache publishes until every replica applied one batch of each.
async fn following(f: &mut Fleet) {
    for _ in 0..100 {
        for c in &f.caches {
            c.clear();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut all = true;
        let publishers: usize = f.caches.iter().map(|c| c.publishers.len()).sum();
        for i in 0..f.replicas.len() {
            all &= f.applied(i).await >= publishers as f64;
        }
        if all {
            // What was in flight lands; then every batch sent reaches every replica.
            tokio::time::sleep(Duration::from_millis(200)).await;
            for i in 0..f.replicas.len() {
                f.offsets[i] = f.applied(i).await - f.batches_sent() as f64;
            }
            return;
        }
    }
    panic!("the replicas never followed every KV event publisher");
}

async fn warmed_elsewhere_then_followed(dialect: Dialect) {
    let engines = Engines {
        dialect,
        block: BLOCK,
        ranks: 1,
    };
    warmed_elsewhere_then_followed_on(engines).await;
}

async fn warmed_elsewhere_then_followed_on(engines: Engines) {
    let mut f = Fleet::start_with(2, 4, engines, "prefix_events", 10_000).await;
    following(&mut f).await;
    // Replica 0 puts six prompts on the workers; replica 1 hears of them from the workers'
    // engines, and sends each conversation, one turn longer, to the worker holding it. (In
    // reverse order: replica 1's own guesses, which never saw these prompts, would all be
    // wrong.)
    for seed in 0..6 {
        f.complete(0, "acme", &prompt(seed, 4)).await;
    }
    f.sync().await;
    for seed in (0..6).rev() {
        let before = f.hits();
        let p = prompt(seed, 4);
        f.complete(1, "acme", &format!("{p} {}", prompt(seed + 100, 1)))
            .await;
        let after = f.hits();
        let gained: u64 = after.iter().zip(&before).map(|(a, b)| a - b).sum();
        assert!(
            gained >= 3 * BLOCK as u64,
            "prompt {seed}: replica 1 did not route to the worker holding it: hits {before:?} -> {after:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_routes_to_the_worker_another_replica_warmed_sglang_events() {
    warmed_elsewhere_then_followed(Dialect::Sglang).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_routes_to_the_worker_another_replica_warmed_vllm_events() {
    warmed_elsewhere_then_followed(Dialect::Vllm).await;
}

/// vLLM started with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`: sha256 bytes for hashes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_events_with_bytes_hashes_route_alike() {
    warmed_elsewhere_then_followed(Dialect::VllmBytes).await;
}

/// SGLang's default page size is 1: one `BlockStored` per token, each a block of one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_pages_of_one_token_route_alike() {
    warmed_elsewhere_then_followed_on(Engines {
        dialect: Dialect::Sglang,
        block: 1,
        ranks: 1,
    })
    .await;
}

/// The ids lockstep sends for `text` (the word tokenizer: one word, one token).
fn ids(text: &str) -> Vec<u32> {
    tokenizer::build()
        .encode(text, false)
        .expect("encodes")
        .get_ids()
        .to_vec()
}

/// Which cache served the last request (its prompt tokens grew).
fn served(f: &Fleet, before: &[u64]) -> usize {
    let now: Vec<u64> = f
        .caches
        .iter()
        .map(|c| c.prompt_tokens.load(Ordering::Relaxed))
        .collect();
    now.iter()
        .zip(before)
        .position(|(a, b)| a > b)
        .expect("a worker served it")
}

fn prompts_served(f: &Fleet) -> Vec<u64> {
    f.caches
        .iter()
        .map(|c| c.prompt_tokens.load(Ordering::Relaxed))
        .collect()
}

/// Blocks filled by generated tokens (both engines cache a finished request's output) attract
/// the conversation's next turn: one worker holds the first turn's prompt, the other the prompt
/// and its answer; the next turn goes to the second and finds all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_of_generated_tokens_attract_the_next_turn() {
    for dialect in [Dialect::Sglang, Dialect::Vllm] {
        let mut f = Fleet::start(1, 2, dialect, "prefix_events", 10_000).await;
        following(&mut f).await;
        let (p, answer) = (prompt(21, 3), prompt(22, 2));
        let before = prompts_served(&f);
        f.complete(0, "acme", &p).await;
        let w = served(&f, &before);
        let (sent, salt) = f.caches[w].last().expect("served");
        assert_eq!(sent, ids(&p));
        // The other worker ran the turn to its end: prompt and answer in its cache.
        let x = 1 - w;
        let whole: Vec<u32> = sent.iter().copied().chain(ids(&answer)).collect();
        f.caches[x].store(0, &whole, salt.as_deref());
        f.sync().await;
        let hits = f.hits();
        let before = prompts_served(&f);
        f.complete(0, "acme", &format!("{p} {answer} {}", prompt(23, 1)))
            .await;
        assert_eq!(
            served(&f, &before),
            x,
            "{dialect:?}: not sent to the answer's blocks"
        );
        assert_eq!(
            f.hits()[x] - hits[x],
            whole.len() as u64,
            "{dialect:?}: prompt and answer found"
        );
    }
}

/// Data parallelism (`kv_events = { dp_size = 2 }`): each rank publishes on its own ports and
/// is followed; the engine deals requests to ranks itself, so a worker counts as holding a
/// prefix only when every rank holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_data_parallel_rank_is_followed_and_a_prefix_counts_when_every_rank_holds_it() {
    let engines = Engines {
        dialect: Dialect::Sglang,
        block: BLOCK,
        ranks: 2,
    };
    let mut f = Fleet::start_with(1, 2, engines, "prefix_events", 10_000).await;
    following(&mut f).await;
    let predicted = "lockstep_prefix_predicted_hit_tokens_total";
    let p = prompt(31, 4);
    let before = prompts_served(&f);
    f.complete(0, "acme", &p).await;
    let w = served(&f, &before);
    f.sync().await;
    // On rank 0 of `w` only: not a hit the engine can promise.
    let was = f.metric(0, predicted).await;
    f.complete(0, "acme", &format!("{p} {}", prompt(32, 1)))
        .await;
    assert_eq!(
        f.metric(0, predicted).await,
        was,
        "a prefix on one rank was counted as the worker's"
    );
    f.sync().await;
    // Every rank of `w` holds it now.
    let (sent, salt) = f.caches[w].last().expect("served");
    for rank in 0..2 {
        f.caches[w].store(rank, &sent[..p.split(' ').count()], salt.as_deref());
    }
    f.sync().await;
    let before = prompts_served(&f);
    f.complete(0, "acme", &format!("{p} {}", prompt(33, 1)))
        .await;
    assert_eq!(served(&f, &before), w);
    assert!(
        f.metric(0, predicted).await >= was + (3 * BLOCK) as f64,
        "a prefix on every rank was not counted"
    );
    let rank_batches: Vec<u64> = f.caches[w]
        .publishers
        .iter()
        .map(|p| p.sent.load(Ordering::Relaxed))
        .collect();
    assert!(rank_batches.iter().all(|n| *n > 1), "{rank_batches:?}");
}

/// Another tenant's identical prompt finds nothing of the first tenant's blocks: the index is
/// keyed by the salt each engine reports, so the prediction stays at zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_prefix_never_attracts_anothers_request() {
    let mut f = Fleet::start(2, 2, Dialect::Sglang, "prefix_events", 10_000).await;
    following(&mut f).await;
    let p = prompt(3, 6);
    f.complete(0, "acme", &p).await;
    f.sync().await;
    let predicted = "lockstep_prefix_predicted_hit_tokens_total";
    let before = f.metric(1, predicted).await;
    f.complete(1, "beta", &p).await;
    assert_eq!(
        f.metric(1, predicted).await,
        before,
        "beta's request was predicted a hit on acme's blocks"
    );
    f.complete(1, "acme", &p).await;
    assert!(
        f.metric(1, predicted).await >= before + (5 * BLOCK) as f64,
        "acme's own prompt was not predicted held"
    );
}

/// A replica started after the workers filled their caches asks the replay for everything
/// from the first batch on its first message, and then holds what the others hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_started_late_learns_the_caches_from_the_replay() {
    let mut f = Fleet::start(1, 2, Dialect::Sglang, "prefix_events", 10_000).await;
    following(&mut f).await;
    for seed in 0..4 {
        f.complete(0, "acme", &prompt(seed, 4)).await;
    }
    f.sync().await;
    let blocks = "lockstep_kv_event_index_blocks{model=\"mock-pd\",side=\"prefill\"}";
    let held = f.metric(0, blocks).await;
    assert!(held >= 16.0, "{held}");
    let cfg = Config::load(&f.path).expect("config");
    f.replicas
        .push(Lockstep::start(cfg).await.expect("late replica"));
    let mut same = false;
    for i in 0..50u32 {
        // Something new on each worker, so the late replica hears from both.
        for (k, c) in f.caches.iter().enumerate() {
            let base = 5000 + (i * 2 + k as u32) * BLOCK as u32;
            c.serve(
                &(base..base + BLOCK as u32).collect::<Vec<_>>(),
                Some("00000000000000aa"),
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (old, late) = (f.metric(0, blocks).await, f.metric(1, blocks).await);
        if old == late && late > held {
            same = true;
            break;
        }
    }
    assert!(same, "the late replica never held what the first one holds");
}

/// A message lost on the wire is fetched from the replay ROUTER and the index kept; a gap no
/// replay can fill drops that worker's index (never trusted), which then rebuilds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gaps_are_filled_from_the_replay_or_drop_the_index() {
    let mut f = Fleet::start(1, 1, Dialect::Sglang, "prefix_events", 10_000).await;
    following(&mut f).await;
    let c = &f.caches[0];
    let blocks = "lockstep_kv_event_index_blocks{model=\"mock-pd\",side=\"prefill\"}";
    let gaps = "lockstep_kv_event_gaps_total{model=\"mock-pd\",side=\"prefill\"}";
    let salt = Some("00000000000000aa");
    let gaps_before = f.metric(0, gaps).await;
    // Lost, then the next one shows the gap: the replay returns it.
    c.publisher().lose_next();
    c.serve(&(0..32).collect::<Vec<u32>>(), salt);
    c.serve(&(100..132).collect::<Vec<u32>>(), salt);
    f.sync().await;
    // The lost batch is not counted as sent: wait for it too.
    assert!(
        wait_for_metric(&f, blocks, 4.0).await,
        "the replayed batch was not applied"
    );
    assert_eq!(f.metric(0, gaps).await, gaps_before + 1.0);
    // A gap no replay can fill: the index is dropped, then holds what follows.
    c.publisher().skip(1);
    c.serve(&(200..216).collect::<Vec<u32>>(), salt);
    f.sync().await;
    assert_eq!(f.metric(0, gaps).await, gaps_before + 2.0);
    assert_eq!(
        f.metric(0, blocks).await,
        1.0,
        "a worker's index survived a gap it could not fill"
    );
}

async fn wait_for_metric(f: &Fleet, name: &str, want: f64) -> bool {
    for _ in 0..200 {
        if f.metric(0, name).await == want {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    false
}

/// The hit rate the workers report, `prefix_aware` against `prefix_events`, with 1, 2 and 4
/// replicas on a multi-turn, multi-tenant workload; the requests go to the replicas in turn.
async fn hit_rate(replicas: usize, policy: &str, conversations: usize, turns: usize) -> f64 {
    let mut f = Fleet::start(replicas, 4, Dialect::Sglang, policy, 4096).await;
    if policy == "prefix_events" {
        following(&mut f).await;
    }
    let mut n = 0;
    for turn in 0..turns {
        for c in 0..conversations {
            let tenant = if c % 2 == 0 { "acme" } else { "beta" };
            // The tenant's system prompt (one block), then the conversation so far (three
            // blocks a turn).
            let history: Vec<String> = (0..=turn).map(|t| prompt(1000 + c * 50 + t, 3)).collect();
            let p = format!("{} {}", prompt(c % 2, 1), history.join(" "));
            f.complete(n, tenant, &p).await;
            n += 1;
            if policy == "prefix_events" {
                // The engines publish as they go; a router hears within milliseconds.
                f.sync().await;
            }
        }
    }
    f.hit_rate()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_four_replicas_events_keep_the_hit_rate_that_guesses_lose() {
    let aware = hit_rate(4, "prefix_aware", 7, 4).await;
    let events = hit_rate(4, "prefix_events", 7, 4).await;
    eprintln!("4 replicas: prefix_aware hit rate {aware:.3}, prefix_events {events:.3}");
    assert!(
        events > aware + 0.05,
        "prefix_events {events:.3} against prefix_aware {aware:.3}"
    );
}

/// `bench/kv_events.sh`: the table for 1, 2 and 4 replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: bench/kv_events.sh"]
async fn hit_rate_table() {
    println!("| replicas | prefix_aware | prefix_events |");
    println!("| --- | --- | --- |");
    for r in [1, 2, 4] {
        let aware = hit_rate(r, "prefix_aware", 15, 6).await;
        let events = hit_rate(r, "prefix_events", 15, 6).await;
        println!("| {r} | {aware:.3} | {events:.3} |");
    }
}

/// A publisher that completes the ZMTP handshake as a PUB, then announces a frame of `size`.
async fn oversized_publisher(size: u64) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        // Every connection the router makes gets the same: it reconnects after each.
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut greeting = [0u8; 64];
                s.read_exact(&mut greeting).await.ok()?;
                let mut mine = [0u8; 64];
                mine[0] = 0xFF;
                mine[9] = 0x7F;
                mine[10] = 3;
                mine[12..16].copy_from_slice(b"NULL");
                s.write_all(&mine).await.ok()?;
                let mut head = [0u8; 2];
                s.read_exact(&mut head).await.ok()?;
                let mut ready = vec![0u8; usize::from(head[1])];
                s.read_exact(&mut ready).await.ok()?;
                let body = b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB";
                s.write_all(&[0x04, body.len() as u8]).await.ok()?;
                s.write_all(body).await.ok()?;
                let mut frame = vec![0x02];
                frame.extend_from_slice(&size.to_be_bytes());
                s.write_all(&frame).await.ok()?;
                tokio::time::sleep(Duration::from_secs(30)).await;
                Some(())
            });
        }
    });
    format!("tcp://{addr}")
}

/// A KV event publisher that announces a message of 2^47 bytes (which made the zeromq crate
/// reserve it and abort the process) is dropped and counted; lockstep keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_announcing_a_huge_message_is_dropped_and_counted() {
    let (_dir, tok_path, mock) =
        lockstep_tests::harness::mock_with_tokenizer(MockConfig::default()).await;
    let publisher = oversized_publisher(1 << 47).await;
    let text = config_text_with(&mock, &tok_path, "", "", TEST_TIMEOUTS);
    let old = format!(
        "workers = [{{ url = \"{}\", bootstrap_port = 8998 }}]",
        mock.prefill_url()
    );
    assert!(text.contains(&old));
    let text = text.replace(
        &old,
        &format!(
            "policy = \"prefix_events\"\nkv_events = {{ max_message_bytes = 65536 }}\nworkers = [{{ url = \"{}\", bootstrap_port = 8998, kv_events = \"{publisher}\" }}]",
            mock.prefill_url()
        ),
    );
    let cfg = Config::parse(&text).expect("config");
    assert!(cfg.problems().is_empty(), "{:?}", cfg.problems());
    let lockstep = Lockstep::start(cfg).await.expect("starts");
    let url = format!("http://{}", lockstep.http_addr);
    let line = "lockstep_kv_event_batches_total{model=\"mock-pd\",result=\"too_large\",side=\"prefill\"} 1";
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let m = TestClient::default()
            .get(&format!("{url}/metrics"), Duration::from_secs(5))
            .await;
        if m.body.contains(line) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{line} not in\n{}",
            m.body
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let a = TestClient::default()
        .send_with(
            "POST",
            &format!("{url}/v1/completions"),
            &[],
            json!({"model": MODEL, "prompt": "hello there", "max_tokens": 2}).to_string(),
            Duration::from_secs(20),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
}

/// The events one prompt's blocks make on `engine`, as its code builds them (SGLang
/// `mem_cache/events.py` `record_store`: one event per page, the salt named; vLLM
/// `v1/core/block_pool.py`: one event, integer hashes, the salt in the first block's keys).
fn engine_events(
    engine: Engine,
    ids: &[u32],
    salt: &str,
    first_hash: i64,
) -> Vec<serde_json::Value> {
    let blocks: Vec<&[u32]> = ids.chunks_exact(BLOCK).collect();
    match engine {
        Engine::Sglang => {
            let mut parent = serde_json::Value::Null;
            blocks
                .iter()
                .enumerate()
                .map(|(i, b)| {
                    let h = first_hash - i as i64;
                    let e = json!({"type": "BlockStored", "block_hashes": [h],
                        "parent_block_hash": parent, "token_ids": b, "block_size": BLOCK,
                        "lora_id": null, "medium": "GPU", "cache_salt": salt});
                    parent = json!(h);
                    e
                })
                .collect()
        }
        Engine::Vllm => {
            let hashes: Vec<u64> = (0..blocks.len())
                .map(|i| (1u64 << 63) + first_hash.unsigned_abs() + i as u64)
                .collect();
            let mut keys = vec![serde_json::Value::Null; blocks.len()];
            keys[0] = json!([salt]);
            vec![json!({"type": "BlockStored", "block_hashes": hashes,
                "parent_block_hash": null, "token_ids": ids[..blocks.len() * BLOCK],
                "block_size": BLOCK, "lora_id": null, "medium": "GPU", "lora_name": null,
                "extra_keys": keys, "group_idx": 0})]
        }
    }
}

/// Two workers of two data-parallel ranks each, every rank's publisher the engine's own code
/// (over libzmq), on the ports the engine's `offset_endpoint_port` gives each rank.
async fn engine_publishers(engine: Engine, src: &std::path::Path) -> Vec<Vec<EnginePublisher>> {
    let mut workers = Vec::new();
    for _ in 0..2 {
        let mut tries = 0;
        let ranks = loop {
            // PUB at p, p + 1; replay at p + 2, p + 3.
            let p = free_ports(4);
            let mut ranks = Vec::new();
            for rank in 0..2 {
                match EnginePublisher::start(engine, src, p, p + 2, rank).await {
                    Ok(x) => ranks.push(x),
                    Err(e) => {
                        eprintln!("publisher on {p}: {e}; again");
                        break;
                    }
                }
            }
            tries += 1;
            if ranks.len() == 2 || tries == 5 {
                break ranks;
            }
        };
        assert_eq!(ranks.len(), 2, "publishers did not start");
        workers.push(ranks);
    }
    workers
}

/// Publishes `AllBlocksCleared` on every publisher until two rounds in a row are each applied
/// whole: every rank is followed.
async fn following_engines(f: &Fleet, pubs: &mut [Vec<EnginePublisher>]) {
    let n = pubs.iter().map(Vec::len).sum::<usize>() as f64;
    let mut whole = 0;
    for _ in 0..100 {
        let before = f.applied(0).await;
        for p in pubs.iter_mut().flatten() {
            p.publish(vec![json!({"type": "AllBlocksCleared"})]).await;
        }
        let mut got = 0.0;
        for _ in 0..20 {
            got = f.applied(0).await - before;
            if got >= n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        whole = if got == n { whole + 1 } else { 0 };
        if whole == 2 {
            return;
        }
    }
    panic!("lockstep never followed every rank's publisher");
}

async fn the_engines_own_publishers(engine: Engine) {
    let Some(src) = engine_publisher::sources() else {
        return;
    };
    let mut pubs = engine_publishers(engine, &src).await;
    let endpoints: Vec<(String, String)> = pubs
        .iter()
        .map(|ranks| (ranks[0].endpoint.clone(), ranks[0].replay.clone()))
        .collect();
    assert!(
        pubs[0][1].endpoint.ends_with(&format!(
            ":{}",
            endpoints[0]
                .0
                .rsplit(':')
                .next()
                .and_then(|p| p.parse::<u16>().ok())
                .expect("port")
                + 1
        )),
        "the engine moved rank 1's port by one"
    );
    let engines = Engines {
        dialect: Dialect::Sglang,
        block: BLOCK,
        ranks: 2,
    };
    let f = Fleet::start_full(1, 2, engines, "prefix_events", 10_000, Some(&endpoints)).await;
    following_engines(&f, &mut pubs).await;
    // The tenant's salt, as lockstep sends it.
    f.complete(0, "acme", &prompt(40, 1)).await;
    let salt = f
        .caches
        .iter()
        .find_map(|c| c.last())
        .and_then(|(_, s)| s)
        .expect("a salt");
    let p = prompt(41, 4);
    let events = engine_events(engine, &ids(&p), &salt, -1000);
    let predicted = "lockstep_prefix_predicted_hit_tokens_total";
    // On rank 1 of worker 0 alone: the engine may deal the request to rank 0.
    let applied = f.applied(0).await;
    pubs[0][1].publish(events.clone()).await;
    assert!(wait_applied(&f, applied + 1.0).await);
    let was = f.metric(0, predicted).await;
    f.complete(0, "acme", &format!("{p} {}", prompt(42, 1)))
        .await;
    assert_eq!(
        f.metric(0, predicted).await,
        was,
        "{engine:?}: one rank counted"
    );
    // On both ranks: the worker holds it, the request goes there.
    let applied = f.applied(0).await;
    pubs[0][0].publish(events).await;
    assert!(wait_applied(&f, applied + 1.0).await);
    let before = prompts_served(&f);
    f.complete(0, "acme", &format!("{p} {}", prompt(43, 1)))
        .await;
    assert_eq!(
        served(&f, &before),
        0,
        "{engine:?}: not sent to the worker holding it"
    );
    assert!(
        f.metric(0, predicted).await >= was + (4 * BLOCK) as f64,
        "{engine:?}: the prompt's blocks were not predicted held"
    );
    // A replica started now learns every rank's cache from its replay ROUTER (libzmq's) on
    // the first message it hears from each.
    let blocks = "lockstep_kv_event_index_blocks{model=\"mock-pd\",side=\"prefill\"}";
    let held = f.metric(0, blocks).await;
    let late = Lockstep::start(Config::load(&f.path).expect("config"))
        .await
        .expect("late replica");
    let late_url = format!("http://{}/metrics", late.http_addr);
    let mut learned = false;
    for i in 0..50i64 {
        // Something new on every rank, so the late replica hears from each.
        for (k, p) in pubs.iter_mut().flatten().enumerate() {
            let extra = prompt(500 + i as usize * 4 + k, 1);
            p.publish(engine_events(
                engine,
                &ids(&extra),
                &salt,
                -5000 - i * 100 - k as i64 * 10,
            ))
            .await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = f.metric(0, blocks).await;
        let body = TestClient::default()
            .get(&late_url, Duration::from_secs(5))
            .await
            .body;
        let theirs: f64 = body
            .lines()
            .filter(|l| l.starts_with(blocks))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        if theirs == now && now > held {
            learned = true;
            break;
        }
    }
    assert!(
        learned,
        "{engine:?}: the late replica never held what the first holds"
    );
}

async fn wait_applied(f: &Fleet, want: f64) -> bool {
    for _ in 0..200 {
        if f.applied(0).await >= want {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    false
}

/// SGLang 0.5.23's own publisher code (libzmq, msgspec), two ranks a worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglangs_own_publisher_feeds_every_rank_and_its_replay() {
    the_engines_own_publishers(Engine::Sglang).await;
}

/// vLLM 0.33.0's own publisher code (libzmq, msgspec), two ranks a worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_own_publisher_feeds_every_rank_and_its_replay() {
    the_engines_own_publishers(Engine::Vllm).await;
}

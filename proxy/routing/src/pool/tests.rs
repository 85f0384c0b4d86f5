//! The worker pool's tests: pair limits, policies, the prefix index.

use super::*;
use std::sync::atomic::AtomicU64;

use lockstep_core::config::HealthConfig;

use lockstep_core::ids::Side;

/// A pool of workers on these loopback ports, each taking at most `max` pairs (0: any number).
fn on_ports(policy: PolicyKind, ports: &[u16], max: usize) -> WorkerPool {
    WorkerPool::new(&PoolConfig {
        policy,
        max_pairs_per_worker: max,
        workers: ports
            .iter()
            .map(|p| WorkerConfig {
                url: format!("http://127.0.0.1:{p}"),
                bootstrap_port: None,
                bootstrap_host: None,
                kv_events: None,
                kv_events_replay: None,
            })
            .collect(),
        ..PoolConfig::default()
    })
}

#[test]
fn a_pair_limit_per_worker_is_never_exceeded() {
    let p = WorkerPool::new(&PoolConfig {
        max_pairs_per_worker: 2,
        ..PoolConfig {
            policy: PolicyKind::LeastLoad,
            workers: (0..2)
                .map(|i| WorkerConfig {
                    url: format!("http://127.0.0.1:{}", 2000 + i),
                    bootstrap_port: None,
                    bootstrap_host: None,
                    kv_events: None,
                    kv_events_replay: None,
                })
                .collect(),
            ..PoolConfig::default()
        }
    });
    let held: Vec<LoadGuard> = (0..4)
        .map(|_| p.pick(None, None).expect("a slot"))
        .collect();
    assert!(p.workers().iter().all(|w| w.in_flight() == 2));
    assert!(p.pick(None, None).is_none() && p.all_busy());
    drop(held);
    assert!(!p.all_busy() && p.pick(None, None).is_some());
    // Concurrent takers never exceed the limit.
    let w = p.workers()[0].clone();
    let got: Vec<Option<LoadGuard>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..16)
            .map(|_| s.spawn(|| LoadGuard::try_new(w.clone(), 3)))
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    assert_eq!(got.iter().filter(|g| g.is_some()).count(), 3);
}

fn pool(n: usize, policy: PolicyKind) -> WorkerPool {
    let ports: Vec<u16> = (1000..).take(n).collect();
    on_ports(policy, &ports, 0)
}

#[test]
fn round_robin_cycles_and_guards_count() {
    let p = pool(3, PolicyKind::RoundRobin);
    let g: Vec<_> = (0..6)
        .map(|_| p.pick(None, None).expect("worker"))
        .collect();
    let urls: Vec<_> = g.iter().map(|g| g.worker().url.clone()).collect();
    assert_eq!(urls[0..3], urls[3..6]);
    assert_ne!(urls[0], urls[1]);
    assert!(p.workers().iter().all(|w| w.in_flight() == 2));
    drop(g);
    assert!(p.workers().iter().all(|w| w.in_flight() == 0));
}

#[test]
fn least_load_prefers_idle_worker() {
    let p = pool(2, PolicyKind::LeastLoad);
    let busy: Vec<_> = (0..5)
        .map(|_| LoadGuard::new(p.workers()[0].clone()))
        .collect();
    for _ in 0..20 {
        let g = p.pick(None, None).expect("worker");
        assert_eq!(g.worker().url, p.workers()[1].url);
    }
    drop(busy);
}

#[test]
fn unhealthy_after_threshold_and_back() {
    let p = pool(2, PolicyKind::RoundRobin);
    let cfg = HealthConfig {
        interval_ms: 1,
        timeout_ms: 1,
        failure_threshold: 2,
        success_threshold: 2,
    };
    let w = &p.workers()[0];
    w.record_health(false, &cfg);
    assert!(w.is_healthy());
    w.record_health(false, &cfg);
    assert!(!w.is_healthy());
    for _ in 0..10 {
        assert_eq!(
            p.pick(None, None).expect("worker").worker().url,
            p.workers()[1].url
        );
    }
    w.record_health(true, &cfg);
    assert!(!w.is_healthy());
    w.record_health(true, &cfg);
    assert!(w.is_healthy());
    p.workers()[1].record_health(false, &cfg);
    p.workers()[1].record_health(false, &cfg);
    w.record_health(false, &cfg);
    w.record_health(false, &cfg);
    assert!(p.pick(None, None).is_none());
}

#[test]
fn avoid_skips_failed_worker_when_possible() {
    let p = pool(2, PolicyKind::RoundRobin);
    let bad = p.workers()[0].clone();
    for _ in 0..6 {
        assert_eq!(
            p.pick(Some(&bad), None).expect("worker").worker().url,
            p.workers()[1].url
        );
    }
    let one = pool(1, PolicyKind::RoundRobin);
    let only = one.workers()[0].clone();
    assert!(one.pick(Some(&only), None).is_some());
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| seed * 1000 + i).collect()
}

fn url_of(p: &WorkerPool, tokens: &[u32], salt: u64) -> String {
    let key = RouteKey { tokens, salt };
    p.pick(None, Some(&key))
        .expect("worker")
        .worker()
        .url
        .clone()
}

#[test]
fn prefix_policy_keeps_a_tenants_prefix_on_one_worker() {
    let p = pool(3, PolicyKind::PrefixAware);
    let shared = prompt(1, 64);
    let home = url_of(&p, &shared, 7);
    // The same prefix with different endings, again and again: the same worker.
    for i in 0..10u32 {
        let mut t = shared.clone();
        t.extend([90_000 + i, 90_100 + i, 90_200 + i]);
        assert_eq!(url_of(&p, &t, 7), home, "request {i}");
    }
    let (routed, hit) = p.prefix_prediction();
    assert_eq!(routed, 64 + 10 * 67);
    assert_eq!(hit, 10 * 64, "every repeat predicted a 4-block hit");
    // Unrelated prompts spread over the workers (least loaded, then least cached).
    let spread: std::collections::HashSet<String> =
        (2..8).map(|s| url_of(&p, &prompt(s, 64), 7)).collect();
    assert_eq!(spread.len(), 3, "{spread:?}");
}

#[test]
fn prefix_policy_never_counts_another_tenants_prefix_as_a_hit() {
    let p = pool(2, PolicyKind::PrefixAware);
    let shared = prompt(1, 64);
    let _ = url_of(&p, &shared, 7);
    let (_, before) = p.prefix_prediction();
    // Tenant 8 sends the identical prompt: no hit is predicted anywhere.
    let _ = url_of(&p, &shared, 8);
    assert_eq!(
        p.prefix_prediction().1,
        before,
        "another tenant's blocks are not a hit"
    );
    // Tenant 8's own repeat is.
    let _ = url_of(&p, &shared, 8);
    assert_eq!(p.prefix_prediction().1, before + 64);
}

#[test]
fn prefix_policy_yields_to_load_when_out_of_balance() {
    let p = pool(2, PolicyKind::PrefixAware);
    let shared = prompt(1, 64);
    let key = RouteKey {
        tokens: &shared,
        salt: 7,
    };
    let first = p.pick(None, Some(&key)).expect("worker");
    let home = first.worker().url.clone();
    // Pile load on the home worker: past the thresholds (more than 4 over, and 1.5x), the
    // same prefix goes to the idle worker.
    let mut held = vec![first];
    while held.len() < 5 {
        let g = p.pick(None, Some(&key)).expect("worker");
        assert_eq!(g.worker().url, home, "balanced enough: stays on its prefix");
        held.push(g);
    }
    let g = p.pick(None, Some(&key)).expect("worker");
    assert_ne!(g.worker().url, home, "out of balance: the idle worker");
}

#[test]
fn prefix_index_forgets_the_least_recently_routed_blocks_first() {
    let tick = AtomicU64::new(0);
    let mut b = Blocks::default();
    b.insert(&[1, 2, 3], &tick, 4);
    b.insert(&[4, 5], &tick, 4);
    assert_eq!(b.by_hash.len(), 4);
    assert_eq!(b.matched(&[1, 2, 3]), 0, "block 1 was the oldest");
    assert_eq!(b.matched(&[2, 3, 4]), 3);
    b.insert(&[2], &tick, 4); // touched: now the newest
    b.insert(&[6], &tick, 4);
    assert!(b.by_hash.contains_key(&2) && !b.by_hash.contains_key(&3));
}

#[test]
fn the_prefix_memory_follows_a_workers_url_across_a_reload() {
    let cfg = |ports: [u16; 2]| on_ports(PolicyKind::PrefixAware, &ports, 0);
    let old = cfg([5000, 5001]);
    let tokens: Vec<u32> = (0..256).collect();
    let key = RouteKey {
        tokens: &tokens,
        salt: 7,
    };
    let first = old
        .pick(None, Some(&key))
        .expect("a worker")
        .worker()
        .url
        .clone();
    // The reloaded pool lists the workers the other way round: the prompt still goes where its
    // blocks were routed, and a worker new to the pool starts with nothing remembered.
    let mut new = cfg([5001, 5000]);
    new.carry_from(&old);
    for _ in 0..3 {
        let again = new
            .pick(None, Some(&key))
            .expect("a worker")
            .worker()
            .url
            .clone();
        assert_eq!(again, first);
    }
    let mut other = cfg([5002, 5003]);
    other.carry_from(&old);
    assert!(other.prefix.workers.is_empty());
}

#[test]
fn both_sides_are_picked_and_a_pinned_prefill_must_be_a_member() {
    let (p, d) = (
        on_ports(PolicyKind::RoundRobin, &[3000, 3001], 1),
        on_ports(PolicyKind::RoundRobin, &[4000], 0),
    );
    let got = pick_pair(&p, &d, None, PrefillChoice::Pick { avoid: None }, None).expect("a pair");
    assert_eq!(got.decode.worker().url, "http://127.0.0.1:4000");
    drop(got);
    let pinned = pick_pair(
        &p,
        &d,
        None,
        PrefillChoice::Pinned("http://127.0.0.1:3001"),
        None,
    )
    .expect("the pinned member");
    assert_eq!(pinned.prefill.worker().url, "http://127.0.0.1:3001");
    // Its one slot is held: pinning it again finds it full.
    let again = pick_pair(
        &p,
        &d,
        None,
        PrefillChoice::Pinned("http://127.0.0.1:3001"),
        None,
    );
    assert_eq!(again.err(), Some(Side::Prefill));
    drop(pinned);
    // A URL outside the pool is never picked, however it is spelled.
    for url in ["http://127.0.0.1:9999", "http://127.0.0.1:3001/", ""] {
        let r = pick_pair(&p, &d, None, PrefillChoice::Pinned(url), None);
        assert_eq!(r.err(), Some(Side::Prefill), "{url}");
    }
    assert!(p.workers().iter().all(|w| w.in_flight() == 0));
}

#[test]
fn a_decode_side_that_cannot_take_the_pair_gives_the_prefill_slot_back() {
    let (p, d) = (
        on_ports(PolicyKind::RoundRobin, &[3000], 0),
        on_ports(PolicyKind::RoundRobin, &[4000], 1),
    );
    let held = d.pick(None, None).expect("the decode's only slot");
    let r = pick_pair(&p, &d, None, PrefillChoice::Pick { avoid: None }, None);
    assert_eq!(r.err(), Some(Side::Decode));
    assert_eq!(
        p.workers()[0].in_flight(),
        0,
        "the prefill slot was given back"
    );
    drop(held);
    assert!(pick_pair(&p, &d, None, PrefillChoice::Pick { avoid: None }, None).is_ok());
}

fn worker(port: u16) -> WorkerConfig {
    WorkerConfig {
        url: format!("http://127.0.0.1:{port}/"),
        bootstrap_port: None,
        bootstrap_host: None,
        kv_events: None,
        kv_events_replay: None,
    }
}

#[test]
fn a_joined_worker_waits_for_its_check_and_a_left_one_takes_no_pairs() {
    let p = on_ports(PolicyKind::RoundRobin, &[5000, 5001], 0);
    let w = p.join(&worker(5002)).expect("a new member");
    assert_eq!(w.url, "http://127.0.0.1:5002");
    assert!(w.joined() && !w.is_verified() && !w.accepts_pairs());
    assert_eq!(w.label("decode"), "decode-2");
    assert!(p.join(&worker(5002)).is_none(), "already a member");
    assert!(p.join(&worker(5000)).is_none(), "a configured member");
    assert_eq!(p.workers().len(), 3);
    // Unverified: never picked.
    for _ in 0..6 {
        let g = p.pick(None, None).expect("a verified worker");
        assert_ne!(g.worker().url, w.url);
    }
    w.set_verified(true);
    assert!((0..6).any(|_| p.pick(None, None).expect("w").worker().url == w.url));
    // A member leaves: a pair it runs keeps its slot; it gets no new pair; names stay.
    let running = LoadGuard::new(p.member_at("http://127.0.0.1:5000").expect("member"));
    let gone = p.leave("http://127.0.0.1:5000/").expect("it was a member");
    assert!(gone.has_left() && !gone.accepts_pairs());
    assert!(p.leave("http://127.0.0.1:5000").is_none());
    assert_eq!(p.workers().len(), 2);
    assert_eq!(
        p.label_of("decode", "http://127.0.0.1:5001").as_deref(),
        Some("decode-1")
    );
    assert_eq!(p.label_of("decode", "http://127.0.0.1:5000"), None);
    for _ in 0..6 {
        assert_ne!(p.pick(None, None).expect("w").worker().url, gone.url);
    }
    assert_eq!(running.worker().in_flight(), 1);
    drop(running);
    assert_eq!(gone.in_flight(), 0);
    // Rejoining gives a new name.
    let back = p.join(&worker(5000)).expect("rejoins");
    assert_eq!(back.label("prefill"), "prefill-3");
}

#[test]
fn a_left_workers_prefix_predictions_go_and_a_reload_keeps_joined_workers() {
    let p = on_ports(PolicyKind::PrefixAware, &[6000], 0);
    let w = p.join(&worker(6001)).expect("joins");
    w.set_verified(true);
    let tokens: Vec<u32> = (0..256).collect();
    let key = RouteKey {
        tokens: &tokens,
        salt: 0,
    };
    let g = p.pick(None, Some(&key)).expect("a worker");
    let chosen = g.worker().url.clone();
    assert!(p.prefix.workers.contains_key(&chosen));
    p.leave(&chosen).expect("member");
    assert!(!p.prefix.workers.contains_key(&chosen));
    // A reload: the new pool has the configured worker; the joined one (if still a member) is
    // carried, with its pair count, unverified until checked again.
    let old = on_ports(PolicyKind::RoundRobin, &[7000], 0);
    let j = old.join(&worker(7001)).expect("joins");
    j.set_verified(true);
    let running = LoadGuard::new(j.clone());
    let gone = old.join(&worker(7002)).expect("joins");
    old.leave(&gone.url);
    let new = on_ports(PolicyKind::RoundRobin, &[7000], 0);
    new.carry_joined(&old);
    let urls: Vec<String> = new.workers().iter().map(|w| w.url.clone()).collect();
    assert_eq!(urls, ["http://127.0.0.1:7000", "http://127.0.0.1:7001"]);
    let carried = new.member_at("http://127.0.0.1:7001").expect("carried");
    assert!(carried.joined() && !carried.is_verified());
    assert_eq!(carried.in_flight(), 1);
    drop(running);
    assert_eq!(carried.in_flight(), 0);
    // A worker the new configuration lists is not carried as joined.
    let listed = on_ports(PolicyKind::RoundRobin, &[7000, 7001], 0);
    listed.carry_joined(&old);
    assert_eq!(listed.workers().len(), 2);
    assert!(
        !listed
            .member_at("http://127.0.0.1:7001")
            .expect("w")
            .joined()
    );
}

#[test]
fn a_subset_pick_takes_the_least_loaded_member_of_the_subset_only() {
    use super::{host_port, pick_within};
    let cfg = PoolConfig {
        workers: [
            "http://10.0.0.1:8000",
            "http://10.0.0.2:8000",
            "http://10.0.0.3:8000",
        ]
        .iter()
        .map(|u| WorkerConfig {
            url: (*u).into(),
            bootstrap_port: None,
            bootstrap_host: None,
            kv_events: None,
            kv_events_replay: None,
        })
        .collect(),
        ..PoolConfig::default()
    };
    let pool = WorkerPool::new(&cfg);
    let busy = pool.pick(None, None).expect("a pick");
    let busy_hp = host_port(&busy.worker().url).expect("host:port");
    let all: Vec<String> = pool
        .workers()
        .iter()
        .filter_map(|w| host_port(&w.url))
        .collect();
    // The busy one is avoided while another of the subset is free.
    let g = pick_within(&pool, &all).expect("a pick");
    assert_ne!(host_port(&g.worker().url), Some(busy_hp.clone()));
    // Only the subset's members: here just the busy one.
    let g2 = pick_within(&pool, std::slice::from_ref(&busy_hp)).expect("the busy one");
    assert_eq!(host_port(&g2.worker().url), Some(busy_hp));
    assert!(pick_within(&pool, &["10.0.0.9:8000".to_string()]).is_none());
    assert!(pick_within(&pool, &[]).is_none());
    assert_eq!(host_port("https://a.example"), Some("a.example:443".into()));
    assert_eq!(host_port("http://a.example"), Some("a.example:80".into()));
    assert_eq!(
        host_port("http://[fd00::1]:30000"),
        Some("[fd00::1]:30000".into())
    );
}

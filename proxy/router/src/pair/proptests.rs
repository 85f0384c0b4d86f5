//! Property tests of the lifecycle: random timings and outcomes of the two halves, and random
//! client behaviour, always end in exactly one terminal state, with aborts sent to both halves iff
//! the pair did not succeed, nothing released before the barrier, and nothing left behind.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use proptest::prelude::*;

use super::{ModelPairs, Outcome, PairEvent, PairId, PairRegistry, PairStats};
use crate::backend::{
    DecodeChunk, DecodeStream, Dispatch, FinishReason, HalfError, HalfFailure, PdBackend,
    PrefillReport, SamplingParams, Side,
};
use lockstep_core::config::{PolicyKind, PoolConfig, RetryConfig, TimeoutConfig, WorkerConfig};
use lockstep_routing::pool::WorkerPool;

#[derive(Debug, Clone)]
enum PrefillScript {
    Ok { delay_ms: u64, count_off: bool },
    Fail { delay_ms: u64, failure: HalfFailure },
}

#[derive(Debug, Clone)]
struct DecodeScript {
    start_delay_ms: u64,
    start_fails: bool,
    chunks: usize,
    chunk_delay_ms: u64,
    cut_at: Option<usize>,
    count_off_at: Option<usize>,
}

#[derive(Debug, Clone)]
struct Script {
    prefill: PrefillScript,
    decode: DecodeScript,
    /// The client stops reading after this many events.
    client_leaves_after: Option<usize>,
    /// The decode reports a KV digest other than the prefill's.
    digest_off: bool,
}

struct Fake {
    script: Script,
    n: u64,
    aborts: Mutex<Vec<(PairId, Side)>>,
    dispatched: Mutex<Vec<PairId>>,
}

impl PdBackend for Fake {
    fn capabilities(&self) -> crate::backend::Capabilities {
        // The fake's decode chunks carry no prompt count unless a case gives one.
        crate::backend::Capabilities {
            decode_counts_prompt: false,
            ..Default::default()
        }
    }
    fn deployment<'a>(
        &'a self,
        m: &'a lockstep_core::config::ModelConfig,
    ) -> BoxFuture<'a, Result<crate::backend::Deployment, String>> {
        Box::pin(async move { Ok(crate::backend::Deployment::capacity(m.kv_capacity_tokens)) })
    }

    fn prefill(&self, d: &Dispatch) -> BoxFuture<'static, Result<PrefillReport, HalfError>> {
        self.dispatched.lock().expect("lock").push(d.pair_id);
        let s = self.script.prefill.clone();
        let n = self.n;
        Box::pin(async move {
            match s {
                PrefillScript::Ok {
                    delay_ms,
                    count_off,
                } => {
                    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                    Ok(PrefillReport {
                        kv_digest: Some(42),
                        cached_tokens: None,
                        prompt_logprobs: None,
                        prompt_tokens: if count_off { n + 1 } else { n },
                    })
                }
                PrefillScript::Fail { delay_ms, failure } => {
                    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                    Err(HalfError {
                        side: Side::Prefill,
                        failure,
                    })
                }
            }
        })
    }

    fn decode(&self, _d: &Dispatch) -> DecodeStream {
        let s = self.script.decode.clone();
        let n = self.n;
        let digest = Some(if self.script.digest_off { 43 } else { 42 });
        futures_util::stream::unfold(0usize, move |i| {
            let s = s.clone();
            async move {
                if i == 0 {
                    tokio::time::sleep(Duration::from_millis(s.start_delay_ms)).await;
                    if s.start_fails {
                        return Some((
                            Err(HalfError {
                                side: Side::Decode,
                                failure: HalfFailure::Status {
                                    status: 500,
                                    message: "x".into(),
                                },
                            }),
                            usize::MAX,
                        ));
                    }
                } else {
                    tokio::time::sleep(Duration::from_millis(s.chunk_delay_ms)).await;
                }
                if i >= s.chunks {
                    return None;
                }
                if s.cut_at == Some(i) {
                    return Some((
                        Err(HalfError {
                            side: Side::Decode,
                            failure: HalfFailure::Transport("cut".into()),
                        }),
                        usize::MAX,
                    ));
                }
                let chunk = DecodeChunk {
                    kv_digest: digest,
                    delta: format!("t{i} "),
                    token_ids: vec![i as u32],
                    prompt_tokens: Some(if s.count_off_at == Some(i) { n + 2 } else { n }),
                    completion_tokens: i as u64 + 1,
                    finish: (i + 1 == s.chunks).then_some(FinishReason::Length),
                    matched_stop: None,
                    logprobs: Vec::new(),
                    prompt_logprobs: None,
                };
                Some((Ok(chunk), i + 1))
            }
        })
        .take_while(|_| futures_util::future::ready(true))
        .scan(false, |failed, item| {
            // Nothing after an error.
            if *failed {
                return futures_util::future::ready(None);
            }
            *failed = item.is_err();
            futures_util::future::ready(Some(item))
        })
        .boxed()
    }

    fn abort(&self, d: &Dispatch, side: Side) -> BoxFuture<'static, Result<(), HalfError>> {
        self.aborts.lock().expect("lock").push((d.pair_id, side));
        Box::pin(async { Ok(()) })
    }
}

fn failure() -> impl Strategy<Value = HalfFailure> {
    prop_oneof![
        Just(HalfFailure::Connect("refused".into())),
        Just(HalfFailure::Status {
            status: 503,
            message: "busy".into()
        }),
        Just(HalfFailure::Status {
            status: 400,
            message: "bad".into()
        }),
        Just(HalfFailure::InBandAbort("abort".into())),
        Just(HalfFailure::Transport("reset".into())),
    ]
}

fn script() -> impl Strategy<Value = Script> {
    let prefill = prop_oneof![
        3 => (0u64..400, proptest::bool::weighted(0.15)).prop_map(|(delay_ms, count_off)| PrefillScript::Ok { delay_ms, count_off }),
        1 => (0u64..400, failure()).prop_map(|(delay_ms, failure)| PrefillScript::Fail { delay_ms, failure }),
    ];
    let decode = (
        0u64..400,
        proptest::bool::weighted(0.1),
        1usize..6,
        0u64..150,
        proptest::option::weighted(0.15, 0usize..6),
        proptest::option::weighted(0.1, 0usize..6),
    )
        .prop_map(
            |(start_delay_ms, start_fails, chunks, chunk_delay_ms, cut_at, count_off_at)| {
                DecodeScript {
                    start_delay_ms,
                    start_fails,
                    chunks,
                    chunk_delay_ms,
                    cut_at,
                    count_off_at,
                }
            },
        );
    (
        prefill,
        decode,
        proptest::option::weighted(0.2, 0usize..5),
        proptest::bool::weighted(0.15),
    )
        .prop_map(
            |(prefill, decode, client_leaves_after, digest_off)| Script {
                prefill,
                decode,
                client_leaves_after,
                digest_off,
            },
        )
}

fn pool() -> Arc<WorkerPool> {
    Arc::new(WorkerPool::new(&PoolConfig {
        policy: PolicyKind::RoundRobin,
        workers: vec![WorkerConfig {
            url: "http://127.0.0.1:9".into(),
            bootstrap_port: Some(1),
            bootstrap_host: None,
            kv_events: None,
            kv_events_replay: None,
        }],
        ..PoolConfig::default()
    }))
}

type Setup = (
    Arc<Fake>,
    Arc<ModelPairs>,
    Arc<PairRegistry>,
    Arc<WorkerPool>,
    Arc<WorkerPool>,
);

/// The fake backend playing `script` under a pair runtime with short deadlines.
fn setup(script: &Script) -> Setup {
    let n = 7u64;
    let fake = Arc::new(Fake {
        script: script.clone(),
        n,
        aborts: Mutex::new(Vec::new()),
        dispatched: Mutex::new(Vec::new()),
    });
    let registry = Arc::new(PairRegistry::default());
    let (prefill, decode) = (pool(), pool());
    let metrics = Arc::new(lockstep_core::metrics::Metrics::new());
    let rt = Arc::new(ModelPairs {
        model: "m".into(),
        backend: fake.clone(),
        prefill: prefill.clone(),
        decode: decode.clone(),
        registry: registry.clone(),
        timeouts: TimeoutConfig {
            total_ms: 2000,
            prefill_ms: 300,
            first_token_ms: 350,
            idle_ms: 120,
            abort_ms: 50,
            abort_confirm_ms: 200,
            client_idle_ms: 150,
        },
        retry: RetryConfig {
            max_retries: 1,
            backoff_ms: 5,
        },
        // The scripts judge a committed stream's failure as the client's error event.
        failover: lockstep_core::config::FailoverConfig {
            max_migrations: 0,
            ..Default::default()
        },
        detok: None,
        stats: Arc::new(PairStats::default()),
        series: lockstep_core::metrics::ModelMetrics::new(&metrics, "m"),
        queue: crate::pair::FairQueue::default(),
        queue_cfg: lockstep_core::config::QueueConfig::default(),
        metrics,
        audit: Arc::new(lockstep_core::audit::Audit::default()),
    });
    (fake, rt, registry, prefill, decode)
}

fn run_case(script: Script) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let n = 7u64;
        let (fake, rt, registry, prefill, decode) = setup(&script);
        let (mut rx, handle) = rt.start(
            vec![1u32; n as usize].into(),
            None,
            Arc::new(SamplingParams {
                max_new_tokens: 8,
                ..Default::default()
            }),
            None,
            lockstep_routing::pool::PrefillPin::Pool,
        );
        let mut events = Vec::new();
        loop {
            if script.client_leaves_after == Some(events.len()) {
                drop(rx);
                break;
            }
            match rx.recv().await {
                Some(e) => events.push(e),
                None => break,
            }
        }
        let outcome = handle.await.expect("task ends");
        // Let the background abort calls run.
        tokio::time::sleep(Duration::from_millis(100)).await;

        let dispatched = fake.dispatched.lock().expect("lock").clone();
        let aborts = fake.aborts.lock().expect("lock").clone();
        let committed_at = events
            .iter()
            .position(|e| matches!(e, PairEvent::Committed { .. }));
        // Nothing before the barrier: no chunk precedes Committed.
        let first_chunk = events.iter().position(|e| matches!(e, PairEvent::Chunk(_)));
        if let Some(fc) = first_chunk {
            prop_assert!(
                committed_at.is_some_and(|c| c < fc),
                "chunk before commit: {events:?}"
            );
        }
        if committed_at.is_some() {
            prop_assert!(
                matches!(
                    script.prefill,
                    PrefillScript::Ok {
                        count_off: false,
                        ..
                    }
                ),
                "committed although the prefill failed"
            );
            prop_assert!(
                !script.digest_off,
                "committed although the KV digests differ"
            );
        }
        match outcome {
            Outcome::Completed => {
                prop_assert!(aborts.is_empty(), "completed pair got aborts: {aborts:?}");
                prop_assert_eq!(dispatched.len(), 1);
                // Completed means every chunk was handed to the front end; a client that leaves after
                // that has nothing left to abort.
                if script.client_leaves_after.is_none() {
                    prop_assert!(
                        matches!(events.last(), Some(PairEvent::Chunk(c)) if c.finish.is_some()),
                        "completed without a finish: {events:?}"
                    );
                }
                prop_assert!(!events.iter().any(|e| matches!(e, PairEvent::Failed(_))));
            }
            Outcome::Aborted(_) => {
                for id in &dispatched {
                    for side in [Side::Prefill, Side::Decode] {
                        prop_assert!(
                            aborts.contains(&(*id, side)),
                            "pair {id} side {side:?} not aborted: {aborts:?}"
                        );
                    }
                }
                prop_assert_eq!(
                    aborts.len(),
                    dispatched.len() * 2,
                    "exactly one abort per half"
                );
                if script.client_leaves_after.is_none() {
                    prop_assert!(
                        matches!(events.last(), Some(PairEvent::Failed(_))),
                        "aborted without telling the client: {events:?}"
                    );
                    prop_assert!(
                        !events
                            .iter()
                            .any(|e| matches!(e, PairEvent::Chunk(c) if c.finish.is_some())),
                        "a finished stream cannot end aborted"
                    );
                }
            }
        }
        prop_assert!(registry.is_empty(), "registry not empty");
        prop_assert!(
            prefill
                .workers()
                .iter()
                .chain(decode.workers().iter())
                .all(|w| w.in_flight() == 0),
            "load counters not zero"
        );
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn one_terminal_state_and_abort_both_iff_failed(s in script()) {
        run_case(s)?;
    }
}

/// A client that stops reading a committed stream: the channel fills, the send waits
/// `client_idle_ms`, then both halves are aborted and nothing is left behind.
#[test]
fn a_stalled_reader_aborts_both_halves_after_client_idle() {
    let script = Script {
        prefill: PrefillScript::Ok {
            delay_ms: 1,
            count_off: false,
        },
        decode: DecodeScript {
            start_delay_ms: 1,
            start_fails: false,
            chunks: 500,
            chunk_delay_ms: 1,
            cut_at: None,
            count_off_at: None,
        },
        client_leaves_after: None,
        digest_off: false,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let (fake, rt, registry, ..) = setup(&script);
        let (mut rx, handle) = rt.start(
            vec![1u32; 7].into(),
            None,
            Arc::new(SamplingParams {
                max_new_tokens: 500,
                ..Default::default()
            }),
            None,
            lockstep_routing::pool::PrefillPin::Pool,
        );
        assert!(matches!(rx.recv().await, Some(PairEvent::Committed { .. })));
        // Stall: hold the receiver, read nothing.
        let started = tokio::time::Instant::now();
        let outcome = handle.await.expect("task ends");
        assert!(
            matches!(
                outcome,
                Outcome::Aborted(super::AbortReason::Deadline(
                    lockstep_core::error::Phase::ClientIdle
                ))
            ),
            "{outcome:?}"
        );
        assert!(started.elapsed() >= Duration::from_millis(150));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let aborts = fake.aborts.lock().expect("lock").clone();
        assert_eq!(aborts.len(), 2, "both halves aborted: {aborts:?}");
        assert!(registry.is_empty());
        drop(rx);
    });
}

//! The metrics of each area, each registered by its own constructor.

use prometheus::{
    GaugeVec, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use super::{ITL, LATENCY, counter, gauge, histogram};

/// The pairs: outcomes, aborts, migrations, the barrier and the latencies a client sees.
#[derive(Debug, Clone)]
pub struct PairMetrics {
    /// Pairs dispatched (each retry is a new pair), by model.
    pub pairs_started: IntCounterVec,
    /// Requests whose pair finished normally, by model.
    pub pairs_completed: IntCounterVec,
    /// Requests whose pair ended aborted on both halves, by model, reason and the side that
    /// failed (`prefill`, `decode`, or `none` when neither half did: a deadline, the client).
    pub pairs_aborted: IntCounterVec,
    /// Committed streams moved to a new pair after their worker failed, by model, reason
    /// (`decode_failed`, `decode_ended`, `decode_idle`, `prefill_failed`) and outcome
    /// (`resumed`: the new pair passed its barrier and the stream went on; `failed`).
    pub migrations: IntCounterVec,
    /// First failure seen → both halves' aborts acknowledged (or timed out), by model.
    pub abort_both_seconds: HistogramVec,
    /// Aborts sent again because the aborted half's answer had not ended, by model and side.
    pub abort_resent: IntCounterVec,
    /// Aborted halves dropped after `abort_confirm_ms` with their answer still open, by model
    /// and side.
    pub abort_unconfirmed: IntCounterVec,
    /// A pair's failure → an aborted half's own answer ended (the worker let go of it), by
    /// model and side; for backends whose answer shows it (SGLang).
    pub half_release_seconds: HistogramVec,
    /// The longest an aborted pair's KV can stay held on its workers, by model (set at scrape).
    pub stranded_kv_bound_seconds: GaugeVec,
    /// Dispatch → commit barrier passed, by model.
    pub barrier_wait_seconds: HistogramVec,
    /// Request start → first token released to the client, by model.
    pub ttft_seconds: HistogramVec,
    /// Between consecutive chunks released to the client, by model.
    pub itl_seconds: HistogramVec,
    /// Integrity violations, by model and kind.
    pub integrity_violations: IntCounterVec,
}

impl PairMetrics {
    pub(super) fn new(r: &Registry) -> PairMetrics {
        PairMetrics {
            pairs_started: counter(
                r,
                "lockstep_pairs_started_total",
                "Pairs dispatched to a prefill and a decode worker (each retry is a new pair).",
                &["model"],
            ),
            pairs_completed: counter(
                r,
                "lockstep_pairs_completed_total",
                "Requests whose pair finished normally.",
                &["model"],
            ),
            pairs_aborted: counter(
                r,
                "lockstep_pairs_aborted_total",
                "Requests whose pair ended aborted on both halves, by reason and failing side.",
                &["model", "reason", "side"],
            ),
            migrations: counter(
                r,
                "lockstep_migrations_total",
                "Committed streams moved to a new pair after their worker failed, by reason and outcome.",
                &["model", "reason", "outcome"],
            ),
            abort_both_seconds: histogram(
                r,
                "lockstep_abort_both_seconds",
                "From the first failure seen to both halves' aborts acknowledged or timed out.",
                &["model"],
                LATENCY,
            ),
            abort_resent: counter(
                r,
                "lockstep_abort_resent_total",
                "Aborts sent again because the aborted half's own answer had not ended yet.",
                &["model", "side"],
            ),
            abort_unconfirmed: counter(
                r,
                "lockstep_abort_unconfirmed_total",
                "Aborted halves dropped after abort_confirm_ms with their answer still open.",
                &["model", "side"],
            ),
            half_release_seconds: histogram(
                r,
                "lockstep_half_release_seconds",
                "From a pair's failure to an aborted half's own answer ending (its worker let go).",
                &["model", "side"],
                LATENCY,
            ),
            stranded_kv_bound_seconds: {
                let g = GaugeVec::new(
                        Opts::new(
                            "lockstep_stranded_kv_bound_seconds",
                            "The longest an aborted pair's KV can stay held on its workers after the failure (by backend: SGLang abort confirmation plus its disconnect check, vLLM the prefill's KV lease, lockstep workers their room lease, embedded 0).",
                        ),
                        &["model"],
                    )
                    .expect("valid metric");
                r.register(Box::new(g.clone())).expect("unique metric");
                g
            },
            barrier_wait_seconds: histogram(
                r,
                "lockstep_commit_barrier_wait_seconds",
                "From dispatch to the commit barrier passing (prefill verified, decode agrees).",
                &["model"],
                LATENCY,
            ),
            ttft_seconds: histogram(
                r,
                "lockstep_time_to_first_token_seconds",
                "From the request's start to its first token released to the client.",
                &["model"],
                LATENCY,
            ),
            itl_seconds: histogram(
                r,
                "lockstep_inter_token_seconds",
                "Between consecutive chunks released to the client.",
                &["model"],
                ITL,
            ),
            integrity_violations: counter(
                r,
                "lockstep_integrity_violations_total",
                "Pairs ended because the halves disagreed or a KV transfer failed verification.",
                &["model", "kind"],
            ),
        }
    }
}

/// Admission: refusals by model and tenant, the wait for a worker slot, the tokenizer cache, the endpoint picker's picks.
#[derive(Debug, Clone)]
pub struct AdmissionMetrics {
    /// Requests refused before dispatch, by model and error code.
    pub admission_refusals: IntCounterVec,
    /// Requests refused before dispatch, by tenant (a configured name) and error code.
    pub tenant_refusals: IntCounterVec,
    /// Requests waiting for a slot (`models[].queue`), by model and tenant.
    pub queue_depth: IntGaugeVec,
    /// How long requests waited for a slot, by model and tenant.
    pub queue_wait: HistogramVec,
    /// Long prompts' bytes the tokenizer's segment cache served (`hit`) or tokenized (`miss`)
    /// (brought up to the cache's count at scrape).
    pub tokenizer_cache_bytes: IntCounterVec,
    /// `lockstep epp`: requests whose prefill and decode endpoints it picked, by model.
    pub epp_picks: IntCounterVec,
}

impl AdmissionMetrics {
    pub(super) fn new(r: &Registry) -> AdmissionMetrics {
        AdmissionMetrics {
            admission_refusals: counter(
                r,
                "lockstep_admission_refusals_total",
                "Requests refused before any worker was involved, by error code.",
                &["model", "code"],
            ),
            tenant_refusals: counter(
                r,
                "lockstep_tenant_refusals_total",
                "Requests of a tenant refused before dispatch, by tenant and error code (rate limits, its concurrency cap, invalid requests).",
                &["tenant", "code"],
            ),
            queue_depth: gauge(
                r,
                "lockstep_queue_depth",
                "Requests waiting for a worker slot, by tenant (\"\": no tenant).",
                &["model", "tenant"],
            ),
            queue_wait: histogram(
                r,
                "lockstep_queue_wait_seconds",
                "How long requests waited for a worker slot, by tenant.",
                &["model", "tenant"],
                LATENCY,
            ),
            tokenizer_cache_bytes: counter(
                r,
                "lockstep_tokenizer_cache_bytes_total",
                "Long prompts' bytes the tokenizer's segment cache served (hit) or tokenized (miss); per tenant, a hit never crosses tenants.",
                &["model", "result"],
            ),
            epp_picks: counter(
                r,
                "lockstep_epp_picks_total",
                "Requests the endpoint picker admitted and picked a decode and a prefill endpoint for.",
                &["model"],
            ),
        }
    }
}

/// The workers and their pools: load, health, capacity, prefix routing, KV events, discovery.
#[derive(Debug, Clone)]
pub struct WorkerMetrics {
    /// In-flight pairs per worker (read at scrape).
    pub worker_inflight: IntGaugeVec,
    /// 1 if the worker is healthy (read at scrape).
    pub worker_healthy: IntGaugeVec,
    /// The KV capacity one request can get, by model: the configured one, or less where workers
    /// reported less (set at scrape).
    pub kv_capacity_tokens: IntGaugeVec,
    /// Prompt tokens prefill workers report they took from their prefix cache.
    pub worker_cached_tokens: IntCounterVec,
    /// Prompt tokens routed by the prefix-aware policy (brought up to the pool's count at scrape).
    pub prefix_routed_tokens: IntCounterVec,
    /// Of those, tokens the policy predicted the chosen worker holds.
    pub prefix_predicted_hit_tokens: IntCounterVec,
    /// `prefix_events`: KV event batches by `result` (`applied`, `unreadable`), sequence gaps
    /// and publisher restarts, and the blocks indexed (brought up to the pool's at scrape).
    pub kv_event_batches: IntCounterVec,
    /// Sequence gaps and publisher restarts.
    pub kv_event_gaps: IntCounterVec,
    /// Blocks the index holds, all workers of a side.
    pub kv_event_blocks: IntGaugeVec,
    /// Pods a discovered pool's selector matches, by state: `ready` (a worker) or `not_ready`.
    pub discovery_pods: IntGaugeVec,
    /// Times a pool's watch of the API server failed and was restarted.
    pub discovery_watch_restarts: IntCounterVec,
    /// When a pool's discovery last had a complete, current list from the API server (Unix
    /// seconds).
    pub discovery_last_sync: IntGaugeVec,
}

impl WorkerMetrics {
    pub(super) fn new(r: &Registry) -> WorkerMetrics {
        WorkerMetrics {
            worker_inflight: gauge(
                r,
                "lockstep_worker_inflight_pairs",
                "Pairs in flight on a worker.",
                &["model", "side", "worker"],
            ),
            worker_healthy: gauge(
                r,
                "lockstep_worker_healthy",
                "1 when the worker passes its health checks, else 0.",
                &["model", "side", "worker"],
            ),
            kv_capacity_tokens: gauge(
                r,
                "lockstep_kv_capacity_tokens",
                "The KV capacity one request can get: the configured one, or less where the workers reported less.",
                &["model"],
            ),
            worker_cached_tokens: counter(
                r,
                "lockstep_worker_cached_tokens_total",
                "Prompt tokens prefill workers report served from their prefix cache (SGLang cached_tokens, vLLM prompt_tokens_details.cached_tokens).",
                &["model"],
            ),
            prefix_routed_tokens: counter(
                r,
                "lockstep_prefix_routed_tokens_total",
                "Prompt tokens routed by the prefix-aware policy, by side.",
                &["model", "side"],
            ),
            prefix_predicted_hit_tokens: counter(
                r,
                "lockstep_prefix_predicted_hit_tokens_total",
                "Prompt tokens the prefix-aware policy predicted cached on the chosen worker.",
                &["model", "side"],
            ),
            kv_event_batches: counter(
                r,
                "lockstep_kv_event_batches_total",
                "KV event batches the prefix_events policy read from the workers' engines, by result (applied, unreadable: that worker's index dropped).",
                &["model", "side", "result"],
            ),
            kv_event_gaps: counter(
                r,
                "lockstep_kv_event_gaps_total",
                "Sequence gaps and publisher restarts in the workers' KV events (a gap the replay could not fill drops that worker's index).",
                &["model", "side"],
            ),
            kv_event_blocks: gauge(
                r,
                "lockstep_kv_event_index_blocks",
                "Blocks the prefix_events index holds, as the workers' engines reported them.",
                &["model", "side"],
            ),
            discovery_pods: gauge(
                r,
                "lockstep_discovery_pods",
                "Pods a discovered pool's selector matches, by state (ready: a worker; not_ready).",
                &["model", "side", "state"],
            ),
            discovery_watch_restarts: counter(
                r,
                "lockstep_discovery_watch_restarts_total",
                "Times a discovered pool's watch of the Kubernetes API failed and was restarted (the last known workers keep serving).",
                &["model", "side"],
            ),
            discovery_last_sync: gauge(
                r,
                "lockstep_discovery_last_sync_timestamp_seconds",
                "When a discovered pool last had a complete, current list of its pods (Unix seconds).",
                &["model", "side"],
            ),
        }
    }
}

/// The embedded engines: KV pages, prefix-cache hits, shared imports.
#[derive(Debug, Clone)]
pub struct EngineMetrics {
    /// Embedded engines' KV pages by state `used` / `free` (read at scrape).
    pub kv_pages: IntGaugeVec,
    /// Prompt tokens an embedded engine took from its prefix cache (brought up to the engine's
    /// count at scrape).
    pub prefix_cache_hit_tokens: IntCounterVec,
    /// Prompt tokens of KV sets an embedded decode engine imported whose pages it held already
    /// with the same bytes, shared instead of copied (brought up to the engine's count at
    /// scrape).
    pub kv_import_shared_tokens: IntCounterVec,
}

impl EngineMetrics {
    pub(super) fn new(r: &Registry) -> EngineMetrics {
        EngineMetrics {
            kv_pages: gauge(
                r,
                "lockstep_kv_pages",
                "KV pages of an embedded engine's pool, by state (used, free).",
                &["model", "engine", "state"],
            ),
            prefix_cache_hit_tokens: counter(
                r,
                "lockstep_prefix_cache_hit_tokens_total",
                "Prompt tokens an embedded engine reused from its prefix cache (same tenant only).",
                &["model", "engine"],
            ),
            kv_import_shared_tokens: counter(
                r,
                "lockstep_kv_import_shared_tokens_total",
                "Prompt tokens of imported KV sets an embedded engine already held with the same bytes (same tenant only), shared instead of copied.",
                &["model", "engine"],
            ),
        }
    }
}

/// The store tenant limits are shared through (`[shared]`).
#[derive(Debug, Clone)]
pub struct SharedStoreMetrics {
    /// 1 while the store tenant limits are shared through (`[shared]`) answers, else 0.
    pub shared_store_up: IntGauge,
    /// Calls to the shared store that failed or timed out.
    pub shared_store_errors: IntCounter,
    /// Replicas sharing the store, as last seen (what a replica's local share divides by).
    pub shared_replicas: IntGauge,
}

impl SharedStoreMetrics {
    pub(super) fn new(r: &Registry) -> SharedStoreMetrics {
        let plain_gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid metric");
            r.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        let shared_store_errors = IntCounter::new(
            "lockstep_shared_store_errors_total",
            "Calls to the shared store (`[shared]`) that failed or timed out.",
        )
        .expect("valid metric");
        r.register(Box::new(shared_store_errors.clone()))
            .expect("unique metric");
        SharedStoreMetrics {
            shared_store_up: plain_gauge(
                "lockstep_shared_store_up",
                "1 while the store tenant limits are shared through (`[shared]`) answers, 0 while each replica enforces its share (or refuses).",
            ),
            shared_store_errors,
            shared_replicas: plain_gauge(
                "lockstep_shared_replicas",
                "Replicas sharing tenant limits through the store, as last seen.",
            ),
        }
    }
}

/// Requests with an `Idempotency-Key` header.
#[derive(Debug, Clone)]
pub struct IdempotencyMetrics {
    /// Requests with a key, by outcome: `first` (generated), `replayed` (a finished answer sent
    /// again), `joined` (a running answer followed from its first event), `mismatch` (422: the
    /// key with another body), `in_progress` (409: running on another replica), `not_kept`
    /// (409: the answer was too large or dropped to keep the bound).
    pub idempotent_requests: IntCounterVec,
    /// Keys remembered now, and the bytes of the answers kept for replay now.
    pub idempotency_keys: IntGauge,
    /// The bytes of the answers kept for replay now.
    pub idempotency_bytes: IntGauge,
}

impl IdempotencyMetrics {
    pub(super) fn new(r: &Registry) -> IdempotencyMetrics {
        let plain_gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid metric");
            r.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        let c = IntCounterVec::new(
            Opts::new(
                "lockstep_idempotent_requests_total",
                "Requests with an Idempotency-Key header, by outcome: first, replayed, joined, mismatch (422), in_progress (409), not_kept (409).",
            ),
            &["outcome"],
        )
        .expect("valid metric");
        r.register(Box::new(c.clone())).expect("unique metric");
        IdempotencyMetrics {
            idempotent_requests: c,
            idempotency_keys: plain_gauge(
                "lockstep_idempotency_keys",
                "Idempotency keys remembered by this replica now.",
            ),
            idempotency_bytes: plain_gauge(
                "lockstep_idempotency_bytes",
                "Bytes of answers this replica keeps for idempotent replay now.",
            ),
        }
    }
}

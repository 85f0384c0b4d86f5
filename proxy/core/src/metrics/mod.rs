//! Prometheus metrics (`GET /metrics`, text exposition format): pair outcomes, the abort-both
//! latency, the commit-barrier wait, time to first token and inter-token latency, admission
//! refusals, integrity violations, per-worker in-flight pairs and health, and the embedded
//! engines' KV pages. Counters and histograms are updated where things happen; the per-worker and
//! per-pool gauges are read from the live models at each scrape.

mod areas;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

pub use areas::{
    AdmissionMetrics, EngineMetrics, IdempotencyMetrics, PairMetrics, SharedStoreMetrics,
    WorkerMetrics,
};

/// Latency buckets, seconds: 1 ms to 5 min.
const LATENCY: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];
/// Inter-token buckets, seconds: 0.5 ms to 10 s.
const ITL: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

/// All of lockstep's metrics, by area.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    /// The pairs: outcomes, aborts, migrations, the barrier and the latencies a client sees.
    pub pairs: PairMetrics,
    /// Admission: refusals, the wait for a slot, the tokenizer cache, the picker's picks.
    pub admission: AdmissionMetrics,
    /// The workers and their pools: load, health, capacity, prefix routing, KV events, discovery.
    pub workers: WorkerMetrics,
    /// The embedded engines: KV pages, prefix-cache hits, shared imports.
    pub engines: EngineMetrics,
    /// The store tenant limits are shared through (`[shared]`).
    pub shared: SharedStoreMetrics,
    /// Requests with an `Idempotency-Key` header.
    pub idempotency: IdempotencyMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

fn counter(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(c.clone())).expect("unique metric");
    c
}

fn gauge(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(g.clone())).expect("unique metric");
    g
}

fn histogram(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> HistogramVec {
    let h = HistogramVec::new(
        HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        labels,
    )
    .expect("valid metric");
    r.register(Box::new(h.clone())).expect("unique metric");
    h
}

/// One model's series of the metrics every pair writes, looked up once when the model is built
/// rather than by label on every request.
#[derive(Debug, Clone)]
pub struct ModelMetrics {
    /// `pairs_started` of the model.
    pub pairs_started: IntCounter,
    /// `pairs_completed` of the model.
    pub pairs_completed: IntCounter,
    /// `barrier_wait_seconds` of the model.
    pub barrier_wait: Histogram,
    /// `ttft_seconds` of the model.
    pub ttft: Histogram,
    /// `itl_seconds` of the model.
    pub itl: Histogram,
    /// `worker_cached_tokens` of the model.
    pub worker_cached_tokens: IntCounter,
    /// `abort_both_seconds` of the model.
    pub abort_both: Histogram,
}

impl ModelMetrics {
    /// The series of `model` in `m`.
    pub fn new(m: &Metrics, model: &str) -> ModelMetrics {
        ModelMetrics {
            pairs_started: m.pairs.pairs_started.with_label_values(&[model]),
            pairs_completed: m.pairs.pairs_completed.with_label_values(&[model]),
            barrier_wait: m.pairs.barrier_wait_seconds.with_label_values(&[model]),
            ttft: m.pairs.ttft_seconds.with_label_values(&[model]),
            itl: m.pairs.itl_seconds.with_label_values(&[model]),
            worker_cached_tokens: m.workers.worker_cached_tokens.with_label_values(&[model]),
            abort_both: m.pairs.abort_both_seconds.with_label_values(&[model]),
        }
    }
}

impl Metrics {
    /// Counts a refusal against a tenant (a configured name, never a client's string).
    pub fn tenant_refusal(&self, tenant: &str, code: &str) {
        self.admission
            .tenant_refusals
            .with_label_values(&[tenant, code])
            .inc();
    }

    /// Counts a request refused before any pair was dispatched, by model (a configured name, or
    /// "" before the model is known: never a client's string) and stable error code.
    pub fn refusal(&self, model: &str, code: &str) {
        self.admission
            .admission_refusals
            .with_label_values(&[model, code])
            .inc();
    }

    /// A fresh registry with every metric registered.
    pub fn new() -> Metrics {
        let registry = Registry::new();
        Metrics {
            pairs: PairMetrics::new(&registry),
            admission: AdmissionMetrics::new(&registry),
            workers: WorkerMetrics::new(&registry),
            engines: EngineMetrics::new(&registry),
            shared: SharedStoreMetrics::new(&registry),
            idempotency: IdempotencyMetrics::new(&registry),
            registry,
        }
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let families = self.registry.gather();
        if TextEncoder::new().encode(&families, &mut buf).is_err() {
            return String::new();
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

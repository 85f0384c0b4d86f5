//! The pair observer: every metric, audit line and log event of a pair's life is recorded here,
//! so the lifecycle reads as control flow and the record of a pair cannot drift between paths.

use std::sync::atomic::Ordering;
use std::time::Duration;

use prometheus::Histogram;
use tokio::time::Instant as TokioInstant;

use super::outcome::Failure;
use super::{Outcome, PairStats};
use crate::backend::{Dispatch, Side};
use lockstep_core::audit::{Audit, AuditEvent, AuditKind, AuditTimings, now_ms};
use lockstep_core::error::LockstepError;
use lockstep_core::metrics::{Metrics, ModelMetrics};

/// Where an aborted pair stood, for its metrics and audit line.
pub(super) struct AbortContext<'a> {
    pub(super) tenant: Option<&'a str>,
    pub(super) attempt: u32,
    pub(super) committed: bool,
    pub(super) started: TokioInstant,
    pub(super) dispatched: TokioInstant,
    pub(super) barrier: Option<Duration>,
}

/// A migration under way: the pair it replaces, why, and what it carries.
pub(super) struct Migration {
    pub(super) from: lockstep_core::ids::PairId,
    pub(super) reason: &'static str,
    pub(super) carried: u64,
    pub(super) started: TokioInstant,
    /// The failed pair's span: the new pair's span follows from it (a span link in traces).
    pub(super) span: Option<tracing::Id>,
}

/// One model's view of the counters, histograms and audit log a pair writes to.
pub(super) struct PairObserver<'a> {
    pub(super) model: &'a str,
    pub(super) metrics: &'a Metrics,
    /// The model's own series of `metrics`.
    pub(super) series: &'a ModelMetrics,
    pub(super) audit: &'a Audit,
    pub(super) stats: &'a PairStats,
}

/// Time to first token and between tokens of a committed pair.
pub(super) struct TokenTimes {
    ttft: Histogram,
    itl: Histogram,
}

impl TokenTimes {
    /// A chunk reached the client at `now`: the first one since `started`, or one after `last`.
    pub(super) fn sent(
        &self,
        now: TokioInstant,
        started: TokioInstant,
        last: Option<TokioInstant>,
    ) {
        match last {
            None => self.ttft.observe((now - started).as_secs_f64()),
            Some(t) => self.itl.observe((now - t).as_secs_f64()),
        }
    }
}

impl PairObserver<'_> {
    /// Both halves were dispatched.
    pub(super) fn dispatched(&self) {
        self.stats.dispatched.fetch_add(1, Ordering::Relaxed);
        self.series.pairs_started.inc();
    }

    /// The barrier passed after `waited`; returns where the token timings go.
    pub(super) fn committed(&self, waited: Duration) -> TokenTimes {
        self.series.barrier_wait.observe(waited.as_secs_f64());
        TokenTimes {
            ttft: self.series.ttft.clone(),
            itl: self.series.itl.clone(),
        }
    }

    /// The prefill worker reported `n` prompt tokens taken from its prefix cache.
    pub(super) fn cached_tokens(&self, n: u64) {
        self.series.worker_cached_tokens.inc_by(n);
    }

    /// The pair finished and its last chunk reached the client.
    pub(super) fn completed(&self) {
        self.series.pairs_completed.inc();
    }

    /// An aborted pair (both halves told): its log line on the pair's span, the abort and
    /// integrity counters, and its audit lines.
    pub(super) fn aborted(
        &self,
        span: &tracing::Span,
        d: &Dispatch,
        f: &Failure,
        at: &AbortContext<'_>,
    ) {
        tracing::warn!(parent: span, pair = %d.pair_id, model = %self.model, reason = f.reason.as_str(), side = f.failed_side.map_or("none", Side::as_str), error = %f.error, detail = f.detail.as_deref().unwrap_or(""), "pair aborted on both halves");
        let model = self.model;
        let side = f.failed_side.map_or("none", Side::as_str);
        self.metrics
            .pairs
            .pairs_aborted
            .with_label_values(&[model, f.reason.as_str(), side])
            .inc();
        if let Some(kind) = f.integrity {
            self.metrics
                .pairs
                .integrity_violations
                .with_label_values(&[model, kind])
                .inc();
        }
        if !self.audit.enabled() {
            return;
        }
        let mut ev = AuditEvent {
            ts_ms: now_ms(),
            event: AuditKind::PairAborted,
            pair_id: d.pair_id.to_string(),
            tenant: at.tenant,
            model,
            reason: f.reason.as_str(),
            integrity_kind: f.integrity,
            side,
            error_code: f.error.code(),
            prefill_worker: &d.prefill.url,
            decode_worker: &d.decode.url,
            attempt: at.attempt,
            committed: at.committed,
            timings: AuditTimings {
                since_request_ms: at.started.elapsed().as_millis() as u64,
                since_dispatch_ms: at.dispatched.elapsed().as_millis() as u64,
                barrier_ms: at.barrier.map(|b| b.as_millis() as u64),
            },
            migrated_from: None,
            carried_tokens: None,
        };
        if f.integrity.is_some() {
            ev.event = AuditKind::IntegrityViolation;
            self.audit.record(&ev);
            ev.event = AuditKind::PairAborted;
        }
        self.audit.record(&ev);
    }

    /// A committed stream's new pair was dispatched in place of the failed one: its log line,
    /// and the audit line that links the two pairs.
    pub(super) fn migrating(
        &self,
        d: &Dispatch,
        m: &Migration,
        tenant: Option<&str>,
        (attempt, nth): (u32, u32),
    ) {
        tracing::warn!(pair = %d.pair_id, migration = nth, migrated_from = %m.from, model = %self.model, reason = m.reason, carried_tokens = m.carried, decode = %d.decode.url, "committed stream migrating to a new pair");
        if !self.audit.enabled() {
            return;
        }
        self.audit.record(&AuditEvent {
            ts_ms: now_ms(),
            event: AuditKind::PairMigrated,
            pair_id: d.pair_id.to_string(),
            tenant,
            model: self.model,
            reason: m.reason,
            integrity_kind: None,
            side: "decode",
            error_code: "",
            prefill_worker: &d.prefill.url,
            decode_worker: &d.decode.url,
            attempt,
            committed: true,
            timings: AuditTimings {
                since_request_ms: m.started.elapsed().as_millis() as u64,
                since_dispatch_ms: 0,
                barrier_ms: None,
            },
            migrated_from: Some(m.from.to_string()),
            carried_tokens: Some(m.carried),
        });
    }

    /// A migration ended: the new pair passed its barrier (`resumed`) or the stream failed.
    pub(super) fn migrated(&self, reason: &str, resumed: bool) {
        let outcome = if resumed { "resumed" } else { "failed" };
        self.metrics
            .pairs
            .migrations
            .with_label_values(&[self.model, reason, outcome])
            .inc();
    }

    /// A failed attempt will be retried as a new pair.
    pub(super) fn retried(&self) {
        self.stats.retries.fetch_add(1, Ordering::Relaxed);
    }

    /// One half's abort call was sent.
    pub(super) fn abort_call(&self) {
        self.stats.abort_calls.fetch_add(1, Ordering::Relaxed);
    }

    /// Where the time from a failure to both aborts answered goes.
    pub(super) fn abort_both_latency(&self) -> Histogram {
        self.series.abort_both.clone()
    }

    /// Nothing was dispatched: no worker could take the pair (an admission refusal).
    pub(super) fn refused(&self, e: &LockstepError) {
        self.metrics.refusal(self.model, e.code());
    }

    /// The request's pair task ended.
    pub(super) fn ended(&self, outcome: Outcome) {
        match outcome {
            Outcome::Completed => self.stats.completed.fetch_add(1, Ordering::Relaxed),
            Outcome::Aborted(_) => self.stats.aborted.fetch_add(1, Ordering::Relaxed),
        };
    }
}

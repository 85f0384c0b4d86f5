//! The pair lifecycle: dispatch both halves, hold decode output behind the commit barrier,
//! abort both halves on any failure, retry only when safe. One task owns each pair.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::time::{Instant as TokioInstant, sleep, sleep_until};
use tracing::Instrument;

use super::abort::{AbortPlan, Halves, abort_both, decode_chunk, prefill_answer};
use super::observer::{AbortContext, PairObserver};
use super::outcome::Failure;
use super::{
    AbortReason, Outcome, PairEvent, PairId, PairInfo, PairRegistry, PairState, PairStats,
};
use crate::audit::Audit;
use crate::backend::{
    DecodeChunk, Dispatch, HalfError, HalfFailure, PdBackend, SamplingParams, Side,
};
use crate::config::{RetryConfig, TimeoutConfig};
use crate::error::{LockstepError, Phase};
use crate::metrics::Metrics;
use crate::pool::{RouteKey, WorkerPool};

/// Everything the lifecycle of one model's pairs needs.
pub struct PairRuntime {
    /// Model name (for the registry and errors).
    pub model: Arc<str>,
    /// The backend speaking to the workers.
    pub backend: Arc<dyn PdBackend>,
    /// Prefill workers.
    pub prefill: Arc<WorkerPool>,
    /// Decode workers.
    pub decode: Arc<WorkerPool>,
    /// Live pairs (shared by all models).
    pub registry: Arc<PairRegistry>,
    /// Deadlines.
    pub timeouts: TimeoutConfig,
    /// Retry policy.
    pub retry: RetryConfig,
    /// Outcome counters.
    pub stats: Arc<PairStats>,
    /// Prometheus metrics (shared by all models).
    pub metrics: Arc<Metrics>,
    /// The audit log (shared by all models).
    pub audit: Arc<Audit>,
}

impl PairRuntime {
    /// The pair observer of this model: every metric, audit line and event of a pair goes there.
    fn observe(&self) -> PairObserver<'_> {
        PairObserver {
            model: &self.model,
            metrics: &self.metrics,
            audit: &self.audit,
            stats: &self.stats,
        }
    }

    /// Starts a request's pair task. Events arrive on the receiver; dropping the receiver is a
    /// client disconnect and aborts both halves. The join handle yields the terminal state.
    pub fn start(
        self: &Arc<Self>,
        input_ids: Arc<[u32]>,
        sampling: Arc<SamplingParams>,
        tenant: Option<Arc<str>>,
    ) -> (mpsc::Receiver<PairEvent>, tokio::task::JoinHandle<Outcome>) {
        let (tx, rx) = mpsc::channel(64);
        let me = self.clone();
        // The request's span (current here) parents every pair this request dispatches.
        let request_span = tracing::Span::current();
        let handle =
            tokio::spawn(
                async move { me.run(input_ids, sampling, tenant, tx, request_span).await },
            );
        (rx, handle)
    }

    async fn run(
        &self,
        input_ids: Arc<[u32]>,
        sampling: Arc<SamplingParams>,
        tenant: Option<Arc<str>>,
        tx: mpsc::Sender<PairEvent>,
        request_span: tracing::Span,
    ) -> Outcome {
        let started = TokioInstant::now();
        let mut attempt: u32 = 0;
        let mut avoid: (
            Option<Arc<crate::pool::Upstream>>,
            Option<Arc<crate::pool::Upstream>>,
        ) = (None, None);
        let outcome = loop {
            let key = RouteKey {
                tokens: &input_ids,
                salt: crate::tenant::cache_salt(tenant.as_deref()),
            };
            let Some(pg) = self.prefill.pick(avoid.0.as_ref(), Some(&key)) else {
                let e = self.no_worker(&self.prefill, "prefill");
                let _ = tx.send(PairEvent::Failed(e)).await;
                break Outcome::Aborted(AbortReason::NoWorker);
            };
            let Some(dg) = self.decode.pick(avoid.1.as_ref(), Some(&key)) else {
                let e = self.no_worker(&self.decode, "decode");
                let _ = tx.send(PairEvent::Failed(e)).await;
                break Outcome::Aborted(AbortReason::NoWorker);
            };
            let guard = self.registry.register(PairInfo {
                model: self.model.clone(),
                prefill: pg.worker().url.clone(),
                decode: dg.worker().url.clone(),
                started: Instant::now(),
                state: PairState::Dispatched,
                tenant: tenant.clone(),
            });
            let d = Dispatch {
                pair_id: guard.id(),
                prefill: pg.worker().clone(),
                decode: dg.worker().clone(),
                input_ids: input_ids.clone(),
                sampling: sampling.clone(),
                tenant: tenant.clone(),
            };
            self.observe().dispatched();
            let mut committed = false;
            let mut barrier = None;
            let dispatched = TokioInstant::now();
            let pair_span = tracing::info_span!(
                parent: &request_span,
                "pair",
                pair_id = %d.pair_id,
                model = %self.model,
                prefill = %d.prefill.url,
                decode = %d.decode.url,
                attempt,
            );
            let mut halves = Halves::default();
            match self
                .attempt(
                    &d,
                    &mut halves,
                    &tx,
                    started,
                    &guard,
                    &mut committed,
                    &mut barrier,
                )
                .instrument(pair_span.clone())
                .await
            {
                Ok(()) => {
                    self.observe().completed();
                    break Outcome::Completed;
                }
                Err(f) => {
                    guard.set_state(PairState::Aborting);
                    self.abort_both(&d, halves, TokioInstant::now());
                    let at = AbortContext {
                        tenant: tenant.as_deref(),
                        attempt,
                        committed,
                        started,
                        dispatched,
                        barrier,
                    };
                    self.observe().aborted(&pair_span, &d, &f, &at);
                    if !committed
                        && f.retry_safe
                        && attempt < self.retry.max_retries
                        && !tx.is_closed()
                        && !self.registry.is_draining()
                    {
                        attempt += 1;
                        self.observe().retried();
                        avoid = match f.failed_side {
                            Some(Side::Prefill) => (Some(d.prefill.clone()), None),
                            Some(Side::Decode) => (None, Some(d.decode.clone())),
                            None => (None, None),
                        };
                        drop((guard, pg, dg));
                        sleep(Duration::from_millis(self.retry.backoff_ms)).await;
                        // A drain that began during the backoff starts nothing new: the client
                        // gets this failure instead.
                        if !self.registry.is_draining() {
                            continue;
                        }
                    }
                    if f.reason != AbortReason::ClientGone {
                        // On a committed stream this becomes one error event; before, an error status.
                        let _ = tokio::time::timeout(
                            Duration::from_secs(1),
                            tx.send(PairEvent::Failed(f.error)),
                        )
                        .await;
                    }
                    break Outcome::Aborted(f.reason);
                }
            }
        };
        self.observe().ended(outcome);
        outcome
    }

    /// Sends the abort to both halves in the background, each call bounded by `abort_ms`, never
    /// delaying the client's error; the time from `failed_at` to both answered (or timed out) is
    /// the abort-both latency. Halves still open are kept until their answers end where the
    /// backend confirms aborts ([`super::abort`]).
    fn abort_both(&self, d: &Dispatch, halves: Halves, failed_at: TokioInstant) {
        self.observe().abort_call();
        self.observe().abort_call();
        let plan = AbortPlan {
            model: &self.model,
            call_bound: self.timeouts.abort(),
            confirm_bound: self.timeouts.abort_confirm(),
            failed_at,
            latency: self.observe().abort_both_latency(),
            // Counted until every call answered, so a drain waits for them (the pair is gone).
            in_flight: self.registry.aborts_started(),
        };
        abort_both(&self.backend, &self.metrics, d, halves, plan);
    }

    /// The refusal when a side has no worker to take the pair: all at their pair limit, or
    /// none healthy (counted as an admission refusal: nothing was dispatched).
    fn no_worker(&self, pool: &WorkerPool, side: &'static str) -> LockstepError {
        let model = self.model.to_string();
        let e = if pool.all_busy() {
            LockstepError::WorkersBusy { model, side }
        } else {
            LockstepError::NoHealthyWorker { model, side }
        };
        self.observe().refused(&e);
        e
    }

    /// One attempt: barrier, then streaming. `Err` means both halves must be aborted.
    #[allow(clippy::too_many_arguments)]
    async fn attempt(
        &self,
        d: &Dispatch,
        halves: &mut Halves,
        tx: &mpsc::Sender<PairEvent>,
        started: TokioInstant,
        guard: &super::PairGuard,
        committed: &mut bool,
        barrier: &mut Option<Duration>,
    ) -> Result<(), Failure> {
        let id = d.pair_id;
        let t = &self.timeouts;
        let dispatched = TokioInstant::now();
        let total_at = started + t.total();
        let prefill_at = dispatched + t.prefill();
        let first_at = dispatched + t.first_token();
        let expected = d.input_ids.len() as u64;

        // Each half's span lives as long as that half does; the backends take the trace context
        // for their upstream requests from the span current when they are created.
        let prefill_span = tracing::info_span!("prefill", worker = %d.prefill.url);
        let decode_span = tracing::info_span!("decode", worker = %d.decode.url);
        halves.prefill = Some(prefill_span.in_scope(|| self.backend.prefill(d)));
        let mut prefill_span = Some(prefill_span);
        halves.decode = Some(decode_span.in_scope(|| self.backend.decode(d)));
        let barrier_span = tracing::info_span!("commit_barrier");
        let mut kv_transfer: Option<tracing::Span> = None;
        let mut prefill_ok = false;
        let mut prefill_digest = None;
        let mut cached_tokens = 0;
        let mut first: Option<DecodeChunk> = None;

        // The commit barrier: no decode byte leaves before the prefill is verified and the decode's
        // first chunk agrees with it.
        while !prefill_ok || first.is_none() {
            tokio::select! {
                biased;
                why = guard.cancelled() => return Err(Failure::cancelled(id, why)),
                _ = tx.closed() => return Err(Failure::plain(LockstepError::Unavailable { message: "client went away".into() }, AbortReason::ClientGone)),
                _ = sleep_until(total_at) => return Err(Failure::deadline(id, Phase::Total)),
                _ = sleep_until(prefill_at), if !prefill_ok => return Err(Failure::deadline(id, Phase::Prefill)),
                _ = sleep_until(first_at), if first.is_none() => return Err(Failure::deadline(id, Phase::FirstToken)),
                r = prefill_answer(&mut halves.prefill), if !prefill_ok => {
                    prefill_span = None;
                    let report = r.map_err(|e| Failure::from_half(id, e))?;
                    if report.prompt_tokens != expected {
                        return Err(Failure::integrity(id, "prefill_prompt_count", format!(
                            "prefill computed {} prompt tokens, lockstep sent {expected}", report.prompt_tokens)));
                    }
                    if let Some(n) = report.cached_tokens {
                        self.observe().cached_tokens(n);
                        if d.tenant.is_some() {
                            cached_tokens = n.min(expected);
                        }
                    }
                    prefill_ok = true;
                    prefill_digest = report.kv_digest;
                    // Prefill done: from here until the decode's first chunk, the KV moves to the
                    // decode worker and its first step runs.
                    if first.is_none() {
                        kv_transfer = Some(tracing::info_span!(parent: &barrier_span, "kv_transfer"));
                    }
                }
                c = decode_chunk(&mut halves.decode), if first.is_none() => {
                    let chunk = match c {
                        Some(Ok(chunk)) => chunk,
                        Some(Err(e)) => return Err(Failure::from_half(id, e)),
                        None => return Err(Failure::from_half(id, HalfError { side: Side::Decode, failure: HalfFailure::Protocol("stream ended before any token".into()) })),
                    };
                    check_decode_count(id, &chunk, expected)?;
                    if chunk.prompt_tokens.is_none() && self.backend.decode_counts_prompt() {
                        // This backend always reports the count: its absence is no proof.
                        return Err(Failure::integrity(id, "decode_prompt_count", "the decode's first chunk reports no prompt count".into()));
                    }
                    first = Some(chunk);
                    kv_transfer = None;
                }
            }
        }
        drop((kv_transfer, prefill_span, barrier_span));

        // Verified KV: the digest the decode imported must be the one the prefill sent; neither
        // side is trusted alone.
        let decode_digest = first.as_ref().and_then(|c| c.kv_digest);
        if prefill_digest != decode_digest {
            return Err(Failure::integrity(
                id,
                "kv_digest_mismatch",
                format!(
                    "KV digest mismatch: prefill sent {}, decode imported {}",
                    digest_text(prefill_digest),
                    digest_text(decode_digest)
                ),
            ));
        }
        guard.set_state(PairState::Committed);
        *committed = true;
        let waited = dispatched.elapsed();
        *barrier = Some(waited);
        let tokens = self.observe().committed(waited);
        let mut last_sent: Option<TokioInstant> = None;
        let gone = || {
            Failure::plain(
                LockstepError::Unavailable {
                    message: "client went away".into(),
                },
                AbortReason::ClientGone,
            )
        };
        if tx
            .send(PairEvent::Committed {
                pair_id: id,
                prompt_tokens: expected,
                cached_tokens,
            })
            .await
            .is_err()
        {
            return Err(gone());
        }
        let Some(mut chunk) = first else {
            return Err(Failure::plain(
                LockstepError::Unavailable {
                    message: "internal: barrier passed without a chunk".into(),
                },
                AbortReason::DecodeFailed,
            ));
        };
        loop {
            let finished = chunk.finish.is_some();
            // A client that stops reading fills the channel (and the socket under it): the send
            // then waits, bounded by `client_idle_ms`, and stays abortable.
            tokio::select! {
                biased;
                why = guard.cancelled() => return Err(Failure::cancelled(id, why)),
                sent = tx.send(PairEvent::Chunk(chunk)) => match sent {
                    Ok(()) => {
                        let now = TokioInstant::now();
                        tokens.sent(now, started, last_sent);
                        last_sent = Some(now);
                    }
                    Err(_) => return Err(gone()),
                },
                _ = sleep_until(total_at) => return Err(Failure::deadline(id, Phase::Total)),
                _ = sleep(t.client_idle()) => return Err(Failure::deadline(id, Phase::ClientIdle)),
            }
            if finished {
                return Ok(());
            }
            tokio::select! {
                biased;
                why = guard.cancelled() => return Err(Failure::cancelled(id, why)),
                _ = tx.closed() => return Err(gone()),
                _ = sleep_until(total_at) => return Err(Failure::deadline(id, Phase::Total)),
                _ = sleep(t.idle()) => return Err(Failure::deadline(id, Phase::Idle)),
                c = decode_chunk(&mut halves.decode) => match c {
                    Some(Ok(c)) => {
                        check_decode_count(id, &c, expected)?;
                        chunk = c;
                    }
                    Some(Err(e)) => return Err(Failure::from_half(id, e)),
                    None => return Err(Failure::from_half(id, HalfError { side: Side::Decode, failure: HalfFailure::Protocol("stream ended without a finish reason".into()) })),
                }
            }
        }
    }
}

fn digest_text(d: Option<u64>) -> String {
    d.map_or_else(|| "none".into(), |d| format!("{d:016x}"))
}

fn check_decode_count(id: PairId, chunk: &DecodeChunk, expected: u64) -> Result<(), Failure> {
    match chunk.prompt_tokens {
        Some(n) if n != expected => Err(Failure::integrity(
            id,
            "decode_prompt_count",
            format!("decode read {n} prompt tokens, lockstep sent {expected}"),
        )),
        _ => Ok(()),
    }
}

impl std::fmt::Debug for PairRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PairRuntime")
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

//! The pair lifecycle: dispatch both halves, hold decode output behind the commit barrier,
//! abort both halves on any failure, retry only when safe. One task owns each pair.

mod carry;
mod waits;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::time::{Instant as TokioInstant, sleep};
use tracing::Instrument;

use lockstep_prompt::Detok;

use super::abort::{AbortPlan, Halves, abort_both};
use super::machine::{Action, Env, Limits, Machine, Observation, Stage, Verdict};
use super::observer::{AbortContext, Migration, PairObserver, TokenTimes};
use super::outcome::Failure;
use super::{Outcome, PairEvent, PairGuard, PairId, PairInfo, PairRegistry, PairState, PairStats};
use crate::backend::{DecodeChunk, Dispatch, HalfError, PdBackend, SamplingParams, Side};
use lockstep_core::audit::Audit;
use lockstep_core::config::{FailoverConfig, RetryConfig, TimeoutConfig};
use lockstep_core::error::LockstepError;
use lockstep_core::metrics::{Metrics, ModelMetrics};
use lockstep_routing::pool::{
    LoadGuard, PrefillChoice, PrefillPin, RouteKey, Upstream, WorkerPool, pick_pair,
};

/// Everything the lifecycle of one model's pairs needs.
pub struct ModelPairs {
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
    /// Migration of committed streams (`[models.failover]`).
    pub failover: FailoverConfig,
    /// The model's token ids to text, where the text of ids is the concatenation of each
    /// id's (a byte-level tokenizer): a migration checks with it that the text delivered is
    /// the delivered ids' ([`unsent`]). `None`: nothing is carried.
    pub detok: Option<Detok>,
    /// Outcome counters.
    pub stats: Arc<PairStats>,
    /// Prometheus metrics (shared by all models).
    pub metrics: Arc<Metrics>,
    /// The audit log (shared by all models).
    pub audit: Arc<Audit>,
    /// This model's series of `metrics` ([`ModelMetrics::new`]).
    pub series: ModelMetrics,
    /// Requests waiting for a slot ([`super::queue`]).
    pub queue: super::FairQueue,
    /// The queue's settings (`models[].queue`).
    pub queue_cfg: lockstep_core::config::QueueConfig,
}

impl ModelPairs {
    /// The pair observer of this model: every metric, audit line and event of a pair goes there.
    fn observe(&self) -> PairObserver<'_> {
        PairObserver {
            model: &self.model,
            metrics: &self.metrics,
            series: &self.series,
            audit: &self.audit,
            stats: &self.stats,
        }
    }

    /// Starts a request's pair task. Events arrive on the receiver; dropping the receiver is a
    /// client disconnect and aborts both halves. The join handle yields the terminal state.
    /// `ids_json`: the ids as JSON where admission already wrote them (else written at the first
    /// dispatch that needs them). `prefill`: where the prefill runs, as admission settled it.
    pub fn start(
        self: &Arc<Self>,
        input_ids: Arc<[u32]>,
        ids_json: Option<Bytes>,
        sampling: Arc<SamplingParams>,
        tenant: Option<Arc<lockstep_tenancy::tenant::Tenant>>,
        prefill: PrefillPin,
    ) -> (mpsc::Receiver<PairEvent>, tokio::task::JoinHandle<Outcome>) {
        let (tx, rx) = mpsc::channel(64);
        let me = self.clone();
        // The request's span (current here) parents every pair this request dispatches.
        let request_span = tracing::Span::current();
        let handle = tokio::spawn(async move {
            let req = Request {
                salt: lockstep_tenancy::tenant::salt_of(tenant.as_deref()),
                weight: tenant.as_ref().map_or(1, |t| t.weight),
                priority: tenant.as_ref().map_or(0, |t| t.priority),
                tenant: tenant.map(|t| t.name.clone()),
                input_ids,
                ids_json: ids_json.map(std::sync::OnceLock::from).unwrap_or_default(),
                sampling,
                span: request_span,
                prefill,
            };
            me.run(req, tx).await
        });
        (rx, handle)
    }

    async fn run(&self, mut req: Request, tx: mpsc::Sender<PairEvent>) -> Outcome {
        let started = TokioInstant::now();
        let total_at = started + self.timeouts.total();
        let expected = req.input_ids.len() as u64;
        let mut machine = Machine::new(Limits {
            expected,
            decode_counts_prompt: self.backend.capabilities().decode_counts_prompt,
            max_retries: self.retry.max_retries,
            max_migrations: self.failover.max_migrations,
            max_migrated_tokens: self.failover.max_migrated_tokens,
            max_new: req.sampling.max_new_tokens,
            resumable: self.backend.resumes(&req.sampling),
        });
        // What a migration needs (kept only where one may happen).
        let mut carry = carry::Carry::new(
            self.failover.max_migrations > 0,
            req.input_ids.clone(),
            req.sampling.clone(),
        );
        let mut avoid: Avoid = (None, None);
        let mut cur: Option<Attempt> = None;
        let mut failure: Option<Failure> = None;
        let mut tokens: Option<TokenTimes> = None;
        let mut last_sent: Option<TokioInstant> = None;
        let outcome = loop {
            // Wait for whatever the stage awaits: that is the machine's next input.
            let input = match (machine.stage(), cur.as_mut()) {
                (Stage::Done(o), _) => break o,
                (Stage::Picking, _) => {
                    match self.pick_queued(&req, &avoid, machine.attempt(), &tx).await {
                        Ok(a) => {
                            if let Some(m) = &carry.migration {
                                a.span.follows_from(m.span.clone());
                            }
                            cur = Some(a);
                            Observation::Picked
                        }
                        Err(side) => Observation::NoWorker(side),
                    }
                }
                (Stage::Backoff(_), _) => {
                    sleep(Duration::from_millis(self.retry.backoff_ms)).await;
                    Observation::BackoffOver
                }
                (Stage::Barrier { prefill, first }, Some(a)) => {
                    let span = a.span.clone();
                    self.barrier_wait(a, prefill.is_some(), first.is_some(), &tx, total_at)
                        .instrument(span)
                        .await
                }
                (Stage::Committing { .. } | Stage::Forwarding { .. }, Some(a)) => {
                    let span = a.span.clone();
                    let input = self.deliver(a, &tx, total_at).instrument(span).await;
                    if input == Observation::Delivered && a.delivered_chunk {
                        let now = TokioInstant::now();
                        if let Some(t) = &tokens {
                            t.sent(now, started, last_sent);
                        }
                        last_sent = Some(now);
                        carry.delivered();
                    }
                    input
                }
                (Stage::Streaming, Some(a)) => {
                    let span = a.span.clone();
                    self.stream_wait(a, &tx, total_at).instrument(span).await
                }
                (_, None) => unreachable!("an attempt's stage without its attempt"),
            };
            // Only a failure of a committed stream that may migrate needs the text checked.
            let may_carry = carry.keeps()
                && machine.committed()
                && machine.migrations() < self.failover.max_migrations
                && matches!(
                    input,
                    Observation::HalfFailed { .. }
                        | Observation::DecodeEnded
                        | Observation::Deadline(_)
                );
            let env = Env {
                client_open: !tx.is_closed(),
                draining: self.registry.is_draining(),
                unsent: if may_carry {
                    carry.unsent(self.detok.as_ref())
                } else {
                    Some(0)
                },
            };
            let mut fail = None;
            // The attempt's own prompt count (a migration's is the prompt and what it carried).
            let attempt_expected = machine.expected();
            for action in machine.step(input, env) {
                match (action, cur.as_mut()) {
                    (Action::Dispatch, Some(a)) => {
                        self.dispatch(a);
                        if let Some(m) = &carry.migration {
                            let tenant = req.tenant.as_deref();
                            self.observe().migrating(
                                &a.d,
                                m,
                                tenant,
                                (machine.attempt(), machine.migrations()),
                            );
                        }
                    }
                    (Action::PrefillVerified, Some(a)) => {
                        a.prefill_verified(self, req.tenant.is_some(), expected);
                    }
                    (Action::Commit, Some(a)) => {
                        a.guard.set_state(PairState::Committed);
                        let waited = a.dispatched.elapsed();
                        a.barrier = Some(waited);
                        a.barrier_span = None;
                        tokens = Some(self.observe().committed(waited));
                        a.outgoing = Some(PairEvent::Committed {
                            pair_id: a.d.pair_id,
                            prompt_tokens: expected,
                            cached_tokens: a.cached_tokens,
                            prompt_logprobs: a.prompt_logprobs.take(),
                        });
                    }
                    (Action::Resume, Some(a)) => {
                        // The client was told of the commit by the first pair: nothing to send.
                        a.guard.set_state(PairState::Committed);
                        a.barrier = Some(a.dispatched.elapsed());
                        a.barrier_span = None;
                        if let Some(m) = carry.migration.take() {
                            self.observe().migrated(m.reason, true);
                        }
                    }
                    (Action::Forward, Some(a)) => {
                        // A migrated pair counts its completion tokens from its own start.
                        let carried = machine.expected() - expected;
                        a.outgoing = a.held.take().and_then(|mut c| {
                            c.completion_tokens += carried;
                            match carry.forward(&mut c) {
                                Ok(()) => Some(PairEvent::Chunk(c)),
                                Err(e) => {
                                    a.mismatch = Some(e);
                                    None
                                }
                            }
                        });
                    }
                    (Action::Migrate { verdict, carried }, Some(a)) => {
                        if let Some(m) = carry.migration.take() {
                            // The previous migration's pair failed before its barrier.
                            self.observe().migrated(m.reason, false);
                        }
                        avoid = match verdict.failed_side() {
                            Some(Side::Prefill) => (Some(a.d.prefill.clone()), None),
                            _ => (None, Some(a.d.decode.clone())),
                        };
                        // What the client lacks the text of is generated again.
                        carry.migrate(carried);
                        req.carry(&carry.original.0, carry.carried_ids(), &carry.original.1);
                        carry.migration = Some(Migration {
                            from: a.d.pair_id,
                            reason: verdict.migration_reason().unwrap_or("decode_failed"),
                            carried,
                            started,
                            span: a.span.id(),
                        });
                        // The failed pair leaves the registry and its workers' counts now.
                        cur = None;
                    }
                    (Action::Abort(v), Some(a)) => {
                        let f = Failure::of(a.d.pair_id, v, a.failed_half.take(), attempt_expected);
                        a.guard.set_state(PairState::Aborting);
                        self.abort_both(&a.d, std::mem::take(&mut a.halves), TokioInstant::now());
                        let at = AbortContext {
                            tenant: req.tenant.as_deref(),
                            attempt: machine.attempt(),
                            committed: machine.committed(),
                            started,
                            dispatched: a.dispatched,
                            barrier: a.barrier,
                        };
                        self.observe().aborted(&a.span, &a.d, &f, &at);
                        failure = Some(f);
                    }
                    (Action::Retry(v), Some(a)) => {
                        self.observe().retried();
                        avoid = match v.failed_side() {
                            Some(Side::Prefill) => (Some(a.d.prefill.clone()), None),
                            Some(Side::Decode) => (None, Some(a.d.decode.clone())),
                            None => (None, None),
                        };
                        // The failed pair leaves the registry and its workers' counts now.
                        cur = None;
                    }
                    (Action::Fail(Verdict::NoWorker(side)), _) => {
                        fail = Some(self.no_worker(side));
                    }
                    (Action::Fail(v), _) => {
                        let pair_id = cur.as_ref().map_or(PairId::from_raw(0), |a| a.d.pair_id);
                        let f = failure
                            .take()
                            .unwrap_or_else(|| Failure::of(pair_id, v, None, attempt_expected));
                        fail = Some(f.error);
                    }
                    (Action::Finish(Outcome::Completed), _) => self.observe().completed(),
                    (Action::Finish(_), _) => {
                        if let Some(m) = carry.migration.take() {
                            self.observe().migrated(m.reason, false);
                        }
                    }
                    (_, None) => unreachable!("an attempt's action without its attempt"),
                }
            }
            if let Some(error) = fail {
                // On a committed stream this becomes one error event; before, an error status.
                let _ =
                    tokio::time::timeout(Duration::from_secs(1), tx.send(PairEvent::Failed(error)))
                        .await;
            }
        };
        self.observe().ended(outcome);
        outcome
    }

    /// Picks both workers (avoiding the ones a retry names), registers the pair and opens its
    /// span; `Err` names the side no worker could take.
    pub(super) fn pick(&self, req: &Request, avoid: &Avoid, attempt: u32) -> Result<Attempt, Side> {
        let key = RouteKey {
            tokens: &req.input_ids,
            salt: req.salt,
        };
        let (pg, dg) = match &req.prefill {
            // A decode serving alone: no prefill slot, the decode worker stands for both.
            PrefillPin::Alone if self.backend.capabilities().serves_alone => {
                let d = self.decode.pick(avoid.1.as_ref(), Some(&key));
                (None, d.ok_or(Side::Decode)?)
            }
            PrefillPin::Alone => return Err(Side::Prefill),
            pin => {
                let choice = match pin {
                    PrefillPin::At(url) => PrefillChoice::Pinned(url),
                    _ => PrefillChoice::Pick {
                        avoid: avoid.0.as_ref(),
                    },
                };
                let p = pick_pair(
                    &self.prefill,
                    &self.decode,
                    Some(&key),
                    choice,
                    avoid.1.as_ref(),
                )?;
                (Some(p.prefill), p.decode)
            }
        };
        let prefill = pg.as_ref().unwrap_or(&dg).worker().clone();
        let guard = self.registry.register(PairInfo {
            model: self.model.clone(),
            prefill: prefill.url.clone(),
            decode: dg.worker().url.clone(),
            started: Instant::now(),
            state: PairState::Dispatched,
            tenant: req.tenant.clone(),
        });
        let d = Dispatch {
            pair_id: guard.id(),
            alone: pg.is_none(),
            prefill,
            decode: dg.worker().clone(),
            input_ids: req.input_ids.clone(),
            sampling: req.sampling.clone(),
            tenant: req.tenant.clone(),
            salt: req.salt,
            ids_json: req.ids_json.clone(),
        };
        let span = tracing::info_span!(
            parent: &req.span,
            "pair",
            pair_id = %d.pair_id,
            model = %self.model,
            prefill = %d.prefill.url,
            decode = %d.decode.url,
            attempt,
        );
        Ok(Attempt {
            d,
            guard,
            _load: (pg, dg),
            span,
            dispatched: TokioInstant::now(),
            halves: Halves::default(),
            ids_seen: 0,
            prefill_span: None,
            decode_span: None,
            barrier_span: None,
            kv_transfer: None,
            reported_cached: None,
            prompt_logprobs: None,
            cached_tokens: 0,
            held: None,
            failed_half: None,
            outgoing: None,
            delivered_chunk: false,
            barrier: None,
            mismatch: None,
        })
    }

    /// Sends both halves to their workers. Each half's span lives as long as that half does; the
    /// backends take the trace context for their upstream requests from the span current when
    /// they are created.
    fn dispatch(&self, a: &mut Attempt) {
        self.observe().dispatched();
        a.dispatched = TokioInstant::now();
        let prefill_span =
            tracing::info_span!(parent: &a.span, "prefill", worker = %a.d.prefill.url);
        let decode_span = tracing::info_span!(parent: &a.span, "decode", worker = %a.d.decode.url);
        a.halves.prefill = Some(prefill_span.in_scope(|| self.backend.prefill(&a.d)));
        a.halves.decode = Some(decode_span.in_scope(|| self.backend.decode(&a.d)));
        a.prefill_span = Some(prefill_span);
        a.decode_span = Some(decode_span);
        a.barrier_span = Some(tracing::info_span!(parent: &a.span, "commit_barrier"));
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
    fn no_worker(&self, side: Side) -> LockstepError {
        let pool = match side {
            Side::Prefill => &self.prefill,
            Side::Decode => &self.decode,
        };
        let model = self.model.to_string();
        let side = side.as_str();
        let e = if pool.all_busy() {
            LockstepError::WorkersBusy { model, side }
        } else {
            LockstepError::NoHealthyWorker { model, side }
        };
        self.observe().refused(&e);
        e
    }
}

/// How many of the delivered ids at the end the client lacks the whole text of: the fewest
/// dropped from the end so that the rest decode to exactly the text delivered (a character
/// split across tokens waits for its last byte; a worker may hold text back for a stop
/// string). `None` where no such prefix is found within a bound, or there is no `detok`; and
/// where the text delivered ends with the start of a stop string: a worker that does not hold
/// such text back (SGLang) would not match the string across the two pairs.
pub(in crate::pair) fn unsent(
    detok: Option<&Detok>,
    ids: &[u32],
    text: &str,
    stop: &[String],
) -> Option<u64> {
    /// Ids a character or a stop string's holdback can lag behind the text.
    const LAG: usize = 64;
    let detok = detok?;
    let straddles = stop
        .iter()
        .any(|s| (1..s.len()).any(|n| s.is_char_boundary(n) && text.ends_with(&s[..n])));
    if straddles {
        return None;
    }
    (0..=ids.len().min(LAG))
        .find(|&back| detok(&ids[..ids.len() - back]) == text)
        .map(|back| back as u64)
}

/// What a request brings to each of its attempts.
pub(super) struct Request {
    input_ids: Arc<[u32]>,
    /// The ids as JSON, where admission wrote them; each attempt's [`Dispatch`] starts from it.
    ids_json: std::sync::OnceLock<Bytes>,
    sampling: Arc<SamplingParams>,
    pub(super) tenant: Option<Arc<str>>,
    /// The tenant's prefix-cache salt (an HMAC: computed once, not per attempt).
    salt: u64,
    /// The request's span: it parents every pair the request dispatches.
    span: tracing::Span,
    /// Where its prefill runs.
    prefill: PrefillPin,
    /// Its tenant's share and band when it waits for a slot.
    pub(super) weight: u32,
    pub(super) priority: i32,
}

impl Request {
    /// The request continued on a new pair: its prompt is the client's prompt and the tokens
    /// delivered, with `max_tokens` less what they used (the other parameters carried as
    /// they are).
    fn carry(&mut self, prompt: &Arc<[u32]>, delivered: &[u32], sampling: &SamplingParams) {
        self.input_ids = prompt.iter().chain(delivered).copied().collect();
        self.ids_json = std::sync::OnceLock::new();
        let mut s = sampling.clone();
        s.max_new_tokens = s.max_new_tokens.saturating_sub(delivered.len() as u64);
        s.resumed = delivered.len() as u32;
        self.sampling = Arc::new(s);
    }
}

/// The workers a retry avoids: the side that failed.
pub(super) type Avoid = (Option<Arc<Upstream>>, Option<Arc<Upstream>>);

/// One attempt's pair: its registration, workers, halves, spans, and what waits for the client.
pub(super) struct Attempt {
    d: Dispatch,
    /// The registry entry: the pair is live while this is held.
    guard: PairGuard,
    /// Both workers' in-flight counts, held as long as the attempt (no prefill slot for a
    /// decode serving alone).
    _load: (Option<LoadGuard>, LoadGuard),
    span: tracing::Span,
    dispatched: TokioInstant,
    halves: Halves,
    /// Token ids the decode's chunks carried so far.
    ids_seen: u64,
    prefill_span: Option<tracing::Span>,
    decode_span: Option<tracing::Span>,
    barrier_span: Option<tracing::Span>,
    /// From the prefill's verified answer until the decode's first chunk: the KV moves to the
    /// decode worker and its first step runs.
    kv_transfer: Option<tracing::Span>,
    /// The prefix-cache count the prefill reported.
    reported_cached: Option<u64>,
    /// The prompt's log-probabilities the prefill reported, for the commit.
    prompt_logprobs: Option<Vec<crate::backend::TokenLogprobs>>,
    /// What the client is told of it (0 without a tenant).
    cached_tokens: u64,
    /// The decode chunk the machine is judging or holding.
    held: Option<DecodeChunk>,
    /// The failed half's own error, for the machine's verdict.
    failed_half: Option<HalfError>,
    /// What the client is to receive next.
    outgoing: Option<PairEvent>,
    /// The last event delivered was a chunk (a token's time).
    delivered_chunk: bool,
    /// How long the barrier held, once it passed.
    barrier: Option<Duration>,
    /// A migrated pair generated other tokens than the ones the client was given already.
    mismatch: Option<HalfError>,
}

impl std::fmt::Debug for ModelPairs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelPairs")
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

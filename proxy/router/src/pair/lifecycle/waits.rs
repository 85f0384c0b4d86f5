//! The lifecycle's waits: what each stage awaits (the barrier, a delivery, the next chunk),
//! turned into the machine's next [`Observation`], and the attempt's own bookkeeping of them.

use tokio::sync::mpsc;
use tokio::time::{Instant as TokioInstant, sleep, sleep_until};

use super::{Attempt, ModelPairs};
use crate::backend::{DecodeChunk, HalfError, HalfFailure};
use crate::pair::PairEvent;
use crate::pair::abort::{decode_chunk, prefill_answer};
use crate::pair::machine::Observation;
use lockstep_core::error::Phase;

impl ModelPairs {
    /// The commit barrier's wait: no decode byte leaves before the prefill is verified and the
    /// decode's first chunk agrees with it (the machine judges both).
    pub(super) async fn barrier_wait(
        &self,
        a: &mut Attempt,
        prefill_in: bool,
        first_in: bool,
        tx: &mpsc::Sender<PairEvent>,
        total_at: TokioInstant,
    ) -> Observation {
        let prefill_at = a.dispatched + self.timeouts.prefill();
        let first_at = a.dispatched + self.timeouts.first_token();
        tokio::select! {
            biased;
            why = a.guard.cancelled() => Observation::Cancelled(why),
            _ = tx.closed() => Observation::ClientGone,
            _ = sleep_until(total_at) => Observation::Deadline(Phase::Total),
            _ = sleep_until(prefill_at), if !prefill_in => Observation::Deadline(Phase::Prefill),
            _ = sleep_until(first_at), if !first_in => Observation::Deadline(Phase::FirstToken),
            r = prefill_answer(&mut a.halves.prefill), if !prefill_in => {
                a.prefill_span = None;
                match r {
                    Ok(report) => {
                        a.reported_cached = report.cached_tokens;
                        a.prompt_logprobs = report.prompt_logprobs;
                        Observation::Prefill { prompt_tokens: report.prompt_tokens, digest: report.kv_digest }
                    }
                    Err(e) => a.half_failed(e),
                }
            }
            c = decode_chunk(&mut a.halves.decode), if !first_in => {
                a.kv_transfer = None;
                a.decoded(c)
            }
        }
    }

    /// Hands the outgoing event to the client. A client that stops reading fills the channel
    /// (and the socket under it): the send then waits, bounded by `client_idle_ms`, and stays
    /// abortable.
    pub(super) async fn deliver(
        &self,
        a: &mut Attempt,
        tx: &mpsc::Sender<PairEvent>,
        total_at: TokioInstant,
    ) -> Observation {
        if let Some(e) = a.mismatch.take() {
            return a.half_failed(e);
        }
        let Some(event) = a.outgoing.take() else {
            return Observation::Delivered;
        };
        a.delivered_chunk = matches!(event, PairEvent::Chunk(_));
        tokio::select! {
            biased;
            why = a.guard.cancelled() => Observation::Cancelled(why),
            sent = tx.send(event) => match sent {
                Ok(()) => Observation::Delivered,
                Err(_) => Observation::ClientGone,
            },
            _ = sleep_until(total_at) => Observation::Deadline(Phase::Total),
            _ = sleep(self.timeouts.client_idle()) => Observation::Deadline(Phase::ClientIdle),
        }
    }

    /// Waits for the decode's next chunk after commit.
    pub(super) async fn stream_wait(
        &self,
        a: &mut Attempt,
        tx: &mpsc::Sender<PairEvent>,
        total_at: TokioInstant,
    ) -> Observation {
        tokio::select! {
            biased;
            why = a.guard.cancelled() => Observation::Cancelled(why),
            _ = tx.closed() => Observation::ClientGone,
            _ = sleep_until(total_at) => Observation::Deadline(Phase::Total),
            _ = sleep(self.timeouts.idle()) => Observation::Deadline(Phase::Idle),
            c = decode_chunk(&mut a.halves.decode) => a.decoded(c),
        }
    }
}

impl Attempt {
    pub(super) fn half_failed(&mut self, e: HalfError) -> Observation {
        let input = Observation::HalfFailed {
            side: e.side,
            retry_safe: e.retry_safe(),
            integrity: matches!(e.failure, HalfFailure::Integrity(_)),
            migratable: e.migratable(),
        };
        self.failed_half = Some(e);
        input
    }

    /// The decode's next item as the machine's input; a chunk is held until it is judged.
    fn decoded(&mut self, c: Option<Result<DecodeChunk, HalfError>>) -> Observation {
        match c {
            Some(Ok(chunk)) => {
                // The chunk's ids are all its tokens when they bring the ids seen to the
                // worker's own completion count; else what it delivered cannot be carried.
                let n = chunk.token_ids.len() as u64;
                let tokens = (self.ids_seen + n == chunk.completion_tokens)
                    .then(|| u32::try_from(n).ok())
                    .flatten();
                self.ids_seen += n;
                let input = Observation::Decode {
                    prompt_tokens: chunk.prompt_tokens,
                    digest: chunk.kv_digest,
                    last: chunk.finish.is_some(),
                    tokens,
                };
                self.held = Some(chunk);
                input
            }
            Some(Err(e)) => self.half_failed(e),
            None => Observation::DecodeEnded,
        }
    }

    /// The machine took the prefill's answer: count its prefix-cache report (told to a tenant's
    /// client only: the cache is shared otherwise, and the count would tell one caller what
    /// another sent; and only where the backend's cache is known to be the tenant's own) and time the KV's move until the decode's first chunk.
    pub(super) fn prefill_verified(&mut self, rt: &ModelPairs, tenant: bool, expected: u64) {
        if let Some(n) = self.reported_cached {
            rt.observe().cached_tokens(n);
            if tenant && rt.backend.capabilities().cache_report_is_tenants_own {
                self.cached_tokens = n.min(expected);
            }
        }
        if let (None, Some(barrier)) = (&self.held, &self.barrier_span) {
            self.kv_transfer = Some(tracing::info_span!(parent: barrier, "kv_transfer"));
        }
    }
}

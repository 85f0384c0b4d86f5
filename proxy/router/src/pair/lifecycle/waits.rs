//! The lifecycle's waits: what each stage awaits (the barrier, a delivery, the next chunk),
//! turned into the machine's next [`Observation`], and the attempt's own bookkeeping of them.

use tokio::sync::mpsc;
use tokio::time::{Instant as TokioInstant, sleep, sleep_until};

use super::{Attempt, ModelPairs};
use crate::backend::{DecodeChunk, HalfError, HalfFailure, Side};
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
            if tenant && rt.backend.cache_report_is_tenants_own() {
                self.cached_tokens = n.min(expected);
            }
        }
        if let (None, Some(barrier)) = (&self.held, &self.barrier_span) {
            self.kv_transfer = Some(tracing::info_span!(parent: barrier, "kv_transfer"));
        }
    }
}

/// What a migrated stream owes the client: the delivered ids it generates again (the client had
/// their ids but not their text), and the completion count it was last told.
#[derive(Debug, Default)]
pub(super) struct Again {
    ids: Vec<u32>,
    told: u64,
}

impl Again {
    /// A migration will generate `ids` again.
    pub(super) fn expect(&mut self, ids: &[u32]) {
        self.ids = ids.to_vec();
    }

    /// A chunk on its way to the client: the ids it generates again are taken out of it (the
    /// client has them), and they must be the ones the client has (greedy, or lockstep's engine
    /// resuming a seed, gives them again; another draw would make the ids the client holds
    /// another answer's: an integrity failure, never migrated). Its completion count never goes
    /// back below what the client was told.
    pub(super) fn forward(&mut self, c: &mut DecodeChunk) -> Result<(), HalfError> {
        let n = c
            .token_ids
            .iter()
            .zip(&self.ids)
            .take_while(|(a, b)| a == b)
            .count();
        if n < c.token_ids.len().min(self.ids.len()) {
            return Err(HalfError {
                side: Side::Decode,
                failure: HalfFailure::Integrity(
                    "the new pair generated other tokens than the ones already delivered".into(),
                ),
            });
        }
        c.token_ids.drain(..n);
        // Their log-probabilities went with them the first time.
        c.logprobs.drain(..n.min(c.logprobs.len()));
        self.ids.drain(..n);
        self.told = self.told.max(c.completion_tokens);
        c.completion_tokens = self.told;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Again;
    use crate::backend::{DecodeChunk, HalfFailure};

    fn chunk(ids: &[u32], completion_tokens: u64) -> DecodeChunk {
        DecodeChunk {
            token_ids: ids.to_vec(),
            completion_tokens,
            ..DecodeChunk::default()
        }
    }

    #[test]
    fn tokens_generated_again_reach_the_client_once_and_others_are_an_integrity_failure() {
        let mut a = Again::default();
        a.forward(&mut chunk(&[1, 2, 3], 3))
            .expect("a first pair's chunk");
        // Carried 1 of 3 delivered: the new pair's first chunks give 2 and 3 again.
        a.expect(&[2, 3]);
        let mut c = chunk(&[2], 2);
        a.forward(&mut c).expect("the same token");
        assert_eq!((c.token_ids.clone(), c.completion_tokens), (vec![], 3));
        let mut c = chunk(&[3, 4], 4);
        let lp = |logprob| crate::backend::TokenLogprobs {
            logprob,
            top: Vec::new(),
        };
        c.logprobs = vec![lp(-1.0), lp(-2.0)];
        a.forward(&mut c).expect("the same token, then a new one");
        assert_eq!((c.token_ids.clone(), c.completion_tokens), (vec![4], 4));
        assert_eq!(c.logprobs, vec![lp(-2.0)], "the new token's only");
        // Another draw where the client holds a token already: never delivered.
        let mut a = Again::default();
        a.expect(&[7, 8]);
        let e = a.forward(&mut chunk(&[7, 9], 2)).expect_err("other tokens");
        assert!(matches!(e.failure, HalfFailure::Integrity(_)), "{e}");
    }
}

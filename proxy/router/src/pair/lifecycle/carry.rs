//! What a committed stream carries to a new pair when it migrates: the request as the client
//! sent it, the token ids and text the client has, those in flight, the ids the new pair must
//! give again ([`Again`]), and the migration under way. The lifecycle (`ModelPairs::run`) keeps
//! one [`Carry`] per request and asks it; the machine decides whether and how much to carry.

use std::sync::Arc;

use crate::backend::{DecodeChunk, HalfError, HalfFailure, SamplingParams, Side};
use crate::pair::observer::Migration;
use lockstep_prompt::Detok;

/// A request's migration state.
pub(super) struct Carry {
    /// Ids and text are kept only where a migration may happen.
    keep: bool,
    /// The request as the client sent it: its prompt and its sampling.
    pub(super) original: (Arc<[u32]>, Arc<SamplingParams>),
    /// The ids, and their text, the client has whole.
    delivered_ids: Vec<u32>,
    delivered_text: String,
    /// The chunk on its way to the client.
    in_flight_ids: Vec<u32>,
    in_flight_text: String,
    /// Delivered ids a migration generates again, and the completion count last told.
    again: Again,
    /// The migration under way: its pair has not passed its barrier yet.
    pub(super) migration: Option<Migration>,
}

impl Carry {
    /// The state of a request with `prompt` and `sampling`; `keep`: whether it may migrate.
    pub(super) fn new(keep: bool, prompt: Arc<[u32]>, sampling: Arc<SamplingParams>) -> Carry {
        Carry {
            keep,
            original: (prompt, sampling),
            delivered_ids: Vec::new(),
            delivered_text: String::new(),
            in_flight_ids: Vec::new(),
            in_flight_text: String::new(),
            again: Again::default(),
            migration: None,
        }
    }

    /// Whether this request may migrate (its ids and text are kept).
    pub(super) fn keeps(&self) -> bool {
        self.keep
    }

    /// The chunk in flight reached the client: its ids and text are delivered.
    pub(super) fn delivered(&mut self) {
        self.delivered_ids.append(&mut self.in_flight_ids);
        self.delivered_text.push_str(&self.in_flight_text);
        self.in_flight_text.clear();
    }

    /// How many delivered ids the client lacks the whole text of (`None`: not known, so
    /// nothing may be carried); `detok`: the model's byte-level decoder.
    pub(super) fn unsent(&self, detok: Option<&Detok>) -> Option<u64> {
        super::unsent(
            detok,
            &self.delivered_ids,
            &self.delivered_text,
            &self.original.1.stop,
        )
    }

    /// A chunk about to go to the client: remembered as in flight, then the ids a migration
    /// generates again taken out of it ([`Again::forward`]).
    pub(super) fn forward(&mut self, c: &mut DecodeChunk) -> Result<(), HalfError> {
        if self.keep {
            self.in_flight_ids.clone_from(&c.token_ids);
            self.in_flight_text.clone_from(&c.delta);
        }
        self.again.forward(c)
    }

    /// A migration that carries the first `carried` delivered ids: the rest are generated again
    /// by the new pair, nothing is in flight.
    pub(super) fn migrate(&mut self, carried: u64) {
        let carried = (carried as usize).min(self.delivered_ids.len());
        self.again.expect(&self.delivered_ids[carried..]);
        self.delivered_ids.truncate(carried);
        self.in_flight_ids.clear();
        self.in_flight_text.clear();
    }

    /// The delivered ids a new pair's prompt carries.
    pub(super) fn carried_ids(&self) -> &[u32] {
        &self.delivered_ids
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

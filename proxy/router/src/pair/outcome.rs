//! What a pair ends as: the events a front end receives, the abort reasons, the outcome counters,
//! and a failed attempt with what the retry decision needs.

use std::sync::atomic::AtomicU64;

use super::machine::{Check, Verdict};
use super::{CancelReason, PairId};
use crate::backend::{DecodeChunk, HalfError, HalfFailure, Side};
use lockstep_core::error::{LockstepError, Phase};

/// What the front end receives from a pair's task.
#[derive(Debug)]
pub enum PairEvent {
    /// The barrier passed: the prefill is verified and the decode's first chunk agrees with it.
    /// Nothing was sent to the client before this.
    Committed {
        /// The pair that answers.
        pair_id: PairId,
        /// The verified prompt token count.
        prompt_tokens: u64,
        /// Prompt tokens the prefill took from its prefix cache, as it reported them; 0 for a
        /// request without a tenant (the cache is shared there, so the count would tell one
        /// caller what another sent).
        cached_tokens: u64,
        /// The prompt's log-probabilities, where the prefill reported them.
        prompt_logprobs: Option<Vec<crate::backend::TokenLogprobs>>,
    },
    /// Decode output; the chunk with `finish` set is the last.
    Chunk(DecodeChunk),
    /// The pair failed; both halves have been told to abort.
    Failed(LockstepError),
}

/// Why a pair ended aborted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AbortReason {
    /// The prefill half failed or was rejected.
    PrefillFailed,
    /// The decode half failed.
    DecodeFailed,
    /// The halves disagree about what was computed.
    Integrity,
    /// A deadline expired.
    Deadline(Phase),
    /// The client went away.
    ClientGone,
    /// No healthy worker (nothing was dispatched).
    NoWorker,
    /// lockstep is shutting down: uncommitted pairs at once, committed ones after the grace.
    Shutdown,
    /// An operator aborted the pair.
    Operator,
    /// The pair's own client aborted it (gRPC `Abort`); unlike [`AbortReason::ClientGone`] the
    /// client is still there and gets the error.
    ClientAbort,
}

impl AbortReason {
    /// Stable name for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            AbortReason::PrefillFailed => "prefill_failed",
            AbortReason::DecodeFailed => "decode_failed",
            AbortReason::Integrity => "integrity",
            AbortReason::Deadline(Phase::Total) => "deadline_total",
            AbortReason::Deadline(Phase::Prefill) => "deadline_prefill",
            AbortReason::Deadline(Phase::FirstToken) => "deadline_first_token",
            AbortReason::Deadline(Phase::Idle) => "deadline_idle",
            AbortReason::Deadline(Phase::ClientIdle) => "deadline_client_idle",
            AbortReason::ClientGone => "client_gone",
            AbortReason::NoWorker => "no_worker",
            AbortReason::Shutdown => "shutdown",
            AbortReason::Operator => "operator",
            AbortReason::ClientAbort => "client_abort",
        }
    }
}

/// The one terminal state a request's pair task ends in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Every token reached the client and the pair finished normally.
    Completed,
    /// The pair was aborted on both halves.
    Aborted(AbortReason),
}

/// Counters of pair outcomes.
#[derive(Debug, Default)]
pub struct PairStats {
    /// Pairs dispatched (each retry is a new pair).
    pub dispatched: AtomicU64,
    /// Requests that completed.
    pub completed: AtomicU64,
    /// Requests that ended aborted.
    pub aborted: AtomicU64,
    /// Abort calls sent to workers.
    pub abort_calls: AtomicU64,
    /// Retries taken.
    pub retries: AtomicU64,
}

/// A failed attempt: what the client, the log, the metrics and the audit are told.
pub(super) struct Failure {
    pub(super) error: LockstepError,
    pub(super) reason: AbortReason,
    pub(super) failed_side: Option<Side>,
    /// For integrity failures: which check failed (a metric label and audit field).
    pub(super) integrity: Option<&'static str>,
    /// The whole story for the log, where the client's message leaves some out (worker
    /// addresses).
    pub(super) detail: Option<String>,
}

impl Failure {
    /// The failure the machine's verdict names; `half` is the half's own error where one failed,
    /// `sent` the prompt count lockstep sent.
    pub(super) fn of(pair_id: PairId, v: Verdict, half: Option<HalfError>, sent: u64) -> Failure {
        let protocol = |message: &str| HalfError {
            side: Side::Decode,
            failure: HalfFailure::Protocol(message.into()),
        };
        match v {
            Verdict::Half { .. } => {
                let e = half.unwrap_or_else(|| protocol("the half failed"));
                Failure::from_half(pair_id, e)
            }
            Verdict::DecodeEnded { committed: false } => {
                Failure::from_half(pair_id, protocol("stream ended before any token"))
            }
            Verdict::DecodeEnded { committed: true } => {
                Failure::from_half(pair_id, protocol("stream ended without a finish reason"))
            }
            Verdict::Check(c) => Failure::integrity(pair_id, c.name(), check_message(c, sent)),
            Verdict::Deadline(phase) => Failure::deadline(pair_id, phase),
            Verdict::Cancelled(why) => Failure::cancelled(pair_id, why),
            Verdict::ClientGone => Failure::plain(
                LockstepError::Unavailable {
                    message: "client went away".into(),
                },
                AbortReason::ClientGone,
            ),
            Verdict::NoWorker(side) => Failure::plain(
                LockstepError::Unavailable {
                    message: format!("no {} worker", side.as_str()),
                },
                AbortReason::NoWorker,
            ),
        }
    }
    pub(super) fn from_half(pair_id: PairId, e: HalfError) -> Failure {
        let message = e.public_message();
        let detail = Some(e.to_string()).filter(|d| *d != message);
        if matches!(e.failure, HalfFailure::Integrity(_)) {
            return Failure {
                failed_side: Some(e.side),
                detail,
                ..Failure::integrity(pair_id, "kv_transfer", message)
            };
        }
        let (error, reason) = match e.side {
            Side::Prefill => (
                LockstepError::PrefillRejected { pair_id, message },
                AbortReason::PrefillFailed,
            ),
            Side::Decode => (
                LockstepError::DecodeFailed { pair_id, message },
                AbortReason::DecodeFailed,
            ),
        };
        Failure {
            error,
            reason,
            failed_side: Some(e.side),
            integrity: None,
            detail,
        }
    }
    pub(super) fn plain(error: LockstepError, reason: AbortReason) -> Failure {
        Failure {
            error,
            reason,
            failed_side: None,
            integrity: None,
            detail: None,
        }
    }
    pub(super) fn deadline(pair_id: PairId, phase: Phase) -> Failure {
        Failure::plain(
            LockstepError::Timeout { pair_id, phase },
            AbortReason::Deadline(phase),
        )
    }
    pub(super) fn cancelled(pair_id: PairId, why: CancelReason) -> Failure {
        let (message, reason) = match why {
            CancelReason::Shutdown => ("lockstep is shutting down", AbortReason::Shutdown),
            CancelReason::Operator => ("aborted by an operator", AbortReason::Operator),
            CancelReason::Client => ("aborted by its client", AbortReason::ClientAbort),
        };
        Failure::plain(
            LockstepError::Unavailable {
                message: format!("pair {pair_id} {message}"),
            },
            reason,
        )
    }
    pub(super) fn integrity(pair_id: PairId, kind: &'static str, message: String) -> Failure {
        Failure {
            integrity: Some(kind),
            ..Failure::plain(
                LockstepError::IntegrityViolation { pair_id, message },
                AbortReason::Integrity,
            )
        }
    }
}

/// What a failed barrier check tells the client.
fn check_message(c: Check, sent: u64) -> String {
    let digest = |d: Option<u64>| d.map_or_else(|| "none".into(), |d| format!("{d:016x}"));
    match c {
        Check::PrefillCount { got } => {
            format!("prefill computed {got} prompt tokens, lockstep sent {sent}")
        }
        Check::DecodeCount { got } => {
            format!("decode read {got} prompt tokens, lockstep sent {sent}")
        }
        Check::DecodeCountMissing => "the decode's first chunk reports no prompt count".into(),
        Check::KvDigest { prefill, decode } => format!(
            "KV digest mismatch: prefill sent {}, decode imported {}",
            digest(prefill),
            digest(decode)
        ),
    }
}

//! Why a pair's attempt failed, as the machine (`machine.rs`) judges it: the verdict, the
//! barrier check that failed, and what each allows after it (a retry, a migration, the reason
//! the pair ends with).

use super::{AbortReason, CancelReason};
use crate::backend::Side;
use lockstep_core::error::Phase;

/// Why an attempt failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Verdict {
    /// No worker could take a side (nothing was dispatched).
    NoWorker(Side),
    /// A half failed.
    Half {
        /// Which.
        side: Side,
        /// The worker did no work.
        retry_safe: bool,
        /// The worker rejected the KV it was given.
        integrity: bool,
        /// The failure is the worker's, not the request's ([`Verdict::migration_reason`]).
        migratable: bool,
    },
    /// A barrier check failed.
    Check(Check),
    /// The decode's stream ended early: before any chunk, or (`committed`) without a finish.
    DecodeEnded {
        /// After commit.
        committed: bool,
    },
    /// A deadline passed.
    Deadline(Phase),
    /// The client went away.
    ClientGone,
    /// Told to stop from outside.
    Cancelled(CancelReason),
}

/// A failed barrier check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Check {
    /// The prefill computed another prompt count.
    PrefillCount {
        /// What it reported.
        got: u64,
    },
    /// The decode read another prompt count.
    DecodeCount {
        /// What it reported.
        got: u64,
    },
    /// The decode reports no prompt count on a backend that always does.
    DecodeCountMissing,
    /// The decode imported other KV than the prefill sent.
    KvDigest {
        /// The prefill's.
        prefill: Option<u64>,
        /// The decode's.
        decode: Option<u64>,
    },
}

impl Check {
    /// The check's name (a metric label and audit field).
    pub(super) fn name(self) -> &'static str {
        match self {
            Check::PrefillCount { .. } => "prefill_prompt_count",
            Check::DecodeCount { .. } | Check::DecodeCountMissing => "decode_prompt_count",
            Check::KvDigest { .. } => "kv_digest_mismatch",
        }
    }
}

impl Verdict {
    /// The reason the pair ends with, if this verdict ends it.
    pub(super) fn reason(self) -> AbortReason {
        match self {
            Verdict::NoWorker(_) => AbortReason::NoWorker,
            Verdict::Half {
                integrity: true, ..
            }
            | Verdict::Check(_) => AbortReason::Integrity,
            Verdict::Half {
                side: Side::Prefill,
                ..
            } => AbortReason::PrefillFailed,
            Verdict::Half {
                side: Side::Decode, ..
            }
            | Verdict::DecodeEnded { .. } => AbortReason::DecodeFailed,
            Verdict::Deadline(p) => AbortReason::Deadline(p),
            Verdict::ClientGone => AbortReason::ClientGone,
            Verdict::Cancelled(CancelReason::Shutdown) => AbortReason::Shutdown,
            Verdict::Cancelled(CancelReason::Operator) => AbortReason::Operator,
            Verdict::Cancelled(CancelReason::Client) => AbortReason::ClientAbort,
        }
    }
    /// A new pair may be tried: the failed worker did no work.
    pub(super) fn retry_safe(self) -> bool {
        matches!(
            self,
            Verdict::Half {
                retry_safe: true,
                ..
            }
        )
    }
    /// Why a committed stream may continue on a new pair after this failure, as the
    /// `reason` label of `lockstep_migrations_total`; `None` when it must not: the client's
    /// cancel or disconnect, a deadline other than the decode's silence, an operator's abort,
    /// a drain, and above all an integrity failure (never retry into a leak).
    pub(super) fn migration_reason(self) -> Option<&'static str> {
        match self {
            Verdict::Half {
                integrity: false,
                migratable: true,
                side,
                ..
            } => Some(match side {
                Side::Prefill => "prefill_failed",
                Side::Decode => "decode_failed",
            }),
            Verdict::DecodeEnded { committed: true } => Some("decode_ended"),
            Verdict::Deadline(Phase::Idle) => Some("decode_idle"),
            _ => None,
        }
    }
    /// The side whose worker failed, which the retry avoids.
    pub(super) fn failed_side(self) -> Option<Side> {
        match self {
            Verdict::Half { side, .. } => Some(side),
            Verdict::DecodeEnded { .. } | Verdict::Deadline(Phase::Idle) => Some(Side::Decode),
            _ => None,
        }
    }
}

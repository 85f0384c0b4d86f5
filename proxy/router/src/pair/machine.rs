//! The pair lifecycle's decisions as a pure transition function. The lifecycle
//! (`lifecycle.rs`) turns whatever it was awaiting (a half's answer, a deadline, the
//! client, a cancellation, a backoff) into an [`Observation`], calls [`Machine::step`], and carries
//! out the [`Action`]s that come back. Nothing here does I/O, reads a clock or allocates, so the
//! model check (`machine_check.rs`) explores every interleaving of the same code that serves
//! requests.

use super::{AbortReason, CancelReason, Outcome};
use crate::backend::Side;
use crate::error::Phase;

/// What the machine knows of a request, fixed for its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Limits {
    /// The prompt token count lockstep sent: both halves must report exactly this.
    pub expected: u64,
    /// The backend always reports the decode's prompt count, so its absence is no proof.
    pub decode_counts_prompt: bool,
    /// Retries allowed before commit.
    pub max_retries: u32,
}

/// The decode's first chunk, held behind the barrier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Held {
    /// The KV digest the decode says it imported.
    pub digest: Option<u64>,
    /// It is also the last chunk.
    pub last: bool,
}

/// Where a pair stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Stage {
    /// Picking both workers for the next attempt.
    Picking,
    /// Both halves dispatched; nothing reaches the client. `prefill` is the verified prefill's
    /// KV digest once it answered; `first` the decode's first chunk once it arrived.
    Barrier {
        /// `Some(digest)` once the prefill answered and its count was right.
        prefill: Option<Option<u64>>,
        /// The decode's first chunk, once it arrived and its count was right.
        first: Option<Held>,
    },
    /// The `Committed` event is on its way to the client; the held chunk follows.
    Committing {
        /// The held chunk is the last.
        last: bool,
    },
    /// A chunk is on its way to the client.
    Forwarding {
        /// It is the last.
        last: bool,
    },
    /// Waiting for the decode's next chunk.
    Streaming,
    /// A failed attempt waits before its retry.
    Backoff(Verdict),
    /// The one terminal state: nothing changes it.
    Done(Outcome),
}

/// What the lifecycle observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Observation {
    /// Both workers were picked and the pair registered.
    Picked,
    /// No worker could take this side.
    NoWorker(Side),
    /// The prefill answered with success.
    Prefill {
        /// The prompt count it says it computed.
        prompt_tokens: u64,
        /// The digest of the KV it sent.
        digest: Option<u64>,
    },
    /// A decode chunk arrived.
    Decode {
        /// The prompt count it reports, if any.
        prompt_tokens: Option<u64>,
        /// The KV digest it reports, if any (read on the first chunk).
        digest: Option<u64>,
        /// It carries the finish.
        last: bool,
    },
    /// The decode's stream ended without a chunk carrying the finish.
    DecodeEnded,
    /// A half failed.
    HalfFailed {
        /// Which.
        side: Side,
        /// The worker did no work, so a new pair may be tried.
        retry_safe: bool,
        /// The worker rejected the KV it was given.
        integrity: bool,
    },
    /// A deadline passed.
    Deadline(Phase),
    /// The client went away.
    ClientGone,
    /// The pair was told to stop from outside (drain, operator, its own client).
    Cancelled(CancelReason),
    /// What was on its way to the client was taken.
    Delivered,
    /// The retry's backoff is over.
    BackoffOver,
}

/// What the lifecycle can see of the world when a step fails an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Env {
    /// The client still holds the pair's receiver.
    pub client_open: bool,
    /// lockstep is draining: nothing new starts.
    pub draining: bool,
}

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
    /// The side whose worker failed, which the retry avoids.
    pub(super) fn failed_side(self) -> Option<Side> {
        match self {
            Verdict::Half { side, .. } => Some(side),
            _ => None,
        }
    }
}

/// What the lifecycle must do, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Action {
    /// Send both halves to their workers.
    Dispatch,
    /// The prefill's report passed its checks (its count, and its digest against a first chunk
    /// already held): account its cached tokens and open the transfer span.
    PrefillVerified,
    /// Tell the client the pair committed (then the held chunk follows).
    Commit,
    /// Send the held chunk to the client.
    Forward,
    /// Abort both halves of this attempt.
    Abort(Verdict),
    /// Back off, then pick a new pair avoiding the failed side.
    Retry(Verdict),
    /// Tell the client the request failed.
    Fail(Verdict),
    /// The pair ended.
    Finish(Outcome),
}

/// The actions of one step (at most three).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Actions {
    list: [Option<Action>; 3],
}

impl Actions {
    /// Adds an action. A step takes at most three (the model check walks every step); a
    /// fourth is a bug in the machine, never silently dropped.
    fn push(&mut self, a: Action) {
        let slot = self.list.iter_mut().find(|s| s.is_none());
        assert!(slot.is_some(), "a step took a fourth action: {a:?}");
        if let Some(slot) = slot {
            *slot = Some(a);
        }
    }
}

impl IntoIterator for Actions {
    type Item = Action;
    type IntoIter = std::iter::Flatten<std::array::IntoIter<Option<Action>, 3>>;
    fn into_iter(self) -> Self::IntoIter {
        self.list.into_iter().flatten()
    }
}

/// A deliberate bug for the model check to find (tests only).
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Mutant {
    /// An idle decode's pair is failed without aborting its halves.
    DropAbortOnIdle,
}

/// One request's pair lifecycle: its stage and the attempts made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Machine {
    limits: Limits,
    stage: Stage,
    attempt: u32,
    committed: bool,
    #[cfg(test)]
    pub(super) mutant: Option<Mutant>,
}

impl Machine {
    /// A request about to pick its first pair.
    pub(super) fn new(limits: Limits) -> Machine {
        Machine {
            limits,
            stage: Stage::Picking,
            attempt: 0,
            committed: false,
            #[cfg(test)]
            mutant: None,
        }
    }
    /// Where the pair stands.
    pub(super) fn stage(&self) -> Stage {
        self.stage
    }
    /// The attempt under way (0 for the first).
    pub(super) fn attempt(&self) -> u32 {
        self.attempt
    }
    /// The pair committed: the client has been, or is being, told.
    pub(super) fn committed(&self) -> bool {
        self.committed
    }

    /// Takes one observation; returns what to do. An input the stage does not await changes
    /// nothing (the lifecycle only awaits what the stage needs).
    pub(super) fn step(&mut self, input: Observation, env: Env) -> Actions {
        let mut out = Actions::default();
        let expected = self.limits.expected;
        match (self.stage, input) {
            (Stage::Done(_), _) => {}
            (Stage::Picking, Observation::Picked) => {
                self.stage = Stage::Barrier {
                    prefill: None,
                    first: None,
                };
                out.push(Action::Dispatch);
            }
            (Stage::Picking, Observation::NoWorker(side)) => {
                self.end_failed(Verdict::NoWorker(side), &mut out)
            }
            (
                Stage::Barrier {
                    prefill: None,
                    first,
                },
                Observation::Prefill {
                    prompt_tokens,
                    digest,
                },
            ) => {
                if prompt_tokens != expected {
                    let check = Check::PrefillCount { got: prompt_tokens };
                    self.fail(Verdict::Check(check), env, &mut out);
                } else {
                    if first.is_none_or(|held| held.digest == digest) {
                        out.push(Action::PrefillVerified);
                    }
                    self.barrier(Some(digest), first, env, &mut out);
                }
            }
            (
                Stage::Barrier {
                    prefill,
                    first: None,
                },
                Observation::Decode {
                    prompt_tokens,
                    digest,
                    last,
                },
            ) => match self.count_check(prompt_tokens, true) {
                Some(check) => self.fail(Verdict::Check(check), env, &mut out),
                None => self.barrier(prefill, Some(Held { digest, last }), env, &mut out),
            },
            (Stage::Barrier { first: None, .. }, Observation::DecodeEnded) => {
                self.fail(Verdict::DecodeEnded { committed: false }, env, &mut out)
            }
            (Stage::Committing { last }, Observation::Delivered) => {
                self.stage = Stage::Forwarding { last };
                out.push(Action::Forward);
            }
            (Stage::Forwarding { last: true }, Observation::Delivered) => {
                self.stage = Stage::Done(Outcome::Completed);
                out.push(Action::Finish(Outcome::Completed));
            }
            (Stage::Forwarding { last: false }, Observation::Delivered) => {
                self.stage = Stage::Streaming
            }
            (
                Stage::Streaming,
                Observation::Decode {
                    prompt_tokens,
                    last,
                    ..
                },
            ) => match self.count_check(prompt_tokens, false) {
                Some(check) => self.fail(Verdict::Check(check), env, &mut out),
                None => {
                    self.stage = Stage::Forwarding { last };
                    out.push(Action::Forward);
                }
            },
            (Stage::Streaming, Observation::DecodeEnded) => {
                self.fail(Verdict::DecodeEnded { committed: true }, env, &mut out)
            }
            (Stage::Backoff(v), Observation::BackoffOver) => {
                if env.draining {
                    // A drain that began during the backoff starts nothing new.
                    self.end_failed(v, &mut out);
                } else {
                    self.attempt += 1;
                    self.stage = Stage::Picking;
                }
            }
            (
                Stage::Barrier { .. }
                | Stage::Committing { .. }
                | Stage::Forwarding { .. }
                | Stage::Streaming,
                Observation::HalfFailed {
                    side,
                    retry_safe,
                    integrity,
                },
            ) => {
                let v = Verdict::Half {
                    side,
                    retry_safe,
                    integrity,
                };
                self.fail(v, env, &mut out)
            }
            (
                Stage::Barrier { .. }
                | Stage::Committing { .. }
                | Stage::Forwarding { .. }
                | Stage::Streaming,
                Observation::Deadline(phase),
            ) => self.fail(Verdict::Deadline(phase), env, &mut out),
            (
                Stage::Barrier { .. }
                | Stage::Committing { .. }
                | Stage::Forwarding { .. }
                | Stage::Streaming,
                Observation::ClientGone,
            ) => self.fail(Verdict::ClientGone, env, &mut out),
            (
                Stage::Barrier { .. }
                | Stage::Committing { .. }
                | Stage::Forwarding { .. }
                | Stage::Streaming,
                Observation::Cancelled(why),
            ) => self.fail(Verdict::Cancelled(why), env, &mut out),
            _ => {}
        }
        out
    }

    /// The decode's prompt count: it must be the one sent; on the first chunk, a backend that
    /// always reports it must have.
    fn count_check(&self, reported: Option<u64>, first: bool) -> Option<Check> {
        match reported {
            Some(got) if got != self.limits.expected => Some(Check::DecodeCount { got }),
            None if first && self.limits.decode_counts_prompt => Some(Check::DecodeCountMissing),
            _ => None,
        }
    }

    /// The barrier with what has arrived: commit once both halves are in and the decode
    /// imported the KV the prefill sent.
    fn barrier(
        &mut self,
        prefill: Option<Option<u64>>,
        first: Option<Held>,
        env: Env,
        out: &mut Actions,
    ) {
        match (prefill, first) {
            (Some(sent), Some(held)) if sent != held.digest => {
                let check = Check::KvDigest {
                    prefill: sent,
                    decode: held.digest,
                };
                self.fail(Verdict::Check(check), env, out)
            }
            (Some(_), Some(held)) => {
                self.committed = true;
                self.stage = Stage::Committing { last: held.last };
                out.push(Action::Commit);
            }
            _ => self.stage = Stage::Barrier { prefill, first },
        }
    }

    /// The attempt failed: abort both halves, then retry or end.
    fn fail(&mut self, v: Verdict, env: Env, out: &mut Actions) {
        #[cfg(test)]
        let dropped =
            self.mutant == Some(Mutant::DropAbortOnIdle) && v == Verdict::Deadline(Phase::Idle);
        #[cfg(not(test))]
        let dropped = false;
        if !dropped {
            out.push(Action::Abort(v));
        }
        let retry = !self.committed
            && v.retry_safe()
            && self.attempt < self.limits.max_retries
            && env.client_open
            && !env.draining;
        if retry {
            self.stage = Stage::Backoff(v);
            out.push(Action::Retry(v));
        } else {
            self.end_failed(v, out);
        }
    }

    /// The request ends failed; the client is told unless it went away.
    fn end_failed(&mut self, v: Verdict, out: &mut Actions) {
        if v != Verdict::ClientGone {
            out.push(Action::Fail(v));
        }
        let outcome = Outcome::Aborted(v.reason());
        self.stage = Stage::Done(outcome);
        out.push(Action::Finish(outcome));
    }
}

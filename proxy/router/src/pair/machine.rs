//! The pair lifecycle's decisions as a pure transition function. The lifecycle
//! (`lifecycle.rs`) turns whatever it was awaiting (a half's answer, a deadline, the
//! client, a cancellation, a backoff) into an [`Observation`], calls [`Machine::step`], and carries
//! out the [`Action`]s that come back. Nothing here does I/O, reads a clock or allocates, so the
//! model check (`machine_check.rs`) explores every interleaving of the same code that serves
//! requests.

pub(super) use super::verdict::{Check, Verdict};
use super::{CancelReason, Outcome};
use crate::backend::Side;
use lockstep_core::error::Phase;

/// What the machine knows of a request, fixed for its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Limits {
    /// The prompt token count lockstep sent: both halves must report exactly this.
    pub expected: u64,
    /// The backend always reports the decode's prompt count, so its absence is no proof.
    pub decode_counts_prompt: bool,
    /// Retries allowed before commit.
    pub max_retries: u32,
    /// Migrations allowed after commit (`[models.failover] max_migrations`).
    pub max_migrations: u32,
    /// The most delivered tokens a migration carries into the new pair's prompt
    /// (`[models.failover] max_migrated_tokens`).
    pub max_migrated_tokens: u64,
    /// The request's `max_tokens`: a migration needs tokens left to ask for.
    pub max_new: u64,
    /// The backend can continue this request on a new pair: it reports the ids it generates,
    /// and can resume the request's output constraint, if any, mid-way.
    pub resumable: bool,
}

/// The decode's first chunk, held behind the barrier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct FirstChunk {
    /// The KV digest the decode says it imported.
    pub digest: Option<u64>,
    /// It is also the last chunk.
    pub last: bool,
    /// Its token ids, where the chunk carries all of them.
    pub tokens: Option<u32>,
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
        first: Option<FirstChunk>,
    },
    /// The `Committed` event is on its way to the client (after a migration, nothing is: the
    /// client was told once); the held chunk follows.
    Committing {
        /// The held chunk is the last.
        last: bool,
        /// Its token ids, where it carries all of them.
        tokens: Option<u32>,
    },
    /// A chunk is on its way to the client.
    Forwarding {
        /// It is the last.
        last: bool,
        /// Its token ids, where it carries all of them.
        tokens: Option<u32>,
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
        /// Its token ids, where it carries all of them (`None`: the backend did not report
        /// them, so what was delivered cannot be carried to a new pair).
        tokens: Option<u32>,
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
        /// The failure is the worker's (its connection, its crash, its server error), not the
        /// request's.
        migratable: bool,
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
    /// Of the tokens delivered, how many at the end the client does not hold the whole text
    /// of (a character split across tokens, text a worker holds back for a stop string): a
    /// migration carries the others and generates these again. `None` where lockstep cannot
    /// tell (the tokenizer's text is not the concatenation of its tokens', or the delivered text
    /// matches no prefix of the delivered ids): then nothing may be carried.
    pub unsent: Option<u64>,
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
    /// A migrated stream's new pair passed the barrier: its held chunk continues the client's
    /// stream (the client was told of the commit once, by the first pair).
    Resume,
    /// Pick a new pair that continues the committed stream: the prompt's tokens and every
    /// token delivered (`carried`), the failed worker avoided.
    Migrate {
        /// Why.
        verdict: Verdict,
        /// Tokens delivered to the client, now part of the new pair's prompt.
        carried: u64,
    },
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
    /// A committed stream whose worker failed an integrity check migrates like a crash.
    MigrateIntegrity,
}

/// One request's pair lifecycle: its stage and the attempts made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Machine {
    limits: Limits,
    stage: Stage,
    attempt: u32,
    committed: bool,
    /// Migrations taken.
    migrations: u32,
    /// Completion tokens delivered to the client, over every pair.
    delivered: u64,
    /// A chunk whose ids were not reported reached the client: the stream cannot be carried.
    ids_lost: bool,
    /// Delivered tokens in the current attempt's prompt (0 before any migration).
    carried: u64,
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
            migrations: 0,
            delivered: 0,
            ids_lost: false,
            carried: 0,
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
    /// Migrations taken so far.
    pub(super) fn migrations(&self) -> u32 {
        self.migrations
    }
    /// The prompt count the current attempt must report: the request's prompt and the tokens
    /// a migration carried.
    pub(super) fn expected(&self) -> u64 {
        self.limits.expected + self.carried
    }

    /// Takes one observation; returns what to do. An input the stage does not await changes
    /// nothing (the lifecycle only awaits what the stage needs).
    pub(super) fn step(&mut self, input: Observation, env: Env) -> Actions {
        let mut out = Actions::default();
        let expected = self.expected();
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
                    tokens,
                },
            ) => match self.count_check(prompt_tokens, true) {
                Some(check) => self.fail(Verdict::Check(check), env, &mut out),
                None => {
                    let held = FirstChunk {
                        digest,
                        last,
                        tokens,
                    };
                    self.barrier(prefill, Some(held), env, &mut out)
                }
            },
            (Stage::Barrier { first: None, .. }, Observation::DecodeEnded) => {
                self.fail(Verdict::DecodeEnded { committed: false }, env, &mut out)
            }
            (Stage::Committing { last, tokens }, Observation::Delivered) => {
                self.stage = Stage::Forwarding { last, tokens };
                out.push(Action::Forward);
            }
            (Stage::Forwarding { last, tokens }, Observation::Delivered) => {
                match tokens {
                    Some(n) => self.delivered += u64::from(n),
                    None => self.ids_lost = true,
                }
                if last {
                    self.stage = Stage::Done(Outcome::Completed);
                    out.push(Action::Finish(Outcome::Completed));
                } else {
                    self.stage = Stage::Streaming
                }
            }
            (
                Stage::Streaming,
                Observation::Decode {
                    prompt_tokens,
                    last,
                    tokens,
                    ..
                },
            ) => match self.count_check(prompt_tokens, false) {
                Some(check) => self.fail(Verdict::Check(check), env, &mut out),
                None => {
                    self.stage = Stage::Forwarding { last, tokens };
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
                    migratable,
                },
            ) => {
                let v = Verdict::Half {
                    side,
                    retry_safe,
                    integrity,
                    migratable,
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
            Some(got) if got != self.expected() => Some(Check::DecodeCount { got }),
            None if first && self.limits.decode_counts_prompt => Some(Check::DecodeCountMissing),
            _ => None,
        }
    }

    /// The barrier with what has arrived: commit once both halves are in and the decode
    /// imported the KV the prefill sent.
    fn barrier(
        &mut self,
        prefill: Option<Option<u64>>,
        first: Option<FirstChunk>,
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
                // A migrated stream was committed by its first pair: the new pair resumes it.
                out.push(if self.committed {
                    Action::Resume
                } else {
                    Action::Commit
                });
                self.committed = true;
                self.stage = Stage::Committing {
                    last: held.last,
                    tokens: held.tokens,
                };
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
        } else if self.may_migrate(v, env) {
            self.migrations += 1;
            self.attempt += 1;
            // The tokens whose text the client lacks are generated again on the new pair.
            self.delivered -= env.unsent.unwrap_or(0);
            self.carried = self.delivered;
            self.stage = Stage::Picking;
            out.push(Action::Migrate {
                verdict: v,
                carried: self.carried,
            });
        } else {
            self.end_failed(v, out);
        }
    }

    /// A committed stream may continue on a new pair: the failure is the worker's (never an
    /// integrity failure, the client's own cancel or a deadline of the request), migrations
    /// and the carried tokens are within their bounds, every delivered token's id is known and
    /// the delivered text is known to be theirs,
    /// tokens are left to generate, the backend can resume the request, and the client is there
    /// with no drain under way.
    fn may_migrate(&self, v: Verdict, env: Env) -> bool {
        #[cfg(test)]
        let v = match (self.mutant, v) {
            (Some(Mutant::MigrateIntegrity), Verdict::Half { side, .. }) => Verdict::Half {
                side,
                retry_safe: false,
                integrity: false,
                migratable: true,
            },
            _ => v,
        };
        self.committed
            && v.migration_reason().is_some()
            && self.limits.resumable
            && !self.ids_lost
            && env.unsent.is_some_and(|u| u <= self.delivered)
            && self.migrations < self.limits.max_migrations
            && self.delivered <= self.limits.max_migrated_tokens
            && self.delivered < self.limits.max_new
            && env.client_open
            && !env.draining
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

//! The model check of the pair lifecycle: stateright explores, exhaustively, every order in
//! which the two halves' answers (right, wrong counts, wrong digests, failures, early ends),
//! the deadlines, the client leaving, a drain, an operator's or the client's own abort, the
//! backoff and each delivery can reach [`Machine::step`] — the function the lifecycle itself
//! calls — crossed with every state of the world a failure can meet (client there or not, drain
//! or not), over up to three attempts, and a committed stream's migrations to new pairs
//! (every failure a committed stream can meet, with and without the ids of what was delivered,
//! up to the limit of two). A ghost record, kept from the inputs and actions alone,
//! judges the properties, so a bug in the machine's own bookkeeping cannot hide itself.

use stateright::{Checker, Model, Property};

use super::machine::{Action, Env, Limits, Machine, Mutant, Observation, Stage};
use super::{AbortReason, CancelReason, Outcome};
use crate::backend::Side;
use lockstep_core::error::Phase;

/// The prompt count lockstep sent, in the model.
const SENT: u64 = 3;
/// Streamed chunks after the first before the model only offers a last one (bounds the graph).
const MAX_CHUNKS: u8 = 2;
/// Migrations allowed in the model.
const MAX_MIGRATIONS: u32 = 2;

/// What an observer outside the machine saw, from the inputs fed and the actions taken.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
struct Ghost {
    /// Attempts dispatched.
    dispatched: u8,
    /// Abort-both actions taken.
    aborted: u8,
    /// The current attempt was dispatched and not yet aborted.
    live: bool,
    /// What the current attempt's prefill reported: its count and digest.
    prefill: Option<(u64, Option<u64>)>,
    /// What the current attempt's first decode chunk reported.
    first: Option<(Option<u64>, Option<u64>)>,
    /// Each half's answer is still coming.
    prefill_open: bool,
    decode_open: bool,
    /// Chunks streamed after the first.
    chunks: u8,
    /// The machine said the current attempt's prefill passed its checks.
    prefill_verified: bool,
    /// The client was told the pair committed.
    committed: bool,
    /// The client was told the request failed.
    failed: bool,
    finishes: u8,
    retries: u8,
    /// Completion tokens that reached the client, and whether a chunk without its ids did.
    delivered: u64,
    ids_lost: bool,
    /// The token ids of the chunk the machine holds or is forwarding.
    pending: Option<u32>,
    /// Delivered tokens the current attempt's prompt carries.
    carried: u64,
    migrations: u32,
    /// A migration's new pair has not passed its barrier yet.
    need_resume: bool,
    // Violations, latched.
    bad_commit: bool,
    byte_after_failure: bool,
    abort_of_nothing: bool,
    retry_after_commit: bool,
    told_twice: bool,
    bad_migration: bool,
    continued_before_barrier: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct World {
    machine: Machine,
    ghost: Ghost,
}

struct PairModel {
    limits: Limits,
    mutant: Option<Mutant>,
}

const CANCELS: [CancelReason; 3] = [
    CancelReason::Shutdown,
    CancelReason::Operator,
    CancelReason::Client,
];
const SIDES: [Side; 2] = [Side::Prefill, Side::Decode];

/// The inputs the lifecycle can feed at a stage, given which answers are still coming.
fn inputs(stage: Stage, g: &Ghost) -> Vec<Observation> {
    let mut v = Vec::new();
    let half_failures = |v: &mut Vec<Observation>, side: Side| {
        for retry_safe in [false, true] {
            for integrity in [false, true] {
                for migratable in [false, true] {
                    v.push(Observation::HalfFailed {
                        side,
                        retry_safe,
                        integrity,
                        migratable,
                    });
                }
            }
        }
    };
    let outside = |v: &mut Vec<Observation>| {
        v.push(Observation::ClientGone);
        v.extend(CANCELS.map(Observation::Cancelled));
        v.push(Observation::Deadline(Phase::Total));
    };
    let sent = SENT + g.carried;
    let counts = [Some(sent), Some(sent + 1), None];
    match stage {
        Stage::Done(_) => {}
        Stage::Picking => v.extend([Observation::Picked, Observation::NoWorker(Side::Prefill)]),
        Stage::Backoff(_) => v.push(Observation::BackoffOver),
        Stage::Barrier { prefill, first } => {
            if prefill.is_none() && g.prefill_open {
                for prompt_tokens in [sent, sent + 1] {
                    for digest in [None, Some(1)] {
                        v.push(Observation::Prefill {
                            prompt_tokens,
                            digest,
                        });
                    }
                }
                half_failures(&mut v, Side::Prefill);
                v.push(Observation::Deadline(Phase::Prefill));
            }
            if first.is_none() && g.decode_open {
                for prompt_tokens in counts {
                    for digest in [None, Some(1), Some(2)] {
                        for last in [false, true] {
                            for tokens in [Some(1), None] {
                                v.push(Observation::Decode {
                                    prompt_tokens,
                                    digest,
                                    last,
                                    tokens,
                                });
                            }
                        }
                    }
                }
                half_failures(&mut v, Side::Decode);
                v.extend([
                    Observation::DecodeEnded,
                    Observation::Deadline(Phase::FirstToken),
                ]);
            }
            outside(&mut v);
        }
        Stage::Committing { .. } | Stage::Forwarding { .. } => {
            v.extend([
                Observation::Delivered,
                Observation::Deadline(Phase::ClientIdle),
            ]);
            outside(&mut v);
        }
        Stage::Streaming => {
            let lasts: &[bool] = if g.chunks < MAX_CHUNKS {
                &[false, true]
            } else {
                &[true]
            };
            for prompt_tokens in counts {
                for &last in lasts {
                    for tokens in [Some(1), None] {
                        v.push(Observation::Decode {
                            prompt_tokens,
                            digest: None,
                            last,
                            tokens,
                        });
                    }
                }
            }
            half_failures(&mut v, Side::Decode);
            v.extend([Observation::DecodeEnded, Observation::Deadline(Phase::Idle)]);
            outside(&mut v);
        }
    }
    v
}

impl Model for PairModel {
    type State = World;
    type Action = (Observation, Env);

    fn init_states(&self) -> Vec<World> {
        let mut machine = Machine::new(self.limits);
        machine.mutant = self.mutant;
        vec![World {
            machine,
            ghost: Ghost::default(),
        }]
    }

    fn actions(&self, w: &World, out: &mut Vec<(Observation, Env)>) {
        for input in inputs(w.machine.stage(), &w.ghost) {
            for client_open in [true, false] {
                for draining in [false, true] {
                    // Whether the delivered text is known to be its ids' (only a failure asks).
                    let unknown = [false, true];
                    let failure = matches!(
                        input,
                        Observation::HalfFailed { .. }
                            | Observation::DecodeEnded
                            | Observation::Deadline(_)
                    );
                    for unknown in &unknown[..if failure { 2 } else { 1 }] {
                        let env = Env {
                            client_open,
                            draining,
                            unsent: (!unknown).then_some(0),
                        };
                        out.push((input, env));
                    }
                }
            }
        }
    }

    fn next_state(&self, w: &World, (input, env): (Observation, Env)) -> Option<World> {
        let mut next = *w;
        let stage = w.machine.stage();
        let actions = next.machine.step(input, env);
        let g = &mut next.ghost;
        match (stage, input) {
            (
                _,
                Observation::Prefill {
                    prompt_tokens,
                    digest,
                },
            ) => {
                g.prefill = Some((prompt_tokens, digest));
                g.prefill_open = false;
            }
            (
                Stage::Barrier { .. },
                Observation::Decode {
                    prompt_tokens,
                    digest,
                    last,
                    tokens,
                },
            ) => {
                g.first = Some((prompt_tokens, digest));
                g.decode_open = !last;
                g.pending = tokens;
            }
            (_, Observation::Decode { last, tokens, .. }) => {
                g.chunks += 1;
                g.decode_open = !last;
                g.pending = tokens;
            }
            (Stage::Forwarding { .. }, Observation::Delivered) => match g.pending {
                Some(n) => g.delivered += u64::from(n),
                None => g.ids_lost = true,
            },
            (_, Observation::HalfFailed { side, .. }) => match side {
                Side::Prefill => g.prefill_open = false,
                Side::Decode => g.decode_open = false,
            },
            (_, Observation::DecodeEnded) => g.decode_open = false,
            _ => {}
        }
        for action in actions {
            match action {
                Action::Dispatch => {
                    g.dispatched += 1;
                    g.live = true;
                    g.prefill = None;
                    g.first = None;
                    g.prefill_open = true;
                    g.decode_open = true;
                    g.chunks = 0;
                    g.prefill_verified = false;
                }
                Action::PrefillVerified => {
                    // Only a prefill report that passed: its count, and its digest against a
                    // first chunk already held.
                    let ok = g.prefill.is_some_and(|(sent, digest)| {
                        sent == SENT + g.carried && g.first.is_none_or(|(_, d)| d == digest)
                    });
                    g.bad_commit |= !ok || g.prefill_verified;
                    g.prefill_verified = true;
                }
                Action::Commit | Action::Forward | Action::Resume => {
                    if !g.live || g.failed {
                        g.byte_after_failure = true;
                    }
                    match action {
                        Action::Commit => {
                            g.bad_commit |= !self.barrier_passed(g) || !g.prefill_verified;
                            // The client is told of the commit once, whatever migrates.
                            g.told_twice |= g.committed;
                            g.committed = true;
                        }
                        Action::Resume => {
                            g.bad_commit |= !self.barrier_passed(g)
                                || !g.prefill_verified
                                || !g.need_resume
                                || !g.committed;
                            g.need_resume = false;
                        }
                        _ => {
                            g.byte_after_failure |= !g.committed;
                            g.continued_before_barrier |= g.need_resume;
                        }
                    }
                }
                Action::Migrate { carried, .. } => {
                    // Only a worker's own failure of a committed stream, judged from the input
                    // alone: never an integrity failure, a failed check (a chunk or report as
                    // the input), the client's leaving or cancel, a drain or another deadline.
                    let worker_failed = match input {
                        Observation::HalfFailed {
                            integrity,
                            migratable,
                            ..
                        } => migratable && !integrity,
                        Observation::DecodeEnded | Observation::Deadline(Phase::Idle) => true,
                        _ => false,
                    };
                    g.migrations += 1;
                    g.bad_migration |= !worker_failed
                        || !g.committed
                        || g.live
                        || g.ids_lost
                        || carried != g.delivered
                        || g.migrations > self.limits.max_migrations
                        || !env.client_open
                        || env.draining
                        || env.unsent.is_none()
                        || !self.limits.resumable;
                    g.carried = carried;
                    g.need_resume = true;
                }
                Action::Abort(_) => {
                    if !g.live {
                        g.abort_of_nothing = true;
                    }
                    g.live = false;
                    g.aborted += 1;
                }
                Action::Retry(_) => {
                    g.retry_after_commit |= g.committed;
                    g.retries += 1;
                }
                Action::Fail(_) => {
                    g.told_twice |= g.failed;
                    g.failed = true;
                }
                Action::Finish(_) => g.finishes += 1,
            }
        }
        Some(next)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("exactly one terminal state", |_, w: &World| {
                let done = matches!(w.machine.stage(), Stage::Done(_));
                w.ghost.finishes == u8::from(done)
            }),
            Property::eventually("the pair ends", |_, w: &World| {
                matches!(w.machine.stage(), Stage::Done(_))
            }),
            Property::always(
                "no commit unless the prefill passed every barrier check",
                |_, w: &World| !w.ghost.bad_commit,
            ),
            Property::always(
                "abort sent to both halves iff the pair did not succeed",
                |_, w: &World| {
                    let g = &w.ghost;
                    let aborts_ok = match w.machine.stage() {
                        Stage::Done(Outcome::Completed) => g.aborted + 1 == g.dispatched && g.live,
                        Stage::Done(Outcome::Aborted(_)) => g.aborted == g.dispatched && !g.live,
                        _ => g.aborted <= g.dispatched,
                    };
                    aborts_ok && !g.abort_of_nothing
                },
            ),
            Property::always("no byte after a failure", |_, w: &World| {
                !w.ghost.byte_after_failure
            }),
            Property::always(
                "no retry after commit, the client told once",
                |_, w: &World| !w.ghost.retry_after_commit && !w.ghost.told_twice,
            ),
            Property::sometimes("a retried pair completes", |_, w: &World| {
                w.machine.stage() == Stage::Done(Outcome::Completed) && w.ghost.retries > 0
            }),
            Property::sometimes("the last retry completes", |_, w: &World| {
                w.machine.stage() == Stage::Done(Outcome::Completed) && w.ghost.retries == 2
            }),
            Property::sometimes(
                "a drain during the backoff ends the request",
                |_, w: &World| {
                    w.machine.stage() == Stage::Done(Outcome::Aborted(AbortReason::PrefillFailed))
                        && w.ghost.retries > 0
                        && w.ghost.dispatched == w.ghost.retries
                },
            ),
            Property::sometimes("a committed stream fails", |_, w: &World| {
                matches!(w.machine.stage(), Stage::Done(Outcome::Aborted(_))) && w.ghost.committed
            }),
            Property::always(
                "only a worker's failure migrates, at most max_migrations times, carrying what was delivered, its text known",
                |_, w: &World| !w.ghost.bad_migration,
            ),
            Property::always(
                "no continuation before the new pair's barrier",
                |_, w: &World| !w.ghost.continued_before_barrier,
            ),
            Property::sometimes("a migrated stream completes", |_, w: &World| {
                w.machine.stage() == Stage::Done(Outcome::Completed) && w.ghost.migrations > 0
            }),
            Property::sometimes("the last migration completes", |_, w: &World| {
                w.machine.stage() == Stage::Done(Outcome::Completed)
                    && w.ghost.migrations == MAX_MIGRATIONS
                    && w.ghost.carried > 0
            }),
        ]
    }
}

impl PairModel {
    /// What the barrier must have seen before a commit, judged from the inputs alone: the
    /// prefill's count is the one sent, the decode's first chunk agrees (or reports none where
    /// the backend may omit it), and the decode imported the KV the prefill sent.
    fn barrier_passed(&self, g: &Ghost) -> bool {
        let (Some((sent, prefill_digest)), Some((read, decode_digest))) = (g.prefill, g.first)
        else {
            return false;
        };
        let expected = SENT + g.carried;
        let read_ok = match read {
            Some(n) => n == expected,
            None => !self.limits.decode_counts_prompt,
        };
        sent == expected && read_ok && prefill_digest == decode_digest
    }
}

/// Breadth first on one thread, so a counterexample is a shortest one.
fn check(limits: Limits, mutant: Option<Mutant>) -> impl Checker<PairModel> {
    PairModel { limits, mutant }.checker().spawn_bfs().join()
}

fn limits(decode_counts_prompt: bool) -> Limits {
    Limits {
        expected: SENT,
        decode_counts_prompt,
        max_retries: 2,
        max_migrations: MAX_MIGRATIONS,
        max_migrated_tokens: 16,
        max_new: 16,
        resumable: true,
    }
}

#[test]
fn every_interleaving_keeps_the_lifecycle_invariants() {
    for counts in [false, true] {
        let checker = check(limits(counts), None);
        assert!(checker.is_done());
        eprintln!(
            "decode_counts_prompt={counts}: {} states ({} unique), depth {}",
            checker.state_count(),
            checker.unique_state_count(),
            checker.max_depth()
        );
        // Exhaustive (every state explored), over three attempts: the `sometimes` properties
        // show the paths that matter were reached.
        assert!(checker.unique_state_count() > 500);
        checker.assert_properties();
    }
}

#[test]
fn a_dropped_abort_is_found_with_its_trace() {
    // Without migrations, the idle decode's stream ends at once (with them it would move on).
    let no_migrations = Limits {
        max_migrations: 0,
        ..limits(true)
    };
    let checker = check(no_migrations, Some(Mutant::DropAbortOnIdle));
    let name = "abort sent to both halves iff the pair did not succeed";
    let path = checker.assert_any_discovery(name);
    eprintln!("counterexample for {name:?}:\n{path}");
    let actions = path.clone().into_actions();
    assert_eq!(
        actions.last().map(|(input, _)| *input),
        Some(Observation::Deadline(Phase::Idle)),
        "{actions:?}"
    );
    assert!(matches!(
        path.last_state().machine.stage(),
        Stage::Done(Outcome::Aborted(_))
    ));
    // The other properties still hold: the checker names the one that broke.
    for other in [
        "exactly one terminal state",
        "no commit unless the prefill passed every barrier check",
        "no byte after a failure",
    ] {
        checker.assert_no_discovery(other);
    }
}

#[test]
fn nothing_moves_a_finished_pair() {
    let mut m = Machine::new(limits(true));
    let env = Env {
        client_open: true,
        draining: false,
        unsent: Some(0),
    };
    assert_eq!(
        m.step(Observation::NoWorker(Side::Decode), env)
            .into_iter()
            .collect::<Vec<_>>()
            .len(),
        2
    );
    let done = m.stage();
    assert!(matches!(done, Stage::Done(_)));
    let everything = SIDES
        .iter()
        .map(|&side| Observation::HalfFailed {
            side,
            retry_safe: true,
            integrity: false,
            migratable: true,
        })
        .chain([
            Observation::Picked,
            Observation::Delivered,
            Observation::BackoffOver,
            Observation::ClientGone,
            Observation::DecodeEnded,
            Observation::Deadline(Phase::Total),
            Observation::Cancelled(CancelReason::Operator),
            Observation::Prefill {
                prompt_tokens: SENT,
                digest: None,
            },
        ]);
    for input in everything {
        assert_eq!(m.step(input, env).into_iter().count(), 0, "{input:?}");
        assert_eq!(m.stage(), done);
    }
}

#[test]
fn a_migration_after_an_integrity_failure_is_found() {
    let checker = check(limits(true), Some(Mutant::MigrateIntegrity));
    let name = "only a worker's failure migrates, at most max_migrations times, carrying what was delivered, its text known";
    let path = checker.assert_any_discovery(name);
    // The step that broke it: the failure that migrated was an integrity failure or one the
    // worker did not cause.
    let steps = path.clone().into_vec();
    let culprit = steps
        .windows(2)
        .find(|w| !w[0].0.ghost.bad_migration && w[1].0.ghost.bad_migration)
        .and_then(|w| w[0].1);
    assert!(
        matches!(
            culprit,
            Some((Observation::HalfFailed { integrity, migratable, .. }, _)) if integrity || !migratable
        ),
        "{culprit:?} in {path}"
    );
    checker.assert_no_discovery("no continuation before the new pair's barrier");
    checker.assert_no_discovery("no byte after a failure");
}

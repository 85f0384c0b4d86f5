//! Starting a queued job: its pages allocated (shared from the prefix cache, or imported with
//! verification from a prefill engine), its role set up.

use super::super::job::{Active, Job, Role, Score};
use super::super::{EngineError, Event};
use super::Scheduler;
use crate::pool::OwnerId;
use crate::sample::{Sampler, TextStream};
use crate::transfer::ImportExpectation;
use std::sync::atomic::Ordering;

impl Scheduler {
    /// Allocates a job's pages (importing its KV when it brings some).
    #[allow(clippy::result_large_err)]
    pub(super) fn start(
        &mut self,
        job: Job,
        tokens: usize,
    ) -> Result<Option<Active>, (Job, EngineError)> {
        let id = job.id();
        let owner = OwnerId::sequence(id);
        match job {
            Job::Prefill {
                id,
                tokens,
                cache_salt,
                sink,
                reply,
                score,
            } => {
                let salt = cache_salt.filter(|_| self.prefix_cache());
                // A scored prompt is computed whole: cached pages carry no logits.
                let lookup = salt.filter(|_| score.is_none());
                let started = match self.refuse_scoring(score.is_some()) {
                    Some(e) => Err(e),
                    None => self.new_sequence(owner, &tokens, tokens.len(), lookup),
                };
                let (seq, shared) = match started {
                    Ok(s) => s,
                    Err(e) => {
                        let job = Job::Prefill {
                            id,
                            tokens,
                            cache_salt,
                            sink,
                            reply,
                            score,
                        };
                        return Err((job, e));
                    }
                };
                let a = Active {
                    id,
                    seq,
                    input: tokens,
                    fed: shared,
                    publish: salt,
                    role: Role::Prefill {
                        sink: Some(sink),
                        reply: Some(reply),
                        cached: shared,
                    },
                    score: score.map(Score::new),
                };
                if a.input.is_empty() {
                    // Nothing to compute: export the empty set at once.
                    self.finish_prefill(a);
                    return Ok(None);
                }
                Ok(Some(a))
            }
            Job::Gen(mut g, events, guide) => {
                if g.prompt.is_empty() {
                    return Err((
                        Job::Gen(g, events, guide),
                        EngineError::BadRequest("empty prompt".into()),
                    ));
                }
                // Compiled before it was queued ([`Scheduler::submit`]).
                g.sampling.constraint = None;
                let salt = g.cache_salt.filter(|_| self.prefix_cache());
                // The prompt is scored where it is computed: here, unless its KV comes from a
                // prefill engine (which scored it). Computed whole: cached pages carry no logits.
                let score = g
                    .sampling
                    .prompt_logprobs
                    .filter(|_| g.kv.is_none())
                    .map(|k| Score::new((k, g.prompt.clone())));
                if let Some(e) = self.refuse_scoring(score.is_some()) {
                    return Err((Job::Gen(g, events, guide), e));
                }
                let lookup = salt.filter(|_| score.is_none());
                // A split prefill's scores come with its KV.
                let carried = g.kv.as_mut().and_then(|t| t.prompt_logprobs.take());
                let (seq, digest) = match g.kv.take() {
                    None => match self.new_sequence(owner, &g.prompt, tokens, lookup) {
                        Ok((s, _)) => (s, None),
                        Err(e) => return Err((Job::Gen(g, events, None), e)),
                    },
                    Some(t) => {
                        let expect = ImportExpectation {
                            pair_id: id,
                            model: self.bundle.fingerprint,
                            tokens: g.prompt.len() as u64 - 1,
                        };
                        // With the prefix cache, the prompt's full pages already here for
                        // this tenant with the very bytes the set sent are shared, not copied
                        // (a request's several choices hold them once).
                        let imported = match salt {
                            Some(salt) => self
                                .pool
                                .import_sharing(owner, expect, &t, &g.prompt, salt)
                                .map(|(s, shared)| {
                                    self.stats
                                        .import_shared_tokens
                                        .fetch_add(shared, Ordering::Relaxed);
                                    s
                                }),
                            None => self.pool.import(owner, expect, &t),
                        };
                        let imported = imported.map_err(EngineError::from).and_then(|mut s| {
                            let extra = tokens - s.len;
                            let r = self
                                .pool
                                .reserve(&mut s, extra)
                                .map_err(EngineError::from)
                                .and_then(|()| {
                                    self.device
                                        .upload(&self.pool, &s, &t.manifest.page_checksums)
                                });
                            match r {
                                Ok(()) => Ok(s),
                                Err(e) => {
                                    let _ = self.pool.release(s);
                                    Err(e)
                                }
                            }
                        });
                        match imported {
                            Ok(s) => (s, Some(t.manifest.compute_checksum())),
                            Err(e) => return Err((Job::Gen(g, events, None), e)),
                        }
                    }
                };
                let fed = seq.len;
                let _ = events.send(Event::Started {
                    prompt_tokens: g.prompt.len() as u64,
                    kv_digest: digest,
                });
                if let Some(logprobs) = carried.filter(|_| g.sampling.prompt_logprobs.is_some()) {
                    let _ = events.send(Event::Prompt { logprobs });
                }
                let mut text = TextStream::new(&g.sampling, &self.bundle.eog);
                // A migrated stream: its delivered tokens end the prompt and count as output.
                let resumed = g.sampling.resumed.min(g.prompt.len());
                let tail = g.prompt[g.prompt.len() - resumed..].to_vec();
                text.resume(&tail);
                let mut guide = guide;
                if let Some(Err(m)) = guide.as_mut().map(|gd| gd.resume(&tail)) {
                    let _ = self.pool.release(seq);
                    let e = EngineError::BadRequest(format!("output constraint: {m}"));
                    return Err((Job::Gen(g, events, None), e));
                }
                Ok(Some(Active {
                    id,
                    seq,
                    input: g.prompt,
                    fed,
                    // An imported prompt's full pages are offered too: a later pair of the
                    // same tenant and prompt shares them where its set's bytes are theirs.
                    publish: salt,
                    role: Role::Gen {
                        events,
                        sampler: Sampler::new(g.sampling),
                        text,
                        next: [0],
                        sampled: resumed,
                        guide,
                    },
                    score,
                }))
            }
        }
    }

    /// Why a scored prompt cannot run here (`None`: it can, or none is asked): every position's
    /// logits are the CPU engine's only.
    fn refuse_scoring(&self, scored: bool) -> Option<EngineError> {
        (scored && !self.device.scores_prompts()).then(|| {
            EngineError::BadRequest(
                "prompt log-probabilities are computed by the CPU engine only".into(),
            )
        })
    }
}

//! The engine thread: continuous batching over one page pool. Each step admits waiting requests
//! whose pages are all free (never truncating), runs one forward pass over decode tokens and
//! prompt chunks together on the engine's device, samples, streams events, and frees what
//! finished, aborted or lost its receiver.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;

use super::job::{Active, Job, Role, next_token};
use super::{Cmd, EngineConfig, EngineError, EngineStats, Event, KvReport, WhenFull};
use crate::bundle::ModelBundle;
use crate::device::EngineDevice;
use crate::grammar::{Grammars, Guide};
use crate::model::Step;
use crate::pool::{OwnerId, PagePool, ScrubPolicy, Sequence};
use crate::transfer::TransferError;

mod start;

/// The engine thread's state: its pool, device and requests.
pub(super) struct Scheduler {
    bundle: Arc<ModelBundle>,
    cfg: EngineConfig,
    /// Page bookkeeping (and, on a GPU, the host staging copy of pages in transfer).
    pool: PagePool,
    /// Where the forward pass runs (and, on a GPU, where the pages themselves live).
    device: EngineDevice,
    stats: Arc<EngineStats>,
    waiting: VecDeque<Job>,
    active: Vec<Active>,
    /// The model's grammar compiler, built (on the thread pool) for the first constrained
    /// request.
    grammars: Arc<std::sync::OnceLock<Result<Grammars, String>>>,
    /// Constrained requests whose grammar is being compiled on the thread pool: queued once it
    /// is, failed if it cannot be. The engine thread never compiles one.
    compiling: Vec<(Job, std::sync::mpsc::Receiver<Result<Guide, String>>)>,
}

impl Scheduler {
    /// A scheduler with nothing waiting or running.
    pub(super) fn new(
        bundle: Arc<ModelBundle>,
        cfg: EngineConfig,
        pool: PagePool,
        device: EngineDevice,
        stats: Arc<EngineStats>,
    ) -> Scheduler {
        Scheduler {
            bundle,
            cfg,
            pool,
            device,
            stats,
            waiting: VecDeque::new(),
            active: Vec::new(),
            grammars: Arc::default(),
            compiling: Vec::new(),
        }
    }

    /// Queues a job; a constrained generation first has its grammar compiled on the thread
    /// pool, so a costly grammar never holds up the batch.
    fn submit(&mut self, job: Job) {
        match job {
            Job::Gen(mut g, events, None) if g.sampling.constraint.is_some() => {
                let Some(c) = g.sampling.constraint.take() else {
                    return;
                };
                let (grammars, bundle) = (self.grammars.clone(), self.bundle.clone());
                let (tx, rx) = std::sync::mpsc::sync_channel(1);
                rayon::spawn(move || {
                    let guide = match grammars.get_or_init(|| Grammars::new(&bundle.tokenizer)) {
                        Ok(g) => g.guide(&c).map_err(|m| format!("output constraint: {m}")),
                        Err(m) => Err(format!(
                            "structured outputs are unavailable for this model: {m}"
                        )),
                    };
                    let _ = tx.send(guide);
                });
                self.compiling.push((Job::Gen(g, events, None), rx));
            }
            job => self.waiting.push_back(job),
        }
    }

    /// Queues the jobs whose grammars are compiled, in the order they were submitted; fails
    /// those whose grammars could not be.
    fn compiled(&mut self) {
        use std::sync::mpsc::TryRecvError;
        let mut i = 0;
        while i < self.compiling.len() {
            let got = match self.compiling[i].1.try_recv() {
                Err(TryRecvError::Empty) => {
                    i += 1;
                    continue;
                }
                Ok(r) => r,
                Err(TryRecvError::Disconnected) => Err("the grammar compilation was lost".into()),
            };
            let (job, _) = self.compiling.remove(i);
            match (job, got) {
                (Job::Gen(g, events, _), Ok(guide)) => {
                    self.waiting.push_back(Job::Gen(g, events, Some(guide)))
                }
                (job, Err(m)) => job.fail(EngineError::BadRequest(m)),
                (job, Ok(_)) => self.waiting.push_back(job),
            }
        }
    }

    /// The engine thread's loop: take commands, admit, step, publish, until stopped.
    pub(super) fn run(&mut self, rx: mpsc::Receiver<Cmd>) {
        loop {
            let first = if !self.active.is_empty() || !self.waiting.is_empty() {
                None
            } else if self.compiling.is_empty() {
                match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
            } else {
                // Idle but for grammars being compiled: look for them again shortly.
                match rx.recv_timeout(std::time::Duration::from_millis(1)) {
                    Ok(c) => Some(c),
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            };
            for cmd in first
                .into_iter()
                .chain(std::iter::from_fn(|| rx.try_recv().ok()))
            {
                match cmd {
                    Cmd::Submit(job) => self.submit(job),
                    Cmd::Abort(id) => self.abort(id),
                    Cmd::Stop => {
                        self.shutdown();
                        return;
                    }
                }
            }
            self.compiled();
            self.drop_abandoned();
            self.admit();
            self.publish();
            if !self.active.is_empty() {
                self.step();
                self.publish();
            }
        }
    }

    fn publish(&self) {
        let s = &self.stats;
        s.free_pages
            .store(self.pool.available_pages(), Ordering::Relaxed);
        s.running.store(self.active.len(), Ordering::Relaxed);
        s.waiting
            .store(self.waiting.len() + self.compiling.len(), Ordering::Relaxed);
    }

    fn release(&mut self, a: Active) {
        if let Err(e) = self.pool.release(a.seq) {
            tracing::error!(request = a.id, error = %e, "pages not released");
        }
        // On a GPU, mirror the freed tags now so a scrub policy zeroes the pages at once.
        if self.cfg.scrub != ScrubPolicy::None
            && let Err(e) = self.device.sync_tags(&self.pool)
        {
            tracing::error!(request = a.id, error = %e, "device pages not scrubbed");
        }
    }

    fn abort(&mut self, id: u64) {
        self.waiting.retain(|j| j.id() != id);
        self.compiling.retain(|(j, _)| j.id() != id);
        while let Some(i) = self.active.iter().position(|a| a.id == id) {
            let a = self.active.swap_remove(i);
            self.release(a);
        }
    }

    fn drop_abandoned(&mut self) {
        self.waiting.retain(|j| !j.abandoned());
        self.compiling.retain(|(j, _)| !j.abandoned());
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].abandoned() {
                let a = self.active.swap_remove(i);
                self.release(a);
            } else {
                i += 1;
            }
        }
    }

    fn shutdown(&mut self) {
        for j in std::mem::take(&mut self.waiting) {
            j.fail(EngineError::Stopped);
        }
        for (j, _) in std::mem::take(&mut self.compiling) {
            j.fail(EngineError::Stopped);
        }
        for a in std::mem::take(&mut self.active) {
            self.fail(a, EngineError::Stopped);
        }
        self.publish();
    }

    /// Admits queued requests in order while their pages can be allocated.
    fn admit(&mut self) {
        let ps = self.cfg.page_size;
        let total = self.pool.total_pages();
        while self.active.len() < self.cfg.max_running {
            let Some(job) = self.waiting.front() else {
                return;
            };
            let tokens = job.tokens();
            let need = tokens.div_ceil(ps);
            if need > total {
                if let Some(j) = self.waiting.pop_front() {
                    j.fail(EngineError::TooLarge {
                        need,
                        tokens,
                        total,
                    });
                }
                continue;
            }
            let free = self.pool.available_pages();
            if need > free {
                if self.cfg.when_full == WhenFull::Wait {
                    return;
                }
                if let Some(j) = self.waiting.pop_front() {
                    j.fail(EngineError::Full { need, free });
                }
                continue;
            }
            let Some(job) = self.waiting.pop_front() else {
                return;
            };
            match self.start(job, tokens) {
                Ok(Some(a)) => self.active.push(a),
                Ok(None) => {}
                Err((job, e)) => job.fail(e),
            }
        }
    }

    fn prefix_cache(&self) -> bool {
        self.cfg.prefix_cache && self.device.shares_prefixes()
    }

    /// A sequence for `input` with room for `tokens` tokens; with a cache salt, full pages of the
    /// input already cached under that salt are shared. Returns it and the tokens shared.
    fn new_sequence(
        &mut self,
        owner: OwnerId,
        input: &[u32],
        tokens: usize,
        salt: Option<u64>,
    ) -> Result<(Sequence, usize), EngineError> {
        let Some(salt) = salt else {
            return Ok((self.pool.new_sequence(owner, tokens)?, 0));
        };
        let (mut seq, shared) = self.pool.start_with_prefix(owner, input, salt)?;
        if let Err(e) = self.pool.reserve(&mut seq, tokens - shared) {
            let _ = self.pool.release(seq);
            return Err(e.into());
        }
        self.stats
            .prefix_hit_tokens
            .fetch_add(shared, Ordering::Relaxed);
        Ok((seq, shared))
    }

    /// Ends a running request with an error and frees its pages.
    fn fail(&mut self, mut a: Active, e: EngineError) {
        match &mut a.role {
            Role::Gen { events, .. } => {
                let _ = events.send(Event::Failed(e));
            }
            Role::Prefill { reply, .. } => {
                if let Some(r) = reply.take() {
                    let _ = r.send(Err(e));
                }
            }
        }
        self.release(a);
    }

    fn finish_prefill(&mut self, mut a: Active) {
        let exported = match self
            .device
            .download(&mut self.pool, &a.seq, self.cfg.page_size)
        {
            Ok(sums) => self
                .pool
                .export(&a.seq, a.id, self.bundle.fingerprint)
                .map_err(EngineError::from)
                .and_then(|t| match sums {
                    // The device's checksums of the pages must equal the host copy's.
                    Some(sums) if sums != t.manifest.page_checksums => {
                        let index = sums
                            .iter()
                            .zip(&t.manifest.page_checksums)
                            .position(|(a, b)| a != b)
                            .unwrap_or(0) as u32;
                        Err(TransferError::PageCorrupt { index }.into())
                    }
                    _ => Ok(t),
                }),
            Err(e) => Err(e),
        };
        let prompt_logprobs = a.score.take().map(|s| s.out);
        let (sink, reply, cached) = match &mut a.role {
            Role::Prefill {
                sink,
                reply,
                cached,
            } => (sink.take(), reply.take(), *cached as u64),
            Role::Gen { .. } => (None, None, 0),
        };
        // The set is a copy: the pages are free before it leaves.
        self.release(a);
        let r = exported.map(|t| {
            let report = KvReport {
                tokens: t.manifest.tokens,
                digest: t.manifest.manifest_checksum,
                cached,
                prompt_logprobs,
            };
            if let Some(sink) = sink {
                let mut t = t;
                // The scores travel with the KV: the decode sends them before its first token.
                t.prompt_logprobs = report.prompt_logprobs.clone();
                sink(t);
            }
            report
        });
        if let Some(reply) = reply {
            let _ = reply.send(r);
        }
    }

    /// One forward step over the batch.
    fn step(&mut self) {
        let mut budget = self.cfg.max_batch_tokens.max(1);
        // (active index, tokens this step, wants logits, every token's: a scored prompt)
        let mut plan: Vec<(usize, usize, bool, bool)> = Vec::new();
        for (i, a) in self.active.iter().enumerate() {
            if a.fed == a.input.len() {
                plan.push((i, 1, true, false));
                budget = budget.saturating_sub(1);
            }
        }
        for (i, a) in self.active.iter().enumerate() {
            if a.fed < a.input.len() && budget > 0 {
                let n = (a.input.len() - a.fed).min(budget);
                budget -= n;
                let last = a.fed + n == a.input.len();
                let generates = matches!(a.role, Role::Gen { .. });
                plan.push((i, n, last && generates, a.score.is_some()));
            }
        }
        plan.sort_by_key(|p| p.0);
        let result = {
            let mut items = Vec::with_capacity(plan.len());
            let mut pi = plan.iter().peekable();
            for (i, a) in self.active.iter_mut().enumerate() {
                let Some(&&(j, n, logits, _)) = pi.peek() else {
                    break;
                };
                if j != i {
                    continue;
                }
                pi.next();
                let Active {
                    seq,
                    input,
                    fed,
                    role,
                    ..
                } = a;
                let tokens: &[u32] = if *fed < input.len() {
                    &input[*fed..*fed + n]
                } else if let Role::Gen { next, .. } = role {
                    &next[..]
                } else {
                    &[]
                };
                items.push(Step {
                    seq,
                    tokens,
                    logits,
                });
            }
            let all: Vec<bool> = plan.iter().map(|p| p.3).collect();
            self.device
                .forward_batch_scored(&self.bundle, &mut self.pool, &mut items, &all)
        };
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                // The step failed as a whole: end every request in it.
                let e = EngineError::from(e);
                let mut ids: Vec<usize> = plan.iter().map(|p| p.0).collect();
                ids.sort_unstable_by(|a, b| b.cmp(a));
                for i in ids {
                    let a = self.active.swap_remove(i);
                    self.fail(a, e.clone());
                }
                return;
            }
        };
        let mut logits = logits.into_iter();
        let mut done = Vec::new();
        for &(i, n, want, all) in &plan {
            let a = &mut self.active[i];
            let mut own = None;
            if all {
                // Every position's logits score the prompt's next token; the last position's
                // are also the first token's to sample from.
                let from = a.fed;
                for j in 0..n {
                    let Some(l) = logits.next() else { break };
                    if let Some(s) = a.score.as_mut() {
                        s.add(from + j, &l);
                    }
                    if j + 1 == n {
                        own = Some(l);
                    }
                }
            }
            if a.fed < a.input.len() {
                a.fed += n;
                if a.fed == a.input.len()
                    && let Some(salt) = a.publish.take()
                    && let Err(e) = self.pool.publish_prefix(&mut a.seq, &a.input, salt)
                {
                    tracing::error!(request = a.id, error = %e, "prefix pages not published");
                }
            }
            if !want {
                if a.fed == a.input.len() && matches!(a.role, Role::Prefill { .. }) {
                    done.push(i);
                }
                continue;
            }
            let Some(l) = own.or_else(|| logits.next()) else {
                continue;
            };
            // A generating request's scored prompt goes out before its first token.
            if let (Some(s), Role::Gen { events, .. }) =
                (a.score.take_if(|_| a.fed == a.input.len()), &a.role)
            {
                let _ = events.send(Event::Prompt { logprobs: s.out });
            }
            if let Some(last) = next_token(&mut a.role, l, &self.bundle.tokenizer) {
                self.stats.generated.fetch_add(1, Ordering::Relaxed);
                if last {
                    done.push(i);
                }
            }
        }
        done.sort_unstable_by(|a, b| b.cmp(a));
        for i in done {
            let a = self.active.swap_remove(i);
            if matches!(a.role, Role::Prefill { .. }) {
                self.finish_prefill(a);
            } else {
                self.release(a);
            }
        }
    }
}

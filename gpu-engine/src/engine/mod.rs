//! The serving engine: one thread owns a model's page pool and runs continuous batching. Each
//! step runs every decoding sequence's next token together with prompt chunks of sequences still
//! in prefill (up to a token budget), through one [`Llama::forward_batch`]. A request is admitted
//! only when all the pages it can ever need (prompt + `max_tokens`) are allocated, so it is never
//! truncated; until then it waits or is refused ([`WhenFull`]). An abort, a dropped receiver or a
//! finish frees the request's pages at the next step boundary.
//!
//! Roles: a *unified* engine runs whole requests; in split mode a prefill engine computes the
//! prompt's KV ([`Engine::prefill`]: it exports a checksummed [`KvTransfer`] into a sink and
//! reports its digest) and a decode engine verifies and imports it ([`Generate::kv`]) and
//! generates (the `pd` module pairs two engines in one process).

mod job;
mod scheduler;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

use tokio::sync::{mpsc as tmpsc, oneshot};

pub use crate::bundle::ModelBundle;
use crate::device::EngineDevice;
pub use crate::error::EngineError;
use crate::pool::{KvDtype, PagePool, PoolConfig, ScrubPolicy, VerifyMode};
use crate::sample::{Finish, SamplingConfig, TokenLogprobs};
use crate::transfer::KvTransfer;
use job::Job;
use scheduler::Scheduler;

/// What to do with a request whose pages are not free now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhenFull {
    /// Queue it (first come, first served) until pages free up.
    Wait,
    /// Refuse it at once.
    Refuse,
}

/// Engine sizing and policies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineConfig {
    /// Pages in the KV pool.
    pub pages: u32,
    /// Tokens per page.
    pub page_size: usize,
    /// KV storage type.
    pub dtype: KvDtype,
    /// Page scrubbing.
    pub scrub: ScrubPolicy,
    /// Page tag verification.
    pub verify: VerifyMode,
    /// Tokens per step (decode tokens plus prompt chunks).
    pub max_batch_tokens: usize,
    /// Requests in the batch at once.
    pub max_running: usize,
    /// Wait or refuse when the pool is full.
    pub when_full: WhenFull,
    /// Reuse the KV of full prompt pages computed for earlier requests of the same cache salt
    /// (tenant). CPU engines only for now.
    pub prefix_cache: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            pages: 512,
            page_size: 16,
            dtype: KvDtype::F16,
            scrub: ScrubPolicy::OnFree,
            verify: VerifyMode::Always,
            max_batch_tokens: 256,
            max_running: 16,
            when_full: WhenFull::Wait,
            prefix_cache: true,
        }
    }
}

/// What a generating request receives.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Admitted: its pages are allocated (and its imported KV verified).
    Started {
        /// Prompt tokens whose KV this engine holds or will compute.
        prompt_tokens: u64,
        /// The manifest checksum of the imported KV, recomputed after verification.
        kv_digest: Option<u64>,
    },
    /// One generated token.
    Token {
        /// Token id.
        id: u32,
        /// Text to append (stop strings held back or cut).
        text: String,
        /// Set on the last token.
        finish: Option<Finish>,
        /// On the last token, the stop string that ended generation, when one did.
        matched_stop: Option<String>,
        /// Its log-probabilities, when the request asked for them ([`SamplingConfig::logprobs`]).
        logprobs: Option<TokenLogprobs>,
    },
    /// The prompt's log-probabilities ([`SamplingConfig::prompt_logprobs`]): one per prompt
    /// token after the first, in order, sent before the first token.
    Prompt {
        /// The entries.
        logprobs: Vec<TokenLogprobs>,
    },
    /// The request ended with an error; its pages are free.
    Failed(EngineError),
}

impl Event {
    /// The event of one sampled token and what it did to the output.
    pub(crate) fn token(
        id: u32,
        emit: crate::sample::Emit,
        logprobs: Option<TokenLogprobs>,
    ) -> Event {
        Event::Token {
            id,
            text: emit.text,
            finish: emit.finish,
            matched_stop: emit.matched_stop,
            logprobs,
        }
    }
}

/// A generation request.
#[derive(Debug)]
pub struct Generate {
    /// Request (pair) id: the pages' owner and the transfer's pair.
    pub id: u64,
    /// The whole prompt.
    pub prompt: Arc<[u32]>,
    /// Sampling and stopping.
    pub sampling: SamplingConfig,
    /// KV of `prompt[..len - 1]` computed by a prefill engine; `None` computes it here.
    pub kv: Option<KvTransfer>,
    /// The prefix-cache namespace (one per tenant): only requests with the same salt share
    /// cached prompt pages. `None`: no prefix cache for this request.
    pub cache_salt: Option<u64>,
}

#[allow(clippy::large_enum_variant)] // One per request, moved straight into the queue.
enum Cmd {
    Submit(Job),
    Abort(u64),
    Stop,
}

/// Where a prefill engine sends the KV it exported (the decode side's room, or the network).
pub type KvSink = Box<dyn FnOnce(KvTransfer) + Send>;

/// What a prefill reports about the KV it sent.
#[derive(Debug, Clone, PartialEq)]
pub struct KvReport {
    /// Tokens whose KV was exported.
    pub tokens: u64,
    /// The manifest checksum.
    pub digest: u64,
    /// Tokens whose KV came from the prefix cache rather than being computed.
    pub cached: u64,
    /// The prompt's log-probabilities, when asked ([`Engine::prefill_scored`]): one per token of
    /// the whole prompt after the first.
    pub prompt_logprobs: Option<Vec<TokenLogprobs>>,
}

/// Live counters, readable from any thread.
#[derive(Debug, Default)]
pub struct EngineStats {
    /// Free pages in the pool.
    pub free_pages: AtomicUsize,
    /// Pages in the pool.
    pub total_pages: AtomicUsize,
    /// Requests in the batch.
    pub running: AtomicUsize,
    /// Requests queued for pages.
    pub waiting: AtomicUsize,
    /// Tokens generated since start.
    pub generated: AtomicUsize,
    /// Prompt tokens whose KV came from the prefix cache instead of being computed.
    pub prefix_hit_tokens: AtomicUsize,
    /// Prompt tokens of imported KV sets whose pages were already cached with the same bytes:
    /// shared instead of copied (a decode engine's).
    pub import_shared_tokens: AtomicUsize,
}

/// A cheap, clonable way to submit work to an engine.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Cmd>,
    /// The model's vocabulary: a job with a token id outside it is refused on its own, before
    /// it can reach (and fail) a batch.
    vocab: usize,
}

/// An engine thread. Dropping it stops the thread.
pub struct Engine {
    handle: EngineHandle,
    stats: Arc<EngineStats>,
    thread: Option<std::thread::JoinHandle<()>>,
    page_bytes: usize,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Starts an engine thread over a fresh pool for `bundle`'s model.
    pub fn start(
        name: &str,
        bundle: Arc<ModelBundle>,
        cfg: EngineConfig,
    ) -> Result<Engine, EngineError> {
        let c = bundle.model.cfg;
        let pool = PagePool::new(PoolConfig {
            scrub: cfg.scrub,
            verify: cfg.verify,
            dtype: cfg.dtype,
            ..c.kv_pool(cfg.pages, cfg.page_size)
        })?;
        let page_bytes = pool.config().page_bytes();
        let stats = Arc::new(EngineStats::default());
        stats
            .total_pages
            .store(pool.total_pages(), Ordering::Relaxed);
        stats
            .free_pages
            .store(pool.available_pages(), Ordering::Relaxed);
        let device = EngineDevice::for_bundle(&bundle, &pool)?;
        let (tx, rx) = mpsc::channel();
        let mut scheduler = Scheduler::new(bundle, cfg, pool, device, stats.clone());
        let thread = std::thread::Builder::new()
            .name(format!("lockstep-engine-{name}"))
            .spawn(move || scheduler.run(rx))
            .map_err(|e| EngineError::BadRequest(format!("cannot start engine thread: {e}")))?;
        Ok(Engine {
            handle: EngineHandle { tx, vocab: c.vocab },
            stats,
            thread: Some(thread),
            page_bytes,
        })
    }

    /// A handle for submitting work.
    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    /// Queues a generation request ([`EngineHandle::generate`]).
    pub fn generate(&self, req: Generate) -> tmpsc::UnboundedReceiver<Event> {
        self.handle.generate(req)
    }

    /// Queues a prefill ([`EngineHandle::prefill`]).
    pub fn prefill(
        &self,
        id: u64,
        tokens: Arc<[u32]>,
        cache_salt: Option<u64>,
        sink: KvSink,
    ) -> oneshot::Receiver<Result<KvReport, EngineError>> {
        self.handle.prefill(id, tokens, cache_salt, sink, None)
    }

    /// [`Engine::prefill`] that also scores the prompt: `score` is the `k` alternatives and the
    /// whole prompt (`tokens` and the last token the decode computes), whose tokens after the
    /// first get their log-probabilities in the report. The prefix cache is not read for it.
    pub fn prefill_scored(
        &self,
        id: u64,
        tokens: Arc<[u32]>,
        cache_salt: Option<u64>,
        sink: KvSink,
        score: Option<(usize, Arc<[u32]>)>,
    ) -> oneshot::Receiver<Result<KvReport, EngineError>> {
        self.handle.prefill(id, tokens, cache_salt, sink, score)
    }

    /// Aborts request `id` ([`EngineHandle::abort`]).
    pub fn abort(&self, id: u64) {
        self.handle.abort(id)
    }

    /// Live counters.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Bytes in one KV page of this engine's pool (every page of a KV set it imports).
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Asks the engine thread to stop (queued and running work fails with `Stopped`) without
    /// waiting for it; dropping the engine waits.
    pub fn stop(&self) {
        let _ = self.handle.tx.send(Cmd::Stop);
    }

    /// Whether the engine thread still runs (a panic in it ends it: nothing more will be
    /// served, so health must say so).
    pub fn is_alive(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }
}

impl EngineHandle {
    /// Queues a generation request; events arrive on the receiver. Dropping the receiver aborts.
    pub fn generate(&self, req: Generate) -> tmpsc::UnboundedReceiver<Event> {
        let (tx, rx) = tmpsc::unbounded_channel();
        let checked = self.check_ids(&req.prompt).and_then(|()| {
            req.sampling
                .check()
                .map_err(|m| EngineError::BadRequest(format!("stop: {m}")))
        });
        if let Err(e) = checked {
            let _ = tx.send(Event::Failed(e));
            return rx;
        }
        if let Err(mpsc::SendError(Cmd::Submit(job))) =
            self.tx.send(Cmd::Submit(Job::Gen(req, tx, None)))
        {
            job.fail(EngineError::Stopped);
        }
        rx
    }

    fn check_ids(&self, ids: &[u32]) -> Result<(), EngineError> {
        match ids.iter().find(|&&t| t as usize >= self.vocab) {
            Some(t) => Err(EngineError::BadRequest(format!(
                "token id {t} is outside the vocabulary of {} tokens",
                self.vocab
            ))),
            None => Ok(()),
        }
    }

    /// Queues a prefill: computes the KV of `tokens`, exports it for pair `id` into `sink` (from
    /// the engine thread, whether or not anyone awaits the report), frees its pages, then
    /// reports. `cache_salt` as in [`Generate::cache_salt`]. Dropping the receiver aborts.
    pub fn prefill(
        &self,
        id: u64,
        tokens: Arc<[u32]>,
        cache_salt: Option<u64>,
        sink: KvSink,
        score: Option<(usize, Arc<[u32]>)>,
    ) -> oneshot::Receiver<Result<KvReport, EngineError>> {
        let (reply, rx) = oneshot::channel();
        if let Err(e) = self.check_ids(&tokens) {
            let _ = reply.send(Err(e));
            return rx;
        }
        let _ = self.tx.send(Cmd::Submit(Job::Prefill {
            id,
            tokens,
            cache_salt,
            sink,
            reply,
            score,
        }));
        rx
    }

    /// Aborts request `id` wherever it is (queued or running) and frees its pages.
    pub fn abort(&self, id: u64) {
        let _ = self.tx.send(Cmd::Abort(id));
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.handle.tx.send(Cmd::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

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
//! generates (see [`crate::pd`]).

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

use tokio::sync::{mpsc as tmpsc, oneshot};

use crate::cuda::{CudaLlama, DeviceChoice, DeviceKv};
use crate::model::{Llama, ModelError, Step};
use crate::pool::{
    IntegrityError, KvDtype, OwnerId, PagePool, PoolConfig, PoolError, ScrubPolicy, Sequence,
    VerifyMode,
};
use crate::sample::{Finish, Sampler, SamplingConfig, TextStream};
use crate::tokenizer::ModelTokenizer;
use crate::transfer::{ImportExpectation, KvTransfer, ModelFingerprint, TransferError};

/// A model with its tokenizer, loaded once and shared by the engines that serve it.
pub struct ModelBundle {
    /// The network (CPU).
    pub model: Llama,
    /// The same network on a GPU, when the engine runs there.
    pub gpu: Option<CudaLlama>,
    /// Tokenizer and chat template from the same file.
    pub tokenizer: ModelTokenizer,
    /// Identifies the weights in KV manifests.
    pub fingerprint: ModelFingerprint,
    /// End-of-generation tokens.
    pub eog: Vec<u32>,
}

impl std::fmt::Debug for ModelBundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelBundle")
            .field("model", &self.model)
            .field("device", &self.device())
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

impl ModelBundle {
    /// Loads a GGUF file to run on the CPU.
    pub fn open(path: &Path) -> Result<ModelBundle, ModelError> {
        ModelBundle::open_on(path, DeviceChoice::Cpu)
    }

    /// Loads a GGUF file to run where `device` says: `auto` takes CUDA when the driver, NVRTC,
    /// cuBLAS and a device are all there and otherwise the CPU (logging which was missing);
    /// an explicit `cuda:N` that cannot be used is an error.
    pub fn open_on(path: &Path, device: DeviceChoice) -> Result<ModelBundle, ModelError> {
        // The device first: an explicit device that cannot be used fails before any loading.
        let dev = crate::cuda::select(device).map_err(|e| ModelError::Device(e.to_string()))?;
        let g = crate::gguf::open(path).map_err(|e| ModelError::Format(e.to_string()))?;
        let model = Llama::load(&g)?;
        let gpu = match dev {
            Some(dev) => Some(CudaLlama::load(dev, &g)?),
            None => None,
        };
        let tokenizer =
            ModelTokenizer::from_gguf(&g).map_err(|e| ModelError::Format(e.to_string()))?;
        let weights = xxhash_rust::xxh3::xxh3_64(g.bytes());
        let fingerprint =
            ModelFingerprint::derive(&format!("{:?}", model.cfg), &format!("{weights:016x}"));
        let mut eog = vec![tokenizer.eos];
        for name in ["<|im_end|>", "<|endoftext|>", "<|eot_id|>"] {
            if let Some(id) = tokenizer.inner.token_to_id(name)
                && !eog.contains(&id)
            {
                eog.push(id);
            }
        }
        Ok(ModelBundle {
            model,
            gpu,
            tokenizer,
            fingerprint,
            eog,
        })
    }
}

impl ModelBundle {
    /// Where the engines of this bundle compute: `cpu` or `cuda:N (name)`.
    pub fn device(&self) -> String {
        match &self.gpu {
            Some(g) => g.gpu().label(),
            None => "cpu".into(),
        }
    }
}

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

/// Why the engine refused or ended a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// The request can never fit the pool.
    #[error("request needs {need} KV pages ({tokens} tokens), the pool holds {total}")]
    TooLarge {
        /// Pages needed.
        need: usize,
        /// Tokens (prompt + max tokens).
        tokens: usize,
        /// Pages in the pool.
        total: usize,
    },
    /// The pool is full now and the engine refuses rather than waits.
    #[error("KV pool full: {need} pages needed, {free} free")]
    Full {
        /// Pages needed.
        need: usize,
        /// Pages free.
        free: usize,
    },
    /// Malformed request.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The imported KV failed verification.
    #[error("KV transfer refused: {0}")]
    Transfer(#[from] TransferError),
    /// A page tag check failed.
    #[error(transparent)]
    Integrity(#[from] IntegrityError),
    /// The model could not run.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A pool refusal.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The engine (or the other half) stopped or aborted the request.
    #[error("request aborted or engine stopped")]
    Stopped,
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
    },
    /// The request ended with an error; its pages are free.
    Failed(EngineError),
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvReport {
    /// Tokens whose KV was exported.
    pub tokens: u64,
    /// The manifest checksum.
    pub digest: u64,
    /// Tokens whose KV came from the prefix cache rather than being computed.
    pub cached: u64,
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
}

/// A cheap, clonable way to submit work to an engine.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Cmd>,
}

/// An engine thread. Dropping it stops the thread.
pub struct Engine {
    handle: EngineHandle,
    stats: Arc<EngineStats>,
    thread: Option<std::thread::JoinHandle<()>>,
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
        let stats = Arc::new(EngineStats::default());
        stats
            .total_pages
            .store(pool.total_pages(), Ordering::Relaxed);
        stats
            .free_pages
            .store(pool.available_pages(), Ordering::Relaxed);
        let dev = match &bundle.gpu {
            Some(g) => Some(
                DeviceKv::new(g.gpu().clone(), pool.config())
                    .map_err(|e| EngineError::Model(ModelError::Device(e.to_string())))?,
            ),
            None => None,
        };
        let (tx, rx) = mpsc::channel();
        let mut worker = Worker {
            bundle,
            cfg,
            pool,
            dev,
            stats: stats.clone(),
            waiting: VecDeque::new(),
            active: Vec::new(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("lockstep-engine-{name}"))
            .spawn(move || worker.run(rx))
            .map_err(|e| EngineError::BadRequest(format!("cannot start engine thread: {e}")))?;
        Ok(Engine {
            handle: EngineHandle { tx },
            stats,
            thread: Some(thread),
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
        self.handle.prefill(id, tokens, cache_salt, sink)
    }

    /// Aborts request `id` ([`EngineHandle::abort`]).
    pub fn abort(&self, id: u64) {
        self.handle.abort(id)
    }

    /// Live counters.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }
}

impl EngineHandle {
    /// Queues a generation request; events arrive on the receiver. Dropping the receiver aborts.
    pub fn generate(&self, req: Generate) -> tmpsc::UnboundedReceiver<Event> {
        let (tx, rx) = tmpsc::unbounded_channel();
        if let Err(mpsc::SendError(Cmd::Submit(job))) = self.tx.send(Cmd::Submit(Job::Gen(req, tx)))
        {
            job.fail(EngineError::Stopped);
        }
        rx
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
    ) -> oneshot::Receiver<Result<KvReport, EngineError>> {
        let (reply, rx) = oneshot::channel();
        let _ = self.tx.send(Cmd::Submit(Job::Prefill {
            id,
            tokens,
            cache_salt,
            sink,
            reply,
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

/// What a request is doing.
#[allow(clippy::large_enum_variant)] // One per running request; boxing buys nothing.
enum Role {
    Gen {
        events: tmpsc::UnboundedSender<Event>,
        sampler: Sampler,
        text: TextStream,
        /// The token to feed next, once the prompt is in.
        next: [u32; 1],
        sampled: usize,
    },
    Prefill {
        sink: Option<KvSink>,
        reply: Option<oneshot::Sender<Result<KvReport, EngineError>>>,
        /// Tokens shared from the prefix cache.
        cached: usize,
    },
}

/// A queued request.
enum Job {
    Gen(Generate, tmpsc::UnboundedSender<Event>),
    Prefill {
        id: u64,
        tokens: Arc<[u32]>,
        cache_salt: Option<u64>,
        sink: KvSink,
        reply: oneshot::Sender<Result<KvReport, EngineError>>,
    },
}

impl Job {
    fn id(&self) -> u64 {
        match self {
            Job::Gen(g, _) => g.id,
            Job::Prefill { id, .. } => *id,
        }
    }
    fn tokens(&self) -> usize {
        match self {
            Job::Gen(g, _) => g.prompt.len() + g.sampling.max_tokens.max(1),
            Job::Prefill { tokens, .. } => tokens.len(),
        }
    }
    fn fail(self, e: EngineError) {
        match self {
            Job::Gen(_, events) => {
                let _ = events.send(Event::Failed(e));
            }
            Job::Prefill { reply, .. } => {
                let _ = reply.send(Err(e));
            }
        }
    }
    fn abandoned(&self) -> bool {
        match self {
            Job::Gen(_, events) => events.is_closed(),
            Job::Prefill { reply, .. } => reply.is_closed(),
        }
    }
}

/// A request holding pages.
struct Active {
    id: u64,
    seq: Sequence,
    input: Arc<[u32]>,
    /// Input tokens whose KV is in `seq`.
    fed: usize,
    /// The prefix-cache namespace, while the input's full pages are still to be published.
    publish: Option<u64>,
    role: Role,
}

impl Active {
    fn abandoned(&self) -> bool {
        match &self.role {
            Role::Gen { events, .. } => events.is_closed(),
            Role::Prefill { reply, .. } => reply.as_ref().is_none_or(|r| r.is_closed()),
        }
    }
}

struct Worker {
    bundle: Arc<ModelBundle>,
    cfg: EngineConfig,
    /// Page bookkeeping (and, on a GPU, the host staging copy of pages in transfer).
    pool: PagePool,
    /// The pages themselves when the engine runs on a GPU.
    dev: Option<DeviceKv>,
    stats: Arc<EngineStats>,
    waiting: VecDeque<Job>,
    active: Vec<Active>,
}

impl Worker {
    fn run(&mut self, rx: mpsc::Receiver<Cmd>) {
        loop {
            let first = if self.active.is_empty() && self.waiting.is_empty() {
                match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
            } else {
                None
            };
            for cmd in first
                .into_iter()
                .chain(std::iter::from_fn(|| rx.try_recv().ok()))
            {
                match cmd {
                    Cmd::Submit(job) => self.waiting.push_back(job),
                    Cmd::Abort(id) => self.abort(id),
                    Cmd::Stop => {
                        self.shutdown();
                        return;
                    }
                }
            }
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
        s.waiting.store(self.waiting.len(), Ordering::Relaxed);
    }

    fn release(&mut self, a: Active) {
        if let Err(e) = self.pool.release(a.seq) {
            tracing::error!(request = a.id, error = %e, "pages not released");
        }
        // On a GPU, mirror the freed tags now so a scrub policy zeroes the pages at once.
        if let Some(kv) = self.dev.as_mut()
            && self.cfg.scrub != ScrubPolicy::None
            && let Err(e) = kv.sync_tags(&self.pool)
        {
            tracing::error!(request = a.id, error = %e, "device pages not scrubbed");
        }
    }

    fn abort(&mut self, id: u64) {
        self.waiting.retain(|j| j.id() != id);
        while let Some(i) = self.active.iter().position(|a| a.id == id) {
            let a = self.active.swap_remove(i);
            self.release(a);
        }
    }

    fn drop_abandoned(&mut self) {
        self.waiting.retain(|j| !j.abandoned());
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

    /// Allocates a job's pages (importing its KV when it brings some).
    #[allow(clippy::result_large_err)]
    fn start(&mut self, job: Job, tokens: usize) -> Result<Option<Active>, (Job, EngineError)> {
        let id = job.id();
        let owner = OwnerId::sequence(id);
        match job {
            Job::Prefill {
                id,
                tokens,
                cache_salt,
                sink,
                reply,
            } => {
                let salt = cache_salt.filter(|_| self.prefix_cache());
                let (seq, shared) = match self.new_sequence(owner, &tokens, tokens.len(), salt) {
                    Ok(s) => s,
                    Err(e) => {
                        let job = Job::Prefill {
                            id,
                            tokens,
                            cache_salt,
                            sink,
                            reply,
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
                };
                if a.input.is_empty() {
                    // Nothing to compute: export the empty set at once.
                    self.finish_prefill(a);
                    return Ok(None);
                }
                Ok(Some(a))
            }
            Job::Gen(mut g, events) => {
                if g.prompt.is_empty() {
                    return Err((
                        Job::Gen(g, events),
                        EngineError::BadRequest("empty prompt".into()),
                    ));
                }
                let salt = g.cache_salt.filter(|_| self.prefix_cache());
                let (seq, digest) = match g.kv.take() {
                    None => match self.new_sequence(owner, &g.prompt, tokens, salt) {
                        Ok((s, _)) => (s, None),
                        Err(e) => return Err((Job::Gen(g, events), e)),
                    },
                    Some(t) => {
                        let expect = ImportExpectation {
                            pair_id: id,
                            model: self.bundle.fingerprint,
                            tokens: g.prompt.len() as u64 - 1,
                        };
                        let imported = self
                            .pool
                            .import(owner, expect, &t)
                            .map_err(EngineError::from)
                            .and_then(|mut s| {
                                let extra = tokens - s.len;
                                let r = self
                                    .pool
                                    .reserve(&mut s, extra)
                                    .map_err(EngineError::from)
                                    .and_then(|()| self.upload(&s, &t.manifest.page_checksums));
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
                            Err(e) => return Err((Job::Gen(g, events), e)),
                        }
                    }
                };
                let fed = seq.len;
                let _ = events.send(Event::Started {
                    prompt_tokens: g.prompt.len() as u64,
                    kv_digest: digest,
                });
                let text = TextStream::new(&g.sampling, &self.bundle.eog);
                Ok(Some(Active {
                    id,
                    seq,
                    input: g.prompt,
                    fed,
                    publish: salt.filter(|_| digest.is_none()),
                    role: Role::Gen {
                        events,
                        sampler: Sampler::new(g.sampling),
                        text,
                        next: [0],
                        sampled: 0,
                    },
                }))
            }
        }
    }

    fn prefix_cache(&self) -> bool {
        self.cfg.prefix_cache && self.dev.is_none()
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
        let exported = match self.download(&a.seq) {
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
            };
            if let Some(sink) = sink {
                sink(t);
            }
            report
        });
        if let Some(reply) = reply {
            let _ = reply.send(r);
        }
    }

    /// On a GPU: copies an imported sequence's pages (verified on the host) to the device and
    /// checks the device's checksums of them against the manifest's.
    fn upload(&mut self, seq: &Sequence, sums: &[u64]) -> Result<(), EngineError> {
        let Some(kv) = self.dev.as_mut() else {
            return Ok(());
        };
        let pages: Vec<_> = seq.pages.iter().take(sums.len()).map(|r| r.page).collect();
        let dev = |e: crate::cuda::CudaError| EngineError::Model(ModelError::Device(e.to_string()));
        kv.upload_pages(&self.pool, &pages).map_err(dev)?;
        let got = kv.checksums(&pages).map_err(dev)?;
        match got.iter().zip(sums).position(|(a, b)| a != b) {
            Some(index) => Err(TransferError::PageCorrupt {
                index: index as u32,
            }
            .into()),
            None => Ok(()),
        }
    }

    /// On a GPU: copies a finished prefill's pages into the host pool for export and returns
    /// the device's checksums of them (CPU: nothing to do).
    fn download(&mut self, seq: &Sequence) -> Result<Option<Vec<u64>>, EngineError> {
        let Some(kv) = self.dev.as_ref() else {
            return Ok(None);
        };
        let used = seq.len.div_ceil(self.cfg.page_size);
        let pages: Vec<_> = seq.pages.iter().take(used).map(|r| r.page).collect();
        let dev = |e: crate::cuda::CudaError| EngineError::Model(ModelError::Device(e.to_string()));
        kv.download_pages(&mut self.pool, &pages).map_err(dev)?;
        Ok(Some(kv.checksums(&pages).map_err(dev)?))
    }

    /// One forward step over the batch.
    fn step(&mut self) {
        let mut budget = self.cfg.max_batch_tokens.max(1);
        // (active index, tokens this step, wants logits)
        let mut plan: Vec<(usize, usize, bool)> = Vec::new();
        for (i, a) in self.active.iter().enumerate() {
            if a.fed == a.input.len() {
                plan.push((i, 1, true));
                budget = budget.saturating_sub(1);
            }
        }
        for (i, a) in self.active.iter().enumerate() {
            if a.fed < a.input.len() && budget > 0 {
                let n = (a.input.len() - a.fed).min(budget);
                budget -= n;
                let last = a.fed + n == a.input.len();
                plan.push((i, n, last && matches!(a.role, Role::Gen { .. })));
            }
        }
        plan.sort_by_key(|p| p.0);
        let result = {
            let mut items = Vec::with_capacity(plan.len());
            let mut pi = plan.iter().peekable();
            for (i, a) in self.active.iter_mut().enumerate() {
                let Some(&&(j, n, logits)) = pi.peek() else {
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
            match (&self.bundle.gpu, self.dev.as_mut()) {
                (Some(g), Some(kv)) => g.forward_batch(&mut self.pool, kv, &mut items),
                _ => self.bundle.model.forward_batch(&mut self.pool, &mut items),
            }
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
        for &(i, n, want) in &plan {
            let a = &mut self.active[i];
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
            let Some(l) = logits.next() else {
                continue;
            };
            if let Role::Gen {
                events,
                sampler,
                text,
                next,
                sampled,
            } = &mut a.role
            {
                let id = sampler.sample(&l, *sampled, text.ids());
                *sampled += 1;
                next[0] = id;
                let emit = text.push(&self.bundle.tokenizer, id);
                self.stats.generated.fetch_add(1, Ordering::Relaxed);
                let finished = emit.finish.is_some();
                let sent = events.send(Event::Token {
                    id,
                    text: emit.text,
                    finish: emit.finish,
                });
                if finished || sent.is_err() {
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

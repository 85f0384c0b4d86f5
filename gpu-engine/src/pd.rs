//! Disaggregation in process: a prefill engine and a decode engine with separate page pools. The
//! prefill engine computes the KV of the prompt's first `n - 1` tokens and exports it with its
//! manifest; the set goes through the pair's *room* (SGLang's bootstrap room, in memory) to the
//! decode engine, which verifies it against what it knows of the pair (id, model, token count),
//! imports it, recomputes the last prompt token and generates. Each side reports the manifest
//! digest it saw, so the router's commit barrier can compare the two.
//!
//! Unified mode runs whole requests on one engine (no transfer, no digest).
//!
//! Fault injection (for tests; off unless configured) tampers with the set between the halves.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, mpsc as tmpsc};

use crate::engine::{Engine, EngineConfig, EngineError, Event, Generate, ModelBundle};
use crate::sample::SamplingConfig;
use crate::transfer::{KvTransfer, PageData};

/// A tampering applied to the KV between the halves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Flip one byte of the first page.
    CorruptPage,
    /// Lose the last page.
    DropPage,
    /// Exchange the first page with the previous pair's (the first pair loses it).
    SwapPages,
    /// The prefill reports failure while its KV still goes to the decode (a decoy).
    RejectWithDecoy,
}

/// Which pairs a fault hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultPlan {
    /// The fault.
    pub fault: Fault,
    /// Every `every`-th pair (1: all).
    pub every: u64,
}

/// What the prefill half reports.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillDone {
    /// Prompt tokens of the request.
    pub prompt_tokens: u64,
    /// Tokens whose KV was exported.
    pub kv_tokens: u64,
    /// The exported manifest's checksum (`None` in unified mode).
    pub kv_digest: Option<u64>,
    /// Prompt tokens the prefill took from its prefix cache (`None` in unified mode).
    pub cached_tokens: Option<u64>,
    /// The prompt's log-probabilities when [`Pd::prefill_scored`] asked (split mode; in unified
    /// mode they come as [`crate::engine::Event::Prompt`] before the first token).
    pub prompt_logprobs: Option<Vec<crate::sample::TokenLogprobs>>,
}

enum RoomState {
    Empty,
    Ready(KvTransfer),
    Closed,
}

/// One pair's hand-off point for its KV set: the prefill side puts, the decode side takes, an
/// abort closes (a set that arrives after the close is dropped). Used in process (the pair's
/// room) and by network workers (pushed sets waiting for their decode call).
pub struct KvRoom {
    state: Mutex<RoomState>,
    ready: Notify,
    created: std::time::Instant,
}

impl Default for KvRoom {
    fn default() -> Self {
        KvRoom {
            state: Mutex::new(RoomState::Empty),
            ready: Notify::new(),
            created: std::time::Instant::now(),
        }
    }
}

impl std::fmt::Debug for KvRoom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvRoom")
            .field("age", &self.created.elapsed())
            .finish_non_exhaustive()
    }
}

impl KvRoom {
    /// Leaves a set for the taker (ignored unless the room is empty).
    pub fn put(&self, t: KvTransfer) {
        if let Ok(mut s) = self.state.lock()
            && matches!(*s, RoomState::Empty)
        {
            *s = RoomState::Ready(t);
        }
        self.ready.notify_one();
    }
    /// Closes the room: a waiting or later `take` gets `None`, a held set is dropped.
    pub fn close(&self) {
        if let Ok(mut s) = self.state.lock() {
            *s = RoomState::Closed;
        }
        self.ready.notify_one();
    }
    /// Waits for the set (`None` once closed). Taking closes the room.
    pub async fn take(&self) -> Option<KvTransfer> {
        loop {
            {
                let mut s = self.state.lock().ok()?;
                match std::mem::replace(&mut *s, RoomState::Closed) {
                    RoomState::Ready(t) => return Some(t),
                    RoomState::Closed => return None,
                    RoomState::Empty => *s = RoomState::Empty,
                }
            }
            self.ready.notified().await;
        }
    }
    /// How long ago the room was opened.
    pub fn age(&self) -> std::time::Duration {
        self.created.elapsed()
    }
    /// Whether a set is waiting in the room.
    pub fn is_ready(&self) -> bool {
        self.state
            .lock()
            .is_ok_and(|s| matches!(*s, RoomState::Ready(_)))
    }
}

enum Mode {
    Unified(Engine),
    Split {
        prefill: Engine,
        decode: Engine,
        rooms: Rooms,
    },
}

type Rooms = Arc<Mutex<HashMap<u64, Arc<KvRoom>>>>;

/// The embedded engine as a pair of halves (or one unified engine).
pub struct Pd {
    bundle: Arc<ModelBundle>,
    mode: Mode,
    faults: Option<FaultPlan>,
    pairs: AtomicU64,
    swap_stash: Arc<Mutex<Option<PageData>>>,
}

impl std::fmt::Debug for Pd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pd")
            .field("split", &self.is_split())
            .field("faults", &self.faults)
            .finish_non_exhaustive()
    }
}

/// Which side of a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    /// The prefill engine.
    Prefill,
    /// The decode engine.
    Decode,
}

impl Pd {
    /// Split mode: two engines with separate pools.
    pub fn split(
        bundle: Arc<ModelBundle>,
        prefill: EngineConfig,
        decode: EngineConfig,
        faults: Option<FaultPlan>,
    ) -> Result<Pd, EngineError> {
        Ok(Pd {
            mode: Mode::Split {
                prefill: Engine::start("prefill", bundle.clone(), prefill)?,
                decode: Engine::start("decode", bundle.clone(), decode)?,
                rooms: Rooms::default(),
            },
            bundle,
            faults,
            pairs: AtomicU64::new(0),
            swap_stash: Arc::default(),
        })
    }

    /// Unified mode: one engine runs whole requests.
    pub fn unified(bundle: Arc<ModelBundle>, cfg: EngineConfig) -> Result<Pd, EngineError> {
        Ok(Pd {
            mode: Mode::Unified(Engine::start("unified", bundle.clone(), cfg)?),
            bundle,
            faults: None,
            pairs: AtomicU64::new(0),
            swap_stash: Arc::default(),
        })
    }

    /// The model.
    pub fn bundle(&self) -> &Arc<ModelBundle> {
        &self.bundle
    }

    /// Whether prefill and decode run on separate engines.
    pub fn is_split(&self) -> bool {
        matches!(self.mode, Mode::Split { .. })
    }

    /// The engines: (name, engine).
    pub fn engines(&self) -> Vec<(&'static str, &Engine)> {
        match &self.mode {
            Mode::Unified(e) => vec![("unified", e)],
            Mode::Split {
                prefill, decode, ..
            } => vec![("prefill", prefill), ("decode", decode)],
        }
    }

    /// Pages free across the engines' pools, and their total.
    pub fn pages(&self) -> (usize, usize) {
        self.engines().iter().fold((0, 0), |(f, t), (_, e)| {
            (
                f + e.stats().free_pages.load(Ordering::Relaxed),
                t + e.stats().total_pages.load(Ordering::Relaxed),
            )
        })
    }

    /// Runs pair `id`'s prefill half (`cache_salt`: the tenant's prefix-cache namespace, see
    /// [`Generate::cache_salt`]). Call before [`Pd::decode`] for the same pair: it opens the
    /// pair's room and queues the work at once; the engine delivers the KV to the room itself,
    /// and the returned future only carries the prefill's report.
    pub fn prefill(
        &self,
        id: u64,
        prompt: Arc<[u32]>,
        cache_salt: Option<u64>,
    ) -> impl Future<Output = Result<PrefillDone, EngineError>> + Send + 'static {
        self.prefill_scored(id, prompt, cache_salt, None)
    }

    /// [`Pd::prefill`] that scores the prompt with `score` alternatives per token (the decode's
    /// [`SamplingConfig::prompt_logprobs`] must say the same: in unified mode the decode scores
    /// it).
    pub fn prefill_scored(
        &self,
        id: u64,
        prompt: Arc<[u32]>,
        cache_salt: Option<u64>,
        score: Option<usize>,
    ) -> impl Future<Output = Result<PrefillDone, EngineError>> + Send + 'static {
        let n = prompt.len() as u64;
        let fault = self
            .faults
            .filter(|f| {
                self.pairs
                    .fetch_add(1, Ordering::Relaxed)
                    .is_multiple_of(f.every.max(1))
            })
            .map(|f| f.fault);
        let report = match &self.mode {
            Mode::Unified(_) => None,
            Mode::Split { prefill, rooms, .. } => {
                let room = Arc::new(KvRoom::default());
                if let Ok(mut r) = rooms.lock() {
                    r.insert(id, room.clone());
                }
                let head: Arc<[u32]> = prompt[..prompt.len().saturating_sub(1)].into();
                let swap = self.swap_stash.clone();
                let sink = Box::new(move |mut t: KvTransfer| {
                    if let Some(f) = fault {
                        f.apply(&mut t, &swap);
                    }
                    room.put(t);
                });
                let score = score.map(|k| (k, prompt.clone()));
                Some(prefill.prefill_scored(id, head, cache_salt, sink, score))
            }
        };
        let rooms = match &self.mode {
            Mode::Split { rooms, .. } => Some(rooms.clone()),
            Mode::Unified(_) => None,
        };
        async move {
            let Some(rx) = report else {
                return Ok(PrefillDone {
                    prompt_tokens: n,
                    kv_tokens: 0,
                    kv_digest: None,
                    cached_tokens: None,
                    prompt_logprobs: None,
                });
            };
            let r = match rx.await {
                Ok(r) => r,
                Err(_) => Err(EngineError::Stopped),
            };
            let kv = match r {
                Ok(kv) => kv,
                Err(e) => {
                    // Nothing will arrive: let the decode side stop waiting.
                    if let Some(room) = rooms.and_then(|r| r.lock().ok()?.remove(&id)) {
                        room.close();
                    }
                    return Err(e);
                }
            };
            if fault == Some(Fault::RejectWithDecoy) {
                return Err(EngineError::BadRequest(
                    "prefill rejected the request (injected fault; its KV went on)".into(),
                ));
            }
            Ok(PrefillDone {
                prompt_tokens: n,
                kv_tokens: kv.tokens,
                kv_digest: Some(kv.digest),
                cached_tokens: Some(kv.cached),
                prompt_logprobs: kv.prompt_logprobs,
            })
        }
    }

    /// Runs pair `id`'s decode half: waits for the prefill's KV (split mode), then generates.
    /// Events arrive on the returned receiver; dropping it aborts.
    pub fn decode(
        &self,
        id: u64,
        prompt: Arc<[u32]>,
        sampling: SamplingConfig,
        cache_salt: Option<u64>,
    ) -> impl Future<Output = tmpsc::UnboundedReceiver<Event>> + Send + 'static {
        let (engine, rooms) = match &self.mode {
            Mode::Unified(e) => (e.handle(), None),
            Mode::Split { decode, rooms, .. } => (decode.handle(), Some(rooms.clone())),
        };
        async move {
            let kv = match rooms {
                None => None,
                Some(rooms) => {
                    let Some(room) = rooms.lock().ok().and_then(|r| r.get(&id).cloned()) else {
                        return failed(EngineError::Stopped);
                    };
                    let t = room.take().await;
                    if let Ok(mut r) = rooms.lock() {
                        r.remove(&id);
                    }
                    match t {
                        Some(t) => Some(t),
                        None => return failed(EngineError::Stopped),
                    }
                }
            };
            engine.generate(Generate {
                id,
                prompt,
                sampling,
                kv,
                cache_salt,
            })
        }
    }

    /// Aborts one half of pair `id`: the engine drops it (queued or running, pages freed) and the
    /// room is closed, so KV that arrives later is dropped.
    pub fn abort(&self, id: u64, half: Half) {
        match &self.mode {
            Mode::Unified(e) => e.abort(id),
            Mode::Split {
                prefill,
                decode,
                rooms,
            } => {
                if let Some(room) = rooms.lock().ok().and_then(|mut r| r.remove(&id)) {
                    room.close();
                }
                match half {
                    Half::Prefill => prefill.abort(id),
                    Half::Decode => decode.abort(id),
                }
            }
        }
    }
}

fn failed(e: EngineError) -> tmpsc::UnboundedReceiver<Event> {
    let (tx, rx) = tmpsc::unbounded_channel();
    let _ = tx.send(Event::Failed(e));
    rx
}

impl Fault {
    /// Applies the fault to a set in flight; `SwapPages` keeps the previous pair's first page in
    /// `swap`.
    pub fn apply(self, t: &mut KvTransfer, swap: &Mutex<Option<PageData>>) {
        match self {
            Fault::CorruptPage => {
                if let Some(p) = t.pages.first_mut()
                    && p.bytes.len() > 7
                {
                    let mut b = p.bytes.to_vec();
                    b[7] ^= 0x5a;
                    p.bytes = b.into();
                }
            }
            Fault::DropPage => {
                t.pages.pop();
            }
            Fault::SwapPages => {
                if let Ok(mut slot) = swap.lock() {
                    let mine = (!t.pages.is_empty()).then(|| t.pages.remove(0));
                    if let Some(theirs) = slot.take() {
                        t.pages.insert(0, theirs);
                    }
                    *slot = mine;
                }
            }
            Fault::RejectWithDecoy => {}
        }
    }
}

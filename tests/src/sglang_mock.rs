//! A PD-faithful mock of an SGLang prefill/decode pair.
//!
//! What it models, because lockstep's guarantees depend on it:
//! - **The rendezvous.** Prefill computes "KV" for a `bootstrap_room` into pages of a shared pool
//!   and publishes the room; decode waits for its room (up to `kv_wait_timeout`), reads the pages
//!   and generates from them. Work runs in tasks independent of the HTTP connection, as in
//!   SGLang's scheduler: dropping the connection does not release a half at once;
//!   `/abort_request` does. A client that went away is noticed as SGLang 0.5.23 notices it
//!   (`srt/managers/tokenizer_manager.py`): a stream's rid is aborted 2 s after its response
//!   ended, a non-stream request's at the next 4 s check (`SGLANG_REQUEST_STATE_WAIT_TIMEOUT`).
//! - **Unscrubbed reuse.** Freed pages keep their contents and are reused last-in first-out, so a
//!   decode that reads pages it was not given (the incident's decoy) answers with an earlier
//!   request's tokens.
//! - **Decode output comes from the KV:** it echoes the prompt tokens it read, so the content of a
//!   response tells whose KV produced it.
//! - `/abort_request {"rid"}` stops every half on that server whose rid starts with that rid
//!   (when that rid runs there: the tokenizer manager sends on only a rid it holds) and frees
//!   what they hold; every call is recorded with what it released.
//! - Fields lockstep sends that the mock only records (every `/generate` body is kept, see
//!   [`PdMock::requests`]): `cache_salt` (SGLang 0.5.23 `GenerateReqInput.cache_salt`,
//!   `srt/managers/io_struct.py`, a string namespacing the radix cache; the mock has no prefix
//!   cache, so tests check the salt on the wire).
//! - SGLang's answer shapes: `meta_info` with `prompt_tokens` (the length of the `input_ids`
//!   sent, on both halves, as SGLang 0.5.23 reports it: `srt/managers/output_streamer.py`, not a
//!   count read from the KV), `completion_tokens`, `finish_reason`
//!   (`{"type":"length"|"stop"|"abort"}`; `sampling_params.stop` strings are matched in the
//!   decoded text and end it `{"type":"stop","matched":<string>}`, the text cut where the string
//!   starts unless `no_stop_trim`, `srt/managers/schedule_batch.py` `check_finished`,
//!   `detokenizer_manager.py` `trim_matched_stop`); SSE streams cumulative by default and disjoint deltas
//!   with `incremental_streaming_output` (`srt/managers/tokenizer_manager.py`,
//!   `_handle_batch_output`); `/health` takes 1 s, as SGLang 0.5.23's does
//!   (`entrypoints/http_server.py`, `health_generate`, sleeps 1 s before its first check).
//! - **Log-probabilities** (`return_logprob`, `top_logprobs_num`, top-level fields of the
//!   request, SGLang 0.5.23 `srt/managers/io_struct.py` `GenerateReqInput`): every decode event's
//!   `meta_info` carries `output_token_logprobs` (`[logprob, token_id, null]` per output token:
//!   cumulative in the default stream mode, `tokenizer_manager.py` `add_logprob_to_meta_info`
//!   extends the request's list and sends all of it; with `incremental_streaming_output` only
//!   this event's entries, as `_slice_streaming_output_meta_info` cuts `output_token_logprobs`
//!   and `output_top_logprobs` from the last event's offset), `output_token_logprobs_length`
//!   (never sliced), an empty `input_token_logprobs` (the
//!   default `logprob_start_len` -1 becomes the prompt's length, `scheduler.py`), and, with
//!   `top_logprobs_num` > 0, `output_top_logprobs` (a list of `[logprob, id, null]` per token) and
//!   an empty `input_top_logprobs`. In P/D the first token's entry is the prefill's, carried in
//!   the KV metadata buffer (`srt/disaggregation/utils.py`, at most 128 alternatives;
//!   `decode.py` appends it): a prefill not asked for log-probabilities has none to send, and
//!   the decode reports a zero there. The values are the mock's own function of the token id
//!   ([`mock_logprob`]); the text entries are `null` (`return_text_in_logprobs` false). With
//!   `logprob_start_len` s (a prompt position) the prefill's answer carries the prompt's
//!   `input_token_logprobs` from s (`[logprob, id, null]`, the first `null`:
//!   `scheduler_components/logprob_result_processor.py` puts None first and drops the last
//!   position's, which predicts the output) and `input_top_logprobs` (`null` first); the prefill
//!   runs the prompt, the decode only receives its KV.
//! - `/server_info` (and its deprecated alias `/get_server_info`): the resolved server arguments
//!   flat, plus the scheduler's `max_total_num_tokens` and `max_req_input_len`
//!   (`srt/utils/common.py` `build_server_info`; `srt/managers/scheduler.py`), each overridable per
//!   server ([`PdMock::set_server_arg`]) to run the versions and settings users meet.
//! - **The KV checksum** (`--disaggregation-enable-kv-checksum`, `srt/disaggregation/checksum.py`,
//!   `decode.py` `_verify_kv_checksums`): the prefill digests the pages it sends (Adler-32); the
//!   decode recomputes over what it received before its first token and, on a mismatch, aborts
//!   with "KV checksum mismatch" (status 500: HTTP 500 non-stream, an in-band abort inside a 200
//!   stream). It is on only when both servers have it on and their layouts (`page_size`,
//!   `tp_size`) agree (`base/conn.py` `should_verify_kv_checksum`); otherwise it is silently off and
//!   a corrupted transfer ([`Fault::KvCorrupt`]) generates from the corrupted KV.
//! - **Timing**: the prefill answers only once its KV reached the decode (`prefill.py`,
//!   `process_disagg_prefill_inflight_queue`: a request is done on `KVPoll.Success`), finishing
//!   with `{"type":"length","length":0}`; a prefill whose decode never takes the KV fails after
//!   `kv_wait_timeout` with 500.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http::StatusCode;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tokenizers::Tokenizer;
use tokio::net::TcpListener;
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// Which server of the pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// The prefill server.
    Prefill,
    /// The decode server.
    Decode,
}

/// Injected faults, applied to every request until changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Behave like a healthy SGLang pair.
    None,
    /// Prefill answers this error status.
    PrefillStatus(u16),
    /// The incident: prefill answers 200 with `finish_reason: abort` after writing a one-token
    /// decoy, and publishes the room as complete, so decode reads stale pages.
    PrefillInBandAbortDecoy,
    /// Prefill never answers (until aborted).
    PrefillHang,
    /// Prefill resets the connection without answering.
    PrefillReset,
    /// Prefill reports one prompt token more than it was sent.
    PrefillCountMismatch,
    /// Decode answers this error status at once.
    DecodeStatus(u16),
    /// Decode receives the KV and then never emits a token (until aborted).
    DecodeHang,
    /// Decode's stream breaks after this many events.
    DecodeCut(usize),
    /// Decode's stream breaks after this many events, once: the fault then clears (a decode
    /// server that died and came back, or the next request finding a healthy one).
    DecodeCutOnce(usize),
    /// Decode reports one prompt token more than it was sent (what `--allow-auto-truncate` and
    /// old SGLang stubs look like).
    DecodeCountMismatch,
    /// From this event on, decode reports one prompt token more than it was sent: a stream
    /// that turns into another request's after commit (an integrity violation mid-stream).
    DecodeCountChangesAt(usize),
    /// Decode's `output_token_logprobs` name another token than the one in `output_ids` (a
    /// worker whose log-probabilities are not the answer's).
    DecodeLogprobOtherToken,
    /// The prefill's `input_token_logprobs` name other tokens than the prompt's.
    PrefillLogprobOtherToken,
    /// Decode events carry no `meta_info.prompt_tokens` (SGLang 0.5.23 always sends it,
    /// `srt/managers/output_streamer.py`; a server that does not is not one lockstep can verify).
    DecodeNoCount,
    /// The KV transfer corrupts one value of the first page after the prefill digested it.
    /// Caught by SGLang's KV checksum when it is on at both ends; otherwise the decode generates
    /// from the corrupted KV.
    KvCorrupt,
    /// Both halves are slow but within any sane deadline.
    Slow {
        /// Prefill delay in ms.
        prefill_ms: u64,
        /// Per-token decode delay in ms.
        token_ms: u64,
    },
}

/// Mock settings.
#[derive(Debug, Clone)]
pub struct MockConfig {
    /// Pages in the shared pool.
    pub total_pages: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// How long decode waits for its room's KV, and a prefill for its decode to take it: SGLang
    /// 0.5.23's `SGLANG_DISAGGREGATION_WAITING_TIMEOUT` and `_BOOTSTRAP_TIMEOUT`, both 300 s
    /// (`srt/environ.py`). Neither half is told when the other fails: only an abort (or the
    /// timeout) ends the wait.
    pub kv_wait_timeout: Duration,
    /// Delay between decode tokens.
    pub token_delay: Duration,
    /// How long `/health` takes: SGLang 0.5.23's handler (`entrypoints/http_server.py`,
    /// `health_generate`) runs a one-token generation and sleeps 1 s before its first check.
    pub health_delay: Duration,
    /// The model's context length (`max_req_input_len` derives from it).
    pub context_len: usize,
    /// `/server_info` overrides from the start (see [`PdMock::set_server_arg`]).
    pub server_args: Vec<(Role, &'static str, Value)>,
    /// `--api-key`: every call but `/health*` needs `Authorization: Bearer` it (SGLang 0.5.23
    /// `srt/utils/auth.py`: `NORMAL` endpoints; 401 `{"error":"Unauthorized"}` otherwise).
    pub api_key: Option<String>,
    /// `--admin-api-key`: `/abort_request` (`ADMIN_OPTIONAL`) then takes only it.
    pub admin_api_key: Option<String>,
    /// How long an `/abort_request` takes to reach the scheduler and act (a slow network or a
    /// busy server); 0 by default.
    pub abort_delay: Duration,
    /// How long the decode server takes to register a `/generate` it received (the tokenizer
    /// manager still tokenizing, or the request queued behind others); 0 by default. An abort
    /// for its rid arriving meanwhile finds nothing and is dropped, as SGLang 0.5.23 drops an
    /// abort for an rid not yet in `rid_to_state` (`srt/managers/tokenizer_manager.py`,
    /// `abort_request`), and the half then lives on.
    pub decode_register_delay: Duration,
    /// How decode output follows from the sequence: `None` echoes the prompt read from the KV
    /// (output token `i` is prompt token `i mod len`); `Some(lag)` makes each output token the
    /// token `lag` places back in the sequence so far (prompt and output; the first one when the
    /// sequence is shorter). That is a function of the sequence alone, as a real model's greedy
    /// output is, so a stream continued on a new pair from the prompt and the tokens delivered
    /// goes on exactly as it would have: what migration tests need.
    pub continuation_lag: Option<usize>,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            total_pages: 64,
            page_size: 16,
            kv_wait_timeout: Duration::from_secs(300),
            token_delay: Duration::from_millis(1),
            health_delay: Duration::from_secs(1),
            context_len: 8192,
            server_args: Vec::new(),
            api_key: None,
            admin_api_key: None,
            abort_delay: Duration::ZERO,
            decode_register_delay: Duration::ZERO,
            continuation_lag: None,
        }
    }
}

/// One `/abort_request` call the mock received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbortRecord {
    /// Server that received it.
    pub role: Role,
    /// The rid it named.
    pub rid: String,
    /// Whether it released something: a live half, or KV still waiting for its transfer.
    pub released_live: bool,
    /// How many running halves it stopped (every one whose rid starts with `rid`).
    pub stopped: usize,
}

enum Room {
    Published {
        pages: Vec<usize>,
        tokens: usize,
        /// The prefill's digest of what it sent (0: checksum off on the prefill).
        checksum: u32,
    },
    Abandoned,
}

struct Pool {
    pages: Vec<Vec<u32>>,
    free: Vec<usize>,
}

impl Pool {
    fn alloc(&mut self, n: usize) -> Option<Vec<usize>> {
        if self.free.len() < n {
            return None;
        }
        Some((0..n).filter_map(|_| self.free.pop()).collect())
    }
    fn release(&mut self, pages: Vec<usize>) {
        // Not scrubbed: contents stay for the next owner, as in a real KV pool.
        self.free.extend(pages.into_iter().rev());
    }
}

struct Inner {
    cfg: MockConfig,
    tokenizer: Tokenizer,
    fault: Mutex<Fault>,
    /// Faults for requests with one `sampling_seed` (one choice of several), before `fault`.
    seed_faults: Mutex<HashMap<u64, Fault>>,
    healthy: Mutex<(bool, bool)>,
    pool: Mutex<Pool>,
    rooms: Mutex<HashMap<u64, Room>>,
    room_ready: Notify,
    live: Mutex<HashMap<(Role, String), CancellationToken>>,
    rid_rooms: Mutex<Bounded<(String, u64)>>,
    /// Rooms whose prefill was asked for log-probabilities (its first token's entry is in the
    /// KV metadata).
    logprob_rooms: Mutex<std::collections::HashSet<u64>>,
    aborts: Mutex<Bounded<AbortRecord>>,
    requests: Mutex<Bounded<(Role, Value)>>,
    traceparents: Mutex<Bounded<(Role, String)>>,
    /// `/server_info` (and `/get_server_info`) calls answered, both servers together.
    info_calls: AtomicUsize,
    /// Per-server overrides of `/server_info` keys.
    server_args: Mutex<HashMap<(Role, String), Value>>,
    /// Prefills waiting for their decode to take the room's KV.
    taken: Mutex<HashMap<u64, oneshot::Sender<()>>>,
    /// Cancelled when the mock is dropped: open connections close too, as a stopped server's.
    shutdown: CancellationToken,
    /// Calls refused for want of the right key: server and path.
    unauthorized: Mutex<Vec<(Role, String)>>,
    /// The prefill's radix cache: prompts it computed, by `cache_salt` (SGLang 0.5.23
    /// `mem_cache/radix_cache.py:62-77`: the salt is part of the key, so prefixes match only
    /// within one namespace; matches are whole pages).
    radix: Mutex<Bounded<(Option<String>, Vec<u32>)>>,
}

impl Inner {
    /// SGLang 0.5.23's auth decision (`srt/utils/auth.py`, `decide_request_auth`): health,
    /// readiness and metrics are always allowed; `/abort_request` is `ADMIN_OPTIONAL` (the admin
    /// key where one is set, else the API key); everything else `NORMAL` (the API key where one
    /// is set).
    fn refuses<B>(&self, req: &http::Request<B>) -> Option<StatusCode> {
        let path = req.uri().path();
        if ["/health", "/ready", "/metrics"]
            .iter()
            .any(|p| path.starts_with(p))
        {
            return None;
        }
        let want = if path == "/abort_request" {
            self.cfg
                .admin_api_key
                .as_ref()
                .or(self.cfg.api_key.as_ref())
        } else {
            self.cfg.api_key.as_ref()
        }?;
        let got = req
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        (got != Some(want.as_str())).then_some(StatusCode::UNAUTHORIZED)
    }
}

/// How many of each record the mock keeps: every test's whole history, while a soak of many
/// thousands of requests stays bounded in memory.
pub const KEPT: usize = 10_000;

/// The most recent [`KEPT`] records, and how many there were.
#[derive(Debug)]
struct Bounded<T> {
    items: std::collections::VecDeque<T>,
    total: usize,
}

impl<T> Default for Bounded<T> {
    fn default() -> Self {
        Bounded {
            items: std::collections::VecDeque::new(),
            total: 0,
        }
    }
}

impl<T: Clone> Bounded<T> {
    fn push(&mut self, x: T) {
        if self.items.len() == KEPT {
            self.items.pop_front();
        }
        self.items.push_back(x);
        self.total += 1;
    }
    fn items(&self) -> Vec<T> {
        self.items.iter().cloned().collect()
    }
}

impl Bounded<(String, u64)> {
    /// The room of a recent rid.
    fn room(&self, rid: &str) -> Option<u64> {
        self.items
            .iter()
            .rev()
            .find(|(r, _)| r == rid)
            .map(|(_, room)| *room)
    }
}

/// Locks, ignoring poisoning (a panicked test thread must not hide the mock's state).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A running mock pair: a prefill server and a decode server on loopback.
pub struct PdMock {
    inner: Arc<Inner>,
    /// Address of the prefill server.
    pub prefill_addr: SocketAddr,
    /// Address of the decode server.
    pub decode_addr: SocketAddr,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for PdMock {
    fn drop(&mut self) {
        self.inner.shutdown.cancel();
        for t in &self.tasks {
            t.abort();
        }
        for token in lock(&self.inner.live).values() {
            token.cancel();
        }
    }
}

#[derive(Clone)]
struct Ctx {
    inner: Arc<Inner>,
    role: Role,
    /// This prefill server's own prefix cache, publishing KV events ([`PdMock::add_prefill`]).
    cache: Option<Arc<crate::kv_publisher::EngineCache>>,
}

impl PdMock {
    /// Starts both servers on ephemeral loopback ports.
    pub async fn start(cfg: MockConfig, tokenizer: Tokenizer) -> std::io::Result<PdMock> {
        Self::start_on(
            cfg,
            tokenizer,
            "127.0.0.1:0".parse().expect("addr"),
            "127.0.0.1:0".parse().expect("addr"),
        )
        .await
    }

    /// Starts both servers on the given addresses.
    pub async fn start_on(
        cfg: MockConfig,
        tokenizer: Tokenizer,
        prefill: SocketAddr,
        decode: SocketAddr,
    ) -> std::io::Result<PdMock> {
        let pool = Pool {
            pages: vec![vec![0; cfg.page_size]; cfg.total_pages],
            free: (0..cfg.total_pages).rev().collect(),
        };
        let inner = Arc::new(Inner {
            tokenizer,
            fault: Mutex::new(Fault::None),
            seed_faults: Mutex::default(),
            healthy: Mutex::new((true, true)),
            pool: Mutex::new(pool),
            rooms: Mutex::new(HashMap::new()),
            room_ready: Notify::new(),
            live: Mutex::new(HashMap::new()),
            rid_rooms: Mutex::default(),
            logprob_rooms: Mutex::default(),
            aborts: Mutex::default(),
            requests: Mutex::default(),
            traceparents: Mutex::default(),
            info_calls: AtomicUsize::new(0),
            server_args: Mutex::new(
                cfg.server_args
                    .iter()
                    .map(|(r, k, v)| ((*r, k.to_string()), v.clone()))
                    .collect(),
            ),
            taken: Mutex::new(HashMap::new()),
            shutdown: CancellationToken::new(),
            unauthorized: Mutex::new(Vec::new()),
            radix: Mutex::default(),
            cfg,
        });
        let (pl, dl) = (
            TcpListener::bind(prefill).await?,
            TcpListener::bind(decode).await?,
        );
        let (prefill_addr, decode_addr) = (pl.local_addr()?, dl.local_addr()?);
        let tasks = vec![
            tokio::spawn(serve(
                pl,
                Ctx {
                    inner: inner.clone(),
                    role: Role::Prefill,
                    cache: None,
                },
            )),
            tokio::spawn(serve(
                dl,
                Ctx {
                    inner: inner.clone(),
                    role: Role::Decode,
                    cache: None,
                },
            )),
        ];
        Ok(PdMock {
            inner,
            prefill_addr,
            decode_addr,
            tasks,
        })
    }

    /// Starts one more prefill server beside this pair's (SGLang runs one per prefill
    /// instance; the decode takes KV from any of them), with its own prefix cache publishing KV
    /// events as SGLang's `--kv-events-config` publisher does. Returns its base URL.
    pub async fn add_prefill(
        &mut self,
        cache: Arc<crate::kv_publisher::EngineCache>,
    ) -> std::io::Result<String> {
        let l = TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        self.tasks.push(tokio::spawn(serve(
            l,
            Ctx {
                inner: self.inner.clone(),
                role: Role::Prefill,
                cache: Some(cache),
            },
        )));
        Ok(format!("http://{addr}"))
    }

    /// Base URL of the prefill server.
    pub fn prefill_url(&self) -> String {
        format!("http://{}", self.prefill_addr)
    }
    /// Base URL of the decode server.
    pub fn decode_url(&self) -> String {
        format!("http://{}", self.decode_addr)
    }
    /// Sets the fault applied to following requests.
    pub fn set_fault(&self, f: Fault) {
        *lock(&self.inner.fault) = f;
    }
    /// Sets the fault applied to following requests whose `sampling_params.sampling_seed` is
    /// `seed` (one choice of a request for several: lockstep gives each its own seed), instead
    /// of the one [`PdMock::set_fault`] set.
    pub fn set_fault_for_seed(&self, seed: u64, f: Fault) {
        lock(&self.inner.seed_faults).insert(seed, f);
    }
    /// Overrides one key of one server's `/server_info` (the server behaves accordingly where
    /// the mock models the setting: `incremental_streaming_output`, `skip_tokenizer_init`,
    /// `disaggregation_enable_kv_checksum`, `page_size`, `tp_size`).
    pub fn set_server_arg(&self, role: Role, key: &str, value: Value) {
        lock(&self.inner.server_args).insert((role, key.to_string()), value);
    }
    /// Makes one server's `/health` fail or pass.
    pub fn set_healthy(&self, role: Role, ok: bool) {
        let mut h = lock(&self.inner.healthy);
        match role {
            Role::Prefill => h.0 = ok,
            Role::Decode => h.1 = ok,
        }
    }
    /// How many `/server_info` calls both servers have answered (the deployment check's probes).
    pub fn info_calls(&self) -> usize {
        self.inner.info_calls.load(Ordering::SeqCst)
    }
    /// Halves still running (waiting, computing or streaming).
    pub fn live_halves(&self) -> Vec<(Role, String)> {
        lock(&self.inner.live).keys().cloned().collect()
    }
    /// Calls refused for want of the right key (server, path).
    pub fn unauthorized(&self) -> Vec<(Role, String)> {
        lock(&self.inner.unauthorized).clone()
    }
    /// Every abort call received so far (the most recent [`KEPT`]).
    pub fn aborts(&self) -> Vec<AbortRecord> {
        lock(&self.inner.aborts).items()
    }
    /// Every `/generate` body received so far, by server (the most recent [`KEPT`]).
    pub fn requests(&self) -> Vec<(Role, Value)> {
        lock(&self.inner.requests).items()
    }
    /// The `input_ids` of every `/generate` body `role` received so far, in order (the most
    /// recent [`KEPT`] bodies).
    pub fn prompts(&self, role: Role) -> Vec<Vec<u64>> {
        self.requests()
            .into_iter()
            .filter(|(r, _)| *r == role)
            .map(|(_, v)| {
                v["input_ids"]
                    .as_array()
                    .map(|a| a.iter().filter_map(Value::as_u64).collect())
                    .unwrap_or_default()
            })
            .collect()
    }
    /// The W3C `traceparent` header of each `/generate` request that carried one (the most
    /// recent [`KEPT`]).
    pub fn traceparents(&self) -> Vec<(Role, String)> {
        lock(&self.inner.traceparents).items()
    }
    /// Number of `/generate` requests received.
    pub fn request_count(&self) -> usize {
        lock(&self.inner.requests).total
    }
    /// Free pages in the pool.
    pub fn free_pages(&self) -> usize {
        lock(&self.inner.pool).free.len()
    }
    /// Pages in the pool.
    pub fn total_pages(&self) -> usize {
        self.inner.cfg.total_pages
    }
    /// Rooms whose KV was published but not consumed or freed.
    pub fn open_rooms(&self) -> usize {
        lock(&self.inner.rooms)
            .values()
            .filter(|r| matches!(r, Room::Published { .. }))
            .count()
    }
    /// True when nothing is held: no live half, no open room, every page free.
    pub fn is_idle(&self) -> bool {
        self.live_halves().is_empty()
            && self.open_rooms() == 0
            && self.free_pages() == self.total_pages()
    }
    /// Waits (bounded) until the mock is idle; returns whether it got there.
    pub async fn wait_idle(&self, bound: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + bound;
        while tokio::time::Instant::now() < deadline {
            if self.is_idle() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.is_idle()
    }
}

async fn serve(listener: TcpListener, ctx: Ctx) {
    let router = Router::new()
        .route("/generate", post(generate))
        .route("/abort_request", post(abort))
        .route("/health", get(health))
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .with_state(ctx.clone());
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let router = router.clone();
        let ctx = ctx.clone();
        let shutdown = ctx.inner.shutdown.clone();
        tokio::spawn(async move {
            let svc =
                hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let router = router.clone();
                    let ctx = ctx.clone();
                    async move {
                        let reset = ctx.role == Role::Prefill
                            && req.uri().path() == "/generate"
                            && *lock(&ctx.inner.fault) == Fault::PrefillReset;
                        if let Some(status) = ctx.inner.refuses(&req) {
                            lock(&ctx.inner.unauthorized)
                                .push((ctx.role, req.uri().path().to_string()));
                            let body = if status == StatusCode::UNAUTHORIZED {
                                "Unauthorized"
                            } else {
                                "Forbidden"
                            };
                            return Ok(
                                (status, axum::Json(json!({ "error": body }))).into_response()
                            );
                        }
                        if reset {
                            lock(&ctx.inner.requests).push((Role::Prefill, json!({"reset": true})));
                            // An error from the service makes hyper drop the connection unanswered.
                            return Err::<Response, std::io::Error>(std::io::Error::other(
                                "injected connection reset",
                            ));
                        }
                        Ok(router
                            .oneshot(req.map(Body::new))
                            .await
                            .unwrap_or_else(|e| match e {}))
                    }
                });
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            let conn = builder.serve_connection(TokioIo::new(stream), svc);
            tokio::select! {
                _ = conn => {}
                _ = shutdown.cancelled() => {}
            }
        });
    }
}

async fn health(State(ctx): State<Ctx>) -> Response {
    tokio::time::sleep(ctx.inner.cfg.health_delay).await;
    let h = *lock(&ctx.inner.healthy);
    let ok = match ctx.role {
        Role::Prefill => h.0,
        Role::Decode => h.1,
    };
    if ok {
        StatusCode::OK.into_response()
    } else {
        StatusCode::SERVICE_UNAVAILABLE.into_response()
    }
}

async fn server_info(State(ctx): State<Ctx>) -> Response {
    ctx.inner.info_calls.fetch_add(1, Ordering::SeqCst);
    axum::Json(server_args(&ctx.inner, ctx.role)).into_response()
}

/// One server's `/server_info`: the resolved arguments flat plus the scheduler's figures
/// (`srt/utils/common.py` `build_server_info`), with the test's overrides applied.
fn server_args(inner: &Inner, role: Role) -> Value {
    let cfg = &inner.cfg;
    let cap = cfg.total_pages * cfg.page_size;
    // `srt/managers/tp_worker.py`: min(context_len - 1, max_total_num_tokens - 1) - 5.
    let max_req_input_len = (cfg.context_len - 1).min(cap - 1) - 5;
    let mut v = json!({
        "version": "0.5.23",
        "disaggregation_mode": match role { Role::Prefill => "prefill", Role::Decode => "decode" },
        "disaggregation_transfer_backend": "mooncake",
        "disaggregation_bootstrap_port": 8998,
        "disaggregation_enable_kv_checksum": true,
        "incremental_streaming_output": false,
        "enable_deterministic_inference": false,
        "skip_tokenizer_init": false,
        "allow_auto_truncate": false,
        "page_size": cfg.page_size,
        "kv_cache_dtype": "auto",
        "tp_size": 1,
        "pp_size": 1,
        "context_length": null,
        "max_total_num_tokens": cap,
        "max_req_input_len": max_req_input_len,
    });
    for ((r, k), val) in lock(&inner.server_args).iter() {
        if *r == role {
            v[k.as_str()] = val.clone();
        }
    }
    v
}

fn arg_bool(inner: &Inner, role: Role, key: &str) -> bool {
    server_args(inner, role)[key].as_bool().unwrap_or(false)
}

/// Whether the decode verifies the prefill's KV checksum: on at both ends, layouts equal
/// (`srt/disaggregation/base/conn.py` `should_verify_kv_checksum`; off silently otherwise).
fn checksum_on(inner: &Inner) -> bool {
    let (p, d) = (
        server_args(inner, Role::Prefill),
        server_args(inner, Role::Decode),
    );
    let on = |v: &Value| v["disaggregation_enable_kv_checksum"].as_bool() == Some(true);
    on(&p) && on(&d) && p["page_size"] == d["page_size"] && p["tp_size"] == d["tp_size"]
}

/// Adler-32, what SGLang digests KV pages with (`srt/disaggregation/checksum.py`); never 0
/// for a non-empty input, which SGLang reads as "no checksum".
fn adler32(tokens: &[u32]) -> u32 {
    let (mut a, mut b) = (1u32, 0u32);
    for byte in tokens.iter().flat_map(|t| t.to_le_bytes()) {
        a = (a + byte as u32) % 65_521;
        b = (b + a) % 65_521;
    }
    (b << 16) | a
}

/// `/abort_request {"rid", "abort_all"}` (SGLang 0.5.23 `srt/entrypoints/http_server.py`; the
/// scheduler matches by rid prefix across its queues, `srt/managers/scheduler.py`
/// `abort_request`): stops every half on this server whose rid starts with the one named (if it
/// names a running one) and frees what they hold.
async fn abort(State(ctx): State<Ctx>, body: Bytes) -> Response {
    tokio::time::sleep(ctx.inner.cfg.abort_delay).await;
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    // `AbortReq`: `rid` defaults to "" and `abort_all` to false (`srt/managers/io_struct.py`).
    let rid = v
        .get("rid")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let abort_all = v.get("abort_all").and_then(Value::as_bool).unwrap_or(false);
    // `TokenizerManager.abort_request`: an empty rid without `abort_all` is ignored; a rid it
    // does not hold is not sent on (one tokenizer worker); one it holds goes to the scheduler,
    // which aborts every request whose rid *starts with* it (`scheduler.py` `abort_request`).
    let tokens: Vec<CancellationToken> = {
        let live = lock(&ctx.inner.live);
        let known = abort_all || (!rid.is_empty() && live.contains_key(&(ctx.role, rid.clone())));
        live.iter()
            .filter(|((role, r), _)| {
                known && *role == ctx.role && (abort_all || r.starts_with(&rid))
            })
            .map(|(_, t)| t.clone())
            .collect()
    };
    let mut released = !tokens.is_empty();
    if !tokens.is_empty() {
        tokens.iter().for_each(CancellationToken::cancel);
    } else if !rid.is_empty()
        && let Some(room) = lock(&ctx.inner.rid_rooms).room(&rid)
    {
        // The half already ended, but KV it produced may still wait for a transfer that will
        // never happen: the abort frees it (or makes a later publish free it).
        let mut rooms = lock(&ctx.inner.rooms);
        match rooms.remove(&room) {
            Some(Room::Published { pages, .. }) => {
                lock(&ctx.inner.pool).release(pages);
                released = true;
            }
            _ => {
                rooms.insert(room, Room::Abandoned);
            }
        }
    }
    lock(&ctx.inner.aborts).push(AbortRecord {
        role: ctx.role,
        rid,
        released_live: released,
        stopped: tokens.len(),
    });
    // SGLang 0.5.23 answers every abort 200 with an empty body, known rid or not
    // (`srt/entrypoints/http_server.py`, `abort_request`).
    StatusCode::OK.into_response()
}

/// A `stop` field's strings, as both servers take it: one string or a list of them.
pub(crate) fn stop_strings(v: Option<&Value>) -> Vec<String> {
    match v {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect(),
        _ => Vec::new(),
    }
}

fn sglang_error(status: StatusCode, message: &str) -> Response {
    (status, axum::Json(json!({ "object": "error", "message": message, "type": "BadRequestError", "code": status.as_u16() }))).into_response()
}

struct Half {
    rid: String,
    room: u64,
    ids: Vec<u32>,
    max_new: usize,
    stream: bool,
    /// `cache_salt`, where sent.
    salt: Option<String>,
    /// `sampling_params.stop`: a string or a list.
    stop: Vec<String>,
    /// `sampling_params.no_stop_trim`: keep the matched stop string in the text.
    no_stop_trim: bool,
    /// `return_logprob` with `top_logprobs_num` (0 when absent).
    logprobs: Option<usize>,
    /// `logprob_start_len`, where it is a prompt position (-1 or absent: none).
    logprob_start: Option<usize>,
    /// `sampling_params.sampling_seed`, where sent.
    seed: Option<u64>,
}

fn parse_half(v: &Value) -> Result<Half, &'static str> {
    let rid = v
        .get("rid")
        .and_then(Value::as_str)
        .ok_or("rid is required in PD mode")?
        .to_string();
    let room = v
        .get("bootstrap_room")
        .and_then(Value::as_u64)
        .ok_or("bootstrap_room is required in PD mode")?;
    if v.get("bootstrap_host").and_then(Value::as_str).is_none() {
        return Err("bootstrap_host is required in PD mode");
    }
    let ids: Vec<u32> = v
        .get("input_ids")
        .and_then(Value::as_array)
        .ok_or("input_ids is required")?
        .iter()
        .map(|x| x.as_u64().map(|n| n as u32))
        .collect::<Option<_>>()
        .ok_or("input_ids must be integers")?;
    if ids.is_empty() {
        return Err("input_ids must not be empty");
    }
    let max_new = v
        .pointer("/sampling_params/max_new_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(16) as usize;
    Ok(Half {
        rid,
        room,
        ids,
        max_new,
        stream: v.get("stream").and_then(Value::as_bool).unwrap_or(false),
        salt: v
            .get("cache_salt")
            .and_then(Value::as_str)
            .map(str::to_string),
        stop: stop_strings(v.pointer("/sampling_params/stop")),
        no_stop_trim: v
            .pointer("/sampling_params/no_stop_trim")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        logprob_start: v
            .get("logprob_start_len")
            .and_then(Value::as_i64)
            .and_then(|s| usize::try_from(s).ok()),
        logprobs: (v.get("return_logprob").and_then(Value::as_bool) == Some(true)).then(|| {
            v.get("top_logprobs_num")
                .and_then(Value::as_u64)
                .unwrap_or(0) as usize
        }),
        seed: v
            .pointer("/sampling_params/sampling_seed")
            .and_then(Value::as_u64),
    })
}

/// The mock's log-probability of token `id` (a function of the id only, so a test can check
/// every value it is given).
pub fn mock_logprob(id: u32) -> f32 {
    -0.25 - (id % 40) as f32 / 8.0
}

/// The `top_logprobs_num` most likely tokens after `id`, as the mock reports them: `id` first,
/// then the ids after it, each less likely.
pub fn mock_top(id: u32, k: usize) -> Vec<(u32, f32)> {
    (0..k as u32)
        .map(|j| (id.wrapping_add(j), mock_logprob(id) - j as f32))
        .collect()
}

/// The log-probability fields of a decode event's `meta_info` for output `out` (cumulative), as
/// SGLang 0.5.23 writes them (`tokenizer_manager.py` `add_logprob_to_meta_info`). `first_zero`:
/// the prefill was not asked, so the first token's value in the metadata buffer is a zero.
fn logprob_meta(out: &[u32], k: usize, first_zero: bool, other_token: bool) -> Value {
    let entry = |i: usize, id: u32| {
        let lp = if i == 0 && first_zero {
            0.0
        } else {
            mock_logprob(id)
        };
        json!([lp, if other_token { id.wrapping_add(1) } else { id }, null])
    };
    let mut m = json!({
        "input_token_logprobs": [],
        "output_token_logprobs": out.iter().enumerate().map(|(i, &id)| entry(i, id)).collect::<Vec<_>>(),
        "output_token_logprobs_length": out.len(),
    });
    if k > 0 {
        m["input_top_logprobs"] = json!([]);
        m["output_top_logprobs"] = out
            .iter()
            .map(|&id| {
                mock_top(id, k)
                    .into_iter()
                    .map(|(t, lp)| json!([lp, t, null]))
                    .collect::<Vec<_>>()
            })
            .collect();
    }
    m
}

async fn generate(State(ctx): State<Ctx>, headers: axum::http::HeaderMap, body: Bytes) -> Response {
    if let Some(tp) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
        lock(&ctx.inner.traceparents).push((ctx.role, tp.to_string()));
    }
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(_) => return sglang_error(StatusCode::BAD_REQUEST, "body is not JSON"),
    };
    lock(&ctx.inner.requests).push((ctx.role, v.clone()));
    let half = match parse_half(&v) {
        Ok(h) => h,
        Err(m) => return sglang_error(StatusCode::BAD_REQUEST, m),
    };
    let seeded = v
        .pointer("/sampling_params/sampling_seed")
        .and_then(Value::as_u64)
        .and_then(|s| lock(&ctx.inner.seed_faults).get(&s).copied());
    let fault = seeded.unwrap_or_else(|| *lock(&ctx.inner.fault));
    match ctx.role {
        Role::Prefill => {
            lock(&ctx.inner.rid_rooms).push((half.rid.clone(), half.room));
            if half.logprobs.is_some() {
                lock(&ctx.inner.logprob_rooms).insert(half.room);
            }
            prefill(ctx.inner, half, fault, ctx.cache).await
        }
        Role::Decode => decode(ctx.inner, half, fault).await,
    }
}

/// SGLang's abort of a request whose client went away: armed while the response is owed; if it
/// is dropped armed (the connection closed first), the half is cancelled `after` later.
struct GoneClient {
    inner: Arc<Inner>,
    role: Role,
    rid: String,
    after: Duration,
    armed: bool,
}

impl GoneClient {
    fn new(inner: &Arc<Inner>, role: Role, rid: &str, after: Duration) -> GoneClient {
        GoneClient {
            inner: inner.clone(),
            role,
            rid: rid.to_string(),
            after,
            armed: true,
        }
    }
}

impl Drop for GoneClient {
    fn drop(&mut self) {
        if !self.armed || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let (inner, key, after) = (
            self.inner.clone(),
            (self.role, std::mem::take(&mut self.rid)),
            self.after,
        );
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            if let Some(t) = lock(&inner.live).get(&key) {
                t.cancel();
            }
        });
    }
}

/// SGLang 0.5.23's delay before it aborts a streamed request whose client went away.
pub const STREAM_GONE_AFTER: Duration = Duration::from_secs(2);
/// SGLang 0.5.23's check of a non-streamed request's client (`SGLANG_REQUEST_STATE_WAIT_TIMEOUT`).
const WAIT_GONE_AFTER: Duration = Duration::from_secs(4);

fn register(inner: &Inner, role: Role, rid: &str) -> CancellationToken {
    let token = CancellationToken::new();
    lock(&inner.live).insert((role, rid.to_string()), token.clone());
    token
}

fn unregister(inner: &Inner, role: Role, rid: &str) {
    lock(&inner.live).remove(&(role, rid.to_string()));
}

/// The prefill's `cached_tokens`: the longest prefix of `h`'s prompt an earlier prompt of the
/// same `cache_salt` shares, in whole pages and never the last token (SGLang 0.5.23
/// `managers/schedule_batch.py:1766-1785`, `_compute_max_prefix_len`: at most `input_len - 1`;
/// `mem_cache/radix_cache.py:147`, `page_aligned`), then `h`'s prompt is cached too.
fn radix_hit(inner: &Inner, h: &Half) -> usize {
    let mut radix = lock(&inner.radix);
    let page = inner.cfg.page_size.max(1);
    let best = radix
        .items
        .iter()
        .filter(|(salt, _)| *salt == h.salt)
        .map(|(_, ids)| ids.iter().zip(&h.ids).take_while(|(a, b)| a == b).count())
        .max()
        .unwrap_or(0);
    radix.push((h.salt.clone(), h.ids.clone()));
    (best.min(h.ids.len().saturating_sub(1)) / page) * page
}

fn meta(rid: &str, prompt_tokens: usize, completion: usize, finish: Value) -> Value {
    json!({ "id": rid, "prompt_tokens": prompt_tokens, "completion_tokens": completion, "cached_tokens": 0, "finish_reason": finish })
}

/// Publishes a room, unless its decode was already aborted (then the pages are freed and it
/// returns false).
fn publish(inner: &Inner, room: u64, pages: Vec<usize>, tokens: usize, checksum: u32) -> bool {
    let mut rooms = lock(&inner.rooms);
    if matches!(rooms.get(&room), Some(Room::Abandoned)) {
        rooms.remove(&room);
        lock(&inner.pool).release(pages);
        return false;
    }
    rooms.insert(
        room,
        Room::Published {
            pages,
            tokens,
            checksum,
        },
    );
    drop(rooms);
    inner.room_ready.notify_waiters();
    true
}

/// The prefill gives up on a room its decode did not take: its pages are freed.
fn withdraw(inner: &Inner, room: u64) {
    lock(&inner.taken).remove(&room);
    let mut rooms = lock(&inner.rooms);
    if matches!(rooms.get(&room), Some(Room::Published { .. }))
        && let Some(Room::Published { pages, .. }) = rooms.remove(&room)
    {
        lock(&inner.pool).release(pages);
    }
}

async fn prefill(
    inner: Arc<Inner>,
    h: Half,
    fault: Fault,
    cache: Option<Arc<crate::kv_publisher::EngineCache>>,
) -> Response {
    if let Fault::PrefillStatus(code) = fault {
        let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return sglang_error(status, "injected prefill failure");
    }
    let cancel = register(&inner, Role::Prefill, &h.rid);
    let h_rid = h.rid.clone();
    let (tx, rx) = oneshot::channel();
    let work = inner.clone();
    // The scheduler's work: independent of the HTTP connection.
    tokio::spawn(async move {
        let inner = work;
        let aborted = |rid: &str| json!({ "text": "", "meta_info": meta(rid, 0, 0, json!({"type": "abort", "message": "Abort request"})) });
        let delay = match fault {
            Fault::PrefillHang => Duration::from_secs(120),
            Fault::Slow { prefill_ms, .. } => Duration::from_millis(prefill_ms),
            _ => Duration::ZERO,
        };
        if !delay.is_zero() {
            tokio::select! {
                _ = cancel.cancelled() => {
                    unregister(&inner, Role::Prefill, &h.rid);
                    let _ = tx.send((StatusCode::OK, aborted(&h.rid)));
                    return;
                }
                _ = tokio::time::sleep(delay) => {}
            }
        }
        if cancel.is_cancelled() {
            unregister(&inner, Role::Prefill, &h.rid);
            let _ = tx.send((StatusCode::OK, aborted(&h.rid)));
            return;
        }
        let ps = inner.cfg.page_size;
        let n = h.ids.len();
        let capacity = inner.cfg.total_pages * ps;
        let decoy = fault == Fault::PrefillInBandAbortDecoy || n > capacity;
        let want = n.min(capacity).div_ceil(ps);
        let Some(pages) = lock(&inner.pool).alloc(want) else {
            unregister(&inner, Role::Prefill, &h.rid);
            let _ = tx.send((
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"object": "error", "message": "KV pool exhausted", "code": 503}),
            ));
            return;
        };
        {
            let mut pool = lock(&inner.pool);
            if decoy {
                // The engine bug: only a one-token decoy is written; the rest of the pages keep
                // whatever an earlier request left there.
                pool.pages[pages[0]][0] = h.ids[0];
            } else {
                for (i, t) in h.ids.iter().enumerate() {
                    pool.pages[pages[i / ps]][i % ps] = *t;
                }
            }
        }
        let tokens = n.min(pages.len() * ps);
        let checksum = if arg_bool(&inner, Role::Prefill, "disaggregation_enable_kv_checksum") {
            let pool = lock(&inner.pool);
            let sent: Vec<u32> = (0..tokens)
                .map(|i| pool.pages[pages[i / ps]][i % ps])
                .collect();
            adler32(&sent)
        } else {
            0
        };
        let first = inner
            .tokenizer
            .decode(&h.ids[..1], false)
            .unwrap_or_default();
        if decoy {
            // Older SGLang: the prefill answered at once, the room published as complete.
            publish(&inner, h.room, pages, tokens, checksum);
            unregister(&inner, Role::Prefill, &h.rid);
            let body = json!({ "text": "", "meta_info": meta(&h.rid, n, 0, json!({"type": "abort", "message": format!("Input length ({n} tokens) exceeds the maximum allowed length ({capacity} tokens)")})) });
            let _ = tx.send((StatusCode::OK, body));
            return;
        }
        // SGLang 0.5.23 (`srt/disaggregation/prefill.py`, `process_disagg_prefill_inflight_queue`):
        // the prefill's request is done only when its transfer reached `KVPoll.Success`, that is
        // once the decode has the KV; a failed transfer aborts it with status 500.
        let (taken_tx, taken_rx) = oneshot::channel();
        lock(&inner.taken).insert(h.room, taken_tx);
        let delivered = publish(&inner, h.room, pages, tokens, checksum)
            && tokio::select! {
                _ = cancel.cancelled() => {
                    withdraw(&inner, h.room);
                    unregister(&inner, Role::Prefill, &h.rid);
                    let _ = tx.send((StatusCode::OK, aborted(&h.rid)));
                    return;
                }
                taken = taken_rx => taken.is_ok(),
                _ = tokio::time::sleep(inner.cfg.kv_wait_timeout) => false,
            };
        unregister(&inner, Role::Prefill, &h.rid);
        if !delivered {
            withdraw(&inner, h.room);
            let _ = tx.send((
                StatusCode::INTERNAL_SERVER_ERROR,
                json!({"object": "error", "message": "KV transfer failed", "type": "500", "param": null, "code": 500}),
            ));
            return;
        }
        let reported = if fault == Fault::PrefillCountMismatch {
            n + 1
        } else {
            n
        };
        let mut info = meta(&h.rid, reported, 1, json!({"type": "length", "length": 0}));
        info["cached_tokens"] = json!(match &cache {
            Some(c) => c.serve(&h.ids, h.salt.as_deref()),
            None => radix_hit(&inner, &h),
        });
        // The prompt's log-probabilities from `logprob_start_len` (`logprob_result_processor.py`:
        // the first `None`, then each later token's; ids `origin_input_ids[start:]`).
        if let (Some(k), Some(start)) = (h.logprobs, h.logprob_start)
            && start < n
            && let Some(m) = info.as_object_mut()
        {
            let input = &h.ids[start..];
            let lp = |i: usize, id: u32| {
                let named = if fault == Fault::PrefillLogprobOtherToken {
                    id ^ 1
                } else {
                    id
                };
                let v = (i > 0).then(|| mock_logprob(id));
                json!([v, named, null])
            };
            m.insert(
                "input_token_logprobs".into(),
                input.iter().enumerate().map(|(i, &id)| lp(i, id)).collect(),
            );
            if k > 0 {
                m.insert(
                    "input_top_logprobs".into(),
                    input
                        .iter()
                        .enumerate()
                        .map(|(i, &id)| {
                            if i == 0 {
                                Value::Null
                            } else {
                                mock_top(id, k)
                                    .into_iter()
                                    .map(|(t, v)| json!([v, t, null]))
                                    .collect()
                            }
                        })
                        .collect(),
                );
            }
        }
        let body = json!({ "text": first, "output_ids": [h.ids[0]], "meta_info": info });
        let _ = tx.send((StatusCode::OK, body));
    });
    let mut gone = GoneClient::new(&inner, Role::Prefill, &h_rid, WAIT_GONE_AFTER);
    let answer = rx.await;
    gone.armed = false;
    match answer {
        Ok((status, body)) => (status, axum::Json(body)).into_response(),
        Err(_) => sglang_error(StatusCode::INTERNAL_SERVER_ERROR, "prefill task lost"),
    }
}

enum DecodeMsg {
    Event(Value),
    Cut,
    Fail(StatusCode, String),
    /// The scheduler's `prepare_abort(req, message, status_code)`: inside a stream an event
    /// whose `finish_reason` is the abort; non-stream, that HTTP status with SGLang's
    /// `ErrorResponse` body (`srt/managers/tokenizer_manager.py`, `srt/entrypoints/http_server.py`).
    Abort(Value, StatusCode, String),
}

async fn decode(inner: Arc<Inner>, h: Half, fault: Fault) -> Response {
    if let Fault::DecodeStatus(code) = fault {
        let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return sglang_error(status, "injected decode failure");
    }
    let (tx, mut rx) = mpsc::unbounded_channel::<DecodeMsg>();
    let work = inner.clone();
    let (rid, stream) = (h.rid.clone(), h.stream);
    let answer_rid = rid.clone();
    // The scheduler's work, independent of the HTTP connection (a client that leaves does not
    // stop it); registered after `decode_register_delay`.
    let delay = inner.cfg.decode_register_delay;
    let register_now = delay.is_zero().then(|| {
        lock(&inner.rid_rooms).push((h.rid.clone(), h.room));
        register(&inner, Role::Decode, &h.rid)
    });
    tokio::spawn(async move {
        let cancel = match register_now {
            Some(c) => c,
            None => {
                tokio::time::sleep(delay).await;
                lock(&work.rid_rooms).push((h.rid.clone(), h.room));
                register(&work, Role::Decode, &h.rid)
            }
        };
        decode_work(work.clone(), h, fault, cancel, tx).await;
        unregister(&work, Role::Decode, &rid);
    });
    if stream {
        // Dropped when the response ends, however it ends: SGLang aborts the rid 2 s later.
        let gone = GoneClient::new(&inner, Role::Decode, &answer_rid, STREAM_GONE_AFTER);
        let body = futures_util::stream::unfold(
            (rx, 0usize, gone),
            move |(mut rx, sent, gone)| async move {
                match rx.recv().await {
                    Some(DecodeMsg::Event(v)) => Some((
                        Ok::<Bytes, std::io::Error>(Bytes::from(format!("data: {v}\n\n"))),
                        (rx, sent + 1, gone),
                    )),
                    Some(DecodeMsg::Cut) => Some((
                        Err(std::io::Error::other("injected stream cut")),
                        (rx, sent, gone),
                    )),
                    Some(DecodeMsg::Abort(ev, _, _)) => Some((
                        Ok(Bytes::from(format!("data: {ev}\n\n"))),
                        (rx, sent + 1, gone),
                    )),
                    Some(DecodeMsg::Fail(_, m)) => Some((
                        Ok(Bytes::from(format!(
                            "data: {}\n\n",
                            json!({"error": {"message": m}})
                        ))),
                        (rx, sent, gone),
                    )),
                    None => {
                        if sent == usize::MAX {
                            return None;
                        }
                        Some((
                            Ok(Bytes::from_static(b"data: [DONE]\n\n")),
                            (rx, usize::MAX, gone),
                        ))
                    }
                }
            },
        );
        return Response::builder()
            .header(http::header::CONTENT_TYPE, "text/event-stream")
            .body(Body::from_stream(body))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }
    let mut gone = GoneClient::new(&inner, Role::Decode, &answer_rid, WAIT_GONE_AFTER);
    let answer = decode_answer(&mut rx).await;
    gone.armed = false;
    answer
}

/// A non-streamed decode's whole answer.
async fn decode_answer(rx: &mut mpsc::UnboundedReceiver<DecodeMsg>) -> Response {
    let mut last = None;
    while let Some(m) = rx.recv().await {
        match m {
            DecodeMsg::Event(v) => last = Some(v),
            DecodeMsg::Cut => {
                return sglang_error(StatusCode::INTERNAL_SERVER_ERROR, "injected stream cut");
            }
            DecodeMsg::Fail(s, m) => return sglang_error(s, &m),
            DecodeMsg::Abort(_, s, m) => {
                let code = s.as_u16();
                return (s, axum::Json(json!({"object": "error", "message": m, "type": code.to_string(), "param": null, "code": code}))).into_response();
            }
        }
    }
    match last {
        Some(v) => axum::Json(v).into_response(),
        None => sglang_error(StatusCode::INTERNAL_SERVER_ERROR, "no output"),
    }
}

async fn decode_work(
    inner: Arc<Inner>,
    h: Half,
    fault: Fault,
    cancel: CancellationToken,
    tx: mpsc::UnboundedSender<DecodeMsg>,
) {
    let aborted = |rid: &str| {
        DecodeMsg::Event(
            json!({ "text": "", "meta_info": meta(rid, 0, 0, json!({"type": "abort", "message": "Abort request"})) }),
        )
    };
    // Wait for the room's KV.
    let deadline = tokio::time::Instant::now() + inner.cfg.kv_wait_timeout;
    let (pages, tokens, checksum) = loop {
        let notified = inner.room_ready.notified();
        {
            let mut rooms = lock(&inner.rooms);
            if matches!(rooms.get(&h.room), Some(Room::Published { .. }))
                && let Some(Room::Published {
                    pages,
                    tokens,
                    checksum,
                }) = rooms.remove(&h.room)
            {
                // The transfer is done: the waiting prefill may answer.
                if let Some(taken) = lock(&inner.taken).remove(&h.room) {
                    let _ = taken.send(());
                }
                break (pages, tokens, checksum);
            }
        }
        tokio::select! {
            _ = notified => {}
            _ = cancel.cancelled() => {
                abandon(&inner, h.room);
                let _ = tx.send(aborted(&h.rid));
                return;
            }
            _ = tokio::time::sleep_until(deadline) => {
                abandon(&inner, h.room);
                let _ = tx.send(DecodeMsg::Fail(StatusCode::INTERNAL_SERVER_ERROR, "KV transfer timed out waiting for prefill".into()));
                return;
            }
        }
    };
    let ps = inner.cfg.page_size;
    let mut kv: Vec<u32> = {
        let pool = lock(&inner.pool);
        (0..tokens)
            .map(|i| pool.pages[pages[i / ps]][i % ps])
            .collect()
    };
    let release = |pages: Vec<usize>| lock(&inner.pool).release(pages);
    if fault == Fault::KvCorrupt
        && let Some(v) = kv.first_mut()
    {
        *v ^= 1;
    }
    // `srt/disaggregation/decode.py` `_verify_kv_checksums`, before the first forward pass.
    if checksum != 0 && checksum_on(&inner) && adler32(&kv) != checksum {
        release(pages);
        let message = "KV checksum mismatch";
        let finish =
            json!({"type": "abort", "message": message, "status_code": 500, "err_type": null});
        let ev = json!({ "text": "", "output_ids": [], "meta_info": meta(&h.rid, h.ids.len(), 0, finish) });
        let _ = tx.send(DecodeMsg::Abort(
            ev,
            StatusCode::INTERNAL_SERVER_ERROR,
            message.into(),
        ));
        return;
    }
    let incremental = h.stream && arg_bool(&inner, Role::Decode, "incremental_streaming_output");
    // A deterministic server draws each token from (seed, position): an unseeded request gets
    // seed 42 (`srt/sampling/sampling_batch_info.py`, built only with
    // `--enable-deterministic-inference`; `layers/sampler.py` `multinomial_with_seed` over the
    // seed and the position), here an index into what the KV holds. Read once per request.
    let deterministic = arg_bool(&inner, Role::Decode, "enable_deterministic_inference");
    let prefill_logprobs = lock(&inner.logprob_rooms).remove(&h.room);
    let with_text = !arg_bool(&inner, Role::Decode, "skip_tokenizer_init");
    if fault == Fault::DecodeHang {
        tokio::select! {
            _ = cancel.cancelled() => { let _ = tx.send(aborted(&h.rid)); }
            _ = tokio::time::sleep(Duration::from_secs(120)) => {}
        }
        release(pages);
        return;
    }
    let token_delay = match fault {
        Fault::Slow { token_ms, .. } => Duration::from_millis(token_ms),
        _ => inner.cfg.token_delay,
    };
    // What SGLang reports: the length of the ids it was sent (`output_streamer.py`).
    let reported = if fault == Fault::DecodeCountMismatch {
        h.ids.len() + 1
    } else {
        h.ids.len()
    };
    let mut out = Vec::with_capacity(h.max_new);
    for i in 0..h.max_new {
        tokio::select! {
            _ = cancel.cancelled() => {
                let _ = tx.send(aborted(&h.rid));
                release(pages);
                return;
            }
            _ = tokio::time::sleep(token_delay) => {}
        }
        if let Fault::DecodeCut(after) | Fault::DecodeCutOnce(after) = fault
            && i == after
        {
            if let Fault::DecodeCutOnce(_) = fault {
                let mut f = lock(&inner.fault);
                if *f == fault {
                    *f = Fault::None;
                }
            }
            let _ = tx.send(DecodeMsg::Cut);
            release(pages);
            return;
        }
        // Output is read from the KV: the prompt echoed back, or the token `lag` back.
        out.push(match inner.cfg.continuation_lag {
            _ if deterministic && !kv.is_empty() => {
                let seed = h.seed.unwrap_or(42);
                let mixed = (seed ^ 0x9e37_79b9_7f4a_7c15)
                    .wrapping_mul(0xbf58_476d_1ce4_e5b9)
                    .wrapping_add((i as u64).wrapping_mul(0x94d0_49bb_1331_11eb));
                kv[((mixed >> 17) % kv.len() as u64) as usize]
            }
            None => kv[i % kv.len().max(1)],
            Some(_) if kv.is_empty() => 0,
            Some(lag) => {
                let t = kv.len() + i;
                let at = t.saturating_sub(lag);
                if at < kv.len() {
                    kv[at]
                } else {
                    out[at - kv.len()]
                }
            }
        });
        let mut text = with_text.then(|| printable(&inner.tokenizer, &out));
        // `Req.check_finished` (`srt/managers/schedule_batch.py`): the first stop string, in the
        // request's order, found in the decoded text ends the request `{"type":"stop","matched"}`;
        // the detokenizer then cuts the text where it starts unless `no_stop_trim`
        // (`detokenizer_manager.py` `trim_matched_stop`). Text already streamed stays sent.
        let matched = text.as_ref().and_then(|t| {
            h.stop
                .iter()
                .find(|s| !s.is_empty() && t.contains(s.as_str()))
        });
        let finish = if let Some(m) = matched {
            if let Some(t) = text.as_mut()
                && let Some(pos) = t.find(m.as_str())
            {
                t.truncate(if h.no_stop_trim { pos + m.len() } else { pos });
            }
            json!({"type": "stop", "matched": m})
        } else if i + 1 == h.max_new {
            json!({"type": "length", "length": h.max_new})
        } else {
            Value::Null
        };
        let last = !finish.is_null();
        // Cumulative `text`/`output_ids` by default; with `incremental_streaming_output` only
        // this step's (`tokenizer_manager.py` `_handle_batch_output`); `meta_info`'s
        // `completion_tokens` counts all of them either way.
        let shown = if incremental { &out[i..] } else { &out[..] };
        let reported = match fault {
            Fault::DecodeCountChangesAt(at) if i >= at => h.ids.len() + 1,
            _ => reported,
        };
        let mut ev =
            json!({ "output_ids": shown, "meta_info": meta(&h.rid, reported, out.len(), finish) });
        if fault == Fault::DecodeNoCount
            && let Some(m) = ev["meta_info"].as_object_mut()
        {
            m.remove("prompt_tokens");
        }
        if let Some(k) = h.logprobs
            && let (Some(m), Value::Object(mut lp)) = (
                ev["meta_info"].as_object_mut(),
                logprob_meta(
                    &out,
                    k,
                    !prefill_logprobs,
                    fault == Fault::DecodeLogprobOtherToken,
                ),
            )
        {
            if incremental {
                // Incremental mode slices the output-side lists to this event's tokens, from
                // the offset of the last event sent (`tokenizer_manager.py`
                // `_slice_streaming_output_meta_info` over `_INCREMENTAL_STREAMING_META_INFO_KEYS`:
                // `output_token_logprobs`, `output_top_logprobs`, ...); the `_length` and the
                // input-side lists are not sliced.
                for key in ["output_token_logprobs", "output_top_logprobs"] {
                    if let Some(Value::Array(list)) = lp.get_mut(key) {
                        list.drain(..i.min(list.len()));
                    }
                }
            }
            m.extend(lp);
        }
        if let Some(text) = text {
            ev["text"] = json!(if incremental {
                let before = printable(&inner.tokenizer, &out[..i]);
                text.get(before.len()..).unwrap_or_default().to_string()
            } else {
                text
            });
        }
        let _ = tx.send(DecodeMsg::Event(ev));
        if last {
            break;
        }
    }
    release(pages);
}

/// The text of `ids` as SGLang's detokenizer streams it: a character whose bytes have not all
/// come yet (U+FFFD at the end) is held back (`srt/managers/detokenizer_manager.py`: incomplete
/// UTF-8 emits the printable prefix only).
fn printable(tok: &Tokenizer, ids: &[u32]) -> String {
    let text = tok.decode(ids, false).unwrap_or_default();
    text.trim_end_matches('\u{FFFD}').to_string()
}

fn abandon(inner: &Inner, room: u64) {
    let mut rooms = lock(&inner.rooms);
    match rooms.remove(&room) {
        Some(Room::Published { pages, .. }) => lock(&inner.pool).release(pages),
        _ => {
            rooms.insert(room, Room::Abandoned);
        }
    }
}

//! A mock of a vLLM disaggregated pair (NixlConnector), faithful where lockstep's guarantees
//! depend on it:
//! - **One block pool, never scrubbed.** The prefill server writes a request's prompt into blocks
//!   of a pool the decode server reads from (NIXL reads the prefill's GPU memory); freed blocks
//!   keep their contents and are reused last-in first-out.
//! - **The decode reads exactly the blocks the params name** and echoes the tokens it read, so
//!   an answer shows whose KV produced it: block ids that point at freed blocks (vLLM #52234)
//!   return an earlier request's prompt.
//! - **Held blocks.** After answering, the prefill holds the request's blocks until a decode
//!   reads them (then they are freed), or until its lease runs out (vLLM 0.33:
//!   `kv_lease_duration`, 30 s, extended by decode heartbeats, `nixl/base_scheduler.py`; short
//!   here).
//! - **No abort endpoint.** A request runs as long as its connection: the decode stops and frees
//!   what it holds when the client closes the connection.
//! - vLLM's shapes: `/v1/completions` with token-id prompts, `kv_transfer_params` in and out
//!   (`remote_block_ids` nested per KV-cache group as 0.33 sends them, or flat as before:
//!   [`BlockIdShape`]),
//!   `usage` on a stream only as vLLM 0.33 sends it (`should_include_usage`,
//!   `entrypoints/serve/utils/api_utils.py`; `entrypoints/openai/completion/serving.py`): on
//!   every chunk only with `stream_options.include_usage` and `continuous_usage_stats`, and a
//!   last chunk with `choices: []` and the totals under `include_usage`; none otherwise),
//!   `finish_reason` with `stop_reason` (a `stop` string matched in the output text ends it
//!   with `"stop"`, the text cut before the string, `v1/engine/detokenizer.py`
//!   `check_stop_strings`; the NIXL connector keeps a stopped prefill's blocks as it keeps a
//!   length-capped one's, `nixl/pull_scheduler.py` `request_finished`), a body whose `model` is not the served name refused 404 `NotFoundError`
//!   (`entrypoints/serve/engine/serving.py` `_check_model`), error bodies
//!   `{"error":{"message","type","param","code"}}` (`entrypoints/serve/engine/protocol.py`),
//!   `X-Request-Id` (the engine id is `cmpl-<X-Request-Id>-0-<suffix>`, named by
//!   `remote_request_id`), `/health`, `/v1/models` with `max_model_len`, `/metrics` with
//!   `vllm:cache_config_info`, and the `--api-key` guard on `/v1` paths.
//!
//! - **Log-probabilities** (`logprobs: k`, at most 20: above, 400 "Requested sample logprobs of
//!   N, which is greater than max allowed: 20", `sampling_params.py`): each chunk's
//!   `choices[0].logprobs` in the completions shape (`completion/serving.py`
//!   `_create_completion_logprobs`): `tokens` (`token_id:N` with `return_tokens_as_token_ids`,
//!   `generate/base/serving.py` `format_token_id_placeholder`; else the token's text),
//!   `token_logprobs`, `top_logprobs` (a map holding the sampled token first, then the `k` most
//!   likely, `logprobs.py` `append_logprobs_for_next_position`: a token in both is listed once,
//!   at the sampled token's place) and `text_offset` (advanced by each token string's length).
//!   The mock's sampled token is never among its `k` most likely (as with a temperature: its
//!   value is [`crate::sglang_mock::mock_logprob`] less 2.5, the alternatives' 0.1 to 0.1 k
//!   above it), so a reader must pick them by value.
//!
//! - **Chunks with several steps** (`merged_steps`): 2, then 3, ... steps' outputs in one chunk,
//!   as vLLM merges them when its API server falls behind ([`crate::vllm_chunks`]).
//!
//! Faults (applied to every request until changed): the stale-reference prefill of #52234,
//! missing or duplicated block ids, a decode error status, a decode that hangs.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::{HeaderMap, StatusCode};
use serde_json::{Value, json};
use tokenizers::Tokenizer;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::sglang_mock::{KEPT, lock, stop_strings};
use crate::vllm_chunks::{Step, deliver};

/// Injected faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VllmFault {
    /// Healthy.
    None,
    /// vLLM #52234: the prefill answers 200 with `usage.prompt_tokens = 1` and block ids that
    /// still hold an earlier request's data (it computed nothing).
    StaleReference,
    /// The prefill's answer has no `kv_transfer_params` (it still holds its blocks).
    MissingParams,
    /// The prefill's params name one block twice.
    DuplicateBlockIds,
    /// The decode answers this error status.
    DecodeStatus(u16),
    /// The decode reads its blocks and then sends nothing, until the client goes away.
    DecodeHang,
    /// The decode server queues the request for two leases before it reads the blocks (a busy
    /// decode): by then the prefill has freed them and another request may have written there.
    /// Every count is still right; nothing in vLLM's protocol tells.
    DecodeQueuedPastLease,
    /// The decode's stream breaks after this many chunks, once (a decode server that died):
    /// the fault then clears.
    DecodeCutOnce(usize),
    /// The decode's log-probabilities name the token after the one it output.
    DecodeLogprobOtherToken,
    /// The prefill's `prompt_logprobs` hold other tokens than the prompt's.
    PrefillPromptLogprobsOtherToken,
}

/// Mock settings.
#[derive(Debug, Clone)]
pub struct VllmMockConfig {
    /// Blocks in the shared pool.
    pub blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// The prefill refuses longer prompts with 400 (vLLM's `max_model_len`).
    pub max_model_len: usize,
    /// How long a prefill holds blocks no decode reads.
    pub lease: Duration,
    /// Delay between streamed tokens.
    pub token_delay: Duration,
    /// How the prefill's `kv_transfer_params` name its blocks (which vLLM release it acts as).
    pub block_ids: BlockIdShape,
    /// `--served-model-name`: what `/v1/models` lists.
    pub served_model_name: String,
    /// `--api-key`: paths under `/v1` need `Authorization: Bearer` it, else 401
    /// `{"error":"Unauthorized"}` (vLLM 0.33 `entrypoints/serve/middleware/authenticate.py`);
    /// `/health` is not guarded.
    pub api_key: Option<String>,
    /// How the output follows from the sequence: `None` echoes the KV read (token `i` is KV
    /// token `i mod len`); `Some(lag)` makes each token the one `lag` places back in the
    /// sequence so far (prompt and output), a function of the sequence alone as a real model's
    /// greedy output is (the migration tests).
    pub continuation_lag: Option<usize>,
    /// The API server behind the engine: each chunk carries 2, then 3, then 2 ... steps'
    /// outputs merged (`RequestOutputCollector.put`, [`crate::vllm_chunks`]); `false`, one step
    /// a chunk.
    pub merged_steps: bool,
}

/// The shape of `kv_transfer_params.remote_block_ids`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockIdShape {
    /// vLLM 0.33: one list per KV-cache group (`BlockIds = tuple[list[int], ...]`,
    /// `vllm/distributed/kv_transfer/kv_connector/utils.py`; the NIXL connector's
    /// `request_finished` in `nixl/pull_scheduler.py` returns them with `remote_num_tokens`,
    /// `remote_request_id`, `tp_size`, `dcp_size`, `pp_size`, `transfer_mode` and
    /// `remote_registration_generation`). A dense model has one group: `[[4, 9, 2]]`.
    Nested,
    /// Releases before the KV-cache groups: one flat list, `[4, 9, 2]`.
    Flat,
}

impl Default for VllmMockConfig {
    fn default() -> Self {
        VllmMockConfig {
            blocks: 64,
            block_size: 16,
            max_model_len: 256,
            lease: Duration::from_millis(600),
            token_delay: Duration::from_millis(1),
            block_ids: BlockIdShape::Nested,
            api_key: None,
            served_model_name: "vllm-pd".into(),
            continuation_lag: None,
            merged_steps: false,
        }
    }
}

/// Which server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VllmRole {
    /// The prefill server (`kv_producer`).
    Prefill,
    /// The decode server (`kv_consumer`).
    Decode,
}

struct Pool {
    blocks: Vec<Vec<u32>>,
    free: Vec<usize>,
}

/// Records one request, keeping the most recent [`KEPT`] (a soak stays bounded in memory).
fn record(inner: &Inner, entry: (VllmRole, Option<String>, Value)) {
    let mut log = lock(&inner.requests);
    if log.len() >= KEPT {
        log.drain(..KEPT / 10);
    }
    log.push(entry);
}

struct Inner {
    cfg: VllmMockConfig,
    tokenizer: Tokenizer,
    fault: Mutex<VllmFault>,
    pool: Mutex<Pool>,
    /// Request id → (blocks held for a remote decode, lease end).
    held: Mutex<HashMap<String, (Vec<usize>, Instant)>>,
    /// The blocks of the previous prefill (freed or not): what a stale reference points at.
    last_blocks: Mutex<Vec<usize>>,
    /// Streams and requests in progress.
    live: AtomicUsize,
    /// Makes each engine request id unique.
    suffix: AtomicUsize,
    requests: Mutex<Vec<(VllmRole, Option<String>, Value)>>,
}

/// A running mock pair.
pub struct VllmMock {
    inner: Arc<Inner>,
    /// The prefill server.
    pub prefill_addr: SocketAddr,
    /// The decode server.
    pub decode_addr: SocketAddr,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for VllmMock {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Counts a request or stream in progress while alive.
struct Live(Arc<Inner>);

impl Live {
    fn new(inner: &Arc<Inner>) -> Live {
        inner.live.fetch_add(1, Ordering::SeqCst);
        Live(inner.clone())
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::SeqCst);
    }
}

impl VllmMock {
    /// Starts both servers on ephemeral loopback ports.
    pub async fn start(cfg: VllmMockConfig, tokenizer: Tokenizer) -> std::io::Result<VllmMock> {
        let inner = Arc::new(Inner {
            pool: Mutex::new(Pool {
                blocks: vec![vec![0; cfg.block_size]; cfg.blocks],
                free: (0..cfg.blocks).rev().collect(),
            }),
            cfg,
            tokenizer,
            fault: Mutex::new(VllmFault::None),
            held: Mutex::default(),
            last_blocks: Mutex::default(),
            live: AtomicUsize::new(0),
            suffix: AtomicUsize::new(0x5eed),
            requests: Mutex::default(),
        });
        let (pl, dl) = (
            TcpListener::bind("127.0.0.1:0").await?,
            TcpListener::bind("127.0.0.1:0").await?,
        );
        let (prefill_addr, decode_addr) = (pl.local_addr()?, dl.local_addr()?);
        let app = |role: VllmRole| {
            Router::new()
                .route("/v1/completions", post(completions))
                .route("/health", get(|| async { "ok" }))
                .route("/v1/models", get(models))
                .route("/metrics", get(metrics))
                .with_state((inner.clone(), role))
        };
        let (pa, da) = (app(VllmRole::Prefill), app(VllmRole::Decode));
        let sweeper = {
            let inner = inner.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    let now = Instant::now();
                    let expired: Vec<Vec<usize>> = {
                        let mut held = lock(&inner.held);
                        let ids: Vec<String> = held
                            .iter()
                            .filter(|(_, (_, end))| *end <= now)
                            .map(|(k, _)| k.clone())
                            .collect();
                        ids.iter()
                            .filter_map(|k| held.remove(k))
                            .map(|h| h.0)
                            .collect()
                    };
                    let mut pool = lock(&inner.pool);
                    for b in expired.into_iter().flatten() {
                        pool.free.push(b);
                    }
                }
            })
        };
        let tasks = vec![
            tokio::spawn(async move {
                let _ = axum::serve(pl, pa).await;
            }),
            tokio::spawn(async move {
                let _ = axum::serve(dl, da).await;
            }),
            sweeper,
        ];
        Ok(VllmMock {
            inner,
            prefill_addr,
            decode_addr,
            tasks,
        })
    }

    /// Base URL of the prefill server.
    pub fn prefill_url(&self) -> String {
        format!("http://{}", self.prefill_addr)
    }
    /// Base URL of the decode server.
    pub fn decode_url(&self) -> String {
        format!("http://{}", self.decode_addr)
    }
    /// Sets the fault for following requests.
    pub fn set_fault(&self, f: VllmFault) {
        *lock(&self.inner.fault) = f;
    }
    /// Every request body received, with its server and `X-Request-Id`.
    pub fn requests(&self) -> Vec<(VllmRole, Option<String>, Value)> {
        lock(&self.inner.requests).clone()
    }
    /// Blocks held for remote decodes.
    pub fn held_blocks(&self) -> usize {
        lock(&self.inner.held).values().map(|h| h.0.len()).sum()
    }
    /// True when nothing is held: no request or stream in progress, every block free.
    pub fn is_idle(&self) -> bool {
        self.inner.live.load(Ordering::SeqCst) == 0
            && self.held_blocks() == 0
            && lock(&self.inner.pool).free.len() == self.inner.cfg.blocks
    }
    /// Waits (bounded) until idle; returns whether it got there.
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

/// vLLM 0.33's error answer: `ErrorResponse {error: ErrorInfo {message, type, param, code}}`
/// with the HTTP status equal to `code` (`entrypoints/serve/engine/protocol.py`).
/// `should_include_usage` (`entrypoints/serve/utils/api_utils.py`): (`include_usage`,
/// `include_usage && continuous_usage_stats`).
fn include_usage(req: &Value) -> (bool, bool) {
    let on = |k: &str| {
        req.pointer(&format!("/stream_options/{k}"))
            .and_then(Value::as_bool)
            .unwrap_or(false)
    };
    (
        on("include_usage"),
        on("include_usage") && on("continuous_usage_stats"),
    )
}

/// The request's `stop` strings (a string or a list, `completion/protocol.py`).
fn stops(req: &Value) -> Vec<String> {
    stop_strings(req.get("stop"))
}

/// `check_stop_strings` over the whole text: where the earliest-ending stop string starts, and
/// which string it is (ties by list order).
fn stop_match(text: &str, stop: &[String]) -> Option<(usize, String)> {
    stop.iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()).map(|at| (at + s.len(), at, s)))
        .min_by_key(|(end, _, _)| *end)
        .map(|(_, at, s)| (at, s.clone()))
}

/// 404 `NotFoundError` naming `model` (`serve/engine/serving.py` `_check_model`).
fn not_found(message: &str) -> Response {
    (
        StatusCode::NOT_FOUND,
        axum::Json(
            json!({ "error": { "message": message, "type": "NotFoundError",
                                      "param": "model", "code": 404 } }),
        ),
    )
        .into_response()
}

fn error(status: StatusCode, message: String) -> Response {
    let kind = if status.is_client_error() {
        "BadRequestError"
    } else {
        "InternalServerError"
    };
    (
        status,
        axum::Json(json!({ "error": { "message": message, "type": kind,
                                      "param": null, "code": status.as_u16() } })),
    )
        .into_response()
}

/// The API-key guard of vLLM 0.33 (`entrypoints/serve/middleware/authenticate.py`): paths
/// under `/v1` need `Authorization: Bearer <key>`, else 401 `{"error":"Unauthorized"}`.
fn unauthorized(inner: &Inner, headers: &HeaderMap) -> Option<Response> {
    let key = inner.cfg.api_key.as_ref()?;
    let got = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    (got != Some(key.as_str())).then(|| {
        (
            StatusCode::UNAUTHORIZED,
            axum::Json(serde_json::json!({"error": "Unauthorized"})),
        )
            .into_response()
    })
}

/// `GET /v1/models` (`entrypoints/openai/models/serving.py`, `show_available_models`): the
/// served model with its `max_model_len`.
async fn models(State((inner, _)): State<(Arc<Inner>, VllmRole)>, headers: HeaderMap) -> Response {
    if let Some(r) = unauthorized(&inner, &headers) {
        return r;
    }
    let cfg = &inner.cfg;
    axum::Json(json!({ "object": "list", "data": [{
        "id": cfg.served_model_name, "object": "model", "owned_by": "vllm",
        "root": "mock", "parent": null, "max_model_len": cfg.max_model_len, "permission": [],
    }] }))
    .into_response()
}

/// `GET /metrics` (not guarded by the API key): the `vllm:cache_config_info` gauge whose labels
/// are the cache config (`v1/metrics/loggers.py`, `log_metrics_info`).
async fn metrics(State((inner, _)): State<(Arc<Inner>, VllmRole)>) -> String {
    let cfg = &inner.cfg;
    format!(
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"0.9\",num_gpu_blocks=\"{}\"}} 1.0\n",
        cfg.block_size, cfg.blocks
    )
}

async fn completions(
    State((inner, role)): State<(Arc<Inner>, VllmRole)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let _live = Live::new(&inner);
    if let Some(r) = unauthorized(&inner, &headers) {
        record(&inner, (role, None, json!({"unauthorized": true})));
        return r;
    }
    let Ok(req) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "body is not JSON".into());
    };
    let rid = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    record(&inner, (role, rid.clone(), req.clone()));
    // `_check_model`: a missing or empty `model` is the served one; any other name is refused.
    if let Some(m) = req.get("model").and_then(Value::as_str)
        && !m.is_empty()
        && m != inner.cfg.served_model_name
    {
        return not_found(&format!(
            "The model `{m}` does not exist. Valid aliases: {}.",
            inner.cfg.served_model_name
        ));
    }
    let Some(prompt) = req.get("prompt").and_then(Value::as_array).map(|a| {
        a.iter()
            .filter_map(|t| t.as_u64().map(|t| t as u32))
            .collect::<Vec<u32>>()
    }) else {
        return error(StatusCode::BAD_REQUEST, "prompt must be token ids".into());
    };
    let fault = *lock(&inner.fault);
    match role {
        VllmRole::Prefill => prefill(&inner, fault, rid.unwrap_or_default(), &prompt, &req),
        VllmRole::Decode => {
            if fault == VllmFault::DecodeQueuedPastLease {
                tokio::time::sleep(inner.cfg.lease * 2).await;
            }
            decode(inner.clone(), fault, &req, prompt.len())
        }
    }
}

fn prefill(
    inner: &Arc<Inner>,
    fault: VllmFault,
    rid: String,
    prompt: &[u32],
    req: &Value,
) -> Response {
    let cfg = &inner.cfg;
    // The engine's request id, what `remote_request_id` names: `cmpl-<X-Request-Id>` plus the
    // choice index (`entrypoints/openai/completion/serving.py`) plus a random suffix the engine
    // adds (`v1/engine/input_processor.py`); the suffix here is a counter.
    let internal = format!(
        "cmpl-{rid}-0-{:08x}",
        inner.suffix.fetch_add(1, Ordering::SeqCst) as u32
    );
    let rid = internal;
    if prompt.len() > cfg.max_model_len {
        return error(
            StatusCode::BAD_REQUEST,
            format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens in the messages.",
                cfg.max_model_len,
                prompt.len()
            ),
        );
    }
    let (blocks, reported) = if fault == VllmFault::StaleReference {
        // Computes nothing and names the previous request's (freed, unscrubbed) blocks.
        (lock(&inner.last_blocks).clone(), 1)
    } else {
        let need = prompt.len().div_ceil(cfg.block_size);
        let mut pool = lock(&inner.pool);
        if need > pool.free.len() {
            return error(StatusCode::SERVICE_UNAVAILABLE, "no free KV blocks".into());
        }
        let blocks: Vec<usize> = (0..need).filter_map(|_| pool.free.pop()).collect();
        for (i, chunk) in prompt.chunks(cfg.block_size).enumerate() {
            pool.blocks[blocks[i]][..chunk.len()].copy_from_slice(chunk);
        }
        drop(pool);
        lock(&inner.held).insert(rid.clone(), (blocks.clone(), Instant::now() + cfg.lease));
        *lock(&inner.last_blocks) = blocks.clone();
        (blocks, prompt.len())
    };
    let mut ids: Vec<Value> = blocks.iter().map(|b| json!(b)).collect();
    if fault == VllmFault::DuplicateBlockIds
        && let Some(first) = ids.first().cloned()
    {
        ids.push(first);
    }
    let first_token = prompt.last().copied().unwrap_or(0);
    let text = inner
        .tokenizer
        .decode(&[first_token], false)
        .unwrap_or_default();
    let (text, finish, stop_reason) = match stop_match(&text, &stops(req)) {
        Some((cut, s)) => (text[..cut].to_string(), "stop", json!(s)),
        None => (text, "length", Value::Null),
    };
    let mut answer = json!({
        "id": format!("cmpl-{rid}"), "object": "text_completion", "model": cfg.served_model_name,
        "choices": [{ "index": 0, "text": text, "logprobs": null, "finish_reason": finish,
                      "stop_reason": stop_reason }],
        "usage": { "prompt_tokens": reported, "completion_tokens": 1, "total_tokens": reported + 1 },
    });
    // `prompt_logprobs: k` (`completion/protocol.py` `CompletionResponseChoice.prompt_logprobs`):
    // `null` for the first prompt token, then a map from token id to `{logprob, rank,
    // decoded_token}` holding the prompt's token (here never among the most likely: rank k + 1)
    // and the k most likely (`logprobs.py` `append_logprobs_for_next_position`).
    if let Some(k) = req.get("prompt_logprobs").and_then(Value::as_u64) {
        let entries: Vec<Value> = prompt
            .iter()
            .enumerate()
            .map(|(i, &id)| {
                if i == 0 {
                    return Value::Null;
                }
                let named = if fault == VllmFault::PrefillPromptLogprobsOtherToken {
                    id ^ 1
                } else {
                    id
                };
                let lp = crate::sglang_mock::mock_logprob(id) - 2.5;
                let mut m = serde_json::Map::new();
                m.insert(
                    named.to_string(),
                    json!({"logprob": lp, "rank": k + 1, "decoded_token": ""}),
                );
                for j in 0..k {
                    let above = 0.1 * (k - j) as f32;
                    m.insert(
                        (id.wrapping_add(1 + j as u32)).to_string(),
                        json!({"logprob": lp + above, "rank": j + 1, "decoded_token": ""}),
                    );
                }
                Value::Object(m)
            })
            .collect();
        answer["choices"][0]["prompt_logprobs"] = json!(entries);
    }
    // `request_finished` (`nixl/pull_scheduler.py`) keeps the blocks for a decode after a
    // length-capped or a stopped finish alike.
    if fault != VllmFault::MissingParams {
        answer["kv_transfer_params"] = match inner.cfg.block_ids {
            BlockIdShape::Nested => json!({
                "do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [ids],
                "remote_engine_id": "mock-prefill-engine", "remote_request_id": rid,
                "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1, "dcp_size": 1,
                "pp_size": 1, "remote_num_tokens": reported, "remote_blocks_expiry_time": null,
                "remote_registration_generation": 0, "transfer_mode": "pull",
            }),
            BlockIdShape::Flat => json!({
                "do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": ids,
                "remote_engine_id": "mock-prefill-engine", "remote_host": "127.0.0.1", "remote_port": 5600,
                "remote_request_id": rid, "tp_size": 1,
            }),
        };
    }
    axum::Json(answer).into_response()
}

fn decode(inner: Arc<Inner>, fault: VllmFault, req: &Value, prompt_tokens: usize) -> Response {
    if let Some(k) = req.get("logprobs").and_then(Value::as_u64)
        && k > 20
    {
        return error(
            StatusCode::BAD_REQUEST,
            format!("Requested sample logprobs of {k}, which is greater than max allowed: 20"),
        );
    }
    if let VllmFault::DecodeStatus(s) = fault {
        let status = StatusCode::from_u16(s).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return error(status, "decode failed (injected)".into());
    }
    let Some(params) = req.get("kv_transfer_params").filter(|p| p.is_object()) else {
        // No transfer asked for: the server computes the prompt itself (vLLM 0.33's
        // NixlConnector matches no external tokens without `do_remote_prefill`,
        // `nixl/pull_scheduler.py` `get_num_new_matched_tokens`), so its KV is the prompt's.
        let prompt = prompt_of(req);
        return stream_from(inner, fault, req, prompt_tokens, prompt);
    };
    // Nested (0.33: the decode walks every group, `nixl/base_worker.py`) or flat (before).
    let ids: Vec<usize> = params
        .get("remote_block_ids")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .flat_map(|b| match b.as_array() {
                    Some(group) => group.clone(),
                    None => vec![b.clone()],
                })
                .filter_map(|b| b.as_u64().map(|b| b as usize))
                .collect()
        })
        .unwrap_or_default();
    // NIXL reads exactly these blocks, whoever's they are; the prefill then frees what it held.
    let kv: Vec<u32> = {
        let pool = lock(&inner.pool);
        ids.iter()
            .filter_map(|b| pool.blocks.get(*b))
            .flat_map(|b| b.iter().copied())
            .collect()
    };
    if let Some(rid) = params.get("remote_request_id").and_then(Value::as_str)
        && let Some((blocks, _)) = lock(&inner.held).remove(rid)
    {
        lock(&inner.pool).free.extend(blocks);
    }
    stream_from(inner, fault, req, prompt_tokens, kv)
}

/// The prompt's token ids of a request (already checked to be ids).
fn prompt_of(req: &Value) -> Vec<u32> {
    req.get("prompt")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|t| t.as_u64().map(|t| t as u32))
                .collect()
        })
        .unwrap_or_default()
}

/// The decode's stream, generating from `kv` (what its blocks hold).
fn stream_from(
    inner: Arc<Inner>,
    fault: VllmFault,
    req: &Value,
    prompt_tokens: usize,
    kv: Vec<u32>,
) -> Response {
    // vLLM refuses `max_tokens` below 1 (`completion/protocol.py`).
    let max = req
        .get("max_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(16)
        .max(1) as usize;
    let live = Live::new(&inner);
    let delay = inner.cfg.token_delay;
    let hang = fault == VllmFault::DecodeHang;
    let (include_usage, continuous) = include_usage(req);
    let stop = stops(req);
    let model = inner.cfg.served_model_name.clone();
    // The detokenizer holds back the last `longest stop - 1` bytes of unfinished text, so no
    // part of a stop string is sent before it is known not to be one (`stop_buffer_length`,
    // `v1/engine/output_processor.py` `get_next_output_text`).
    let hold = stop
        .iter()
        .map(String::len)
        .max()
        .unwrap_or(1)
        .saturating_sub(1);
    // With `return_token_ids`, each chunk's own ids and, on the first, the prompt's
    // (`entrypoints/openai/completion/serving.py`).
    let with_ids = req.get("return_token_ids") == Some(&Value::Bool(true));
    let logprobs = req
        .get("logprobs")
        .and_then(Value::as_u64)
        .map(|k| k as usize);
    let as_ids = req.get("return_tokens_as_token_ids") == Some(&Value::Bool(true));
    let next_offset = Arc::new(AtomicUsize::new(0));
    let prompt_ids = prompt_of(req);
    let lag = inner.cfg.continuation_lag;
    let merge = inner.cfg.merged_steps.then_some([2, 3]);
    let cut = match fault {
        VllmFault::DecodeCutOnce(n) => {
            let mut f = lock(&inner.fault);
            if *f == fault {
                *f = VllmFault::None;
            }
            Some(n)
        }
        _ => None,
    };
    // (tokens made, text so far, bytes of it sent, live guard, finished: totals and `[DONE]`)
    let start = (
        Vec::<u32>::new(),
        String::new(),
        0usize,
        live,
        None::<usize>,
    );
    let stream = futures_util::stream::unfold(start, move |(mut out, text, sent, live, ended)| {
        let kv = kv.clone();
        let inner = inner.clone();
        let stop = stop.clone();
        let model = model.clone();
        let prompt_ids = prompt_ids.clone();
        let next_offset = next_offset.clone();
        async move {
            let i = out.len();
            if let Some(n) = ended {
                // `[DONE]` after the totals chunk (under `include_usage`); then the end.
                if n == usize::MAX {
                    return None;
                }
                let last = if include_usage {
                    let totals = json!({
                        "id": "cmpl-mock", "object": "text_completion", "model": model, "choices": [],
                        "usage": { "prompt_tokens": prompt_tokens, "completion_tokens": n,
                                   "total_tokens": prompt_tokens + n },
                    });
                    format!("data: {totals}\n\ndata: [DONE]\n\n")
                } else {
                    "data: [DONE]\n\n".to_string()
                };
                let state = (out, text, sent, live, Some(usize::MAX));
                return Some((Ok::<_, std::io::Error>(Step::Tail(last)), state));
            }
            if hang {
                // Until the client goes away (dropping this stream drops `live`).
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(delay).await;
            if cut == Some(i) {
                return Some((
                    Err(std::io::Error::other("injected stream cut")),
                    (out, text, sent, live, Some(usize::MAX)),
                ));
            }
            let token = match lag {
                None => kv.get(i % kv.len().max(1)).copied().unwrap_or(0),
                Some(lag) => {
                    let at = (kv.len() + i).saturating_sub(lag);
                    if at < kv.len() {
                        kv.get(at).copied().unwrap_or(0)
                    } else {
                        out[at - kv.len()]
                    }
                }
            };
            out.push(token);
            // The detokenizer's text of every token so far, a character whose bytes have not
            // all come held back (`v1/engine/detokenizer.py`, incremental decoding).
            let mut text = inner.tokenizer.decode(&out, false).unwrap_or_default();
            text.truncate(text.trim_end_matches('\u{FFFD}').len());
            // `check_stop_strings`: the text is cut where the string starts.
            let (upto, finish, stop_reason) = match stop_match(&text, &stop) {
                Some((cut, s)) => {
                    text.truncate(cut);
                    (cut, json!("stop"), json!(s))
                }
                None if i + 1 == max => (text.len(), json!("length"), Value::Null),
                None => {
                    let mut upto = text.len().saturating_sub(hold).max(sent);
                    while !text.is_char_boundary(upto) {
                        upto -= 1;
                    }
                    (upto.max(sent), Value::Null, Value::Null)
                }
            };
            let delta = text
                .get(sent.min(upto)..upto)
                .unwrap_or_default()
                .to_string();
            let mut choice = json!({ "index": 0, "text": delta, "logprobs": null,
                                     "finish_reason": finish, "stop_reason": stop_reason });
            if let Some(k) = logprobs {
                let named = if fault == VllmFault::DecodeLogprobOtherToken {
                    token.wrapping_add(1)
                } else {
                    token
                };
                let name = |id: u32| {
                    if as_ids {
                        format!("token_id:{id}")
                    } else {
                        inner.tokenizer.decode(&[id], false).unwrap_or_default()
                    }
                };
                // Below every alternative: a token drawn outside the most likely.
                let lp = crate::sglang_mock::mock_logprob(token) - 2.5;
                let mut top = serde_json::Map::new();
                top.insert(name(named), json!(lp));
                for j in 0..k as u32 {
                    let above = 0.1 * (k as u32 - j) as f32;
                    top.insert(name(token.wrapping_add(1 + j)), json!(lp + above));
                }
                let offset = next_offset.fetch_add(name(named).len(), Ordering::Relaxed);
                choice["logprobs"] = json!({ "text_offset": [offset], "token_logprobs": [lp],
                                             "tokens": [name(named)], "top_logprobs": [top] });
            }
            if with_ids {
                choice["token_ids"] = json!([token]);
                if i == 0 {
                    choice["prompt_token_ids"] = json!(prompt_ids);
                }
            }
            let mut ev = json!({
                "id": "cmpl-mock", "object": "text_completion", "model": model,
                "choices": [choice],
            });
            if continuous {
                ev["usage"] = json!({ "prompt_tokens": prompt_tokens, "completion_tokens": i + 1,
                                      "total_tokens": prompt_tokens + i + 1 });
            }
            let ended = (!finish.is_null()).then_some(i + 1);
            Some((Ok(Step::Event(ev)), (out, text, upto, live, ended)))
        }
    });
    Response::builder()
        .header(http::header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from_stream(deliver(stream, merge)))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "response".into()))
}

//! Backends: one trait whose methods are the phases of a pair, one file per backend.
//!
//! A backend speaks its workers' protocol and reports protocol-level facts (status, in-band
//! aborts, prompt token counts); the pair lifecycle (`pair`, the layer above) decides what they mean.

mod body;
mod bulk;
pub mod check;
mod client;
pub mod embedded;
mod events;
pub mod lockstep;
pub mod sglang;
pub(crate) mod sglang_answer;
pub mod sglang_info;
pub(crate) mod sse;
pub mod vllm;
pub(crate) mod vllm_check;
mod vllm_logprobs;
mod vllm_params;

pub use body::ReqBody;
pub use client::{CallError, UpstreamClient};

use std::sync::Arc;

use bytes::Bytes;

use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;

use lockstep_core::config::ModelConfig;
pub use lockstep_core::generation::{
    Constraint, DecodeChunk, FinishReason, MAX_TOP_LOGPROBS, SamplingParams, TokenLogprobs,
};
pub use lockstep_core::ids::{PairId, Side};
use lockstep_routing::pool::Upstream;

/// Everything a backend needs to run both halves of one pair.
#[derive(Debug, Clone)]
pub struct Dispatch {
    /// The pair id (bootstrap room, rid).
    pub pair_id: PairId,
    /// The chosen prefill worker.
    pub prefill: Arc<Upstream>,
    /// The chosen decode worker.
    pub decode: Arc<Upstream>,
    /// Prompt token ids computed by lockstep.
    pub input_ids: Arc<[u32]>,
    /// Sampling parameters.
    pub sampling: Arc<SamplingParams>,
    /// The tenant whose request it is (`None` without tenants): the prefix-cache namespace.
    pub tenant: Option<Arc<str>>,
    /// The tenant's prefix-cache salt ([`lockstep_tenancy::tenant::Tenant::salt`]; without tenants, the
    /// one shared namespace).
    pub salt: u64,
    /// `input_ids` as a JSON array, written once for both halves ([`Dispatch::ids_json`]).
    pub ids_json: std::sync::OnceLock<Bytes>,
    /// No prefill: the decode worker serves the whole request (`prefill` is the decode worker;
    /// only for a backend that [`PdBackend::serves_alone`]).
    pub alone: bool,
}

impl Dispatch {
    /// The prompt's token ids as a JSON array (`[1,2,3]`), written on first use and shared by
    /// both halves' bodies: a long prompt's ids are the bulk of each body.
    pub fn ids_json(&self) -> &Bytes {
        self.ids_json.get_or_init(|| ids_json(&self.input_ids))
    }

    /// The prefix-cache salt of the pair's tenant: requests of one tenant share cached prompt
    /// pages, two tenants never do (requests without a tenant share one namespace).
    pub fn cache_salt(&self) -> u64 {
        self.salt
    }
}

/// Ids below this (every id of a vocabulary up to 128 Ki tokens, Llama 3's included) are
/// written from [`ID_TEXT`]; larger ones digit by digit.
const ID_TABLE_LEN: u32 = 1 << 17;

/// Each id below [`ID_TABLE_LEN`] as JSON: little-endian, its digits and a comma, then in the
/// top byte how many bytes those are (at most 7). One load and one 8-byte store per id, where
/// writing the digits out costs about seven times as much (30k ids: 28 µs against 150 µs).
static ID_TEXT: std::sync::LazyLock<Box<[u64]>> = std::sync::LazyLock::new(|| {
    (0..ID_TABLE_LEN)
        .map(|id| {
            let digits = id.to_string();
            let mut word = [0u8; 8];
            word[..digits.len()].copy_from_slice(digits.as_bytes());
            word[digits.len()] = b',';
            word[7] = digits.len() as u8 + 1;
            u64::from_le_bytes(word)
        })
        .collect()
});

/// Builds the table [`ids_json`] writes from (about 1 ms, once), so no request waits for it.
pub(crate) fn warm_ids_json() {
    std::sync::LazyLock::force(&ID_TEXT);
}

/// `ids` as a JSON array, exactly as `serde_json` writes it.
pub(crate) fn ids_json(ids: &[u32]) -> Bytes {
    let table = &**ID_TEXT;
    // Room for the longest ids (10 digits and a comma each) and one whole word past the last.
    let mut out = vec![0u8; 10 + ids.len() * 11];
    out[0] = b'[';
    let mut at = 1;
    for &id in ids {
        match table.get(id as usize) {
            Some(&word) => {
                // Bytes past the comma are overwritten by the next id or cut off below.
                out[at..at + 8].copy_from_slice(&word.to_le_bytes());
                at += (word >> 56) as usize;
            }
            None => {
                let digits = id.to_string();
                out[at..at + digits.len()].copy_from_slice(digits.as_bytes());
                out[at + digits.len()] = b',';
                at += digits.len() + 1;
            }
        }
    }
    // The last comma becomes the closing bracket (or the bracket follows `[` at once).
    let end = if ids.is_empty() { 1 } else { at - 1 };
    out[end] = b']';
    out.truncate(end + 1);
    Bytes::from(out)
}

/// A request body: `object` (a JSON object `serde_json` wrote) with `value` put first under the
/// key `head` opens (`{"input_ids":`), where `value` is JSON already written
/// ([`Dispatch::ids_json`]), so the ids are neither serialised nor copied once per half (they
/// go out as a piece of their own, [`ReqBody`]).
pub(crate) fn with_first(head: &'static str, value: &Bytes, object: &[u8]) -> ReqBody {
    with_first_owned(head, value, object.to_vec())
}

/// [`with_first`] taking the object's buffer: its `{` becomes the comma (or goes, for `{}`).
pub(crate) fn with_first_owned(head: &'static str, value: &Bytes, mut object: Vec<u8>) -> ReqBody {
    debug_assert!(head.starts_with("{\"") && head.ends_with("\":"));
    debug_assert!(object.first() == Some(&b'{') && object.last() == Some(&b'}'));
    if object.len() > 2 {
        object[0] = b',';
    } else {
        object.remove(0);
    }
    ReqBody::of(
        Bytes::from_static(head.as_bytes()),
        value.clone(),
        Bytes::from(object),
    )
}

/// What a deployment check found: the limits admission applies to the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deployment {
    /// The KV capacity one request can get: the configured one, or less where workers report
    /// less.
    pub kv_capacity: u64,
    /// The longest prompt every worker accepts, where they report one (SGLang:
    /// `max_req_input_len - 1`).
    pub max_prompt_tokens: Option<u64>,
    /// Workers the check could not reach (URL without a trailing slash, and why): they get no
    /// pairs until they answer and pass ([`check::fold_member`]).
    pub unverified: Vec<(String, String)>,
    /// The longest lease the workers report for KV waiting on a pair (lockstep workers).
    pub kv_lease_ms: Option<u64>,
    /// The workers the check verified, with what each reported: a worker checked later is
    /// checked together with them ([`check::fold_member`]).
    pub verified: Vec<check::Probed>,
}

impl Deployment {
    /// A deployment limited by its KV capacity alone.
    pub fn capacity(kv_capacity: u64) -> Deployment {
        Deployment {
            kv_capacity,
            max_prompt_tokens: None,
            unverified: Vec::new(),
            kv_lease_ms: None,
            verified: Vec::new(),
        }
    }
}

/// What the prefill half reported once it finished.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillReport {
    /// The prompt token count the prefill worker says it computed.
    pub prompt_tokens: u64,
    /// The checksum of the KV manifest the prefill sent, when the backend transfers verified KV.
    pub kv_digest: Option<u64>,
    /// Prompt tokens the worker took from its prefix cache, when it reports them (SGLang
    /// `meta_info.cached_tokens`, vLLM `usage.prompt_tokens_details.cached_tokens`).
    pub cached_tokens: Option<u64>,
    /// The prompt's log-probabilities (one per prompt token after the first), where the request
    /// asked and this backend's prefill computes them (SGLang's `input_token_logprobs`).
    pub prompt_logprobs: Option<Vec<TokenLogprobs>>,
}

/// How one half failed, as the protocol saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HalfFailure {
    /// Could not connect: nothing was sent.
    Connect(String),
    /// Error status.
    Status {
        /// HTTP status.
        status: u16,
        /// The worker's message.
        message: String,
    },
    /// A success status whose content says the request was aborted or failed.
    InBandAbort(String),
    /// The answer could not be understood.
    Protocol(String),
    /// The connection broke after the answer began.
    Transport(String),
    /// The worker found the pair's data inconsistent (a KV set that failed verification).
    Integrity(String),
}

/// A failure of one half.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HalfError {
    /// Which half.
    pub side: Side,
    /// What happened.
    pub failure: HalfFailure,
}

impl HalfError {
    /// Whether the failure is the worker's rather than the request's, so a committed stream
    /// may continue on a new pair ([`SamplingParams`] permitting): it could not be reached, its
    /// connection broke, or it answered a server error (5xx: a crash, a shutdown, an engine
    /// error). Never an integrity failure, an in-band abort (an operator's or the engine's
    /// own verdict on the request), an answer lockstep could not read, or a 4xx (the request).
    pub fn migratable(&self) -> bool {
        match &self.failure {
            HalfFailure::Connect(_) | HalfFailure::Transport(_) => true,
            HalfFailure::Status { status, .. } => *status >= 500,
            HalfFailure::InBandAbort(_) | HalfFailure::Protocol(_) | HalfFailure::Integrity(_) => {
                false
            }
        }
    }
    /// Whether retrying on a new pair is safe: the worker did no work for this request.
    pub fn retry_safe(&self) -> bool {
        matches!(
            self.failure,
            HalfFailure::Connect(_) | HalfFailure::Status { status: 503, .. }
        )
    }
}

impl HalfError {
    /// What an API client may read of this failure: its class, and the worker's own words only
    /// for a 4xx (the request's fault, worth showing); never an address or another internal
    /// detail (connect and transport errors carry the URLs lockstep dialed, verification and
    /// abort texts name hosts and ids). The whole text goes to the log and the audit.
    pub fn public_message(&self) -> String {
        let side = self.side.as_str();
        match &self.failure {
            HalfFailure::Connect(_) => format!("{side} worker unreachable"),
            HalfFailure::Transport(_) => format!("{side} worker's connection broke mid-answer"),
            HalfFailure::Protocol(_) => format!("{side} worker's answer could not be understood"),
            HalfFailure::Integrity(_) => format!("{side} worker's KV failed verification"),
            HalfFailure::InBandAbort(_) => format!("{side} worker aborted the request"),
            HalfFailure::Status { status, .. } if !(400..500).contains(status) => {
                format!("{side} worker answered {status}")
            }
            HalfFailure::Status { .. } => self.to_string(),
        }
    }
}

impl std::fmt::Display for HalfError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let side = self.side.as_str();
        match &self.failure {
            HalfFailure::Connect(m) => write!(f, "{side} worker unreachable: {m}"),
            HalfFailure::Status { status, message } => {
                write!(f, "{side} worker answered {status}: {message}")
            }
            HalfFailure::InBandAbort(m) => write!(
                f,
                "{side} worker aborted the request inside a success response: {m}"
            ),
            HalfFailure::Protocol(m) => write!(f, "{side} worker sent an unreadable answer: {m}"),
            HalfFailure::Transport(m) => write!(f, "{side} connection broke: {m}"),
            HalfFailure::Integrity(m) => write!(f, "{side} worker refused the pair's data: {m}"),
        }
    }
}

/// Decode output as a stream of chunks; the first item may be the failure to start.
pub type DecodeStream = BoxStream<'static, Result<DecodeChunk, HalfError>>;

/// What a backend's workers do that the lifecycle relies on, one value per backend
/// ([`PdBackend::capabilities`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Whether a worker that does not answer the deployment check waits, without pairs, until it
    /// answers and passes (SGLang: its KV checksum and stream mode cannot be known otherwise);
    /// otherwise it is a warning and the configured limits hold. A worker that joins at run time
    /// is always checked before it takes pairs.
    pub unreached_waits: bool,
    /// Whether an aborted half's own answer shows that the abort took (SGLang ends an aborted
    /// request's answer with `finish_reason: abort`) while dropping its connection does not
    /// release it promptly (SGLang notices a gone client only at its next 4 s check, and drops an
    /// abort for an rid it has not registered yet). Then the lifecycle keeps an aborted half's
    /// request open, sends the abort again while that answer has not ended, and drops it after
    /// `timeouts.abort_confirm_ms`. Default false: the half's request is dropped at once, which
    /// is itself the abort for vLLM, lockstep workers and the embedded engine.
    pub confirms_abort: bool,
    /// Whether the decode's first chunk always carries the prompt count it was given (SGLang's
    /// `meta_info.prompt_tokens`, vLLM's per-chunk usage, lockstep's own workers and engine):
    /// then a first chunk without one fails the pair instead of passing the count check
    /// unchecked.
    pub decode_counts_prompt: bool,
    /// Whether a decode worker can serve a request alone, with no prefill half (vLLM: a request
    /// without `kv_transfer_params` runs whole on the server it is sent to); then its first
    /// chunk's prompt count is the count the barrier checks
    /// (`decode_counts_prompt` must hold).
    pub serves_alone: bool,
    /// Whether the prefill's prefix-cache report (`cached_tokens`) can be told to a tenant's
    /// client: only where lockstep knows each tenant's cache is its own (its engine and workers
    /// key the cache by the tenant's salt themselves; vLLM 0.33 validates and applies
    /// `cache_salt`, `conformance.md` Q8). Elsewhere the count stays in the metrics.
    pub cache_report_is_tenants_own: bool,
    /// Whether the halves' bodies carry the ids as JSON ([`Dispatch::ids_json`]): then a long
    /// prompt's JSON is written at admission, on the low-priority pool, not on the pair's thread.
    pub ids_as_json: bool,
}

impl Default for Capabilities {
    /// lockstep's own engine and workers: nothing waits unchecked, a dropped half is aborted,
    /// the decode always reports its prompt count, no decode serves alone, each tenant's cache
    /// is its own, the ids travel as protobuf.
    fn default() -> Self {
        Capabilities {
            unreached_waits: false,
            confirms_abort: false,
            decode_counts_prompt: true,
            serves_alone: false,
            cache_report_is_tenants_own: true,
            ids_as_json: false,
        }
    }
}

/// A disaggregated backend, shaped as the phases of a model's life and of each pair (Pingora's
/// `ProxyHttp` style: the driver, `pair::ModelPairs`, owns the order, the deadlines,
/// the commit barrier, abort-both and retries; an implementation reports protocol facts).
pub trait PdBackend: Send + Sync + 'static {
    /// **Before the model serves** (start, every reload, `lockstep check`): the deployment check
    /// (invariant 6) against what the workers of `m` report, smaller of the reported and the
    /// configured capacity. No pair exists yet. Returns what admission will use, or every problem
    /// found (the model does not serve). Default: every worker through
    /// [`PdBackend::probe_worker`], the set through the one fold ([`check::check`]).
    fn deployment<'a>(&'a self, m: &'a ModelConfig) -> BoxFuture<'a, Result<Deployment, String>> {
        Box::pin(check::check(self, m))
    }
    /// What one worker of `m` (on `side`) reports about itself: the KV capacity one request can
    /// get, its prompt limit, the facts every worker must share (SGLang: role, KV checksum,
    /// layouts, stream mode; vLLM: served model, block size; lockstep workers: role, model
    /// fingerprint). Used by the deployment check and for every worker checked later (one that
    /// did not answer at start, one that joins the pool at run time). Default: nothing to ask.
    fn probe_worker<'a>(
        &'a self,
        _m: &'a ModelConfig,
        _side: Side,
        _w: &'a lockstep_core::config::WorkerConfig,
    ) -> BoxFuture<'a, Result<check::WorkerReport, check::ProbeError>> {
        Box::pin(std::future::ready(Ok(check::WorkerReport::default())))
    }
    /// What this backend's workers do that the lifecycle relies on ([`Capabilities`]). Default:
    /// lockstep's own engine and workers.
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }
    /// **Phase 1, after admission**: the pair is registered, both workers are chosen and
    /// [`PdBackend::decode`] was started alongside. Runs the prefill half to completion and
    /// reports what the worker said it computed; nothing has reached the client.
    fn prefill(&self, d: &Dispatch) -> BoxFuture<'static, Result<PrefillReport, HalfError>>;
    /// **Phase 1, alongside the prefill**: starts the decode half. Its chunks are held by the
    /// lifecycle until the commit barrier passes (prefill verified, counts and digests agree);
    /// the stream is dropped, unread, when the pair aborts.
    fn decode(&self, d: &Dispatch) -> DecodeStream;
    /// **On any failure of the pair** (either half, a deadline, the client leaving): tells one
    /// half's worker to release what it holds for the pair. Called for both halves, in the
    /// background, bounded by `timeouts.abort_ms`; the client's error never waits for it.
    fn abort(&self, d: &Dispatch, side: Side) -> BoxFuture<'static, Result<(), HalfError>>;
    /// Forgets what the backend keeps for the worker at `url`, one that left its pool (a pod
    /// gone): its connection, the settings its check verified. Per-URL state then grows with
    /// the pool, not with its churn; a worker that comes back is checked again. Default: none
    /// kept.
    fn forget(&self, _url: &str) {}
    /// Whether a committed stream of this request can continue on a new pair whose prompt is
    /// the request's prompt and the tokens delivered: the decode's chunks must carry their
    /// token ids (checked per chunk by the lifecycle), and what the new pair generates must go
    /// on as the old one's would have. Default (SGLang and vLLM): requests without an output
    /// constraint (neither can start a grammar from a state other than its root), a seed (the
    /// draws would start over) or a penalty (it would not count the delivered tokens).
    fn resumes(&self, sampling: &SamplingParams) -> bool {
        let off = |p: Option<f64>| p.is_none_or(|p| p == 0.0);
        sampling.constraint.is_none()
            && sampling.sampling_seed.is_none()
            && off(sampling.frequency_penalty)
            && off(sampling.presence_penalty)
    }
    /// Whether the worker at `url` is healthy (the health loop's probe). Default: `GET
    /// {url}/health` through the upstream client, answered 2xx within `timeout`.
    fn health(
        &self,
        client: &UpstreamClient,
        url: &str,
        timeout: std::time::Duration,
    ) -> BoxFuture<'static, bool> {
        let (client, url) = (client.clone(), url.to_string());
        Box::pin(async move { client.health(&url, timeout).await })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    #[test]
    fn ids_are_written_as_serde_json_writes_them() {
        let mut x = 1u64;
        let ids: Vec<u32> = (0..2000)
            .map(|i| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                if i % 7 == 0 {
                    u32::MAX
                } else {
                    (x >> 40) as u32 >> (i % 24)
                }
            })
            .collect();
        for n in [0, 1, 2, ids.len()] {
            let want = serde_json::to_vec(&ids[..n]).expect("json");
            assert_eq!(&super::ids_json(&ids[..n])[..], &want[..]);
        }
    }

    #[test]
    fn every_id_of_the_table_and_past_it_is_written_as_serde_json_writes_it() {
        let ids: Vec<u32> = (0..super::ID_TABLE_LEN + 1000).rev().collect();
        let want = serde_json::to_vec(&ids).expect("json");
        assert_eq!(&super::ids_json(&ids)[..], &want[..]);
        for id in [
            0,
            9,
            10,
            super::ID_TABLE_LEN - 1,
            super::ID_TABLE_LEN,
            u32::MAX,
        ] {
            let want = serde_json::to_vec(&[id]).expect("json");
            assert_eq!(&super::ids_json(&[id])[..], &want[..], "{id}");
        }
    }

    #[test]
    fn the_value_put_first_leaves_the_rest_of_the_object_as_it_was() {
        let ids = super::ids_json(&[5, 6]);
        let rest = serde_json::to_vec(&json!({ "a": 1, "b": { "c": [2] } })).expect("json");
        let body = super::with_first(r#"{"input_ids":"#, &ids, &rest).to_bytes();
        let v: Value = serde_json::from_slice(&body).expect("valid JSON");
        assert_eq!(v, json!({ "input_ids": [5, 6], "a": 1, "b": { "c": [2] } }));
        assert!(body.starts_with(b"{\"input_ids\":[5,6],"));
        let alone = super::with_first(r#"{"prompt":"#, &ids, b"{}").to_bytes();
        assert_eq!(&alone[..], b"{\"prompt\":[5,6]}");
    }
}

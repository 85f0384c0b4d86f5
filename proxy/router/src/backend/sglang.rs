//! SGLang PD backend: the native `/generate` API with `input_ids` computed by lockstep,
//! `rid`/`bootstrap_*` set by lockstep, and `/abort_request` on both halves.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::Method;
use serde_json::{Value, json};

use super::check::{ProbeError, WorkerReport};
use super::client::{CallError, UpstreamClient};
use super::sglang_answer::Answer;
use super::sglang_info::StreamMode;
use super::sse::{ChunkSource, SseReader, decode_stream};
use super::{
    Constraint, DecodeChunk, DecodeStream, Dispatch, FinishReason, HalfError, HalfFailure,
    PdBackend, PrefillReport, Side,
};
use lockstep_core::config::ModelConfig;

/// Talks to SGLang prefill and decode workers.
#[derive(Debug, Clone)]
pub struct SglangBackend {
    client: UpstreamClient,
    /// Each probed decode worker's stream mode, by URL (a worker gets pairs only once its probe
    /// passed the deployment check; one never probed has none, and its stream fails closed).
    stream_modes: Arc<RwLock<HashMap<String, StreamMode>>>,
}

/// What SGLang's decode says when the KV it received does not match the prefill's checksum
/// (`srt/disaggregation/decode.py`, `_handle_kv_checksum_mismatch`).
const KV_CHECKSUM_MISMATCH: &str = "KV checksum mismatch";

impl SglangBackend {
    /// A backend over the shared upstream client.
    pub fn new(client: UpstreamClient) -> SglangBackend {
        SglangBackend {
            client,
            stream_modes: Arc::default(),
        }
    }

    fn stream_mode(&self, decode_url: &str) -> Option<StreamMode> {
        let modes = self.stream_modes.read().unwrap_or_else(|p| p.into_inner());
        modes.get(decode_url).copied()
    }

    /// The `/generate` body of one half. Client-sent routing fields never reach here: lockstep
    /// builds the whole body.
    pub fn generate_body(d: &Dispatch, stream: bool) -> super::ReqBody {
        let s = &d.sampling;
        let (json_schema, regex, ebnf) = match &s.constraint {
            None => (None, None, None),
            // What SGLang's own OpenAI layer sends for json_object
            // (`srt/entrypoints/openai/protocol.py`, `to_sampling_params`).
            Some(Constraint::JsonObject) => (Some(r#"{"type": "object"}"#), None, None),
            Some(Constraint::JsonSchema(t)) => (Some(t.as_str()), None, None),
            Some(Constraint::Regex(r)) => (None, Some(r.as_str()), None),
            Some(Constraint::Ebnf(g) | Constraint::Lark(g)) => (None, None, Some(g.as_str())),
        };
        let body = GenerateBody {
            sampling_params: SglangSampling {
                base: s,
                choice_seed: (s.sampling_seed.is_none() && s.choice > 0)
                    .then(|| UNSEEDED + u64::from(s.choice)),
                json_schema,
                regex,
                ebnf,
            },
            rid: d.pair_id.rid_text(),
            bootstrap_host: &d.prefill.bootstrap_host,
            bootstrap_port: d.prefill.bootstrap_port,
            bootstrap_room: d.pair_id.raw(),
            cache_salt: SaltText(d.cache_salt()),
            stream,
            // On both halves: SGLang's prefill computes the first token's entry and sends it
            // with the KV (`srt/disaggregation/utils.py`), the decode the rest.
            return_logprob: s.logprobs.map(|_| true),
            top_logprobs_num: s.logprobs,
            // The prompt's log-probabilities are the prefill's (it runs the prompt; the decode
            // gets its KV): asked of the prefill half, the one not streamed.
            logprob_start_len: s.prompt_logprobs.filter(|_| !stream).map(|_| 0),
        };
        // One buffer, large enough for the usual body, and no copy after.
        let mut rest = Vec::with_capacity(384);
        // Writing to a Vec fails only for a type that refuses to serialize: none here.
        let _ = serde_json::to_writer(&mut rest, &body);
        super::with_first_owned(r#"{"input_ids":"#, d.ids_json(), rest)
    }
}

/// The seed SGLang gives an unseeded request when it runs `--enable-deterministic-inference`
/// (0.5.23 `srt/sampling/sampling_batch_info.py`; without that flag it samples unseeded and
/// ignores `sampling_seed`). Every unseeded choice of a request for several would be one answer
/// there, so choice `i` > 0 is sent `UNSEEDED + i`: the first keeps SGLang's own seed, and the
/// others move on from it as a client's seed moves on by the choice's index.
const UNSEEDED: u64 = 42;

/// SGLang's `sampling_params`: the common ones plus the constraint, in SGLang's keys (on both
/// halves: SGLang's prefill samples the first token).
#[derive(serde::Serialize)]
struct SglangSampling<'a> {
    #[serde(flatten)]
    base: &'a super::SamplingParams,
    /// A further choice's own seed where the request has none ([`UNSEEDED`]).
    #[serde(rename = "sampling_seed", skip_serializing_if = "Option::is_none")]
    choice_seed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    json_schema: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    regex: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ebnf: Option<&'a str>,
}

/// The native `/generate` body of one half, but for its `input_ids` (put first, written once
/// for both halves: [`Dispatch::ids_json`]).
#[derive(serde::Serialize)]
struct GenerateBody<'a> {
    sampling_params: SglangSampling<'a>,
    /// The pair id as SGLang's `rid` ([`lockstep_core::ids::PairId::rid`]).
    rid: lockstep_core::ids::RidText,
    bootstrap_host: &'a str,
    bootstrap_port: Option<u16>,
    /// The pair id as the integer SGLang expects.
    bootstrap_room: u64,
    /// The tenant's prefix-cache namespace (SGLang 0.5.23 `GenerateReqInput.cache_salt`,
    /// `srt/managers/io_struct.py`: "cache namespace used to isolate otherwise-identical
    /// prefixes"), the same on both halves, so one tenant's prompt never hits another's radix
    /// cache on either worker.
    cache_salt: SaltText,
    stream: bool,
    /// Log-probabilities with every output token (`GenerateReqInput.return_logprob`); the
    /// default `logprob_start_len` computes none for the prompt.
    #[serde(skip_serializing_if = "Option::is_none")]
    return_logprob: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_logprobs_num: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    logprob_start_len: Option<u32>,
}

/// A cache salt as its 16 hex digits, a JSON string written straight into the body.
struct SaltText(u64);

impl serde::Serialize for SaltText {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&format_args!("{:016x}", self.0))
    }
}

/// Extracts a worker's error message from an error body (SGLang: `{"error":{"message"}}` or
/// `{"object":"error","message"}`), falling back to the raw text.
pub(crate) fn error_message(body: &[u8]) -> String {
    let v: Option<Value> = serde_json::from_slice(body).ok();
    v.as_ref()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("message"))
                .or_else(|| v.get("error"))
        })
        .map(|m| {
            m.as_str()
                .map(str::to_string)
                .unwrap_or_else(|| m.to_string())
        })
        .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(256)]).into_owned())
}

/// A worker's refusal: an integrity failure when SGLang's KV checksum caught a corrupted
/// transfer, an in-band abort otherwise.
fn refusal(message: String) -> HalfFailure {
    if message.starts_with(KV_CHECKSUM_MISMATCH) {
        HalfFailure::Integrity(format!(
            "SGLang's KV checksum caught a corrupted transfer: {message}"
        ))
    } else {
        HalfFailure::InBandAbort(message)
    }
}

/// A non-2xx answer: its status, or the integrity failure it reports.
fn status_failure(status: u16, body: &[u8]) -> HalfFailure {
    let message = error_message(body);
    match refusal(message) {
        HalfFailure::InBandAbort(message) => HalfFailure::Status { status, message },
        integrity => integrity,
    }
}

/// Checks one `/generate` answer for an in-band failure; returns its finish reason.
pub(crate) fn inspect(side: Side, v: &Answer) -> Result<Option<FinishReason>, HalfError> {
    let fail = |m: String| HalfError {
        side,
        failure: refusal(m),
    };
    if let Some(err) = &v.error {
        return Err(fail(err.to_string()));
    }
    let Some(meta) = &v.meta_info else {
        return Err(HalfError {
            side,
            failure: HalfFailure::Protocol("no meta_info".into()),
        });
    };
    match &meta.finish_reason {
        None => Ok(None),
        Some(fr) => {
            let kind = fr.kind.as_deref().unwrap_or("");
            match kind {
                "stop" => Ok(Some(FinishReason::Stop)),
                "length" => Ok(Some(FinishReason::Length)),
                "abort" => Err(fail(
                    fr.message
                        .as_deref()
                        .unwrap_or("finish_reason abort")
                        .to_string(),
                )),
                other => Err(HalfError {
                    side,
                    failure: HalfFailure::Protocol(format!("unknown finish_reason `{other}`")),
                }),
            }
        }
    }
}

/// What a prefill's final (non-stream) answer reports, failing closed: it must be a finished
/// request (SGLang 0.5.23 always sets `meta_info.finish_reason` on a finished request,
/// `srt/managers/schedule_batch.py`; the prefill of a PD pair finishes with `length`), with no
/// in-band abort, a prompt count, and, where it names one, this pair's rid (`meta_info.id`).
pub(crate) fn prefill_report(v: &Answer, rid: &str) -> Result<PrefillReport, HalfError> {
    let side = Side::Prefill;
    let protocol = |m: String| HalfError {
        side,
        failure: HalfFailure::Protocol(m),
    };
    if inspect(side, v)?.is_none() {
        return Err(protocol(
            "the prefill's answer has no finish_reason: not a finished request".into(),
        ));
    }
    if let Some(id) = v.meta_info.as_ref().and_then(|m| m.id.as_deref())
        && id != rid
    {
        return Err(protocol(format!(
            "the prefill answered for request `{id}`, not this pair's `{rid}`"
        )));
    }
    let prompt_tokens = v
        .meta(|m| m.prompt_tokens)
        .ok_or_else(|| protocol("no meta_info.prompt_tokens".into()))?;
    Ok(PrefillReport {
        prompt_tokens,
        kv_digest: None,
        cached_tokens: v.meta(|m| m.cached_tokens),
        prompt_logprobs: None,
    })
}

impl PdBackend for SglangBackend {
    fn capabilities(&self) -> super::Capabilities {
        super::Capabilities {
            // An SGLang worker that does not answer cannot be known to checksum its KV or to
            // stream as lockstep reads it: no pairs until it answers and passes.
            unreached_waits: true,
            // SGLang namespaces its radix cache by `cache_salt`, but nothing lockstep checks
            // proves a given deployment does (a build without it would mix tenants' prefixes
            // and report the hits): its `cached_tokens` go to the metrics, not to clients
            // (second security review).
            cache_report_is_tenants_own: false,
            ids_as_json: true,
            confirms_abort: true,
            ..super::Capabilities::default()
        }
    }

    fn forget(&self, url: &str) {
        let mut modes = self.stream_modes.write().unwrap_or_else(|p| p.into_inner());
        modes.remove(url);
    }

    /// `/server_info` ([`super::sglang_info`]); a decode worker's stream mode is kept for its
    /// streams.
    fn probe_worker<'a>(
        &'a self,
        m: &'a ModelConfig,
        side: Side,
        w: &'a lockstep_core::config::WorkerConfig,
    ) -> BoxFuture<'a, Result<WorkerReport, ProbeError>> {
        Box::pin(async move {
            let (report, mode) = super::sglang_info::probe_worker(&self.client, m, side, w).await?;
            if let Some(mode) = mode {
                let mut modes = self.stream_modes.write().unwrap_or_else(|p| p.into_inner());
                modes.insert(w.url.trim_end_matches('/').to_string(), mode);
            }
            Ok(report)
        })
    }

    fn prefill(&self, d: &Dispatch) -> BoxFuture<'static, Result<PrefillReport, HalfError>> {
        let client = self.client.clone();
        let target = d.prefill.endpoint("/generate");
        let body = Self::generate_body(d, false);
        let trace = d
            .prefill
            .headers(lockstep_runtime::telemetry::trace_headers(), false);
        let rid = d.pair_id.rid();
        let scored = d.sampling.prompt_logprobs.map(|k| (k, d.input_ids.clone()));
        Box::pin(async move {
            let side = Side::Prefill;
            let target = target.map_err(|m| CallError::Connect(m).of(side))?;
            let (status, body) = client
                .post_collect_to(&target, body, &trace)
                .await
                .map_err(|e| e.of(side))?;
            if !(200..300).contains(&status) {
                return Err(HalfError {
                    side,
                    failure: status_failure(status, &body),
                });
            }
            let answer = Answer::parse(side, &body, "not JSON")?;
            let mut report = prefill_report(&answer, &rid)?;
            if let Some((k, ids)) = scored {
                report.prompt_logprobs = Some(answer.prompt_logprobs(&ids, k)?);
            }
            Ok(report)
        })
    }

    fn decode(&self, d: &Dispatch) -> DecodeStream {
        let client = self.client.clone();
        let target = d.decode.endpoint("/generate");
        let body = Self::generate_body(d, true);
        let trace = d
            .decode
            .headers(lockstep_runtime::telemetry::trace_headers(), false);
        let mode = self.stream_mode(&d.decode.url);
        let logprobs = d.sampling.logprobs;
        let start = async move {
            let side = Side::Decode;
            let mode = mode.ok_or_else(|| HalfError {
                side,
                failure: HalfFailure::Protocol(
                    "the decode worker's stream mode was not verified at the deployment check"
                        .into(),
                ),
            })?;
            let target = target.map_err(|m| CallError::Connect(m).of(side))?;
            let resp = client
                .send_to(Method::POST, &target, body, &trace)
                .await
                .map_err(|e| e.of(side))?;
            let status = resp.status().as_u16();
            if !(200..300).contains(&status) {
                let body = super::client::collect_bounded(resp.into_body())
                    .await
                    .unwrap_or_default();
                return Err(HalfError {
                    side,
                    failure: status_failure(status, &body),
                });
            }
            Ok(SseDecoder {
                events: SseReader::new(resp.into_body(), side),
                text: StreamText::new(mode),
                logprobs,
            })
        };
        decode_stream(start)
    }

    fn abort(&self, d: &Dispatch, side: Side) -> BoxFuture<'static, Result<(), HalfError>> {
        let client = self.client.clone();
        let worker = match side {
            Side::Prefill => &d.prefill,
            Side::Decode => &d.decode,
        };
        let url = format!("{}/abort_request", worker.url);
        let body = Bytes::from(json!({ "rid": d.pair_id.rid() }).to_string());
        let headers = worker.headers(Vec::new(), true);
        Box::pin(async move {
            let (status, body) = client
                .post_collect_with(&url, body, &headers)
                .await
                .map_err(|e| e.of(side))?;
            if (200..300).contains(&status) {
                Ok(())
            } else {
                Err(HalfError {
                    side,
                    failure: HalfFailure::Status {
                        status,
                        message: error_message(&body),
                    },
                })
            }
        })
    }
}

/// Turns SGLang's SSE stream (`data: {text, output_ids, meta_info}` events, then `data: [DONE]`)
/// into text deltas. The text is cumulative by default and disjoint deltas with
/// `--incremental-streaming-output` (SGLang 0.5.23 `srt/managers/tokenizer_manager.py`,
/// `_handle_batch_output`); the mode comes from the worker's `/server_info`, and every event's
/// `output_ids` are checked against `meta_info.completion_tokens` (cumulative in both modes), so
/// a worker restarted in the other mode fails the pair instead of garbling its text.
struct SseDecoder {
    events: SseReader,
    text: StreamText,
    /// The alternatives asked for with each token, when log-probabilities were.
    logprobs: Option<u32>,
}

/// The text and ids a decode stream has delivered so far, in its worker's stream mode.
struct StreamText {
    mode: StreamMode,
    text_len: usize,
    ids_seen: u64,
    /// Log-probability entries already delivered. SGLang's output-side lists follow the stream
    /// mode: cumulative by default, only the event's own entries with
    /// `--incremental-streaming-output` (0.5.23 `tokenizer_manager.py`
    /// `_slice_streaming_output_meta_info`, and `_coalesce_streaming_chunks` concatenating
    /// them when events queue up).
    logprobs_seen: usize,
}

impl StreamText {
    fn new(mode: StreamMode) -> StreamText {
        StreamText {
            mode,
            text_len: 0,
            ids_seen: 0,
            logprobs_seen: 0,
        }
    }

    /// The entries of an event's new tokens `ids` (`k` alternatives each): each must name the
    /// token it belongs to, and every new token must have one, or the event is not this answer's.
    fn logprobs(
        &mut self,
        v: &Answer,
        ids: &[u32],
        k: u32,
    ) -> Result<Vec<super::TokenLogprobs>, String> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let meta = v.meta_info.as_ref();
        let all = meta
            .and_then(|m| m.output_token_logprobs.as_deref())
            .unwrap_or_default();
        let tops = meta.and_then(|m| m.output_top_logprobs.as_deref());
        // Where this event's entries start in its lists: past the ones delivered when the lists
        // are cumulative; at 0 when they hold this event's alone, which must be exactly one per
        // new token.
        let from = match self.mode {
            StreamMode::Cumulative => self.logprobs_seen,
            StreamMode::Incremental => {
                if all.len() != ids.len() {
                    return Err(format!(
                        "{} output_token_logprobs for an incremental event of {} output tokens",
                        all.len(),
                        ids.len()
                    ));
                }
                0
            }
        };
        let new = all.get(from..from + ids.len()).ok_or_else(|| {
            format!(
                "{} output_token_logprobs for {} output tokens",
                all.len(),
                from + ids.len()
            )
        })?;
        let mut out = Vec::with_capacity(ids.len());
        for (i, (e, &id)) in new.iter().zip(ids).enumerate() {
            if e.1 != id {
                return Err(format!(
                    "output_token_logprobs names token {} where the output has {id}",
                    e.1
                ));
            }
            let top = match (k, tops) {
                (0, _) => Vec::new(),
                (_, Some(t)) => t
                    .get(from + i)
                    .and_then(Option::as_deref)
                    .ok_or("output_top_logprobs is shorter than the output")?
                    .iter()
                    .map(|t| (t.1, t.logprob()))
                    .collect(),
                (_, None) => return Err("output_top_logprobs is missing".into()),
            };
            out.push(super::TokenLogprobs {
                logprob: e.logprob(),
                top,
            });
        }
        self.logprobs_seen += ids.len();
        Ok(out)
    }

    /// The new text and token ids of one event, after checking its ids against the mode.
    fn delta(&mut self, v: &Answer) -> Result<(String, Vec<u32>), String> {
        let text = v.text.as_deref().unwrap_or("");
        let completion = v.meta(|m| m.completion_tokens);
        let mut new_ids = Vec::new();
        if let (Some(ids), Some(completion)) = (&v.output_ids, completion) {
            let n = ids.len() as u64;
            let total = match self.mode {
                StreamMode::Cumulative => n,
                StreamMode::Incremental => self.ids_seen + n,
            };
            // An abort event carries no ids; only a count that moved must match.
            if completion > 0 && total != completion {
                return Err(format!(
                    "{n} output_ids with completion_tokens {completion} do not fit the {:?} stream mode the worker reported",
                    self.mode
                ));
            }
            if completion > 0 {
                new_ids = match self.mode {
                    StreamMode::Incremental => ids.clone(),
                    // Cumulative: the ids past the ones already seen.
                    StreamMode::Cumulative => ids
                        .get(self.ids_seen as usize..)
                        .unwrap_or_default()
                        .to_vec(),
                };
                self.ids_seen = total;
            }
        }
        let delta = match self.mode {
            StreamMode::Incremental => text.to_string(),
            StreamMode::Cumulative => {
                if text.len() >= self.text_len && text.is_char_boundary(self.text_len) {
                    let delta = text[self.text_len..].to_string();
                    self.text_len = text.len();
                    delta
                } else {
                    return Err("streamed text is not cumulative".into());
                }
            }
        };
        Ok((delta, new_ids))
    }
}

impl ChunkSource for SseDecoder {
    async fn next_chunk(&mut self) -> Result<Option<DecodeChunk>, HalfError> {
        let side = Side::Decode;
        let Some(data) = self.events.next_data().await? else {
            return Ok(None);
        };
        let v = Answer::parse(side, data.as_bytes(), "bad SSE event")?;
        let finish = inspect(side, &v)?;
        let protocol = |m| HalfError {
            side,
            failure: HalfFailure::Protocol(m),
        };
        let (delta, token_ids) = self.text.delta(&v).map_err(protocol)?;
        let logprobs = match self.logprobs {
            Some(k) => self.text.logprobs(&v, &token_ids, k).map_err(protocol)?,
            None => Vec::new(),
        };
        Ok(Some(DecodeChunk {
            kv_digest: None,
            delta,
            token_ids,
            prompt_tokens: v.meta(|m| m.prompt_tokens),
            completion_tokens: v.meta(|m| m.completion_tokens).unwrap_or(0),
            // SGLang's `finish_reason.matched`: the stop string (a token id otherwise).
            matched_stop: finish
                .and(v.meta_info.as_ref())
                .and_then(|m| m.finish_reason.as_ref())
                .and_then(|f| f.matched.clone()),
            finish,
            logprobs,
            prompt_logprobs: None,
        }))
    }
}

#[cfg(test)]
#[path = "sglang_tests.rs"]
mod tests;

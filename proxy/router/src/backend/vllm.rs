//! vLLM disaggregated serving (NixlConnector, MooncakeConnector) as a backend.
//!
//! vLLM's protocol is sequential: the prefill half gets the request with `max_tokens = 1`,
//! `stream = false` and `kv_transfer_params = {do_remote_decode: true, ...}`; its answer's
//! `kv_transfer_params` (remote block ids, engine id, host, port) go into the decode half's
//! request; both halves carry the same `X-Request-Id`. lockstep builds every field itself from
//! the token ids it computed (client-sent `kv_transfer_params` and `cache_salt` never pass) and
//! sets `cache_salt` from the tenant.
//!
//! The lifecycle starts both halves at once; here the decode half waits for the prefill's
//! verdict and is **never sent** unless the prefill answered 2xx, with no error object, a normal
//! finish, `usage.prompt_tokens` equal to lockstep's count, and well-formed transfer params (block
//! count consistent with the token count and block size, no duplicate ids). vLLM has no abort
//! endpoint: closing the connection aborts a running request, and the lifecycle drops a failed
//! pair's connections. Blocks a prefill holds for a decode that will not come are freed by vLLM
//! 0.33 when their KV lease runs out (`kv_connector_extra_config.kv_lease_duration`, 30 s,
//! extended by the decode's heartbeats once it has the request; `nixl/base_scheduler.py`):
//! that bounds the leak. The same lease bounds how late a decode may be sent: past it the blocks
//! may already hold another request's KV with every count still right, so lockstep refuses to
//! send a decode later than `vllm.kv_lease_ms` less a margin after the prefill answered.

use std::sync::Arc;

use dashmap::DashMap;
use futures_util::future::BoxFuture;
use http::Method;
use serde_json::{Value, json};
use tokio::sync::watch;

use super::client::UpstreamClient;
use super::sse::{ChunkSource, SseReader, decode_stream};
use super::vllm_logprobs::chunk_logprobs;
use super::{
    Constraint, DecodeChunk, DecodeStream, Dispatch, FinishReason, HalfError, HalfFailure,
    PdBackend, PrefillReport, Side,
};
use lockstep_core::config::ModelConfig;
use lockstep_core::config::{VllmConnector, VllmSection};
use lockstep_core::ids::PairId;

/// The prefill's verdict, as the decode half waits for it.
#[derive(Debug, Clone)]
enum Handoff {
    Waiting,
    /// The checked transfer params, and when the prefill answered: send the decode.
    Go(Arc<Value>, std::time::Instant),
    /// The prefill failed or its answer was refused: the decode is never sent.
    NoGo,
}

/// Talks to vLLM prefill and decode servers.
#[derive(Debug, Clone)]
pub struct VllmBackend {
    client: UpstreamClient,
    cfg: VllmSection,
    served_model: String,
    handoffs: Arc<DashMap<PairId, watch::Sender<Handoff>>>,
}

impl VllmBackend {
    /// A backend for `model` over the shared upstream client.
    pub fn new(client: UpstreamClient, model: &str, cfg: VllmSection) -> VllmBackend {
        let served_model = cfg
            .served_model_name
            .clone()
            .unwrap_or_else(|| model.to_string());
        VllmBackend {
            client,
            cfg,
            served_model,
            handoffs: Arc::default(),
        }
    }

    fn handoff(&self, id: PairId) -> watch::Sender<Handoff> {
        self.handoffs
            .entry(id)
            .or_insert_with(|| watch::channel(Handoff::Waiting).0)
            .clone()
    }

    /// The `/v1/completions` body of one half: token ids, sampling, lockstep's transfer params and
    /// the tenant's cache salt. Nothing of the client's body reaches it.
    fn body(&self, d: &Dispatch, prefill: bool, kv: Value) -> super::ReqBody {
        let s = &d.sampling;
        let mut b = json!({
            "model": self.served_model,
            "max_tokens": if prefill { 1 } else { s.max_new_tokens },
            "stream": !prefill,
            "kv_transfer_params": kv,
            "cache_salt": format!("{:016x}", d.cache_salt()),
        });
        if kv.is_null() {
            // A decode serving alone: no transfer.
            if let Some(o) = b.as_object_mut() {
                o.remove("kv_transfer_params");
            }
        }
        if !prefill {
            b["stream_options"] = json!({ "include_usage": true, "continuous_usage_stats": true });
            // Each chunk's token ids (`choices[].token_ids`, the chunk's own; vLLM 0.33
            // `entrypoints/openai/completion/serving.py`), so a migration can carry what was
            // delivered.
            b["return_token_ids"] = Value::Bool(true);
            // Log-probabilities come from the decode, which samples every output token (the
            // prefill's one token is not part of the answer); each entry's tokens as
            // `token_id:N` (`entrypoints/generate/base/serving.py`
            // `format_token_id_placeholder`), so lockstep checks them against the ids.
            if let Some(k) = s.logprobs {
                b["logprobs"] = Value::from(k);
                b["return_tokens_as_token_ids"] = Value::Bool(true);
            }
        } else if let Some(k) = s.prompt_logprobs {
            // The prompt's are the prefill's: it runs the prompt, the decode reads its KV.
            b["prompt_logprobs"] = Value::from(k);
        }
        let opt = [
            ("temperature", s.temperature.map(Value::from)),
            ("top_p", s.top_p.map(Value::from)),
            ("top_k", s.top_k.map(Value::from)),
            ("seed", s.sampling_seed.map(Value::from)),
            ("ignore_eos", s.ignore_eos.map(Value::from)),
            ("frequency_penalty", s.frequency_penalty.map(Value::from)),
            ("presence_penalty", s.presence_penalty.map(Value::from)),
            (
                "stop",
                (!s.stop.is_empty()).then(|| Value::from(s.stop.clone())),
            ),
        ];
        for (k, v) in opt {
            if let Some(v) = v {
                b[k] = v;
            }
        }
        // vLLM 0.33's `structured_outputs` (`StructuredOutputsParams`, `vllm/sampling_params.py`),
        // on both halves.
        if let Some(c) = &s.constraint {
            b["structured_outputs"] = match c {
                Constraint::JsonObject => json!({ "json_object": true }),
                Constraint::JsonSchema(t) => {
                    json!({ "json": serde_json::from_str::<Value>(t).unwrap_or(Value::Null) })
                }
                Constraint::Regex(r) => json!({ "regex": r }),
                Constraint::Ebnf(g) | Constraint::Lark(g) => json!({ "grammar": g }),
            };
        }
        // The prompt's ids go first, written once for both halves.
        super::with_first(
            r#"{"prompt":"#,
            d.ids_json(),
            &serde_json::to_vec(&b).unwrap_or_default(),
        )
    }

    /// What the prefill half asks for.
    fn prefill_params(&self) -> Value {
        match self.cfg.connector {
            VllmConnector::Nixl => json!({
                "do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                "remote_block_ids": null, "remote_host": null, "remote_port": null,
            }),
            VllmConnector::Mooncake => json!({ "do_remote_decode": true }),
        }
    }
}

/// A half's extra headers: its trace context and `X-Request-Id` (the pair id, on both halves).
fn half_headers(id: PairId) -> Vec<(http::HeaderName, http::HeaderValue)> {
    let mut h = lockstep_runtime::telemetry::trace_headers();
    if let Ok(v) = http::HeaderValue::from_str(&id.to_string()) {
        h.push((http::HeaderName::from_static("x-request-id"), v));
    }
    h
}

/// vLLM's error bodies: `{"object":"error","message"}` or `{"error":{"message"}}`.
pub(crate) fn error_in(v: &Value) -> Option<String> {
    if v.get("object").and_then(Value::as_str) == Some("error") {
        return Some(
            v.get("message")
                .and_then(Value::as_str)
                .unwrap_or("error")
                .to_string(),
        );
    }
    v.get("error").filter(|e| !e.is_null()).map(|e| {
        e.get("message")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| e.to_string())
    })
}

/// A choice's finish reason; `abort` or anything unknown is a failure.
pub(crate) fn finish_of(side: Side, c: &Value) -> Result<Option<FinishReason>, HalfError> {
    match c.get("finish_reason") {
        None | Some(Value::Null) => Ok(None),
        Some(f) => match f.as_str() {
            Some("stop") => Ok(Some(FinishReason::Stop)),
            Some("length") => Ok(Some(FinishReason::Length)),
            other => Err(HalfError {
                side,
                failure: HalfFailure::InBandAbort(format!(
                    "finish_reason {}",
                    other.unwrap_or("(not a string)")
                )),
            }),
        },
    }
}

pub(crate) fn usage(v: &Value, key: &str) -> Option<u64> {
    v.get("usage")
        .and_then(|u| u.get(key))
        .and_then(Value::as_u64)
}

impl PdBackend for VllmBackend {
    fn capabilities(&self) -> super::Capabilities {
        // lockstep asks the decode for `stream_options.continuous_usage_stats`, so vLLM 0.33 puts
        // `usage` (with `prompt_tokens`) on every chunk (`entrypoints/openai/completion/
        // serving.py`): the decode counts its prompt. A request without `kv_transfer_params`
        // runs whole on the decode server, whose usage still says what it computed.
        super::Capabilities {
            ids_as_json: true,
            serves_alone: true,
            ..super::Capabilities::default()
        }
    }

    /// `/v1/models` and `/metrics` ([`super::vllm_check`]).
    fn probe_worker<'a>(
        &'a self,
        m: &'a ModelConfig,
        side: Side,
        w: &'a lockstep_core::config::WorkerConfig,
    ) -> BoxFuture<'a, Result<super::check::WorkerReport, super::check::ProbeError>> {
        Box::pin(super::vllm_check::probe_worker(
            &self.client,
            m,
            side,
            w,
            &self.served_model,
        ))
    }

    fn prefill(&self, d: &Dispatch) -> BoxFuture<'static, Result<PrefillReport, HalfError>> {
        if d.alone {
            // Nothing to send: the decode goes at once, without transfer params, and its first
            // chunk's prompt count is the one the barrier checks.
            self.handoff(d.pair_id).send_replace(Handoff::Go(
                Arc::new(Value::Null),
                std::time::Instant::now(),
            ));
            let report = PrefillReport {
                prompt_tokens: d.input_ids.len() as u64,
                kv_digest: None,
                cached_tokens: None,
                prompt_logprobs: None,
            };
            return Box::pin(std::future::ready(Ok(report)));
        }
        let client = self.client.clone();
        let url = format!("{}/v1/completions", d.prefill.url);
        let body = self.body(d, true, self.prefill_params());
        let headers = d.prefill.headers(half_headers(d.pair_id), false);
        let handoff = self.handoff(d.pair_id);
        let me = self.clone();
        let expected = d.input_ids.len() as u64;
        let scored = d.sampling.prompt_logprobs.map(|k| (k, d.input_ids.clone()));
        let d_id = d.pair_id.to_string();
        let prefill_host = d.prefill.host.clone();
        Box::pin(async move {
            let side = Side::Prefill;
            let verdict = async {
                let (status, body) = client
                    .post_collect_with(&url, body, &headers)
                    .await
                    .map_err(|e| e.of(side))?;
                let v: Option<Value> = serde_json::from_slice(&body).ok();
                if !(200..300).contains(&status) {
                    let message = v
                        .as_ref()
                        .and_then(error_in)
                        .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
                    return Err(HalfError {
                        side,
                        failure: HalfFailure::Status { status, message },
                    });
                }
                let v = v.ok_or(HalfError {
                    side,
                    failure: HalfFailure::Protocol("not JSON".into()),
                })?;
                if let Some(m) = error_in(&v) {
                    return Err(HalfError {
                        side,
                        failure: HalfFailure::InBandAbort(m),
                    });
                }
                let choice = v.pointer("/choices/0").ok_or(HalfError {
                    side,
                    failure: HalfFailure::Protocol("no choices".into()),
                })?;
                if finish_of(side, choice)?.is_none() {
                    return Err(HalfError {
                        side,
                        failure: HalfFailure::InBandAbort("the prefill did not finish".into()),
                    });
                }
                let prompt_tokens = usage(&v, "prompt_tokens").ok_or(HalfError {
                    side,
                    failure: HalfFailure::Protocol("no usage.prompt_tokens".into()),
                })?;
                let prompt_logprobs = match scored {
                    Some((k, ids)) => Some(
                        super::vllm_logprobs::prompt_logprobs(choice, &ids, k).map_err(|m| {
                            HalfError {
                                side,
                                failure: HalfFailure::Protocol(m),
                            }
                        })?,
                    ),
                    None => None,
                };
                let report = PrefillReport {
                    prompt_tokens,
                    kv_digest: None,
                    cached_tokens: v
                        .pointer("/usage/prompt_tokens_details/cached_tokens")
                        .and_then(Value::as_u64),
                    prompt_logprobs,
                };
                if prompt_tokens != expected {
                    // The lifecycle ends the pair on the count (an integrity violation); the
                    // decode is not sent.
                    return Ok((report, None));
                }
                let params = v.get("kv_transfer_params");
                super::vllm_params::check_params(
                    &me.cfg,
                    params,
                    prompt_tokens,
                    &d_id,
                    &prefill_host,
                )
                .map_err(|m| HalfError {
                    side,
                    failure: HalfFailure::Integrity(m),
                })?;
                Ok((report, params.cloned().map(Arc::new)))
            }
            .await;
            match verdict {
                Ok((report, Some(params))) => {
                    handoff.send_replace(Handoff::Go(params, std::time::Instant::now()));
                    Ok(report)
                }
                Ok((report, None)) => {
                    handoff.send_replace(Handoff::NoGo);
                    Ok(report)
                }
                Err(e) => {
                    handoff.send_replace(Handoff::NoGo);
                    Err(e)
                }
            }
        })
    }

    fn decode(&self, d: &Dispatch) -> DecodeStream {
        let client = self.client.clone();
        let url = format!("{}/v1/completions", d.decode.url);
        let mut rx = self.handoff(d.pair_id).subscribe();
        let me = self.clone();
        let d = d.clone();
        let start = async move {
            let side = Side::Decode;
            let params = loop {
                let state = rx.borrow_and_update().clone();
                match state {
                    Handoff::Go(p, answered) => {
                        let lease = std::time::Duration::from_millis(me.cfg.kv_lease_ms);
                        // Past the lease (less a margin for the request's way to the decode),
                        // the prefill may have freed the blocks the params name.
                        let margin = (lease / 4).min(std::time::Duration::from_secs(5));
                        if answered.elapsed() + margin > lease {
                            me.handoffs.remove(&d.pair_id);
                            return Err(HalfError {
                                side,
                                failure: HalfFailure::Integrity(format!(
                                    "the decode would be sent {} ms after the prefill answered, too near its {} ms KV lease: the blocks may hold another request's KV",
                                    answered.elapsed().as_millis(),
                                    lease.as_millis()
                                )),
                            });
                        }
                        break p;
                    }
                    Handoff::NoGo => {
                        me.handoffs.remove(&d.pair_id);
                        return Err(HalfError {
                            side,
                            failure: HalfFailure::InBandAbort(
                                "the prefill's answer was refused: the decode was not sent".into(),
                            ),
                        });
                    }
                    Handoff::Waiting => {
                        if rx.changed().await.is_err() {
                            return Err(HalfError {
                                side,
                                failure: HalfFailure::InBandAbort("pair aborted".into()),
                            });
                        }
                    }
                }
            };
            me.handoffs.remove(&d.pair_id);
            let body = me.body(&d, false, (*params).clone());
            let headers = d.decode.headers(half_headers(d.pair_id), false);
            let resp = client
                .send_with(Method::POST, &url, body, &headers)
                .await
                .map_err(|e| e.of(side))?;
            let status = resp.status().as_u16();
            if !(200..300).contains(&status) {
                let body = super::client::collect_bounded(resp.into_body())
                    .await
                    .unwrap_or_default();
                let message = serde_json::from_slice::<Value>(&body)
                    .ok()
                    .as_ref()
                    .and_then(error_in)
                    .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
                return Err(HalfError {
                    side,
                    failure: HalfFailure::Status { status, message },
                });
            }
            Ok(Sse {
                events: SseReader::new(resp.into_body(), side),
                chunks: 0,
                logprobs: d.sampling.logprobs,
            })
        };
        decode_stream(start)
    }

    fn abort(&self, d: &Dispatch, _side: Side) -> BoxFuture<'static, Result<(), HalfError>> {
        // vLLM has no abort endpoint: the lifecycle drops the pair's connections, which aborts
        // running requests; a decode still waiting for the prefill is told not to go.
        if let Some((_, h)) = self.handoffs.remove(&d.pair_id) {
            h.send_replace(Handoff::NoGo);
        }
        Box::pin(async { Ok(()) })
    }
}

/// vLLM's OpenAI completion stream (`data: {choices:[{text, finish_reason}], usage}` events, then
/// `data: [DONE]`) as decode chunks.
struct Sse {
    events: SseReader,
    /// Choice events so far (the completion count when the server sends no running usage).
    chunks: u64,
    /// The alternatives asked for with each token, when log-probabilities were.
    logprobs: Option<u32>,
}

impl ChunkSource for Sse {
    async fn next_chunk(&mut self) -> Result<Option<DecodeChunk>, HalfError> {
        let side = Side::Decode;
        loop {
            let Some(data) = self.events.next_data().await? else {
                return Ok(None);
            };
            let v: Value = serde_json::from_str(&data).map_err(|e| HalfError {
                side,
                failure: HalfFailure::Protocol(format!("bad SSE event: {e}")),
            })?;
            if let Some(m) = error_in(&v) {
                return Err(HalfError {
                    side,
                    failure: HalfFailure::InBandAbort(m),
                });
            }
            // The final usage-only event (no choices) carries nothing new.
            let Some(choice) = v.pointer("/choices/0") else {
                continue;
            };
            let finish = finish_of(side, choice)?;
            let ids = token_ids(side, choice)?;
            let logprobs = match self.logprobs {
                Some(k) => chunk_logprobs(choice, &ids, k).map_err(|m| HalfError {
                    side,
                    failure: HalfFailure::Protocol(m),
                })?,
                None => Vec::new(),
            };
            self.chunks += 1;
            return Ok(Some(DecodeChunk {
                delta: choice
                    .get("text")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
                token_ids: ids,
                prompt_tokens: usage(&v, "prompt_tokens"),
                kv_digest: None,
                completion_tokens: usage(&v, "completion_tokens").unwrap_or(self.chunks),
                // vLLM's `stop_reason`: the stop string that matched (a token id otherwise).
                matched_stop: finish
                    .and(choice.get("stop_reason"))
                    .and_then(Value::as_str)
                    .map(str::to_string),
                finish,
                logprobs,
                prompt_logprobs: None,
            }));
        }
    }
}

/// A chunk's `token_ids` (its own ids, with `return_token_ids`); none where absent.
fn token_ids(side: Side, choice: &Value) -> Result<Vec<u32>, HalfError> {
    match choice.get("token_ids") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(v) => serde_json::from_value(v.clone()).map_err(|e| HalfError {
            side,
            failure: HalfFailure::Protocol(format!("bad choices[0].token_ids: {e}")),
        }),
    }
}

#[cfg(test)]
#[path = "vllm_tests.rs"]
mod tests;

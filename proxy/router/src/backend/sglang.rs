//! SGLang PD backend: the native `/generate` API with `input_ids` computed by lockstep,
//! `rid`/`bootstrap_*` set by lockstep, and `/abort_request` on both halves.

use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::Method;
use http_body_util::BodyExt;
use serde_json::{Value, json};

use super::client::UpstreamClient;
use super::sse::{ChunkSource, SseReader, decode_stream};
use super::{
    DecodeChunk, DecodeStream, Dispatch, FinishReason, HalfError, HalfFailure, PdBackend,
    PrefillReport, Side,
};
use crate::config::ModelConfig;

/// Talks to SGLang prefill and decode workers.
#[derive(Debug, Clone)]
pub struct SglangBackend {
    client: UpstreamClient,
}

impl SglangBackend {
    /// A backend over the shared upstream client.
    pub fn new(client: UpstreamClient) -> SglangBackend {
        SglangBackend { client }
    }

    /// The `/generate` body of one half. Client-sent routing fields never reach here: lockstep
    /// builds the whole body.
    pub fn generate_body(d: &Dispatch, stream: bool) -> Bytes {
        let body = GenerateBody {
            input_ids: &d.input_ids,
            sampling_params: &d.sampling,
            rid: d.pair_id,
            bootstrap_host: &d.prefill.bootstrap_host,
            bootstrap_port: d.prefill.bootstrap_port,
            bootstrap_room: d.pair_id.raw(),
            cache_salt: format!("{:016x}", d.cache_salt()),
            stream,
        };
        Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
    }
}

/// The native `/generate` body of one half.
#[derive(serde::Serialize)]
struct GenerateBody<'a> {
    input_ids: &'a [u32],
    sampling_params: &'a super::SamplingParams,
    /// The pair id as a string (SGLang's `rid`).
    rid: crate::pair::PairId,
    bootstrap_host: &'a str,
    bootstrap_port: Option<u16>,
    /// The pair id as the integer SGLang expects.
    bootstrap_room: u64,
    /// The tenant's prefix-cache namespace (SGLang 0.5.23 `GenerateReqInput.cache_salt`,
    /// `srt/managers/io_struct.py`: "cache namespace used to isolate otherwise-identical
    /// prefixes"), the same on both halves, so one tenant's prompt never hits another's radix
    /// cache on either worker.
    cache_salt: String,
    stream: bool,
}

/// Extracts a worker's error message from an error body (SGLang: `{"error":{"message"}}` or
/// `{"object":"error","message"}`), falling back to the raw text.
fn error_message(body: &[u8]) -> String {
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

/// Checks one `/generate` JSON object for an in-band failure; returns its finish reason.
fn inspect(side: Side, v: &Value) -> Result<Option<FinishReason>, HalfError> {
    let fail = |m: String| HalfError {
        side,
        failure: HalfFailure::InBandAbort(m),
    };
    if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
        return Err(fail(err.to_string()));
    }
    let Some(meta) = v.get("meta_info") else {
        return Err(HalfError {
            side,
            failure: HalfFailure::Protocol("no meta_info".into()),
        });
    };
    match meta.get("finish_reason") {
        None | Some(Value::Null) => Ok(None),
        Some(fr) => {
            let kind = fr
                .get("type")
                .and_then(Value::as_str)
                .or_else(|| fr.as_str())
                .unwrap_or("");
            match kind {
                "stop" => Ok(Some(FinishReason::Stop)),
                "length" => Ok(Some(FinishReason::Length)),
                "abort" => Err(fail(
                    fr.get("message")
                        .and_then(Value::as_str)
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
fn prefill_report(v: &Value, rid: &str) -> Result<PrefillReport, HalfError> {
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
    if let Some(id) = v.pointer("/meta_info/id").and_then(Value::as_str)
        && id != rid
    {
        return Err(protocol(format!(
            "the prefill answered for request `{id}`, not this pair's `{rid}`"
        )));
    }
    let prompt_tokens = meta_u64(v, "prompt_tokens")
        .ok_or_else(|| protocol("no meta_info.prompt_tokens".into()))?;
    Ok(PrefillReport {
        prompt_tokens,
        kv_digest: None,
        cached_tokens: meta_u64(v, "cached_tokens"),
    })
}

fn meta_u64(v: &Value, key: &str) -> Option<u64> {
    v.get("meta_info")
        .and_then(|m| m.get(key))
        .and_then(Value::as_u64)
}

impl PdBackend for SglangBackend {
    fn deployment_capacity<'a>(&'a self, m: &'a ModelConfig) -> BoxFuture<'a, Result<u64, String>> {
        Box::pin(super::probe::reported_capacity(&self.client, m))
    }

    fn prefill(&self, d: &Dispatch) -> BoxFuture<'static, Result<PrefillReport, HalfError>> {
        let client = self.client.clone();
        let url = format!("{}/generate", d.prefill.url);
        let body = Self::generate_body(d, false);
        let trace = lockstep_serve::telemetry::trace_headers();
        let rid = d.pair_id.to_string();
        Box::pin(async move {
            let side = Side::Prefill;
            let (status, body) = client
                .post_collect_with(&url, body, &trace)
                .await
                .map_err(|e| e.of(side))?;
            if !(200..300).contains(&status) {
                return Err(HalfError {
                    side,
                    failure: HalfFailure::Status {
                        status,
                        message: error_message(&body),
                    },
                });
            }
            let v: Value = serde_json::from_slice(&body).map_err(|e| HalfError {
                side,
                failure: HalfFailure::Protocol(format!("not JSON: {e}")),
            })?;
            prefill_report(&v, &rid)
        })
    }

    fn decode(&self, d: &Dispatch) -> DecodeStream {
        let client = self.client.clone();
        let url = format!("{}/generate", d.decode.url);
        let body = Self::generate_body(d, true);
        let trace = lockstep_serve::telemetry::trace_headers();
        let start = async move {
            let side = Side::Decode;
            let resp = client
                .send_with(Method::POST, &url, body, &trace)
                .await
                .map_err(|e| e.of(side))?;
            let status = resp.status().as_u16();
            if !(200..300).contains(&status) {
                let body = resp
                    .into_body()
                    .collect()
                    .await
                    .map(|c| c.to_bytes())
                    .unwrap_or_default();
                return Err(HalfError {
                    side,
                    failure: HalfFailure::Status {
                        status,
                        message: error_message(&body),
                    },
                });
            }
            Ok(SseDecoder {
                events: SseReader::new(resp.into_body(), side),
                text_len: 0,
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
        let body = Bytes::from(json!({ "rid": d.pair_id.to_string() }).to_string());
        Box::pin(async move {
            let (status, body) = client
                .post_collect(&url, body)
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

/// Turns SGLang's SSE stream (`data: {cumulative text, meta_info}` events, then `data: [DONE]`)
/// into text deltas.
struct SseDecoder {
    events: SseReader,
    text_len: usize,
}

impl ChunkSource for SseDecoder {
    async fn next_chunk(&mut self) -> Result<Option<DecodeChunk>, HalfError> {
        let side = Side::Decode;
        let Some(data) = self.events.next_data().await? else {
            return Ok(None);
        };
        let v: Value = serde_json::from_str(&data).map_err(|e| HalfError {
            side,
            failure: HalfFailure::Protocol(format!("bad SSE event: {e}")),
        })?;
        let finish = inspect(side, &v)?;
        let text = v.get("text").and_then(Value::as_str).unwrap_or("");
        // SGLang streams cumulative text; lockstep forwards only the new part.
        let delta = if text.len() >= self.text_len && text.is_char_boundary(self.text_len) {
            text[self.text_len..].to_string()
        } else {
            return Err(HalfError {
                side,
                failure: HalfFailure::Protocol("streamed text is not cumulative".into()),
            });
        };
        self.text_len = text.len();
        Ok(Some(DecodeChunk {
            kv_digest: None,
            delta,
            token_ids: Vec::new(),
            prompt_tokens: meta_u64(&v, "prompt_tokens"),
            completion_tokens: meta_u64(&v, "completion_tokens").unwrap_or(0),
            finish,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn answer(meta: Value) -> Value {
        json!({ "text": "x", "output_ids": [1], "meta_info": meta })
    }

    #[test]
    fn a_prefill_answer_fails_closed_unless_finished_and_ours() {
        let ok = answer(json!({ "id": "7", "prompt_tokens": 5, "cached_tokens": 2,
                                "finish_reason": { "type": "length", "length": 0 } }));
        let r = prefill_report(&ok, "7").expect("finished, ours");
        assert_eq!((r.prompt_tokens, r.cached_tokens), (5, Some(2)));
        // No id (older releases): accepted on the other checks.
        let no_id = answer(json!({ "prompt_tokens": 5, "finish_reason": { "type": "length" } }));
        assert!(prefill_report(&no_id, "7").is_ok());
        for (bad, why) in [
            (
                answer(json!({ "id": "7", "prompt_tokens": 5, "finish_reason": null })),
                "no finish_reason",
            ),
            (
                answer(json!({ "id": "7", "prompt_tokens": 5 })),
                "no finish_reason",
            ),
            (
                answer(
                    json!({ "id": "8", "prompt_tokens": 5, "finish_reason": { "type": "length" } }),
                ),
                "not this pair",
            ),
            (
                answer(json!({ "id": "7", "finish_reason": { "type": "length" } })),
                "prompt_tokens",
            ),
            (
                answer(
                    json!({ "id": "7", "prompt_tokens": 5, "finish_reason": { "type": "abort", "message": "m" } }),
                ),
                "m",
            ),
        ] {
            let e = prefill_report(&bad, "7").expect_err(why).to_string();
            assert!(e.contains(why), "{why}: {e}");
        }
    }
}

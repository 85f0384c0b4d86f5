//! lockstep's own network workers (`lockstep worker`) as a backend, over the gRPC worker service.
//!
//! The router sends `Prefill` (with the decode worker's endpoint) and `Decode` at once; the
//! prefill worker pushes the KV straight to the decode worker, never through the router. The
//! prefill reports the digest of the manifest it pushed; the decode worker reports the digest of
//! what it verified and imported; the lifecycle's commit barrier compares the two before any
//! token is released.

use std::time::Duration;

use dashmap::DashMap;
use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use futures_util::stream::{self, StreamExt};
use lockstep_proto::v1 as pb;
use lockstep_proto::v1::worker_client::WorkerClient;
use tonic::transport::Channel;
use tonic::{Code, Status};

use super::check::{ProbeError, WorkerReport};
use super::events::{HalfEvent, decode_chunks};
use super::{
    DecodeStream, Dispatch, FinishReason, HalfError, HalfFailure, PdBackend, PrefillReport,
    SamplingParams, Side, TokenLogprobs,
};
use lockstep_core::config::{ModelConfig, WorkerConfig};
use lockstep_proto::MAX_MESSAGE_BYTES;
use lockstep_runtime::tls::{PlaneTls, worker_channel};

/// The backend over lockstep workers.
#[derive(Debug, Clone)]
pub struct LockstepBackend {
    clients: std::sync::Arc<DashMap<String, WorkerClient<Channel>>>,
    connect_timeout: Duration,
    tls: Option<std::sync::Arc<PlaneTls>>,
    /// Carried to the workers as `grpc-timeout`: how long a prefill may take, and how long a
    /// decode may wait for its KV and first token (the router's own deadlines, so a worker's
    /// shorter lease never ends a pair the router would still wait for).
    deadlines: (Duration, Duration),
}

impl LockstepBackend {
    /// A backend whose connections to workers are bounded by `connect_timeout`, over the
    /// worker plane's mutual TLS when `tls` is set (`https://` workers).
    /// `timeouts` are the model's: their prefill and first-token bounds go to the workers.
    pub fn new(
        connect_timeout: Duration,
        tls: Option<std::sync::Arc<PlaneTls>>,
        timeouts: &lockstep_core::config::TimeoutConfig,
    ) -> LockstepBackend {
        LockstepBackend {
            clients: Default::default(),
            connect_timeout,
            tls,
            deadlines: (
                Duration::from_millis(timeouts.prefill_ms),
                Duration::from_millis(timeouts.first_token_ms),
            ),
        }
    }

    /// The client for a worker (one h2 connection per worker, opened lazily).
    pub fn client(&self, url: &str) -> Result<WorkerClient<Channel>, String> {
        if let Some(c) = self.clients.get(url) {
            return Ok(c.clone());
        }
        let c = WorkerClient::new(worker_channel(
            url,
            self.connect_timeout,
            self.tls.as_ref(),
        )?)
        .max_decoding_message_size(MAX_MESSAGE_BYTES);
        self.clients.insert(url.to_string(), c.clone());
        Ok(c)
    }
}

/// The pair's KV key, given to both of its workers: the prefill signs the manifest it pushes
/// with it, the decode imports only a set that verifies (`lockstep-worker`'s `kvmac`). Derived,
/// HMAC-SHA256, from a secret drawn at process start and the pair id (ids are never reused), so it
/// is fresh per pair, the same for both halves and for aborts, and unguessable off this process.
fn kv_key(pair: u64) -> Vec<u8> {
    use hmac::Mac;
    static SECRET: std::sync::OnceLock<[u8; 32]> = std::sync::OnceLock::new();
    let secret = SECRET.get_or_init(rand::random);
    let mut h = <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(secret).expect("any key");
    h.update(b"lockstep pair kv key\0");
    h.update(&pair.to_le_bytes());
    h.finalize().into_bytes().to_vec()
}

/// A request with the current span's trace context in its metadata.
fn traced<T>(msg: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    for (k, v) in lockstep_runtime::telemetry::trace_headers() {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(k.as_str().as_bytes()),
            tonic::metadata::MetadataValue::try_from(v.as_bytes()),
        ) {
            req.metadata_mut().insert(k, v);
        }
    }
    req
}

/// How a worker's status reads as a half's failure. `started`: the answer had begun.
fn half_error(side: Side, s: &Status, started: bool) -> HalfError {
    let message = s.message().to_string();
    let failure = match s.code() {
        // Before an answer: the worker (or, for a prefill, the decode worker its KV was pushed
        // to) could not be reached; no KV arrived anywhere, so a new pair is safe.
        Code::Unavailable if !started => HalfFailure::Connect(message),
        Code::Unavailable | Code::Unknown | Code::Cancelled if started => {
            HalfFailure::Transport(message)
        }
        Code::ResourceExhausted => HalfFailure::Status {
            status: 503,
            message,
        },
        Code::InvalidArgument => HalfFailure::Status {
            status: 400,
            message,
        },
        Code::DataLoss => HalfFailure::Integrity(message),
        _ => HalfFailure::InBandAbort(format!("{:?}: {message}", s.code())),
    };
    HalfError { side, failure }
}

fn sampling(p: &SamplingParams) -> pb::Sampling {
    pb::Sampling {
        max_tokens: p.max_new_tokens.min(u64::from(u32::MAX)) as u32,
        temperature: p.temperature.unwrap_or(1.0) as f32,
        top_k: p.top_k.filter(|k| *k > 0).unwrap_or(0) as u32,
        top_p: p.top_p.unwrap_or(1.0) as f32,
        seed: p.sampling_seed,
        stop: p.stop.clone(),
        ignore_eos: p.ignore_eos.unwrap_or(false),
        presence_penalty: p.presence_penalty.unwrap_or(0.0) as f32,
        frequency_penalty: p.frequency_penalty.unwrap_or(0.0) as f32,
        constraint: p.constraint.as_ref().and_then(|c| {
            use lockstep_engine::grammar::OutputConstraint as O;
            use pb::sampling::Constraint as C;
            Some(match c.for_engine()? {
                O::JsonObject => C::JsonObject(true),
                O::JsonSchema(s) => C::JsonSchema(s),
                O::Regex(r) => C::Regex(r),
                O::Lark(g) => C::Lark(g),
            })
        }),
        resumed: p.resumed,
        logprobs: p.logprobs,
    }
}

fn unreachable(side: Side, e: String) -> HalfError {
    HalfError {
        side,
        failure: HalfFailure::Connect(e),
    }
}

impl PdBackend for LockstepBackend {
    fn forget(&self, url: &str) {
        self.clients.remove(url);
    }

    /// A worker's `Capacity`: its KV pool, its lease, its role (which must fit its pool) and its
    /// model's fingerprint (which every worker must share: KV moves between them).
    fn probe_worker<'a>(
        &'a self,
        _m: &'a ModelConfig,
        side: Side,
        w: &'a WorkerConfig,
    ) -> BoxFuture<'a, Result<WorkerReport, ProbeError>> {
        Box::pin(async move {
            let mut req = tonic::Request::new(pb::CapacityRequest {});
            req.set_timeout(Duration::from_secs(2));
            let mut c = self
                .client(w.url.trim_end_matches('/'))
                .map_err(ProbeError::Refused)?;
            let c = c
                .capacity(req)
                .await
                .map_err(|s| ProbeError::Unreachable(s.message().to_string()))?
                .into_inner();
            let mut report = WorkerReport {
                kv_tokens: Some(c.kv_capacity_tokens),
                kv_lease_ms: Some(c.lease_ms),
                ..WorkerReport::default()
            };
            let roles = match side {
                Side::Prefill => ["prefill", "unified"],
                Side::Decode => ["decode", "unified"],
            };
            if !roles.contains(&c.role.as_str()) {
                report.problems.push(format!("is a `{}` worker", c.role));
            }
            report.share(
                "model fingerprint",
                format!("{:#x}", c.model_fingerprint),
                "it serves another model, and KV cannot be exchanged between models",
            );
            Ok(report)
        })
    }

    fn prefill(&self, d: &Dispatch) -> BoxFuture<'static, Result<PrefillReport, HalfError>> {
        let client = self.client(&d.prefill.url);
        let req = pb::PrefillRequest {
            pair_id: d.pair_id.raw(),
            input_ids: d.input_ids.to_vec(),
            decode_endpoint: d.decode.url.clone(),
            cache_salt: Some(d.cache_salt()),
            kv_key: kv_key(d.pair_id.raw()),
            prompt_logprobs: d.sampling.prompt_logprobs,
        };
        let asked = d.sampling.prompt_logprobs.is_some();
        let mut req = traced(req);
        req.set_timeout(self.deadlines.0);
        async move {
            let mut c = client.map_err(|e| unreachable(Side::Prefill, e))?;
            let r = c
                .prefill(req)
                .await
                .map_err(|s| half_error(Side::Prefill, &s, false))?
                .into_inner();
            // The prompt's entries, where asked (their count is checked with the first chunk).
            let prompt_logprobs = asked
                .then(|| {
                    r.prompt_logprobs
                        .into_iter()
                        .map(|l| {
                            (l.top_ids.len() == l.top_logprobs.len())
                                .then(|| super::TokenLogprobs {
                                    logprob: l.logprob,
                                    top: l.top_ids.into_iter().zip(l.top_logprobs).collect(),
                                })
                                .ok_or_else(|| HalfError {
                                    side: Side::Prefill,
                                    failure: HalfFailure::Protocol(
                                        "a prompt entry's top ids and values differ in number"
                                            .into(),
                                    ),
                                })
                        })
                        .collect::<Result<Vec<_>, _>>()
                })
                .transpose()?;
            Ok(PrefillReport {
                prompt_tokens: r.prompt_tokens,
                kv_digest: Some(r.kv_digest),
                cached_tokens: Some(r.cached_tokens),
                prompt_logprobs,
            })
        }
        .boxed()
    }

    fn decode(&self, d: &Dispatch) -> DecodeStream {
        let client = self.client(&d.decode.url);
        let mut req = traced(pb::DecodeRequest {
            pair_id: d.pair_id.raw(),
            input_ids: d.input_ids.to_vec(),
            sampling: Some(sampling(&d.sampling)),
            expect_kv: true,
            cache_salt: Some(d.cache_salt()),
            kv_key: kv_key(d.pair_id.raw()),
        });
        req.set_timeout(self.deadlines.1);
        let start = async move {
            let mut c = client.map_err(|e| unreachable(Side::Decode, e))?;
            c.decode(req)
                .await
                .map(tonic::Response::into_inner)
                .map_err(|s| half_error(Side::Decode, &s, false))
        };
        let ended = HalfError {
            side: Side::Decode,
            failure: HalfFailure::Transport(
                "the worker ended the stream before the last token".into(),
            ),
        };
        start
            .map(|started| match started {
                Err(e) => stream::once(async move { Err(e) }).boxed(),
                Ok(events) => {
                    // (the gRPC stream, whether `Started` came: a broken stream after it is a
                    // transport failure, not a refused connection)
                    let events =
                        stream::unfold((events, false), |(mut events, started)| async move {
                            let e = match events.message().await {
                                Ok(Some(e)) => e,
                                Ok(None) => return None,
                                Err(s) => {
                                    let e = half_error(Side::Decode, &s, started);
                                    return Some((HalfEvent::Failed(e), (events, started)));
                                }
                            };
                            let e = half_event(e);
                            let started = started || matches!(e, HalfEvent::Started { .. });
                            Some((e, (events, started)))
                        });
                    decode_chunks(events, ended)
                }
            })
            .flatten_stream()
            .boxed()
    }

    /// lockstep's engine counts the delivered tokens as output ([`SamplingParams::resumed`]):
    /// penalties, seeded draws and the output constraint go on where they were.
    fn resumes(&self, _: &SamplingParams) -> bool {
        true
    }

    /// The worker service's `Health` (over the plane's mutual TLS where configured): serving,
    /// which a worker answers only while it is not draining and its engine thread lives.
    fn health(
        &self,
        _client: &super::UpstreamClient,
        url: &str,
        timeout: Duration,
    ) -> BoxFuture<'static, bool> {
        let client = self.client(url);
        async move {
            let Ok(mut c) = client else { return false };
            let mut req = tonic::Request::new(pb::HealthRequest {});
            req.set_timeout(timeout);
            matches!(
                tokio::time::timeout(timeout, c.health(req)).await,
                Ok(Ok(r)) if r.get_ref().serving
            )
        }
        .boxed()
    }

    fn abort(&self, d: &Dispatch, side: Side) -> BoxFuture<'static, Result<(), HalfError>> {
        let url = match side {
            Side::Prefill => &d.prefill.url,
            Side::Decode => &d.decode.url,
        };
        let client = self.client(url);
        let mut req = traced(pb::WorkerAbortRequest {
            pair_id: d.pair_id.raw(),
        });
        req.set_timeout(Duration::from_secs(2));
        async move {
            let mut c = client.map_err(|e| unreachable(side, e))?;
            c.abort(req)
                .await
                .map(|_| ())
                .map_err(|s| half_error(side, &s, false))
        }
        .boxed()
    }
}

/// One worker event as the decode adapter reads it. A finish code lockstep does not know is a
/// protocol error: reading it as a stop would end a stream on a worker's say-so it cannot check.
fn half_event(e: pb::DecodeEvent) -> HalfEvent {
    use pb::decode_event::Event as E;
    let t = match e.event {
        Some(E::Started(s)) => {
            return HalfEvent::Started {
                prompt_tokens: s.prompt_tokens,
                kv_digest: s.kv_digest,
            };
        }
        Some(E::Token(t)) => t,
        None => return HalfEvent::Nothing,
    };
    let finish = match pb::DecodeFinish::try_from(t.finish) {
        Ok(pb::DecodeFinish::None) => None,
        Ok(pb::DecodeFinish::Stop) => Some(FinishReason::Stop),
        Ok(pb::DecodeFinish::Length) => Some(FinishReason::Length),
        Err(_) => {
            return HalfEvent::Failed(HalfError {
                side: Side::Decode,
                failure: HalfFailure::Protocol(format!(
                    "unknown finish code {} from the worker",
                    t.finish
                )),
            });
        }
    };
    let logprobs = match t.logprobs {
        None => None,
        Some(l) if l.top_ids.len() == l.top_logprobs.len() => Some(TokenLogprobs {
            logprob: l.logprob,
            top: l.top_ids.into_iter().zip(l.top_logprobs).collect(),
        }),
        Some(l) => {
            return HalfEvent::Failed(HalfError {
                side: Side::Decode,
                failure: HalfFailure::Protocol(format!(
                    "the worker sent {} top token ids with {} log-probabilities",
                    l.top_ids.len(),
                    l.top_logprobs.len()
                )),
            });
        }
    };
    HalfEvent::Token {
        id: t.id,
        text: t.text,
        finish,
        matched_stop: Some(t.matched_stop).filter(|m| !m.is_empty()),
        logprobs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(finish: i32, matched: &str) -> pb::DecodeToken {
        pb::DecodeToken {
            id: 7,
            text: "x".into(),
            finish,
            matched_stop: matched.into(),
            logprobs: None,
        }
    }

    #[tokio::test]
    async fn a_forgotten_worker_leaves_no_connection_behind() {
        let b = LockstepBackend::new(
            Duration::from_secs(1),
            None,
            &lockstep_core::config::TimeoutConfig::default(),
        );
        for port in [7001, 7002] {
            b.client(&format!("http://127.0.0.1:{port}"))
                .expect("a lazy channel");
        }
        assert_eq!(b.clients.len(), 2);
        b.forget("http://127.0.0.1:7001");
        assert_eq!(b.clients.len(), 1);
        assert!(b.clients.contains_key("http://127.0.0.1:7002"));
    }

    #[test]
    fn a_tokens_log_probabilities_are_read_and_a_mismatched_list_is_an_error() {
        use pb::decode_event::Event as E;
        let ev = |l| {
            half_event(pb::DecodeEvent {
                event: Some(E::Token(pb::DecodeToken {
                    logprobs: Some(l),
                    ..token(0, "")
                })),
            })
        };
        let ok = ev(pb::TokenLogprobs {
            logprob: -0.25,
            top_ids: vec![7, 3],
            top_logprobs: vec![-0.25, -2.0],
        });
        match ok {
            HalfEvent::Token { logprobs, .. } => assert_eq!(
                logprobs,
                Some(TokenLogprobs {
                    logprob: -0.25,
                    top: vec![(7, -0.25), (3, -2.0)],
                })
            ),
            other => panic!("{other:?}"),
        }
        let bad = ev(pb::TokenLogprobs {
            logprob: -0.25,
            top_ids: vec![7, 3],
            top_logprobs: vec![-0.25],
        });
        assert!(
            matches!(&bad, HalfEvent::Failed(e) if matches!(e.failure, HalfFailure::Protocol(_))),
            "{bad:?}"
        );
        // None asked, none sent.
        match ev(pb::TokenLogprobs::default()) {
            HalfEvent::Token { logprobs, .. } => assert!(logprobs.is_some()),
            other => panic!("{other:?}"),
        }
        match half_event(pb::DecodeEvent {
            event: Some(E::Token(token(0, ""))),
        }) {
            HalfEvent::Token { logprobs, .. } => assert_eq!(logprobs, None),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_tokens_finish_code_is_read_exactly_and_an_unknown_one_is_an_error() {
        use pb::decode_event::Event as E;
        let ev = |t| {
            half_event(pb::DecodeEvent {
                event: Some(E::Token(t)),
            })
        };
        let read = |finish, matched: &str| match ev(token(finish, matched)) {
            HalfEvent::Token {
                id,
                finish,
                matched_stop,
                ..
            } => Ok((id, finish, matched_stop)),
            HalfEvent::Failed(e) => Err(e),
            other => panic!("{other:?}"),
        };
        assert_eq!(read(0, ""), Ok((7, None, None)));
        assert_eq!(
            read(1, "end"),
            Ok((7, Some(FinishReason::Stop), Some("end".into())))
        );
        assert_eq!(read(2, ""), Ok((7, Some(FinishReason::Length), None)));
        for code in [3, 7, -1] {
            let e = read(code, "").expect_err("unknown");
            assert_eq!(e.side, Side::Decode);
            assert!(
                matches!(&e.failure, HalfFailure::Protocol(m) if m.contains(&code.to_string())),
                "{e:?}"
            );
        }
        let started = half_event(pb::DecodeEvent {
            event: Some(E::Started(pb::DecodeStarted {
                prompt_tokens: 5,
                kv_digest: Some(9),
            })),
        });
        assert!(matches!(
            started,
            HalfEvent::Started {
                prompt_tokens: 5,
                kv_digest: Some(9)
            }
        ));
        assert!(matches!(
            half_event(pb::DecodeEvent { event: None }),
            HalfEvent::Nothing
        ));
    }
}

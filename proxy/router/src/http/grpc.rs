//! The gRPC front end (`lockstep.v1.Lockstep`), served on the HTTP listener beside the HTTP API
//! (h2c or h2 over TLS), with `grpc.health.v1` (NOT_SERVING while draining) and server reflection
//! (v1 and v1alpha).
//!
//! Requests go through the same admission, pair lifecycle and commit barrier as HTTP requests
//! (`crate::admission`, then `super::respond::commit`); errors are the same [`LockstepError`]s, mapped to a status in
//! one place ([`LockstepError::to_status`]). The client's deadline (`grpc-timeout`) bounds the
//! whole pair; a cancelled call drops the pair's receiver, which aborts both halves.

use std::pin::Pin;
use std::sync::Arc;

use futures_util::Stream;
use lockstep_proto::v1 as pb;
use lockstep_proto::v1::lockstep_server::{Lockstep, LockstepServer};
use tokio::time::Instant;
use tonic::{Request, Response, Status};
use tracing::Instrument;

pub use super::grpc_guard::GrpcLimits;
use super::openai::{CommonParams, Content, MessageIn, Stop, to_messages};
use super::respond::{Committed, commit};
use crate::admission::{
    Admitted, FrontRequest, Identity, Input, Prompt, admit_decoded, authorize_identified, identify,
};
use crate::backend::{FinishReason, SamplingParams};
use crate::pair::{CancelReason, PairId};
use crate::state::AppState;
use lockstep_core::error::LockstepError;
use lockstep_tenancy::tenant::Tenant;

/// The gRPC services, ready to mount on the HTTP router, and the health reporter (drain flips it).
pub fn services(
    state: Arc<AppState>,
    limits: GrpcLimits,
) -> (axum::Router, tonic_health::server::HealthReporter) {
    let (health, health_svc) = tonic_health::server::health_reporter();
    // The guard has read (and bounded) every request body before tonic decodes it; these
    // bound the decoded message too, whatever the guard let through.
    let health_svc = health_svc.max_decoding_message_size(super::grpc_guard::HEALTH_BODY_BYTES);
    let api = LockstepServer::new(Front {
        state: state.clone(),
    })
    .max_decoding_message_size(state.max_body_bytes);
    // Only what this listener serves is advertised (not the worker service).
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(lockstep_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .with_service_name("lockstep.v1.Lockstep")
            .with_service_name("grpc.health.v1.Health")
    };
    let v1 = reflection().build_v1();
    let v1alpha = reflection().build_v1alpha();
    let mut routes = tonic::service::Routes::new(api).add_service(health_svc);
    if let (Ok(a), Ok(b)) = (v1, v1alpha) {
        let cap = super::grpc_guard::REFLECTION_MESSAGE_BYTES;
        routes = routes
            .add_service(a.max_decoding_message_size(cap))
            .add_service(b.max_decoding_message_size(cap));
    } else {
        tracing::warn!("gRPC reflection could not be built; serving without it");
    }
    let grpc = routes.prepare();
    let mut router = axum::Router::new();
    for service in [
        "lockstep.v1.Lockstep",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    ] {
        router = router.route_service(&format!("/{service}/{{*method}}"), grpc.clone());
    }
    let guard = Arc::new(super::grpc_guard::Guard::new(state, limits));
    let router = router.layer(axum::middleware::from_fn_with_state(
        guard,
        super::grpc_guard::guard,
    ));
    (router, health)
}

/// Marks every gRPC service serving or not (`grpc.health.v1`).
pub async fn set_serving(health: &tonic_health::server::HealthReporter, serving: bool) {
    let status = if serving {
        tonic_health::ServingStatus::Serving
    } else {
        tonic_health::ServingStatus::NotServing
    };
    for name in ["", "lockstep.v1.Lockstep"] {
        health.set_service_status(name, status).await;
    }
}

struct Front {
    state: Arc<AppState>,
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

fn common(s: Option<pb::SamplingParams>) -> CommonParams {
    let s = s.unwrap_or_default();
    CommonParams {
        max_tokens: s.max_tokens.map(i64::from),
        max_completion_tokens: None,
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k.map(i64::from),
        n: None,
        stream: true,
        stream_options: None,
        stop: (!s.stop.is_empty()).then_some(Stop::Many(s.stop)),
        seed: s.seed,
        frequency_penalty: s.frequency_penalty,
        presence_penalty: s.presence_penalty,
        ignore_eos: s.ignore_eos,
        best_of: None,
    }
}

/// A call's sampling parameters, log-probabilities included (bounded as on HTTP, and refused
/// for backends lockstep does not read them from).
fn sampling(
    s: Option<pb::SamplingParams>,
    model: &lockstep_core::config::ModelConfig,
) -> Result<(SamplingParams, bool, bool), LockstepError> {
    let logprobs = s.as_ref().and_then(|s| s.logprobs);
    let mut out = common(s).sampling(model)?;
    if let Some(k) = logprobs {
        out.0.logprobs = Some(super::logprob_params::grpc_logprobs(k)?);
    }
    Ok(out)
}

/// A call's context: its tenant.
struct Call {
    tenant: Option<Arc<Tenant>>,
}

impl Front {
    /// A call that needs no tenant limits (abort, pair status, model list): its tenant.
    fn call<T>(&self, req: &Request<T>) -> Result<Call, Status> {
        let tenant = self.identity(req)?.tenant;
        Ok(Call { tenant })
    }

    /// Who the call is from: as the guard found it on the headers, else (a service mounted
    /// without the guard) checked here.
    fn identity<T>(&self, req: &Request<T>) -> Result<Identity, Status> {
        match req.extensions().get::<Identity>() {
            Some(who) => Ok(who.clone()),
            None => identify(&self.state, &req.metadata().clone().into_headers())
                .map_err(|r| r.0.to_status()),
        }
    }

    /// A generation call through the admission stage, then its pair.
    async fn generation<R: FrontRequest<Shape = ()> + prost::Message + 'static>(
        &self,
        req: Request<R>,
    ) -> Result<Response<EventStream>, Status> {
        let deadline = lockstep_runtime::grpc_timeout(req.metadata()).map(|d| Instant::now() + d);
        let caller =
            authorize_identified(&self.state, self.identity(&req)?).map_err(|r| r.0.to_status())?;
        let req = req.into_inner();
        let size = req.encoded_len();
        let (admitted, ()) = admit_decoded(&self.state, caller, req, size)
            .await
            .map_err(|r| r.0.to_status())?;
        self.run(deadline, admitted).await
    }

    /// Admits and runs the pair; the stream carries its events until it finishes.
    async fn run(
        &self,
        deadline: Option<Instant>,
        admitted: Admitted,
    ) -> Result<Response<EventStream>, Status> {
        let model = admitted.model.clone();
        let tenant = admitted.caller.tenant.clone();
        let logprobs = admitted.sampling.logprobs;
        let admit = commit(admitted);
        let committed = match deadline {
            // Dropping the admission future drops the pair's receiver: both halves abort.
            Some(d) => tokio::time::timeout_at(d, admit).await.map_err(|_| {
                Status::deadline_exceeded("the call's deadline passed before the pair committed")
            })?,
            None => admit.await,
        }
        .map_err(|e| e.to_status())?;
        let Committed {
            rx,
            pair_id,
            prompt_tokens,
            cached_tokens,
            permit,
            ..
        } = committed;
        let started = pb::GenerateResponse {
            event: Some(pb::generate_response::Event::Started(pb::Started {
                pair_id: pair_id.to_string(),
                model: model.name.to_string(),
                prompt_tokens: prompt_tokens as u32,
            })),
        };
        let prompt = prompt_tokens;
        let chunks = Box::pin(super::respond::committed_chunks(
            rx, pair_id, permit, logprobs, None,
        ));
        let codec = model.codec.clone();
        // The committed answer, ended at the call's deadline (ending it drops the pair's
        // receiver: both halves abort).
        let pair = futures_util::stream::unfold(Some((chunks, codec)), move |open| async move {
            use futures_util::StreamExt;
            use pb::generate_response::Event as E;
            let (mut chunks, codec) = open?;
            let next = match deadline {
                Some(d) => match tokio::time::timeout_at(d, chunks.next()).await {
                    Ok(next) => next,
                    Err(_) => {
                        let s = Status::deadline_exceeded(format!(
                            "the call's deadline passed; pair {pair_id} aborted"
                        ));
                        return Some((Err(s), None));
                    }
                },
                None => chunks.next().await,
            }?;
            let c = match next {
                Ok(c) => c,
                Err(e) => return Some((Err(e.to_status()), None)),
            };
            let entry = |id: u32, logprob: f32| pb::TopLogprob {
                token_id: id,
                logprob,
                token: codec.token_bytes(id).to_vec(),
            };
            let logprobs = c
                .token_ids
                .iter()
                .zip(&c.logprobs)
                .map(|(&id, l)| {
                    let own = entry(id, l.logprob);
                    pb::TokenLogprob {
                        token_id: id,
                        logprob: own.logprob,
                        token: own.token,
                        top: l.top.iter().map(|&(t, lp)| entry(t, lp)).collect(),
                    }
                })
                .collect();
            let mut out = vec![pb::GenerateResponse {
                event: Some(E::Delta(pb::Delta {
                    text: c.delta,
                    token_ids: c.token_ids,
                    completion_tokens: c.completion_tokens as u32,
                    logprobs,
                })),
            }];
            if let Some(f) = c.finish {
                out.push(pb::GenerateResponse {
                    event: Some(E::Finished(pb::Finished {
                        finish_reason: match f {
                            FinishReason::Stop => pb::FinishReason::Stop,
                            FinishReason::Length => pb::FinishReason::Length,
                        } as i32,
                        usage: Some(pb::Usage {
                            prompt_tokens: clamp_u32(prompt),
                            completion_tokens: clamp_u32(c.completion_tokens),
                            total_tokens: clamp_u32(prompt.saturating_add(c.completion_tokens)),
                            cached_tokens: clamp_u32(cached_tokens),
                        }),
                    })),
                });
            }
            Some((Ok(out), Some((chunks, codec))))
        });
        use futures_util::StreamExt;
        let events = futures_util::stream::once(async move { Ok(started) }).chain(pair.flat_map(
            |r: Result<Vec<pb::GenerateResponse>, Status>| match r {
                Ok(v) => futures_util::stream::iter(v.into_iter().map(Ok)).left_stream(),
                Err(s) => futures_util::stream::once(async move { Err(s) }).right_stream(),
            },
        ));
        let mut resp = Response::new(Box::pin(events) as EventStream);
        // The tenant's `x-ratelimit-*`, as the HTTP answers carry them, in the response's
        // metadata.
        for (k, v) in tenant.iter().flat_map(|t| t.rate_headers()) {
            if let Ok(v) = tonic::metadata::MetadataValue::try_from(v.as_str()) {
                resp.metadata_mut().insert(k, v);
            }
        }
        Ok(resp)
    }

    /// The live pair `raw` if the caller may see it (its own, or any when tenants are off).
    fn own_pair(&self, call: &Call, raw: &str) -> Result<(PairId, crate::pair::PairInfo), Status> {
        let not_found = || Status::not_found(format!("no live pair `{raw}`"));
        let id = PairId::from_raw(raw.parse::<u64>().map_err(|_| not_found())?);
        let info = self.state.registry.get(id).ok_or_else(not_found)?;
        let caller = call.tenant.as_ref().map(|t| &t.name);
        if call.tenant.is_some() && info.tenant.as_ref() != caller {
            // Another tenant's pair does not exist, as far as this caller can tell.
            return Err(not_found());
        }
        Ok((id, info))
    }
}

impl FrontRequest for pb::GenerateRequest {
    type Shape = ();

    fn model(&self) -> Option<&str> {
        (!self.model.is_empty()).then_some(&self.model)
    }

    fn validate(
        self,
        model: &lockstep_core::config::ModelConfig,
    ) -> Result<(Input, SamplingParams, ()), LockstepError> {
        let (sampling, ..) = sampling(self.sampling, model)?;
        let prompt = match self.prompt {
            Some(pb::generate_request::Prompt::Text(t)) => Prompt::Text(t),
            Some(pb::generate_request::Prompt::InputIds(ids)) => Prompt::Ids(ids.ids),
            None => {
                return Err(super::openai::bad(
                    "prompt",
                    "`text` or `input_ids` is required".into(),
                ));
            }
        };
        Ok((Input::Prompt(prompt), sampling, ()))
    }
}

impl FrontRequest for pb::ChatRequest {
    type Shape = ();

    fn model(&self) -> Option<&str> {
        (!self.model.is_empty()).then_some(&self.model)
    }

    fn validate(
        self,
        model: &lockstep_core::config::ModelConfig,
    ) -> Result<(Input, SamplingParams, ()), LockstepError> {
        let (sampling, ..) = sampling(self.sampling, model)?;
        let messages = to_messages(
            self.messages
                .into_iter()
                .map(|m| MessageIn {
                    role: m.role,
                    content: Some(Content::Text(m.content)),
                    rest: Default::default(),
                })
                .collect(),
        )?;
        Ok((Input::Chat(messages), sampling, ()))
    }
}

fn span(method: &str, meta: &tonic::metadata::MetadataMap) -> tracing::Span {
    let span = tracing::info_span!(
        "request",
        otel.name = %format!("grpc lockstep.v1.Lockstep/{method}"),
        rpc.system = "grpc",
        rpc.method = method,
    );
    lockstep_runtime::telemetry::adopt_parent(&span, &meta.clone().into_headers());
    span
}

#[tonic::async_trait]
impl Lockstep for Front {
    type GenerateStream = EventStream;
    type ChatStream = EventStream;

    async fn generate(
        &self,
        req: Request<pb::GenerateRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let span = span("Generate", req.metadata());
        self.generation(req).instrument(span).await
    }

    async fn chat(&self, req: Request<pb::ChatRequest>) -> Result<Response<EventStream>, Status> {
        let span = span("Chat", req.metadata());
        self.generation(req).instrument(span).await
    }

    async fn abort(
        &self,
        req: Request<pb::AbortRequest>,
    ) -> Result<Response<pb::AbortResponse>, Status> {
        let call = self.call(&req)?;
        let (id, info) = self.own_pair(&call, &req.get_ref().pair_id)?;
        if !self.state.registry.cancel(id, CancelReason::Client) {
            return Err(Status::not_found(format!("no live pair `{id}`")));
        }
        Ok(Response::new(pb::AbortResponse {
            state: info.state.as_str().into(),
        }))
    }

    async fn get_pair(
        &self,
        req: Request<pb::GetPairRequest>,
    ) -> Result<Response<pb::PairInfo>, Status> {
        let call = self.call(&req)?;
        let (id, info) = self.own_pair(&call, &req.get_ref().pair_id)?;
        // Workers by their labels, never their addresses.
        let models = self.state.models.load();
        let pools = models.by_name.get(&*info.model).map(|m| &m.pairs);
        let label = |side: &str, url: &str| {
            pools
                .and_then(|p| match side {
                    "prefill" => p.prefill.label_of(side, url),
                    _ => p.decode.label_of(side, url),
                })
                .unwrap_or_default()
        };
        Ok(Response::new(pb::PairInfo {
            pair_id: id.to_string(),
            model: info.model.to_string(),
            state: info.state.as_str().into(),
            prefill_worker: label("prefill", &info.prefill),
            decode_worker: label("decode", &info.decode),
            age_ms: info.started.elapsed().as_millis() as u64,
        }))
    }

    async fn list_models(
        &self,
        req: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        let call = self.call(&req)?;
        let models = self
            .state
            .models
            .load()
            .by_name
            .values()
            .filter(|m| call.tenant.as_ref().is_none_or(|t| t.allows(&m.name)))
            .map(|m| pb::Model {
                name: m.name.to_string(),
                context_window: m.cfg.context_window,
                backend: m.cfg.backend.as_str().into(),
            })
            .collect();
        Ok(Response::new(pb::ListModelsResponse { models }))
    }
}

/// An upstream's count on the wire's u32 (saturating: a lying worker cannot wrap it).
fn clamp_u32(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

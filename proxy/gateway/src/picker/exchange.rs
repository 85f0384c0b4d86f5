//! One ext_proc stream: one HTTP request and its response, as Envoy streams them in
//! `FULL_DUPLEX_STREAMED` mode (request headers, body chunks to end of stream, optional
//! trailers; then response headers, body chunks, optional trailers). Every message Envoy sends
//! gets its answer in order; the request's headers are answered only once its body is whole and
//! the endpoints are picked.
//!
//! What a caller can make the picker hold is bounded before it holds it:
//! - the caller is authenticated and its tenant's limits taken on `request_headers`, so a request
//!   without a key (or over its limits) ends there, with an `ImmediateResponse`, before a byte of
//!   its body is read;
//! - the request (headers and body) must arrive within `server.body_timeout_ms` of the stream's
//!   start (408 `body_timeout`), and its body within `server.max_body_bytes` (413);
//! - [`crate::Picker`] caps the streams served at once (`epp.max_streams`) and the body bytes
//!   they hold together (`epp.max_buffered_bytes`, 503 past it).
//!
//! Health and readiness paths are the one exception to authentication: they are answered with a
//! decode endpoint and hold nothing (no slot, no permit).

use std::sync::Arc;

use super::policy as picker;
use crate::sidecar::PREFILLER_HEADER;
use bytes::{Bytes, BytesMut};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap as EnvoyHeaders, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as In;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Out;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::Struct;
use lockstep_core::error::LockstepError;
use lockstep_router::admission::Caller;
use lockstep_router::state::AppState;
use lockstep_routing::pool::{LoadGuard, host_port};
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio::time::Instant;
use tonic::{Status, Streaming};

use super::wire::{
    DESTINATION, destination_metadata, header, headers_of, served_as_picked, subset_of,
};

type Tx = mpsc::Sender<Result<ProcessingResponse, Status>>;

/// What is held while the request lives: both workers' slots, the tenant's permit.
struct Holds {
    _slots: Vec<LoadGuard>,
    _permit: lockstep_tenancy::tenant::Held,
    /// The endpoint picked.
    destination: String,
}

/// One stream's state.
pub(crate) struct Exchange {
    state: Arc<AppState>,
    chunk: usize,
    tx: Tx,
    headers: http::HeaderMap,
    path: String,
    subset: Option<Vec<String>>,
    body: BytesMut,
    /// The request's headers are answered (the endpoints picked).
    decided: bool,
    /// The caller, authenticated on the request's headers, with its tenant's permit.
    caller: Option<Caller>,
    /// When the request (headers and body) must have arrived by.
    deadline: Instant,
    held: Option<Holds>,
    /// This stream's place under `epp.max_streams`.
    _stream: OwnedSemaphorePermit,
    /// The picker's budget of body bytes held (`epp.max_buffered_bytes`).
    budget: Arc<tokio::sync::Semaphore>,
    /// What of it this stream's body holds, until the body goes on.
    holding: Option<OwnedSemaphorePermit>,
}

impl Exchange {
    pub(crate) fn new(
        state: Arc<AppState>,
        chunk: usize,
        tx: Tx,
        stream: OwnedSemaphorePermit,
        budget: Arc<tokio::sync::Semaphore>,
    ) -> Exchange {
        let deadline = Instant::now() + state.body_timeout;
        Exchange {
            state,
            chunk,
            tx,
            headers: http::HeaderMap::new(),
            path: String::new(),
            subset: None,
            body: BytesMut::new(),
            decided: false,
            caller: None,
            deadline,
            held: None,
            _stream: stream,
            budget,
            holding: None,
        }
    }

    /// Answers every message of the stream until it ends, or until an immediate response ends
    /// the request. Dropping the exchange frees what it held.
    pub(crate) async fn run(mut self, mut inbound: Streaming<ProcessingRequest>) {
        loop {
            // Until the request is whole, every message is awaited against its deadline; after,
            // the response streams at the pace of the workers (their own deadlines bound it).
            let next = if self.decided {
                inbound.message().await
            } else {
                match tokio::time::timeout_at(self.deadline, inbound.message()).await {
                    Ok(m) => m,
                    Err(_) => {
                        let ms = self.state.body_timeout.as_millis() as u64;
                        self.state.metrics.refusal("", "body_timeout");
                        self.immediate(&LockstepError::BodyTimeout { ms }).await;
                        return;
                    }
                }
            };
            let msg = match next {
                Ok(Some(m)) => m,
                Ok(None) => return,
                Err(e) => {
                    tracing::debug!(error = %e, "ext_proc stream ended");
                    return;
                }
            };
            match self.step(msg).await {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => {
                    // Fail closed: the request ends here with the error, in its API's shape.
                    self.immediate(&e).await;
                    return;
                }
            }
        }
    }

    /// One message; `Ok(false)`: the stream is over for us.
    async fn step(&mut self, msg: ProcessingRequest) -> Result<bool, LockstepError> {
        let metadata = msg.metadata_context;
        match msg.request {
            Some(In::RequestHeaders(h)) => {
                if self.decided || !self.path.is_empty() {
                    return Err(protocol("request headers twice"));
                }
                self.read_headers(h.headers.as_ref());
                if self.path.is_empty() {
                    return Err(protocol("request headers without :path"));
                }
                self.subset = subset_of(metadata.as_ref());
                // The key and the tenant's limits, before any of the body is read.
                if !picker::is_open(&self.path) {
                    self.caller = Some(
                        lockstep_router::admission::authorize(&self.state, &self.headers)
                            .map_err(|r| r.0)?,
                    );
                }
                if h.end_of_stream {
                    self.decide().await?;
                }
            }
            Some(In::RequestBody(b)) => {
                if self.path.is_empty() {
                    return Err(protocol("request body before its headers"));
                }
                if self.decided {
                    return Err(protocol("request body after the request ended"));
                }
                if self.body.len() + b.body.len() > self.state.max_body_bytes {
                    return Err(LockstepError::BodyTooLarge {
                        limit: self.state.max_body_bytes,
                    });
                }
                self.hold(b.body.len())?;
                self.body.extend_from_slice(&b.body);
                if b.end_of_stream || b.end_of_stream_without_message {
                    self.decide().await?;
                }
            }
            Some(In::RequestTrailers(_)) => {
                if self.path.is_empty() {
                    return Err(protocol("request trailers before its headers"));
                }
                if !self.decided {
                    self.decide().await?;
                }
                self.send(Out::RequestTrailers(TrailersResponse::default()), None)
                    .await?;
            }
            Some(In::ResponseHeaders(h)) => {
                self.check_served(metadata.as_ref())?;
                let end = h.end_of_stream;
                self.send(Out::ResponseHeaders(HeadersResponse::default()), None)
                    .await?;
                if end {
                    self.held = None;
                }
            }
            Some(In::ResponseBody(b)) => {
                let end = b.end_of_stream || b.end_of_stream_without_message;
                self.send_body(false, Bytes::from(b.body), end).await?;
                if end {
                    self.held = None;
                }
            }
            Some(In::ResponseTrailers(_)) => {
                self.send(Out::ResponseTrailers(TrailersResponse::default()), None)
                    .await?;
                self.held = None;
            }
            None => return Err(protocol("a message with no request")),
        }
        Ok(true)
    }

    fn read_headers(&mut self, h: Option<&EnvoyHeaders>) {
        let (path, headers) = headers_of(h);
        self.path = path;
        self.headers = headers;
    }

    /// Takes `n` more bytes of the picker's body budget for this stream's body: 503 when the
    /// streams hold all of it.
    fn hold(&mut self, n: usize) -> Result<(), LockstepError> {
        if n == 0 {
            return Ok(());
        }
        let more = u32::try_from(n)
            .ok()
            .and_then(|n| self.budget.clone().try_acquire_many_owned(n).ok())
            .ok_or_else(|| LockstepError::Unavailable {
                message: "the endpoint picker holds as many request bodies as it may \
                          (epp.max_buffered_bytes); retry"
                    .into(),
            })?;
        match &mut self.holding {
            Some(h) => h.merge(more),
            None => self.holding = Some(more),
        }
        Ok(())
    }

    /// The request is whole: admit it, pick, answer its headers, then send its body back.
    async fn decide(&mut self) -> Result<(), LockstepError> {
        self.decided = true;
        let body = std::mem::take(&mut self.body).freeze();
        // The body goes on (or the request ends): its bytes leave the budget when this returns.
        let _held = self.holding.take();
        let caller = self.caller.take();
        if picker::is_health(&self.path) {
            // Health and readiness: a decode endpoint, no slot held (a `Watch` keeps only its
            // tenant's permit).
            let d = self.decode_for_path()?;
            let destination = endpoint(&d)?;
            drop(d);
            let permit = caller.map(|c| c.permit).unwrap_or_default();
            return self
                .answer_headers(destination, None, Vec::new(), permit, body)
                .await;
        }
        let Some(caller) = caller else {
            return Err(protocol("a request not authenticated on its headers"));
        };
        let (slots, permit, prefill) = if picker::admitted_api(&self.path).is_some() {
            let admitted = picker::admit_wire(&self.state, &self.path, caller, body.clone())
                .await
                .map_err(|r| r.0)?;
            let pick = picker::pick(&self.state, &admitted, self.subset.as_deref())?;
            let prefill = endpoint(&pick.prefill)?;
            (
                vec![pick.decode, pick.prefill],
                admitted.caller.permit,
                Some(prefill),
            )
        } else if picker::is_grpc_generation(&self.path) {
            // gRPC `Generate` and `Chat`: the pair's prefill named as for HTTP (the sidecar's
            // SGLang decode cannot serve alone).
            let pick = picker::pick_grpc(&self.state, &caller, &body, self.subset.as_deref())?;
            let prefill = endpoint(&pick.prefill)?;
            (
                vec![pick.decode, pick.prefill],
                caller.permit,
                Some(prefill),
            )
        } else {
            // Any other path that reaches a worker: the caller authenticated on the headers,
            // holding its tenant's permit and a decode slot while the request lives.
            (vec![self.decode_for_path()?], caller.permit, None)
        };
        let destination = endpoint(&slots[0])?;
        self.answer_headers(destination, prefill, slots, permit, body)
            .await
    }

    /// A decode worker for a path that is not a generation, from the subset hint where the data
    /// plane sent one: 503 when none takes requests.
    fn decode_for_path(&self) -> Result<LoadGuard, LockstepError> {
        let d = match &self.subset {
            Some(s) => self
                .state
                .models
                .load()
                .by_name
                .values()
                .find_map(|m| lockstep_routing::pool::pick_within(&m.pairs.decode, s)),
            None => picker::any_decode(&self.state),
        };
        d.ok_or_else(|| LockstepError::Unavailable {
            message: "no decode endpoint takes requests".into(),
        })
    }

    /// Answers the request's headers with the picked endpoints, holding `slots` and `permit` as
    /// long as the request lives, then sends its body back unchanged.
    async fn answer_headers(
        &mut self,
        destination: String,
        prefill: Option<String>,
        slots: Vec<LoadGuard>,
        permit: lockstep_tenancy::tenant::Held,
        body: Bytes,
    ) -> Result<(), LockstepError> {
        tracing::debug!(path = %self.path, %destination, prefill = ?prefill, "picked");
        let mut set = vec![header(DESTINATION, &destination)];
        // A client's own `x-prefiller-host-port` never reaches a sidecar: it is replaced, or
        // removed where no prefill was picked.
        let mut remove = Vec::new();
        match &prefill {
            Some(p) => set.push(header(PREFILLER_HEADER, p)),
            None => remove.push(PREFILLER_HEADER.to_string()),
        }
        let common = CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers: set,
                remove_headers: remove,
            }),
            clear_route_cache: true,
            ..CommonResponse::default()
        };
        let metadata = destination_metadata(&destination);
        self.held = Some(Holds {
            _slots: slots,
            _permit: permit,
            destination,
        });
        self.send(
            Out::RequestHeaders(HeadersResponse {
                response: Some(common),
            }),
            Some(metadata),
        )
        .await?;
        // The body goes on unchanged, in chunks Envoy takes.
        let mut rest = body;
        while !rest.is_empty() {
            let piece = rest.split_to(rest.len().min(self.chunk));
            self.send_body(true, piece, rest.is_empty()).await?;
        }
        Ok(())
    }

    /// The data plane's report of the endpoint that served, where it sends one, must be the
    /// one picked (this picker names one endpoint, so no other may answer).
    fn check_served(&self, metadata: Option<&Metadata>) -> Result<(), LockstepError> {
        match &self.held {
            Some(h) => served_as_picked(metadata, &h.destination),
            None => Ok(()),
        }
    }

    async fn send_body(
        &self,
        request: bool,
        body: Bytes,
        end_of_stream: bool,
    ) -> Result<(), LockstepError> {
        let common = CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body: body.to_vec(),
                        end_of_stream,
                        ..StreamedBodyResponse::default()
                    },
                )),
            }),
            ..CommonResponse::default()
        };
        let r = BodyResponse {
            response: Some(common),
        };
        let out = if request {
            Out::RequestBody(r)
        } else {
            Out::ResponseBody(r)
        };
        self.send(out, None).await
    }

    async fn send(&self, out: Out, metadata: Option<Struct>) -> Result<(), LockstepError> {
        let msg = ProcessingResponse {
            response: Some(out),
            dynamic_metadata: metadata,
            ..ProcessingResponse::default()
        };
        self.tx
            .send(Ok(msg))
            .await
            .map_err(|_| LockstepError::Unavailable {
                message: "Envoy closed the ext_proc stream".into(),
            })
    }

    /// Ends the request with `e` as its response: status, the API's error body and the error's
    /// own headers (`Retry-After`, `WWW-Authenticate`).
    async fn immediate(&self, e: &LockstepError) {
        let mut set = vec![header("content-type", "application/json")];
        for (k, v) in e.headers() {
            set.push(header(k.as_str(), v.to_str().unwrap_or_default()));
        }
        let body = picker::error_body(&self.path, e).to_string();
        let r = ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(e.status().as_u16()),
            }),
            headers: Some(HeaderMutation {
                set_headers: set,
                remove_headers: Vec::new(),
            }),
            body: body.into_bytes(),
            details: format!("lockstep_epp_{}", e.code()),
            ..ImmediateResponse::default()
        };
        let _ = self
            .tx
            .send(Ok(ProcessingResponse {
                response: Some(Out::ImmediateResponse(r)),
                ..ProcessingResponse::default()
            }))
            .await;
    }
}

fn protocol(what: &str) -> LockstepError {
    LockstepError::Unavailable {
        message: format!("endpoint picker: ext_proc protocol: {what}"),
    }
}

/// A picked worker's `host:port`.
fn endpoint(g: &LoadGuard) -> Result<String, LockstepError> {
    host_port(&g.worker().url).ok_or_else(|| LockstepError::Unavailable {
        message: format!("worker URL {} has no host:port", g.worker().url),
    })
}

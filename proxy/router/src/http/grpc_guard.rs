//! What every gRPC call passes before tonic reads a byte of its body.
//!
//! tonic decodes a whole request message before a handler runs, so a check in the handler comes
//! too late: an anonymous client could hold megabytes per stream, on many streams, and never
//! finish them. This layer runs on the request's headers first:
//! - `lockstep.v1.Lockstep/*`: the API key is checked (UNAUTHENTICATED at once, the body never
//!   read), then the body is read within `server.max_body_bytes` (plus the 5-byte gRPC frame
//!   header) and `server.body_timeout_ms`, as an HTTP body is, before tonic sees it;
//! - `grpc.health.v1.Health/Check` and `/Watch`: no key (probes carry none); the one small
//!   request message read within 4 KiB and the body timeout;
//! - health `Watch` and reflection streams, which never end on their own: at most
//!   `server.grpc_max_long_streams` open at once (UNAVAILABLE past it), each ended after
//!   `server.grpc_stream_lifetime_ms` with UNAVAILABLE (clients re-open), so they cannot keep
//!   connections busy forever and fill `server.max_connections`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use bytes::Bytes;
use hyper::body::Frame;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::admission::{Refusal, identify};
use crate::state::AppState;
use lockstep_core::error::LockstepError;

/// Largest health request read (a `HealthCheckRequest` is one service name).
pub(super) const HEALTH_BODY_BYTES: usize = 4096;

/// Largest reflection request message decoded (a symbol or file name).
pub(super) const REFLECTION_MESSAGE_BYTES: usize = 64 * 1024;

/// The length-prefixed message framing of gRPC: one flag byte and a 4-byte length.
const GRPC_FRAME_HEADER: usize = 5;

/// Bounds on the gRPC listener's long-lived streams (`server.grpc_*`).
#[derive(Debug, Clone, Copy)]
pub struct GrpcLimits {
    /// Health-watch and reflection streams open at once.
    pub max_long_streams: usize,
    /// How long one of them may stay open.
    pub stream_lifetime: Duration,
}

/// The guard's state: the app's, and the slots of long-lived streams.
#[derive(Debug)]
pub(super) struct Guard {
    state: Arc<AppState>,
    long_streams: Arc<Semaphore>,
    max_long_streams: usize,
    lifetime: Duration,
}

impl Guard {
    pub(super) fn new(state: Arc<AppState>, limits: GrpcLimits) -> Self {
        Guard {
            state,
            long_streams: Arc::new(Semaphore::new(limits.max_long_streams)),
            max_long_streams: limits.max_long_streams,
            lifetime: limits.stream_lifetime,
        }
    }
}

/// What a path is, as far as the guard is concerned.
enum Kind {
    /// A `lockstep.v1.Lockstep` call: key, then a bounded body.
    Api,
    /// A health check: a bounded body; `long` for `Watch`.
    Health { long: bool },
    /// A reflection stream (bidirectional): bounded in count and lifetime.
    Reflection,
}

fn kind(path: &str) -> Option<Kind> {
    if path.starts_with("/lockstep.v1.Lockstep/") {
        Some(Kind::Api)
    } else if let Some(m) = path.strip_prefix("/grpc.health.v1.Health/") {
        Some(Kind::Health { long: m == "Watch" })
    } else if path.starts_with("/grpc.reflection.") {
        Some(Kind::Reflection)
    } else {
        None
    }
}

/// The axum middleware in front of the gRPC services.
pub(super) async fn guard(State(g): State<Arc<Guard>>, mut req: Request, next: Next) -> Response {
    let Some(kind) = kind(req.uri().path()) else {
        return next.run(req).await;
    };
    let st = &g.state;
    let (limit, long) = match kind {
        Kind::Api => {
            // The handler takes the caller from here: the key is checked once.
            match identify(st, req.headers()) {
                Ok(who) => req.extensions_mut().insert(who),
                Err(r) => return refuse(r.0),
            };
            (Some(st.max_body_bytes + GRPC_FRAME_HEADER), false)
        }
        Kind::Health { long } => (Some(HEALTH_BODY_BYTES + GRPC_FRAME_HEADER), long),
        Kind::Reflection => (None, true),
    };
    let permit = if long {
        match g.long_streams.clone().try_acquire_owned() {
            Ok(p) => Some(p),
            Err(_) => {
                return refuse(LockstepError::Unavailable {
                    message: format!(
                        "{} health-watch and reflection streams are open, the most allowed \
                         (server.grpc_max_long_streams); try again later",
                        g.max_long_streams
                    ),
                });
            }
        }
    } else {
        None
    };
    let req = match limit {
        None => req,
        Some(limit) => {
            let (parts, body) = req.into_parts();
            match super::extract::read_limited(&parts.headers, body, limit, st.body_timeout, false)
                .await
            {
                Ok(bytes) => Request::from_parts(parts, Body::from(bytes)),
                Err(e) => return refuse(Refusal::count(st, "", e).0),
            }
        }
    };
    let resp = next.run(req).await;
    match permit {
        None => resp,
        Some(permit) => resp.map(|body| {
            Body::new(Lifetime {
                inner: body,
                end: Box::pin(tokio::time::sleep(g.lifetime)),
                _permit: permit,
                done: false,
            })
        }),
    }
}

/// `e` as a trailers-only gRPC answer.
fn refuse(e: LockstepError) -> Response {
    e.to_status().into_http::<Body>()
}

/// A long-lived stream's response body: ended with UNAVAILABLE when its lifetime is over; holds
/// its slot until dropped.
struct Lifetime {
    inner: Body,
    end: Pin<Box<tokio::time::Sleep>>,
    _permit: OwnedSemaphorePermit,
    done: bool,
}

impl axum::body::HttpBody for Lifetime {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        if self.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => {
                if f.is_trailers() {
                    self.done = true;
                }
                return Poll::Ready(Some(Ok(f)));
            }
            Poll::Ready(other) => {
                self.done = true;
                return Poll::Ready(other);
            }
            Poll::Pending => {}
        }
        if self.end.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        self.done = true;
        let status = tonic::Status::unavailable(
            "this stream reached its lifetime (server.grpc_stream_lifetime_ms); open a new one",
        );
        let mut trailers = http::HeaderMap::new();
        match status.add_header(&mut trailers) {
            Ok(()) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
            Err(_) => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

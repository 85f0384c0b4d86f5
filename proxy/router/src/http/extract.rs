//! The HTTP side of the admission stage, as axum extractors: [`Authenticated`] (the caller's
//! tenant) and [`Admit`] (the whole stage for a generation route: authenticate, tenant limits, a
//! size-bounded typed JSON body whose errors name the failing field, then `admission::admit_body`). A
//! rejection is the refusal's response, already counted.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::HeaderMap;
use http::request::Parts;
use http_body_util::BodyExt;
use serde::de::DeserializeOwned;

use crate::admission::{Admitted, FrontRequest, Refusal, admit_body, authorize};
use crate::state::AppState;
use lockstep_core::error::LockstepError;
use lockstep_tenancy::tenant::Tenant;

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        self.0.into_response()
    }
}

/// The caller's tenant (`None` when lockstep runs open), for routes that take no limits.
#[derive(Debug)]
pub(crate) struct Authenticated(pub(crate) Option<Arc<Tenant>>);

impl FromRequestParts<Arc<AppState>> for Authenticated {
    type Rejection = Refusal;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<AppState>,
    ) -> Result<Self, Self::Rejection> {
        state
            .models
            .load()
            .tenants
            .authenticate(&parts.headers)
            .map(Authenticated)
            .map_err(|e| Refusal::count(state, "", e))
    }
}

/// A generation request through the whole admission stage: ready to become a pair, with the
/// shape its answer takes.
#[derive(Debug)]
pub(crate) struct Admit<R: FrontRequest>(pub(crate) Admitted, pub(crate) R::Shape);

impl<R> FromRequest<Arc<AppState>> for Admit<R>
where
    R: FrontRequest + DeserializeOwned + Send + 'static,
    R::Shape: Send,
{
    type Rejection = Refusal;

    async fn from_request(req: Request, state: &Arc<AppState>) -> Result<Self, Self::Rejection> {
        let (caller, bytes) = authorized_body(state, req).await?;
        let (admitted, shape) = admit_body::<R>(state, caller, bytes).await?;
        Ok(Admit(admitted, shape))
    }
}

/// Steps 1 and 2 of admission on the headers, then the body read within its bounds: the caller
/// and the body's bytes. An unauthenticated body is never read: the answer goes out now and the
/// connection closes after it (HTTP/1.1; h2 resets the stream).
pub(crate) async fn authorized_body(
    state: &Arc<AppState>,
    req: Request,
) -> Result<(crate::admission::Caller, Bytes), Refusal> {
    let (parts, body) = req.into_parts();
    let caller = match authorize(state, &parts.headers) {
        Ok(c) => c,
        Err(r @ Refusal(LockstepError::Unauthorized { .. })) => return Err(r),
        Err(r) => {
            discard(body).await;
            return Err(r);
        }
    };
    let bytes = read_body(state, &parts.headers, body)
        .await
        .map_err(|e| Refusal::count(state, "", e))?;
    Ok((caller, bytes))
}

/// Reads the body within the configured limit, mapping every failure to a stable error code:
/// 413 `body_too_large`, 400 `invalid_json` (unreadable) or 408 `body_timeout`.
pub(super) async fn read_body(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Bytes, LockstepError> {
    read_limited(
        headers,
        body,
        state.max_body_bytes,
        state.body_timeout,
        true,
    )
    .await
}

/// Reads `body` whole, refusing more than `limit` bytes (413 `body_too_large`, at once when the
/// declared length is over) and a body not finished within `timeout` of the call (408
/// `body_timeout`); an unreadable body is 400 `invalid_json`. With `drain`, a body refused as
/// too large is read on and thrown away for a moment first, so an HTTP/1.1 client still sending
/// it reads the answer rather than a reset (an h2 stream needs none of that).
pub(super) async fn read_limited(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    timeout: std::time::Duration,
    drain: bool,
) -> Result<Bytes, LockstepError> {
    let declared = headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        if drain {
            discard(body).await;
        }
        return Err(LockstepError::BodyTooLarge { limit });
    }
    let mut body = body;
    // Sized from the declared length (within the limit), so a long body is not copied as it grows.
    let mut buf = bytes::BytesMut::with_capacity(declared.map_or(0, |n| n as usize));
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(_) => {
                return Err(LockstepError::BodyTimeout {
                    ms: timeout.as_millis() as u64,
                });
            }
        };
        let frame = frame.map_err(|e| LockstepError::InvalidJson {
            message: format!("cannot read body: {e}"),
        })?;
        if let Ok(data) = frame.into_data() {
            if buf.len() + data.len() > limit {
                if drain {
                    discard(body).await;
                }
                return Err(LockstepError::BodyTooLarge { limit });
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(buf.freeze())
}

/// Reads and drops, frame by frame as it arrives (nothing is kept), what is left of a refused
/// body, bounded in bytes and time, before the error is sent, so the client, still writing, gets
/// the 413 or 429 instead of a broken pipe (nginx calls this a lingering close).
async fn discard(mut body: Body) {
    const DRAIN_BYTES: usize = 16 * 1024 * 1024;
    let drain = async {
        let mut seen = 0usize;
        while let Some(Ok(frame)) = body.frame().await {
            seen += frame.data_ref().map_or(0, |d| d.len());
            if seen > DRAIN_BYTES {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), drain).await;
}

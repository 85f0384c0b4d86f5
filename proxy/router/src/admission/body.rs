//! A JSON body into the admission stage: the one entry every caller with a request body uses
//! (the HTTP front ends, and next an endpoint picker reading Envoy's body), so the split between
//! admitting inline and on the low-priority pool lives in one place.

use std::sync::Arc;

use bytes::Bytes;
use serde::de::DeserializeOwned;

use super::{Admitted, Caller, FrontRequest, INLINE_TOKENIZE_BYTES, Refusal};
use super::{admit, admit_here, in_background};
use crate::state::AppState;
use lockstep_core::error::LockstepError;

/// Admits a request from its JSON body (already read within the size and time bounds) for a
/// caller already authorized ([`admit_sized`]: parsed with the rest of the work, inline or on
/// the low-priority pool by its size). Every refusal is counted once.
pub async fn admit_body<R>(
    state: &Arc<AppState>,
    caller: Caller,
    bytes: Bytes,
) -> Result<(Admitted, R::Shape), Refusal>
where
    R: FrontRequest + DeserializeOwned + Send + 'static,
    R::Shape: Send,
{
    let size = bytes.len();
    admit_sized(state, caller, size, move || parse_json::<R>(&bytes)).await
}

/// Admits a request already decoded by its transport (gRPC's protobuf; `size`: its encoded
/// length) as [`admit_body`] admits a JSON body of that size.
pub async fn admit_decoded<R>(
    state: &Arc<AppState>,
    caller: Caller,
    req: R,
    size: usize,
) -> Result<(Admitted, R::Shape), Refusal>
where
    R: FrontRequest + Send + 'static,
    R::Shape: Send,
{
    admit_sized(state, caller, size, move || Ok(req)).await
}

/// The one split between admitting inline and on the low-priority pool: a request up to
/// [`INLINE_TOKENIZE_BYTES`] is read (`read`: parsed, or already decoded) and admitted here
/// ([`admit`]); a longer one is read, templated and tokenized in one trip to the low-priority
/// pool ([`admit_here`] there), so a long prompt never holds a front-end thread.
async fn admit_sized<R, F>(
    state: &Arc<AppState>,
    caller: Caller,
    size: usize,
    read: F,
) -> Result<(Admitted, R::Shape), Refusal>
where
    R: FrontRequest + Send + 'static,
    R::Shape: Send,
    F: FnOnce() -> Result<R, LockstepError> + Send + 'static,
{
    let (mut admitted, shape) = if size <= INLINE_TOKENIZE_BYTES {
        let req = read().map_err(|e| Refusal::count(state, "", e))?;
        admit(state, caller, req).await?
    } else {
        let st = state.clone();
        in_background(state, move || {
            let req = read().map_err(|e| Refusal::count(&st, "", e));
            Ok(req.and_then(|req| admit_here(&st, caller, req)))
        })
        .await
        .map_err(|e| Refusal::count(state, "", e))??
    };
    claim_shared(state, &mut admitted).await?;
    // The role's prefill (`lockstep sidecar`: the one the request named, checked), after the
    // prompt is known to fit, so a refused prompt never makes a prefill join.
    let a = &admitted;
    admitted.prefill = state
        .role
        .pin_prefill(&a.model, &a.caller.role_data, a.ids.len())
        .await
        .map_err(|e| Refusal::count_for(state, &a.model.name, a.caller.tenant.as_deref(), e))?;
    Ok((admitted, shape))
}

/// The tenant's limits shared with the other replicas (`[shared]`): the request's concurrency
/// slot and token reservation, and those of its further choices, claimed from the store.
async fn claim_shared(state: &AppState, admitted: &mut Admitted) -> Result<(), Refusal> {
    let Some(t) = admitted.caller.tenant.clone() else {
        return Ok(());
    };
    let model = admitted.model.name.clone();
    let refuse = |e| Refusal::count_for(state, &model, Some(&t), e);
    admitted
        .caller
        .permit
        .claim_shared(&t)
        .await
        .map_err(refuse)?;
    for h in &mut admitted.further {
        h.claim_shared(&t).await.map_err(refuse)?;
    }
    Ok(())
}

/// Parses `bytes` as `T`: 400 `invalid_json`, or 400 `invalid_request` with the offending field
/// as `param`.
pub(crate) fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, LockstepError> {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return Err(LockstepError::InvalidJson {
            message: "body is not valid UTF-8".into(),
        });
    };
    // Parsed from the checked text, so strings are not checked again one by one (for a long
    // prompt, 50 µs of a 128 KiB body's parse). Most bodies parse: the path of a failure is
    // tracked only when a plain parse failed (the same deserializer with the path wrapped
    // around it, so it fails the same way).
    if let Ok(v) = serde_json::from_str(text) {
        return Ok(v);
    }
    let de = &mut serde_json::Deserializer::from_str(text);
    let v = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_data() {
            LockstepError::InvalidRequest {
                message: format!("`{path}`: {inner}"),
                param: (path != ".").then_some(path),
            }
        } else {
            LockstepError::InvalidJson {
                message: inner.to_string(),
            }
        }
    })?;
    // A value and then more is not one JSON body (the plain parse refuses it too).
    de.end().map_err(|e| LockstepError::InvalidJson {
        message: e.to_string(),
    })?;
    Ok(v)
}

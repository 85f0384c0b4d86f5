//! A JSON body into the admission stage: the one entry every caller with a request body uses
//! (the HTTP front ends, and next an endpoint picker reading Envoy's body), so the split between
//! admitting inline and on the low-priority pool lives in one place.

use std::sync::Arc;

use bytes::Bytes;
use serde::de::DeserializeOwned;

use super::{Admitted, Caller, FrontRequest, INLINE_TOKENIZE_BYTES, Refusal};
use super::{admit, admit_here, in_background};
use crate::error::LockstepError;
use crate::state::AppState;

/// Admits a request from its JSON body (already read within the size and time bounds) for a
/// caller already authorized: a body up to [`INLINE_TOKENIZE_BYTES`] is parsed and admitted
/// here ([`admit`]); a longer one is parsed, templated and tokenized in one trip to the
/// low-priority pool ([`admit_here`] there). Every refusal is counted once.
pub async fn admit_body<R>(
    state: &Arc<AppState>,
    caller: Caller,
    bytes: Bytes,
) -> Result<(Admitted, R::Shape), Refusal>
where
    R: FrontRequest + DeserializeOwned + Send + 'static,
    R::Shape: Send,
{
    if bytes.len() <= INLINE_TOKENIZE_BYTES {
        let parsed: R = parse_json(&bytes).map_err(|e| Refusal::count(state, "", e))?;
        return admit(state, caller, parsed).await;
    }
    let st = state.clone();
    in_background(state, move || {
        let parsed = parse_json::<R>(&bytes).map_err(|e| Refusal::count(&st, "", e));
        Ok(parsed.and_then(|req| admit_here(&st, caller, req)))
    })
    .await
    .map_err(|e| Refusal::count(state, "", e))?
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

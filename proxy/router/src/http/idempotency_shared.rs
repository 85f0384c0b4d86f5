//! The replicas' side of `Idempotency-Key` (`[shared]`): the key claimed in the shared store
//! before the request runs, the answer written there when it ends (within `max_answer_bytes`),
//! and a repeat on another replica answered from it. While the store cannot be reached, a
//! replica coordinates its own requests only (`[shared] on_unavailable = "local"`) or refuses
//! (`"deny"`: 503 `shared_store_unavailable`).

use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use base64::Engine;
use serde_json::{Value, json};

use crate::idempotency::{Entry, Head, Idempotency};
use lockstep_core::config::OnUnavailable;
use lockstep_core::error::LockstepError;
use lockstep_tenancy::shared::{IdempotencyClaim, SharedStore};

fn hex(fp: &[u8; 32]) -> String {
    fp.iter().map(|b| format!("{b:02x}")).collect()
}

fn window_ms(idem: &Idempotency) -> u64 {
    idem.cfg.window_secs.saturating_mul(1000)
}

/// An answer as the store keeps it: status, headers, body.
fn encode(head: &Head, body: &[bytes::Bytes]) -> Vec<u8> {
    let headers: Vec<(String, String)> = head
        .headers
        .iter()
        .filter_map(|(k, v)| Some((k.to_string(), v.to_str().ok()?.to_string())))
        .collect();
    let bytes: Vec<u8> = body.iter().flat_map(|c| c.iter().copied()).collect();
    json!({
        "status": head.status.as_u16(),
        "headers": headers,
        "body": base64::engine::general_purpose::STANDARD.encode(bytes),
    })
    .to_string()
    .into_bytes()
}

/// A kept answer read back (`None`: unreadable).
fn decode(raw: &[u8]) -> Option<(Head, Vec<u8>)> {
    let v: Value = serde_json::from_slice(raw).ok()?;
    let status = http::StatusCode::from_u16(u16::try_from(v["status"].as_u64()?).ok()?).ok()?;
    let headers = v["headers"]
        .as_array()?
        .iter()
        .filter_map(|h| {
            let k = http::HeaderName::from_bytes(h[0].as_str()?.as_bytes()).ok()?;
            let v = http::HeaderValue::from_str(h[1].as_str()?).ok()?;
            Some((k, v))
        })
        .collect();
    let body = base64::engine::general_purpose::STANDARD
        .decode(v["body"].as_str()?)
        .ok()?;
    Some((Head { status, headers }, body))
}

/// Claims the key in the store: `None` when this replica runs the request; else the answer to
/// give (a replay of another replica's answer) or the refusal.
pub(super) async fn claim(
    store: &Arc<SharedStore>,
    tenant: &str,
    key: &str,
    fp: &[u8; 32],
    idem: &Idempotency,
) -> Result<Option<Response>, LockstepError> {
    let fingerprint = hex(fp);
    let claimed = store
        .idem_claim(tenant, key, &fingerprint, window_ms(idem))
        .await;
    match claimed {
        Ok(IdempotencyClaim::Ours) => Ok(None),
        Ok(IdempotencyClaim::Seen {
            fingerprint: theirs,
            ..
        }) if theirs != fingerprint => {
            idem.count("mismatch");
            Err(LockstepError::IdempotencyKeyReused {
                key: key.to_string(),
            })
        }
        Ok(IdempotencyClaim::Seen { done: false, .. }) => {
            idem.count("in_progress");
            Err(LockstepError::IdempotencyConflict {
                message: "a request with this Idempotency-Key is running on another replica; retry shortly to get its answer".into(),
                retry: true,
            })
        }
        Ok(IdempotencyClaim::Seen { answer, .. }) => match answer.as_deref().and_then(decode) {
            Some((head, body)) => {
                idem.count("replayed");
                Ok(Some(head.response(Body::from(body), true)))
            }
            None => {
                idem.count("not_kept");
                Err(LockstepError::IdempotencyConflict {
                    message: "the answer to this Idempotency-Key was not kept (too large); it is not generated twice: use a new key".into(),
                    retry: false,
                })
            }
        },
        Err(e) => match store.config().on_unavailable {
            OnUnavailable::Local => {
                tracing::warn!(
                    "idempotency: the shared store cannot be reached ({e}); coordinating this replica's requests only"
                );
                Ok(None)
            }
            OnUnavailable::Deny => Err(LockstepError::SharedStoreUnavailable {
                message: format!(
                    "the shared store cannot be reached to coordinate the Idempotency-Key: {e}"
                ),
            }),
        },
    }
}

/// The request's answer ended whole: written for the other replicas (when kept).
pub(super) async fn finished(
    store: &Arc<SharedStore>,
    tenant: &str,
    key: &str,
    fp: &[u8; 32],
    entry: &Entry,
    idem: &Idempotency,
) {
    let answer = entry.kept().map(|(head, body)| encode(&head, &body));
    let answer = answer.filter(|a| a.len() <= idem.cfg.max_answer_bytes.saturating_mul(2));
    if let Err(e) = store
        .idem_done(tenant, key, &hex(fp), answer.as_deref(), window_ms(idem))
        .await
    {
        tracing::warn!("idempotency: cannot write the answer to the shared store: {e}");
    }
}

/// The request's answer may change on a retry: the key is forgotten in the store too.
pub(super) async fn release(store: &Arc<SharedStore>, tenant: &str, key: &str) {
    if let Err(e) = store.idem_release(tenant, key).await {
        tracing::warn!("idempotency: cannot release the key in the shared store: {e}");
    }
}

//! `lockstep sidecar`: which prefill an admitted request's pair uses. The endpoint picker names
//! one in `x-prefiller-host-port` ([`crate::pool::NamedPrefills`] reads it at admission); the pair
//! is pinned to it, after it is found to be a prefill this sidecar may call and one that passed
//! the deployment check with the local decode:
//! - a member of the prefill pool (configured or discovered) is used as it is;
//! - an address inside `sidecar.prefill_allow` joins the pool (a [`MemberChange::Join`], so the
//!   member task checks it with the verified set, as any worker that joins at run time) and the
//!   request waits for that check, up to `sidecar.verify_wait_ms`; a failed check is 503
//!   `prefill_unverified` naming why;
//! - anything else is 403 `prefill_not_allowed`, and nothing is contacted.
//!
//! No prefill named: vLLM's decode serves the request alone (llm-d's sidecar does the same when
//! the picker decides against disaggregation), SGLang's cannot (503 `prefill_required`).

use std::time::Duration;

use crate::config::{BackendKind, WorkerConfig};
use crate::error::LockstepError;
use crate::pool::{MemberChange, NamedPrefill, NamedPrefills, PrefillPin};
use crate::state::ModelRuntime;
use crate::vocab::Side;

/// SGLang's default bootstrap port (`--disaggregation-bootstrap-port`).
const SGLANG_BOOTSTRAP_PORT: u16 = 8998;

/// The prefill the pair of a request on `model` uses, from what the request named.
pub(crate) async fn pin(
    policy: &NamedPrefills,
    model: &ModelRuntime,
    named: Option<&NamedPrefill>,
) -> Result<PrefillPin, LockstepError> {
    let Some(named) = named else {
        // The backend says whether its decode can serve alone (vLLM's can, SGLang's cannot).
        return if model.pairs.backend.serves_alone() {
            Ok(PrefillPin::Alone)
        } else {
            Err(LockstepError::PrefillRequired {
                model: model.name.to_string(),
            })
        };
    };
    let url = named.url();
    let pool = &model.pairs.prefill;
    if pool.member_at(&url).is_none() {
        if !named.ip.is_some_and(|ip| policy.allows(ip)) {
            return Err(LockstepError::PrefillNotAllowed {
                prefill: named.host_port.clone(),
            });
        }
        join(policy, model, &url)?;
    }
    let deadline = tokio::time::Instant::now() + policy.verify_wait;
    loop {
        let Some(w) = pool.member_at(&url) else {
            // Not yet joined (the member task applies the change), or it left again.
            if tokio::time::Instant::now() >= deadline {
                return Err(unverified(&url, "it did not join the prefill pool in time"));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        if w.is_verified() {
            return Ok(PrefillPin::At(url.into()));
        }
        if let Some(why) = w.check_error() {
            return Err(unverified(&url, &why));
        }
        if tokio::time::Instant::now() >= deadline {
            let ms = policy.verify_wait.as_millis();
            return Err(unverified(
                &url,
                &format!("its deployment check did not finish within {ms} ms"),
            ));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn unverified(url: &str, why: &str) -> LockstepError {
    LockstepError::PrefillUnverified {
        prefill: url.to_string(),
        reason: why.to_string(),
    }
}

/// Asks the model's member task to add `url` to the prefill pool, first making room: past
/// `sidecar.max_prefills` named members, the idle one that joined first leaves.
fn join(policy: &NamedPrefills, model: &ModelRuntime, url: &str) -> Result<(), LockstepError> {
    let feed = model
        .members
        .as_ref()
        .ok_or_else(|| LockstepError::Unavailable {
            message: format!("model `{}` takes no prefill named at run time", model.name),
        })?;
    let named: Vec<_> = model
        .pairs
        .prefill
        .workers()
        .iter()
        .filter(|w| w.joined())
        .cloned()
        .collect();
    if named.len() >= policy.max_members {
        let Some(idle) = named.iter().find(|w| w.in_flight() == 0) else {
            return Err(LockstepError::WorkersBusy {
                model: model.name.to_string(),
                side: Side::Prefill.as_str(),
            });
        };
        feed.send(MemberChange::Leave {
            side: Side::Prefill,
            url: idle.url.clone(),
        });
    }
    let port = model
        .cfg
        .prefill
        .bootstrap_port
        .unwrap_or(SGLANG_BOOTSTRAP_PORT);
    let sent = feed.send(MemberChange::Join {
        side: Side::Prefill,
        worker: WorkerConfig {
            url: url.to_string(),
            bootstrap_port: (model.cfg.backend == BackendKind::Sglang).then_some(port),
            bootstrap_host: None,
            kv_events: None,
            kv_events_replay: None,
        },
    });
    if sent {
        Ok(())
    } else {
        Err(LockstepError::Unavailable {
            message: format!("model `{}` is being replaced; retry", model.name),
        })
    }
}

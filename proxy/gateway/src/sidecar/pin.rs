//! `lockstep sidecar`: which prefill an admitted request's pair uses. The endpoint picker names
//! one in `x-prefiller-host-port` ([`lockstep_routing::pool::NamedPrefills`] reads it at admission); the pair
//! is pinned to it, after it is found to be a prefill this sidecar may call and one that passed
//! the deployment check with the local decode:
//! - a member of the prefill pool (configured or discovered) is used as it is;
//! - an address inside `sidecar.prefill_allow` is kept within `sidecar.max_prefills` (reserved
//!   before it joins) and joins the pool (a [`lockstep_routing::pool::MemberChange::Named`], so the member
//!   task checks it with the verified set, as any worker that joins at run time, and what it
//!   reports never lowers the model's limits) and the request waits for that check, up to
//!   `sidecar.verify_wait_ms`; a failed check is 503 `prefill_unverified` (the reason goes to
//!   the log, not to the client);
//! - anything else, and an address off loopback when the prefill pool's API key would reach it
//!   over plain `http://` (the `insecure_plaintext` rule), is 403 `prefill_not_allowed`, and
//!   nothing is contacted.
//!
//! No prefill named: vLLM's decode serves the request alone (llm-d's sidecar does the same when
//! the picker decides against disaggregation), SGLang's cannot (503 `prefill_required`).

use std::time::Duration;

use super::named::{NamedPrefill, NamedPrefills};
use lockstep_core::config::{BackendKind, WorkerConfig};
use lockstep_core::error::LockstepError;
use lockstep_router::state::ModelRuntime;
use lockstep_routing::pool::PrefillPin;

/// SGLang's default bootstrap port (`--disaggregation-bootstrap-port`).
const SGLANG_BOOTSTRAP_PORT: u16 = 8998;

/// The prefill the pair of a request on `model` uses, from what the request named;
/// `prompt_tokens`: the request's prompt (a named prefill's own limit applies to it).
pub async fn pin(
    policy: &NamedPrefills,
    model: &ModelRuntime,
    named: Option<&NamedPrefill>,
    prompt_tokens: usize,
) -> Result<PrefillPin, LockstepError> {
    let Some(named) = named else {
        // The backend says whether its decode can serve alone (vLLM's can, SGLang's cannot).
        return if model.pairs.backend.capabilities().serves_alone {
            Ok(PrefillPin::Alone)
        } else {
            Err(LockstepError::PrefillRequired {
                model: model.name.to_string(),
            })
        };
    };
    let url = named.url();
    let pool = &model.pairs.prefill;
    // A member from the configuration or discovery is used as it is; anything else is a
    // prefill named at run time, allowed, then kept within `sidecar.max_prefills`.
    if pool.member_at(&url).is_none_or(|w| w.named()) {
        let Some(ip) = named.ip.filter(|ip| policy.allows(*ip, named.port)) else {
            return Err(LockstepError::PrefillNotAllowed {
                prefill: named.host_port.clone(),
            });
        };
        if key_in_plaintext(model, ip) {
            tracing::warn!(model = %model.name, prefill = %named.host_port, "named prefill refused: the prefill pool's API key would cross the network in plaintext (http:// off loopback); set models.prefill.insecure_plaintext = true (UNSAFE) to allow it");
            return Err(LockstepError::PrefillNotAllowed {
                prefill: named.host_port.clone(),
            });
        }
        let feed = model
            .members
            .as_ref()
            .ok_or_else(|| LockstepError::Unavailable {
                message: format!("model `{}` takes no prefill named at run time", model.name),
            })?;
        policy.keep(pool, feed, named_worker(model, &url), &model.name)?;
    }
    let deadline = tokio::time::Instant::now() + policy.verify_wait;
    loop {
        let Some(w) = pool.member_at(&url) else {
            // Not yet joined (the member task applies the change), or it left again.
            if tokio::time::Instant::now() >= deadline {
                return Err(unverified(
                    named,
                    &url,
                    "it did not join the prefill pool in time",
                ));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        if w.is_verified() {
            // What the named prefill reported limits the pairs pinned to it alone.
            if let Some(limit) = w.own_prompt_limit()
                && prompt_tokens as u64 > limit
            {
                return Err(LockstepError::PromptTooLong {
                    prompt_tokens: prompt_tokens as u64,
                    limit,
                });
            }
            return Ok(PrefillPin::At(url.into()));
        }
        if let Some(why) = w.check_error() {
            return Err(unverified(named, &url, &why));
        }
        if tokio::time::Instant::now() >= deadline {
            let ms = policy.verify_wait.as_millis();
            return Err(unverified(
                named,
                &url,
                &format!("its deployment check did not finish within {ms} ms"),
            ));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Whether calling a named prefill at `ip` would send the prefill pool's API key over the
/// network in plaintext: the rule configured workers are held to (`insecure_plaintext`).
fn key_in_plaintext(model: &ModelRuntime, ip: std::net::IpAddr) -> bool {
    let pool = &model.cfg.prefill;
    let loopback = match ip {
        std::net::IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map_or(v6.is_loopback(), |v4| v4.is_loopback()),
        std::net::IpAddr::V4(v4) => v4.is_loopback(),
    };
    (pool.api_key.is_some() || pool.admin_api_key.is_some())
        && !pool.insecure_plaintext
        && !loopback
}

/// 503 `prefill_unverified`: the client learns which of its names failed (what it sent), never
/// why (connect errors, a worker's answers, other workers' URLs); the log has the reason.
fn unverified(named: &NamedPrefill, url: &str, why: &str) -> LockstepError {
    tracing::warn!(prefill = %url, reason = %why, "named prefill not verified: request refused");
    LockstepError::PrefillUnverified {
        prefill: named.host_port.clone(),
    }
}

/// The worker settings a prefill named at `url` joins with.
fn named_worker(model: &ModelRuntime, url: &str) -> WorkerConfig {
    let port = model
        .cfg
        .prefill
        .bootstrap_port
        .unwrap_or(SGLANG_BOOTSTRAP_PORT);
    WorkerConfig {
        url: url.to_string(),
        bootstrap_port: (model.cfg.backend == BackendKind::Sglang).then_some(port),
        bootstrap_host: None,
        kv_events: None,
        kv_events_replay: None,
    }
}

//! Picking both workers of a pair, as a pool function: the lifecycle calls it for every attempt,
//! and anything that must choose a pair without proxying it (an endpoint picker in front of
//! Envoy, a migration to a fresh decode) calls the same one. The prefill may be pinned to a
//! member of the prefill pool, named by URL; a URL that is not a member (one a request made up)
//! is never contacted.

use std::sync::Arc;

use super::{LoadGuard, RouteKey, Upstream, WorkerPool};
use lockstep_core::ids::Side;

/// How the prefill worker is chosen.
#[derive(Debug, Clone, Copy)]
pub enum PrefillChoice<'a> {
    /// By the pool's policy, avoiding this worker (the one a retry names) where it can.
    Pick {
        /// The worker to avoid.
        avoid: Option<&'a Arc<Upstream>>,
    },
    /// This member of the prefill pool (by URL), if it takes pairs now.
    Pinned(&'a str),
}

/// Where a request's prefill runs, as admission settled it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum PrefillPin {
    /// Picked from the prefill pool by its policy.
    #[default]
    Pool,
    /// The member of the prefill pool at this URL (`lockstep sidecar`: the prefill an endpoint
    /// picker named, verified).
    At(Arc<str>),
    /// No prefill: the decode worker serves the request alone (`lockstep sidecar` on vLLM when
    /// the picker named none); only for backends that serve alone
    /// (`PdBackend::serves_alone`).
    Alone,
}

/// Both workers of one pair, each holding its slot (`max_pairs_per_worker`) while the guard
/// lives.
#[derive(Debug)]
pub struct PairPick {
    /// The prefill worker's slot.
    pub prefill: LoadGuard,
    /// The decode worker's slot.
    pub decode: LoadGuard,
}

/// Picks a prefill and a decode worker for a prompt (`key`: its tokens and tenant salt, for
/// prefix-aware policies); `Err` names the side no worker could take. A prefill slot taken
/// before the decode side fails is given back (the guard drops).
pub fn pick_pair(
    prefill: &WorkerPool,
    decode: &WorkerPool,
    key: Option<&RouteKey>,
    prefill_choice: PrefillChoice,
    avoid_decode: Option<&Arc<Upstream>>,
) -> Result<PairPick, Side> {
    let p = match prefill_choice {
        PrefillChoice::Pick { avoid } => prefill.pick(avoid, key),
        PrefillChoice::Pinned(url) => prefill
            .member_at(url)
            .filter(|w| w.accepts_pairs())
            .and_then(|w| LoadGuard::try_new(w.clone(), prefill.max_pairs)),
    }
    .ok_or(Side::Prefill)?;
    let d = decode.pick(avoid_decode, key).ok_or(Side::Decode)?;
    Ok(PairPick {
        prefill: p,
        decode: d,
    })
}

/// A worker's `host:port` (how Envoy and the endpoint picker protocol name an endpoint), from
/// its URL.
pub fn host_port(url: &str) -> Option<String> {
    let uri = url.parse::<http::Uri>().ok()?;
    let auth = uri.authority()?;
    let port = auth.port_u16().or(match uri.scheme_str() {
        Some("https") => Some(443),
        _ => Some(80),
    })?;
    Some(format!("{}:{port}", auth.host()))
}

/// The least-loaded worker of `pool` that takes pairs and whose `host:port` is in `subset` (the
/// data plane's subset hint: the picker must choose from it), with its slot taken.
pub fn pick_within(pool: &WorkerPool, subset: &[String]) -> Option<LoadGuard> {
    let max = pool.max_pairs;
    let workers = pool.workers();
    let mut open: Vec<&Arc<Upstream>> = workers
        .iter()
        .filter(|w| w.accepts_pairs() && (max == 0 || w.in_flight() < max))
        .filter(|w| host_port(&w.url).is_some_and(|hp| subset.contains(&hp)))
        .collect();
    open.sort_by_key(|w| w.in_flight());
    open.into_iter()
        .find_map(|w| LoadGuard::try_new(w.clone(), max))
}

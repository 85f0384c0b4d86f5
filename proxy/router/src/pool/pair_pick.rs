//! Picking both workers of a pair, as a pool function: the lifecycle calls it for every attempt,
//! and anything that must choose a pair without proxying it (an endpoint picker in front of
//! Envoy, a migration to a fresh decode) calls the same one. The prefill may be pinned to a
//! member of the prefill pool, named by URL; a URL that is not a member (one a request made up)
//! is never contacted.

use std::sync::Arc;

use super::{LoadGuard, RouteKey, Upstream, WorkerPool};
use crate::vocab::Side;

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
            .workers()
            .iter()
            .find(|w| w.url == url)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{PoolConfig, WorkerConfig};

    fn pool(ports: &[u16], max: usize) -> WorkerPool {
        WorkerPool::new(&PoolConfig {
            max_pairs_per_worker: max,
            workers: ports
                .iter()
                .map(|p| WorkerConfig {
                    url: format!("http://127.0.0.1:{p}"),
                    bootstrap_port: None,
                    bootstrap_host: None,
                })
                .collect(),
            ..PoolConfig::default()
        })
    }

    #[test]
    fn both_sides_are_picked_and_a_pinned_prefill_must_be_a_member() {
        let (p, d) = (pool(&[3000, 3001], 1), pool(&[4000], 0));
        let got =
            pick_pair(&p, &d, None, PrefillChoice::Pick { avoid: None }, None).expect("a pair");
        assert_eq!(got.decode.worker().url, "http://127.0.0.1:4000");
        drop(got);
        let pinned = pick_pair(
            &p,
            &d,
            None,
            PrefillChoice::Pinned("http://127.0.0.1:3001"),
            None,
        )
        .expect("the pinned member");
        assert_eq!(pinned.prefill.worker().url, "http://127.0.0.1:3001");
        // Its one slot is held: pinning it again finds it full.
        let again = pick_pair(
            &p,
            &d,
            None,
            PrefillChoice::Pinned("http://127.0.0.1:3001"),
            None,
        );
        assert_eq!(again.err(), Some(Side::Prefill));
        drop(pinned);
        // A URL outside the pool is never picked, however it is spelled.
        for url in ["http://127.0.0.1:9999", "http://127.0.0.1:3001/", ""] {
            let r = pick_pair(&p, &d, None, PrefillChoice::Pinned(url), None);
            assert_eq!(r.err(), Some(Side::Prefill), "{url}");
        }
        assert!(p.workers().iter().all(|w| w.in_flight() == 0));
    }

    #[test]
    fn a_decode_side_that_cannot_take_the_pair_gives_the_prefill_slot_back() {
        let (p, d) = (pool(&[3000], 0), pool(&[4000], 1));
        let held = d.pick(None, None).expect("the decode's only slot");
        let r = pick_pair(&p, &d, None, PrefillChoice::Pick { avoid: None }, None);
        assert_eq!(r.err(), Some(Side::Decode));
        assert_eq!(
            p.workers()[0].in_flight(),
            0,
            "the prefill slot was given back"
        );
        drop(held);
        assert!(pick_pair(&p, &d, None, PrefillChoice::Pick { avoid: None }, None).is_ok());
    }
}

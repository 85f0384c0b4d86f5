//! The deployment check (invariant 6), written once for every backend: a backend says what one
//! worker reports about itself ([`super::PdBackend::probe_worker`]); [`fold`] checks the set —
//! each worker's own problems, the facts every worker must share, the smallest capacity and
//! prompt limit against the model's window.
//!
//! The same fold runs at start, at every reload, in `lockstep check`, and for a worker checked
//! later (one that did not answer at start, or one that joined the pool at run time): it is then
//! checked together with the workers already verified ([`probe_member`], [`fold_member`]).

use std::collections::HashMap;

use super::{Deployment, PdBackend, Side};
use lockstep_core::config::{ModelConfig, WorkerConfig, deployment_check};

/// What one worker said about itself. Each `None` where it did not say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerReport {
    /// Tokens its KV pool holds.
    pub kv_tokens: Option<u64>,
    /// The longest prompt it accepts.
    pub max_prompt_tokens: Option<u64>,
    /// How long it keeps KV waiting for a pair's decode (lockstep workers).
    pub kv_lease_ms: Option<u64>,
    /// Facts that must be equal on every worker of the model (one model, one KV layout, one
    /// transfer backend).
    pub shared: Vec<Shared>,
    /// What is wrong with this worker on its own (a wrong role, a setting lockstep refuses).
    pub problems: Vec<String>,
}

/// A fact every worker of a model must report alike.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shared {
    /// What it is (`page_size`, `model fingerprint`).
    pub key: &'static str,
    /// Its value on this worker, as shown in a problem.
    pub value: String,
    /// Why a difference is refused.
    pub why: &'static str,
}

impl WorkerReport {
    /// Records a fact every worker must share.
    pub fn share(&mut self, key: &'static str, value: String, why: &'static str) {
        self.shared.push(Shared { key, value, why });
    }
}

/// Why a worker could not be probed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeError {
    /// No answer (connect error, timeout, broken exchange): the worker may come up later.
    Unreachable(String),
    /// An answer lockstep cannot accept (an API key wanted, an error status, not the server it
    /// should be): a problem now.
    Refused(String),
}

/// One probed worker of a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probed {
    /// Its side.
    pub side: Side,
    /// Its URL, without a trailing slash.
    pub url: String,
    /// What it reported.
    pub report: WorkerReport,
}

/// Checks a set of probed workers of `m`: every worker's own problems, each shared fact equal
/// on all (the first worker that reported it is the reference), the smallest reported capacity
/// (or the configured one) against the model's window. Returns the limits or every problem.
pub fn fold(m: &ModelConfig, set: &[Probed]) -> Result<Deployment, String> {
    let mut problems = Vec::new();
    let mut capacity = m.kv_capacity_tokens;
    let mut source = "configured kv_capacity_tokens".to_string();
    let mut prompt_limit: Option<u64> = None;
    let mut lease: Option<u64> = None;
    let mut first: HashMap<&'static str, (&str, &str)> = HashMap::new();
    for p in set {
        let at = format!("model `{}`: {} worker {}", m.name, p.side.as_str(), p.url);
        let r = &p.report;
        problems.extend(r.problems.iter().map(|e| format!("{at}: {e}")));
        for s in &r.shared {
            match first.get(s.key) {
                None => {
                    first.insert(s.key, (&p.url, &s.value));
                }
                Some((url, value)) if *value != s.value => problems.push(format!(
                    "{at}: {} = {} differs from {url}'s {value}: {}",
                    s.key, s.value, s.why
                )),
                Some(_) => {}
            }
        }
        if let Some(t) = r.kv_tokens
            && t < capacity
        {
            capacity = t;
            source = format!("reported by worker {}", p.url);
        }
        if let Some(limit) = r.max_prompt_tokens {
            prompt_limit = Some(prompt_limit.map_or(limit, |l| l.min(limit)));
        }
        lease = lease.max(r.kv_lease_ms);
    }
    if let Err(e) = deployment_check(&m.name, m.context_window, m.headroom, capacity, &source) {
        problems.push(e);
    }
    if problems.is_empty() {
        Ok(Deployment {
            kv_capacity: capacity,
            max_prompt_tokens: prompt_limit,
            unverified: Vec::new(),
            kv_lease_ms: lease,
            verified: set.to_vec(),
        })
    } else {
        Err(problems.join("\n"))
    }
}

/// Every configured worker of `m` with its side.
pub fn workers(m: &ModelConfig) -> impl Iterator<Item = (Side, &WorkerConfig)> {
    (m.prefill.workers.iter().map(|w| (Side::Prefill, w)))
        .chain(m.decode.workers.iter().map(|w| (Side::Decode, w)))
}

/// The deployment check of `m` through `backend`: every worker probed at once, then [`fold`].
/// A worker that does not answer is a warning; where the backend says so
/// ([`PdBackend::unreached_waits`]) it gets no pairs until it answers and passes
/// ([`Deployment::unverified`]). One that answers what lockstep refuses is a problem.
pub async fn check<B: PdBackend + ?Sized>(
    backend: &B,
    m: &ModelConfig,
) -> Result<Deployment, String> {
    let probes = workers(m).map(|(side, w)| async move {
        let url = w.url.trim_end_matches('/').to_string();
        (side, url, backend.probe_worker(m, side, w).await)
    });
    let mut set = Vec::new();
    let mut problems = Vec::new();
    let mut unverified = Vec::new();
    for (side, url, got) in futures_util::future::join_all(probes).await {
        match got {
            Ok(report) => set.push(Probed { side, url, report }),
            Err(ProbeError::Unreachable(e)) => {
                if backend.capabilities().unreached_waits {
                    tracing::warn!(model = %m.name, worker = %url, error = %e, "worker did not answer the deployment check: it gets no pairs until it answers and passes");
                    unverified.push((url, e));
                } else {
                    tracing::warn!(model = %m.name, worker = %url, error = %e, "worker did not answer the deployment check; using the configured limits");
                }
            }
            Err(ProbeError::Refused(e)) => problems.push(format!(
                "model `{}`: {} worker {url}: {e}",
                m.name,
                side.as_str()
            )),
        }
    }
    match fold(m, &set) {
        Ok(d) if problems.is_empty() => Ok(Deployment { unverified, ..d }),
        Ok(_) => Err(problems.join("\n")),
        Err(more) => {
            problems.push(more);
            Err(problems.join("\n"))
        }
    }
}

/// The first half of checking one worker that was not verified (it did not answer at start, or
/// it joined the pool at run time): what it reports of itself. It passes when the set of it and
/// the workers already verified passes ([`fold_member`]).
pub async fn probe_member<B: PdBackend + ?Sized>(
    backend: &B,
    m: &ModelConfig,
    side: Side,
    w: &WorkerConfig,
) -> Result<Probed, String> {
    let report = backend
        .probe_worker(m, side, w)
        .await
        .map_err(|e| match e {
            ProbeError::Unreachable(e) | ProbeError::Refused(e) => e,
        })?;
    Ok(Probed {
        side,
        url: w.url.trim_end_matches('/').to_string(),
        report,
    })
}

/// The second half of checking a member: what it reported ([`probe_member`]) folded with the
/// verified members' `known` reports ([`fold`]). Synchronous, so a caller that holds the verified
/// set while it folds and records checks each member together with every other one that passed.
pub fn fold_member(m: &ModelConfig, me: &Probed, known: &[Probed]) -> Result<Deployment, String> {
    let mut all: Vec<Probed> = known.iter().filter(|p| p.url != me.url).cloned().collect();
    all.push(me.clone());
    fold(m, &all)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both halves of checking a member, as the member tasks run them.
    async fn verify_member<B: PdBackend + ?Sized>(
        backend: &B,
        m: &ModelConfig,
        side: Side,
        w: &WorkerConfig,
        known: &[Probed],
    ) -> Result<(Probed, Deployment), String> {
        let me = probe_member(backend, m, side, w).await?;
        let d = fold_member(m, &me, known)?;
        Ok((me, d))
    }

    fn model() -> ModelConfig {
        lockstep_core::config::test_model("http://p", "http://d", "")
    }

    fn probed(side: Side, url: &str, report: WorkerReport) -> Probed {
        Probed {
            side,
            url: url.into(),
            report,
        }
    }

    #[test]
    fn the_fold_takes_the_smallest_limits_and_the_longest_lease() {
        let m = model();
        let a = WorkerReport {
            kv_tokens: Some(3000),
            max_prompt_tokens: Some(900),
            kv_lease_ms: Some(10),
            ..WorkerReport::default()
        };
        let b = WorkerReport {
            kv_tokens: Some(3500),
            max_prompt_tokens: Some(800),
            kv_lease_ms: Some(30),
            ..WorkerReport::default()
        };
        let d = fold(
            &m,
            &[
                probed(Side::Prefill, "http://p", a),
                probed(Side::Decode, "http://d", b),
            ],
        )
        .expect("ok");
        assert_eq!(
            (d.kv_capacity, d.max_prompt_tokens, d.kv_lease_ms),
            (3000, Some(800), Some(30))
        );
        assert_eq!(d.verified.len(), 2);
        // Nothing reported: the configured capacity, no limits.
        let d = fold(&m, &[]).expect("ok");
        assert_eq!((d.kv_capacity, d.max_prompt_tokens), (4000, None));
        // Too little capacity for the window fails, naming who reported it.
        let small = WorkerReport {
            kv_tokens: Some(900),
            ..WorkerReport::default()
        };
        let e = fold(&m, &[probed(Side::Decode, "http://d", small)]).expect_err("small");
        assert!(
            e.contains("deployment check failed") && e.contains("http://d"),
            "{e}"
        );
    }

    #[test]
    fn a_shared_fact_that_differs_and_a_workers_own_problem_are_each_named() {
        let m = model();
        let mut a = WorkerReport::default();
        a.share("page_size", "16".into(), "layouts must match");
        let mut b = WorkerReport::default();
        b.share("page_size", "32".into(), "layouts must match");
        b.problems.push("is a `prefill` worker".into());
        let mut c = WorkerReport::default();
        c.share("page_size", "16".into(), "layouts must match");
        let e = fold(
            &m,
            &[
                probed(Side::Prefill, "http://p", a),
                probed(Side::Decode, "http://d", b),
                probed(Side::Decode, "http://e", c),
            ],
        )
        .expect_err("differs");
        assert!(
            e.contains(
                "model `m`: decode worker http://d: page_size = 32 differs from http://p's 16: layouts must match"
            ),
            "{e}"
        );
        assert!(
            e.contains("model `m`: decode worker http://d: is a `prefill` worker"),
            "{e}"
        );
        // The third agrees with the first: two problems, not three.
        assert_eq!(e.lines().count(), 2, "{e}");
    }

    /// A backend whose workers answer as `answers` says, by URL (unlisted: unreachable).
    struct Answers {
        answers: Vec<(&'static str, Result<WorkerReport, ProbeError>)>,
        waits: bool,
    }

    impl PdBackend for Answers {
        fn prefill(
            &self,
            _: &super::super::Dispatch,
        ) -> futures_util::future::BoxFuture<
            'static,
            Result<super::super::PrefillReport, super::super::HalfError>,
        > {
            unreachable!("no pairs here")
        }
        fn decode(&self, _: &super::super::Dispatch) -> super::super::DecodeStream {
            unreachable!("no pairs here")
        }
        fn abort(
            &self,
            _: &super::super::Dispatch,
            _: Side,
        ) -> futures_util::future::BoxFuture<'static, Result<(), super::super::HalfError>> {
            unreachable!("no pairs here")
        }
        fn capabilities(&self) -> super::super::Capabilities {
            super::super::Capabilities {
                unreached_waits: self.waits,
                ..Default::default()
            }
        }
        fn probe_worker<'a>(
            &'a self,
            _: &'a ModelConfig,
            _: Side,
            w: &'a WorkerConfig,
        ) -> futures_util::future::BoxFuture<'a, Result<WorkerReport, ProbeError>> {
            let got = self
                .answers
                .iter()
                .find(|(u, _)| w.url.trim_end_matches('/') == *u)
                .map(|(_, r)| r.clone())
                .unwrap_or(Err(ProbeError::Unreachable("no answer".into())));
            Box::pin(std::future::ready(got))
        }
    }

    fn capacity(kv: u64) -> Result<WorkerReport, ProbeError> {
        Ok(WorkerReport {
            kv_tokens: Some(kv),
            ..WorkerReport::default()
        })
    }

    #[tokio::test]
    async fn every_worker_is_probed_and_one_that_does_not_answer_waits_where_the_backend_says() {
        let m = model();
        for waits in [true, false] {
            let b = Answers {
                answers: vec![("http://p", capacity(3000))],
                waits,
            };
            let d = check(&b, &m).await.expect("passes");
            assert_eq!(d.kv_capacity, 3000, "the prefill was probed");
            assert_eq!(d.verified.len(), 1);
            assert_eq!(d.verified[0].url, "http://p");
            let unverified: Vec<&str> = d.unverified.iter().map(|(u, _)| u.as_str()).collect();
            if waits {
                assert_eq!(unverified, ["http://d"]);
            } else {
                assert!(unverified.is_empty(), "{unverified:?}");
            }
        }
        // A refusal fails the check, named, whatever the others say.
        let b = Answers {
            answers: vec![
                ("http://p", capacity(3000)),
                ("http://d", Err(ProbeError::Refused("wants a key".into()))),
            ],
            waits: false,
        };
        let e = check(&b, &m).await.expect_err("refused");
        assert_eq!(e, "model `m`: decode worker http://d: wants a key");
        // A refusal and a failing fold: both reasons.
        let b = Answers {
            answers: vec![
                ("http://p", capacity(10)),
                ("http://d", Err(ProbeError::Refused("wants a key".into()))),
            ],
            waits: false,
        };
        let e = check(&b, &m).await.expect_err("refused");
        assert!(
            e.contains("wants a key") && e.contains("deployment check failed"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn a_member_checked_later_is_checked_with_the_set_and_replaces_its_old_report() {
        let m = model();
        let mut shared = WorkerReport::default();
        shared.share("page_size", "16".into(), "layouts");
        let known = vec![probed(Side::Prefill, "http://p", shared.clone())];
        let mut other = WorkerReport::default();
        other.share("page_size", "32".into(), "layouts");
        let w = WorkerConfig {
            url: "http://d/".into(),
            bootstrap_port: None,
            bootstrap_host: None,
            kv_events: None,
            kv_events_replay: None,
        };
        let b = Answers {
            answers: vec![("http://d", Ok(other))],
            waits: true,
        };
        let e = verify_member(&b, &m, Side::Decode, &w, &known)
            .await
            .expect_err("differs from the set");
        assert!(
            e.contains("page_size = 32 differs from http://p's 16"),
            "{e}"
        );
        // Agreeing, it passes; a stale report of its own URL is replaced, not kept beside it.
        let b = Answers {
            answers: vec![("http://d", Ok(shared.clone()))],
            waits: true,
        };
        let mut stale = WorkerReport::default();
        stale.share("page_size", "64".into(), "layouts");
        let known = vec![
            probed(Side::Prefill, "http://p", shared),
            probed(Side::Decode, "http://d", stale),
        ];
        let (me, d) = verify_member(&b, &m, Side::Decode, &w, &known)
            .await
            .expect("agrees");
        assert_eq!(me.url, "http://d");
        assert_eq!(d.verified.len(), 2);
        // Unreachable: an error, never a pass.
        let b = Answers {
            answers: Vec::new(),
            waits: true,
        };
        assert!(verify_member(&b, &m, Side::Decode, &w, &[]).await.is_err());
    }

    #[test]
    fn a_report_equal_to_the_configured_capacity_is_not_named_as_its_source() {
        let mut m = model();
        m.kv_capacity_tokens = 900;
        let e = fold(
            &m,
            &[probed(Side::Decode, "http://d", capacity(900).expect("r"))],
        )
        .expect_err("too small for the window");
        assert!(e.contains("configured kv_capacity_tokens"), "{e}");
    }
}

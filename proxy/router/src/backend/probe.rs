//! The deployment check (invariant 6), written once for every backend: a backend says what one
//! worker reports about itself ([`super::PdBackend::probe_worker`]); [`fold`] checks the set —
//! each worker's own problems, the facts every worker must share, the smallest capacity and
//! prompt limit against the model's window.
//!
//! The same fold runs at start, at every reload, in `lockstep check`, and for a worker checked
//! later (one that did not answer at start, or one that joined the pool at run time): it is then
//! checked together with the workers already verified ([`verify_member`]).

use std::collections::HashMap;

use super::{Deployment, PdBackend, Side};
use crate::config::{ModelConfig, WorkerConfig, deployment_check};

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
                if backend.unreached_waits() {
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

/// Checks one worker that was not verified (it did not answer at start, or it joined the pool at
/// run time) together with the workers already verified (`known`): it passes when the whole set
/// passes. Returns its report and the limits of the set with it.
pub async fn verify_member<B: PdBackend + ?Sized>(
    backend: &B,
    m: &ModelConfig,
    side: Side,
    w: &WorkerConfig,
    known: &[Probed],
) -> Result<(Probed, Deployment), String> {
    let report = backend
        .probe_worker(m, side, w)
        .await
        .map_err(|e| match e {
            ProbeError::Unreachable(e) | ProbeError::Refused(e) => e,
        })?;
    let me = Probed {
        side,
        url: w.url.trim_end_matches('/').to_string(),
        report,
    };
    let mut all: Vec<Probed> = known.iter().filter(|p| p.url != me.url).cloned().collect();
    all.push(me.clone());
    let d = fold(m, &all)?;
    Ok((me, d))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> ModelConfig {
        let text = r#"
[[models]]
name = "m"
backend = "vllm"
context_window = 1000
kv_capacity_tokens = 4000
tokenizer = "/t.json"
chat_template = { inline = "x" }
[models.prefill]
workers = [{ url = "http://p" }]
[models.decode]
workers = [{ url = "http://d" }]
"#;
        crate::config::Config::parse(text)
            .expect("config")
            .models
            .remove(0)
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
}

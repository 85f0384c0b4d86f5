//! Background health checks: the backend's probe (`GET /health`, or the worker service's `Health`
//! for lockstep workers) on every worker of a model, marking a worker unhealthy after
//! `failure_threshold` failures in a row and healthy again after `success_threshold` successes.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::Upstream;
use crate::config::HealthConfig;

/// Runs health checks for `workers` forever (the caller aborts the task on shutdown): `probe(url,
/// timeout)` says whether a worker is healthy.
pub async fn health_loop<P, F>(probe: P, workers: Vec<Arc<Upstream>>, cfg: HealthConfig)
where
    P: Fn(String, Duration) -> F,
    F: Future<Output = bool>,
{
    let mut tick = tokio::time::interval(Duration::from_millis(cfg.interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let checks = workers.iter().map(|w| {
            let cfg = &cfg;
            let check = probe(w.url.clone(), Duration::from_millis(cfg.timeout_ms));
            async move {
                let ok = check.await;
                w.record_health(ok, cfg);
            }
        });
        futures_util::future::join_all(checks).await;
    }
}

//! Background health checks: `GET /health` on every worker of a model, marking a worker unhealthy
//! after `failure_threshold` failures in a row and healthy again after `success_threshold`
//! successes.

use std::sync::Arc;
use std::time::Duration;

use super::Upstream;
use crate::backend::UpstreamClient;
use crate::config::HealthConfig;

/// Runs health checks for `workers` forever (the caller aborts the task on shutdown).
pub async fn health_loop(client: UpstreamClient, workers: Vec<Arc<Upstream>>, cfg: HealthConfig) {
    let mut tick = tokio::time::interval(Duration::from_millis(cfg.interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let checks = workers.iter().map(|w| {
            let client = client.clone();
            let cfg = &cfg;
            async move {
                let ok = client
                    .health(&w.url, Duration::from_millis(cfg.timeout_ms))
                    .await;
                w.record_health(ok, cfg);
            }
        });
        futures_util::future::join_all(checks).await;
    }
}

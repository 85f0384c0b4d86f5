//! The deployment probe of HTTP workers: the KV capacity each one reports (SGLang's
//! `/get_server_info` -> `max_total_num_tokens`), the smallest of them and the configured one,
//! checked against the model's context window.

use std::time::Duration;

use super::UpstreamClient;
use crate::config::{ModelConfig, deployment_check};

/// The capacity a worker reports (SGLang `/get_server_info` → `max_total_num_tokens`).
pub async fn probe_capacity(
    client: &UpstreamClient,
    base: &str,
    auth: Option<http::HeaderValue>,
) -> Option<u64> {
    let url = format!("{base}/get_server_info");
    let auth: Vec<_> = auth
        .map(|v| (http::header::AUTHORIZATION, v))
        .into_iter()
        .collect();
    let get = client.get_collect_with(&url, &auth);
    let (status, body) = tokio::time::timeout(Duration::from_secs(2), get)
        .await
        .ok()?
        .ok()?;
    if !(200..300).contains(&status) {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
    v.get("max_total_num_tokens")
        .or_else(|| v.pointer("/internal_states/0/max_total_num_tokens"))
        .and_then(serde_json::Value::as_u64)
}

/// Invariant 6 against live workers: the effective capacity is the smaller of the configured one
/// and every capacity a worker reports. Returns it, or every problem found.
pub async fn reported_capacity(client: &UpstreamClient, m: &ModelConfig) -> Result<u64, String> {
    let mut capacity = m.kv_capacity_tokens;
    let mut source = "configured kv_capacity_tokens".to_string();
    let workers = (m.prefill.workers.iter().map(|w| (w, &m.prefill)))
        .chain(m.decode.workers.iter().map(|w| (w, &m.decode)));
    for (w, pool) in workers {
        match probe_capacity(client, w.url.trim_end_matches('/'), pool.auth()).await {
            Some(reported) if reported < capacity => {
                capacity = reported;
                source = format!("reported by worker {}", w.url);
            }
            Some(_) => {}
            None => {
                tracing::warn!(model = %m.name, worker = %w.url, "worker did not report a KV capacity; using the configured one")
            }
        }
    }
    deployment_check(&m.name, m.context_window, m.headroom, capacity, &source)?;
    Ok(capacity)
}

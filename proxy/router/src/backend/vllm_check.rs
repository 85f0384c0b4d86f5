//! The vLLM deployment probe: what each worker says about itself, read at start, at every reload
//! and in `lockstep check` (vLLM 0.33 has no `/server_info` outside dev mode):
//! - `GET /v1/models`: the served model and its `max_model_len`
//!   (`entrypoints/openai/models/serving.py`, `show_available_models`);
//! - `GET /metrics`: `vllm:cache_config_info`, a gauge whose labels are the cache config
//!   (`v1/metrics/loggers.py`, `log_metrics_info`; `config/cache.py`, `metrics_info`), among them
//!   `block_size` and `num_gpu_blocks`.
//!
//! Problems (the model does not serve): a worker that does not serve the model, a
//! `max_model_len` below the context window, a block size other than `vllm.block_size` (the
//! block-id checks depend on it), a KV pool too small for the window, a worker that wants an API
//! key lockstep lacks, a worker that answers either endpoint with an error status, block counts
//! whose product overflows. A worker that does not answer at all is a warning: it is
//! health-checked later, and nothing here verifies KV content anyway.

use std::time::Duration;

use serde_json::Value;

use super::UpstreamClient;
use super::check::{ProbeError, WorkerReport};
use lockstep_core::config::{ModelConfig, WorkerConfig};
use lockstep_core::ids::Side;

/// What one worker reported (each `None` where it did not say).
#[derive(Debug, Default, PartialEq)]
pub(super) struct Report {
    /// `max_model_len` of the served model; `Some(None)`: the list answered, without the model.
    pub max_model_len: Option<Option<u64>>,
    /// `block_size` of its KV cache.
    pub block_size: Option<u64>,
    /// Tokens its KV pool holds (`num_gpu_blocks × block_size`).
    pub kv_tokens: Option<u64>,
}

/// What one worker reports, read against the model's configuration
/// ([`super::PdBackend::probe_worker`] for vLLM).
pub(super) async fn probe_worker(
    client: &UpstreamClient,
    m: &ModelConfig,
    side: Side,
    w: &WorkerConfig,
    served: &str,
) -> Result<WorkerReport, ProbeError> {
    let pool = match side {
        Side::Prefill => &m.prefill,
        Side::Decode => &m.decode,
    };
    let base = w.url.trim_end_matches('/');
    match probe(client, base, &pool.auth_headers(), served).await {
        Ok(r) => Ok(read(m, served, &r)),
        Err(Some(e)) => Err(ProbeError::Refused(e)),
        Err(None) => Err(ProbeError::Unreachable(
            "no answer to /v1/models or /metrics within 5 s".into(),
        )),
    }
}

/// One worker's report; `Err(None)` when it did not answer, `Err(Some)` for a refusal.
async fn probe(
    client: &UpstreamClient,
    base: &str,
    auth: &[(http::HeaderName, http::HeaderValue)],
    served: &str,
) -> Result<Report, Option<String>> {
    let get = |path: &'static str, auth| async move {
        let url = format!("{base}{path}");
        match tokio::time::timeout(Duration::from_secs(5), client.get_collect_with(&url, auth))
            .await
        {
            Ok(Ok((401 | 403, _))) => Err(Some(format!(
                "{path} answered 401: the worker wants an API key; set this pool's api_key to its --api-key"
            ))),
            Ok(Ok((s, body))) if (200..300).contains(&s) => Ok(body),
            // What lockstep checks cannot be read: refused, as the SGLang check refuses.
            Ok(Ok((s, _))) => Err(Some(format!(
                "{path} answered {s}: the deployment cannot be verified (is this a vLLM 0.33 worker?)"
            ))),
            _ => Err(None),
        }
    };
    let models = get("/v1/models", auth).await?;
    let metrics = get("/metrics", &[]).await?;
    let mut report = Report::default();
    if let Ok(v) = serde_json::from_slice::<Value>(&models)
        && let Some(list) = v.get("data").and_then(Value::as_array)
    {
        report.max_model_len = Some(
            list.iter()
                .find(|c| c.get("id").and_then(Value::as_str) == Some(served))
                .map(|c| c.get("max_model_len").and_then(Value::as_u64).unwrap_or(0)),
        );
    }
    if let Ok(text) = std::str::from_utf8(&metrics) {
        let line = text
            .lines()
            .find(|l| l.starts_with("vllm:cache_config_info{"));
        let label = |name: &str| line.and_then(|l| label(l, name));
        report.block_size = label("block_size");
        report.kv_tokens = match label("num_gpu_blocks").zip(report.block_size) {
            None => None,
            Some((n, b)) => Some(n.checked_mul(b).ok_or_else(|| {
                Some(format!(
                    "/metrics reports {n} blocks of {b} tokens: more than any KV pool holds"
                ))
            })?),
        };
    }
    Ok(report)
}

/// The value of label `name` in a Prometheus sample line, as an integer.
pub(crate) fn label(line: &str, name: &str) -> Option<u64> {
    let mut rest = line.split_once('{')?.1.rsplit_once('}')?.0;
    while let Some((key, after)) = rest.split_once("=\"") {
        let (value, tail) = after.split_once('"')?;
        if key.trim_start_matches(',').trim() == name {
            return value.parse().ok();
        }
        rest = tail;
    }
    None
}

/// What lockstep requires of one worker's report: it serves the model, within the window, with
/// the configured block size. Its KV pool is its capacity.
pub(super) fn read(m: &ModelConfig, served: &str, r: &Report) -> WorkerReport {
    let mut out = WorkerReport {
        kv_tokens: r.kv_tokens,
        ..WorkerReport::default()
    };
    match r.max_model_len {
        Some(None) => out.problems.push(format!(
            "does not serve `{served}` (its /v1/models lists other models; set vllm.served_model_name)"
        )),
        Some(Some(len)) if len < m.context_window => out.problems.push(format!(
            "has max_model_len {len}, below context_window {}: requests that fit the window would be refused",
            m.context_window
        )),
        _ => {}
    }
    if let Some(bs) = r.block_size
        && bs != m.vllm.block_size
    {
        out.problems.push(format!(
            "runs block_size {bs}, but vllm.block_size is {}: lockstep checks the prefill's block ids against it",
            m.vllm.block_size
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> ModelConfig {
        lockstep_core::config::test_model("http://p", "http://d", "")
    }

    fn report(len: Option<Option<u64>>, bs: Option<u64>, kv: Option<u64>) -> Report {
        Report {
            max_model_len: len,
            block_size: bs,
            kv_tokens: kv,
        }
    }

    #[test]
    fn cache_config_labels_are_read() {
        let l = r#"vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="2048",prefix_caching_hash_algo="sha256"} 1.0"#;
        assert_eq!(label(l, "block_size"), Some(16));
        assert_eq!(label(l, "num_gpu_blocks"), Some(2048));
        assert_eq!(label(l, "cache_dtype"), None);
        assert_eq!(label(l, "gpu_blocks"), None);
    }

    /// The fold over one worker's report: its capacity, or its problem.
    fn check(m: &ModelConfig, served: &str, r: &Report) -> Result<u64, String> {
        let p = super::super::check::Probed {
            side: Side::Prefill,
            url: "http://p".into(),
            report: read(m, served, r),
        };
        super::super::check::fold(m, &[p]).map(|d| d.kv_capacity)
    }

    #[test]
    fn what_vllm_workers_report_is_checked_against_the_model() {
        let m = model();
        let ok = report(Some(Some(2048)), Some(16), Some(3000));
        assert_eq!(check(&m, "m", &ok), Ok(3000));
        // Nothing readable: the configured limits.
        assert_eq!(check(&m, "m", &Report::default()), Ok(4000));
        for (r, why) in [
            (report(Some(None), None, None), "does not serve `m`"),
            (report(Some(Some(512)), None, None), "max_model_len 512"),
            (report(None, Some(32), None), "block_size 32"),
            (report(None, Some(16), Some(800)), "deployment check failed"),
        ] {
            let e = check(&m, "m", &r).expect_err(why);
            assert!(e.contains(why), "{why}: {e}");
        }
    }

    /// A worker whose answers lockstep cannot read is refused, not waved through on the
    /// configured limits: an error status on either endpoint, block counts that overflow.
    #[tokio::test]
    async fn error_statuses_and_impossible_counts_are_refused() {
        use axum::routing::get;
        let serve = |models: u16, metrics: &'static str| async move {
            let app = axum::Router::new()
                .route(
                    "/v1/models",
                    get(move || async move {
                        (
                            http::StatusCode::from_u16(models).expect("status"),
                            r#"{"data":[{"id":"m","max_model_len":2048}]}"#,
                        )
                    }),
                )
                .route("/metrics", get(move || async move { metrics }));
            let l = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let url = format!("http://{}", l.local_addr().expect("addr"));
            tokio::spawn(async move {
                let _ = axum::serve(l, app).await;
            });
            url
        };
        let client = UpstreamClient::with_ca(Duration::from_secs(2), None).expect("client");
        let ok = "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"200\"} 1.0\n";
        let url = serve(200, ok).await;
        let r = probe(&client, &url, &[], "m").await.expect("readable");
        assert_eq!(r.kv_tokens, Some(3200));
        let url = serve(500, ok).await;
        let e = probe(&client, &url, &[], "m").await.expect_err("500");
        assert!(e.is_some_and(|e| e.contains("/v1/models answered 500")));
        let huge = "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"18446744073709551615\"} 1.0\n";
        let url = serve(200, huge).await;
        let e = probe(&client, &url, &[], "m").await.expect_err("overflow");
        assert!(e.is_some_and(|e| e.contains("more than any KV pool holds")));
    }
}

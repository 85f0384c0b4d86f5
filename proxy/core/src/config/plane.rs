//! `[worker_plane]`: how the router reaches lockstep workers. With `tls` (cert, key, CA files),
//! every call to a worker is mutual TLS (`https://` worker URLs), and so is every KV push between
//! workers configured the same way; without it, worker URLs must be `http://` on loopback unless
//! `insecure_plaintext = true` (UNSAFE, and `lockstep check` says so).

use lockstep_runtime::tls::PlaneTlsFiles;
use lockstep_runtime::toml_file::Problems;
use serde::Deserialize;

use super::ModelConfig;

/// `[worker_plane]`.
#[derive(Debug, Clone, Default, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkerPlaneConfig {
    /// Mutual TLS to lockstep workers: this router's client certificate and key, and the CA the
    /// workers' certificates chain to. Re-read on every reload.
    #[serde(default)]
    pub tls: Option<PlaneTlsFiles>,
    /// Allow `http://` workers on non-loopback hosts. UNSAFE: the worker plane is then neither
    /// authenticated nor encrypted.
    #[serde(default)]
    pub insecure_plaintext: bool,
}

/// The model's `http://` worker URLs whose host is not loopback.
pub(super) fn plaintext_workers(m: &ModelConfig) -> impl Iterator<Item = &str> {
    m.prefill
        .workers
        .iter()
        .chain(&m.decode.workers)
        .map(|w| w.url.as_str())
        .filter(|u| {
            let uri: Option<http::Uri> = u.parse().ok();
            uri.is_some_and(|uri| uri.scheme_str() == Some("http") && !is_loopback(uri.host()))
        })
}

pub(super) fn is_loopback(host: Option<&str>) -> bool {
    match host {
        Some("localhost") => true,
        Some(h) => h
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback()),
        None => false,
    }
}

impl WorkerPlaneConfig {
    /// Problems with a lockstep model's worker URLs under this plane.
    pub(super) fn validate_workers(&self, i: usize, m: &ModelConfig, out: &mut Problems) {
        for (side, pool) in [("prefill", &m.prefill), ("decode", &m.decode)] {
            for (j, w) in pool.workers.iter().enumerate() {
                let at = format!("models[{i}].{side}.workers[{j}].url");
                let scheme = w
                    .url
                    .parse::<http::Uri>()
                    .ok()
                    .and_then(|u| u.scheme_str().map(str::to_string));
                match (scheme.as_deref(), &self.tls) {
                    (Some("https"), None) => out.push(
                        at,
                        "https:// needs [worker_plane.tls] (cert_file, key_file, ca_file)",
                    ),
                    (Some("http"), Some(_)) => out.push(
                        at,
                        "the worker plane uses TLS ([worker_plane.tls]): use https://",
                    ),
                    _ => {}
                }
            }
        }
        if self.tls.is_none() && !self.insecure_plaintext {
            for u in plaintext_workers(m) {
                out.push(
                    format!("models[{i}] ({}).workers", m.name),
                    format!(
                        "TLS is required to reach {u} (not loopback): set [worker_plane.tls] and serve the workers with [worker.tls], or worker_plane.insecure_plaintext = true (UNSAFE)"
                    ),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn problems_and_warnings(workers: &str, plane: &str) -> (String, String) {
        let cfg = Config::parse(&format!(
            r#"
[[models]]
name = "m"
backend = "lockstep"
context_window = 64
kv_capacity_tokens = 128
[models.prefill]
workers = [{{ url = "{workers}" }}]
[models.decode]
workers = [{{ url = "http://127.0.0.1:9101" }}]
{plane}
"#
        ))
        .expect("parses");
        (
            crate::config::lines(&cfg.problems()).join("\n"),
            cfg.warnings().join("\n"),
        )
    }

    #[test]
    fn plaintext_off_loopback_needs_tls_or_an_explicit_unsafe_switch() {
        let (p, w) = problems_and_warnings("http://127.0.0.1:9100", "");
        assert!(
            !p.contains("TLS") && w.is_empty(),
            "loopback is fine: {p} {w}"
        );
        let (p, _) = problems_and_warnings("http://10.0.0.5:9100", "");
        assert!(
            p.contains("TLS is required to reach http://10.0.0.5:9100"),
            "{p}"
        );
        let (p, w) = problems_and_warnings(
            "http://10.0.0.5:9100",
            "[worker_plane]\ninsecure_plaintext = true",
        );
        assert!(!p.contains("TLS"), "{p}");
        assert!(w.contains("UNSAFE"), "check says so: {w}");
    }

    #[test]
    fn the_url_scheme_must_match_the_plane() {
        let (p, _) = problems_and_warnings("https://10.0.0.5:9100", "");
        assert!(p.contains("needs [worker_plane.tls]"), "{p}");
        let tls = "[worker_plane]\ntls = { cert_file = \"c\", key_file = \"k\", ca_file = \"a\" }";
        let (p, _) = problems_and_warnings("https://10.0.0.5:9100", tls);
        assert!(
            p.contains("workers[0].url: the worker plane uses TLS"),
            "the http decode: {p}"
        );
        assert!(!p.contains("prefill.workers[0]"), "{p}");
    }

    /// A pool's API key is never sent in plaintext off loopback unless the pool says UNSAFE
    /// (second security review, finding 10).
    #[test]
    fn an_api_key_is_not_sent_in_plaintext_off_loopback() {
        let sglang = |url: &str, pool_extra: &str| {
            let cfg = Config::parse(&format!(
                r#"
[[models]]
name = "m"
backend = "sglang"
context_window = 64
kv_capacity_tokens = 128
tokenizer = "t.json"
[models.prefill]
workers = [{{ url = "{url}", bootstrap_port = 8998 }}]
api_key = "k"
{pool_extra}
[models.decode]
workers = [{{ url = "http://127.0.0.1:30002" }}]
api_key = "k"
"#
            ))
            .expect("parses");
            crate::config::lines(&cfg.problems()).join("\n")
        };
        let p = sglang("http://10.0.0.5:30000", "");
        assert!(
            p.contains("prefill.workers[0].url: `http://10.0.0.5:30000`")
                && p.contains("would cross the network in plaintext"),
            "{p}"
        );
        assert!(!p.contains("decode.workers"), "loopback is fine: {p}");
        for ok in [
            sglang("https://10.0.0.5:30000", ""),
            sglang("http://10.0.0.5:30000", "insecure_plaintext = true"),
            sglang("http://[::1]:30000", ""),
        ] {
            assert!(!ok.contains("plaintext"), "{ok}");
        }
    }
}

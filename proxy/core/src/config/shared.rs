//! `[shared]`: the store several lockstep replicas share their tenants' limits through (Redis).

use lockstep_runtime::toml_file::{Problems, Section};
use serde::Deserialize;

/// What a replica does while the shared store cannot be reached.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum OnUnavailable {
    /// Each replica enforces its share of every limit (the limit divided by the replicas last
    /// seen, never fewer than `shared.replicas`) in its own process. A replica that has no
    /// count (`replicas = 0` and the store never reached since it started) refuses as `deny`:
    /// dividing by one would give every replica the whole limit.
    #[default]
    Local,
    /// Every request of a limited tenant is refused: 503 `shared_store_unavailable`.
    Deny,
}

/// `[shared]`: tenant limits (request rate, concurrent pairs, token budgets) kept in one Redis
/// for every replica in front of the same workers.
#[derive(Debug, Clone, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SharedConfig {
    /// `redis://HOST:PORT/DB` (`redis://:PASSWORD@HOST:PORT/DB` with a password), or
    /// `rediss://...` for TLS. A password in a `redis://` URL to a host off loopback is refused
    /// unless `insecure_plaintext = true` (UNSAFE): it and every budget would cross the network
    /// in clear.
    pub redis_url: String,
    /// PEM file of the CAs a `rediss://` store's certificate must chain to (default: the
    /// system's roots).
    pub ca_file: Option<std::path::PathBuf>,
    /// Allows a password over plain `redis://` off loopback (UNSAFE).
    pub insecure_plaintext: bool,
    /// While the store cannot be reached: `local` (each replica enforces its share) or `deny`.
    pub on_unavailable: OnUnavailable,
    /// Replicas to assume when dividing the limits without the store (0: learned from the
    /// store, where the replicas announce themselves; the larger of the two is used).
    pub replicas: u32,
    /// How long a replica's concurrent-pair leases (and its presence) live without renewal, ms:
    /// a replica that dies gives its slots back after this.
    pub lease_ttl_ms: u64,
    /// How long one call to the store may take before it counts as unreachable, ms.
    pub timeout_ms: u64,
    /// Prefix of every key lockstep writes (several deployments can share one Redis).
    pub key_prefix: String,
}

impl Default for SharedConfig {
    fn default() -> Self {
        SharedConfig {
            redis_url: String::new(),
            ca_file: None,
            insecure_plaintext: false,
            on_unavailable: OnUnavailable::Local,
            replicas: 0,
            lease_ttl_ms: 10_000,
            timeout_ms: 250,
            key_prefix: "lockstep".into(),
        }
    }
}

impl Section for SharedConfig {
    fn validate(&self, at: &str, out: &mut Problems) {
        let url = self.redis_url.trim();
        if url.is_empty() {
            out.push(
                format!("{at}.redis_url"),
                "required (`redis://HOST:PORT/DB`)",
            );
        } else if !url.starts_with("redis://") && !url.starts_with("rediss://") {
            out.push(
                format!("{at}.redis_url"),
                "expected `redis://HOST:PORT/DB` or `rediss://HOST:PORT/DB` (TLS); unix sockets are not built in",
            );
        } else {
            match redis::IntoConnectionInfo::into_connection_info(url) {
                Err(e) => out.push(format!("{at}.redis_url"), e.to_string()),
                Ok(info) => {
                    let tls = url.starts_with("rediss://");
                    let password = info.redis_settings().password().is_some();
                    let host = match info.addr() {
                        redis::ConnectionAddr::Tcp(h, _) => Some(h.clone()),
                        _ => None,
                    };
                    let loopback = host.as_deref().is_some_and(|h| {
                        h == "localhost"
                            || h.trim_matches(['[', ']'])
                                .parse::<std::net::IpAddr>()
                                .is_ok_and(|ip| ip.is_loopback())
                    });
                    if !tls && password && !loopback && !self.insecure_plaintext {
                        out.push(
                            format!("{at}.redis_url"),
                            format!("the password and every tenant's budgets would cross the network in clear to `{}`: use rediss:// (with {at}.ca_file for a private CA), or set {at}.insecure_plaintext = true (UNSAFE)", host.unwrap_or_default()),
                        );
                    }
                    if !tls && self.ca_file.is_some() {
                        out.push(
                            format!("{at}.ca_file"),
                            "only a rediss:// store is reached over TLS",
                        );
                    }
                }
            }
        }
        if self.lease_ttl_ms < 300 {
            out.push(format!("{at}.lease_ttl_ms"), "must be at least 300");
        }
        if self.timeout_ms == 0 || self.timeout_ms * 3 > self.lease_ttl_ms {
            out.push(
                format!("{at}.timeout_ms"),
                "must be at least 1 and at most a third of lease_ttl_ms",
            );
        }
        let p = &self.key_prefix;
        if p.is_empty() || p.chars().any(|c| c.is_whitespace() || "{}".contains(c)) {
            out.push(
                format!("{at}.key_prefix"),
                "must be non-empty, without spaces or braces",
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(c: &SharedConfig) -> Vec<String> {
        let mut out = Problems::default();
        c.validate("shared", &mut out);
        out.into_vec()
            .into_iter()
            .map(|p| format!("{}: {}", p.key, p.message))
            .collect()
    }

    #[test]
    fn the_url_the_lease_and_the_timeout_are_checked() {
        let ok = SharedConfig {
            redis_url: "redis://127.0.0.1:6379/0".into(),
            ..SharedConfig::default()
        };
        assert!(problems(&ok).is_empty(), "{:?}", problems(&ok));
        for (bad, key) in [
            (
                SharedConfig {
                    redis_url: String::new(),
                    ..ok.clone()
                },
                "shared.redis_url",
            ),
            (
                SharedConfig {
                    redis_url: "http://127.0.0.1:6379".into(),
                    ..ok.clone()
                },
                "shared.redis_url",
            ),
            (
                SharedConfig {
                    lease_ttl_ms: 100,
                    ..ok.clone()
                },
                "shared.lease_ttl_ms",
            ),
            (
                SharedConfig {
                    timeout_ms: 5000,
                    ..ok.clone()
                },
                "shared.timeout_ms",
            ),
            (
                SharedConfig {
                    key_prefix: "a{b}".into(),
                    ..ok.clone()
                },
                "shared.key_prefix",
            ),
            // A password in clear off loopback; a CA for a store not reached over TLS.
            (
                SharedConfig {
                    redis_url: "redis://:pw@10.0.0.5:6379/0".into(),
                    ..ok.clone()
                },
                "shared.redis_url",
            ),
            (
                SharedConfig {
                    ca_file: Some("/ca.pem".into()),
                    ..ok.clone()
                },
                "shared.ca_file",
            ),
        ] {
            let p = problems(&bad);
            assert!(p.iter().any(|p| p.starts_with(key)), "{key}: {p:?}");
        }
        for fine in [
            "rediss://:pw@10.0.0.5:6379/0",
            "redis://:pw@127.0.0.1:6379/0",
            "redis://:pw@localhost:6379/0",
            "redis://10.0.0.5:6379/0",
        ] {
            let c = SharedConfig {
                redis_url: fine.into(),
                ..ok.clone()
            };
            assert!(problems(&c).is_empty(), "{fine}: {:?}", problems(&c));
        }
        let unsafe_ok = SharedConfig {
            redis_url: "redis://:pw@10.0.0.5:6379/0".into(),
            insecure_plaintext: true,
            ..ok.clone()
        };
        assert!(problems(&unsafe_ok).is_empty());
        let parsed: SharedConfig = lockstep_runtime::toml_file::parse(
            "redis_url = \"redis://h:1/2\"\non_unavailable = \"deny\"",
        )
        .expect("parses");
        assert_eq!(parsed.on_unavailable, OnUnavailable::Deny);
        assert!(
            lockstep_runtime::toml_file::parse::<SharedConfig>("on_unavailable = \"open\"")
                .is_err()
        );
        assert!(lockstep_runtime::toml_file::parse::<SharedConfig>("redis = \"x\"").is_err());
    }
}

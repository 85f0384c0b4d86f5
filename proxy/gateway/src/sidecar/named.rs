//! Prefills named per request: `lockstep sidecar` serves the pair between the prefill an endpoint
//! picker names in `x-prefiller-host-port` (llm-d's routing sidecar header) and its local decode.
//! A name is read once, at admission; what it may name is decided here, before any connection is
//! made: a member of the prefill pool (configured or discovered), or an IP address inside
//! `sidecar.prefill_allow`. A host name that is not a pool member is never resolved (DNS would
//! decide where the prefill goes).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockstep_core::config::{AllowedPrefills, SidecarConfig, WorkerConfig};
use lockstep_core::error::LockstepError;
use lockstep_core::ids::Side;
use lockstep_routing::pool::{MemberChange, MemberFeed, WorkerPool};

/// The header an endpoint picker names the prefill in (`host:port`, the first of a comma list).
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";

/// A prefill a request named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedPrefill {
    /// `host:port` as named.
    pub host_port: String,
    /// Its address, when the host is an IP literal.
    pub ip: Option<IpAddr>,
    /// Its port.
    pub port: u16,
}

impl NamedPrefill {
    /// The worker URL it names (`http://host:port`).
    pub fn url(&self) -> String {
        format!("http://{}", self.host_port)
    }
}

/// What a sidecar lets requests name.
#[derive(Debug, Clone)]
pub struct NamedPrefills {
    allow: Vec<AllowedPrefills>,
    /// Prefills named at run time kept as members at once.
    pub max_members: usize,
    /// How long a request waits for a newly named prefill's deployment check.
    pub verify_wait: Duration,
    /// How long a named prefill that runs no pair stays without being named again.
    pub idle: Duration,
    /// The prefills named at run time, by URL, with when each was last named: reserved here
    /// before they join, so there are never more than `max_members`.
    kept: Arc<Mutex<HashMap<String, Instant>>>,
}

impl NamedPrefills {
    /// The policy of a `[sidecar]` section (already validated).
    pub fn new(cfg: &SidecarConfig) -> Result<NamedPrefills, String> {
        Ok(NamedPrefills {
            allow: cfg.networks()?,
            max_members: cfg.max_prefills,
            verify_wait: Duration::from_millis(cfg.verify_wait_ms),
            idle: Duration::from_millis(cfg.prefill_idle_ms),
            kept: Arc::default(),
        })
    }

    /// Keeps the named prefill at `url` as a member of `pool` (its joining sent through `feed`
    /// with `worker`'s settings when it is not one): its place is reserved first, so at most
    /// `max_members` are kept whatever the requests in flight. Named prefills idle for
    /// [`NamedPrefills::idle`] leave first; past the bound the idle one named longest ago leaves,
    /// and with none idle (each runs a pair, or was named within `verify_wait`) the name is 503
    /// `workers_busy`.
    pub fn keep(
        &self,
        pool: &WorkerPool,
        feed: &MemberFeed,
        worker: WorkerConfig,
        model: &str,
    ) -> Result<(), LockstepError> {
        let url = worker.url.clone();
        let now = Instant::now();
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let idle_since = |u: &str, last: Instant| {
            let busy = pool.member_at(u).is_some_and(|w| w.in_flight() > 0);
            (!busy).then(|| now.saturating_duration_since(last))
        };
        let leave = |u: String| {
            feed.send(MemberChange::Leave {
                side: Side::Prefill,
                url: u,
            });
        };
        // Those that served nothing for a while leave.
        let gone: Vec<String> = kept
            .iter()
            .filter(|(u, last)| *u != &url && idle_since(u, **last).is_some_and(|d| d >= self.idle))
            .map(|(u, _)| u.clone())
            .collect();
        for u in gone {
            kept.remove(&u);
            tracing::info!(prefill = %u, "named prefill idle: it leaves the pool");
            leave(u);
        }
        let reserved = kept.contains_key(&url);
        if !reserved && kept.len() >= self.max_members {
            let oldest = kept
                .iter()
                .filter(|(u, last)| idle_since(u, **last).is_some_and(|d| d >= self.verify_wait))
                .min_by_key(|(_, last)| **last)
                .map(|(u, _)| u.clone());
            let Some(u) = oldest else {
                return Err(LockstepError::WorkersBusy {
                    model: model.to_string(),
                    side: Side::Prefill.as_str(),
                });
            };
            kept.remove(&u);
            leave(u);
        }
        kept.insert(url.clone(), now);
        if pool.member_at(&url).is_none() && !feed.send(MemberChange::Named { worker }) {
            kept.remove(&url);
            return Err(LockstepError::Unavailable {
                message: format!("model `{model}` is being replaced; retry"),
            });
        }
        Ok(())
    }

    /// How many named prefills are kept (reserved or members).
    pub fn kept(&self) -> usize {
        self.kept.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether `ip:port` is inside one of the allowed networks, on one of its ports.
    pub fn allows(&self, ip: IpAddr, port: u16) -> bool {
        // An IPv4-mapped IPv6 address is judged as the IPv4 address it is.
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        self.allow
            .iter()
            .any(|a| a.net.contains(&ip) && a.ports.contains(&port))
    }

    /// The prefill the request's headers name, if any, read as llm-d's routing sidecar reads
    /// `x-prefiller-host-port` (`pkg/sidecar/proxy/chat_completions.go`,
    /// `chatCompletionsHandler`): every header line, one line split on commas (RFC 7230's
    /// combined form), the first entry, trimmed; an empty one means decode only, as no header
    /// does (`None`: vLLM's decode serves alone, an SGLang decode refuses with 503
    /// `prefill_required` because it cannot). An entry that is not `host:port` is 400
    /// `invalid_request`, where llm-d would answer 403 from its allowlist.
    pub fn read(headers: &http::HeaderMap) -> Result<Option<NamedPrefill>, LockstepError> {
        let bad = |why: &str| LockstepError::InvalidRequest {
            message: format!("header {PREFILLER_HEADER}: {why}"),
            param: Some(PREFILLER_HEADER.into()),
        };
        let mut lines = headers.get_all(PREFILLER_HEADER).iter();
        let Some(v) = lines.next() else {
            return Ok(None);
        };
        let text = v.to_str().map_err(|_| bad("not ASCII"))?;
        let first = if lines.next().is_none() {
            // One line: a comma list.
            text.split(',').next().unwrap_or("")
        } else {
            // Several lines: one host each.
            text
        }
        .trim();
        if first.is_empty() {
            return Ok(None);
        }
        if let Ok(a) = first.parse::<SocketAddr>() {
            if a.port() == 0 {
                return Err(bad("port 0"));
            }
            return Ok(Some(NamedPrefill {
                host_port: a.to_string(),
                ip: Some(a.ip()),
                port: a.port(),
            }));
        }
        // A host name: `name:port`, nothing else (no user, path or scheme).
        let auth = first
            .parse::<http::uri::Authority>()
            .map_err(|_| bad("not host:port"))?;
        match auth.port_u16() {
            Some(p) if p > 0 && !first.contains('@') => Ok(Some(NamedPrefill {
                host_port: format!("{}:{p}", auth.host().to_ascii_lowercase()),
                ip: None,
                port: p,
            })),
            _ => Err(bad("not host:port")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(v: &str) -> Result<Option<NamedPrefill>, LockstepError> {
        let mut h = http::HeaderMap::new();
        h.insert(PREFILLER_HEADER, v.parse().expect("header value"));
        NamedPrefills::read(&h)
    }

    #[test]
    fn the_header_is_read_as_llm_d_reads_it_and_only_host_port_is_accepted() {
        assert_eq!(
            NamedPrefills::read(&http::HeaderMap::new()).ok(),
            Some(None)
        );
        let n = named("10.0.0.7:8000, 10.0.0.8:8000")
            .expect("ok")
            .expect("named");
        assert_eq!(n.host_port, "10.0.0.7:8000");
        assert_eq!(n.url(), "http://10.0.0.7:8000");
        assert_eq!(n.ip, Some("10.0.0.7".parse().expect("ip")));
        let v6 = named("[fd00::1]:30000").expect("ok").expect("named");
        assert_eq!(v6.url(), "http://[fd00::1]:30000");
        let host = named("Prefill-0.svc:8000").expect("ok").expect("named");
        assert_eq!(
            (host.host_port.as_str(), host.ip),
            ("prefill-0.svc:8000", None)
        );
        // Empty, as llm-d reads it: decode only, like no header.
        for empty in ["", " ", " , 10.0.0.1:1"] {
            assert_eq!(named(empty).ok(), Some(None), "{empty:?}");
        }
        for bad in [
            "10.0.0.7",
            "10.0.0.7:0",
            "http://10.0.0.7:80",
            "u@h:80",
            "h:80/x",
        ] {
            let e = named(bad).expect_err(bad);
            assert_eq!(e.code(), "invalid_request", "{bad}");
            assert_eq!(e.param(), Some(PREFILLER_HEADER), "{bad}");
        }
        // Several lines: one host each, the first taken whole (a comma inside it is no list).
        let lines = |vs: &[&str]| {
            let mut h = http::HeaderMap::new();
            for v in vs {
                h.append(PREFILLER_HEADER, v.parse().expect("header value"));
            }
            NamedPrefills::read(&h)
        };
        let n = lines(&["10.0.0.8:8000", "10.0.0.9:8000"])
            .expect("ok")
            .expect("named");
        assert_eq!(n.host_port, "10.0.0.8:8000");
        assert_eq!(lines(&[" ", "10.0.0.9:8000"]).ok(), Some(None));
        let e = lines(&["10.0.0.8:8000,10.0.0.7:1", "10.0.0.9:8000"]).expect_err("a list");
        assert_eq!(e.code(), "invalid_request");
    }

    #[test]
    fn only_addresses_inside_the_allowed_networks_are_allowed() {
        let cfg = SidecarConfig {
            prefill_allow: vec![
                "10.1.0.0/16".into(),
                "192.168.5.7".into(),
                "fd00::/8".into(),
            ],
            ..SidecarConfig::default()
        };
        let p = NamedPrefills::new(&cfg).expect("policy");
        let ip = |s: &str| s.parse::<IpAddr>().expect("ip");
        let allows = |s: &str| p.allows(ip(s), 8000);
        assert!(allows("10.1.255.3"));
        assert!(!allows("10.2.0.1"));
        assert!(allows("192.168.5.7"));
        assert!(!allows("192.168.5.8"));
        assert!(allows("fd12::9"));
        assert!(
            allows("::ffff:10.1.0.1"),
            "an IPv4-mapped address is its IPv4 one"
        );
        assert!(!allows("::ffff:10.2.0.1"));
        let none = NamedPrefills::new(&SidecarConfig::default()).expect("policy");
        assert!(!none.allows(ip("127.0.0.1"), 8000), "no list: no address");
        for bad in [
            "10.0.0.0/33",
            "10.0.0.0/8:0",
            "10.0.0.0/8:70000",
            "10.0.0.0/8:9000-8000",
            "10.0.0.0/8:",
            "[fd00::/8]8000",
            "[fd00::/8",
            "fd00::/8:8000",
        ] {
            let cfg = SidecarConfig {
                prefill_allow: vec![bad.into()],
                ..SidecarConfig::default()
            };
            assert!(NamedPrefills::new(&cfg).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_allowed_network_may_name_its_ports() {
        let cfg = SidecarConfig {
            prefill_allow: vec![
                "10.1.0.0/16:8000".into(),
                "10.2.0.0/16:8000-8010".into(),
                "192.168.5.7:30000".into(),
                "[fd00::/8]:9000".into(),
                "[fd00::1]".into(),
            ],
            ..SidecarConfig::default()
        };
        let p = NamedPrefills::new(&cfg).expect("policy");
        let at = |s: &str, port: u16| p.allows(s.parse().expect("ip"), port);
        assert!(at("10.1.2.3", 8000));
        assert!(!at("10.1.2.3", 8001), "another port of an allowed address");
        assert!(at("10.2.2.3", 8000) && at("10.2.2.3", 8010));
        assert!(!at("10.2.2.3", 8011) && !at("10.2.2.3", 7999));
        assert!(at("192.168.5.7", 30000) && !at("192.168.5.7", 22));
        assert!(at("fd12::9", 9000) && !at("fd12::9", 9001));
        assert!(at("fd00::1", 22), "no port named: any port");
        assert!(at("::ffff:10.1.0.1", 8000) && !at("::ffff:10.1.0.1", 9));
    }
}

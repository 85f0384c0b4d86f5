//! What the probe saw: counts per endpoint and outcome, errors by kind, leaks, over-long prompts
//! accepted, latency percentiles; printed as a table at the end and served as Prometheus metrics.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Duration;

/// How one request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A 2xx answer that completed normally.
    Completed,
    /// The probe left mid-stream on purpose.
    Left,
    /// An error, by kind (`http_4xx`, `http_5xx`, `error_after_commit`, `truncated`,
    /// `malformed`, `timeout`, `transport`).
    Error(&'static str),
}

/// One finished request.
#[derive(Debug, Clone)]
pub struct Record {
    /// `chat stream`, `completions json`, `grpc generate`, ...
    pub endpoint: String,
    /// Over-long prompt (`true`) or short canary request.
    pub over_long: bool,
    /// How it ended.
    pub outcome: Outcome,
    /// Whether any HTTP (or gRPC) response arrived.
    pub responded: bool,
    /// Other requests' secrets found in its answer.
    pub leaks: Vec<String>,
    /// Time to the end of the answer (or to the error).
    pub latency: Duration,
}

#[derive(Debug, Default, Clone)]
struct Row {
    sent: u64,
    completed: u64,
    left: u64,
    errors: u64,
    leaks: u64,
}

/// Latencies kept for percentiles: the most recent ones, bounded.
const KEEP: usize = 65_536;

#[derive(Debug, Default)]
struct Inner {
    rows: BTreeMap<String, Row>,
    errors: BTreeMap<&'static str, u64>,
    leaks: Vec<(String, String)>,
    over_long_sent: u64,
    over_long_refused: u64,
    over_long_accepted: u64,
    responded: bool,
    latencies: VecDeque<f64>,
    skipped: BTreeMap<String, String>,
}

/// A run's totals, for callers that judge it (the soak test).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Totals {
    /// Requests sent (over-long ones included).
    pub sent: u64,
    /// Requests that completed normally.
    pub completed: u64,
    /// Requests that ended in an error.
    pub errors: u64,
    /// Foreign secrets seen.
    pub leaks: u64,
    /// p99 latency of completed short requests, seconds.
    pub p99: Option<f64>,
}

/// Shared counters.
#[derive(Debug, Default)]
pub struct Stats {
    inner: Mutex<Inner>,
}

impl Stats {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one finished request.
    pub fn record(&self, r: &Record) {
        let mut g = self.lock();
        g.responded |= r.responded;
        let row = g.rows.entry(r.endpoint.clone()).or_default();
        row.sent += 1;
        match &r.outcome {
            Outcome::Completed => row.completed += 1,
            Outcome::Left => row.left += 1,
            Outcome::Error(_) => row.errors += 1,
        }
        row.leaks += r.leaks.len() as u64;
        if let Outcome::Error(kind) = r.outcome {
            *g.errors.entry(kind).or_default() += 1;
        }
        for l in &r.leaks {
            g.leaks.push((r.endpoint.clone(), l.clone()));
        }
        if r.over_long {
            g.over_long_sent += 1;
            match r.outcome {
                Outcome::Completed => g.over_long_accepted += 1,
                _ => g.over_long_refused += 1,
            }
        } else if r.outcome == Outcome::Completed {
            if g.latencies.len() == KEEP {
                g.latencies.pop_front();
            }
            g.latencies.push_back(r.latency.as_secs_f64());
        }
    }

    /// Notes that an endpoint is not served (404/405) and will not be probed.
    pub fn skip(&self, endpoint: &str, why: &str) {
        self.lock()
            .skipped
            .insert(endpoint.to_string(), why.to_string());
    }

    /// Whether an endpoint was found not served.
    pub fn skipped(&self, endpoint: &str) -> bool {
        self.lock().skipped.contains_key(endpoint)
    }

    /// Notes that some response arrived (discovery counts).
    pub fn responded(&self) {
        self.lock().responded = true;
    }

    /// The exit code: 1 on a foreign secret or a completed over-long prompt, else 2 when no
    /// response ever arrived, else 3 when one of the `expected` endpoints (rows such as `chat
    /// json`) never completed a request (it answered only errors, or was not served, or the run
    /// never reached it: nothing there was verified), else 0.
    pub fn exit_code(&self, expected: &[String]) -> u8 {
        let g = self.lock();
        if !g.leaks.is_empty() || g.over_long_accepted > 0 {
            1
        } else if !g.responded {
            2
        } else if !Stats::unverified_in(&g, expected).is_empty() {
            3
        } else {
            0
        }
    }

    /// The `expected` endpoints no request completed on.
    pub fn unverified(&self, expected: &[String]) -> Vec<String> {
        Stats::unverified_in(&self.lock(), expected)
    }

    fn unverified_in(g: &Inner, expected: &[String]) -> Vec<String> {
        expected
            .iter()
            .filter(|e| g.rows.get(*e).is_none_or(|r| r.completed == 0))
            .cloned()
            .collect()
    }

    fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
        if sorted.is_empty() {
            return None;
        }
        let i = ((sorted.len() - 1) as f64 * p).round() as usize;
        Some(sorted[i])
    }

    /// The totals so far.
    pub fn totals(&self) -> Totals {
        let g = self.lock();
        let mut lat: Vec<f64> = g.latencies.iter().copied().collect();
        lat.sort_by(f64::total_cmp);
        Totals {
            sent: g.rows.values().map(|r| r.sent).sum(),
            completed: g.rows.values().map(|r| r.completed).sum(),
            errors: g.rows.values().map(|r| r.errors).sum(),
            leaks: g.leaks.len() as u64,
            p99: Stats::percentile(&lat, 0.99),
        }
    }

    /// The summary table.
    pub fn table(&self) -> String {
        let g = self.lock();
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<24}{:>8}{:>11}{:>7}{:>8}{:>7}",
            "endpoint", "sent", "completed", "left", "errors", "leaks"
        );
        for (k, r) in &g.rows {
            let _ = writeln!(
                s,
                "{k:<24}{:>8}{:>11}{:>7}{:>8}{:>7}",
                r.sent, r.completed, r.left, r.errors, r.leaks
            );
        }
        for (k, why) in &g.skipped {
            let _ = writeln!(s, "{k:<24} skipped: {why}");
        }
        let errors: Vec<String> = g.errors.iter().map(|(k, n)| format!("{k} {n}")).collect();
        let _ = writeln!(
            s,
            "errors by kind: {}",
            if errors.is_empty() {
                "none".to_string()
            } else {
                errors.join(", ")
            }
        );
        let _ = writeln!(
            s,
            "over-long prompts: {} sent, {} refused, {} completed (each a failure)",
            g.over_long_sent, g.over_long_refused, g.over_long_accepted
        );
        let mut lat: Vec<f64> = g.latencies.iter().copied().collect();
        lat.sort_by(f64::total_cmp);
        let p = |q| {
            Stats::percentile(&lat, q).map_or("-".to_string(), |v| format!("{:.0} ms", v * 1e3))
        };
        let _ = writeln!(
            s,
            "latency of completed short requests: p50 {}, p90 {}, p99 {} ({} samples)",
            p(0.5),
            p(0.9),
            p(0.99),
            lat.len()
        );
        let _ = writeln!(
            s,
            "leaks (another request's secret in an answer): {}",
            g.leaks.len()
        );
        for (endpoint, secret) in g.leaks.iter().take(20) {
            let _ = writeln!(s, "  LEAK on {endpoint}: {secret}");
        }
        s
    }

    /// Prometheus text exposition.
    pub fn prometheus(&self) -> String {
        let g = self.lock();
        let mut s = String::new();
        s.push_str("# HELP lockstep_probe_requests_total Probe requests by endpoint and outcome.\n# TYPE lockstep_probe_requests_total counter\n");
        for (k, r) in &g.rows {
            for (outcome, n) in [
                ("completed", r.completed),
                ("left", r.left),
                ("error", r.errors),
            ] {
                let _ = writeln!(
                    s,
                    "lockstep_probe_requests_total{{endpoint=\"{k}\",outcome=\"{outcome}\"}} {n}"
                );
            }
        }
        s.push_str("# HELP lockstep_probe_errors_total Probe errors by kind.\n# TYPE lockstep_probe_errors_total counter\n");
        for (k, n) in &g.errors {
            let _ = writeln!(s, "lockstep_probe_errors_total{{kind=\"{k}\"}} {n}");
        }
        let _ = writeln!(
            s,
            "# HELP lockstep_probe_leaks_total Answers holding another request's secret.\n# TYPE lockstep_probe_leaks_total counter\nlockstep_probe_leaks_total {}",
            g.leaks.len()
        );
        let _ = writeln!(
            s,
            "# HELP lockstep_probe_over_long_completed_total Over-long prompts answered as if they fit.\n# TYPE lockstep_probe_over_long_completed_total counter\nlockstep_probe_over_long_completed_total {}",
            g.over_long_accepted
        );
        let mut lat: Vec<f64> = g.latencies.iter().copied().collect();
        lat.sort_by(f64::total_cmp);
        s.push_str("# HELP lockstep_probe_latency_seconds Latency of completed short requests (recent).\n# TYPE lockstep_probe_latency_seconds gauge\n");
        for q in [0.5, 0.9, 0.99] {
            if let Some(v) = Stats::percentile(&lat, q) {
                let _ = writeln!(s, "lockstep_probe_latency_seconds{{quantile=\"{q}\"}} {v}");
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(outcome: Outcome, over_long: bool, leaks: Vec<String>) -> Record {
        Record {
            endpoint: "chat stream".into(),
            over_long,
            outcome,
            responded: true,
            leaks,
            latency: Duration::from_millis(5),
        }
    }

    #[test]
    fn exit_codes_follow_what_was_seen() {
        let chat = ["chat stream".to_string()];
        let s = Stats::default();
        assert_eq!(s.exit_code(&chat), 2, "nothing answered");
        s.record(&rec(Outcome::Error("http_5xx"), false, vec![]));
        assert_eq!(s.exit_code(&chat), 3, "only errors: nothing verified");
        assert_eq!(s.unverified(&chat), chat.to_vec());
        s.record(&rec(Outcome::Completed, false, vec![]));
        assert_eq!(
            s.exit_code(&chat),
            0,
            "errors beside answers are counted, not failed"
        );
        let both = ["chat stream".to_string(), "completions json".to_string()];
        assert_eq!(
            s.exit_code(&both),
            3,
            "an expected endpoint never exercised"
        );
        assert_eq!(s.unverified(&both), vec!["completions json".to_string()]);
        s.record(&rec(Outcome::Error("http_4xx"), true, vec![]));
        assert_eq!(s.exit_code(&chat), 0, "an over-long prompt refused");
        let t = Stats::default();
        t.record(&rec(Outcome::Completed, true, vec![]));
        assert_eq!(t.exit_code(&chat), 1, "an over-long prompt completed");
        let u = Stats::default();
        u.record(&rec(
            Outcome::Left,
            false,
            vec!["cnry0000000000000001".into()],
        ));
        assert_eq!(u.exit_code(&chat), 1, "a foreign secret");
        assert!(
            u.table()
                .contains("LEAK on chat stream: cnry0000000000000001")
        );
        assert!(u.prometheus().contains("lockstep_probe_leaks_total 1"));
    }
}

//! A model's pair deadlines and retry policy.

use std::time::Duration;

use lockstep_runtime::toml_file::{Problems, Section};
use serde::Deserialize;

/// Pair deadlines, in milliseconds. Each one, when it expires, aborts both halves.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TimeoutConfig {
    /// Whole pair, dispatch to last token.
    pub total_ms: u64,
    /// Prefill answer, from dispatch. Default as long as `first_token_ms`: a real SGLang prefill
    /// answers only once its KV reached the decode (`srt/disaggregation/prefill.py`: done on
    /// `KVPoll.Success`), and by default cannot start before the decode reserved memory for it,
    /// so it covers decode queueing and the transfer, almost up to the first token.
    pub prefill_ms: u64,
    /// First decode token, from dispatch.
    pub first_token_ms: u64,
    /// Longest gap between two decode chunks.
    pub idle_ms: u64,
    /// Bound on each `/abort_request` call (never delays the client's error).
    pub abort_ms: u64,
    /// For backends whose aborted half's own answer shows the abort took (SGLang): how long
    /// lockstep keeps that half's request open after the pair failed, sending the abort again
    /// while the answer has not ended (an abort that overtook its request is dropped by the
    /// worker). Then the request is dropped and the half counted unconfirmed.
    pub abort_confirm_ms: u64,
    /// Longest a committed stream waits for its client to take the next chunk (a reader that
    /// stalled, or reads too slowly to ever finish); then both halves are aborted.
    pub client_idle_ms: u64,
}

impl Default for TimeoutConfig {
    fn default() -> Self {
        TimeoutConfig {
            total_ms: 600_000,
            prefill_ms: 90_000,
            first_token_ms: 90_000,
            idle_ms: 30_000,
            abort_ms: 2_000,
            abort_confirm_ms: 5_000,
            client_idle_ms: 30_000,
        }
    }
}

impl TimeoutConfig {
    /// `total_ms` as a duration.
    pub fn total(&self) -> Duration {
        Duration::from_millis(self.total_ms)
    }
    /// `prefill_ms` as a duration.
    pub fn prefill(&self) -> Duration {
        Duration::from_millis(self.prefill_ms)
    }
    /// `first_token_ms` as a duration.
    pub fn first_token(&self) -> Duration {
        Duration::from_millis(self.first_token_ms)
    }
    /// `idle_ms` as a duration.
    pub fn idle(&self) -> Duration {
        Duration::from_millis(self.idle_ms)
    }
    /// `abort_ms` as a duration.
    pub fn abort(&self) -> Duration {
        Duration::from_millis(self.abort_ms)
    }
    /// `abort_confirm_ms` as a duration.
    pub fn abort_confirm(&self) -> Duration {
        Duration::from_millis(self.abort_confirm_ms)
    }
    /// `client_idle_ms` as a duration.
    pub fn client_idle(&self) -> Duration {
        Duration::from_millis(self.client_idle_ms)
    }
}

/// Retry policy: only before anything reached the client, only for failures safe to retry.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Additional attempts after the first (0 disables retries).
    pub max_retries: u32,
    /// Pause before a retry.
    pub backoff_ms: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            max_retries: 1,
            backoff_ms: 20,
        }
    }
}

/// `[models.failover]`: a committed stream whose worker fails continues on a new pair.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct FailoverConfig {
    /// New pairs one request may migrate to after commit (0: a worker's failure ends the
    /// stream with an error event, as before).
    pub max_migrations: u32,
    /// The most delivered tokens a migration carries into the new pair's prompt; a stream
    /// past it fails instead (the new prefill recomputes all of them).
    pub max_migrated_tokens: u64,
}

impl Default for FailoverConfig {
    fn default() -> Self {
        FailoverConfig {
            max_migrations: 1,
            max_migrated_tokens: 8192,
        }
    }
}

impl Section for FailoverConfig {
    fn validate(&self, at: &str, out: &mut Problems) {
        if self.max_migrations > 16 {
            out.push(
                format!("{at}.max_migrations"),
                "must be at most 16 (each migration recomputes the whole stream)",
            );
        }
    }
}

impl Section for TimeoutConfig {
    fn validate(&self, at: &str, out: &mut Problems) {
        for (k, v) in [
            ("total_ms", self.total_ms),
            ("prefill_ms", self.prefill_ms),
            ("first_token_ms", self.first_token_ms),
            ("idle_ms", self.idle_ms),
            ("abort_ms", self.abort_ms),
            ("abort_confirm_ms", self.abort_confirm_ms),
            ("client_idle_ms", self.client_idle_ms),
        ] {
            if v == 0 {
                out.push(format!("{at}.{k}"), "must be greater than 0");
            }
        }
    }
}

/// `models[].queue`: waiting for a slot when every worker of a side is at its pair limit.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct QueueConfig {
    /// How long a request may wait for a slot, ms (0: no queue, 503 `workers_busy` at once).
    pub max_wait_ms: u64,
    /// Requests one tenant may have waiting at once (past it, 503 at once).
    pub max_per_tenant: usize,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            max_wait_ms: 0,
            max_per_tenant: 64,
        }
    }
}

impl Section for QueueConfig {
    fn validate(&self, at: &str, out: &mut Problems) {
        if self.max_wait_ms > 0 && self.max_per_tenant == 0 {
            out.push(
                format!("{at}.max_per_tenant"),
                "must be at least 1 with a queue",
            );
        }
    }
}

//! `[idempotency]`: how long and how much lockstep keeps of answers to requests sent with an
//! `Idempotency-Key` header, so a retry gets the same answer without a second generation.

use lockstep_runtime::toml_file::{Problems, Section};
use serde::Deserialize;

/// `[idempotency]`: requests with an `Idempotency-Key` header, per tenant.
#[derive(Debug, Clone, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct IdempotencyConfig {
    /// Whether the header is honoured. Off: a request carrying it is refused with 400 (it asks
    /// for something lockstep would not do).
    pub enabled: bool,
    /// How long a key is remembered after its request, seconds: a repeat within it is replayed
    /// (or refused), after it runs as a new request.
    pub window_secs: u64,
    /// The largest answer kept for replay, bytes: a repeat of a larger one is refused with 409
    /// `idempotent_answer_not_kept` (never generated twice).
    pub max_answer_bytes: usize,
    /// All answers kept at once, bytes: past it the oldest answers are dropped (their keys are
    /// still remembered, so a repeat is refused rather than generated twice).
    pub max_total_bytes: usize,
    /// Keys remembered at once: past it the oldest are forgotten.
    pub max_keys: usize,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        IdempotencyConfig {
            enabled: true,
            window_secs: 24 * 3600,
            max_answer_bytes: 1 << 20,
            max_total_bytes: 256 << 20,
            max_keys: 100_000,
        }
    }
}

impl Section for IdempotencyConfig {
    fn validate(&self, at: &str, out: &mut Problems) {
        if self.window_secs == 0 {
            out.push(format!("{at}.window_secs"), "must be at least 1");
        }
        if self.max_answer_bytes == 0 || self.max_answer_bytes > self.max_total_bytes {
            out.push(
                format!("{at}.max_answer_bytes"),
                "must be at least 1 and at most max_total_bytes",
            );
        }
        if self.max_keys == 0 {
            out.push(format!("{at}.max_keys"), "must be at least 1");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bounds_are_checked() {
        let keys = |c: &IdempotencyConfig| {
            let mut out = Problems::default();
            c.validate("idempotency", &mut out);
            out.into_vec()
                .into_iter()
                .map(|p| p.key)
                .collect::<Vec<_>>()
        };
        assert!(keys(&IdempotencyConfig::default()).is_empty());
        let d = IdempotencyConfig::default();
        for (bad, key) in [
            (
                IdempotencyConfig {
                    window_secs: 0,
                    ..d.clone()
                },
                "idempotency.window_secs",
            ),
            (
                IdempotencyConfig {
                    max_answer_bytes: 0,
                    ..d.clone()
                },
                "idempotency.max_answer_bytes",
            ),
            (
                IdempotencyConfig {
                    max_total_bytes: 10,
                    ..d.clone()
                },
                "idempotency.max_answer_bytes",
            ),
            (
                IdempotencyConfig {
                    max_keys: 0,
                    ..d.clone()
                },
                "idempotency.max_keys",
            ),
        ] {
            assert_eq!(keys(&bad), vec![key.to_string()]);
        }
    }
}

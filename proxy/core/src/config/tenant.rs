//! `[[tenants]]`: who holds which keys, and what they may do.

use std::collections::HashSet;

use lockstep_runtime::toml_file::{Problems, is_sha256_hex};
use serde::Deserialize;

/// One tenant: who holds which keys, and what they may do.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TenantConfig {
    /// The tenant's name (audit log, errors).
    pub name: String,
    /// A stable identity for the tenant's prefix-cache namespace (default: the name). Give one
    /// so a renamed tenant keeps its cached prefixes, and a later tenant given a freed name
    /// does not inherit them.
    pub id: String,
    /// Bumped to start the tenant's prefix-cache namespace afresh (key compromise, a name handed
    /// to someone else without an `id`): nothing cached under an earlier epoch is a hit again.
    pub cache_epoch: u32,
    /// sha256 (lowercase hex) of each API key the tenant uses; keys are never stored.
    /// `lockstep hash-key KEY` prints one.
    pub api_keys_sha256: Vec<String>,
    /// Models the tenant may use (`["*"]`: all).
    pub models: Vec<String>,
    /// Sustained requests per second (0: unlimited).
    pub requests_per_second: u32,
    /// Requests that may arrive at once above the rate (0: the rate).
    pub burst: u32,
    /// Requests in flight at once (0: unlimited).
    pub max_concurrent_pairs: u32,
    /// Prompt + completion tokens per minute (0: unlimited): each request reserves its prompt
    /// and `max_tokens` at admission and gives back what it did not use.
    pub tokens_per_minute: u64,
    /// Its share against other tenants' when requests wait for a slot (`models[].queue`): a
    /// tenant of weight 2 is served twice as often as one of weight 1 (at least 1).
    pub weight: u32,
    /// Its priority band when requests wait for a slot: a higher band is always served first.
    pub priority: i32,
}

impl Default for TenantConfig {
    fn default() -> Self {
        TenantConfig {
            name: String::new(),
            id: String::new(),
            cache_epoch: 0,
            api_keys_sha256: Vec::new(),
            models: vec!["*".into()],
            requests_per_second: 0,
            burst: 0,
            max_concurrent_pairs: 0,
            tokens_per_minute: 0,
            weight: 1,
            priority: 0,
        }
    }
}

/// The problems of the tenant list; `models` are the configured model names.
pub fn validate_tenants(tenants: &[TenantConfig], models: &HashSet<&str>, out: &mut Problems) {
    let mut names = HashSet::new();
    let mut ids = HashSet::new();
    let mut keys = HashSet::new();
    for (i, t) in tenants.iter().enumerate() {
        let at = format!("tenants[{i}]");
        if t.name.is_empty() {
            out.push(format!("{at}.name"), "required");
        } else if !names.insert(t.name.as_str()) {
            out.push(format!("{at}.name"), format!("`{}` is used twice", t.name));
        }
        if !t.id.is_empty() && !ids.insert(t.id.as_str()) {
            out.push(format!("{at}.id"), format!("`{}` is used twice", t.id));
        }
        if t.api_keys_sha256.is_empty() {
            out.push(
                format!("{at}.api_keys_sha256"),
                "at least one key hash is required",
            );
        }
        for (j, h) in t.api_keys_sha256.iter().enumerate() {
            let key = format!("{at}.api_keys_sha256[{j}]");
            if !is_sha256_hex(h) {
                out.push(
                    key,
                    "expected 64 lowercase hex digits (the sha256 of the key, not the key)",
                );
            } else if !keys.insert(h.as_str()) {
                out.push(key, "the same key is configured twice");
            }
        }
        for m in &t.models {
            if m != "*" && !models.contains(m.as_str()) {
                out.push(format!("{at}.models"), format!("no model named `{m}`"));
            }
        }
        if t.burst > 0 && t.requests_per_second == 0 {
            out.push(format!("{at}.burst"), "needs requests_per_second");
        }
    }
}

//! `[state]`: where the Responses API keeps stored responses and the Conversations API its
//! conversations (SQLite by default, Postgres for replicas).

use std::path::PathBuf;

use lockstep_runtime::toml_file::{Problems, Section};
use serde::Deserialize;

/// `[state]`: stored responses (`store`, `previous_response_id`, `background`) and
/// conversations. Without the table, responses are stored in SQLite under the user's data
/// directory.
#[derive(Debug, Clone, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct StateConfig {
    /// Whether responses are stored at all. Off: a request that leaves `store` out is not
    /// stored, and one that asks for state (`store: true`, `previous_response_id`,
    /// `conversation`, `background`) or calls the Conversations API is refused with 400.
    pub enabled: bool,
    /// `postgres://USER:PASSWORD@HOST:PORT/DB` (several replicas share it; `?sslmode=require`
    /// for TLS) or `sqlite://PATH`. Empty: SQLite in [`StateConfig::path`].
    pub url: String,
    /// The SQLite file when `url` is empty (default: `$XDG_DATA_HOME/lockstep/state.db`, else
    /// `~/.local/share/lockstep/state.db`).
    pub path: Option<PathBuf>,
    /// How long a stored response or conversation is kept after it was created, seconds (0:
    /// until deleted). Expired ones are gone from every read at once and deleted from the
    /// database within a minute.
    pub retention_secs: u64,
    /// Connections in the pool.
    pub max_connections: u32,
    /// How long one call to the database may take before the request is answered with 503
    /// `state_unavailable`, ms.
    pub timeout_ms: u64,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            enabled: true,
            url: String::new(),
            path: None,
            retention_secs: 30 * 24 * 3600,
            max_connections: 8,
            timeout_ms: 2000,
        }
    }
}

impl StateConfig {
    /// The database URL: `url`, else the SQLite file (`path`, else the default under the
    /// user's data directory).
    pub fn database_url(&self) -> String {
        if !self.url.trim().is_empty() {
            return self.url.trim().to_string();
        }
        format!("sqlite://{}?mode=rwc", self.sqlite_path().display())
    }

    /// The SQLite file used when `url` is empty.
    pub fn sqlite_path(&self) -> PathBuf {
        self.path.clone().unwrap_or_else(default_path)
    }
}

/// `$XDG_DATA_HOME/lockstep/state.db`, else `~/.local/share/lockstep/state.db` (the working
/// directory's `lockstep-state.db` without a home).
fn default_path() -> PathBuf {
    let data = std::env::var_os("XDG_DATA_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")));
    match data {
        Some(d) => d.join("lockstep").join("state.db"),
        None => PathBuf::from("lockstep-state.db"),
    }
}

impl Section for StateConfig {
    fn validate(&self, at: &str, out: &mut Problems) {
        let url = self.url.trim();
        if !url.is_empty() {
            if !["postgres://", "postgresql://", "sqlite://"]
                .iter()
                .any(|p| url.starts_with(p))
            {
                out.push(
                    format!("{at}.url"),
                    "expected `postgres://USER:PASSWORD@HOST:PORT/DB` or `sqlite://PATH`",
                );
            }
            if self.path.is_some() {
                out.push(
                    format!("{at}.path"),
                    "names the SQLite file used without `url`; give one of the two",
                );
            }
        }
        if self.max_connections == 0 {
            out.push(format!("{at}.max_connections"), "must be at least 1");
        }
        if self.timeout_ms == 0 {
            out.push(format!("{at}.timeout_ms"), "must be at least 1");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(c: &StateConfig) -> Vec<String> {
        let mut out = Problems::default();
        c.validate("state", &mut out);
        out.into_vec().into_iter().map(|p| p.key).collect()
    }

    #[test]
    fn the_url_the_pool_and_the_timeout_are_checked() {
        assert!(problems(&StateConfig::default()).is_empty());
        let pg = StateConfig {
            url: "postgres://u:p@127.0.0.1:5432/db".into(),
            ..StateConfig::default()
        };
        assert!(problems(&pg).is_empty());
        assert_eq!(pg.database_url(), "postgres://u:p@127.0.0.1:5432/db");
        for (bad, key) in [
            (
                StateConfig {
                    url: "mysql://x".into(),
                    ..StateConfig::default()
                },
                "state.url",
            ),
            (
                StateConfig {
                    path: Some("/x.db".into()),
                    ..pg.clone()
                },
                "state.path",
            ),
            (
                StateConfig {
                    max_connections: 0,
                    ..StateConfig::default()
                },
                "state.max_connections",
            ),
            (
                StateConfig {
                    timeout_ms: 0,
                    ..StateConfig::default()
                },
                "state.timeout_ms",
            ),
        ] {
            assert_eq!(problems(&bad), vec![key.to_string()]);
        }
    }

    #[test]
    fn sqlite_lives_in_the_path_given_or_the_data_directory() {
        let c = StateConfig {
            path: Some("/var/lib/lockstep/s.db".into()),
            ..StateConfig::default()
        };
        assert_eq!(c.database_url(), "sqlite:///var/lib/lockstep/s.db?mode=rwc");
        let d = StateConfig::default().sqlite_path();
        assert!(d.ends_with("lockstep/state.db"), "{}", d.display());
    }
}

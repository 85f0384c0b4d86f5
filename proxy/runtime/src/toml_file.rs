//! The one TOML loader of `serve`, `check` and `worker`: read, parse with the key path of any
//! error, resolve relative paths against the file's folder, then let every section list its
//! problems at once (each naming its key path), so `lockstep check` shows them all.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

/// One semantic problem of a configuration: the key path and what is wrong there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Where: `models[0] (m).timeouts.total_ms`.
    pub key: String,
    /// What was expected, or why the value cannot work.
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}

/// The problems of a configuration, collected section by section.
#[derive(Debug, Default)]
pub struct Problems(Vec<Problem>);

impl Problems {
    /// Records a problem at `key`.
    pub fn push(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.0.push(Problem {
            key: key.into(),
            message: message.into(),
        });
    }

    /// Every problem, in the order found.
    pub fn into_vec(self) -> Vec<Problem> {
        self.0
    }
}

/// A section of a configuration file that checks itself.
pub trait Section {
    /// Records every problem of this section; `at` is its key path (`models[0] (m)`).
    fn validate(&self, at: &str, out: &mut Problems);
}

/// A whole configuration file.
pub trait ConfigFile: DeserializeOwned {
    /// Makes relative paths relative to `base` (the file's folder) and expands `~/`.
    fn resolve_paths(&mut self, base: &Path);
    /// Every semantic problem; empty when the file is valid.
    fn problems(&self) -> Vec<Problem>;
    /// Remembers the file it was read from.
    fn set_source(&mut self, _path: &Path) {}
}

/// A configuration that could not be loaded or is not valid.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: cannot read: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The TOML does not parse or does not match the schema.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// Key path, position and what was expected.
        message: String,
    },
    /// The configuration parses but has problems; all of them are listed.
    #[error("{path}: {} problem(s):\n  - {}", problems.len(), lines(problems).join("\n  - "))]
    Invalid {
        /// The file (or `built-in configuration`).
        path: PathBuf,
        /// Every problem, each naming its key path.
        problems: Vec<Problem>,
    },
}

/// Problems as display lines.
pub fn lines(problems: &[Problem]) -> Vec<String> {
    problems.iter().map(Problem::to_string).collect()
}

/// Parses TOML text; the error names the key path and what was expected.
pub fn parse<T: DeserializeOwned>(text: &str) -> Result<T, String> {
    let de = toml::Deserializer::parse(text).map_err(|e| e.to_string().trim_end().to_string())?;
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        format!("at `{path}`: {}", inner.trim_end())
    })
}

/// Reads, parses, resolves and validates a configuration file.
pub fn load<T: ConfigFile>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let base = path.parent().unwrap_or(Path::new("."));
    let mut cfg: T = from_text(&text, base, path)?;
    cfg.set_source(path);
    Ok(cfg)
}

/// Parses, resolves against `base` and validates `text`; errors name `shown` as the file.
pub fn from_text<T: ConfigFile>(text: &str, base: &Path, shown: &Path) -> Result<T, ConfigError> {
    let mut cfg: T = parse(text).map_err(|message| ConfigError::Parse {
        path: shown.to_path_buf(),
        message,
    })?;
    cfg.resolve_paths(base);
    let problems = cfg.problems();
    if problems.is_empty() {
        Ok(cfg)
    } else {
        Err(ConfigError::Invalid {
            path: shown.to_path_buf(),
            problems,
        })
    }
}

/// `~/x` → `$HOME/x`.
pub fn expand_home(p: &Path) -> PathBuf {
    match (p.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => p.to_path_buf(),
    }
}

/// Expands `~/` in `p` and makes it relative to `base` when it is relative.
pub fn resolve(p: &mut PathBuf, base: &Path) {
    *p = expand_home(p);
    if p.is_relative() {
        *p = base.join(&*p);
    }
}

/// 64 lowercase hex digits (a sha256, as configured for keys and model files).
pub fn is_sha256_hex(h: &str) -> bool {
    h.len() == 64
        && h.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct File {
        n: u64,
        p: PathBuf,
    }

    impl ConfigFile for File {
        fn resolve_paths(&mut self, base: &Path) {
            resolve(&mut self.p, base);
        }
        fn problems(&self) -> Vec<Problem> {
            let mut out = Problems::default();
            if self.n == 0 {
                out.push("n", "must be greater than 0");
            }
            out.into_vec()
        }
    }

    #[test]
    fn errors_name_the_key_path_and_every_problem() {
        let e = parse::<File>("n = \"x\"\np = \"a\"").unwrap_err();
        assert!(e.contains("`n`"), "{e}");
        let e = parse::<File>("n = 1\np = \"a\"\nq = 2").unwrap_err();
        assert!(e.contains('q'), "{e}");
        let e = from_text::<File>("n = 0\np = \"a\"", Path::new("/b"), Path::new("f.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("f.toml") && e.contains("n: must be greater than 0"),
            "{e}"
        );
        let f: File = from_text("n = 1\np = \"a\"", Path::new("/b"), Path::new("f")).unwrap();
        assert_eq!(f.p, Path::new("/b/a"));
    }
}

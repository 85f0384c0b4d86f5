//! lockstep-runtime: what every lockstep process (the router and the workers) needs to serve,
//! and nothing of either: the accept loop ([`accept`], with its idle tracking), TLS on listeners ([`tls`]), signals
//! ([`signals`]), background tasks ([`tasks`]), connection threads ([`threads`]), logs and traces ([`telemetry`]), the TOML loader
//! with per-section validation ([`toml_file`]), the engine section both processes read
//! ([`engine_section`]) and the model-file fetch ([`model_file`]).
//!
//! The crate map and a request's path through the code: `docs/ARCHITECTURE.md`.

pub mod accept;
mod activity;
pub mod busy_poll;
pub mod engine_section;
pub mod memory;
pub mod model_file;
pub mod signals;
pub mod tasks;
pub mod telemetry;
pub mod threads;
pub mod tls;
pub mod toml_file;

/// `grpc-timeout`: an integer of at most 8 digits and a unit (H, M, S, m, u, n).
pub fn grpc_timeout(meta: &tonic::metadata::MetadataMap) -> Option<std::time::Duration> {
    let v = meta.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => std::time::Duration::from_secs(n * 3600),
        "M" => std::time::Duration::from_secs(n * 60),
        "S" => std::time::Duration::from_secs(n),
        "m" => std::time::Duration::from_millis(n),
        "u" => std::time::Duration::from_micros(n),
        "n" => std::time::Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_parses_every_unit_and_refuses_malformed_values() {
        let parse = |v: &str| {
            let mut m = tonic::metadata::MetadataMap::new();
            m.insert("grpc-timeout", v.parse().expect("ascii"));
            grpc_timeout(&m)
        };
        assert_eq!(parse("2H"), Some(std::time::Duration::from_secs(7200)));
        assert_eq!(parse("3M"), Some(std::time::Duration::from_secs(180)));
        assert_eq!(parse("5S"), Some(std::time::Duration::from_secs(5)));
        assert_eq!(parse("250m"), Some(std::time::Duration::from_millis(250)));
        assert_eq!(parse("7u"), Some(std::time::Duration::from_micros(7)));
        assert_eq!(parse("9n"), Some(std::time::Duration::from_nanos(9)));
        for bad in ["", "S", "5", "5x", "123456789S", "-1S", "1.5S"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
        assert_eq!(grpc_timeout(&tonic::metadata::MetadataMap::new()), None);
    }
}

//! The audit log: one JSON line per aborted pair, per integrity event and per migration of a
//! committed stream to a new pair, to a file (appended) or
//! stdout (`server.audit_log`: a path, `-`, or empty for off). It carries the pair id, tenant,
//! model, reason, the side that failed, both workers and the timings; never prompt or answer
//! content (no field can hold text from either).

use std::io::Write;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// Where audit lines go.
#[derive(Default)]
pub struct Audit {
    sink: Option<Mutex<Box<dyn Write + Send>>>,
}

impl std::fmt::Debug for Audit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Audit")
            .field("enabled", &self.sink.is_some())
            .finish()
    }
}

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AuditKind {
    /// A pair ended aborted on both halves.
    PairAborted,
    /// The halves disagreed or a KV transfer failed verification (also logged as `pair_aborted`).
    IntegrityViolation,
    /// A committed stream's failed pair was replaced by a new one (`pair_id`), continuing from
    /// what had been delivered (`migrated_from`: the failed pair, logged as `pair_aborted`).
    PairMigrated,
}

/// Milliseconds a pair spent, as far as it got.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct AuditTimings {
    /// Request start → this event.
    pub since_request_ms: u64,
    /// This pair's dispatch → this event.
    pub since_dispatch_ms: u64,
    /// Dispatch → commit barrier, when it was passed.
    pub barrier_ms: Option<u64>,
}

/// One audit line. Every field is metadata: ids, names, codes, numbers.
#[derive(Debug, Clone, Serialize)]
pub struct AuditEvent<'a> {
    /// Unix time, milliseconds.
    pub ts_ms: u64,
    /// What happened.
    pub event: AuditKind,
    /// The pair (hex, as in error bodies and logs).
    pub pair_id: String,
    /// The tenant whose request it was, when tenants are configured.
    pub tenant: Option<&'a str>,
    /// The model.
    pub model: &'a str,
    /// The abort reason (`prefill_failed`, `integrity`, `deadline_idle`, ...).
    pub reason: &'a str,
    /// For integrity events: which check failed.
    pub integrity_kind: Option<&'a str>,
    /// The side that failed: `prefill`, `decode` or `none`.
    pub side: &'a str,
    /// The stable error code the client received (or would have, for a vanished client).
    pub error_code: &'a str,
    /// Prefill worker.
    pub prefill_worker: &'a str,
    /// Decode worker.
    pub decode_worker: &'a str,
    /// Retry attempt (0 for the first pair of a request).
    pub attempt: u32,
    /// Whether tokens had already reached the client.
    pub committed: bool,
    /// Timings.
    pub timings: AuditTimings,
    /// For `pair_migrated`: the pair it replaces.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub migrated_from: Option<String>,
    /// For `pair_migrated`: the completion tokens carried into the new pair's prompt.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub carried_tokens: Option<u64>,
}

/// Unix time in milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Audit {
    /// Opens the sink: empty = off, `-` = stdout, else a file opened for appending (created with
    /// its directory if needed).
    pub fn open(path: &str) -> Result<Audit, String> {
        let sink: Box<dyn Write + Send> = match path {
            "" => return Ok(Audit::default()),
            "-" => Box::new(std::io::stdout()),
            p => {
                let p = std::path::Path::new(p);
                if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir)
                        .map_err(|e| format!("audit log {}: {e}", p.display()))?;
                }
                Box::new(
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(p)
                        .map_err(|e| format!("audit log {}: {e}", p.display()))?,
                )
            }
        };
        Ok(Audit {
            sink: Some(Mutex::new(sink)),
        })
    }

    /// Whether lines are written anywhere.
    pub fn enabled(&self) -> bool {
        self.sink.is_some()
    }

    /// Writes one line (whole, flushed). A failing sink is logged, never fatal to the request.
    pub fn record(&self, ev: &AuditEvent<'_>) {
        let Some(sink) = &self.sink else {
            return;
        };
        let mut line = match serde_json::to_vec(ev) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "audit event not serialisable");
                return;
            }
        };
        line.push(b'\n');
        let mut w = sink.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = w.write_all(&line).and_then(|()| w.flush()) {
            tracing::error!(error = %e, "audit log write failed");
        }
    }
}

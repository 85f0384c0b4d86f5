//! How workers are named to API callers: by their side and place in the pool (`prefill-0`, in
//! configuration order, then in the order workers joined at run time; a name stays while its
//! worker is a member), never by their address. Addresses stay on the admin API (`/admin/workers`
//! maps one to the other), in logs and in the audit log.

use super::WorkerPool;

/// The name of a pool's worker at `index` in metrics and API answers: `prefill-0`, `decode-2`.
pub fn worker_label(side: &str, index: usize) -> String {
    format!("{side}-{index}")
}

impl WorkerPool {
    /// The name of the worker at `url` ([`worker_label`]); `None` when it is not in the pool.
    pub fn label_of(&self, side: &str, url: &str) -> Option<String> {
        self.member_at(url).map(|w| w.label(side))
    }
}

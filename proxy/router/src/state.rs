//! The router's shared state: the served models (one generation, swapped whole on reload), the
//! live pairs, tenants and the process-wide counters the front ends read.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use arc_swap::ArcSwap;
use lockstep_engine::pd::Pd;
use tokio::task::JoinHandle;

use crate::admission::Admission;
use crate::audit::Audit;
use crate::backend::UpstreamClient;
use crate::config::ModelConfig;
use crate::metrics::Metrics;
use crate::pair::{PairRegistry, PairRuntime, PairStats};
use crate::tenant::Tenants;

/// One served model.
#[derive(Debug)]
pub struct ModelRuntime {
    /// The name clients use.
    pub name: Arc<str>,
    /// Its configuration.
    pub cfg: ModelConfig,
    /// Tokenizer and chat template.
    pub admission: Arc<Admission>,
    /// Its pair lifecycle and pools.
    pub pairs: Arc<PairRuntime>,
    /// The embedded engines, for `backend = "embedded"`.
    pub engine: Option<Arc<Pd>>,
    pub(crate) kv_capacity: AtomicU64,
}

impl ModelRuntime {
    /// The KV capacity admission uses: the configured one, or less when workers reported less.
    pub fn kv_capacity(&self) -> u64 {
        self.kv_capacity.load(Ordering::Acquire)
    }
}

/// One generation of served models. Reload builds a new one and swaps it in atomically; pairs in
/// flight keep the `ModelRuntime` they started with.
#[derive(Debug, Default)]
pub struct Models {
    /// Models by name.
    pub by_name: BTreeMap<String, Arc<ModelRuntime>>,
    pub(crate) health: Vec<JoinHandle<()>>,
}

impl Drop for Models {
    fn drop(&mut self) {
        for t in &self.health {
            t.abort();
        }
    }
}

/// Shared state of the front ends.
#[derive(Debug)]
pub struct AppState {
    /// The current generation of models.
    pub models: ArcSwap<Models>,
    /// Live pairs of all models.
    pub registry: Arc<PairRegistry>,
    /// Outcome counters of all models.
    pub stats: Arc<PairStats>,
    /// Prometheus metrics.
    pub metrics: Arc<Metrics>,
    /// The audit log (`server.audit_log`; a reload keeps the one opened at start).
    pub audit: Arc<Audit>,
    /// Largest accepted body.
    pub max_body_bytes: usize,
    /// Set while shutting down: `/ready` fails.
    pub draining: AtomicBool,
    /// Tenants and their keys and limits (swapped on reload).
    pub tenants: ArcSwap<Tenants>,
    /// The configuration file (admin reload re-reads it); `None` for the built-in one.
    pub config_path: Option<std::path::PathBuf>,
    /// Worker URLs an operator is draining (re-applied to the workers of a reloaded config).
    pub drained: dashmap::DashSet<String>,
    pub(crate) client: UpstreamClient,
}

//! `lockstep sidecar`: the prefill/decode sidecar of one decode engine behind a Gateway (llm-d's
//! routing sidecar). An endpoint picker names the prefill of each request in
//! `x-prefiller-host-port`; the sidecar checks that name ([`named`]: what may be named, kept
//! within a bound) and pins the request's pair to it ([`pin`]), and serves the engine's own pages
//! in place of the router's ([`pages`]).

mod named;
mod pages;
mod pin;

use std::sync::Arc;

use futures_util::future::BoxFuture;
use http::HeaderMap;
use lockstep_core::config::Config;
use lockstep_core::error::LockstepError;
use lockstep_router::app::Lockstep;
use lockstep_router::state::{AppState, ModelRuntime, Role, RoleData};
use lockstep_routing::pool::PrefillPin;

pub use named::{NamedPrefill, NamedPrefills, PREFILLER_HEADER};

/// The sidecar's role in the router: phase 1 reads the named prefill, phase 2 pins the pair to
/// it (or lets the decode serve alone, where its backend can); the HTTP listener serves the
/// engine's pages; readiness needs no prefill worker (they are named per request).
#[derive(Debug)]
pub struct SidecarRole {
    /// What a request may name, and the prefills named so far.
    pub named: NamedPrefills,
}

impl SidecarRole {
    /// The sidecar role of the running router `state`, if it runs as one.
    pub fn of(state: &AppState) -> Option<&SidecarRole> {
        (&*state.role as &dyn std::any::Any).downcast_ref()
    }
}

impl Role for SidecarRole {
    fn name(&self) -> &'static str {
        "sidecar"
    }

    fn on_headers(&self, headers: &HeaderMap) -> Result<RoleData, LockstepError> {
        Ok(NamedPrefills::read(headers)?.map(|n| Arc::new(n) as _))
    }

    fn pin_prefill<'a>(
        &'a self,
        model: &'a Arc<ModelRuntime>,
        data: &'a RoleData,
        prompt_tokens: usize,
    ) -> BoxFuture<'a, Result<PrefillPin, LockstepError>> {
        let named = data
            .as_deref()
            .and_then(|d| d.downcast_ref::<NamedPrefill>());
        Box::pin(pin::pin(&self.named, model, named, prompt_tokens))
    }

    fn http_routes(
        &self,
        state: &Arc<AppState>,
        with_metrics: bool,
    ) -> Option<axum::Router<Arc<AppState>>> {
        let r = lockstep_router::http::generation_routes(state);
        Some(pages::routes(r, with_metrics))
    }

    fn needs_prefill_workers(&self) -> bool {
        false
    }
}

/// Starts `lockstep sidecar` from `cfg` (fitted with `Config::for_role`: its `[sidecar]` table).
pub async fn start(mut cfg: Config) -> Result<Lockstep, String> {
    // Fitted here too, whoever calls: one local engine's model, no other role's table.
    cfg.for_role(lockstep_core::config::Role::Sidecar)?;
    let section = cfg
        .sidecar
        .as_ref()
        .ok_or("a sidecar needs its [sidecar] table")?;
    let role = SidecarRole {
        named: NamedPrefills::new(section)?,
    };
    Lockstep::start_as(cfg, Arc::new(role)).await
}

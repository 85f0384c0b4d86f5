//! Abort-both: telling both workers to let go of a failed pair, and, where the backend's answers
//! show it, keeping at it until they have.
//!
//! SGLang drops an `/abort_request` whose rid it has not registered yet (the abort can overtake
//! its request on another connection), and notices a client that went away only at its next 4 s
//! check. So for such a backend ([`PdBackend::confirms_abort`]) the failed pair's halves stay
//! open after the failure: the abort is sent again every [`RESEND_EVERY`] while a half's own
//! answer has not ended, until it ends (the worker let go: the release time is measured) or
//! `timeouts.abort_confirm_ms` passes (the request is dropped and the half counted unconfirmed).
//! Nothing read from a half after its pair failed goes anywhere.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use prometheus::{Histogram, IntCounter};
use tokio::time::Instant;

use super::AbortsInFlight;
use crate::backend::{
    DecodeChunk, DecodeStream, Dispatch, HalfError, PdBackend, PrefillReport, Side,
};
use lockstep_core::metrics::Metrics;

/// How long an abort waits for its half's answer to end before it is sent again.
pub(super) const RESEND_EVERY: Duration = Duration::from_millis(250);

/// The prefill half's answer, in flight.
pub(super) type PrefillFuture = BoxFuture<'static, Result<PrefillReport, HalfError>>;

/// A pair's two halves while their answers are still open (`None` once one has ended).
#[derive(Default)]
pub(super) struct Halves {
    /// The prefill's answer, until it arrived.
    pub prefill: Option<PrefillFuture>,
    /// The decode's stream, until it ended or failed.
    pub decode: Option<DecodeStream>,
}

/// Waits for the prefill's answer and marks it ended; pending forever once it has (cancel-safe:
/// dropped early, the answer stays in flight).
pub(super) async fn prefill_answer(
    prefill: &mut Option<PrefillFuture>,
) -> Result<PrefillReport, HalfError> {
    let Some(f) = prefill.as_mut() else {
        return std::future::pending().await;
    };
    let r = f.await;
    *prefill = None;
    r
}

/// The decode's next chunk; the stream is marked ended at its end or first error (cancel-safe).
pub(super) async fn decode_chunk(
    decode: &mut Option<DecodeStream>,
) -> Option<Result<DecodeChunk, HalfError>> {
    let Some(s) = decode.as_mut() else {
        return std::future::pending().await;
    };
    let c = s.next().await;
    if !matches!(c, Some(Ok(_))) {
        *decode = None;
    }
    c
}

/// One half still open after its pair failed.
enum Open {
    Prefill(PrefillFuture),
    Decode(DecodeStream),
}

impl Open {
    /// Resolves when the half's answer has ended, however it ended; what it says is discarded.
    async fn ended(&mut self) {
        match self {
            Open::Prefill(f) => {
                let _ = f.await;
            }
            Open::Decode(s) => while let Some(Ok(_)) = s.next().await {},
        }
    }
}

/// What abort-both needs besides the pair: bounds and where to count.
pub(super) struct AbortPlan<'a> {
    /// The model (metric label).
    pub model: &'a str,
    /// Bound on each abort call.
    pub call_bound: Duration,
    /// How long a half's answer may stay open after the failure (`abort_confirm_ms`).
    pub confirm_bound: Duration,
    /// When the pair failed.
    pub failed_at: Instant,
    /// Where the time to both first aborts answered goes.
    pub latency: Histogram,
    /// Held until every abort and confirmation is done, so a drain waits for them.
    pub in_flight: AbortsInFlight,
}

/// Sends the abort to both halves in the background, never delaying the client's error; where
/// the backend confirms aborts, keeps each open half until its answer ends (see the module).
pub(super) fn abort_both(
    backend: &Arc<dyn PdBackend>,
    metrics: &Metrics,
    d: &Dispatch,
    halves: Halves,
    plan: AbortPlan<'_>,
) {
    let confirm = backend.capabilities().confirms_abort;
    // Without confirmation the halves are dropped here: closing the request is itself the
    // abort for those backends.
    let (prefill, decode) = if confirm {
        (
            halves.prefill.map(Open::Prefill),
            halves.decode.map(Open::Decode),
        )
    } else {
        (None, None)
    };
    let side = |side: Side| SideAbort {
        side,
        backend: backend.clone(),
        d: d.clone(),
        bound: plan.call_bound,
        resent: metrics
            .pairs
            .abort_resent
            .with_label_values(&[plan.model, side.as_str()]),
        unconfirmed: metrics
            .pairs
            .abort_unconfirmed
            .with_label_values(&[plan.model, side.as_str()]),
        released: metrics
            .pairs
            .half_release_seconds
            .with_label_values(&[plan.model, side.as_str()]),
    };
    let (p, dd) = (side(Side::Prefill), side(Side::Decode));
    let AbortPlan {
        confirm_bound,
        failed_at,
        latency,
        in_flight,
        ..
    } = plan;
    let until = failed_at + confirm_bound;
    tokio::spawn(async move {
        let (p, dd) = tokio::join!(p.first(), dd.first());
        latency.observe(failed_at.elapsed().as_secs_f64());
        tokio::join!(
            p.confirm(prefill, failed_at, until),
            dd.confirm(decode, failed_at, until)
        );
        drop(in_flight);
    });
}

/// One half's abort.
struct SideAbort {
    side: Side,
    backend: Arc<dyn PdBackend>,
    d: Dispatch,
    bound: Duration,
    resent: IntCounter,
    unconfirmed: IntCounter,
    released: Histogram,
}

impl SideAbort {
    /// One abort call, bounded; failures are logged (the confirmation, where there is one,
    /// tries again).
    async fn call(&self) {
        let (pair, side) = (self.d.pair_id, self.side.as_str());
        match tokio::time::timeout(self.bound, self.backend.abort(&self.d, self.side)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(pair = %pair, side, error = %e, "abort call failed"),
            Err(_) => tracing::warn!(pair = %pair, side, "abort call timed out"),
        }
    }

    /// The first abort call.
    async fn first(self) -> SideAbort {
        self.call().await;
        self
    }

    /// Until the half's answer ends, the abort again every [`RESEND_EVERY`]; by `until`, the
    /// half is dropped unconfirmed.
    async fn confirm(self, open: Option<Open>, failed_at: Instant, until: Instant) {
        let Some(mut open) = open else {
            return;
        };
        loop {
            let wait = (Instant::now() + RESEND_EVERY).min(until);
            if tokio::time::timeout_at(wait, open.ended()).await.is_ok() {
                self.released.observe(failed_at.elapsed().as_secs_f64());
                return;
            }
            if Instant::now() >= until {
                tracing::warn!(pair = %self.d.pair_id, side = self.side.as_str(), "aborted half still open after abort_confirm_ms: dropped unconfirmed");
                self.unconfirmed.inc();
                return;
            }
            self.resent.inc();
            self.call().await;
        }
    }
}

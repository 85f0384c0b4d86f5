//! A pair's pick when the workers are full: waiting its turn in the model's fair queue
//! (`models[].queue`; the queue's order is `queue.rs`'s).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::{Instant as TokioInstant, sleep, sleep_until};

use super::PairEvent;
use super::lifecycle::{Attempt, Avoid, ModelPairs, Request};
use lockstep_core::ids::Side;

/// How often the head looks for a slot when no notification came (a slot freed by a pair of
/// a configuration that was reloaded away notifies the old pools).
const RECHECK: Duration = Duration::from_millis(20);

impl ModelPairs {
    /// Picks both workers; where every worker of a side is busy and the model has a queue, the
    /// request waits its turn (and a request arriving while others wait queues behind them).
    /// `Err` names the side no worker could take: busy past `max_wait_ms`, a full tenant
    /// queue, no healthy worker, or the client gone.
    pub(super) async fn pick_queued(
        &self,
        req: &Request,
        avoid: &Avoid,
        attempt: u32,
        tx: &mpsc::Sender<PairEvent>,
    ) -> Result<Attempt, Side> {
        let cfg = &self.queue_cfg;
        let first = if self.queue.has_waiters() && cfg.max_wait_ms > 0 {
            Err(Side::Decode)
        } else {
            self.pick(req, avoid, attempt)
        };
        let side = match first {
            Ok(a) => return Ok(a),
            Err(side) if cfg.max_wait_ms == 0 => return Err(side),
            Err(side) => side,
        };
        // A side with no worker taking pairs fails now; a busy one (or one whose slot freed
        // since the try) is waited for.
        let down = |s: Side| match s {
            Side::Prefill => !self.prefill.any_healthy(),
            Side::Decode => !self.decode.any_healthy(),
        };
        if down(side) {
            return Err(side);
        }
        let tenant: Arc<str> = req.tenant.clone().unwrap_or_else(|| "".into());
        let Some(ticket) = self
            .queue
            .join(&tenant, req.weight, req.priority, cfg.max_per_tenant)
        else {
            return Err(side);
        };
        let waited = TokioInstant::now();
        let deadline = waited + Duration::from_millis(cfg.max_wait_ms);
        let depth = self
            .metrics
            .admission
            .queue_depth
            .with_label_values(&[&*self.model, &*tenant]);
        depth.inc();
        let result = loop {
            // The head tries first; one behind it once those ahead found no slot (a head pinned
            // to a saturated prefill blocks no request that could run elsewhere).
            if ticket.may_try() {
                match self.pick(req, avoid, attempt) {
                    Ok(a) => {
                        ticket.served();
                        break Ok(a);
                    }
                    Err(s) if down(s) => break Err(s),
                    Err(_) => ticket.found_none(),
                }
            }
            // Listened for after the try: the try's own slot on the other side, taken and given
            // back, is no slot freed. One freed in between is seen at the next recheck.
            let freed_p = self.prefill.freed().notified();
            let freed_d = self.decode.freed().notified();
            let turn = self.queue.turn().notified();
            tokio::select! {
                _ = freed_p => self.queue.slot_freed(),
                _ = freed_d => self.queue.slot_freed(),
                _ = turn => {}
                _ = sleep(RECHECK) => {}
                _ = sleep_until(deadline) => break Err(side),
                _ = tx.closed() => break Err(side),
            }
        };
        depth.dec();
        self.metrics
            .admission
            .queue_wait
            .with_label_values(&[&*self.model, &*tenant])
            .observe(waited.elapsed().as_secs_f64());
        drop(ticket);
        // The next head may take the slot this one did not need.
        self.decode.freed().notify_waiters();
        result
    }
}

//! Where a model's workers come from at run time: a stream of membership changes (the admin API's
//! `POST /admin/workers/add` and `/remove` today; service discovery next). The configuration's
//! workers are the pool at start; each change then joins or removes one worker, and the model's
//! member task (the `members` module) checks a joined worker before it takes pairs, checks each
//! member's health, and makes its backend forget a worker that left.

use futures_util::stream::BoxStream;
use tokio::sync::mpsc;

use lockstep_core::config::WorkerConfig;
use lockstep_core::ids::Side;

/// One change to a model's pools.
#[derive(Debug, Clone)]
pub enum MemberChange {
    /// A worker appeared on `side`.
    Join {
        /// Its side.
        side: Side,
        /// How to reach it.
        worker: WorkerConfig,
    },
    /// A prefill a request named (`lockstep sidecar`): it joins the prefill pool as
    /// [`MemberChange::Join`] does, and what it reports limits only the pairs pinned to it.
    Named {
        /// How to reach it.
        worker: WorkerConfig,
    },
    /// The worker at `url` is gone from `side`.
    Leave {
        /// Its side.
        side: Side,
        /// Its URL.
        url: String,
    },
    /// The workers that joined `side` at run time are now exactly these (a discovery source's
    /// whole current list): the others leave, the new ones join, one whose settings changed
    /// (its bootstrap port) leaves and joins again. Configured workers are not touched.
    Replace {
        /// Its side.
        side: Side,
        /// The workers.
        workers: Vec<WorkerConfig>,
    },
}

/// A source of membership changes for one model.
pub type WorkerSource = BoxStream<'static, MemberChange>;

/// The sending end of a model's membership changes, held by whatever learns of them (the admin
/// API); the model's member task reads them in order.
#[derive(Debug, Clone)]
pub struct MemberFeed(mpsc::UnboundedSender<MemberChange>);

impl MemberFeed {
    /// A feed and the source its changes come out of.
    pub fn new() -> (MemberFeed, WorkerSource) {
        let (tx, rx) = mpsc::unbounded_channel();
        let source =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|c| (c, rx)) },
            );
        (MemberFeed(tx), Box::pin(source))
    }

    /// Sends a change; `false` when the model's member task is gone (the model was replaced).
    pub fn send(&self, change: MemberChange) -> bool {
        self.0.send(change).is_ok()
    }
}

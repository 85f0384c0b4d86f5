//! The pair: its id, the registry of live pairs, and the lifecycle that owns each one.

mod abort;
mod lifecycle;
mod machine;
mod observer;
mod outcome;
mod queue;
mod queued;
mod registry;
mod verdict;

pub use lifecycle::ModelPairs;
pub use lockstep_prompt::Detok;
pub use outcome::{AbortReason, Outcome, PairEvent, PairStats};
pub use queue::FairQueue;
pub use registry::{AbortsInFlight, CancelReason, PairGuard, PairInfo, PairRegistry, PairState};

pub use lockstep_core::ids::{PairId, RidText};

#[cfg(test)]
mod machine_check;
#[cfg(test)]
mod machine_tests;
#[cfg(test)]
mod proptests;

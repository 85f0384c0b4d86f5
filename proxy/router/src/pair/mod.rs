//! The pair: its id, the registry of live pairs, and the lifecycle that owns each one.

mod lifecycle;
mod observer;
mod outcome;
mod registry;

pub use lifecycle::PairRuntime;
pub use outcome::{AbortReason, Outcome, PairEvent, PairStats};
pub use registry::{CancelReason, PairGuard, PairInfo, PairRegistry, PairState};

use serde::{Serialize, Serializer};

/// A pair id: random, 63 bits, unique among live pairs. Used as SGLang's `bootstrap_room`
/// (an integer) and as the `rid` of both halves (its decimal string). In lockstep's own JSON it
/// is always a string, since it exceeds 2^53.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PairId(u64);

impl PairId {
    /// A fresh random 63-bit id (not checked for uniqueness: the registry does that).
    pub fn random() -> PairId {
        PairId(rand::random::<u64>() >> 1)
    }
    /// Wraps a raw value (tests, parsing).
    pub fn from_raw(raw: u64) -> PairId {
        PairId(raw & (u64::MAX >> 1))
    }
    /// The raw integer, as SGLang's `bootstrap_room`.
    pub fn raw(self) -> u64 {
        self.0
    }
}

impl std::fmt::Display for PairId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl Serialize for PairId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod proptests;

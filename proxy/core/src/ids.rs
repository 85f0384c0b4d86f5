//! The pair's identity: its id (SGLang's `bootstrap_room` and both halves' `rid`) and its two
//! sides.

use serde::{Serialize, Serializer};

/// A pair id: random, 63 bits, unique among live pairs. Used as SGLang's `bootstrap_room`
/// (an integer) and as the `rid` of both halves (its decimal string). In lockstep's own JSON it
/// is always a string, since it exceeds 2^53.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PairId(u64);

impl PairId {
    /// A fresh random 63-bit id, never 0 (SGLang's decode reads `bootstrap_room == 0` as
    /// "metadata not written", `srt/disaggregation/decode.py`); not checked for uniqueness: the
    /// registry does that.
    pub fn random() -> PairId {
        PairId((rand::random::<u64>() >> 1).max(1))
    }
    /// The id as SGLang's `rid`: 19 digits, zero-padded. SGLang's scheduler aborts every request
    /// whose rid *starts with* the one named (`srt/managers/scheduler.py`, `abort_request`); with
    /// one length for all, a prefix is the id itself, so aborting one pair never aborts another.
    pub fn rid(self) -> String {
        self.rid_text().to_string()
    }
    /// [`PairId::rid`] as a `Display`, to write it where it goes without a `String` between.
    pub fn rid_text(self) -> RidText {
        RidText(self.0)
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

/// A pair's `rid` ([`PairId::rid_text`]).
#[derive(Debug, Clone, Copy)]
pub struct RidText(u64);

impl std::fmt::Display for RidText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:019}", self.0)
    }
}

impl Serialize for RidText {
    /// A JSON string, written straight into the output (`serde_json`'s `collect_str`).
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
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

/// Which half of a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The prefill half.
    Prefill,
    /// The decode half.
    Decode,
}

impl Side {
    /// `prefill` or `decode`.
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PairId;

    #[test]
    fn rids_are_one_length_so_none_is_a_prefix_of_another() {
        let (a, b) = (PairId::from_raw(12), PairId::from_raw(1234));
        assert!(!b.rid().starts_with(&a.rid()), "{} {}", a.rid(), b.rid());
        assert_eq!(PairId::from_raw(u64::MAX).rid().len(), 19);
        assert_eq!(a.rid(), "0000000000000000012");
        // Written into JSON, it is the same string.
        for raw in [0, 1, 12, 1234, 10u64.pow(18), u64::MAX] {
            let id = PairId::from_raw(raw);
            let json = serde_json::to_string(&id.rid_text()).expect("serializes");
            assert_eq!(json, format!("\"{}\"", id.rid()));
            assert_eq!(id.rid(), format!("{:019}", id.raw()));
        }
        assert!((0..1000).all(|_| PairId::random().raw() != 0));
    }
}

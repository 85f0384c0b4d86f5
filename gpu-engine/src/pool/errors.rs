//! What the pool refuses: integrity violations (a read or write through a stale or foreign tag)
//! and capacity or configuration errors.

use super::{OwnerTag, PageIdx};

/// A read or write that the tags forbid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IntegrityError {
    /// The page belongs to another owner now.
    #[error("page {page}: owned by {found:?}, reader holds {expected:?}")]
    ForeignOwner {
        /// The page.
        page: PageIdx,
        /// The tag the reader holds.
        expected: OwnerTag,
        /// The tag the page has.
        found: OwnerTag,
    },
    /// Same owner, but the page was freed and reallocated since the reader got it.
    #[error("page {page}: stale epoch {} (page is at {})", expected.epoch, found.epoch)]
    StaleEpoch {
        /// The page.
        page: PageIdx,
        /// The tag the reader holds.
        expected: OwnerTag,
        /// The tag the page has.
        found: OwnerTag,
    },
    /// A write through a shared (read-only) prefix page.
    #[error("page {page} is a shared prefix page and read-only")]
    ReadOnlyShared {
        /// The page.
        page: PageIdx,
    },
    /// A position beyond the sequence's page table.
    #[error("position {pos} is beyond the page table ({capacity} tokens)")]
    PositionOutOfRange {
        /// The position.
        pos: usize,
        /// Tokens the table holds.
        capacity: usize,
    },
    /// A page index outside the pool.
    #[error("page {page} does not exist")]
    NoSuchPage {
        /// The page.
        page: PageIdx,
    },
}

/// Why an allocation or configuration failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// Not every page could be had: nothing was allocated.
    #[error("KV capacity exceeded: need {needed} pages, {available} of {total} available")]
    CapacityExceeded {
        /// Pages needed.
        needed: usize,
        /// Pages free or evictable.
        available: usize,
        /// Pages in the pool.
        total: usize,
    },
    /// A tag check failed.
    #[error(transparent)]
    Integrity(#[from] IntegrityError),
    /// The configuration is not supported.
    #[error("invalid pool configuration: {0}")]
    InvalidConfig(String),
}

//! Why an engine request failed, one type for the engine, its device and its callers.

use crate::model::ModelError;
use crate::pool::{IntegrityError, PoolError};
use crate::transfer::TransferError;

/// Why the engine refused or ended a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// The request can never fit the pool.
    #[error("request needs {need} KV pages ({tokens} tokens), the pool holds {total}")]
    TooLarge {
        /// Pages needed.
        need: usize,
        /// Tokens (prompt + max tokens).
        tokens: usize,
        /// Pages in the pool.
        total: usize,
    },
    /// The pool is full now and the engine refuses rather than waits.
    #[error("KV pool full: {need} pages needed, {free} free")]
    Full {
        /// Pages needed.
        need: usize,
        /// Pages free.
        free: usize,
    },
    /// Malformed request.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The imported KV failed verification.
    #[error("KV transfer refused: {0}")]
    Transfer(#[from] TransferError),
    /// A page tag check failed.
    #[error(transparent)]
    Integrity(#[from] IntegrityError),
    /// The model could not run.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A pool refusal.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The engine (or the other half) stopped or aborted the request.
    #[error("request aborted or engine stopped")]
    Stopped,
}

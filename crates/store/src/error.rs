//! The one error type of every store.

use std::time::Duration;

/// What went wrong in a store operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Some keys were still missing when the deadline passed.
    #[error("store: timed out after {timeout:?} waiting for keys {keys:?}")]
    Timeout {
        /// The keys that were still missing.
        keys: Vec<String>,
        /// How long the call waited.
        timeout: Duration,
    },
    /// [`Store::add`](crate::Store::add) found a value that is not an integer.
    #[error("store: key {key:?} holds {value:?}, which is not an integer counter")]
    NotACounter {
        /// The key.
        key: String,
        /// Its value, lossily decoded.
        value: String,
    },
    /// The store's backing file or socket failed.
    #[error("store {location}: {source}")]
    Io {
        /// The path or address of the store.
        location: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The other end sent something that is not the store protocol, or the
    /// backing file is corrupt.
    #[error("store {location}: {detail}")]
    Protocol {
        /// The path or address of the store.
        location: String,
        /// What was wrong.
        detail: String,
    },
}

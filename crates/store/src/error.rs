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
    /// A client could not reach the store server before its deadline.
    #[error("store: could not connect to {addr} within {timeout:?}: {source}")]
    Connect {
        /// The address the client tried.
        addr: String,
        /// How long it kept trying.
        timeout: Duration,
        /// The last failure seen.
        #[source]
        source: std::io::Error,
    },
    /// A store server could not listen on its address (for example, the port
    /// is already in use).
    #[error("store: cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// The job-secret handshake with the other end failed (it lacks the
    /// secret, holds another one, or is no cohort store at all).
    #[error("store {location}: {source}")]
    Auth {
        /// The address of the store.
        location: String,
        /// What failed (boxed: errors that embed `StoreError` stay small).
        #[source]
        source: Box<crate::auth::AuthError>,
    },
    /// A key or a value is larger than the stores accept
    /// ([`MAX_KEY_LEN`](crate::MAX_KEY_LEN), [`MAX_VALUE_LEN`](crate::MAX_VALUE_LEN)).
    #[error("store: {what} of key {key:?} is {size} bytes, over the limit of {limit}")]
    TooLarge {
        /// `"key"` or `"value"`.
        what: &'static str,
        /// The key (its first 64 characters when the key itself is too long).
        key: String,
        /// The size given.
        size: usize,
        /// The largest size accepted.
        limit: usize,
    },
}

//! Rendezvous key-value stores: how the processes of a job find each other.
//!
//! A [`Store`] is a small shared dictionary of byte strings that every rank of
//! a job can reach. Process groups use it once, at start-up, to exchange socket
//! addresses; launchers use it to count the agents that have arrived. It is the
//! c10d `Store` of PyTorch, with the same operations and semantics:
//!
//! - [`HashStore`]: in one process (threads of a test, or a world of one);
//! - [`FileStore`]: a file on a filesystem every rank can open;
//! - [`TcpStore`]: a server (hosted by the launcher or rank 0) and a client on
//!   every rank.
//! - [`PrefixStore`]: a namespace inside another store (one per process group).
//!
//! Every call that waits has a deadline and fails with [`StoreError::Timeout`],
//! naming the keys and the timeout, instead of hanging. This crate knows
//! nothing of tensors, collectives or models.
//!
//! ```
//! use cohort_store::{HashStore, Store};
//! use std::time::Duration;
//!
//! let store = HashStore::new();
//! store.set("addr/0", b"127.0.0.1:4000").unwrap();
//! assert_eq!(store.get("addr/0").unwrap(), b"127.0.0.1:4000");
//! assert_eq!(store.add("arrived", 1).unwrap(), 1);
//! store.wait(&["addr/0"], Duration::from_secs(1)).unwrap();
//! ```
#![deny(missing_docs)]

mod error;
mod file;
mod hash;
mod prefix;
mod tcp;

pub use error::StoreError;
pub use file::FileStore;
pub use hash::HashStore;
pub use prefix::PrefixStore;
pub use tcp::{TcpStore, TcpStoreServer};

use std::time::Duration;

/// Timeout of a store's blocking calls unless set otherwise (PyTorch's default).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// A key-value store shared by the processes of a job.
///
/// Semantics follow `torch.distributed.Store`:
/// - [`get`](Store::get) waits (up to the store's timeout) for the key to exist;
/// - [`add`](Store::add) treats a missing key as 0 and keeps the value as a
///   decimal ASCII integer, so `get` of a counter returns e.g. `b"3"`;
/// - [`compare_set`](Store::compare_set) sets `desired` when the current value
///   equals `expected` (a missing key matches an empty `expected`) and returns
///   the value the key holds afterwards.
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, replacing any previous value.
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;

    /// Returns the value of `key`, waiting up to [`Store::timeout`] for it to be set.
    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError>;

    /// Adds `delta` to the integer at `key` (0 if missing) and returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError>;

    /// Atomically replaces the value of `key` by `desired` if it equals
    /// `expected`; returns the value `key` holds after the call.
    fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError>;

    /// Waits until every key in `keys` exists, or fails after `timeout`.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError>;

    /// Returns whether every key in `keys` exists, without waiting.
    fn check(&self, keys: &[&str]) -> Result<bool, StoreError>;

    /// Deletes `key`; returns whether it existed.
    fn delete(&self, key: &str) -> Result<bool, StoreError>;

    /// Number of keys in the store.
    fn num_keys(&self) -> Result<usize, StoreError>;

    /// The timeout that [`Store::get`] waits for.
    fn timeout(&self) -> Duration;
}

/// Parses a value written by [`Store::add`].
pub(crate) fn parse_counter(key: &str, value: &[u8]) -> Result<i64, StoreError> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .ok_or_else(|| StoreError::NotACounter {
            key: key.to_string(),
            value: String::from_utf8_lossy(value).into_owned(),
        })
}

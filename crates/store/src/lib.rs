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
//! The stores that cross process boundaries: [`FileStore::new`] opens (or
//! creates) a log file shared through the filesystem, locked with `flock` for
//! each operation, and removed when the last `FileStore` on it is dropped, as
//! in c10d. [`TcpStoreServer::bind`] serves a table to any number of clients
//! from background threads of the hosting process until it is dropped;
//! [`TcpStore::connect`] is a client (retrying until the server is up) whose
//! `get` and `wait` block on the server, not by polling; and
//! [`TcpStore::new_master_or_client`] is PyTorch's
//! `TCPStore(host, port, is_master=...)`: rank 0 hosts the server in-process
//! and every rank, rank 0 included, talks to it as a client. Keys are at most
//! [`MAX_KEY_LEN`] bytes and values at most [`MAX_VALUE_LEN`] in every store.
//!
//! A job's stores can be closed to strangers: a [`TcpStoreServer`] bound
//! with a [`Secret`] (the job secret, `COHORT_SECRET`) serves only clients
//! that prove they know it through the handshake in [`auth`], which the
//! collective sockets and other services of a job reuse. Every listener of a
//! job bounds what strangers may cost it with the rules in [`door`]: one
//! deadline per handshake, a capped waiting room, a rate-limited log.
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

pub mod auth;
mod codec;
#[cfg(test)]
mod contract;
pub mod door;
pub mod endpoint;
mod error;
mod file;
mod hash;
mod prefix;
pub mod slurm;
mod tcp;

pub use auth::Secret;
pub use error::StoreError;
pub use file::FileStore;
pub use hash::HashStore;
pub use prefix::PrefixStore;
pub use tcp::{TcpStore, TcpStoreServer};

use std::time::{Duration, Instant};

/// Timeout of a store's blocking calls unless set otherwise (PyTorch's default).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Largest key, in bytes, that any store accepts.
pub const MAX_KEY_LEN: usize = 64 << 10;

/// Largest value, in bytes, that any store accepts; it bounds what a
/// [`TcpStoreServer`] buffers for one request and what a [`FileStore`] reads
/// for one record.
pub const MAX_VALUE_LEN: usize = 64 << 20;

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

/// The counter that `add(key, delta)` leaves, given the key's current value.
pub(crate) fn counter_after_add(
    key: &str,
    current: Option<&[u8]>,
    delta: i64,
) -> Result<i64, StoreError> {
    let current = match current {
        Some(v) => parse_counter(key, v)?,
        None => 0,
    };
    Ok(current.wrapping_add(delta))
}

/// Whether `compare_set` replaces a key holding `current` (`None`: missing).
pub(crate) fn compare_matches(current: Option<&[u8]>, expected: &[u8]) -> bool {
    match current {
        None => expected.is_empty(),
        Some(current) => current == expected,
    }
}

/// Rejects a key that no store may hold.
pub(crate) fn check_key(key: &str) -> Result<(), StoreError> {
    if key.len() > MAX_KEY_LEN {
        return Err(StoreError::TooLarge {
            what: "key",
            key: key.chars().take(64).collect(),
            size: key.len(),
            limit: MAX_KEY_LEN,
        });
    }
    Ok(())
}

/// Rejects a key or value that no store may hold.
pub(crate) fn check_entry(key: &str, value: &[u8]) -> Result<(), StoreError> {
    check_key(key)?;
    if value.len() > MAX_VALUE_LEN {
        return Err(StoreError::TooLarge {
            what: "value",
            key: key.to_string(),
            size: value.len(),
            limit: MAX_VALUE_LEN,
        });
    }
    Ok(())
}

/// The instant `timeout` from now; a timeout too large to represent (such as
/// `Duration::MAX`, meaning "forever") saturates instead of panicking.
pub(crate) fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

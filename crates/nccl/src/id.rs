//! The unique id a communicator is made from, and its exchange through cohort's store: rank 0
//! asks NCCL for one and sets it under a key; every other rank waits for the key (up to the
//! collective timeout) and reads it. The store is the job's authenticated one, so the id
//! (which holds rank 0's bootstrap address) travels only to the job's own processes.
//!
//! This module never talks to a GPU and never reuses a key: the caller scopes it (group,
//! restart, communicator).

use std::time::Duration;

use cohort_store::Store;

use crate::ffi::{self, UNIQUE_ID_BYTES};
use crate::{Nccl, NcclError};

/// An `ncclUniqueId`'s 128 bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId([u8; UNIQUE_ID_BYTES]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The bytes are an address and a magic number: not worth a log line.
        f.write_str("UniqueId(..)")
    }
}

impl UniqueId {
    /// The bytes as the store carries them.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The id of `bytes`, which must be exactly [`UNIQUE_ID_BYTES`] long.
    pub fn from_bytes(bytes: &[u8]) -> Option<UniqueId> {
        bytes.try_into().ok().map(UniqueId)
    }

    pub(crate) fn from_ffi(id: &ffi::UniqueId) -> UniqueId {
        UniqueId(id.internal.map(|c| c as u8))
    }

    pub(crate) fn to_ffi(&self) -> ffi::UniqueId {
        ffi::UniqueId {
            internal: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}

/// Rank 0 makes an id and sets it at `key`; every other rank waits up to `timeout` for the
/// key and reads it. Collective over the ranks that share the store.
pub fn exchange_id(
    nccl: &Nccl,
    store: &dyn Store,
    key: &str,
    rank: usize,
    timeout: Duration,
) -> Result<UniqueId, NcclError> {
    let store_err = |reason: String| NcclError::Store {
        rank,
        key: key.to_string(),
        reason,
    };
    if rank == 0 {
        let id = nccl.unique_id(rank)?;
        store
            .set(key, id.as_bytes())
            .map_err(|e| store_err(e.to_string()))?;
        return Ok(id);
    }
    store
        .wait(&[key], timeout)
        .map_err(|e| store_err(format!("rank 0 never set it: {e}")))?;
    let bytes = store.get(key).map_err(|e| store_err(e.to_string()))?;
    UniqueId::from_bytes(&bytes).ok_or_else(|| {
        store_err(format!(
            "holds {} bytes, an NCCL unique id has {UNIQUE_ID_BYTES}",
            bytes.len()
        ))
    })
}

//! NCCL for cohort: the library found at run time where users have it (the `nvidia-nccl`
//! wheel's `nvidia/nccl/lib/libnccl.so.2`, `LD_LIBRARY_PATH`, the system), its functions
//! resolved by hand (cudarc's loader never tries the wheel's file name), and a
//! [`Communicator`] over the GPU of the CUDA backend, on its stream: all-reduce (sum or
//! average), reduce-scatter, all-gather and broadcast of device views, f32 or bf16.
//!
//! - [`load`] finds and opens the library once per process ([`Nccl`]), with its
//!   [`Version`]; a missing library is one line naming the file names tried and every
//!   directory searched.
//! - [`exchange_id`] hands rank 0's unique id to the others through cohort's store (rank 0
//!   sets the key, the others wait for it up to the collective timeout), as PyTorch's
//!   ProcessGroupNCCL does through its TCPStore.
//! - [`Communicator`] is created nonblocking and polled, and waits for each collective by
//!   polling an event and `ncclCommGetAsyncError`: an error, or a collective still running
//!   at the timeout, aborts the communicator (`ncclCommAbort`, PyTorch's watchdog) and is a
//!   one-line [`NcclError`] naming the rank and the operation. Nothing hangs.
//! - [`join`] is the whole set-up for a process group: every rank's GPU compared (several
//!   ranks on one GPU are refused unless the library allows it), then the id exchanged and
//!   the communicator made; or, when NCCL is only preferred, the reason to stage through the
//!   host instead, agreed by every rank.
//! - [`check`] runs every collective against host-computed values (`cohort gpu nccl`, the
//!   GPU tests).
//!
//! This crate must never panic on a missing library or device, never link NCCL or CUDA at
//! build time, and never know a model, a training loop or a tokenizer: it moves device
//! memory it is given.
//!
//! ```no_run
//! use cohort_cuda::libraries::Search;
//!
//! let nccl = cohort_nccl::load(&Search::from_env())?; // "no NCCL: looked for libnccl.so.2 ..."
//! println!("NCCL {}", nccl.version());
//! # Ok::<(), cohort_nccl::NcclError>(())
//! ```

#![deny(missing_docs)]

pub mod check;
mod comm;
mod error;
mod ffi;
mod id;
mod join;

use std::fmt;
use std::path::Path;
use std::sync::Mutex;

use cohort_cuda::libraries::{Library, Search};

pub use comm::{Binding, Communicator, NcclElem, Reduce};
pub use error::NcclError;
pub use ffi::UNIQUE_ID_BYTES;
pub use id::{exchange_id, UniqueId};
pub use join::{join, Joined, Policy, MULTI_RANK_GPU_ENV};

/// NCCL, opened: its functions and its version.
pub struct Nccl {
    api: ffi::Api,
    version: Version,
}

impl fmt::Debug for Nccl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nccl")
            .field("path", &self.api.path)
            .field("version", &self.version)
            .finish()
    }
}

/// The library opened by [`load`], kept for the process's life.
static LOADED: Mutex<Option<&'static Nccl>> = Mutex::new(None);

/// Finds NCCL through `search` (cohort-cuda's lookup), opens it and resolves the functions
/// cohort calls, once per process: later calls return the same library. Needs no GPU.
pub fn load(search: &Search) -> Result<&'static Nccl, NcclError> {
    let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(n) = *loaded {
        return Ok(n);
    }
    let nccl: &'static Nccl = Box::leak(Box::new(Nccl::open(search)?));
    *loaded = Some(nccl);
    Ok(nccl)
}

impl Nccl {
    /// [`load`] without the process-wide cache: the library `search` finds, opened anew (the
    /// handle is never closed). What a test of another search uses.
    pub fn open(search: &Search) -> Result<Nccl, NcclError> {
        let path = search.find(Library::Nccl)?;
        let api = ffi::Api::open(&path)?;
        let mut code = 0;
        // SAFETY: ncclGetVersion writes one int through the valid pointer; it needs no GPU.
        let rc = unsafe { (api.get_version)(&mut code) };
        if rc != ffi::SUCCESS {
            return Err(NcclError::Call {
                op: "get version",
                rank: 0,
                reason: api.describe(rc, std::ptr::null_mut()),
            });
        }
        Ok(Nccl {
            api,
            version: Version(code),
        })
    }
}

impl Nccl {
    /// The library's version.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The file it was opened from.
    pub fn path(&self) -> &Path {
        &self.api.path
    }

    /// A new unique id (what rank 0 makes and hands to the others). Needs no GPU: NCCL only
    /// sets up its bootstrap socket. `rank` names this process in an error.
    pub fn unique_id(&self, rank: usize) -> Result<UniqueId, NcclError> {
        let mut id = ffi::UniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        // SAFETY: ncclGetUniqueId writes the 128-byte struct through the valid pointer.
        let rc = unsafe { (self.api.get_unique_id)(&mut id) };
        if rc != ffi::SUCCESS {
            return Err(NcclError::Call {
                op: "unique id",
                rank,
                reason: self.api.describe(rc, std::ptr::null_mut()),
            });
        }
        Ok(UniqueId::from_ffi(&id))
    }
}

/// An NCCL version (`NCCL_VERSION_CODE`: 23007 is 2.30.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub i32);

impl Version {
    /// (major, minor, patch); codes before 2.9 had one digit less for the minor.
    pub fn parts(self) -> (i32, i32, i32) {
        let c = self.0;
        if c >= 20900 {
            (c / 10000, (c % 10000) / 100, c % 100)
        } else {
            (c / 1000, (c % 1000) / 100, c % 100)
        }
    }

    /// Whether this is `major.minor` or later.
    pub fn at_least(self, major: i32, minor: i32) -> bool {
        let (a, b, _) = self.parts();
        (a, b) >= (major, minor)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (a, b, c) = self.parts();
        write!(f, "{a}.{b}.{c}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_print_as_releases() {
        assert_eq!(Version(23007).to_string(), "2.30.7");
        assert_eq!(Version(22703).to_string(), "2.27.3");
        assert_eq!(Version(2804).to_string(), "2.8.4");
        assert!(Version(23007).at_least(2, 30));
        assert!(!Version(22703).at_least(2, 30));
    }
}

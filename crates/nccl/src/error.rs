//! The crate's one error type. Every variant names what failed and where: the library and
//! the places looked for it, or the rank and the operation of a communicator, so that the
//! line alone says where to look. A message is always one line.

use std::path::PathBuf;
use std::time::Duration;

/// What went wrong loading NCCL or running a communicator.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NcclError {
    /// The library was not found, or did not open ("no NCCL: looked for libnccl.so.2 ...").
    #[error("{0}")]
    Library(#[from] cohort_cuda::CudaError),
    /// The library lacks a function cohort calls (an NCCL older than 2.14).
    #[error("NCCL at {}: no symbol {symbol} (cohort needs NCCL 2.14 or later)", path.display())]
    Symbol {
        /// The library file.
        path: PathBuf,
        /// The missing function.
        symbol: &'static str,
    },
    /// An NCCL call failed.
    #[error("NCCL {op} on rank {rank}: {reason}")]
    Call {
        /// The operation ("all_reduce", "init", "unique id").
        op: &'static str,
        /// This process's rank in the communicator.
        rank: usize,
        /// NCCL's text for the error, and its last-error detail.
        reason: String,
    },
    /// A collective (or the communicator's set-up) outlived the timeout; the communicator
    /// was aborted, as PyTorch's watchdog does, and every later call fails.
    #[error(
        "NCCL {op} on rank {rank}: not done within {timeout:?}; the communicator was aborted \
         (a rank stopped, or never joined)"
    )]
    Timeout {
        /// The operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The collective timeout.
        timeout: Duration,
    },
    /// A call on a communicator an earlier failure aborted.
    #[error("NCCL {op} on rank {rank}: the communicator was aborted earlier: {first}")]
    Aborted {
        /// The operation refused.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The failure that aborted it.
        first: String,
    },
    /// The unique id could not be exchanged through the store.
    #[error("NCCL unique id on rank {rank}: store key {key:?}: {reason}")]
    Store {
        /// This rank.
        rank: usize,
        /// The key rank 0 sets.
        key: String,
        /// The store's error, or what was wrong with the value.
        reason: String,
    },
    /// The process group the set-up compares the ranks' GPUs over failed.
    #[error("NCCL {op} on rank {rank}: the process group: {reason}")]
    Group {
        /// The operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The group's error.
        reason: String,
    },
    /// NCCL cannot run on some rank (no library there, or no GPU), so the ranks cannot use it.
    #[error("NCCL on rank {rank}: not available on rank(s) {ranks}{}", local.as_ref().map(|l| format!(": {l}")).unwrap_or_default())]
    Unavailable {
        /// This rank.
        rank: usize,
        /// The ranks without it ("1, 3").
        ranks: String,
        /// Why, when this rank is one of them.
        local: Option<String>,
    },
    /// A CUDA driver call the communicator needs (its context, its completion events).
    #[error("NCCL {op} on rank {rank}: CUDA driver: {reason}")]
    Driver {
        /// The operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The driver's error.
        reason: String,
    },
    /// Buffers that do not fit the collective.
    #[error("NCCL {op} on rank {rank}: {what}")]
    Argument {
        /// The operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// Which buffer, its size and the size needed.
        what: String,
    },
    /// Several ranks on one GPU, which this NCCL refuses.
    #[error("NCCL on rank {rank}: ranks {ranks} share one GPU ({gpu}); NCCL {version} {fix}")]
    SharedGpu {
        /// This rank.
        rank: usize,
        /// The ranks that share it ("0 and 1").
        ranks: String,
        /// The GPU, as this host sees it.
        gpu: String,
        /// The library's version.
        version: String,
        /// What the library does with that, and what to do instead.
        fix: String,
    },
}

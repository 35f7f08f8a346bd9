//! The one error type of process groups and collectives.
//!
//! Every variant carries what a user needs to find the fault without a
//! debugger: the operation, its sequence number, the group and the ranks
//! involved. Communication failures (timeouts, lost peers, mismatches) abort
//! the group; misuse ([`CommError::InvalidArgument`], [`CommError::Unsupported`])
//! is caught before any byte moves and leaves the group usable.

use std::time::Duration;

use crate::element::DType;
use crate::kinds::OpKind;
use crate::reduce_op::ReduceOp;

/// What went wrong in a process group.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// A peer sent nothing (or accepted nothing) before the group's timeout.
    #[error("{op} #{seq} on group {group:?}: no progress with rank {peer} within {timeout:?} (rank {rank} is this process)")]
    Timeout {
        /// The operation that timed out.
        op: OpKind,
        /// Its sequence number in the group.
        seq: u64,
        /// The group's name.
        group: String,
        /// This process's rank in the group.
        rank: usize,
        /// The rank this process was waiting on.
        peer: usize,
        /// The timeout that expired.
        timeout: Duration,
    },
    /// The connection to a peer broke: it died, aborted, or closed its group.
    #[error("{op} #{seq} on group {group:?}: connection between rank {rank} (this process) and rank {peer} lost: {detail}")]
    PeerLost {
        /// The operation in progress.
        op: OpKind,
        /// Its sequence number.
        seq: u64,
        /// The group's name.
        group: String,
        /// This process's rank.
        rank: usize,
        /// The peer whose connection broke.
        peer: usize,
        /// What the socket said (EOF, reset, ...).
        detail: String,
    },
    /// Two ranks issued different calls at the same point of the group's
    /// sequence (another op, length, dtype, reduce op or root).
    #[error("mismatched collectives on group {group:?}: rank {rank} (this process) called {ours}, but rank {peer} called {theirs}")]
    Mismatch {
        /// The group's name.
        group: String,
        /// This process's rank.
        rank: usize,
        /// The rank whose call differs.
        peer: usize,
        /// This rank's call, e.g. `all_reduce #3 of 10 x float32 (sum)`.
        ours: String,
        /// The peer's call.
        theirs: String,
    },
    /// The group failed earlier and can no longer be used (NCCL's abort).
    #[error("{op} on group {group:?}: the group was aborted by an earlier error: {reason}")]
    Aborted {
        /// The operation that was refused.
        op: OpKind,
        /// The group's name.
        group: String,
        /// The error that aborted the group.
        reason: String,
    },
    /// The call's arguments are inconsistent (lengths, ranks, roots).
    #[error("{op} on group {group:?}: {detail}")]
    InvalidArgument {
        /// The operation.
        op: OpKind,
        /// The group's name.
        group: String,
        /// What was wrong.
        detail: String,
    },
    /// The reduce operator does not apply to the element type.
    #[error("{op} on group {group:?}: reduce op {reduce} is not supported for {dtype} (avg needs a floating-point type)")]
    Unsupported {
        /// The operation.
        op: OpKind,
        /// The group's name.
        group: String,
        /// The reduce operator.
        reduce: ReduceOp,
        /// The element type.
        dtype: DType,
    },
    /// The ranks could not find or connect to each other.
    #[error("rendezvous of group {group:?} (rank {rank}): {detail}")]
    Rendezvous {
        /// The group's name.
        group: String,
        /// This process's rank.
        rank: usize,
        /// What failed.
        detail: String,
    },
    /// The rendezvous store failed.
    #[error("store of group {group:?}: {source}")]
    Store {
        /// The group's name.
        group: String,
        /// The store's error.
        #[source]
        source: cohort_store::StoreError,
    },
    /// `init_process_group` got a bad init method, backend or variable.
    #[error("init_process_group: {name}: {detail}")]
    Init {
        /// The environment variable, URL part or argument at fault.
        name: String,
        /// What was wrong with it.
        detail: String,
    },
    /// A local system call failed (binding a socket, spawning a thread).
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl CommError {
    /// Whether this error means the group is broken (as opposed to a call
    /// rejected before it communicated).
    pub fn is_fatal(&self) -> bool {
        !matches!(
            self,
            CommError::InvalidArgument { .. } | CommError::Unsupported { .. }
        )
    }
}

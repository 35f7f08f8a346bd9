//! all_reduce: the choice of algorithm.
//!
//! Recursive doubling needs ceil(log2 N) steps but sends log2(N) buffers per
//! rank; the ring needs 2(N-1) steps and sends 2(N-1)/N buffers per rank. So
//! small messages go to recursive doubling and large ones to the ring. With
//! two ranks both send the same bytes and recursive doubling does it in one
//! step instead of two, but reduces the whole buffer instead of half and
//! burns more CPU: measured, it wins up to 256 KB and the ring from 512 KB
//! (1 MB: 305 us vs 480 us median). Ranks that share memory reduce large
//! buffers straight from each other's staging areas (`shm.rs`), and groups
//! that span several nodes go hierarchical (`hierarchical.rs`, chosen by the
//! mesh backend, which holds the node meshes; reduce_scatter and all_gather
//! too, `hierarchical_scatter.rs`). `COHORT_ALGO` (`ring`,
//! `tree`, `shm`, `hierarchical`) overrides. A world of one has nothing to do.
//!
//! The choice depends only on the byte count, the world size and the
//! group's algorithm setting, which all ranks share, so all ranks pick the
//! same algorithm without talking.

mod recursive_doubling;
mod ring;
mod shm;

use super::{Comm, SMALL_BYTES};
use crate::error::CommError;
use crate::kinds::Algorithm;
use crate::reduce_op::ReduceOp;

/// Up to this size, two ranks use recursive doubling (a plain exchange).
const TWO_RANK_EXCHANGE_BYTES: usize = 256 << 10;

/// From this size, ranks that share memory reduce straight through it;
/// below, the pipelined algorithms over the shared-memory rings cost less
/// CPU (2 ranks, CPU per call: 1 MB ring 95 us vs direct 113 us; 4 MB
/// direct 359 us vs ring 392 us; 16 MB direct 1.4 ms vs ring 2.5 ms).
const SHM_DIRECT_BYTES: usize = 2 << 20;

/// Reduces `buf` across the group in place.
pub(crate) fn all_reduce(comm: &Comm<'_>, buf: &mut [u8], op: ReduceOp) -> Result<(), CommError> {
    let n = comm.size();
    if n == 1 {
        // Sum over one rank divided by one: nothing to do for any operator.
        return Ok(());
    }
    if let Some(mem) = comm.env.transport.shm() {
        let direct = match comm.algorithm {
            Algorithm::Shm => true,
            Algorithm::Auto | Algorithm::Hierarchical => buf.len() >= SHM_DIRECT_BYTES,
            Algorithm::Ring | Algorithm::Tree => false,
        };
        if direct {
            return shm::run(comm, mem, buf, op);
        }
    }
    let limit = if n == 2 {
        TWO_RANK_EXCHANGE_BYTES
    } else {
        SMALL_BYTES
    };
    let doubling = match comm.algorithm {
        Algorithm::Ring => false,
        Algorithm::Tree => true,
        _ => buf.len() <= limit,
    };
    if doubling {
        recursive_doubling::run(comm, buf, op)
    } else {
        ring::run(comm, buf, op)
    }
}

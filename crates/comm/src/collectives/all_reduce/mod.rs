//! all_reduce: options, validation and the choice of algorithm.
//!
//! Small messages (or `COHORT_ALGO=tree`) go to recursive doubling, which
//! needs ceil(log2 N) rounds; large ones (or `COHORT_ALGO=ring`) go to the
//! pipelined ring, which sends 2(N-1)/N of the buffer per rank whatever N
//! is. A world of one only finishes the average. This step must never start
//! communicating before it knows every rank will pick the same algorithm:
//! the choice depends only on the byte count, the world size and the
//! group's algorithm setting, which all ranks share.

mod recursive_doubling;
mod ring;

use super::Comm;
use crate::error::CommError;
use crate::reduce_op::ReduceOp;

/// Reduces `buf` across the group in place.
pub(crate) fn all_reduce(comm: &Comm<'_>, buf: &mut [u8], op: ReduceOp) -> Result<(), CommError> {
    if comm.size() == 1 {
        // Sum over one rank divided by one: nothing to do for any operator.
        return Ok(());
    }
    if comm.small(buf.len()) {
        recursive_doubling::run(comm, buf, op)
    } else {
        ring::run(comm, buf, op)
    }
}

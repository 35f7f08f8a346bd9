//! Ring reduce_scatter, segmented and pipelined.
//!
//! Scheme: the input (N slots of n elements) is copied into scratch, the
//! working copy. At step s = 0..N-2 rank r sends slot (r - s - 1) to
//! next = r+1, receives slot (r - s - 2) from prev = r-1 into a segment of
//! scratch and reduces it into the working copy. The slot received at step
//! s is the one sent at step s+1, segment by segment. After the last step
//! the working slot r holds the full reduction (divided by N there for
//! `Avg`) and is copied to the output. Each rank sends (N-1)/N of the input.
//! The caller's input is never written.

use super::{segments, Comm};
use crate::engine::{Dep, RecvFrame, Region, Schedule};
use crate::error::CommError;
use crate::reduce_op::ReduceOp;

pub(crate) fn reduce_scatter(
    comm: &Comm<'_>,
    input: &[u8],
    output: &mut [u8],
    op: ReduceOp,
) -> Result<(), CommError> {
    let (r, n) = (comm.rank(), comm.size());
    let slot = output.len();
    let total = input.len();
    let seg = comm.segment();
    let tmp = total;
    let next = (r + 1) % n;
    let prev = (r + n - 1) % n;
    let mut sched = Schedule::default();
    let mut last: Vec<Dep> = Vec::new();
    for s in 0..n.saturating_sub(1) {
        let send_slot = (r + 2 * n - s - 1) % n;
        for (j, (o, l)) in segments(send_slot * slot, slot, seg).enumerate() {
            sched.send(next, Region::Scratch(o, l), last.get(j).copied());
        }
        let recv_slot = (r + 2 * n - s - 2) % n;
        last = segments(recv_slot * slot, slot, seg)
            .map(|(o, l)| {
                let frame = RecvFrame::reduce(Region::Scratch(tmp, l), Region::Scratch(o, l))
                    .finish_avg(op == ReduceOp::Avg && s + 2 == n);
                sched.recv(prev, frame)
            })
            .collect();
    }
    comm.with_bufs(output, input, total + seg.min(slot.max(1)), |bufs| {
        bufs.copy(Region::Scratch(0, total), Region::In(0, total));
        comm.run(&sched, bufs, Some(op))?;
        bufs.copy(Region::Out(0, slot), Region::Scratch(r * slot, slot));
        Ok(())
    })
}

//! Ring reduce_scatter, segmented and pipelined.
//!
//! Scheme (N ranks, input = N slots of n elements): at step s = 0..N-2 rank
//! r sends slot (r - s - 1) to next = r+1, receives slot (r - s - 2) from
//! prev = r-1 into a segment of scratch and reduces it into its partial sum
//! of that slot. The slot received at step s is the one sent at step s+1,
//! segment by segment. The last slot received is slot r itself, whose
//! partial sum lives in the output, so the result lands there (divided by N
//! for `Avg`). Each rank sends (N-1)/N of the input.
//!
//! The caller's input is never written: step 0 sends straight from it, the
//! output starts as input slot r, and only the N-2 slots that are reduced
//! and forwarded get a working copy in scratch.

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
    let seg = comm.segment();
    let next = (r + 1) % n;
    let prev = (r + n - 1) % n;
    // Working copies of slot c live at scratch c * slot (slots r and r-1 unused),
    // then one receive segment.
    let work = |c: usize, o: usize, l: usize| Region::Scratch(c * slot + o, l);
    let tmp = n * slot;
    let mut sched = Schedule::default();
    let mut last: Vec<Dep> = Vec::new();
    for s in 0..n.saturating_sub(1) {
        let send_slot = (r + 2 * n - s - 1) % n;
        for (j, (o, l)) in segments(0, slot, seg).enumerate() {
            let src = if s == 0 {
                Region::In(send_slot * slot + o, l)
            } else {
                work(send_slot, o, l)
            };
            sched.send(next, src, last.get(j).copied());
        }
        let recv_slot = (r + 2 * n - s - 2) % n;
        let final_step = s + 2 == n;
        last = segments(0, slot, seg)
            .map(|(o, l)| {
                let into = if final_step {
                    Region::Out(o, l)
                } else {
                    work(recv_slot, o, l)
                };
                let frame = RecvFrame::reduce(Region::Scratch(tmp, l), into)
                    .finish_avg(final_step && op == ReduceOp::Avg);
                sched.recv(prev, frame)
            })
            .collect();
    }
    let scratch = if n > 1 { tmp + seg.min(slot.max(1)) } else { 0 };
    comm.with_bufs(output, input, scratch, |bufs| {
        bufs.copy(Region::Out(0, slot), Region::In(r * slot, slot));
        for c in (0..n).filter(|&c| c != r && c != (r + n - 1) % n) {
            bufs.copy(work(c, 0, slot), Region::In(c * slot, slot));
        }
        comm.run(&sched, bufs, Some(op))
    })
}

//! Ring all_gather, segmented and pipelined.
//!
//! Scheme: rank r first copies its input into slot r of the output. At step
//! s = 0..N-2 it sends slot (r - s) to next = r+1 and receives slot
//! (r - s - 1) from prev = r-1 straight into the output. The slot received at
//! step s is the one sent at step s+1, segment by segment, so segments flow
//! around the ring without waiting for whole slots. Each rank sends and
//! receives (N-1)/N of the output.

use super::{segments, Comm};
use crate::engine::{Dep, RecvFrame, Region, Schedule};
use crate::error::CommError;

pub(crate) fn all_gather(
    comm: &Comm<'_>,
    input: &[u8],
    output: &mut [u8],
) -> Result<(), CommError> {
    let (r, n) = (comm.rank(), comm.size());
    let slot = input.len();
    let seg = comm.segment();
    let next = (r + 1) % n;
    let prev = (r + n - 1) % n;
    let mut sched = Schedule::default();
    let mut last: Vec<Dep> = Vec::new();
    for s in 0..n.saturating_sub(1) {
        let send_slot = (r + n - s) % n;
        for (j, (o, l)) in segments(send_slot * slot, slot, seg).enumerate() {
            sched.send(next, Region::Out(o, l), last.get(j).copied());
        }
        let recv_slot = (r + 2 * n - s - 1) % n;
        last = segments(recv_slot * slot, slot, seg)
            .map(|(o, l)| sched.recv(prev, RecvFrame::copy(Region::Out(o, l))))
            .collect();
    }
    comm.with_bufs(output, input, 0, |bufs| {
        bufs.copy(Region::Out(r * slot, slot), Region::In(0, slot));
        comm.run(&sched, bufs, None)
    })
}

//! Gather: every rank sends its input straight to the root.
//!
//! Scheme: one hop, segmented. The root receives from all N-1 peers at
//! once (the engine interleaves the streams as data arrives) straight into
//! their output slots, and copies its own input into its slot. The root's
//! link carries (N-1)/N of the output, which no algorithm can beat.

use super::{segments, Comm};
use crate::engine::{RecvFrame, Region, Schedule};
use crate::error::CommError;

pub(crate) fn gather(
    comm: &Comm<'_>,
    input: &[u8],
    output: Option<&mut [u8]>,
    root: usize,
) -> Result<(), CommError> {
    let (r, n) = (comm.rank(), comm.size());
    let slot = input.len();
    let seg = comm.segment();
    let mut sched = Schedule::default();
    match output {
        Some(out) => {
            for p in (0..n).filter(|&p| p != r) {
                for (o, l) in segments(p * slot, slot, seg) {
                    sched.recv(p, RecvFrame::copy(Region::Out(o, l)));
                }
            }
            comm.with_bufs(out, input, 0, |bufs| {
                bufs.copy(Region::Out(r * slot, slot), Region::In(0, slot));
                comm.run(&sched, bufs, None)
            })
        }
        None => {
            for (o, l) in segments(0, slot, seg) {
                sched.send(root, Region::In(o, l), None);
            }
            comm.with_bufs(&mut [], input, 0, |bufs| comm.run(&sched, bufs, None))
        }
    }
}

//! Scatter: the root sends slot p of its input straight to rank p.
//!
//! Scheme: one hop, segmented; the root feeds all N-1 streams at once (the
//! engine writes to whichever socket has room) and copies its own slot.

use super::{segments, Comm};
use crate::engine::{RecvFrame, Region, Schedule};
use crate::error::CommError;

pub(crate) fn scatter(
    comm: &Comm<'_>,
    input: Option<&[u8]>,
    output: &mut [u8],
    root: usize,
) -> Result<(), CommError> {
    let (r, n) = (comm.rank(), comm.size());
    let slot = output.len();
    let seg = comm.segment();
    let mut sched = Schedule::default();
    match input {
        Some(inp) => {
            for p in (0..n).filter(|&p| p != r) {
                for (o, l) in segments(p * slot, slot, seg) {
                    sched.send(p, Region::In(o, l), None);
                }
            }
            comm.with_bufs(output, inp, 0, |bufs| {
                bufs.copy(Region::Out(0, slot), Region::In(r * slot, slot));
                comm.run(&sched, bufs, None)
            })
        }
        None => {
            for (o, l) in segments(0, slot, seg) {
                sched.recv(root, RecvFrame::copy(Region::Out(o, l)));
            }
            comm.with_bufs(output, &[], 0, |bufs| comm.run(&sched, bufs, None))
        }
    }
}

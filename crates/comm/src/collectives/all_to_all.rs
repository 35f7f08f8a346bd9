//! all_to_all: every pair exchanges its slots directly.
//!
//! Scheme: rank r sends input slot p to rank p and receives rank p's slot r
//! into output slot p, for every p at once; the engine interleaves the
//! 2(N-1) streams as sockets allow, so no pairwise ordering (and no
//! deadlock-avoiding schedule) is needed. The own slot is a local copy.

use super::{segments, Comm};
use crate::engine::{RecvFrame, Region, Schedule};
use crate::error::CommError;

pub(crate) fn all_to_all(
    comm: &Comm<'_>,
    input: &[u8],
    output: &mut [u8],
) -> Result<(), CommError> {
    let (r, n) = (comm.rank(), comm.size());
    let slot = input.len() / n;
    let seg = comm.segment();
    let mut sched = Schedule::default();
    // Start with the next rank up so that not everyone hits rank 0 first.
    for p in (1..n).map(|k| (r + k) % n) {
        for (o, l) in segments(p * slot, slot, seg) {
            sched.send(p, Region::In(o, l), None);
            sched.recv(p, RecvFrame::copy(Region::Out(o, l)));
        }
    }
    comm.with_bufs(output, input, 0, |bufs| {
        bufs.copy(Region::Out(r * slot, slot), Region::In(r * slot, slot));
        comm.run(&sched, bufs, None)
    })
}

//! Dissemination barrier.
//!
//! Scheme: in round k = 0, 1, ... while 2^k < N, rank r sends an empty
//! frame to r + 2^k and waits for one from r - 2^k (mod N); each round's
//! send waits for the previous round's receive. After ceil(log2 N) rounds
//! every rank has heard, directly or transitively, from every other, so
//! nobody leaves before everybody arrived.

use super::Comm;
use crate::engine::{RecvFrame, Region, Schedule};
use crate::error::CommError;

pub(crate) fn barrier(comm: &Comm<'_>) -> Result<(), CommError> {
    let (r, n) = (comm.rank(), comm.size());
    let mut sched = Schedule::default();
    let mut last = None;
    let mut dist = 1;
    while dist < n {
        sched.send((r + dist) % n, Region::Out(0, 0), last);
        last = Some(sched.recv((r + n - dist) % n, RecvFrame::copy(Region::Out(0, 0))));
        dist *= 2;
    }
    comm.with_bufs(&mut [], &[], 0, |bufs| comm.run(&sched, bufs, None))
}

//! Broadcast down a tree, segmented and pipelined.
//!
//! Scheme: small messages go down a binomial tree (log2 N hops), large ones
//! down a chain (see `tree.rs`). The buffer is cut into segments; a rank
//! forwards segment j to its children as soon as segment j has arrived from
//! its parent, so on a chain all links are busy at once and the time is
//! about one buffer transfer plus N-2 segment transfers. Non-roots receive
//! straight into the caller's buffer.

use super::tree::{binomial, chain};
use super::{segments, Comm};
use crate::engine::{RecvFrame, Region, Schedule};
use crate::error::CommError;

pub(crate) fn broadcast(comm: &Comm<'_>, buf: &mut [u8], root: usize) -> Result<(), CommError> {
    let (r, n) = (comm.rank(), comm.size());
    if n == 1 {
        return Ok(());
    }
    let tree = if comm.small(buf.len()) {
        binomial(r, n, root)
    } else {
        chain(r, n, root)
    };
    let mut sched = Schedule::default();
    let segs: Vec<(usize, usize)> = segments(0, buf.len(), comm.segment()).collect();
    let arrived: Vec<_> = match tree.parent {
        Some(p) => segs
            .iter()
            .map(|&(o, l)| Some(sched.recv(p, RecvFrame::copy(Region::Out(o, l)))))
            .collect(),
        None => vec![None; segs.len()],
    };
    for &child in &tree.children {
        for (j, &(o, l)) in segs.iter().enumerate() {
            sched.send(child, Region::Out(o, l), arrived[j]);
        }
    }
    comm.with_bufs(buf, &[], 0, |bufs| comm.run(&sched, bufs, None))
}

//! Reduce up a tree onto the root, segmented and pipelined.
//!
//! Scheme: the mirror image of broadcast (binomial tree for small messages,
//! chain for large). For each segment j, a rank receives segment j from each
//! child in turn into a segment of scratch and reduces it into its
//! accumulator, then sends its accumulated segment j to its parent while
//! later segments still arrive. Receives are serialised (segment-major,
//! child-minor) so one segment of scratch suffices.
//!
//! The root accumulates straight into the caller's buffer and divides each
//! finished segment by N for `Avg`. Other ranks never write the caller's
//! buffer (it stays unchanged, as NCCL's separate send buffer would): inner
//! ranks copy it into scratch and accumulate there; leaves send it as is.

use super::tree::{binomial, chain};
use super::{segments, Comm};
use crate::engine::{RecvFrame, Region, Schedule};
use crate::error::CommError;
use crate::reduce_op::ReduceOp;

pub(crate) fn reduce(
    comm: &Comm<'_>,
    buf: &mut [u8],
    op: ReduceOp,
    root: usize,
) -> Result<(), CommError> {
    let (r, n) = (comm.rank(), comm.size());
    if n == 1 {
        return Ok(());
    }
    let bytes = buf.len();
    let seg = comm.segment().min(bytes.max(1));
    let tree = if comm.small(bytes) {
        binomial(r, n, root)
    } else {
        chain(r, n, root)
    };
    let is_root = r == root;
    let inner = !is_root && !tree.children.is_empty();
    // Accumulator and receive segment.
    let (acc, tmp_at) = match (is_root, inner) {
        (true, _) => (Region::Out as fn(usize, usize) -> Region, 0),
        (false, true) => (Region::Scratch as fn(usize, usize) -> Region, bytes),
        (false, false) => (Region::In as fn(usize, usize) -> Region, 0),
    };
    let mut sched = Schedule::default();
    let mut last = None;
    for (o, l) in segments(0, bytes, seg) {
        for (k, &child) in tree.children.iter().enumerate() {
            let finish = is_root && op == ReduceOp::Avg && k + 1 == tree.children.len();
            let frame = RecvFrame::reduce(Region::Scratch(tmp_at, l), acc(o, l))
                .after(last)
                .finish_avg(finish);
            last = Some(sched.recv(child, frame));
        }
        if let Some(p) = tree.parent {
            sched.send(p, acc(o, l), last);
        }
    }
    let scratch = if tree.children.is_empty() {
        0
    } else {
        tmp_at + seg
    };
    if is_root {
        comm.with_bufs(buf, &[], scratch, |bufs| comm.run(&sched, bufs, Some(op)))
    } else {
        comm.with_bufs(&mut [], buf, scratch, |bufs| {
            if inner {
                bufs.copy(Region::Scratch(0, bytes), Region::In(0, bytes));
            }
            comm.run(&sched, bufs, Some(op))
        })
    }
}

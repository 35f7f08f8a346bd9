//! Recursive-doubling all_reduce, segmented.
//!
//! Scheme (N ranks, p = the largest power of two <= N, extra = N - p):
//! 1. Fold: among the first 2*extra ranks, each even rank sends its buffer
//!    to the odd rank above it, which reduces it in and represents both.
//!    The p remaining ranks get new ranks 0..p (odd ones r/2, the rest r-extra).
//! 2. Rounds, mask = 1, 2, 4, ... < p: exchange the whole buffer with the
//!    rank whose new rank differs in `mask`, and reduce what arrives. After
//!    log2(p) rounds every remaining rank holds the full reduction.
//! 3. Unfold: each odd rank of the first 2*extra sends the result back to
//!    the even rank it represents.
//!
//! Every message is the whole buffer: log2(p) (+2) latencies, and log2(p)
//! buffers sent per rank, so it is chosen for small buffers, and for two
//! ranks at any size (there it sends exactly what the ring sends, in one
//! step instead of two). Messages are cut into segments, and segment j of a
//! round goes out as soon as segment j of the previous round is reduced.
//! Both sides of an exchange compute `mine op theirs`; the operators are
//! commutative, so all ranks end with bit-identical results.
//!
//! Memory: each receive stream (the fold and each round) owns one segment of
//! scratch; its frames are read one after another and each is reduced before
//! the next is read. The partner's segment may arrive before our own send of
//! that segment has left: it is read at once (so neither side can block the
//! other) but reduced into the buffer only once our send is complete (a
//! `hold`), so a send never sees half-reduced data.

use super::super::{segments, Comm};
use crate::engine::{Dep, RecvFrame, Region, Schedule};
use crate::error::CommError;
use crate::reduce_op::ReduceOp;

pub(super) fn run(comm: &Comm<'_>, buf: &mut [u8], op: ReduceOp) -> Result<(), CommError> {
    let (r, n) = (comm.rank(), comm.size());
    let seg = comm.segment();
    let segs: Vec<(usize, usize)> = segments(0, buf.len(), seg).collect();
    // Bytes of one scratch slot: a segment, or the whole (smaller) buffer.
    let slot = seg.min(buf.len());
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let extra = n - p;
    let mut sched = Schedule::default();
    // Scratch slot of the next receive stream.
    let mut slots = 0;
    if r < 2 * extra && r % 2 == 0 {
        for &(o, l) in &segs {
            sched.send(r + 1, Region::Out(o, l), None);
        }
        for &(o, l) in &segs {
            sched.recv(r + 1, RecvFrame::copy(Region::Out(o, l)));
        }
    } else {
        let new = if r < 2 * extra { r / 2 } else { r - extra };
        let old = |v: usize| if v < extra { 2 * v + 1 } else { v + extra };
        // Per segment: what the next send of it must wait for.
        let mut ready: Vec<Option<Dep>> = vec![None; segs.len()];
        if r < 2 * extra {
            for (j, &(o, l)) in segs.iter().enumerate() {
                let frame = RecvFrame::reduce(Region::Scratch(0, l), Region::Out(o, l));
                ready[j] = Some(sched.recv(r - 1, frame));
            }
            slots += 1;
        }
        let mut mask = 1;
        while mask < p {
            let partner = old(new ^ mask);
            let last_round = mask * 2 == p;
            for (j, &(o, l)) in segs.iter().enumerate() {
                let sent = sched.send(partner, Region::Out(o, l), ready[j]);
                let frame = RecvFrame::reduce(Region::Scratch(slots * slot, l), Region::Out(o, l))
                    .hold(Some(sent))
                    .finish_avg(last_round && op == ReduceOp::Avg);
                ready[j] = Some(sched.recv(partner, frame));
            }
            slots += 1;
            mask *= 2;
        }
        if r < 2 * extra {
            for (j, &(o, l)) in segs.iter().enumerate() {
                sched.send(r - 1, Region::Out(o, l), ready[j]);
            }
        }
    }
    let scratch = slots * slot;
    comm.with_bufs(buf, &[], scratch, |bufs| comm.run(&sched, bufs, Some(op)))
}

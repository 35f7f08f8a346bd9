//! Recursive-doubling all_reduce, for small messages.
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
//! Every message is the whole buffer, so this costs log2(p) (+2) latencies
//! and is only chosen for small buffers. Both sides of an exchange compute
//! `mine op theirs`; the operators are commutative, so all ranks end with
//! bit-identical results. Each round's send waits for the previous round's
//! reduction, and each round's receive for the previous one, so one
//! buffer-sized scratch serves every round. The two sides of a round send at
//! the same time, so the partner's data may arrive before our own send has
//! left: it is read into scratch at once (so neither side can block the
//! other) but reduced into the buffer only once our send is complete.

use super::super::Comm;
use crate::engine::{Dep, RecvFrame, Region, Schedule};
use crate::error::CommError;
use crate::reduce_op::ReduceOp;

pub(super) fn run(comm: &Comm<'_>, buf: &mut [u8], op: ReduceOp) -> Result<(), CommError> {
    let (r, n) = (comm.rank(), comm.size());
    let bytes = buf.len();
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let extra = n - p;
    let all = Region::Out(0, bytes);
    let reduce_frame = |after: Option<Dep>, hold: Option<Dep>, finish: bool| RecvFrame {
        dst: Region::Scratch(0, bytes),
        after,
        reduce_into: Some(all),
        hold,
        finish_avg: finish && op == ReduceOp::Avg,
    };
    let mut sched = Schedule::default();
    if r < 2 * extra && r % 2 == 0 {
        sched.send(r + 1, all, None);
        sched.recv(
            r + 1,
            RecvFrame {
                dst: all,
                after: None,
                reduce_into: None,
                hold: None,
                finish_avg: false,
            },
        );
    } else {
        let new = if r < 2 * extra { r / 2 } else { r - extra };
        let old = |v: usize| if v < extra { 2 * v + 1 } else { v + extra };
        let mut last = None;
        if r < 2 * extra {
            last = Some(sched.recv(r - 1, reduce_frame(None, None, false)));
        }
        let mut mask = 1;
        while mask < p {
            let partner = old(new ^ mask);
            let sent = sched.send(partner, all, last);
            last = Some(sched.recv(partner, reduce_frame(last, Some(sent), mask * 2 == p)));
            mask *= 2;
        }
        if r < 2 * extra {
            sched.send(r - 1, all, last);
        }
    }
    comm.with_bufs(buf, &[], bytes, |bufs| comm.run(&sched, bufs, Some(op)))
}

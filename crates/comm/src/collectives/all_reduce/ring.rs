//! Ring all_reduce: a reduce-scatter then an all-gather around the ring,
//! chunked and pipelined.
//!
//! Scheme (N ranks, rank r sends to next = r+1 and receives from prev = r-1,
//! mod N): the buffer is cut into N chunks (sizes differ by at most one
//! element) and every chunk into segments of `SEGMENT_BYTES`.
//!
//! - Reduce-scatter, steps s = 0..N-2: send chunk (r - s), receive chunk
//!   (r - s - 1) into scratch and reduce it into the buffer. After the last
//!   step rank r holds the full reduction of chunk (r + 1) (divided by N
//!   there for `Avg`, so that only 1/N of the buffer is divided per rank).
//! - All-gather, steps s = 0..N-2: send chunk (r + 1 - s), receive chunk
//!   (r - s) straight into the buffer.
//!
//! The chunk sent at step s+1 is the chunk received at step s, so segment j
//! of step s+1 goes out as soon as segment j of step s has arrived (and been
//! reduced): while segment j is being reduced, segment j+1 is on the wire,
//! and the two phases flow into each other without a barrier. Every rank
//! sends 2(N-1)/N of the buffer and receives as much. Writes into the buffer
//! never race with sends of the same bytes: a region is overwritten only by
//! data the peer could only produce after receiving what we sent from it.

use super::super::{chunk, segments, Comm};
use crate::engine::{Dep, RecvFrame, Region, Schedule};
use crate::error::CommError;
use crate::reduce_op::ReduceOp;

pub(super) fn run(comm: &Comm<'_>, buf: &mut [u8], op: ReduceOp) -> Result<(), CommError> {
    let (r, n, es) = (comm.rank(), comm.size(), comm.es());
    let count = buf.len() / es;
    let seg = comm.segment();
    let next = (r + 1) % n;
    let prev = (r + n - 1) % n;
    let at = |c: usize| chunk(count, n, c % n, es);

    let mut sched = Schedule::default();
    // Dependencies of the chunk received in the previous step, one per segment.
    let mut last: Vec<Dep> = Vec::new();
    for s in 0..n - 1 {
        let (so, sl) = at(r + n - s);
        for (j, (o, l)) in segments(so, sl, seg).enumerate() {
            sched.send(next, Region::Out(o, l), last.get(j).copied());
        }
        let (ro, rl) = at(r + 2 * n - s - 1);
        last = segments(ro, rl, seg)
            .map(|(o, l)| {
                sched.recv(
                    prev,
                    RecvFrame {
                        dst: Region::Scratch(0, l),
                        after: None,
                        reduce_into: Some(Region::Out(o, l)),
                        hold: None,
                        finish_avg: op == ReduceOp::Avg && s == n - 2,
                    },
                )
            })
            .collect();
    }
    for s in 0..n - 1 {
        let (so, sl) = at(r + 1 + n - s);
        for (j, (o, l)) in segments(so, sl, seg).enumerate() {
            sched.send(next, Region::Out(o, l), last.get(j).copied());
        }
        let (ro, rl) = at(r + n - s);
        last = segments(ro, rl, seg)
            .map(|(o, l)| {
                sched.recv(
                    prev,
                    RecvFrame {
                        dst: Region::Out(o, l),
                        after: None,
                        reduce_into: None,
                        hold: None,
                        finish_avg: false,
                    },
                )
            })
            .collect();
    }
    let scratch = seg.min(buf.len());
    comm.with_bufs(buf, &[], scratch, |bufs| comm.run(&sched, bufs, Some(op)))
}

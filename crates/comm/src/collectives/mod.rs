//! Collective algorithms of the mesh backend, one file per algorithm.
//!
//! Each algorithm turns one call into an engine [`Schedule`] (who sends which
//! region to whom, after what) plus local copies, then lets the engine run it.
//! The `all_reduce` module holds the options/dispatch step that validates
//! sizes and picks ring or recursive doubling. Algorithms see only a
//! [`Comm`]: rank, size, the op's header description, scratch memory and
//! the engine; they must never touch sockets or the group's state.

pub(crate) mod all_gather;
pub(crate) mod all_reduce;
pub(crate) mod all_to_all;
pub(crate) mod barrier;
pub(crate) mod broadcast;
pub(crate) mod gather;
pub(crate) mod reduce;
pub(crate) mod reduce_scatter;
pub(crate) mod scatter;
pub(crate) mod tree;

use std::sync::Mutex;

use crate::element::DType;
use crate::engine::{self, Bufs, OpEnv, Schedule};
use crate::error::CommError;
use crate::kinds::Algorithm;
use crate::reduce_op::ReduceOp;

/// Bytes per pipelined frame. Big enough that per-frame costs (a header,
/// a few syscalls) vanish, small enough that a received segment is still in
/// cache when it is reduced and that the next hop starts early.
pub(crate) const SEGMENT_BYTES: usize = 256 << 10;

/// Messages up to this size use latency-optimal algorithms (recursive
/// doubling, binomial trees) unless `COHORT_ALGO` says otherwise.
pub(crate) const SMALL_BYTES: usize = 64 << 10;

/// What an algorithm may use: the op's identity and the engine.
pub(crate) struct Comm<'a> {
    pub env: OpEnv<'a>,
    pub algorithm: Algorithm,
    pub dtype: DType,
    pub scratch: &'a Mutex<Vec<f64>>,
}

impl Comm<'_> {
    pub fn rank(&self) -> usize {
        self.env.rank()
    }

    pub fn size(&self) -> usize {
        self.env.size()
    }

    /// Element size in bytes.
    pub fn es(&self) -> usize {
        self.dtype.size()
    }

    /// Whether to use the latency-optimal variant for a message of `bytes`.
    pub fn small(&self, bytes: usize) -> bool {
        match self.algorithm {
            Algorithm::Ring => false,
            Algorithm::Tree => true,
            _ => bytes <= SMALL_BYTES,
        }
    }

    /// Segment length in bytes, a whole number of elements.
    pub fn segment(&self) -> usize {
        (SEGMENT_BYTES / self.es()).max(1) * self.es()
    }

    /// Calls `f` with the op's buffers and `scratch_bytes` of scratch
    /// (8-byte aligned, reused across ops, contents unspecified).
    pub fn with_bufs<R>(
        &self,
        out: &mut [u8],
        inp: &[u8],
        scratch_bytes: usize,
        f: impl FnOnce(&mut Bufs<'_>) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let words = scratch_bytes.div_ceil(8);
        if guard.len() < words {
            // A fresh zeroed allocation, not `resize`: a large one comes from
            // the kernel as untouched pages, resident only once a collective
            // writes them. Some algorithms lay out more scratch than they use
            // (a two-rank ring reduce_scatter only ever writes its receive
            // segment), and `resize` would hold all of it resident for the
            // life of the group.
            *guard = vec![0.0; words];
        }
        let scratch = crate::element::as_bytes_mut(&mut guard[..]);
        let mut bufs = Bufs {
            out,
            inp,
            scratch: &mut scratch[..scratch_bytes],
        };
        f(&mut bufs)
    }

    /// Runs a schedule on `bufs`.
    pub fn run(
        &self,
        sched: &Schedule,
        bufs: &mut Bufs<'_>,
        reduce: Option<ReduceOp>,
    ) -> Result<(), CommError> {
        engine::run(&self.env, sched, bufs, reduce.map(|op| (self.dtype, op)))
    }
}

/// Byte range `(offset, len)` of chunk `c` when `count` elements of `es`
/// bytes are split into `n` chunks as evenly as possible (the first
/// `count % n` chunks get one element more).
pub(crate) fn chunk(count: usize, n: usize, c: usize, es: usize) -> (usize, usize) {
    let base = count / n;
    let rem = count % n;
    let off = c * base + c.min(rem);
    let len = base + usize::from(c < rem);
    (off * es, len * es)
}

/// Splits the byte range `(off, len)` into segments of at most `seg`
/// bytes; an empty range still yields one empty segment so that every
/// step of an algorithm exchanges at least a header (and thus checks it).
pub(crate) fn segments(off: usize, len: usize, seg: usize) -> impl Iterator<Item = (usize, usize)> {
    let n = len.div_ceil(seg).max(1);
    (0..n).map(move |i| {
        let o = i * seg;
        (off + o, seg.min(len - o.min(len)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_buffer_exactly() {
        for count in [0usize, 1, 2, 7, 13, 100] {
            for n in 1..9 {
                let mut next = 0;
                for c in 0..n {
                    let (o, l) = chunk(count, n, c, 4);
                    assert_eq!(o, next);
                    next = o + l;
                }
                assert_eq!(next, count * 4);
            }
        }
    }

    #[test]
    fn segments_cover_and_empty_yields_one() {
        assert_eq!(segments(8, 0, 4).collect::<Vec<_>>(), vec![(8, 0)]);
        assert_eq!(
            segments(0, 10, 4).collect::<Vec<_>>(),
            vec![(0, 4), (4, 4), (8, 2)]
        );
    }
}

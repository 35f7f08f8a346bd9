//! DDP's buckets on a device's gradient buffer, averaged by the device collectives (NCCL) while
//! backward goes on, as PyTorch's DDP does with `backend="nccl"`.
//!
//! The buckets are cohort-ddp's (cut along the ranges backward hands over, in launch order,
//! the last one small), as ranges of the device's gradient buffer. As backward hands a range
//! over (the model's readiness hook, each block's MLP half first), the hook records an event on
//! the device and [`Readiness`] files the range's view under the buckets it covers; once every
//! range of a bucket is in, and every bucket before it has gone, the bucket's views are joined
//! into one and sent with that event to a reducer thread. There the collectives queue its
//! average after the event, apart from the kernels (NCCL: on its communication stream), and
//! wait for it, while the training thread goes on launching backward's kernels. After
//! backward, what was not launched (nothing, when the ranges tile the buckets) is averaged,
//! and the kernels' stream is made to wait for the collectives before the gradient guard,
//! clipping and AdamW read the gradients.
//!
//! This module must never hand a bucket to the collectives before backward has handed over
//! every range of it, nor out of launch order (every rank must issue the same collectives in
//! the same order), nor use the collectives from two threads at once.

use std::ops::Range;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use cohort_engine::{Event, ViewMut};
use cohort_gpt::{Backward, GPT};

use super::step::SyncTimes;
use crate::device_comm::DeviceCollectives;
use crate::error::TrainError;

/// The last micro-batch's backward with its gradients averaged in `buckets` (ranges of the
/// gradient buffer in launch order, tiling it) by `coll` as backward finishes each (see the
/// module doc). The averaged gradients are ordered before every kernel launched after it
/// returns. Collective.
pub(crate) fn backward(
    model: &mut GPT,
    buckets: &[Range<usize>],
    coll: &dyn DeviceCollectives,
) -> Result<SyncTimes, TrainError> {
    let dev = model.backend_handle();
    let n = model.num_params();
    let fail = |what: String| TrainError::DeviceComm(what);
    let mut times = SyncTimes::default();
    let unlaunched = std::thread::scope(|s| -> Result<Range<usize>, TrainError> {
        let dev = &*dev;
        let (tx, rx) = mpsc::channel::<(usize, ViewMut<'_, f32>, Arc<Event>)>();
        // The one thread that uses the collectives while backward runs.
        let reducer = s.spawn(move || -> Result<Duration, String> {
            let mut busy = Duration::ZERO;
            for (b, grads, after) in rx {
                let t = Instant::now();
                coll.all_reduce_avg_after(dev, grads, &after)
                    .map_err(|e| format!("gradient bucket {b}: {e}"))?;
                busy += t.elapsed();
            }
            Ok(busy)
        });
        let mut ready = Readiness::new(buckets.to_vec(), n).map_err(fail)?;
        let mut bad: Option<String> = None;
        let t = Instant::now();
        let ran = model.backward(
            Backward::new()
                .on_ready(hook(|range, grads| {
                    let after = Arc::new(dev.record_event());
                    match ready.mark(range, grads, after, ViewMut::split_at_mut) {
                        Ok(launches) => {
                            for Launch {
                                bucket,
                                pieces,
                                after,
                            } in launches
                            {
                                match join(pieces) {
                                    // Fails only if the reducer stopped on an error, which
                                    // its join reports.
                                    Some(grads) => {
                                        let _ = tx.send((bucket, grads, after));
                                    }
                                    None => {
                                        bad.get_or_insert(format!(
                                            "gradient bucket {bucket}: its ranges are not one \
                                             piece of the gradient buffer"
                                        ));
                                    }
                                }
                            }
                        }
                        Err(e) => {
                            bad.get_or_insert(e);
                        }
                    }
                }))
                .split_blocks(),
        );
        times.backward = t.elapsed();
        drop(tx);
        let unlaunched = ready.unlaunched();
        drop(ready);
        let t = Instant::now();
        let busy = reducer
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
        times.comm_wait = t.elapsed();
        ran?;
        times.comm_busy = busy.map_err(fail)?;
        match bad {
            Some(e) => Err(fail(format!("backward's gradient ranges: {e}"))),
            None => Ok(unlaunched),
        }
    })?;
    // What backward did not complete (never, when its ranges tile the buckets) goes now, in
    // launch order, from this thread: the reducer is done.
    let t = Instant::now();
    let (dev, mut grads) = model.grads_view_mut();
    for b in unlaunched {
        let after = dev.record_event();
        coll.all_reduce_avg_after(dev, grads.slice_mut(buckets[b].clone()), &after)
            .map_err(|e| fail(format!("gradient bucket {b}: {e}")))?;
    }
    coll.order_kernels_after(dev).map_err(fail)?;
    times.comm_wait += t.elapsed();
    Ok(times)
}

/// `f` as a readiness hook of the one lifetime `'g` (a closure left to itself would take any
/// lifetime, and could then keep none of the views it is given).
fn hook<'g, F: FnMut(Range<usize>, ViewMut<'g, f32>) + Send>(f: F) -> F {
    f
}

/// The views of one bucket (ascending, adjacent) as one view.
fn join(pieces: Vec<ViewMut<'_, f32>>) -> Option<ViewMut<'_, f32>> {
    let mut it = pieces.into_iter();
    let first = it.next()?;
    // SAFETY: every piece is a view the model's backward handed over of its one gradient
    // buffer (split further only at bucket boundaries, `split_at_mut`), so adjacent pieces
    // are adjacent parts of one allocation; `join` checks the adjacency.
    it.try_fold(first, |whole, next| unsafe { whole.join(next) })
}

/// A bucket whose ranges are all in: its pieces in ascending order and the event of the range
/// that completed it (after which the kernels that wrote all of it have been launched).
#[derive(Debug)]
pub(crate) struct Launch<V, E> {
    pub bucket: usize,
    pub pieces: Vec<V>,
    pub after: E,
}

/// Which buckets the ranges handed over so far complete, launched strictly in bucket order
/// (see the module doc). `V` is a range's payload (the device's view of it), cut at bucket
/// boundaries by the caller's `split`; `E` the event of the range.
pub(crate) struct Readiness<V, E> {
    /// The buckets' ranges, in launch order.
    buckets: Vec<Range<usize>>,
    /// Per bucket, the pieces handed over so far, with their ranges.
    pieces: Vec<Vec<(Range<usize>, V)>>,
    /// Per bucket, the elements still to come.
    left: Vec<usize>,
    /// Per bucket, the event of the range that completed it.
    completed: Vec<Option<E>>,
    /// The next bucket to launch.
    next: usize,
    /// The gradient buffer's length.
    len: usize,
}

impl<V, E: Clone> Readiness<V, E> {
    /// Readiness of `buckets` (in launch order), which must tile `0..len`.
    pub(crate) fn new(buckets: Vec<Range<usize>>, len: usize) -> Result<Self, String> {
        let mut sorted = buckets.clone();
        sorted.sort_by_key(|r| r.start);
        let mut at = 0;
        for r in &sorted {
            if r.start != at || r.end <= r.start {
                return Err(format!(
                    "the buckets {buckets:?} do not tile the gradient buffer of {len} at {at}"
                ));
            }
            at = r.end;
        }
        if at != len {
            return Err(format!(
                "the buckets {buckets:?} end at {at}, the gradient buffer at {len}"
            ));
        }
        let k = buckets.len();
        Ok(Readiness {
            left: buckets.iter().map(|r| r.len()).collect(),
            buckets,
            pieces: (0..k).map(|_| Vec::new()).collect(),
            completed: vec![None; k],
            next: 0,
            len,
        })
    }

    /// Files `range` (its payload `view`, recorded after `event`) under the buckets it covers,
    /// cutting it with `split(view, at)` (the first `at` elements and the rest) where it
    /// crosses a boundary; returns the buckets that may now go, in launch order. An error for
    /// a range outside the buffer or handed over twice.
    pub(crate) fn mark(
        &mut self,
        range: Range<usize>,
        view: V,
        event: E,
        split: impl Fn(V, usize) -> (V, V),
    ) -> Result<Vec<Launch<V, E>>, String> {
        let mut hit: Vec<usize> = (0..self.buckets.len())
            .filter(|&b| {
                let r = &self.buckets[b];
                r.start < range.end && range.start < r.end
            })
            .collect();
        hit.sort_by_key(|&b| self.buckets[b].start);
        let covered: usize = hit
            .iter()
            .map(|&b| {
                let r = &self.buckets[b];
                r.end.min(range.end) - r.start.max(range.start)
            })
            .sum();
        if range.is_empty() || covered != range.len() {
            return Err(format!(
                "{range:?} is not a range of the gradient buffer of {}",
                self.len
            ));
        }
        for &b in &hit {
            let r = &self.buckets[b];
            let part = r.start.max(range.start)..r.end.min(range.end);
            let overlaps = |(p, _): &(Range<usize>, V)| p.start < part.end && part.start < p.end;
            if self.left[b] < part.len() || self.pieces[b].iter().any(overlaps) {
                return Err(format!("{part:?} was handed over twice"));
            }
        }
        // Cut from the top: each cut leaves the lower part to cut again.
        let mut rest = view;
        for &b in hit.iter().rev() {
            let r = &self.buckets[b];
            let lo = r.start.max(range.start);
            let part = lo..r.end.min(range.end);
            let piece = match lo > range.start {
                true => {
                    let (below, piece) = split(rest, lo - range.start);
                    rest = below;
                    piece
                }
                // The lowest bucket takes what is left (the loop's last turn).
                false => {
                    self.file(b, part, rest, &event);
                    break;
                }
            };
            self.file(b, part, piece, &event);
        }
        let mut go = Vec::new();
        while self.next < self.buckets.len() && self.left[self.next] == 0 {
            let b = self.next;
            let mut pieces = std::mem::take(&mut self.pieces[b]);
            pieces.sort_by_key(|(r, _)| r.start);
            go.push(Launch {
                bucket: b,
                pieces: pieces.into_iter().map(|(_, v)| v).collect(),
                after: self.completed[b]
                    .take()
                    .expect("a complete bucket has its event"),
            });
            self.next += 1;
        }
        Ok(go)
    }

    /// The buckets not launched: to go after backward, in this order.
    pub(crate) fn unlaunched(&self) -> Range<usize> {
        self.next..self.buckets.len()
    }

    fn file(&mut self, b: usize, part: Range<usize>, piece: V, event: &E) {
        self.left[b] -= part.len();
        self.pieces[b].push((part, piece));
        if self.left[b] == 0 {
            self.completed[b] = Some(event.clone());
        }
    }
}

// Lists of pieces that happen to hold one range, not ranges meant as lists.
#[allow(clippy::single_range_in_vec_init)]
#[cfg(test)]
mod tests {
    use super::*;

    /// A range's payload in the tests: the range itself, cut as a view would be.
    fn cut(v: Range<usize>, at: usize) -> (Range<usize>, Range<usize>) {
        (v.start..v.start + at, v.start + at..v.end)
    }

    fn mark(
        r: &mut Readiness<Range<usize>, u32>,
        range: Range<usize>,
        event: u32,
    ) -> Vec<(usize, Vec<Range<usize>>, u32)> {
        r.mark(range.clone(), range, event, cut)
            .unwrap()
            .into_iter()
            .map(|l| (l.bucket, l.pieces, l.after))
            .collect()
    }

    /// Buckets in launch order from the top down, as cohort-ddp cuts them; the ranges of
    /// backward come top down too: each bucket goes once its last range is in, with that
    /// range's event.
    #[test]
    fn a_bucket_goes_when_its_last_range_is_in() {
        let mut r = Readiness::new(vec![6..10, 2..6, 0..2], 10).unwrap();
        assert_eq!(mark(&mut r, 8..10, 1), vec![]);
        assert_eq!(mark(&mut r, 6..8, 2), vec![(0, vec![6..8, 8..10], 2)]);
        assert_eq!(mark(&mut r, 2..6, 3), vec![(1, vec![2..6], 3)]);
        assert_eq!(r.unlaunched(), 2..3);
        assert_eq!(mark(&mut r, 0..2, 4), vec![(2, vec![0..2], 4)]);
        assert_eq!(r.unlaunched(), 3..3);
    }

    /// A range that crosses bucket boundaries is cut at them; a bucket complete before the
    /// one ahead of it in launch order waits for it, and both go together.
    #[test]
    fn ranges_are_cut_at_bucket_boundaries_and_buckets_go_in_order() {
        let mut r = Readiness::new(vec![5..10, 0..5], 10).unwrap();
        // 0..5 complete first, but bucket 0 (5..10) goes first.
        assert_eq!(mark(&mut r, 0..3, 1), vec![]);
        assert_eq!(mark(&mut r, 3..7, 2), vec![]);
        assert_eq!(
            mark(&mut r, 7..10, 3),
            vec![(0, vec![5..7, 7..10], 3), (1, vec![0..3, 3..5], 2)]
        );
        // One range over three buckets.
        let mut r = Readiness::new(vec![6..9, 3..6, 0..3], 9).unwrap();
        assert_eq!(
            mark(&mut r, 0..9, 7),
            vec![(0, vec![6..9], 7), (1, vec![3..6], 7), (2, vec![0..3], 7)]
        );
    }

    /// A range outside the buffer, an empty one, or one handed over twice is an error, as is
    /// a bucket layout that does not tile the buffer; nothing is launched for it.
    #[test]
    fn bad_ranges_and_layouts_are_errors() {
        let mut r = Readiness::<Range<usize>, u32>::new(vec![4..8, 0..4], 8).unwrap();
        let e = r.mark(6..9, 6..9, 0, cut).unwrap_err();
        assert!(e.contains("6..9") && e.contains("of 8"), "{e}");
        assert!(r.mark(3..3, 3..3, 0, cut).is_err());
        assert!(r.mark(5..6, 5..6, 0, cut).unwrap().is_empty());
        let e = r.mark(4..6, 4..6, 0, cut).unwrap_err();
        assert!(e.contains("twice"), "{e}");
        // Bucket 0 complete and launched: a range of it again is still an error.
        assert_eq!(r.mark(6..8, 6..8, 0, cut).unwrap().len(), 0);
        assert_eq!(r.mark(4..5, 4..5, 0, cut).unwrap().len(), 1);
        let e = r.mark(7..8, 7..8, 0, cut).unwrap_err();
        assert!(e.contains("twice"), "{e}");
        for (buckets, len) in [
            (vec![4..8, 0..3], 8),
            (vec![4..8, 0..5], 8),
            (vec![0..8], 9),
        ] {
            assert!(Readiness::<(), u32>::new(buckets, len).is_err());
        }
    }
}

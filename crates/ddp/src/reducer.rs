//! The `Reducer`: turns the model's "gradients of range [a, b) are final"
//! calls into bucket all-reduces, in bucket order.
//!
//! Backward hands over disjoint slices of the flat gradient buffer, top of
//! the buffer first. The reducer cuts each slice at bucket boundaries, keeps
//! the pieces of each bucket until the bucket is covered, joins them into one
//! slice and launches buckets strictly in index order (so every rank issues
//! the same collectives in the same order, whatever order its hook fires in).
//! It never reads or writes gradient values, and never waits: launching means
//! handing the slice to a callback (the communication thread's queue).

use crate::bucket::{GradientBucket, ParamSpec};
use crate::error::DdpError;
use std::ops::Range;

/// Per-backward state of the buckets.
pub(crate) struct Reducer<'b, 'g> {
    params: &'b [ParamSpec],
    buckets: &'b [GradientBucket],
    total: usize,
    /// Keep the slices and launch buckets (overlapped reduction), or only
    /// record coverage (reduction after backward).
    launch: bool,
    /// Per bucket, the ranges reported so far.
    covered: Vec<Vec<Range<usize>>>,
    /// Per bucket, elements reported so far.
    filled: Vec<usize>,
    /// Per bucket, the reported slices not yet joined (overlapped mode).
    pieces: Vec<Vec<&'g mut [f32]>>,
    /// Per bucket, the joined slice once covered, until its turn to launch.
    complete: Vec<Option<&'g mut [f32]>>,
    /// Buckets below this index have been launched.
    next: usize,
    /// The first misuse seen in the hook (which cannot return errors).
    error: Option<DdpError>,
    /// Every range reported, in the order reported.
    ready_log: Vec<Range<usize>>,
}

impl<'b, 'g> Reducer<'b, 'g> {
    pub(crate) fn new(
        params: &'b [ParamSpec],
        buckets: &'b [GradientBucket],
        total: usize,
        launch: bool,
    ) -> Self {
        let n = buckets.len();
        Self {
            params,
            buckets,
            total,
            launch,
            covered: vec![Vec::new(); n],
            filled: vec![0; n],
            pieces: (0..n).map(|_| Vec::new()).collect(),
            complete: (0..n).map(|_| None).collect(),
            next: 0,
            error: None,
            ready_log: Vec::new(),
        }
    }

    /// Records that `grads`, the gradients of `range`, are final; calls
    /// `launch(bucket, slice)` for each bucket that can now be reduced.
    pub(crate) fn mark_ready(
        &mut self,
        range: Range<usize>,
        grads: &'g mut [f32],
        launch: &mut dyn FnMut(usize, &'g mut [f32]),
    ) {
        if self.error.is_some() {
            return;
        }
        if let Err(e) = self.try_mark_ready(range, grads, launch) {
            self.error = Some(e);
        }
    }

    fn try_mark_ready(
        &mut self,
        range: Range<usize>,
        mut grads: &'g mut [f32],
        launch: &mut dyn FnMut(usize, &'g mut [f32]),
    ) -> Result<(), DdpError> {
        let len = grads.len();
        let bad = |why| DdpError::BadReadyRange {
            range: range.clone(),
            len,
            why,
        };
        if grads.len() != range.len() || range.end < range.start {
            return Err(bad("does not match the length of its slice"));
        }
        if range.end > self.total {
            return Err(bad("ends past the gradient buffer"));
        }
        self.ready_log.push(range.clone());
        // Buckets are in descending address order; walk the ones that
        // intersect `range` from its top down, peeling pieces off the end.
        let mut b = self
            .buckets
            .partition_point(|bk| bk.range.start >= range.end);
        let mut end = range.end;
        while end > range.start {
            let bucket = &self.buckets[b];
            let start = bucket.range.start.max(range.start);
            if self.covered[b]
                .iter()
                .any(|c| c.start < end && start < c.end)
            {
                return Err(bad("overlaps a range already reported in this backward"));
            }
            let (rest, piece) = std::mem::take(&mut grads).split_at_mut(start - range.start);
            grads = rest;
            self.covered[b].push(start..end);
            self.filled[b] += end - start;
            if self.launch {
                self.pieces[b].push(piece);
                if self.filled[b] == bucket.range.len() {
                    let pieces = std::mem::take(&mut self.pieces[b]);
                    self.complete[b] = Some(join_adjacent(pieces));
                }
            }
            end = start;
            b += 1;
        }
        while self.next < self.buckets.len() {
            match self.complete[self.next].take() {
                Some(slice) => {
                    launch(self.next, slice);
                    self.next += 1;
                }
                None => break,
            }
        }
        Ok(())
    }

    /// Ends the backward: the index of the first bucket not launched (all
    /// from there on must be reduced from the whole buffer), and the first
    /// parameter whose gradient was never reported, if any. Drops every
    /// slice still held.
    pub(crate) fn finish(self) -> Result<(usize, Option<&'b ParamSpec>), DdpError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let mut unused = None;
        'buckets: for (b, bucket) in self.buckets.iter().enumerate().skip(self.next) {
            if self.filled[b] == bucket.range.len() {
                continue;
            }
            for p in &self.params[bucket.params.clone()] {
                let got: usize = self.covered[b]
                    .iter()
                    .map(|c| {
                        c.end
                            .min(p.range.end)
                            .saturating_sub(c.start.max(p.range.start))
                    })
                    .sum();
                if got < p.range.len() {
                    unused = Some(p);
                    break 'buckets;
                }
            }
        }
        Ok((self.next, unused))
    }

    /// The ranges of bucket `b` that backward never reported, ascending.
    pub(crate) fn gaps(covered: &[Range<usize>], bucket: &Range<usize>) -> Vec<Range<usize>> {
        let mut sorted = covered.to_vec();
        sorted.sort_by_key(|r| r.start);
        let mut gaps = Vec::new();
        let mut at = bucket.start;
        for r in sorted {
            if r.start > at {
                gaps.push(at..r.start);
            }
            at = at.max(r.end);
        }
        if at < bucket.end {
            gaps.push(at..bucket.end);
        }
        gaps
    }

    /// Every range reported so far, in the order backward reported them.
    pub(crate) fn ready_log(&self) -> &[Range<usize>] {
        &self.ready_log
    }

    /// Per bucket, the ranges reported (for zeroing the gaps afterwards).
    pub(crate) fn covered(&self) -> &[Vec<Range<usize>>] {
        &self.covered
    }
}

/// Joins slices of one buffer that lie back to back in memory (in any
/// order) into one slice.
///
/// # Panics
/// If the slices are not contiguous in memory: that would be a bug in the
/// reducer, not bad input (pieces of a bucket always tile its range).
fn join_adjacent(mut pieces: Vec<&mut [f32]>) -> &mut [f32] {
    pieces.sort_by_key(|p| p.as_ptr() as usize);
    let mut pieces = pieces.into_iter();
    let mut joined = pieces.next().unwrap_or_default();
    for next in pieces {
        let len = joined.len();
        assert_eq!(
            joined.as_ptr().wrapping_add(len),
            next.as_ptr(),
            "gradient pieces of one bucket are not adjacent"
        );
        // SAFETY: `joined` and `next` are both exclusive borrows of parts of
        // the same allocation (the flat gradient buffer, split by the engine
        // with split_at_mut and by `try_mark_ready` with split_at_mut), with
        // the same lifetime 'g, and we just checked that `next` starts where
        // `joined` ends. Both are consumed here, so the joined slice is the
        // only way to reach those elements for the rest of 'g: no aliasing.
        // The pointer of `joined` is used to reach `next`'s elements; this
        // is allowed by the Tree Borrows model (a reference's pointer may
        // reach outside its range within the allocation as long as no other
        // live reference is invalidated); `next` is dead from here on. The
        // hook calls that delivered the slices have returned, so no function
        // argument protector covers them either.
        joined = unsafe { std::slice::from_raw_parts_mut(joined.as_mut_ptr(), len + next.len()) };
    }
    joined
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::assign_buckets;

    fn layout(lens: &[usize]) -> Vec<ParamSpec> {
        let mut off = 0;
        lens.iter()
            .enumerate()
            .map(|(i, &n)| {
                off += n;
                ParamSpec {
                    name: format!("p{i}"),
                    shape: vec![n],
                    range: off - n..off,
                }
            })
            .collect()
    }

    type Launched = (usize, Range<usize>);
    type Finished = Result<(usize, Option<String>), String>;

    /// Reports `ranges` (each a slice of a fresh buffer) and returns the
    /// launched (bucket, range-of-slice) pairs and the finish result.
    fn run(
        params: &[ParamSpec],
        buckets: &[GradientBucket],
        ranges: &[Range<usize>],
    ) -> (Vec<Launched>, Finished) {
        let total = params.last().unwrap().range.end;
        let mut buf = vec![0f32; total];
        let base = buf.as_ptr() as usize;
        let mut launched = Vec::new();
        let mut r = Reducer::new(params, buckets, total, true);
        // Hand out disjoint slices as the engine does: peel from the top.
        let mut rest: &mut [f32] = &mut buf;
        let mut sorted = ranges.to_vec();
        sorted.sort_by_key(|r| std::cmp::Reverse(r.start));
        let mut slices = Vec::new();
        for range in &sorted {
            let (lo, hi) = std::mem::take(&mut rest).split_at_mut(range.end);
            let (lo, piece) = lo.split_at_mut(range.start);
            let _ = hi;
            rest = lo;
            slices.push((range.clone(), piece));
        }
        // Report in the order given.
        for want in ranges {
            let i = slices.iter().position(|(r, _)| r == want).unwrap();
            let (range, s) = slices.swap_remove(i);
            r.mark_ready(range, s, &mut |b, s: &mut [f32]| {
                let start = (s.as_ptr() as usize - base) / 4;
                launched.push((b, start..start + s.len()));
            });
        }
        let fin = r
            .finish()
            .map(|(n, p)| (n, p.map(|p| p.name.clone())))
            .map_err(|e| e.to_string());
        (launched, fin)
    }

    #[test]
    fn launches_in_bucket_order_with_joined_slices() {
        let params = layout(&[4, 4, 4, 4]); // buckets of 2 params: [8..16], [0..8]
        let buckets = assign_buckets(&params, 32, 32);
        assert_eq!(buckets.len(), 2);
        // Ready ranges cut across params and buckets: 10..16, 6..10, 0..6.
        let (launched, fin) = run(&params, &buckets, &[10..16, 6..10, 0..6]);
        assert_eq!(launched, vec![(0, 8..16), (1, 0..8)]);
        assert_eq!(fin.unwrap(), (2, None));
    }

    #[test]
    fn a_bucket_ready_early_waits_for_its_turn() {
        let params = layout(&[4, 4, 4, 4]);
        let buckets = assign_buckets(&params, 32, 32);
        let (launched, _) = run(&params, &buckets, &[0..8, 8..16]);
        assert_eq!(launched, vec![(0, 8..16), (1, 0..8)]);
    }

    #[test]
    fn unreported_parameter_is_named() {
        let params = layout(&[4, 4, 4, 4]);
        let buckets = assign_buckets(&params, 16, 16); // one per param
        let (launched, fin) = run(&params, &buckets, &[12..16, 8..12, 0..4]);
        assert_eq!(launched, vec![(0, 12..16), (1, 8..12)]);
        assert_eq!(fin.unwrap(), (2, Some("p1".to_string())));
    }

    #[test]
    fn overlapping_or_bad_ranges_are_errors() {
        let params = layout(&[4, 4]);
        let buckets = assign_buckets(&params, 1 << 20, 1 << 20);
        let mut buf = [0f32; 8];
        let mut other = vec![0f32; 4];
        let mut r = Reducer::new(&params, &buckets, 8, true);
        r.mark_ready(4..8, &mut buf[4..], &mut |_, _| {});
        r.mark_ready(2..6, &mut other, &mut |_, _| {});
        let err = r.finish().unwrap_err().to_string();
        assert!(err.contains("overlaps"), "{err}");

        let mut buf = [0f32; 8];
        let mut r = Reducer::new(&params, &buckets, 8, true);
        r.mark_ready(0..3, &mut buf[..4], &mut |_, _| {});
        assert!(r.finish().unwrap_err().to_string().contains("length"));
    }

    #[test]
    fn gaps_of_a_bucket() {
        assert_eq!(Reducer::gaps(&[4..6, 0..2], &(0..8)), vec![2..4, 6..8]);
        assert_eq!(Reducer::gaps(&[], &(3..5)), vec![3..5]);
        let whole = [Range { start: 3, end: 5 }];
        assert!(Reducer::gaps(&whole, &(3..5)).is_empty());
    }
}

//! Which elements of the flat parameter buffer get weight decay: the buffer is cut into
//! contiguous segments, each decayed or exempt. Built once from ranges the model supplies; must
//! never know what the ranges mean.

use std::ops::Range;

use super::OptimError;

/// The weight-decay exemption mask of a flat parameter buffer, as sorted, merged segments that
/// cover `0..len` exactly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecayMask {
    len: usize,
    /// Consecutive `(range, decayed)` segments covering `0..len`; neighbours differ in `decayed`.
    segments: Vec<(Range<usize>, bool)>,
}

impl DecayMask {
    /// Every element decayed (PyTorch's single parameter group).
    pub fn all(len: usize) -> Self {
        Self::with_exempt(len, std::iter::empty()).expect("no ranges cannot be out of bounds")
    }

    /// Every element decayed except those in `exempt` (ranges may overlap, touch or come in any
    /// order). An empty range is ignored; a range past `len` is an error.
    pub fn with_exempt(
        len: usize,
        exempt: impl IntoIterator<Item = Range<usize>>,
    ) -> Result<Self, OptimError> {
        let mut ranges = Vec::new();
        for r in exempt {
            if r.start > r.end || r.end > len {
                return Err(OptimError::RangeOutOfBounds {
                    start: r.start,
                    end: r.end,
                    len,
                });
            }
            if !r.is_empty() {
                ranges.push(r);
            }
        }
        ranges.sort_by_key(|r| r.start);
        let mut segments: Vec<(Range<usize>, bool)> = Vec::new();
        let mut push = |r: Range<usize>, decayed: bool| {
            if r.is_empty() {
                return;
            }
            match segments.last_mut() {
                Some((last, d)) if *d == decayed && last.end == r.start => last.end = r.end,
                _ => segments.push((r, decayed)),
            }
        };
        let mut at = 0;
        for r in ranges {
            if r.start > at {
                push(at..r.start, true);
            }
            let end = r.end.max(at);
            push(at.max(r.start)..end, false);
            at = end;
        }
        push(at..len, true);
        Ok(Self { len, segments })
    }

    /// Length of the parameter buffer this mask describes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of decayed elements.
    pub fn decayed_count(&self) -> usize {
        self.segments
            .iter()
            .filter(|(_, d)| *d)
            .map(|(r, _)| r.len())
            .sum()
    }

    /// The `(range, decayed)` segments, in order, covering `0..len`.
    pub fn segments(&self) -> &[(Range<usize>, bool)] {
        &self.segments
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_is_one_decayed_segment() {
        assert_eq!(DecayMask::all(10).segments(), &[(0..10, true)]);
        assert!(DecayMask::all(0).segments().is_empty());
    }

    #[test]
    fn exempt_ranges_are_sorted_merged_and_cover_the_buffer() {
        let m = DecayMask::with_exempt(20, [12..15, 2..4, 3..6, 6..8, 9..9, 18..20]).unwrap();
        assert_eq!(
            m.segments(),
            &[
                (0..2, true),
                (2..8, false),
                (8..12, true),
                (12..15, false),
                (15..18, true),
                (18..20, false)
            ]
        );
        assert_eq!(m.decayed_count(), 2 + 4 + 3);
        let m = DecayMask::with_exempt(5, [0..5, 1..2]).unwrap();
        assert_eq!(m.segments(), &[(0..5, false)]);
    }

    #[test]
    fn out_of_bounds_range_is_an_error() {
        let e = DecayMask::with_exempt(5, std::iter::once(3..6)).unwrap_err();
        assert_eq!(
            e,
            OptimError::RangeOutOfBounds {
                start: 3,
                end: 6,
                len: 5
            }
        );
    }
}

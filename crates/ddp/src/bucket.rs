//! Gradient buckets: how the flat gradient buffer is cut into the pieces that
//! are all-reduced one call at a time.
//!
//! A bucket is a contiguous range of the flat buffer covering whole
//! parameters. Buckets are assigned as PyTorch's
//! `compute_bucket_assignment_by_size` does: walk the parameters in reverse
//! order (the order backward produces their gradients), close a bucket as soon
//! as it holds at least its limit, with a smaller limit for the first bucket so
//! that communication starts early. The last bucket, whose gradients are
//! final only when backward ends, is then cut small too
//! ([`split_last_bucket`]): whatever is still on the wire after backward is
//! exposed, and a small last bucket leaves little. This module only computes
//! ranges; it must never touch gradient values.

use crate::error::DdpError;
use std::ops::Range;

/// Bytes per gradient element (f32).
const ELEM_BYTES: usize = 4;

/// One named parameter of the model: where it lives in the flat buffers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ParamSpec {
    /// Name, e.g. `h.0.attn.c_attn.weight`.
    pub name: String,
    /// Shape; its product is the length of `range`.
    pub shape: Vec<usize>,
    /// Offsets of the parameter in the flat parameter and gradient buffers.
    pub range: Range<usize>,
}

/// A contiguous range of the flat gradient buffer, all-reduced in one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GradientBucket {
    /// Position in launch order: bucket 0 holds the last parameters.
    pub index: usize,
    /// Offsets in the flat gradient buffer.
    pub range: Range<usize>,
    /// Indices (into the parameter list) of the parameters it covers.
    pub params: Range<usize>,
}

impl GradientBucket {
    /// Size of the bucket in bytes.
    pub fn bytes(&self) -> usize {
        self.range.len() * ELEM_BYTES
    }
}

/// Checks that `params` are sorted, contiguous from offset 0, each as long as
/// its shape says, with distinct names; returns the total length.
pub(crate) fn check_layout(params: &[ParamSpec]) -> Result<usize, DdpError> {
    let mut end = 0;
    let mut names = std::collections::HashSet::new();
    for p in params {
        let numel: usize = p.shape.iter().product();
        if p.range.start != end || p.range.len() != numel || p.range.end < p.range.start {
            return Err(DdpError::BadLayout {
                name: p.name.clone(),
                range: p.range.clone(),
                expected_start: end,
                numel,
            });
        }
        if !names.insert(p.name.as_str()) {
            return Err(DdpError::DuplicateName(p.name.clone()));
        }
        end = p.range.end;
    }
    Ok(end)
}

/// Assigns parameters to buckets: in reverse parameter order, the first
/// bucket closes once it holds `first_cap_bytes` (capped at `cap_bytes`), the
/// others once they hold `cap_bytes`. A bucket may exceed its cap by the size
/// of its last parameter, as in PyTorch; a cap of 0 gives one bucket per
/// parameter. `params` must satisfy [`check_layout`].
pub fn assign_buckets(
    params: &[ParamSpec],
    first_cap_bytes: usize,
    cap_bytes: usize,
) -> Vec<GradientBucket> {
    let mut buckets = Vec::new();
    let mut limit = first_cap_bytes.min(cap_bytes);
    let mut open: Option<(usize, usize)> = None; // (first param index, bytes)
    for i in (0..params.len()).rev() {
        let bytes = params[i].range.len() * ELEM_BYTES;
        let (top, size) = open.unwrap_or((i, 0));
        let size = size + bytes;
        if size >= limit {
            buckets.push(make_bucket(params, buckets.len(), i..top + 1));
            limit = cap_bytes;
            open = None;
        } else {
            open = Some((top, size));
        }
    }
    if let Some((top, _)) = open {
        buckets.push(make_bucket(params, buckets.len(), 0..top + 1));
    }
    buckets
}

/// Buckets made of whole "ready ranges" (the ranges backward reports at
/// once, in the order it reported them), so that no bucket waits for part of
/// a range that finishes later: PyTorch rebuilds its buckets after the first
/// iteration from the order gradients became ready, for the same reason.
/// Same caps as [`assign_buckets`], applied to whole ranges; a bucket ends
/// only where a range boundary is also a parameter boundary. `None` when the
/// ranges do not tile the buffer from the top down (then the parameter-based
/// buckets stay).
pub fn assign_buckets_aligned(
    params: &[ParamSpec],
    ready: &[Range<usize>],
    first_cap_bytes: usize,
    cap_bytes: usize,
) -> Option<Vec<GradientBucket>> {
    let total = params.last().map_or(0, |p| p.range.end);
    let mut top = total;
    for r in ready {
        if r.end != top || r.is_empty() {
            return None;
        }
        top = r.start;
    }
    if top != 0 {
        return None;
    }
    let starts: std::collections::HashSet<usize> = params.iter().map(|p| p.range.start).collect();
    let mut bounds = vec![total];
    let mut limit = first_cap_bytes.min(cap_bytes);
    for r in ready {
        let open = bounds[bounds.len() - 1];
        if (open - r.start) * ELEM_BYTES >= limit && starts.contains(&r.start) && r.start > 0 {
            bounds.push(r.start);
            limit = cap_bytes;
        }
    }
    bounds.push(0);
    Some(buckets_from_bounds(params, &bounds))
}

/// `buckets` with the last one (the lowest offsets, ready last) cut at one
/// of `cuts` (offsets where a cut is allowed: parameter starts, or ready
/// range starts that are also parameter starts) so that it holds at most
/// `last_cap_bytes`: at the highest cut that keeps it under the cap, else at
/// the lowest (the smallest last bucket there can be). Unchanged when the
/// last bucket is already within the cap or nothing can cut it.
pub fn split_last_bucket(
    params: &[ParamSpec],
    buckets: &[GradientBucket],
    cuts: impl IntoIterator<Item = usize>,
    last_cap_bytes: usize,
) -> Vec<GradientBucket> {
    let Some(last) = buckets.last() else {
        return Vec::new();
    };
    if last.bytes() <= last_cap_bytes {
        return buckets.to_vec();
    }
    let starts: std::collections::HashSet<usize> = params.iter().map(|p| p.range.start).collect();
    let inside: Vec<usize> = cuts
        .into_iter()
        .filter(|c| last.range.start < *c && *c < last.range.end && starts.contains(c))
        .collect();
    let fits = inside
        .iter()
        .copied()
        .filter(|c| (c - last.range.start) * ELEM_BYTES <= last_cap_bytes);
    let Some(cut) = fits.max().or_else(|| inside.iter().copied().min()) else {
        return buckets.to_vec();
    };
    let mut bounds: Vec<usize> = std::iter::once(buckets[0].range.end)
        .chain(buckets.iter().map(|b| b.range.start))
        .collect();
    bounds.insert(bounds.len() - 1, cut);
    buckets_from_bounds(params, &bounds)
}

/// The bucket sizes in launch order, for a log line: `7.08 + 7.08 + ... +
/// 0.50 MB` (the middle elided beyond eight buckets).
pub fn describe_sizes(buckets: &[GradientBucket]) -> String {
    let bytes: Vec<usize> = buckets.iter().map(GradientBucket::bytes).collect();
    describe_bytes(&bytes)
}

/// Sizes in bytes, in order, for a log line in MB as [`describe_sizes`]
/// writes them (any collective's pieces: ZeRO's reduce-scatter units too).
pub fn describe_bytes(bytes: &[usize]) -> String {
    let mb = |b: &usize| format!("{:.2}", *b as f64 / (1024.0 * 1024.0));
    let sizes: Vec<String> = if bytes.len() > 8 {
        let n = bytes.len();
        let head = bytes[..3].iter().map(mb);
        let tail = bytes[n - 2..].iter().map(mb);
        head.chain(["...".to_string()]).chain(tail).collect()
    } else {
        bytes.iter().map(mb).collect()
    };
    format!("{} MB", sizes.join(" + "))
}

/// Buckets between descending offsets `bounds` (from the total down to 0),
/// each a whole number of parameters.
pub(crate) fn buckets_from_bounds(params: &[ParamSpec], bounds: &[usize]) -> Vec<GradientBucket> {
    bounds
        .windows(2)
        .filter(|w| w[0] > w[1])
        .enumerate()
        .map(|(index, w)| {
            let first = params.partition_point(|p| p.range.start < w[1]);
            let last = params.partition_point(|p| p.range.start < w[0]);
            GradientBucket {
                index,
                range: w[1]..w[0],
                params: first..last,
            }
        })
        .collect()
}

fn make_bucket(params: &[ParamSpec], index: usize, ids: Range<usize>) -> GradientBucket {
    GradientBucket {
        index,
        range: params[ids.start].range.start..params[ids.end - 1].range.end,
        params: ids,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Buckets must partition the buffer, in descending address order.
    fn assert_partition(b: &[GradientBucket], total: usize) {
        let mut end = total;
        for (i, bucket) in b.iter().enumerate() {
            assert_eq!(bucket.index, i);
            assert_eq!(bucket.range.end, end);
            assert!(!bucket.range.is_empty());
            end = bucket.range.start;
        }
        assert_eq!(end, 0);
    }

    #[test]
    fn first_bucket_is_small_then_cap() {
        // 10 params of 100 floats (400 B): first cap 800 B, then 2000 B.
        let p = layout(&[100; 10]);
        let b = assign_buckets(&p, 800, 2000);
        assert_partition(&b, 1000);
        let sizes: Vec<usize> = b.iter().map(|b| b.params.len()).collect();
        assert_eq!(sizes, vec![2, 5, 3]);
        assert_eq!(b[0].params, 8..10);
        assert_eq!(b[0].bytes(), 800);
    }

    #[test]
    fn zero_cap_gives_one_bucket_per_param_and_huge_cap_one_bucket() {
        let p = layout(&[3, 1, 4, 1, 5]);
        let tiny = assign_buckets(&p, 0, 0);
        assert_eq!(tiny.len(), 5);
        assert_partition(&tiny, 14);
        let huge = assign_buckets(&p, usize::MAX, usize::MAX);
        assert_eq!(huge.len(), 1);
        assert_eq!(huge[0].range, 0..14);
    }

    #[test]
    fn first_cap_never_exceeds_cap() {
        let p = layout(&[10; 4]);
        let b = assign_buckets(&p, 1 << 20, 40);
        assert_eq!(b.len(), 4);
    }

    #[test]
    fn aligned_buckets_end_on_ready_range_boundaries() {
        // Params of 100 floats; backward reports [700, 1000), [300, 700), [0, 300).
        let p = layout(&[100; 10]);
        let ready = [700..1000, 300..700, 0..300];
        // First cap 800 B = 200 floats: closes after the first range (300
        // floats), not inside the second as param-based buckets would.
        let b = assign_buckets_aligned(&p, &ready, 800, 2000).unwrap();
        assert_partition(&b, 1000);
        let ranges: Vec<_> = b.iter().map(|b| b.range.clone()).collect();
        assert_eq!(ranges, vec![700..1000, 0..700]);
        assert_eq!(b[1].params, 0..7);
        // Cap 0: one bucket per range; huge: one bucket.
        assert_eq!(assign_buckets_aligned(&p, &ready, 0, 0).unwrap().len(), 3);
        assert_eq!(
            assign_buckets_aligned(&p, &ready, usize::MAX, usize::MAX)
                .unwrap()
                .len(),
            1
        );
        // A range boundary inside a parameter is no bucket boundary.
        let odd = [650..1000, 0..650];
        let b = assign_buckets_aligned(&p, &odd, 0, 0).unwrap();
        assert_eq!(b.len(), 1);
        // Ranges that do not tile the buffer top-down: no rebuild.
        assert!(assign_buckets_aligned(&p, &[0..300, 300..1000], 0, 0).is_none());
        assert!(assign_buckets_aligned(&p, &[700..1000, 0..300], 0, 0).is_none());
    }

    #[test]
    fn the_last_bucket_is_cut_small() {
        // 10 params of 100 floats, one 2000 B bucket then the rest (4000 B).
        let p = layout(&[100; 10]);
        let b = assign_buckets(&p, 2000, 2000);
        let sizes = |b: &[GradientBucket]| b.iter().map(|b| b.bytes()).collect::<Vec<_>>();
        assert_eq!(sizes(&b), vec![2000, 2000]);
        let starts = p.iter().map(|p| p.range.start);
        // Cap 800 B: the last bucket is the two lowest parameters.
        let cut = split_last_bucket(&p, &b, starts.clone(), 800);
        assert_partition(&cut, 1000);
        assert_eq!(sizes(&cut), vec![2000, 1200, 800]);
        assert_eq!(cut[2].params, 0..2);
        // Cap 100 B: no cut keeps it under, so the smallest there is.
        assert_eq!(
            sizes(&split_last_bucket(&p, &b, starts.clone(), 100)),
            vec![2000, 1600, 400]
        );
        // Within the cap, or nothing to cut at: unchanged.
        assert_eq!(split_last_bucket(&p, &b, starts, 4000), b);
        assert_eq!(split_last_bucket(&p, &b, [0, 350], 800), b);
        assert_eq!(describe_sizes(&cut[..2]), "0.00 + 0.00 MB");
    }

    #[test]
    fn layout_errors_name_the_parameter() {
        let mut p = layout(&[2, 3]);
        assert_eq!(check_layout(&p).unwrap(), 5);
        p[1].range = 3..6;
        match check_layout(&p) {
            Err(DdpError::BadLayout {
                name,
                expected_start,
                ..
            }) => {
                assert_eq!((name.as_str(), expected_start), ("p1", 2))
            }
            other => panic!("{other:?}"),
        }
        let mut p = layout(&[2, 3]);
        p[1].shape = vec![4];
        assert!(matches!(check_layout(&p), Err(DdpError::BadLayout { .. })));
        let mut p = layout(&[2, 3]);
        p[1].name = "p0".into();
        assert!(matches!(check_layout(&p), Err(DdpError::DuplicateName(n)) if n == "p0"));
    }
}

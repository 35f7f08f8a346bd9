//! Packing: a batch's samples (short conversations) laid end to end in rows of a fixed width
//! instead of one padded row each, with per-position segment ids that keep each sample's
//! attention, positions and loss inside it (the model's `Forward::segments`).
//!
//! Scheme: samples longest first (ties in plan order), each into the first row it fits in
//! (first-fit decreasing), a new row when none has room; a sample longer than the width gets a
//! row of its own, the batch then as wide as it (never truncated). A row's k-th sample has
//! segment id k, and its padding the next id. The packing is a pure function of the batch's
//! indices, so the sampler's plan (DistributedSampler order, token budget, mid-epoch resume)
//! decides the batches exactly as without packing. It never reads a sample twice.

use crate::dataset::Samples;
use crate::loader::{Batch, SampleBuf};

/// Collates samples `indices` packed into rows of `width` positions (see the module doc).
/// A sample of n tokens takes n - 1 positions (its inputs; the targets are its next tokens),
/// so no position's target is another sample's token.
pub fn collate_packed(samples: &dyn Samples, indices: &[usize], width: usize) -> Batch {
    let positions = |i: usize| samples.sample_len(i).saturating_sub(1);
    let longest = indices.iter().map(|&i| positions(i)).max().unwrap_or(0);
    let seq = width.max(longest).max(1);
    let mut order: Vec<usize> = (0..indices.len()).collect();
    order.sort_by_key(|&k| std::cmp::Reverse(positions(indices[k])));
    // (used positions, samples) per row, and each sample's (row, offset) in plan order.
    let mut rows: Vec<(usize, u32)> = Vec::new();
    let mut place = vec![(0usize, 0usize); indices.len()];
    for k in order {
        let n = positions(indices[k]);
        if n == 0 {
            // A one-token sample has no target and takes no room.
            continue;
        }
        let row = match rows.iter().position(|&(used, _)| used + n <= seq) {
            Some(r) => r,
            None => {
                rows.push((0, 0));
                rows.len() - 1
            }
        };
        place[k] = (row, rows[row].0);
        rows[row].0 += n;
        rows[row].1 += 1;
    }
    let count = rows.len().max(1);
    let mut batch = Batch::padding(count, seq, indices);
    let mut segments = vec![0u32; count * seq];
    // Padding after a row's samples is a segment of its own.
    for (r, &(used, samples_in_row)) in rows.iter().enumerate() {
        segments[r * seq + used..(r + 1) * seq].fill(samples_in_row);
    }
    let mut next_id = vec![0u32; count];
    let mut buf = SampleBuf::default();
    // A sample's id is its rank among its row's samples by offset.
    let mut by_offset: Vec<usize> = (0..indices.len())
        .filter(|&k| positions(indices[k]) > 0)
        .collect();
    by_offset.sort_by_key(|&k| place[k]);
    for k in by_offset {
        let (row, off) = place[k];
        let at = row * seq + off;
        buf.place(samples, indices[k], &mut batch, at);
        segments[at..at + positions(indices[k])].fill(next_id[row]);
        next_id[row] += 1;
    }
    batch.segments = Some(segments);
    batch
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::{collate, DataLoader, LoaderConfig, IGNORE_INDEX};
    use crate::sampler::{BudgetConfig, TokenBudgetSampler};
    use std::sync::Arc;

    /// Sample i: 1 + i % 23 tokens, token p = i * 100 + p; every third token is not trained.
    struct Convs(usize);
    impl Samples for Convs {
        fn len(&self) -> usize {
            self.0
        }
        fn sample_len(&self, i: usize) -> usize {
            1 + i % 23
        }
        fn read(&self, i: usize, out: &mut [u32]) {
            for (p, o) in out.iter_mut().enumerate() {
                *o = (i * 100 + p) as u32;
            }
        }
        fn read_loss_mask(&self, _i: usize, out: &mut [u8]) -> bool {
            for (p, m) in out.iter_mut().enumerate() {
                *m = (p % 3 != 0) as u8;
            }
            true
        }
    }

    /// Every sample of the batch once, contiguous under one segment id, its inputs and targets
    /// as the unpacked collate writes them; padding and segment boundaries never targets.
    #[test]
    fn each_sample_is_one_segment_with_the_unpacked_targets() {
        let data = Convs(200);
        let indices: Vec<usize> = (0..40).map(|k| (k * 37) % 200).collect();
        for width in [16, 22, 64] {
            let b = collate_packed(&data, &indices, width);
            assert_eq!(b.seq, width.max(22));
            assert_eq!(b.indices, indices);
            let segs = b.segments.as_ref().unwrap();
            let want_positions: usize = indices.iter().map(|&i| data.sample_len(i) - 1).sum();
            let real = b.attention_mask.iter().filter(|&&m| m == 1).count();
            assert_eq!(real, want_positions);
            // Fewer rows than one sample a row.
            assert!(b.batch < indices.len());
            let mut found = 0;
            for &i in &indices {
                let n = data.sample_len(i) - 1;
                if n == 0 {
                    continue;
                }
                let start = b.input_ids.iter().position(|&x| x == (i * 100) as u32);
                let at = start.expect("sample placed");
                let one = collate(&data, &[i]);
                assert_eq!(&b.input_ids[at..at + n], &one.input_ids[..n]);
                assert_eq!(&b.targets[at..at + n], &one.targets[..n]);
                assert!(segs[at..at + n].iter().all(|&s| s == segs[at]));
                assert!(
                    at % b.seq == 0 || segs[at - 1] != segs[at],
                    "sample {i} starts a run"
                );
                let end = at + n;
                assert!(
                    end % b.seq == 0 || segs[end] != segs[at],
                    "sample {i} ends its run"
                );
                found += 1;
            }
            assert!(found > 30);
            for (p, &m) in b.attention_mask.iter().enumerate() {
                if m == 0 {
                    assert_eq!(b.targets[p], IGNORE_INDEX, "padding at {p}");
                }
            }
        }
    }

    /// The same packed batches whatever the number of workers, and a resumed plan continues
    /// with exactly the batches an uninterrupted one has.
    #[test]
    fn packed_batches_are_identical_across_workers_and_resumes() {
        let data = Arc::new(Convs(300));
        let plan = |start: usize| {
            let cfg = BudgetConfig {
                batch_tokens: 96,
                sort_size: 32,
                seed: 5,
                ..BudgetConfig::default()
            };
            TokenBudgetSampler::new(&*data, cfg, 2, 1)
                .unwrap()
                .batches(1, start)
        };
        let cfg = |workers| LoaderConfig {
            workers,
            prefetch: 2,
            pack: Some(32),
        };
        let all: Vec<Batch> = DataLoader::new(data.clone(), plan(0), cfg(0)).collect();
        assert!(all.len() > 10 && all.iter().all(|b| b.segments.is_some()));
        let threaded: Vec<Batch> = DataLoader::new(data.clone(), plan(0), cfg(3)).collect();
        assert_eq!(threaded, all);
        let head: Vec<Batch> = DataLoader::new(data.clone(), plan(0), cfg(2))
            .take(4)
            .collect();
        let tail: Vec<Batch> = DataLoader::new(data.clone(), plan(4), cfg(1)).collect();
        assert_eq!([head, tail].concat(), all);
    }
}

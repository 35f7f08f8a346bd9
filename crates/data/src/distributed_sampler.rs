//! `DistributedSampler`: which dataset indices each rank reads in an epoch.
//!
//! It follows `torch.utils.data.distributed.DistributedSampler` exactly in
//! its arithmetic (padding, truncation, striding, `set_epoch`); the shuffled
//! order itself comes from our own seeded generator, not torch's Mersenne
//! twister, so the permutations differ from PyTorch's while having the same
//! properties. It must never depend on anything a rank knows alone: every
//! rank computes the same permutation and takes its own stride of it.

use cohort_rng::SplitMix64;

use crate::DataError;

/// Splits `len` dataset indices among `num_replicas` ranks for one epoch.
///
/// - `shuffle`: the indices are permuted by a generator seeded with
///   `seed + epoch`, identically on every rank (so call
///   [`set_epoch`](DistributedSampler::set_epoch) at each epoch on every
///   rank, or every epoch repeats the same order);
/// - `drop_last = false`: the list is padded by repeating its first indices
///   until its length is a multiple of `num_replicas`, so every rank gets
///   `ceil(len / num_replicas)` indices (a few samples are seen twice);
/// - `drop_last = true`: the tail is dropped, so every rank gets
///   `floor(len / num_replicas)` indices;
/// - rank `r` takes `indices[r], indices[r + num_replicas], ...`.
///
/// ```
/// use cohort_data::DistributedSampler;
///
/// let s0 = DistributedSampler::new(10, 3, 0, false, 0, false).unwrap();
/// let s1 = DistributedSampler::new(10, 3, 1, false, 0, false).unwrap();
/// assert_eq!(s0.indices(), vec![0, 3, 6, 9]);
/// assert_eq!(s1.indices(), vec![1, 4, 7, 0]); // padded with index 0
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    len: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    /// A sampler over a dataset of `len` samples for rank `rank` of
    /// `num_replicas`. Fails when `num_replicas` is 0 or `rank` is not below it.
    pub fn new(
        len: usize,
        num_replicas: usize,
        rank: usize,
        shuffle: bool,
        seed: u64,
        drop_last: bool,
    ) -> Result<Self, DataError> {
        if num_replicas == 0 || rank >= num_replicas {
            return Err(DataError::InvalidRank { rank, num_replicas });
        }
        Ok(Self {
            len,
            num_replicas,
            rank,
            shuffle,
            seed,
            drop_last,
            epoch: 0,
        })
    }

    /// Sets the epoch, which changes the shuffled order (on every rank alike).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// How many indices this rank gets per epoch (the same on every rank).
    pub fn num_samples(&self) -> usize {
        if self.drop_last {
            self.len / self.num_replicas
        } else {
            self.len.div_ceil(self.num_replicas)
        }
    }

    /// `num_samples() * num_replicas`: the length of the padded or truncated list.
    pub fn total_size(&self) -> usize {
        self.num_samples() * self.num_replicas
    }

    /// This rank's indices for the current epoch, in the order to read them.
    pub fn indices(&self) -> Vec<usize> {
        let mut all: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            shuffle(&mut all, self.seed.wrapping_add(self.epoch));
        }
        let total = self.total_size();
        if total > all.len() && !all.is_empty() {
            // Pad by cycling through the list from its start, as PyTorch does
            // (`indices += (indices * ceil(pad / len))[:pad]`).
            let base = all.len();
            for i in 0..total - base {
                all.push(all[i % base]);
            }
        }
        all.truncate(total);
        all.into_iter()
            .skip(self.rank)
            .step_by(self.num_replicas)
            .collect()
    }
}

/// Fisher-Yates with SplitMix64: the same permutation on every rank and
/// platform for a given seed.
fn shuffle(v: &mut [usize], seed: u64) {
    let mut rng = SplitMix64(seed);
    for i in (1..v.len()).rev() {
        let j = rng.below_unbiased(i as u64 + 1) as usize;
        v.swap(i, j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn all_ranks(
        len: usize,
        n: usize,
        shuffle: bool,
        drop_last: bool,
        epoch: u64,
    ) -> Vec<Vec<usize>> {
        (0..n)
            .map(|r| {
                let mut s = DistributedSampler::new(len, n, r, shuffle, 7, drop_last).unwrap();
                s.set_epoch(epoch);
                s.indices()
            })
            .collect()
    }

    #[test]
    fn disjoint_and_cover_when_divisible() {
        for shuffle in [false, true] {
            let parts = all_ranks(12, 3, shuffle, false, 0);
            let mut seen = BTreeSet::new();
            for p in &parts {
                assert_eq!(p.len(), 4);
                for &i in p {
                    assert!(seen.insert(i), "index {i} given to two ranks");
                }
            }
            assert_eq!(seen, (0..12).collect());
        }
    }

    #[test]
    fn pads_by_repeating_first_indices() {
        let parts = all_ranks(10, 4, false, false, 0);
        // total 12: 0..10 then 0, 1; rank r takes r::4
        assert_eq!(
            parts,
            vec![vec![0, 4, 8], vec![1, 5, 9], vec![2, 6, 0], vec![3, 7, 1]]
        );
        // Shuffled: every index is covered, exactly two appear twice, and the
        // repeats are the first two of the permutation.
        let parts = all_ranks(10, 4, true, false, 3);
        let mut count = [0; 10];
        for p in &parts {
            assert_eq!(p.len(), 3);
            for &i in p {
                count[i] += 1;
            }
        }
        assert!(count.iter().all(|&c| c >= 1));
        assert_eq!(count.iter().filter(|&&c| c == 2).count(), 2);
        let mut perm: Vec<usize> = (0..10).collect();
        shuffle(&mut perm, 7 + 3);
        assert_eq!(parts[2][2], perm[0]);
        assert_eq!(parts[3][2], perm[1]);
    }

    #[test]
    fn pads_more_than_the_dataset_length() {
        // PyTorch cycles the list when the padding exceeds it: len 2, 5 ranks.
        let parts = all_ranks(2, 5, false, false, 0);
        assert_eq!(parts, vec![vec![0], vec![1], vec![0], vec![1], vec![0]]);
    }

    #[test]
    fn drop_last_truncates() {
        let parts = all_ranks(10, 4, false, true, 0);
        assert_eq!(parts, vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
        let s = DistributedSampler::new(10, 4, 0, true, 0, true).unwrap();
        assert_eq!((s.num_samples(), s.total_size()), (2, 8));
        let shuffled = all_ranks(10, 4, true, true, 1);
        let flat: BTreeSet<usize> = shuffled.iter().flatten().copied().collect();
        assert_eq!(flat.len(), 8, "drop_last must not repeat any index");
    }

    #[test]
    fn set_epoch_changes_order_identically_on_all_ranks() {
        let e0 = all_ranks(100, 3, true, false, 0);
        let e1 = all_ranks(100, 3, true, false, 1);
        assert_ne!(e0, e1);
        // Computed again (as another process would): the same lists.
        assert_eq!(e1, all_ranks(100, 3, true, false, 1));
        // Each epoch is still a partition of the padded permutation.
        for parts in [&e0, &e1] {
            let flat: BTreeSet<usize> = parts.iter().flatten().copied().collect();
            assert_eq!(flat, (0..100).collect());
        }
        // Without shuffle the epoch changes nothing.
        assert_eq!(
            all_ranks(100, 3, false, false, 0),
            all_ranks(100, 3, false, false, 5)
        );
    }

    #[test]
    fn shuffle_is_a_permutation_and_depends_on_seed() {
        let mut a: Vec<usize> = (0..1000).collect();
        let mut b = a.clone();
        shuffle(&mut a, 1);
        shuffle(&mut b, 2);
        assert_ne!(a, b);
        a.sort_unstable();
        assert_eq!(a, (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn empty_dataset_and_bad_rank() {
        let s = DistributedSampler::new(0, 2, 1, true, 0, false).unwrap();
        assert!(s.indices().is_empty());
        assert!(matches!(
            DistributedSampler::new(5, 2, 2, true, 0, false),
            Err(DataError::InvalidRank {
                rank: 2,
                num_replicas: 2
            })
        ));
        assert!(DistributedSampler::new(5, 0, 0, true, 0, false).is_err());
    }
}

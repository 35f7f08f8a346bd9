//! [`TokenBudgetSampler`]: a distributed, sort-buffer, token-budget dynamic batch sampler for
//! documents of different lengths.
//!
//! Scheme, per epoch: shuffle all sample indices (seeded by seed + epoch, identical on every
//! rank); cut them into sort buffers of `sort_size * world` samples; sort each buffer by sample
//! length (stable); walk it, closing a batch when adding the next sample would make
//! `max_len_in_batch * count` exceed the token budget or `count` reach `max_samples`; shuffle
//! the batch order; pad the list with seeded repeats until it divides by `world`; deal batch i
//! to rank i % world. `start_step` skips the batches a resumed run has already trained on, so a
//! resume neither repeats nor skips. The sampler only computes indices; it never reads data.

use cohort_rng::SplitMix64 as Rng;

use crate::dataset::Samples;
use crate::DataError;

/// Settings of the token-budget sampler.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetConfig {
    /// Most tokens per batch, padding included (`max_len * count`); a single sample longer than
    /// this still forms a batch of one.
    pub batch_tokens: usize,
    /// Most samples per batch.
    pub max_samples: usize,
    /// Samples per sort buffer, per rank.
    pub sort_size: usize,
    /// Shuffle samples and batches each epoch.
    pub shuffle: bool,
    /// Seed of the shuffles.
    pub seed: u64,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        BudgetConfig {
            batch_tokens: 4096,
            max_samples: 200,
            sort_size: 1024,
            shuffle: true,
            seed: 0,
        }
    }
}

/// Batches of sample indices by token budget, dealt across ranks.
#[derive(Debug, Clone)]
pub struct TokenBudgetSampler {
    cfg: BudgetConfig,
    lens: Vec<usize>,
    world: usize,
    rank: usize,
}

impl TokenBudgetSampler {
    /// A sampler over `samples` for `rank` of `world`.
    pub fn new(
        samples: &dyn Samples,
        cfg: BudgetConfig,
        world: usize,
        rank: usize,
    ) -> Result<TokenBudgetSampler, DataError> {
        let bad = |what, reason: String| Err(DataError::Config { what, reason });
        if world == 0 || rank >= world {
            return bad("rank", format!("rank {rank} of world {world}"));
        }
        if cfg.batch_tokens == 0 || cfg.max_samples == 0 || cfg.sort_size == 0 {
            return bad(
                "sampler",
                format!("zero batch_tokens, max_samples or sort_size in {cfg:?}"),
            );
        }
        if samples.is_empty() {
            return bad("sampler", "no samples".into());
        }
        let lens = (0..samples.len()).map(|i| samples.sample_len(i)).collect();
        Ok(TokenBudgetSampler {
            cfg,
            lens,
            world,
            rank,
        })
    }

    /// All batches of `epoch`, for every rank, before dealing (equal count per rank).
    fn all_batches(&self, epoch: u64) -> Vec<Vec<usize>> {
        let mut rng = Rng(self.cfg.seed ^ epoch.wrapping_mul(0xA076_1D64_78BD_642F));
        let mut indices: Vec<usize> = (0..self.lens.len()).collect();
        if self.cfg.shuffle {
            rng.shuffle(&mut indices);
        }
        let mut batches = Vec::new();
        for buffer in indices.chunks_mut(self.cfg.sort_size * self.world) {
            buffer.sort_by_key(|&i| self.lens[i]);
            let mut batch: Vec<usize> = Vec::new();
            let mut max_len = 0;
            for &i in buffer.iter() {
                let len = self.lens[i];
                let grown = max_len.max(len) * (batch.len() + 1);
                if !batch.is_empty()
                    && (grown > self.cfg.batch_tokens || batch.len() >= self.cfg.max_samples)
                {
                    batches.push(std::mem::take(&mut batch));
                    max_len = 0;
                }
                batch.push(i);
                max_len = max_len.max(len);
            }
            if !batch.is_empty() {
                batches.push(batch);
            }
        }
        if self.cfg.shuffle {
            rng.shuffle(&mut batches);
        }
        let short = batches.len().next_multiple_of(self.world) - batches.len();
        let n = batches.len();
        for _ in 0..short {
            batches.push(batches[rng.below(n)].clone());
        }
        batches
    }

    /// Batches per rank in an epoch.
    pub fn batches_per_epoch(&self, epoch: u64) -> usize {
        self.all_batches(epoch).len() / self.world
    }

    /// This rank's batches of `epoch`, from step `start_step` on.
    pub fn batches(&self, epoch: u64, start_step: usize) -> Vec<Vec<usize>> {
        self.all_batches(epoch)
            .into_iter()
            .skip(self.rank)
            .step_by(self.world)
            .skip(start_step)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Lens(Vec<usize>);
    impl Samples for Lens {
        fn len(&self) -> usize {
            self.0.len()
        }
        fn sample_len(&self, i: usize) -> usize {
            self.0[i]
        }
        fn read(&self, _: usize, _: &mut [u32]) {}
    }

    fn lens(n: usize) -> Lens {
        Lens((0..n).map(|i| 1 + (i * 37) % 50).collect())
    }

    #[test]
    fn batches_respect_the_budget_and_cover_every_sample_once() {
        let data = lens(500);
        let cfg = BudgetConfig {
            batch_tokens: 200,
            max_samples: 16,
            sort_size: 64,
            shuffle: true,
            seed: 3,
        };
        for world in [1, 2, 3] {
            let mut seen = vec![0; 500];
            let mut per_rank = Vec::new();
            for rank in 0..world {
                let s = TokenBudgetSampler::new(&data, cfg.clone(), world, rank).unwrap();
                let batches = s.batches(0, 0);
                per_rank.push(batches.len());
                for b in &batches {
                    let max = b.iter().map(|&i| data.0[i]).max().unwrap();
                    assert!(max * b.len() <= 200 && b.len() <= 16, "{b:?}");
                    b.iter().for_each(|&i| seen[i] += 1);
                }
            }
            assert!(per_rank.iter().all(|&n| n == per_rank[0]), "{per_rank:?}");
            // Every sample at least once; repeats only from the padding batches.
            assert!(seen.iter().all(|&c| c >= 1));
            assert!(seen.iter().sum::<usize>() - 500 <= (world - 1) * 16);
        }
    }

    #[test]
    fn epochs_differ_and_start_step_resumes_exactly() {
        let data = lens(300);
        let s = TokenBudgetSampler::new(
            &data,
            BudgetConfig {
                batch_tokens: 128,
                ..Default::default()
            },
            2,
            1,
        )
        .unwrap();
        let full = s.batches(4, 0);
        assert_eq!(s.batches(4, 0), full, "deterministic");
        assert_ne!(s.batches(5, 0), full);
        assert_eq!(s.batches(4, 7), full[7..].to_vec());
        assert_eq!(s.batches_per_epoch(4), full.len());
        // A sample longer than the budget is a batch of its own.
        let long = Lens(vec![10, 500, 10]);
        let s = TokenBudgetSampler::new(
            &long,
            BudgetConfig {
                batch_tokens: 100,
                ..Default::default()
            },
            1,
            0,
        )
        .unwrap();
        assert!(s.batches(0, 0).contains(&vec![1]));
        let e = TokenBudgetSampler::new(&long, BudgetConfig::default(), 2, 2).unwrap_err();
        assert!(e.to_string().contains("rank 2 of world 2"), "{e}");
    }
}

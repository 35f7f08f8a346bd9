//! The batches one rank trains on: which samples, in what order, and the loader threads that
//! read them ahead of the training loop.
//!
//! - Fixed-length data (the Markov corpus, random tokens, windows of a token stream): the
//!   rank's [`DistributedSampler`] order, epoch after epoch, cut into batches of `batch_size`
//!   rows; a batch may straddle two epochs, as one continuous stream.
//! - Documents of different lengths (JSONL): the [`TokenBudgetSampler`] (sort buffer, token budget), one plan per
//!   epoch, each batch at most `batch_size * seq_len` tokens padding included, right-padded
//!   with an attention mask and -100 labels.
//!
//! Either way the position after every batch, `(epoch, offset)`, is what checkpoints record, so
//! a resumed run reads exactly the batches an uninterrupted one would. Batches are pure
//! functions of the plan, so the number of loader threads never changes them. This module
//! never touches the model or a process group.

use std::sync::Arc;

use cohort_data::DistributedSampler;
use cohort_data::TokenBudgetSampler;
use cohort_data::{collate_as, Batch, BudgetConfig, DataLoader, LoaderConfig, Samples};

use crate::config::TrainConfig;
use crate::error::TrainError;
use cohort_data::{Dataset, Split};

/// Batches planned at a time for fixed-length data (a plan is a few KB of indices).
const PLAN_CHUNK: usize = 256;

/// Token-budget batching of variable-length data: as many tokens per batch, padding
/// included, as `batch_size` full-length sequences.
fn budget(cfg: &TrainConfig, data: &dyn Dataset, shuffle: bool) -> BudgetConfig {
    // Samples hold one token more than their trained positions.
    let batch_tokens = cfg.batch_size * (data.seq_len() + 1);
    BudgetConfig {
        batch_tokens,
        max_samples: batch_tokens,
        sort_size: cfg.sort_size,
        shuffle,
        seed: cfg.seed,
    }
}

/// The width packed rows have (`--pack`): the model's sequence length.
fn pack_width(cfg: &TrainConfig, data: &dyn Dataset) -> Option<usize> {
    cfg.pack.then(|| data.seq_len())
}

/// One split of a [`Dataset`] as the loader's [`Samples`].
struct SplitSamples {
    data: Arc<dyn Dataset>,
    split: Split,
}

impl Samples for SplitSamples {
    fn len(&self) -> usize {
        self.data.len(self.split)
    }
    fn sample_len(&self, index: usize) -> usize {
        self.data.sample_len(self.split, index)
    }
    fn read(&self, index: usize, out: &mut [u32]) {
        self.data.read(self.split, index, out)
    }
    fn read_loss_mask(&self, index: usize, out: &mut [u8]) -> bool {
        self.data.read_loss_mask(self.split, index, out)
    }
}

/// How the next plan is made.
enum Planner {
    /// Fixed-length samples in the rank's DistributedSampler order.
    Stream {
        sampler: DistributedSampler,
        indices: Vec<usize>,
        batch_size: usize,
    },
    /// Variable-length samples by token budget.
    Budget(TokenBudgetSampler),
}

/// This rank's training batches, from a checkpointed position on.
pub(crate) struct TrainBatches {
    samples: Arc<SplitSamples>,
    planner: Planner,
    loader_config: LoaderConfig,
    loader: Option<DataLoader>,
    /// Position after each batch of the current plan.
    after: Vec<(u64, usize)>,
    taken: usize,
    /// Position before the current plan's first batch.
    start: (u64, usize),
}

impl TrainBatches {
    /// Batches of rank `rank` of `world`, starting at `(epoch, offset)` (0, 0 for a new run).
    pub(crate) fn new(
        data: Arc<dyn Dataset>,
        cfg: &TrainConfig,
        world: usize,
        rank: usize,
        epoch: u64,
        offset: usize,
    ) -> Result<TrainBatches, TrainError> {
        let samples = Arc::new(SplitSamples {
            data: data.clone(),
            split: Split::Train,
        });
        let planner = if data.variable_length() {
            let budget = budget(cfg, &*data, true);
            Planner::Budget(TokenBudgetSampler::new(&*samples, budget, world, rank)?)
        } else {
            let sampler = DistributedSampler::new(
                data.len(Split::Train),
                world,
                rank,
                true,
                cfg.seed,
                false,
            )?;
            Planner::Stream {
                sampler,
                indices: Vec::new(),
                batch_size: cfg.batch_size,
            }
        };
        Ok(TrainBatches {
            samples,
            planner,
            loader_config: LoaderConfig {
                workers: cfg.loader_workers,
                prefetch: cfg.prefetch,
                pack: pack_width(cfg, &*data),
            },
            loader: None,
            after: Vec::new(),
            taken: 0,
            start: (epoch, offset),
        })
    }

    /// Where the stream stands after the last batch taken: `(epoch, offset)`.
    pub(crate) fn position(&self) -> (u64, usize) {
        match self.taken {
            0 => self.start,
            k => self.after[k - 1],
        }
    }

    /// The next batch (the stream never ends: epochs follow each other).
    pub(crate) fn next_batch(&mut self) -> Batch {
        loop {
            if let Some(batch) = self.loader.as_mut().and_then(|l| l.next()) {
                self.taken += 1;
                return batch;
            }
            self.start = self.position();
            let (plan, after) = self.planner.plan(self.start);
            self.after = after;
            self.taken = 0;
            self.loader = Some(DataLoader::new(
                self.samples.clone(),
                plan,
                self.loader_config,
            ));
        }
    }
}

impl Planner {
    /// The batches from `(epoch, offset)` on, and the position after each.
    fn plan(
        &mut self,
        (mut epoch, mut offset): (u64, usize),
    ) -> (Vec<Vec<usize>>, Vec<(u64, usize)>) {
        match self {
            Planner::Stream {
                sampler,
                indices,
                batch_size,
            } => {
                let mut plan = Vec::with_capacity(PLAN_CHUNK);
                let mut after = Vec::with_capacity(PLAN_CHUNK);
                for _ in 0..PLAN_CHUNK {
                    let mut batch = Vec::with_capacity(*batch_size);
                    for _ in 0..*batch_size {
                        if indices.is_empty() || sampler.epoch() != epoch {
                            sampler.set_epoch(epoch);
                            *indices = sampler.indices();
                        }
                        if offset >= indices.len() {
                            epoch += 1;
                            offset = 0;
                            sampler.set_epoch(epoch);
                            *indices = sampler.indices();
                        }
                        batch.push(indices[offset]);
                        offset += 1;
                    }
                    plan.push(batch);
                    after.push((epoch, offset));
                }
                (plan, after)
            }
            Planner::Budget(sampler) => {
                let per_epoch = sampler.batches_per_epoch(epoch);
                if offset >= per_epoch {
                    epoch += 1;
                    offset = 0;
                }
                let plan = sampler.batches(epoch, offset);
                let after = (1..=plan.len()).map(|k| (epoch, offset + k)).collect();
                (plan, after)
            }
        }
    }
}

/// The validation batches of a job, and the share of them one rank evaluates.
pub(crate) struct ValBatches {
    /// Batches in the job's list: the first `count` batches of `batch_size` validation
    /// sequences in the split's own order, the same whatever the world size or strategy.
    pub total: usize,
    /// This rank's share, each with its place in the list.
    pub mine: Vec<(usize, Batch)>,
}

/// Which of the job's `total` validation batches rank `rank` of `world` evaluates: every
/// `world`-th, from the `rank`-th.
pub(crate) fn val_share(total: usize, world: usize, rank: usize) -> Vec<usize> {
    (rank..total).step_by(world.max(1)).collect()
}

/// The samples of batch `k` of the job's validation list, for fixed-length data: the next
/// `batch_size` of the split's sequences, wrapping around it.
pub(crate) fn val_rows(k: usize, batch_size: usize, n: usize) -> impl Iterator<Item = usize> {
    (0..batch_size).map(move |row| (k * batch_size + row) % n)
}

/// The job's first `count` validation batches, and rank `rank` of `world`'s share of them:
/// the same batches at every evaluation and whatever the world size (so a world of one, of
/// two, and an elastic regroup report the same validation loss for the same model), shared
/// out among the ranks.
pub(crate) fn val_batches(
    data: &Arc<dyn Dataset>,
    cfg: &TrainConfig,
    world: usize,
    rank: usize,
    count: usize,
) -> Result<ValBatches, TrainError> {
    let samples = SplitSamples {
        data: data.clone(),
        split: Split::Val,
    };
    let n = samples.len();
    if n == 0 || count == 0 {
        return Ok(ValBatches {
            total: 0,
            mine: Vec::new(),
        });
    }
    let plan: Vec<Vec<usize>> = if data.variable_length() {
        // The whole split's plan, as one rank would make it, so that the list is the job's.
        let budget = budget(cfg, &**data, false);
        let mut plan = TokenBudgetSampler::new(&samples, budget, 1, 0)?.batches(0, 0);
        plan.truncate(count);
        plan
    } else {
        (0..count)
            .map(|k| val_rows(k, cfg.batch_size, n).collect())
            .collect()
    };
    let mine = val_share(plan.len(), world, rank)
        .into_iter()
        .map(|k| (k, collate_as(&samples, &plan[k], pack_width(cfg, &**data))))
        .collect();
    Ok(ValBatches {
        total: plan.len(),
        mine,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sample i of `lens[i]` tokens, token p of it = (i * 7 + p) % 50.
    struct Docs {
        lens: Vec<usize>,
        seq_len: usize,
    }

    impl Dataset for Docs {
        fn len(&self, _split: Split) -> usize {
            self.lens.len()
        }
        fn seq_len(&self) -> usize {
            self.seq_len
        }
        fn vocab_size(&self) -> usize {
            50
        }
        fn read(&self, _split: Split, index: usize, tokens: &mut [u32]) {
            for (p, t) in tokens.iter_mut().enumerate() {
                *t = ((index * 7 + p) % 50) as u32;
            }
        }
        fn sample_len(&self, _split: Split, index: usize) -> usize {
            self.lens[index]
        }
        fn variable_length(&self) -> bool {
            self.lens.iter().any(|&l| l != self.seq_len + 1)
        }
        fn loss_floor(&self) -> Option<f64> {
            None
        }
        fn describe(&self) -> String {
            "docs".into()
        }
    }

    fn cfg(workers: usize) -> TrainConfig {
        TrainConfig {
            batch_size: 4,
            sort_size: 8,
            loader_workers: workers,
            ..TrainConfig::default()
        }
    }

    fn take(b: &mut TrainBatches, n: usize) -> Vec<Vec<usize>> {
        (0..n).map(|_| b.next_batch().indices).collect()
    }

    /// Taking k batches, then resuming from the recorded position, gives the same stream as
    /// never stopping, across epoch boundaries, for fixed and variable lengths.
    #[test]
    fn a_resumed_stream_continues_exactly_where_it_stopped() {
        let fixed: Arc<dyn Dataset> = Arc::new(Docs {
            lens: vec![17; 37],
            seq_len: 16,
        });
        let docs: Arc<dyn Dataset> = Arc::new(Docs {
            lens: (0..101).map(|i| 1 + (i * 5) % 16).collect(),
            seq_len: 16,
        });
        for data in [fixed, docs] {
            for (world, rank) in [(1, 0), (3, 2)] {
                let mut whole =
                    TrainBatches::new(data.clone(), &cfg(2), world, rank, 0, 0).unwrap();
                let all = take(&mut whole, 300);
                let mut first =
                    TrainBatches::new(data.clone(), &cfg(0), world, rank, 0, 0).unwrap();
                let head = take(&mut first, 123);
                let (epoch, offset) = first.position();
                assert!(epoch > 0, "the test crosses an epoch");
                let mut rest =
                    TrainBatches::new(data.clone(), &cfg(1), world, rank, epoch, offset).unwrap();
                let tail = take(&mut rest, 177);
                assert_eq!([head, tail].concat(), all, "world {world} rank {rank}");
            }
        }
    }

    /// Packed documents (`--pack`): the same stream across a resume, batch for batch (ids,
    /// targets and segment ids), for one rank of several; each batch's rows are packed.
    #[test]
    fn a_resumed_packed_stream_continues_exactly_where_it_stopped() {
        let docs: Arc<dyn Dataset> = Arc::new(Docs {
            lens: (0..101).map(|i| 2 + (i * 5) % 9).collect(),
            seq_len: 16,
        });
        let packed = |workers| TrainConfig {
            pack: true,
            ..cfg(workers)
        };
        for (world, rank) in [(1, 0), (3, 2)] {
            let mut whole = TrainBatches::new(docs.clone(), &packed(2), world, rank, 0, 0).unwrap();
            let all: Vec<Batch> = (0..150).map(|_| whole.next_batch()).collect();
            let mut first = TrainBatches::new(docs.clone(), &packed(0), world, rank, 0, 0).unwrap();
            let head: Vec<Batch> = (0..61).map(|_| first.next_batch()).collect();
            let (epoch, offset) = first.position();
            assert!(epoch > 0, "the test crosses an epoch");
            let mut rest =
                TrainBatches::new(docs.clone(), &packed(1), world, rank, epoch, offset).unwrap();
            let tail: Vec<Batch> = (0..89).map(|_| rest.next_batch()).collect();
            assert_eq!([head, tail].concat(), all, "world {world} rank {rank}");
            assert!(all.iter().all(|b| b.seq == 16 && b.segments.is_some()));
            let rows: usize = all.iter().map(|b| b.batch).sum();
            let samples: usize = all.iter().map(|b| b.indices.len()).sum();
            assert!(2 * rows < samples, "{rows} rows for {samples} samples");
        }
    }

    /// Documents: every batch is within the token budget (padding included), right-padded with
    /// mask 0 and target -100, and an epoch of all ranks covers every document.
    #[test]
    fn documents_are_batched_by_token_budget_and_padded() {
        let lens: Vec<usize> = (0..200).map(|i| 1 + (i * 11) % 16).collect();
        let data: Arc<dyn Dataset> = Arc::new(Docs {
            lens: lens.clone(),
            seq_len: 16,
        });
        let mut seen = vec![0usize; lens.len()];
        for rank in 0..2 {
            let mut batches = TrainBatches::new(data.clone(), &cfg(1), 2, rank, 0, 0).unwrap();
            while batches.position().0 == 0 {
                let b = batches.next_batch();
                // The budget counts tokens: 4 full samples of 17.
                assert!(b.batch * b.seq <= 4 * 17, "{} x {}", b.batch, b.seq);
                for (row, &i) in b.indices.iter().enumerate() {
                    seen[i] += 1;
                    let r = row * b.seq..(row + 1) * b.seq;
                    let real = b.attention_mask[r.clone()]
                        .iter()
                        .filter(|&&m| m == 1)
                        .count();
                    // n tokens train n - 1 positions.
                    assert_eq!(real, lens[i] - 1);
                    assert!(b.targets[r][lens[i] - 1..].iter().all(|&l| l == -100));
                }
            }
        }
        assert!(seen.iter().all(|&n| n >= 1), "every document trained on");
        let val = val_batches(&data, &cfg(0), 2, 1, 3).unwrap();
        assert_eq!((val.total, val.mine.len()), (3, 1));
    }

    /// However many ranks share them out, the validation batches are one list: the ranks'
    /// shares put together are a world of one's batches, each once, for fixed and variable
    /// lengths, with fewer batches than ranks too.
    #[test]
    fn the_ranks_share_out_one_list_of_validation_batches() {
        let fixed: Arc<dyn Dataset> = Arc::new(Docs {
            lens: vec![17; 37],
            seq_len: 16,
        });
        let docs: Arc<dyn Dataset> = Arc::new(Docs {
            lens: (0..101).map(|i| 1 + (i * 5) % 16).collect(),
            seq_len: 16,
        });
        for data in [fixed, docs] {
            for count in [1, 5, 12] {
                let one = val_batches(&data, &cfg(0), 1, 0, count).unwrap();
                assert_eq!(one.total, count);
                let list: Vec<Vec<usize>> =
                    one.mine.iter().map(|(_, b)| b.indices.clone()).collect();
                for world in [2, 3, 7] {
                    let mut shared = vec![None; count];
                    for rank in 0..world {
                        let share = val_batches(&data, &cfg(0), world, rank, count).unwrap();
                        assert_eq!(share.total, count);
                        for (k, batch) in share.mine {
                            assert!(shared[k].is_none(), "batch {k} evaluated twice");
                            shared[k] = Some(batch.indices);
                        }
                    }
                    let shared: Vec<Vec<usize>> = shared.into_iter().map(Option::unwrap).collect();
                    assert_eq!(shared, list, "world {world}, {count} batches");
                }
            }
        }
    }
}

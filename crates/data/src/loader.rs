//! [`DataLoader`]: worker threads collate batches ahead of the training loop.
//!
//! The plan (a list of batches of sample indices, from a sampler) is fixed before the first
//! batch, and batch k is a pure function of plan[k]; workers take the next batch number from a
//! shared counter, at most `prefetch` ahead of the consumer, and the consumer receives batches
//! strictly in plan order. So the batches are identical whatever the number of workers (0 builds
//! them on the calling thread). Dropping the loader stops and joins the workers; it never leaves
//! a thread running or blocks forever.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::dataset::Samples;
use crate::pack::collate_packed;

/// Label of positions the loss ignores (padding), as Hugging Face's -100.
pub const IGNORE_INDEX: i32 = -100;

/// A padded batch in the model's layout: (batch, seq) row-major. A sample of n tokens is a row
/// of n - 1 inputs and their n - 1 next-token targets.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Token ids, 0 at padding.
    pub input_ids: Vec<u32>,
    /// 1 for a token, 0 for padding.
    pub attention_mask: Vec<u8>,
    /// Per position, the token it must predict (the sample shifted by one, as nanoGPT's `y`;
    /// the model's `Labels::Next`), -100 at padding and where the sample's loss mask ignores
    /// the token (a conversation's user and system turns).
    pub targets: Vec<i32>,
    /// Rows.
    pub batch: usize,
    /// Columns: positions of the longest sample of the batch (its tokens less one), or the
    /// packing width ([`collate_packed`]).
    pub seq: usize,
    /// The sample indices of the rows (packed: of the batch, in plan order).
    pub indices: Vec<usize>,
    /// Packed rows ([`collate_packed`]): per position, its sequence's number within the row
    /// (the model's segment ids), the row's padding a segment of its own; None: one sample a
    /// row.
    pub segments: Option<Vec<u32>>,
}

/// Collates samples `indices` into a right-padded batch of inputs and next-token targets.
pub fn collate(samples: &dyn Samples, indices: &[usize]) -> Batch {
    let longest = indices
        .iter()
        .map(|&i| samples.sample_len(i))
        .max()
        .unwrap_or(0);
    // A one-token sample has no target; it still takes a (padding) row, never a zero-width batch.
    let seq = longest.saturating_sub(1).max(1);
    let mut batch = Batch::padding(indices.len(), seq, indices);
    let mut buf = SampleBuf::default();
    for (row, &i) in indices.iter().enumerate() {
        buf.place(samples, i, &mut batch, row * seq);
    }
    batch
}

impl Batch {
    /// `rows` rows of `seq` padding positions, for the samples `indices`.
    pub(crate) fn padding(rows: usize, seq: usize, indices: &[usize]) -> Batch {
        let n = rows * seq;
        Batch {
            input_ids: vec![0; n],
            attention_mask: vec![0; n],
            targets: vec![IGNORE_INDEX; n],
            batch: rows,
            seq,
            indices: indices.to_vec(),
            segments: None,
        }
    }
}

/// The buffers one sample is read through.
#[derive(Default)]
pub(crate) struct SampleBuf {
    tokens: Vec<u32>,
    mask: Vec<u8>,
}

impl SampleBuf {
    /// Writes sample `i`'s inputs and next-token targets (its tokens less one positions) into
    /// `batch` from flat position `at` on.
    pub(crate) fn place(&mut self, samples: &dyn Samples, i: usize, batch: &mut Batch, at: usize) {
        let len = samples.sample_len(i);
        let (tokens, mask) = (&mut self.tokens, &mut self.mask);
        tokens.resize(len, 0);
        samples.read(i, tokens);
        let positions = len.saturating_sub(1);
        let r = at..at + positions;
        batch.input_ids[r.clone()].copy_from_slice(&tokens[..positions]);
        batch.attention_mask[r.clone()].fill(1);
        mask.resize(len, 1);
        let masked = samples.read_loss_mask(i, mask);
        // Position p predicts token p + 1: it is scored only where that token is trained.
        for (p, (y, &x)) in batch.targets[r].iter_mut().zip(&tokens[1..]).enumerate() {
            if !masked || mask[p + 1] == 1 {
                *y = x as i32;
            }
        }
    }
}

/// Worker settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoaderConfig {
    /// Worker threads (0: collate on the caller's thread).
    pub workers: usize,
    /// Batches prepared ahead of the consumer (at least 1).
    pub prefetch: usize,
    /// Pack each batch's samples into rows of this many positions ([`collate_packed`]);
    /// None: one sample a row ([`collate`]).
    pub pack: Option<usize>,
}

/// Collates `indices` as `pack` says: packed into rows of that width, or one sample a row.
pub fn collate_as(samples: &dyn Samples, indices: &[usize], pack: Option<usize>) -> Batch {
    match pack {
        Some(width) => collate_packed(samples, indices, width),
        None => collate(samples, indices),
    }
}

impl Default for LoaderConfig {
    fn default() -> Self {
        LoaderConfig {
            workers: 2,
            prefetch: 4,
            pack: None,
        }
    }
}

struct State {
    /// Next batch number a worker will take.
    next: usize,
    /// Batches handed to the consumer.
    consumed: usize,
    ready: BTreeMap<usize, Batch>,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
}

/// An iterator over the batches of a plan, prepared by worker threads.
pub struct DataLoader {
    samples: Arc<dyn Samples>,
    plan: Arc<Vec<Vec<usize>>>,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Used when there are no workers.
    position: usize,
    pack: Option<usize>,
}

impl std::fmt::Debug for DataLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLoader")
            .field("batches", &self.plan.len())
            .field("workers", &self.workers.len())
            .finish()
    }
}

impl DataLoader {
    /// Starts the workers over `plan` (e.g. `TokenBudgetSampler::batches(epoch, start_step)`).
    pub fn new(samples: Arc<dyn Samples>, plan: Vec<Vec<usize>>, cfg: LoaderConfig) -> DataLoader {
        let plan = Arc::new(plan);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                next: 0,
                consumed: 0,
                ready: BTreeMap::new(),
                stop: false,
            }),
            cv: Condvar::new(),
        });
        let (prefetch, pack) = (cfg.prefetch.max(1), cfg.pack);
        let workers = (0..cfg.workers)
            .map(|_| {
                let (samples, plan, shared) = (samples.clone(), plan.clone(), shared.clone());
                std::thread::spawn(move || worker(&*samples, &plan, &shared, prefetch, pack))
            })
            .collect();
        DataLoader {
            samples,
            plan,
            shared,
            workers,
            position: 0,
            pack,
        }
    }

    /// Batches in the plan.
    pub fn len(&self) -> usize {
        self.plan.len()
    }

    /// Whether the plan is empty.
    pub fn is_empty(&self) -> bool {
        self.plan.is_empty()
    }
}

fn worker(
    samples: &dyn Samples,
    plan: &[Vec<usize>],
    shared: &Shared,
    prefetch: usize,
    pack: Option<usize>,
) {
    loop {
        let k = {
            let mut st = shared.state.lock().unwrap_or_else(|e| e.into_inner());
            while !st.stop && st.next < plan.len() && st.next >= st.consumed + prefetch {
                st = shared.cv.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            if st.stop || st.next >= plan.len() {
                return;
            }
            st.next += 1;
            st.next - 1
        };
        let batch = collate_as(samples, &plan[k], pack);
        let mut st = shared.state.lock().unwrap_or_else(|e| e.into_inner());
        st.ready.insert(k, batch);
        shared.cv.notify_all();
    }
}

impl Iterator for DataLoader {
    type Item = Batch;

    fn next(&mut self) -> Option<Batch> {
        if self.workers.is_empty() {
            let indices = self.plan.get(self.position)?;
            self.position += 1;
            return Some(collate_as(&*self.samples, indices, self.pack));
        }
        let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        let k = st.consumed;
        if k >= self.plan.len() {
            return None;
        }
        loop {
            if let Some(batch) = st.ready.remove(&k) {
                st.consumed += 1;
                self.shared.cv.notify_all();
                return Some(batch);
            }
            // A worker that panicked can no longer deliver; do not wait for it forever.
            if self.workers.iter().all(|w| w.is_finished()) && !st.ready.contains_key(&k) {
                panic!("data loader workers exited before batch {k} was ready");
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, std::time::Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for DataLoader {
    fn drop(&mut self) {
        self.shared
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stop = true;
        self.shared.cv.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::{BudgetConfig, TokenBudgetSampler};

    /// Sample i: length 1 + i % 13, tokens i*100 + position.
    struct Synthetic(usize);
    impl Samples for Synthetic {
        fn len(&self) -> usize {
            self.0
        }
        fn sample_len(&self, i: usize) -> usize {
            1 + i % 13
        }
        fn read(&self, i: usize, out: &mut [u32]) {
            for (p, o) in out.iter_mut().enumerate() {
                *o = (i * 100 + p) as u32;
            }
        }
    }

    fn plan(data: &Synthetic, epoch: u64, start: usize) -> Vec<Vec<usize>> {
        let cfg = BudgetConfig {
            batch_tokens: 48,
            sort_size: 32,
            seed: 9,
            ..BudgetConfig::default()
        };
        TokenBudgetSampler::new(data, cfg, 1, 0)
            .unwrap()
            .batches(epoch, start)
    }

    #[test]
    fn batches_are_identical_whatever_the_number_of_workers() {
        let data = Arc::new(Synthetic(400));
        let reference: Vec<Batch> = DataLoader::new(
            data.clone(),
            plan(&data, 1, 0),
            LoaderConfig {
                workers: 0,
                prefetch: 1,
                pack: None,
            },
        )
        .collect();
        assert!(reference.len() > 20);
        for (workers, prefetch) in [(1, 1), (2, 3), (4, 2), (7, 16)] {
            let got: Vec<Batch> = DataLoader::new(
                data.clone(),
                plan(&data, 1, 0),
                LoaderConfig {
                    workers,
                    prefetch,
                    pack: None,
                },
            )
            .collect();
            assert_eq!(got, reference, "workers {workers}, prefetch {prefetch}");
        }
        for b in &reference {
            for row in 0..b.batch {
                // A sample of n tokens is n - 1 inputs and the n - 1 tokens after them.
                let (i, positions) = (b.indices[row], data.sample_len(b.indices[row]) - 1);
                let cols = row * b.seq..(row + 1) * b.seq;
                let mask = &b.attention_mask[cols.clone()];
                assert_eq!(mask.iter().filter(|&&m| m == 1).count(), positions);
                for p in 0..positions {
                    assert_eq!(b.input_ids[cols.start + p], (i * 100 + p) as u32);
                    assert_eq!(b.targets[cols.start + p], (i * 100 + p + 1) as i32);
                }
                assert!(b.targets[cols.start + positions..cols.end]
                    .iter()
                    .all(|&l| l == IGNORE_INDEX));
            }
        }
    }

    #[test]
    fn resuming_mid_epoch_neither_repeats_nor_skips() {
        let data = Arc::new(Synthetic(300));
        let all: Vec<Vec<usize>> =
            DataLoader::new(data.clone(), plan(&data, 2, 0), LoaderConfig::default())
                .map(|b| b.indices)
                .collect();
        let first: Vec<Vec<usize>> =
            DataLoader::new(data.clone(), plan(&data, 2, 0), LoaderConfig::default())
                .take(5)
                .map(|b| b.indices)
                .collect();
        let rest: Vec<Vec<usize>> =
            DataLoader::new(data.clone(), plan(&data, 2, 5), LoaderConfig::default())
                .map(|b| b.indices)
                .collect();
        assert_eq!([first, rest].concat(), all);
        let mut seen: Vec<usize> = all.concat();
        seen.sort();
        assert_eq!(seen, (0..300).collect::<Vec<_>>());
    }

    #[test]
    fn dropping_early_stops_the_workers() {
        let data = Arc::new(Synthetic(1000));
        let mut loader = DataLoader::new(
            data.clone(),
            plan(&data, 0, 0),
            LoaderConfig {
                workers: 3,
                prefetch: 2,
                pack: None,
            },
        );
        assert!(loader.next().is_some());
        drop(loader);
    }
}

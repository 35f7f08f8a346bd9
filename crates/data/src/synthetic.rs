//! The two built-in [`Dataset`]s, made from a seed instead of files.
//!
//! - [`MarkovCorpus`] (the default): token sequences from a seeded random
//!   order-k Markov chain. Its entropy rate is computed exactly, so the
//!   lowest achievable loss is known and printed: a newcomer sees the model
//!   learn towards a number, not just a loss going down.
//! - [`RandomTokens`] (`--data random`): the toy data of PyTorch's DDP
//!   tutorials (a `ToyRandomDataset`), uniform random ids with labels = input_ids, for throughput runs (its
//!   floor is ln(vocab): nothing to learn).
//!
//! Samples are pure functions of (seed, split, index), so any rank can read
//! any sample and a resumed run reads exactly what an uninterrupted one
//! would. This module never touches the model or the process group.

use std::fmt;

use cohort_rng::SplitMix64 as Rng;

use crate::{DataError, Dataset, Split};

/// Seeds for sample streams: distinct, well-mixed per (seed, split, index).
fn stream_seed(seed: u64, split: Split, index: usize) -> u64 {
    let tag = match split {
        Split::Train => 0x7472_6169_6e00_0000,
        Split::Val => 0x7661_6c00_0000_0000,
    };
    let mut s = Rng(seed ^ tag);
    s.next_u64();
    s.0 ^= (index as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    s.next_u64()
}

/// Shape of the Markov chain behind [`MarkovCorpus`].
#[derive(Debug, Clone, PartialEq)]
pub struct MarkovSpec {
    /// Tokens in the alphabet.
    pub vocab_size: usize,
    /// How many previous tokens decide the next one.
    pub order: usize,
    /// Possible successors of each context (the rest have probability 0).
    pub branching: usize,
    /// Seed of the chain (its transition table) and of the sequences.
    pub seed: u64,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Training sequences.
    pub train_sequences: usize,
    /// Held-out sequences.
    pub val_sequences: usize,
}

/// Sequences from a random order-k Markov chain with a known entropy rate.
///
/// Each context (the last `order` tokens) has `branching` possible
/// successors with random probabilities (flat Dirichlet). Every sequence
/// starts from a context drawn from the chain's stationary distribution, so
/// every position is stationary and the expected loss of the best possible
/// model is exactly [`MarkovCorpus::loss_floor`].
pub struct MarkovCorpus {
    spec: MarkovSpec,
    /// Per context: successor tokens and their cumulative probabilities.
    successors: Vec<u32>,
    cumulative: Vec<f64>,
    /// Cumulative stationary distribution over contexts (for start states).
    start_cdf: Vec<f64>,
    entropy_rate: f64,
    floor: f64,
}

impl MarkovCorpus {
    /// Builds the chain, its stationary distribution and its entropy rate.
    pub fn new(spec: MarkovSpec) -> Result<Self, DataError> {
        let check = |what, value: usize, ok: bool, range| {
            if ok {
                Ok(())
            } else {
                Err(DataError::OutOfRange { what, value, range })
            }
        };
        check(
            "vocab_size",
            spec.vocab_size,
            (2..=65536).contains(&spec.vocab_size),
            "2..=65536",
        )?;
        check("order", spec.order, (1..=4).contains(&spec.order), "1..=4")?;
        let contexts = spec
            .vocab_size
            .checked_pow(spec.order as u32)
            .unwrap_or(usize::MAX);
        check(
            "vocab_size^order",
            contexts,
            contexts <= 1 << 20,
            "at most 2^20 contexts",
        )?;
        check(
            "branching",
            spec.branching,
            (1..=spec.vocab_size).contains(&spec.branching),
            "1..=vocab_size",
        )?;
        check(
            "seq_len",
            spec.seq_len,
            spec.seq_len > spec.order,
            "more than order",
        )?;
        check(
            "train_sequences",
            spec.train_sequences,
            spec.train_sequences > 0,
            "at least 1",
        )?;

        let (v, b) = (spec.vocab_size, spec.branching);
        let mut rng = Rng(spec.seed ^ 0x6d61_726b_6f76);
        let mut successors = Vec::with_capacity(contexts * b);
        let mut probs = Vec::with_capacity(contexts * b);
        let mut pool: Vec<u32> = (0..v as u32).collect();
        for _ in 0..contexts {
            // b distinct successors (partial Fisher-Yates), flat-Dirichlet weights.
            for i in 0..b {
                let j = i + rng.below(v - i);
                pool.swap(i, j);
            }
            let w: Vec<f64> = (0..b).map(|_| -(1.0 - rng.next_f64()).ln()).collect();
            let sum: f64 = w.iter().sum();
            successors.extend_from_slice(&pool[..b]);
            probs.extend(w.iter().map(|x| x / sum));
        }
        let pi = stationary(&successors, &probs, v, b, contexts);
        let row_entropy = |c: usize| -> f64 {
            probs[c * b..(c + 1) * b]
                .iter()
                .filter(|&&p| p > 0.0)
                .map(|p| -p * p.ln())
                .sum()
        };
        let entropy_rate: f64 = (0..contexts).map(|c| pi[c] * row_entropy(c)).sum();

        // Position t predicts token t+1 from tokens 0..=t. With fewer than
        // `order` tokens seen, the best prediction conditions on what is
        // known: H(X_{t+1} | X_0..X_t) from the marginals of the stationary
        // context distribution. From t = order-1 on it is the entropy rate.
        let marginal_entropy = |n: usize| -> f64 {
            // Entropy of the first n tokens of a stationary context.
            let groups = v.pow(n as u32);
            let per = contexts / groups;
            (0..groups)
                .map(|g| pi[g * per..(g + 1) * per].iter().sum::<f64>())
                .filter(|&p| p > 0.0)
                .map(|p| -p * p.ln())
                .sum()
        };
        // Every position of a sequence is trained (a sequence holds seq_len + 1 tokens).
        let positions = spec.seq_len;
        let floor = (0..positions)
            .map(|t| {
                if t + 1 < spec.order {
                    marginal_entropy(t + 2) - marginal_entropy(t + 1)
                } else {
                    entropy_rate
                }
            })
            .sum::<f64>()
            / positions as f64;

        let mut cumulative = probs;
        for row in cumulative.chunks_mut(b) {
            let mut acc = 0.0;
            for p in row.iter_mut() {
                acc += *p;
                *p = acc;
            }
        }
        let mut acc = 0.0;
        let start_cdf = pi
            .iter()
            .map(|p| {
                acc += p;
                acc
            })
            .collect();
        Ok(Self {
            spec,
            successors,
            cumulative,
            start_cdf,
            entropy_rate,
            floor,
        })
    }

    /// Entropy rate of the chain in nats per token (the loss of a perfect
    /// model once it has seen `order` tokens).
    pub fn entropy_rate(&self) -> f64 {
        self.entropy_rate
    }

    /// The chain's parameters.
    pub fn spec(&self) -> &MarkovSpec {
        &self.spec
    }
}

/// Stationary distribution over contexts, by power iteration on the lazy
/// chain (P + I) / 2, which converges for every finite chain, periodic or not.
fn stationary(successors: &[u32], probs: &[f64], v: usize, b: usize, contexts: usize) -> Vec<f64> {
    let mut pi = vec![1.0 / contexts as f64; contexts];
    let mut next = vec![0.0; contexts];
    for _ in 0..20_000 {
        next.iter_mut().zip(&pi).for_each(|(n, p)| *n = 0.5 * p);
        for c in 0..contexts {
            let shifted = (c * v) % contexts;
            for k in 0..b {
                next[shifted + successors[c * b + k] as usize] += 0.5 * pi[c] * probs[c * b + k];
            }
        }
        let change: f64 = next.iter().zip(&pi).map(|(a, b)| (a - b).abs()).sum();
        std::mem::swap(&mut pi, &mut next);
        if change < 1e-13 {
            break;
        }
    }
    let sum: f64 = pi.iter().sum();
    pi.iter_mut().for_each(|p| *p /= sum);
    pi
}

impl Dataset for MarkovCorpus {
    fn len(&self, split: Split) -> usize {
        match split {
            Split::Train => self.spec.train_sequences,
            Split::Val => self.spec.val_sequences,
        }
    }

    fn seq_len(&self) -> usize {
        self.spec.seq_len
    }

    fn vocab_size(&self) -> usize {
        self.spec.vocab_size
    }

    fn read(&self, split: Split, index: usize, tokens: &mut [u32]) {
        let (v, b, k) = (self.spec.vocab_size, self.spec.branching, self.spec.order);
        let contexts = self.start_cdf.len();
        let mut rng = Rng(stream_seed(self.spec.seed, split, index));
        let u = rng.next_f64() * self.start_cdf[contexts - 1];
        let mut ctx = self
            .start_cdf
            .partition_point(|&c| c <= u)
            .min(contexts - 1);
        // Spell out the start context, most significant token first.
        for (i, tok) in tokens[..k].iter_mut().enumerate() {
            *tok = ((ctx / v.pow((k - 1 - i) as u32)) % v) as u32;
        }
        for t in tokens.iter_mut().skip(k) {
            let row = &self.cumulative[ctx * b..(ctx + 1) * b];
            let u = rng.next_f64() * row[b - 1];
            let j = row.partition_point(|&c| c <= u).min(b - 1);
            let tok = self.successors[ctx * b + j];
            *t = tok;
            ctx = (ctx * v) % contexts + tok as usize;
        }
    }

    fn loss_floor(&self) -> Option<f64> {
        Some(self.floor)
    }

    fn describe(&self) -> String {
        let s = &self.spec;
        format!(
            "markov corpus: vocab {}, order {}, {} successors per context, seed {}, \
             {} train / {} val sequences of {} positions; entropy rate {:.4} nats/token, \
             loss floor {:.4} (ln(vocab) = {:.4})",
            s.vocab_size,
            s.order,
            s.branching,
            s.seed,
            s.train_sequences,
            s.val_sequences,
            s.seq_len,
            self.entropy_rate,
            self.floor,
            (s.vocab_size as f64).ln()
        )
    }
}

impl fmt::Debug for MarkovCorpus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MarkovCorpus")
            .field("spec", &self.spec)
            .field("entropy_rate", &self.entropy_rate)
            .finish_non_exhaustive()
    }
}

/// Seed 000's `ToyRandomDataset`: uniform random token ids, labels = ids.
#[derive(Debug, Clone)]
pub struct RandomTokens {
    /// Tokens in the alphabet.
    pub vocab_size: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Training sequences (PyTorch's DDP example uses 1000).
    pub num_samples: usize,
    /// Held-out sequences.
    pub val_samples: usize,
    /// Seed of the token stream.
    pub seed: u64,
}

impl Dataset for RandomTokens {
    fn len(&self, split: Split) -> usize {
        match split {
            Split::Train => self.num_samples,
            Split::Val => self.val_samples,
        }
    }

    fn seq_len(&self) -> usize {
        self.seq_len
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn read(&self, split: Split, index: usize, tokens: &mut [u32]) {
        let mut rng = Rng(stream_seed(self.seed, split, index));
        for t in tokens.iter_mut() {
            *t = rng.below(self.vocab_size) as u32;
        }
    }

    fn loss_floor(&self) -> Option<f64> {
        Some((self.vocab_size as f64).ln())
    }

    fn describe(&self) -> String {
        format!(
            "random tokens (a ToyRandomDataset, as in PyTorch's DDP examples): vocab {}, {} train / {} val \
             sequences of {} positions; nothing to learn, loss floor ln(vocab) = {:.4}",
            self.vocab_size,
            self.num_samples,
            self.val_samples,
            self.seq_len,
            (self.vocab_size as f64).ln()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(order: usize) -> MarkovSpec {
        MarkovSpec {
            vocab_size: 8,
            order,
            branching: 3,
            seed: 5,
            seq_len: 32,
            train_sequences: 100,
            val_sequences: 10,
        }
    }

    /// Empirical conditional entropy of the generated text must match the
    /// computed entropy rate: checks the chain, the stationary distribution
    /// and the sampler together.
    #[test]
    fn sampled_text_has_the_computed_entropy_rate() {
        for order in [1, 2] {
            let mut s = spec(order);
            s.train_sequences = 4000;
            let c = MarkovCorpus::new(s.clone()).unwrap();
            let contexts = 8usize.pow(order as u32);
            let mut counts = vec![0u64; contexts * 8];
            let mut tokens = vec![0u32; s.seq_len];
            for i in 0..s.train_sequences {
                c.read(Split::Train, i, &mut tokens);
                for w in tokens.windows(order + 1) {
                    let ctx = w[..order].iter().fold(0, |a, &t| a * 8 + t as usize);
                    counts[ctx * 8 + w[order] as usize] += 1;
                }
            }
            let total: u64 = counts.iter().sum();
            let mut h = 0.0;
            for row in counts.chunks(8) {
                let n: u64 = row.iter().sum();
                for &k in row.iter().filter(|&&k| k > 0) {
                    let p = k as f64 / n as f64;
                    h -= (k as f64 / total as f64) * p.ln();
                }
            }
            let rate = c.entropy_rate();
            assert!(
                (h - rate).abs() < 0.02,
                "order {order}: empirical {h} vs computed {rate}"
            );
            assert!(rate < (3f64).ln() + 1e-9 && rate > 0.0);
        }
    }

    #[test]
    fn floor_accounts_for_the_first_positions() {
        let c1 = MarkovCorpus::new(spec(1)).unwrap();
        assert!((c1.loss_floor().unwrap() - c1.entropy_rate()).abs() < 1e-12);
        let c2 = MarkovCorpus::new(spec(2)).unwrap();
        // Position 0 sees one token only, so it is harder than the rate.
        assert!(c2.loss_floor().unwrap() > c2.entropy_rate());
        assert!(c2.loss_floor().unwrap() < (8f64).ln());
    }

    #[test]
    fn samples_are_deterministic_and_splits_differ() {
        let c = MarkovCorpus::new(spec(2)).unwrap();
        let (mut a, mut b, mut v) = (vec![0; 32], vec![0; 32], vec![0; 32]);
        c.read(Split::Train, 7, &mut a);
        c.read(Split::Train, 7, &mut b);
        c.read(Split::Val, 7, &mut v);
        assert_eq!(a, b);
        assert_ne!(a, v);
        assert!(a.iter().all(|&t| t < 8));
        let r = RandomTokens {
            vocab_size: 65,
            seq_len: 16,
            num_samples: 10,
            val_samples: 2,
            seed: 1,
        };
        r.read(Split::Train, 3, &mut a[..16]);
        r.read(Split::Train, 3, &mut b[..16]);
        assert_eq!(a[..16], b[..16]);
        assert!(a[..16].iter().all(|&t| t < 65));
    }

    #[test]
    fn bad_spec_is_an_error() {
        let mut s = spec(2);
        s.branching = 9;
        assert!(matches!(
            MarkovCorpus::new(s),
            Err(DataError::OutOfRange {
                what: "branching",
                ..
            })
        ));
        let mut s = spec(2);
        s.seq_len = 2;
        assert!(MarkovCorpus::new(s).is_err());
    }
}

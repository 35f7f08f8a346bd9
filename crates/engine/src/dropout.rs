//! Counter-based dropout masks: whether element `i` of a site is kept is a pure function of
//! (seed, rank, step, site, i), so masks never need storing (backward recomputes them) and do
//! not depend on how work is split across threads.
//!
//! This module never keeps state and never draws from a sequential RNG.

use cohort_rng::{mix64, GOLDEN_GAMMA};

/// One dropout site in one step: the probability and the key all its decisions hash from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dropout {
    /// Probability of zeroing an element, in (0, 1).
    pub p: f32,
    /// Key for this (seed, rank, step, site), from [`Dropout::key`].
    pub key: u64,
}

impl Dropout {
    /// The key of `site` (a small integer the model assigns to each dropout location) at
    /// `step` on `rank` for a run seeded with `seed`.
    pub fn key(seed: u64, rank: u64, step: u64, site: u64) -> u64 {
        let mut k = mix64(seed ^ 0x243f_6a88_85a3_08d3);
        for word in [rank, step, site] {
            k = mix64(k ^ word.wrapping_mul(GOLDEN_GAMMA));
        }
        k
    }

    /// Whether element `i` survives.
    #[inline(always)]
    pub fn keep(&self, i: u64) -> bool {
        let h = mix64(self.key.wrapping_add(i.wrapping_mul(GOLDEN_GAMMA)));
        // 24 bits are exact in f32, so the threshold compare is exact too.
        ((h >> 40) as f32) >= self.p * (1u32 << 24) as f32
    }

    /// The factor kept elements are multiplied by, 1 / (1 - p).
    #[inline(always)]
    pub fn scale(&self) -> f32 {
        1.0 / (1.0 - self.p)
    }

    /// `x[i] = keep(offset + i) ? x[i] * scale : 0`.
    pub fn apply(&self, x: &mut [f32], offset: u64) {
        let scale = self.scale();
        for (i, v) in x.iter_mut().enumerate() {
            *v = if self.keep(offset + i as u64) {
                *v * scale
            } else {
                0.0
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_rate_matches_p_and_keys_differ() {
        let d = Dropout {
            p: 0.1,
            key: Dropout::key(1, 0, 7, 3),
        };
        let n = 200_000;
        let kept = (0..n).filter(|&i| d.keep(i)).count() as f64 / n as f64;
        assert!((kept - 0.9).abs() < 0.005, "kept {kept}");
        let keys = [
            Dropout::key(1, 0, 7, 3),
            Dropout::key(2, 0, 7, 3),
            Dropout::key(1, 1, 7, 3),
            Dropout::key(1, 0, 8, 3),
            Dropout::key(1, 0, 7, 4),
        ];
        for i in 0..keys.len() {
            for j in 0..i {
                assert_ne!(keys[i], keys[j]);
            }
        }
        let e = Dropout {
            p: 0.1,
            key: keys[1],
        };
        let same = (0..10_000).filter(|&i| d.keep(i) == e.keep(i)).count();
        assert!(
            same < 9_000,
            "masks of different seeds agree on {same} of 10000"
        );
    }
}

//! cohort's one random generator and hash: SplitMix64 (Steele, Lea and Flood,
//! 2014) and its 64-bit finalizer.
//!
//! Everything in cohort that draws a number — parameter init, dropout masks,
//! data order, samplers, sampling of tokens, AdamW's test streams, nonces of
//! test peers — draws it here, so that a seed means the same stream on every
//! platform, rank and crate, and a resumed run reproduces an unbroken one
//! bit for bit. The generator is tiny and fast; it is not cryptographic and
//! must never be used for secrets (the job secret comes from the OS).
//!
//! Counter-based use needs no state: [`mix64`] of a key and an index is a
//! well-mixed draw, which is how dropout masks and per-element init are made
//! identical whichever thread computes them.
//!
//! This crate has no dependencies and must never gain any.
//!
//! ```
//! use cohort_rng::SplitMix64;
//!
//! let mut rng = SplitMix64::new(42);
//! let x = rng.next_u64();
//! let mut again = SplitMix64::new(42);
//! assert_eq!(again.next_u64(), x);
//! assert!(rng.below(10) < 10);
//! ```
#![deny(missing_docs)]

/// The increment of SplitMix64's counter: 2^64 / φ, odd, so the counter
/// visits every 64-bit value. Also a good multiplier for spreading small
/// integers (ranks, steps, indices) over 64 bits before [`mix64`].
pub const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's finalizer: a bijective 64-bit mix with full avalanche (each
/// input bit flips each output bit with probability about 1/2).
#[inline(always)]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// SplitMix64: a 64-bit counter advanced by [`GOLDEN_GAMMA`] and passed
/// through [`mix64`]. The state is public so that a stream can be forked
/// or keyed by mixing a value into it, the way samplers derive one stream
/// per epoch or index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The stream of `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN_GAMMA);
        mix64(self.0)
    }

    /// Uniform in [0, 1), with 53 random bits.
    #[inline]
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in (0, 1): the middle of each of the 2^53 cells, never 0, so
    /// `ln` of it is finite (Box-Muller).
    #[inline]
    pub fn next_f64_open(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// In `0..n` (n > 0) by Lemire's multiply-shift, without rejection: one
    /// draw per call, biased by at most n / 2^64, which no sampler of cohort
    /// can see. Use [`below_unbiased`](Self::below_unbiased) where exact
    /// uniformity is part of the contract.
    #[inline]
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Exactly uniform in `0..n` (n > 0): Lemire's multiply-shift with
    /// rejection, so a draw may consume more than one number.
    pub fn below_unbiased(&mut self, n: u64) -> u64 {
        loop {
            let m = (self.next_u64() as u128) * (n as u128);
            let low = m as u64;
            if low >= n.wrapping_neg() % n {
                return (m >> 64) as u64;
            }
        }
    }

    /// Skips `draws` numbers in O(1), as if [`next_u64`](Self::next_u64)
    /// had been called that many times: the counter is all the state.
    #[inline]
    pub fn skip(&mut self, draws: u64) {
        self.0 = self.0.wrapping_add(GOLDEN_GAMMA.wrapping_mul(draws));
    }

    /// Fisher-Yates shuffle with [`below`](Self::below).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_published_splitmix64_stream() {
        // The reference implementation's first outputs for seed 0 and for
        // seed 1234567 (Vigna's splitmix64.c).
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(rng.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(rng.next_u64(), 0x06C4_5D18_8009_454F);
        let mut rng = SplitMix64::new(1234567);
        assert_eq!(rng.next_u64(), 6457827717110365317);
        assert_eq!(rng.next_u64(), 3203168211198807973);
    }

    #[test]
    fn skip_is_the_same_as_drawing() {
        let mut a = SplitMix64::new(7);
        let mut b = a.clone();
        for _ in 0..1000 {
            a.next_u64();
        }
        b.skip(1000);
        assert_eq!(a.next_u64(), b.next_u64());
    }

    #[test]
    fn ranges_hold() {
        let mut rng = SplitMix64::new(3);
        for n in [1usize, 2, 3, 10, 1000] {
            for _ in 0..1000 {
                assert!(rng.below(n) < n);
                assert!(rng.below_unbiased(n as u64) < n as u64);
            }
        }
        for _ in 0..10_000 {
            let u = rng.next_f64();
            assert!((0.0..1.0).contains(&u));
            let o = rng.next_f64_open();
            assert!(o > 0.0 && o < 1.0);
        }
        let mut v: Vec<u32> = (0..100).collect();
        rng.shuffle(&mut v);
        let mut sorted = v.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_ne!(v, sorted);
    }

    #[test]
    fn mix64_is_the_generator_s_finalizer() {
        let mut rng = SplitMix64::new(99);
        assert_eq!(rng.next_u64(), mix64(99u64.wrapping_add(GOLDEN_GAMMA)));
        assert_eq!(mix64(0), 0);
    }
}

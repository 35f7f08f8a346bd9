//! Turning logits into a token as nanoGPT's `sample.py` does: temperature, top-k (ties with
//! the k-th kept), a seeded draw; and the window a prediction conditions on.
//!
//! These functions only read logits and advance the random generator they are given; they never
//! run the model.

use cohort_rng::SplitMix64;

use super::SampleOptions;
use crate::GPTConfig;

/// Index of the largest logit (the first one on ties).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best
}

/// One token from `logits` as nanoGPT samples it: divide by the temperature, keep the top k
/// (and anything tied with the k-th), softmax, draw. Temperature 0 is argmax.
pub(super) fn sample_token(
    logits: &[f32],
    opts: &SampleOptions,
    rng: &mut SplitMix64,
    scratch: &mut Vec<f32>,
) -> u32 {
    if opts.temperature == 0.0 {
        return argmax(logits) as u32;
    }
    let threshold = match opts.top_k {
        Some(k) if k < logits.len() => {
            scratch.clear();
            scratch.extend_from_slice(logits);
            let (_, kth, _) = scratch.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
            *kth
        }
        _ => f32::NEG_INFINITY,
    };
    let t = f64::from(opts.temperature);
    let max = f64::from(logits[argmax(logits)]);
    let weight = |x: f32| {
        if x >= threshold {
            ((f64::from(x) - max) / t).exp()
        } else {
            0.0
        }
    };
    let total: f64 = logits.iter().map(|&x| weight(x)).sum();
    let mut u = rng.next_f64() * total;
    let mut last = 0;
    for (i, &x) in logits.iter().enumerate() {
        let w = weight(x);
        if w > 0.0 {
            last = i;
            if u < w {
                return i as u32;
            }
            u -= w;
        }
    }
    // rounding left u just past the end: the last token with weight
    last as u32
}

/// How many tokens `generate` conditions on: all of `max_position_embeddings` (see the module
/// doc).
pub fn context_window(cfg: &GPTConfig) -> usize {
    cfg.max_position_embeddings.max(1)
}

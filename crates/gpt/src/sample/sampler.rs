//! Turning logits into a token as nanoGPT's `sample.py` does: temperature, top-k (ties with
//! the k-th kept), then top-p (nucleus, as `transformers`' `TopPLogitsWarper`), a seeded draw;
//! and the window a prediction conditions on.
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
    let unnormalised = |x: f32| ((f64::from(x) - max) / t).exp();
    let threshold = if opts.top_p < 1.0 {
        // The nucleus: the most likely of the tokens top-k kept, until their probabilities
        // reach top_p; its least likely logit is the new threshold (ties with it kept).
        scratch.clear();
        scratch.extend(logits.iter().copied().filter(|&x| x >= threshold));
        scratch.sort_unstable_by(|a, b| b.total_cmp(a));
        let total: f64 = scratch.iter().map(|&x| unnormalised(x)).sum();
        let (mut sum, mut cut) = (0.0, scratch[0]);
        for &x in scratch.iter() {
            cut = x;
            sum += unnormalised(x);
            if sum >= f64::from(opts.top_p) * total {
                break;
            }
        }
        cut
    } else {
        threshold
    };
    let weight = |x: f32| {
        if x >= threshold {
            unnormalised(x)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Draws from probabilities .5, .3, .15, .05 with `top_p`: how often each token came.
    fn counts(top_p: f32, top_k: Option<usize>) -> [usize; 4] {
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let opts = SampleOptions {
            max_new_tokens: 1,
            temperature: 1.0,
            top_k,
            top_p,
            seed: 0,
        };
        let (mut rng, mut scratch, mut seen) = (SplitMix64::new(7), Vec::new(), [0; 4]);
        for _ in 0..4000 {
            seen[sample_token(&logits, &opts, &mut rng, &mut scratch) as usize] += 1;
        }
        seen
    }

    #[test]
    fn top_p_keeps_the_nucleus_and_renormalises_it() {
        // .5 + .3 reaches .75: the nucleus is the first two, drawn 5:3.
        let seen = counts(0.75, None);
        assert_eq!((seen[2], seen[3]), (0, 0), "{seen:?}");
        let share = seen[0] as f64 / 4000.0;
        assert!((share - 0.625).abs() < 0.03, "{seen:?}");
        // 0 keeps only the most likely; 1 keeps all.
        assert_eq!(counts(0.0, None), [4000, 0, 0, 0]);
        assert!(counts(1.0, None).iter().all(|&n| n > 0));
        // After top-k = 3 the third is 15/95 of what is left: .5/.95 + .3/.95 < .9, so it stays.
        let seen = counts(0.9, Some(3));
        assert!(seen[2] > 0 && seen[3] == 0, "{seen:?}");
    }
}

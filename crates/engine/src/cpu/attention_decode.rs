//! Attention of one new query row over a sequence's cached keys and values: the inner loop of
//! generating with a KV cache, where each sequence of a batched decode step attends over its
//! own cache (so rows cannot share one matrix product as a training step's do).
//!
//! It is bound by reading the cache (a row at position p reads 2·p·C floats per layer), so it
//! is written for bandwidth: each key and value row is read once, contiguously, by 16-lane
//! loops that `simd_fn!` compiles for AVX-512. Softmax uses the engine's `exp`, not libm's,
//! which keeps it vectorized and gives the same bits on every code path. It never allocates
//! and never writes the cache.

use super::math::{dot, exp, max};
use super::simd_fn;

simd_fn! {
    /// `out` (C) = softmax(q·kᵀ · scale) · v for each of `nh` heads of size `hs` (C = nh·hs),
    /// over the first `ctx` rows of `k` and `v` (row stride `c`). `scores` needs `nh·ctx`
    /// floats. Keys and values are walked position by position, all heads at once, so each
    /// cached row is one contiguous read (the prefetcher's best case), not `nh` strided ones.
    pub fn attention_decode_row(out: &mut [f32], scores: &mut [f32], q: &[f32], k: &[f32], v: &[f32], ctx: usize, nh: usize, hs: usize, c: usize, scale: f32) {
        let w = nh * hs;
        let cache = ctx.saturating_sub(1) * c + w;
        assert!(
            q.len() >= w && out.len() >= w && scores.len() >= nh * ctx
                && k.len() >= cache && v.len() >= cache,
            "attention_decode_row: buffers too short for {ctx} positions of {nh} x {hs}"
        );
        let scores = &mut scores[..nh * ctx];
        for j in 0..ctx {
            let kj = &k[j * c..j * c + w];
            for h in 0..nh {
                scores[h * ctx + j] = dot(&q[h * hs..(h + 1) * hs], &kj[h * hs..(h + 1) * hs]) * scale;
            }
        }
        for s in scores.chunks_exact_mut(ctx) {
            let m = max(s);
            let mut sum = 0.0f32;
            for x in s.iter_mut() {
                *x = exp(*x - m);
                sum += *x;
            }
            let inv = 1.0 / sum;
            for x in s.iter_mut() {
                *x *= inv;
            }
        }
        let out = &mut out[..w];
        out.fill(0.0);
        for j in 0..ctx {
            let vj = &v[j * c..j * c + w];
            for h in 0..nh {
                let p = scores[h * ctx + j];
                for (o, &x) in out[h * hs..(h + 1) * hs].iter_mut().zip(&vj[h * hs..(h + 1) * hs]) {
                    *o += p * x;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_softmax_attention_in_f64() {
        let (nh, hs, ctx) = (3usize, 24usize, 37usize);
        let c = nh * hs;
        let val = |i: usize, m: usize| ((i * m % 101) as f32 - 50.0) * 0.02;
        let q: Vec<f32> = (0..c).map(|i| val(i, 7)).collect();
        let k: Vec<f32> = (0..ctx * c).map(|i| val(i, 13)).collect();
        let v: Vec<f32> = (0..ctx * c).map(|i| val(i, 29)).collect();
        let scale = 1.0 / (hs as f32).sqrt();
        let (mut out, mut scores) = (vec![f32::NAN; c], vec![0.0; nh * ctx]);
        attention_decode_row(&mut out, &mut scores, &q, &k, &v, ctx, nh, hs, c, scale);
        for h in 0..nh {
            let s: Vec<f64> = (0..ctx)
                .map(|j| {
                    (0..hs)
                        .map(|d| q[h * hs + d] as f64 * k[j * c + h * hs + d] as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hs {
                let want: f64 = (0..ctx)
                    .map(|j| e[j] / z * v[j * c + h * hs + d] as f64)
                    .sum();
                let got = out[h * hs + d] as f64;
                assert!(
                    (got - want).abs() < 1e-5,
                    "head {h} dim {d}: {got} vs {want}"
                );
            }
        }
    }
}

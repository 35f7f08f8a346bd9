//! Fused softmax + cross-entropy over the vocabulary, with ignored targets (-100 or any
//! negative id, as PyTorch's ignore_index).
//!
//! Forward keeps only log-sum-exp per row; backward rebuilds the probabilities from it, so the
//! (N, V) probability matrix is never stored.

use rayon::prelude::*;

use super::math::{exp, max, sum};
use super::simd_fn;

const ROWS_PER_TASK: usize = 64;

/// Per row i: `lse[i] = log Σ_j exp(logits[i, j])` and `losses[i] = lse[i] - logits[i,
/// targets[i]]`, or 0 when `targets[i] < 0` (ignored). Targets must be `< v`.
pub fn crossentropy_forward(
    losses: &mut [f32],
    lse: &mut [f32],
    logits: &[f32],
    targets: &[i32],
    n: usize,
    v: usize,
) {
    losses[..n]
        .par_chunks_mut(ROWS_PER_TASK)
        .zip(lse[..n].par_chunks_mut(ROWS_PER_TASK))
        .zip(logits[..n * v].par_chunks(ROWS_PER_TASK * v))
        .zip(targets[..n].par_chunks(ROWS_PER_TASK))
        .for_each(|(((l, s), x), t)| ce_rows(l, s, x, t, v));
}

simd_fn! {
    fn ce_rows(losses: &mut [f32], lse: &mut [f32], logits: &[f32], targets: &[i32], v: usize) {
        for (i, row) in logits.chunks_exact(v).enumerate() {
            let m = max(row);
            // Element j goes to lane j % 16, in order; written over whole chunks so that the
            // compiler vectorises it (an index modulo 16 kept it scalar: 4 ns a logit).
            let mut acc = [0f32; 16];
            let chunks = row.chunks_exact(16);
            let tail = chunks.remainder();
            for ch in chunks {
                for (a, &x) in acc.iter_mut().zip(ch) {
                    *a += exp(x - m);
                }
            }
            for (a, &x) in acc.iter_mut().zip(tail) {
                *a += exp(x - m);
            }
            let s = m + sum(&acc).ln();
            lse[i] = s;
            let t = targets[i];
            losses[i] = if t < 0 { 0.0 } else { s - row[t as usize] };
        }
    }
}

/// `dlogits = scale * (softmax(logits) - onehot(target))` per row (overwritten); rows with an
/// ignored target get zeros.
pub fn crossentropy_backward(
    dlogits: &mut [f32],
    logits: &[f32],
    lse: &[f32],
    targets: &[i32],
    scale: f32,
    n: usize,
    v: usize,
) {
    dlogits[..n * v]
        .par_chunks_mut(ROWS_PER_TASK * v)
        .zip(logits[..n * v].par_chunks(ROWS_PER_TASK * v))
        .zip(lse[..n].par_chunks(ROWS_PER_TASK))
        .zip(targets[..n].par_chunks(ROWS_PER_TASK))
        .for_each(|(((d, x), s), t)| ce_back_rows(d, x, s, t, scale, v));
}

simd_fn! {
    fn ce_back_rows(dlogits: &mut [f32], logits: &[f32], lse: &[f32], targets: &[i32], scale: f32, v: usize) {
        for (i, (d, x)) in dlogits.chunks_exact_mut(v).zip(logits.chunks_exact(v)).enumerate() {
            let t = targets[i];
            if t < 0 {
                d.fill(0.0);
                continue;
            }
            let s = lse[i];
            for (d, &x) in d.iter_mut().zip(x) {
                *d = exp(x - s) * scale;
            }
            d[t as usize] -= scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testing::{check_grad, f64s, rand_vec, within_pool};

    #[test]
    fn crossentropy_matches_finite_differences() {
        let (n, v) = (70, 37);
        let logits: Vec<f32> = rand_vec(n * v, 1).iter().map(|x| x * 3.0).collect();
        let targets: Vec<i32> = (0..n)
            .map(|i| {
                if i % 7 == 3 {
                    -100
                } else {
                    (i * 11 % v) as i32
                }
            })
            .collect();
        let counted = targets.iter().filter(|&&t| t >= 0).count();
        let scale = 1.0 / counted as f32;
        let (mut losses, mut lse, mut d) = (vec![0.0; n], vec![0.0; n], vec![0.0; n * v]);
        within_pool(2, || {
            crossentropy_forward(&mut losses, &mut lse, &logits, &targets, n, v);
            crossentropy_backward(&mut d, &logits, &lse, &targets, scale, n, v);
        });
        let f = |x: &[f64]| -> Vec<f64> {
            let mut total = 0.0;
            for i in 0..n {
                if targets[i] < 0 {
                    continue;
                }
                let row = &x[i * v..(i + 1) * v];
                let m = row.iter().cloned().fold(f64::MIN, f64::max);
                let lse = m + row.iter().map(|y| (y - m).exp()).sum::<f64>().ln();
                total += lse - row[targets[i] as usize];
            }
            vec![total / counted as f64]
        };
        let mean = losses.iter().map(|&l| l as f64).sum::<f64>() / counted as f64;
        let want = f(&f64s(&logits))[0];
        assert!((mean - want).abs() < 1e-5, "{mean} vs {want}");
        check_grad("dlogits", &d, 0.0, &f64s(&logits), &[1.0], f);
    }
}

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

/// log Σ_j exp(row[j]), element j summed into lane j % 16 in order (whole chunks, so that the
/// compiler vectorises it: an index modulo 16 kept it scalar at 4 ns a logit).
#[inline(always)]
fn row_lse(row: &[f32]) -> f32 {
    let m = max(row);
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
    m + sum(&acc).ln()
}

simd_fn! {
    fn ce_rows(losses: &mut [f32], lse: &mut [f32], logits: &[f32], targets: &[i32], v: usize) {
        for (i, row) in logits.chunks_exact(v).enumerate() {
            let s = row_lse(row);
            lse[i] = s;
            let t = targets[i];
            losses[i] = if t < 0 { 0.0 } else { s - row[t as usize] };
        }
    }
}

/// The forward of a vocabulary too large to hold all its logits at once, one block of columns
/// at a time: for the block's columns `v0..v0 + v` (`logits` is (N, v)), each row's running
/// log-sum-exp `lse[i]` (start it at -inf) takes in the block's, and where the row's target
/// falls in the block its logit goes to `target_logit[i]`. After the last block the loss of a
/// counted row is `lse[i] - target_logit[i]`.
pub fn crossentropy_forward_block(
    lse: &mut [f32],
    target_logit: &mut [f32],
    logits: &[f32],
    targets: &[i32],
    n: usize,
    v: usize,
    v0: usize,
) {
    lse[..n]
        .par_chunks_mut(ROWS_PER_TASK)
        .zip(target_logit[..n].par_chunks_mut(ROWS_PER_TASK))
        .zip(logits[..n * v].par_chunks(ROWS_PER_TASK * v))
        .zip(targets[..n].par_chunks(ROWS_PER_TASK))
        .for_each(|(((s, tl), x), t)| ce_block_rows(s, tl, x, t, v, v0));
}

simd_fn! {
    fn ce_block_rows(lse: &mut [f32], target_logit: &mut [f32], logits: &[f32], targets: &[i32], v: usize, v0: usize) {
        for (i, row) in logits.chunks_exact(v).enumerate() {
            let block = row_lse(row);
            let prev = lse[i];
            lse[i] = if prev == f32::NEG_INFINITY {
                block
            } else {
                let hi = prev.max(block);
                hi + (exp(prev - hi) + exp(block - hi)).ln()
            };
            let t = targets[i];
            if t >= 0 && (v0..v0 + v).contains(&(t as usize)) {
                target_logit[i] = row[t as usize - v0];
            }
        }
    }
}

/// The logits become their gradient, `scale * (softmax(logits) - onehot(target))` per row, for
/// the vocabulary columns `v0..v0 + v` (`logits` is (N, v); `lse` is over the whole vocabulary;
/// 0 and the vocabulary size for all of it). Rows with an ignored target get zeros. In place:
/// nothing reads a training step's logits after its loss, and a second (N, V) buffer would be
/// config G's largest activation (206 MB).
pub fn crossentropy_backward(
    logits: &mut [f32],
    lse: &[f32],
    targets: &[i32],
    scale: f32,
    n: usize,
    v: usize,
    v0: usize,
) {
    logits[..n * v]
        .par_chunks_mut(ROWS_PER_TASK * v)
        .zip(lse[..n].par_chunks(ROWS_PER_TASK))
        .zip(targets[..n].par_chunks(ROWS_PER_TASK))
        .for_each(|((x, s), t)| ce_back_rows(x, s, t, scale, v, v0));
}

simd_fn! {
    fn ce_back_rows(logits: &mut [f32], lse: &[f32], targets: &[i32], scale: f32, v: usize, v0: usize) {
        for (i, d) in logits.chunks_exact_mut(v).enumerate() {
            let t = targets[i];
            if t < 0 {
                d.fill(0.0);
                continue;
            }
            let s = lse[i];
            for d in d.iter_mut() {
                *d = exp(*d - s) * scale;
            }
            // The one-hot term, where the target is in this block of columns.
            if let Some(d) = (t as usize).checked_sub(v0).and_then(|j| d.get_mut(j)) {
                *d -= scale;
            }
        }
    }
}

/// After [`crossentropy_forward_block`] over every block: `losses` holds each row's target
/// logit and becomes its loss `lse - target logit`, 0 where the target is ignored (< 0).
pub fn crossentropy_fold(losses: &mut [f32], lse: &[f32], targets: &[i32]) {
    for ((l, &s), &t) in losses.iter_mut().zip(lse).zip(targets) {
        *l = if t < 0 { 0.0 } else { s - *l };
    }
}

/// Σ losses in f64 and in order: the same bits whatever the thread count.
pub fn loss_sum(losses: &[f32]) -> f64 {
    losses.iter().map(|&x| x as f64).sum()
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
        let (mut losses, mut lse, mut d) = (vec![0.0; n], vec![0.0; n], logits.clone());
        within_pool(2, || {
            crossentropy_forward(&mut losses, &mut lse, &logits, &targets, n, v);
            crossentropy_backward(&mut d, &lse, &targets, scale, n, v, 0);
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

//! Rotary position embedding (RoPE): the step between a Llama-style block's qkv product and the
//! attention kernels.
//!
//! RoPE follows Hugging Face's `rotate_half` convention (what `transformers`' Llama computes on
//! Hugging Face-layout weights): within a head of size HS, element i < HS/2 pairs with element
//! i + HS/2, and the pair turns by the angle pos · inv_freq[i]:
//!
//! ```text
//! out[i]        = x[i] · cos - x[i + HS/2] · sin
//! out[i + HS/2] = x[i + HS/2] · cos + x[i] · sin
//! ```
//!
//! The angles come as tables `cos`, `sin` (positions × HS/2) the model computes once. Backward
//! turns the gradient by the opposite angle (the rotation's transpose).
//!
//! Grouped key/value heads need no step here: the attention kernels read them where the qkv
//! product put them (`attention_forward_grouped`). Nothing here allocates.

use rayon::prelude::*;

use super::simd_fn;

/// The shape of a [`rope_forward`]: `n` rows of stride `width`, whose first `heads` heads of
/// size `hs` are rotated (q's heads then k's, which sit side by side in a qkv row).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeDims {
    /// Rows.
    pub n: usize,
    /// Row stride.
    pub width: usize,
    /// Heads rotated, from the start of each row.
    pub heads: usize,
    /// Head size (even).
    pub hs: usize,
}

const ROWS_PER_TASK: usize = 16;

fn rotate(x: &mut [f32], pos: &[u32], cos: &[f32], sin: &[f32], dims: RopeDims, sign: f32) {
    let RopeDims {
        n,
        width,
        heads,
        hs,
    } = dims;
    let half = hs / 2;
    assert!(
        hs.is_multiple_of(2) && heads * hs <= width && x.len() >= n * width && pos.len() >= n,
        "rope: {n} rows of {width} with {heads} heads of {hs} do not fit the buffers"
    );
    assert!(
        pos[..n]
            .iter()
            .all(|&p| (p as usize + 1) * half <= cos.len().min(sin.len())),
        "rope: a position is past the angle tables"
    );
    x[..n * width]
        .par_chunks_mut(ROWS_PER_TASK * width)
        .zip(pos[..n].par_chunks(ROWS_PER_TASK))
        .for_each(|(rows, pos)| {
            for (row, &p) in rows.chunks_exact_mut(width).zip(pos) {
                let at = p as usize * half;
                let (cos, sin) = (&cos[at..at + half], &sin[at..at + half]);
                rotate_row(&mut row[..heads * hs], cos, sin, sign);
            }
        });
}

simd_fn! {
    /// Turns each head (of size 2·cos.len()) of `row` by the angles `cos`, `sin` times `sign`.
    fn rotate_row(row: &mut [f32], cos: &[f32], sin: &[f32], sign: f32) {
        for head in row.chunks_exact_mut(2 * cos.len()) {
            let (lo, hi) = head.split_at_mut(cos.len());
            for (((a, b), &c), &s) in lo.iter_mut().zip(hi.iter_mut()).zip(cos).zip(sin) {
                let s = sign * s;
                let (x0, x1) = (*a, *b);
                *a = x0 * c - x1 * s;
                *b = x1 * c + x0 * s;
            }
        }
    }
}

/// Rotates, in place, the first `dims.heads` heads of each row of `x` by the angles of the
/// row's position `pos[row]` (tables `cos`, `sin`: positions × HS/2).
pub fn rope_forward(x: &mut [f32], pos: &[u32], cos: &[f32], sin: &[f32], dims: RopeDims) {
    rotate(x, pos, cos, sin, dims, 1.0);
}

/// Backward of [`rope_forward`], in place: the gradient turned by the opposite angles.
pub fn rope_backward(dx: &mut [f32], pos: &[u32], cos: &[f32], sin: &[f32], dims: RopeDims) {
    rotate(dx, pos, cos, sin, dims, -1.0);
}

/// The angle tables of rotary embeddings for `positions` positions of heads of size `hs`:
/// (cos, sin), each positions × HS/2, from `inv_freq` (HS/2). The angle pos·inv_freq is
/// formed in f32 as `transformers` forms it; its cosine and sine in f64, then rounded.
pub fn rope_tables(inv_freq: &[f32], positions: usize) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let (mut cos, mut sin) = (vec![0.0; positions * half], vec![0.0; positions * half]);
    for p in 0..positions {
        for (i, &f) in inv_freq.iter().enumerate() {
            let a = (p as f32 * f) as f64;
            cos[p * half + i] = a.cos() as f32;
            sin[p * half + i] = a.sin() as f32;
        }
    }
    (cos, sin)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testing::{assert_close, check_grad, f64s, rand_vec, within_pool};

    #[test]
    fn rope_matches_f64_rotate_half_and_finite_differences() {
        let (n, hs, heads, width) = (37, 8, 3, 40);
        let inv: Vec<f32> = (0..hs / 2)
            .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / hs as f32))
            .collect();
        let (cos, sin) = rope_tables(&inv, 64);
        let pos: Vec<u32> = (0..n).map(|i| (i * 7 % 64) as u32).collect();
        let x = rand_vec(n * width, 1);
        let dout = rand_vec(n * width, 2);
        let dims = RopeDims {
            n,
            width,
            heads,
            hs,
        };
        let reference = |x: &[f64]| -> Vec<f64> {
            let mut out = x.to_vec();
            for (r, &p) in pos.iter().enumerate() {
                for h in 0..heads {
                    for (i, &f) in inv.iter().enumerate() {
                        let a = (p as f32 * f) as f64;
                        let (j, k) = (r * width + h * hs + i, r * width + h * hs + i + hs / 2);
                        out[j] = x[j] * a.cos() - x[k] * a.sin();
                        out[k] = x[k] * a.cos() + x[j] * a.sin();
                    }
                }
            }
            out
        };
        for threads in [1, 2] {
            let mut y = x.clone();
            let mut dx = dout.clone();
            within_pool(threads, || {
                rope_forward(&mut y, &pos, &cos, &sin, dims);
                rope_backward(&mut dx, &pos, &cos, &sin, dims);
            });
            assert_close(&y, &reference(&f64s(&x)), 1e-6, "rope");
            check_grad("dx", &dx, 0.0, &f64s(&x), &dout, reference);
        }
    }
}

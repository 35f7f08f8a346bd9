//! Rotary position embedding (RoPE) and grouped-query attention's key/value expansion: the two
//! steps between a Llama-style block's qkv product and the attention kernels.
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
//! Grouped-query attention (NKV key/value heads, each serving NH/NKV query heads) reuses the
//! multi-head attention kernels unchanged: [`kv_expand_forward`] copies each key/value head
//! into the slots of its query group, giving the (N, 3C) rows those kernels read, and
//! [`kv_expand_backward`] sums the group's gradients back into the shared head. Both are one
//! pass over N·C floats, beside the attention's N·T·C, and leave multi-head models' path
//! untouched. Nothing here allocates.

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

/// The shape of a key/value expansion: `n` rows, `nh` query heads and `nkv` key/value heads
/// (dividing `nh`) of size `hs`. Grouped rows are (NH + 2·NKV)·HS wide (q, k, v), expanded
/// rows 3·NH·HS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvDims {
    /// Rows.
    pub n: usize,
    /// Query heads.
    pub nh: usize,
    /// Key/value heads.
    pub nkv: usize,
    /// Head size.
    pub hs: usize,
}

impl KvDims {
    fn check(self, grouped: usize, expanded: usize) -> (usize, usize, usize) {
        let KvDims { n, nh, nkv, hs } = self;
        assert!(
            nkv > 0 && nh.is_multiple_of(nkv),
            "kv_expand: {nkv} key/value heads do not divide {nh} heads"
        );
        let (gw, c) = ((nh + 2 * nkv) * hs, nh * hs);
        assert!(
            grouped >= n * gw && expanded >= n * 3 * c,
            "kv_expand: buffers too short for {n} rows"
        );
        (gw, c, nh / nkv)
    }
}

/// out (N, 3C) = q | k | v with each of the NKV key and value heads of `qkv`
/// (N, (NH+2·NKV)·HS) copied to the NH/NKV query heads of its group.
pub fn kv_expand_forward(out: &mut [f32], qkv: &[f32], dims: KvDims) {
    let (gw, c, group) = dims.check(qkv.len(), out.len());
    let (hs, kvw) = (dims.hs, dims.nkv * dims.hs);
    out[..dims.n * 3 * c]
        .par_chunks_mut(ROWS_PER_TASK * 3 * c)
        .zip(qkv[..dims.n * gw].par_chunks(ROWS_PER_TASK * gw))
        .for_each(|(out, qkv)| {
            for (o, g) in out.chunks_exact_mut(3 * c).zip(qkv.chunks_exact(gw)) {
                o[..c].copy_from_slice(&g[..c]);
                for h in 0..dims.nh {
                    let kv = (h / group) * hs;
                    o[c + h * hs..c + (h + 1) * hs].copy_from_slice(&g[c + kv..c + kv + hs]);
                    let (vo, vg) = (2 * c + h * hs, c + kvw + kv);
                    o[vo..vo + hs].copy_from_slice(&g[vg..vg + hs]);
                }
            }
        });
}

/// Backward of [`kv_expand_forward`]: dqkv (N, (NH+2·NKV)·HS) = the query gradients, and for
/// each key/value head the sum of its group's gradients in head order (overwritten).
pub fn kv_expand_backward(dqkv: &mut [f32], dout: &[f32], dims: KvDims) {
    let (gw, c, group) = dims.check(dqkv.len(), dout.len());
    let (hs, kvw) = (dims.hs, dims.nkv * dims.hs);
    dqkv[..dims.n * gw]
        .par_chunks_mut(ROWS_PER_TASK * gw)
        .zip(dout[..dims.n * 3 * c].par_chunks(ROWS_PER_TASK * 3 * c))
        .for_each(|(dqkv, dout)| {
            for (g, o) in dqkv.chunks_exact_mut(gw).zip(dout.chunks_exact(3 * c)) {
                g[..c].copy_from_slice(&o[..c]);
                g[c..].fill(0.0);
                for h in 0..dims.nh {
                    let kv = (h / group) * hs;
                    let (dk, dv) = (c + kv, c + kvw + kv);
                    for j in 0..hs {
                        g[dk + j] += o[c + h * hs + j];
                        g[dv + j] += o[2 * c + h * hs + j];
                    }
                }
            }
        });
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

    #[test]
    fn kv_expand_serves_each_group_and_sums_its_gradients() {
        let (n, nh, nkv, hs) = (21, 6, 2, 4);
        let (c, gw) = (nh * hs, (nh + 2 * nkv) * hs);
        let dims = KvDims { n, nh, nkv, hs };
        let qkv = rand_vec(n * gw, 3);
        let dout = rand_vec(n * 3 * c, 4);
        let reference = |g: &[f64]| -> Vec<f64> {
            let mut out = vec![0.0; n * 3 * c];
            for r in 0..n {
                for h in 0..nh {
                    let kv = h / (nh / nkv);
                    for j in 0..hs {
                        let o = r * 3 * c + h * hs + j;
                        out[o] = g[r * gw + h * hs + j];
                        out[o + c] = g[r * gw + c + kv * hs + j];
                        out[o + 2 * c] = g[r * gw + c + nkv * hs + kv * hs + j];
                    }
                }
            }
            out
        };
        for threads in [1, 2] {
            let (mut out, mut dqkv) = (vec![0.0; n * 3 * c], vec![9.0; n * gw]);
            within_pool(threads, || {
                kv_expand_forward(&mut out, &qkv, dims);
                kv_expand_backward(&mut dqkv, &dout, dims);
            });
            assert_close(&out, &reference(&f64s(&qkv)), 0.0, "expand");
            check_grad("dqkv", &dqkv, 0.0, &f64s(&qkv), &dout, reference);
        }
    }
}

//! Elementwise passes: bias + GELU after the MLP's first matmul, residual add with the branch's
//! bias and dropout fused, and their backward passes.
//!
//! Every function is a single pass over its buffers; none allocates or keeps state.

use rayon::prelude::*;

use super::math::{gelu, gelu_and_grad, gelu_grad};
use super::simd_fn;
use crate::Dropout;

/// Elements per parallel task: big enough to hide the fork, small enough to balance.
const CHUNK: usize = 1 << 14;

/// `out = gelu(inp)` (GPT-2's tanh form), elementwise.
pub fn gelu_forward(out: &mut [f32], inp: &[f32]) {
    out.par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(o, x)| gelu_block(o, x));
}

simd_fn! {
    fn gelu_block(out: &mut [f32], inp: &[f32]) {
        for (o, &x) in out.iter_mut().zip(inp) {
            *o = gelu(x);
        }
    }
}

/// `out = gelu(pre)` and `pre = gelu'(pre)` in one pass, one tanh for both: a backward that
/// recomputes GELU's output (for the next product's weight gradient) keeps the derivative in
/// place of the pre-activation, whose only other reader was [`gelu_backward`], so that
/// [`gelu_backward_with_grad`] only multiplies. The same bits as [`gelu_forward`] and
/// [`gelu_backward`].
pub fn gelu_forward_and_grad(out: &mut [f32], pre: &mut [f32]) {
    assert_eq!(
        out.len(),
        pre.len(),
        "gelu forward and grad: output and pre-activation lengths"
    );
    out.par_chunks_mut(CHUNK)
        .zip(pre.par_chunks_mut(CHUNK))
        .for_each(|(o, x)| gelu_and_grad_block(o, x));
}

simd_fn! {
    fn gelu_and_grad_block(out: &mut [f32], pre: &mut [f32]) {
        for (o, x) in out.iter_mut().zip(pre.iter_mut()) {
            (*o, *x) = gelu_and_grad(*x);
        }
    }
}

/// `dinout *= gelu'(inp)`: turns d gelu(x) into d x in place.
pub fn gelu_backward(dinout: &mut [f32], inp: &[f32]) {
    dinout
        .par_chunks_mut(CHUNK)
        .zip(inp.par_chunks(CHUNK))
        .for_each(|(d, x)| gelu_back_block(d, x));
}

simd_fn! {
    fn gelu_back_block(d: &mut [f32], inp: &[f32]) {
        for (d, &x) in d.iter_mut().zip(inp) {
            *d *= gelu_grad(x);
        }
    }
}

/// `dinout *= grad`: [`gelu_backward`] when the forward kept GELU's derivative (`grad`, see
/// `matmul_gelu_forward_bf16`) instead of its input; the same bits, without the tanh.
pub fn gelu_backward_with_grad(dinout: &mut [f32], grad: &[f32]) {
    assert_eq!(
        dinout.len(),
        grad.len(),
        "gelu backward: gradient and derivative lengths"
    );
    dinout
        .par_chunks_mut(CHUNK)
        .zip(grad.par_chunks(CHUNK))
        .for_each(|(d, g)| mul_block(d, g));
}

simd_fn! {
    fn mul_block(d: &mut [f32], g: &[f32]) {
        for (d, &g) in d.iter_mut().zip(g) {
            *d *= g;
        }
    }
}

/// `out = residual + dropout(out + bias)`, rows of `bias.len()` (or of `c` without bias):
/// finishes a residual branch whose matmul wrote `out` without bias. Dropout element `i` is
/// the flat index in `out`.
pub fn residual_forward(
    out: &mut [f32],
    residual: &[f32],
    bias: Option<&[f32]>,
    c: usize,
    dropout: Option<Dropout>,
) {
    let rows_per = CHUNK.div_ceil(c).max(1);
    out.par_chunks_mut(rows_per * c)
        .zip(residual.par_chunks(rows_per * c))
        .enumerate()
        .for_each(|(k, (o, r))| {
            let base = (k * rows_per * c) as u64;
            residual_block(o, r, bias, c, dropout, base)
        });
}

simd_fn! {
    fn residual_block(out: &mut [f32], residual: &[f32], bias: Option<&[f32]>, c: usize, dropout: Option<Dropout>, base: u64) {
        for (row, (o, r)) in out.chunks_exact_mut(c).zip(residual.chunks_exact(c)).enumerate() {
            if let Some(b) = bias {
                for (o, &b) in o.iter_mut().zip(b) {
                    *o += b;
                }
            }
            if let Some(d) = dropout {
                d.apply(o, base + (row * c) as u64);
            }
            for (o, &r) in o.iter_mut().zip(r) {
                *o += r;
            }
        }
    }
}

/// `acc += x`, elementwise (a gradient's second contribution added to its first).
pub fn add_into(acc: &mut [f32], x: &[f32]) {
    assert_eq!(acc.len(), x.len(), "add_into: lengths");
    for (d, &x) in acc.iter_mut().zip(x) {
        *d += x;
    }
}

/// `x = value` (a gradient buffer cleared for the next step: hundreds of MB on larger models).
/// Inside a pool of several threads they share it, as they share AdamW's pass: one thread
/// alone does not reach the memory's bandwidth. Outside a pool (or in a pool of one), a plain
/// fill: it must never spill onto rayon's global pool.
pub fn fill(x: &mut [f32], value: f32) {
    if rayon::current_thread_index().is_some() && rayon::current_num_threads() > 1 {
        x.par_chunks_mut(FILL_CHUNK).for_each(|c| c.fill(value));
    } else {
        x.fill(value);
    }
}

/// Elements per task of [`fill`]: 1 MB, a stride the memory streams at full speed.
const FILL_CHUNK: usize = 1 << 18;

/// `x = dropout(x)` in place, element `i` keyed by `offset + i`.
pub fn dropout_forward(x: &mut [f32], d: Dropout, offset: u64) {
    x.par_chunks_mut(CHUNK).enumerate().for_each(|(k, ch)| {
        d.apply(ch, offset + (k * CHUNK) as u64);
    });
}

/// Backward of dropout: `dx = dropout_mask(dy)`, i.e. the same mask and scale again.
pub fn dropout_backward(dx: &mut [f32], dy: &[f32], d: Dropout, offset: u64) {
    dx.par_chunks_mut(CHUNK)
        .zip(dy.par_chunks(CHUNK))
        .enumerate()
        .for_each(|(k, (dx, dy))| {
            dx.copy_from_slice(dy);
            d.apply(dx, offset + (k * CHUNK) as u64);
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testing::{assert_close, check_grad, f64s, rand_vec, within_pool};

    /// One tanh for both: the bits of gelu_forward, and of gelu_backward's factor.
    #[test]
    fn gelu_forward_and_grad_is_gelu_and_its_derivative() {
        let n = 3 * CHUNK + 7;
        let x: Vec<f32> = rand_vec(n, 5).iter().map(|v| v * 6.0).collect();
        let (mut want, mut d) = (vec![0.0; n], vec![1.0; n]);
        let (mut out, mut pre) = (vec![0.0; n], x.clone());
        within_pool(2, || {
            gelu_forward(&mut want, &x);
            gelu_backward(&mut d, &x);
            gelu_forward_and_grad(&mut out, &mut pre);
        });
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&out), bits(&want));
        assert_eq!(bits(&pre), bits(&d));
    }

    /// Every element, across the tasks' chunk edges and a last partial chunk, on one thread,
    /// on a pool's, and outside any pool.
    #[test]
    fn fill_covers_every_element_on_any_threads() {
        let n = 2 * FILL_CHUNK + 5;
        for threads in [0, 1, 3] {
            let mut x = rand_vec(n, 4);
            if threads == 0 {
                fill(&mut x, -2.5);
            } else {
                within_pool(threads, || fill(&mut x, -2.5));
            }
            assert!(x.iter().all(|&v| v == -2.5), "{threads} threads");
        }
    }

    #[test]
    fn gelu_backward_matches_finite_differences() {
        let n = 3000;
        let x: Vec<f32> = rand_vec(n, 1).iter().map(|v| v * 4.0).collect();
        let dout = rand_vec(n, 2);
        let mut y = vec![0.0; n];
        let mut d = dout.clone();
        within_pool(2, || {
            gelu_forward(&mut y, &x);
            gelu_backward(&mut d, &x);
        });
        let f = |x: &[f64]| -> Vec<f64> {
            x.iter()
                .map(|&x| {
                    0.5 * x
                        * (1.0
                            + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x))
                                .tanh())
                })
                .collect()
        };
        assert_close(&y, &f(&f64s(&x)), 1e-5, "gelu");
        check_grad("dgelu", &d, 0.0, &f64s(&x), &dout, f);
    }

    #[test]
    fn residual_with_dropout_matches_reference_and_backward_reuses_the_mask() {
        let (n, c) = (300, 24);
        let d = Dropout { p: 0.25, key: 99 };
        let branch = rand_vec(n * c, 1);
        let res = rand_vec(n * c, 2);
        let b = rand_vec(c, 3);
        for threads in [1, 2] {
            let mut out = branch.clone();
            within_pool(threads, || {
                residual_forward(&mut out, &res, Some(&b), c, Some(d))
            });
            let mut dropped = 0;
            for i in 0..n * c {
                let keep = d.keep(i as u64);
                dropped += !keep as usize;
                let want = res[i]
                    + if keep {
                        (branch[i] + b[i % c]) / 0.75
                    } else {
                        0.0
                    };
                assert!((out[i] - want).abs() < 1e-6, "{i}");
            }
            assert!(dropped > n * c / 5 && dropped < n * c * 3 / 10, "{dropped}");
            let dy = rand_vec(n * c, 4);
            let mut dx = vec![0.0; n * c];
            within_pool(threads, || dropout_backward(&mut dx, &dy, d, 0));
            for i in 0..n * c {
                let want = if d.keep(i as u64) { dy[i] / 0.75 } else { 0.0 };
                assert!((dx[i] - want).abs() < 1e-6);
            }
        }
    }
}

//! SwiGLU, the gated MLP activation of Llama-style models: out = silu(gate) · up, where the
//! MLP's first product writes gate and up side by side in each row (N, 2F), gate first.
//!
//! Rows are independent and split over threads; nothing here allocates or keeps state.

use rayon::prelude::*;

use super::simd_fn;

const ROWS_PER_TASK: usize = 16;

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// out (N, F) = silu(inp[:, :F]) · inp[:, F:], inp (N, 2F).
pub fn swiglu_forward(out: &mut [f32], inp: &[f32], n: usize, f: usize) {
    out[..n * f]
        .par_chunks_mut(ROWS_PER_TASK * f)
        .zip(inp[..2 * n * f].par_chunks(ROWS_PER_TASK * 2 * f))
        .for_each(|(o, x)| rows_forward(o, x, f));
}

simd_fn! {
    fn rows_forward(out: &mut [f32], inp: &[f32], f: usize) {
        for (o, x) in out.chunks_exact_mut(f).zip(inp.chunks_exact(2 * f)) {
            let (g, u) = x.split_at(f);
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = g * sigmoid(g) * u;
            }
        }
    }
}

/// Backward of [`swiglu_forward`]: dinp (N, 2F) = (dout · up · silu'(gate) | dout ·
/// silu(gate)), overwritten.
pub fn swiglu_backward(dinp: &mut [f32], dout: &[f32], inp: &[f32], n: usize, f: usize) {
    dinp[..2 * n * f]
        .par_chunks_mut(ROWS_PER_TASK * 2 * f)
        .zip(dout[..n * f].par_chunks(ROWS_PER_TASK * f))
        .zip(inp[..2 * n * f].par_chunks(ROWS_PER_TASK * 2 * f))
        .for_each(|((di, d), x)| rows_backward(di, d, x, f));
}

simd_fn! {
    fn rows_backward(dinp: &mut [f32], dout: &[f32], inp: &[f32], f: usize) {
        for ((di, d), x) in dinp.chunks_exact_mut(2 * f).zip(dout.chunks_exact(f)).zip(inp.chunks_exact(2 * f)) {
            let (dg, du) = di.split_at_mut(f);
            let (g, u) = x.split_at(f);
            for ((((dg, du), &d), &g), &u) in dg.iter_mut().zip(du.iter_mut()).zip(d).zip(g).zip(u) {
                let s = sigmoid(g);
                *dg = d * u * s * (1.0 + g * (1.0 - s));
                *du = d * g * s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testing::{assert_close, check_grad, f64s, rand_vec, within_pool};

    #[test]
    fn swiglu_matches_f64_and_finite_differences() {
        let (n, f) = (35, 24);
        let x: Vec<f32> = rand_vec(2 * n * f, 1).iter().map(|v| 3.0 * v).collect();
        let dout = rand_vec(n * f, 2);
        let reference = |x: &[f64]| -> Vec<f64> {
            (0..n * f)
                .map(|i| {
                    let (r, j) = (i / f, i % f);
                    let (g, u) = (x[r * 2 * f + j], x[r * 2 * f + f + j]);
                    g / (1.0 + (-g).exp()) * u
                })
                .collect()
        };
        for threads in [1, 2] {
            let (mut out, mut dx) = (vec![0.0; n * f], vec![7.0; 2 * n * f]);
            within_pool(threads, || {
                swiglu_forward(&mut out, &x, n, f);
                swiglu_backward(&mut dx, &dout, &x, n, f);
            });
            assert_close(&out, &reference(&f64s(&x)), 1e-5, "out");
            check_grad("dx", &dx, 0.0, &f64s(&x), &dout, reference);
        }
    }
}

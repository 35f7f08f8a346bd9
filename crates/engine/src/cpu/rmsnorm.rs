//! RMSNorm over the last dimension (Llama's `LlamaRMSNorm`) and its backward.
//!
//! out = inp · rstd · w with rstd = 1/sqrt(mean(inp²) + eps). Forward keeps rstd per row for
//! backward. Rows split over threads in LayerNorm's fixed groups, and the weight gradient's
//! column sums are added in group order, so the result never depends on the thread count. It
//! never allocates per call (the group sums are LayerNorm's per-thread buffer).

use rayon::prelude::*;

use super::bf16::bf16_bits_as_packed;
use super::layernorm::{add_to, with_group_sums, ROWS_PER_TASK};
use super::math::dot;
use super::simd_fn;

/// out (N, C) = inp · rstd · w, rstd (N) = 1/sqrt(mean(inp²) + eps), written for backward.
pub fn rmsnorm_forward(
    out: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    w: &[f32],
    eps: f32,
    n: usize,
    c: usize,
) {
    let w = &w[..c];
    row_groups(out, rstd, inp, (n, c), |o, r, x| {
        rows_forward(o, r, x, w, eps)
    });
}

/// The forwards' split of `n` rows of `c` over threads, in LayerNorm's groups: `rows` gets each
/// group's outputs (f32 or bf16), rstds and inputs.
fn row_groups<O: Send>(
    out: &mut [O],
    rstd: &mut [f32],
    inp: &[f32],
    (n, c): (usize, usize),
    rows: impl Fn(&mut [O], &mut [f32], &[f32]) + Sync,
) {
    out[..n * c]
        .par_chunks_mut(ROWS_PER_TASK * c)
        .zip(rstd[..n].par_chunks_mut(ROWS_PER_TASK))
        .zip(inp[..n * c].par_chunks(ROWS_PER_TASK * c))
        .for_each(|((o, r), x)| rows(o, r, x));
}

simd_fn! {
    fn rows_forward(out: &mut [f32], rstd: &mut [f32], inp: &[f32], w: &[f32], eps: f32) {
        let c = w.len();
        for (i, (o, x)) in out.chunks_exact_mut(c).zip(inp.chunks_exact(c)).enumerate() {
            let s = row_rstd(x, eps);
            for ((o, &x), &w) in o.iter_mut().zip(x).zip(w) {
                *o = x * s * w;
            }
            rstd[i] = s;
        }
    }
}

/// 1/sqrt(mean(x²) + eps) of one row. Inlined into both forwards, whose output is then the same
/// expression on the same values: the bf16 forward rounds the very f32 values the f32 one
/// writes.
#[inline(always)]
fn row_rstd(x: &[f32], eps: f32) -> f32 {
    1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt()
}

/// [`rmsnorm_forward`] writing its output in bf16 (rounded to nearest even), as
/// [`layernorm_forward_bf16`](super::layernorm_forward_bf16) does and for the same reason.
pub fn rmsnorm_forward_bf16(
    out: &mut [u16],
    rstd: &mut [f32],
    inp: &[f32],
    w: &[f32],
    eps: f32,
    n: usize,
    c: usize,
) {
    let w = &w[..c];
    row_groups(out, rstd, inp, (n, c), |o, r, x| {
        rows_forward_bf16(o, r, x, w, eps)
    });
}

simd_fn! {
    fn rows_forward_bf16(out: &mut [u16], rstd: &mut [f32], inp: &[f32], w: &[f32], eps: f32) {
        let c = w.len();
        for (i, (o, x)) in out.chunks_exact_mut(c).zip(inp.chunks_exact(c)).enumerate() {
            let s = row_rstd(x, eps);
            for ((o, &x), &w) in o.iter_mut().zip(x).zip(w) {
                *o = bf16_bits_as_packed(x * s * w);
            }
            rstd[i] = s;
        }
    }
}

/// Backward of [`rmsnorm_forward`]: `dinp += rstd · (w·dout - x̂ · mean(w·dout·x̂))` with
/// x̂ = inp · rstd, and `dw += Σ_rows x̂ · dout`.
pub fn rmsnorm_backward(
    dinp: &mut [f32],
    dw: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    rstd: &[f32],
    w: &[f32],
    n: usize,
    c: usize,
) {
    let (dinp, dout, inp) = (&mut dinp[..n * c], &dout[..n * c], &inp[..n * c]);
    let (rstd, w, dw) = (&rstd[..n], &w[..c], &mut dw[..c]);
    with_group_sums(n.div_ceil(ROWS_PER_TASK) * c, |sums| {
        sums.fill(0.0);
        dinp.par_chunks_mut(ROWS_PER_TASK * c)
            .zip(dout.par_chunks(ROWS_PER_TASK * c))
            .zip(inp.par_chunks(ROWS_PER_TASK * c))
            .zip(rstd.par_chunks(ROWS_PER_TASK))
            .zip(sums.par_chunks_mut(c))
            .for_each(|((((di, d), x), r), s)| rows_backward(di, d, x, r, w, s));
        for group in sums.chunks_exact(c) {
            add_to(dw, group);
        }
    });
}

simd_fn! {
    fn rows_backward(dinp: &mut [f32], dout: &[f32], inp: &[f32], rstd: &[f32], w: &[f32], sum_w: &mut [f32]) {
        let c = w.len();
        for (i, ((di, d), x)) in dinp
            .chunks_exact_mut(c)
            .zip(dout.chunks_exact(c))
            .zip(inp.chunks_exact(c))
            .enumerate()
        {
            let s = rstd[i];
            let mut acc = 0f32;
            for ((&d, &x), &w) in d.iter().zip(x).zip(w) {
                acc += w * d * x;
            }
            let m = acc * s * s / c as f32;
            for ((((di, &d), &x), &w), sw) in di.iter_mut().zip(d).zip(x).zip(w).zip(sum_w.iter_mut()) {
                *di += s * (w * d - x * m);
                *sw += x * s * d;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testing::{assert_close, check_grad, f64s, rand_vec, within_pool};

    fn reference(x: &[f64], w: &[f64], eps: f64, n: usize, c: usize) -> Vec<f64> {
        let mut out = vec![0.0; n * c];
        for i in 0..n {
            let row = &x[i * c..(i + 1) * c];
            let s = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / c as f64 + eps).sqrt();
            for j in 0..c {
                out[i * c + j] = row[j] * s * w[j];
            }
        }
        out
    }

    #[test]
    fn rmsnorm_matches_f64_and_finite_differences() {
        let (n, c, eps) = (3 * ROWS_PER_TASK + 3, 40, 1e-6);
        let (x, w, dout) = (rand_vec(n * c, 1), rand_vec(c, 2), rand_vec(n * c, 4));
        let mut one = None;
        for threads in [1, 2, 3] {
            let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
            let (mut dx, mut dw) = (vec![0.5; n * c], vec![0.25; c]);
            within_pool(threads, || {
                rmsnorm_forward(&mut out, &mut rstd, &x, &w, eps, n, c);
                rmsnorm_backward(&mut dx, &mut dw, &dout, &x, &rstd, &w, n, c);
            });
            let f = |x: &[f64], w: &[f64]| reference(x, w, eps as f64, n, c);
            let (x64, w64) = (f64s(&x), f64s(&w));
            assert_close(&out, &f(&x64, &w64), 1e-5, "out");
            check_grad("dx", &dx, 0.5, &x64, &dout, |x| f(x, &w64));
            check_grad("dw", &dw, 0.25, &w64, &dout, |w| f(&x64, w));
            let bits: Vec<u32> = dx.iter().chain(&dw).map(|v| v.to_bits()).collect();
            assert!(
                one.get_or_insert(bits.clone()) == &bits,
                "{threads} threads"
            );
        }
    }

    /// The bf16 forward writes the f32 forward's values rounded to nearest even, bit for bit,
    /// with the same rstd, C with a tail past whole 16-lane chunks.
    #[test]
    fn bf16_output_is_the_f32_output_rounded() {
        use crate::cpu::bf16::bf16_bits_as_packed;
        for (n, c) in [(2 * ROWS_PER_TASK + 3, 32), (ROWS_PER_TASK + 1, 37)] {
            let (x, w) = (rand_vec(n * c, 12), rand_vec(c, 13));
            for threads in [1, 2] {
                let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
                let (mut out16, mut rstd16) = (vec![0u16; n * c], vec![0.0; n]);
                within_pool(threads, || {
                    rmsnorm_forward(&mut out, &mut rstd, &x, &w, 1e-6, n, c);
                    rmsnorm_forward_bf16(&mut out16, &mut rstd16, &x, &w, 1e-6, n, c);
                });
                let want: Vec<u16> = out.iter().map(|&v| bf16_bits_as_packed(v)).collect();
                assert_eq!(out16, want, "out, {n}x{c}, {threads} threads");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&rstd16),
                    bits(&rstd),
                    "rstd, {n}x{c}, {threads} threads"
                );
            }
        }
    }
}

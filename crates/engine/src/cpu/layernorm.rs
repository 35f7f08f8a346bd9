//! LayerNorm over the last dimension (eps 1e-5, as PyTorch and GPT-2) and its backward.
//!
//! Forward caches mean and 1/std per row; backward takes them instead of recomputing. Rows are
//! independent, so they split over threads in fixed groups of rows. The weight and bias
//! gradients are column sums: each group sums its own rows' terms while it has them in cache,
//! and the groups' sums are added in group order at the end, so the result never depends on the
//! thread count. (A second pass over the rows, split by columns, read the gradient and the input
//! again: on a training step's [tokens x d] matrices that pass cost as much as the first and did
//! not get faster with a second thread.)

use rayon::prelude::*;

use super::bf16::bf16_bits_as_packed;
use super::math::{dot, sum};
use super::simd_fn;

const EPS: f32 = 1e-5;
pub(super) const ROWS_PER_TASK: usize = 32;

/// out (N, C) = (inp - mean) / sqrt(var + eps) * w + b; mean, rstd (N) are written for backward.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward(
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    n: usize,
    c: usize,
) {
    let (w, b) = (&w[..c], b.map(|b| &b[..c]));
    row_groups(out, (mean, rstd), inp, (n, c), |o, m, r, x| {
        rows_forward(o, m, r, x, w, b)
    });
}

/// The forwards' split of `n` rows of `c` over threads: `rows` gets each group of
/// [`ROWS_PER_TASK`] rows' outputs (f32 or bf16), means, rstds and inputs.
fn row_groups<O: Send>(
    out: &mut [O],
    (mean, rstd): (&mut [f32], &mut [f32]),
    inp: &[f32],
    (n, c): (usize, usize),
    rows: impl Fn(&mut [O], &mut [f32], &mut [f32], &[f32]) + Sync,
) {
    out[..n * c]
        .par_chunks_mut(ROWS_PER_TASK * c)
        .zip(mean[..n].par_chunks_mut(ROWS_PER_TASK))
        .zip(rstd[..n].par_chunks_mut(ROWS_PER_TASK))
        .zip(inp[..n * c].par_chunks(ROWS_PER_TASK * c))
        .for_each(|(((o, m), r), x)| rows(o, m, r, x));
}

simd_fn! {
    fn rows_forward(out: &mut [f32], mean: &mut [f32], rstd: &mut [f32], inp: &[f32], w: &[f32], b: Option<&[f32]>) {
        let c = w.len();
        for (i, (o, x)) in out.chunks_exact_mut(c).zip(inp.chunks_exact(c)).enumerate() {
            let (m, s) = centre_row(o, x);
            match b {
                Some(b) => {
                    for ((o, &w), &b) in o.iter_mut().zip(w).zip(b) {
                        *o = *o * s * w + b;
                    }
                }
                None => {
                    for (o, &w) in o.iter_mut().zip(w) {
                        *o = *o * s * w;
                    }
                }
            }
            (mean[i], rstd[i]) = (m, s);
        }
    }
}

/// `o` = the row `x` less its mean: returns the mean and rstd. Inlined into both forwards,
/// whose last step (`o · rstd · w + b`) is then the same expression on the same values: the
/// bf16 forward rounds the very f32 values the f32 one writes.
#[inline(always)]
fn centre_row(o: &mut [f32], x: &[f32]) -> (f32, f32) {
    let c = x.len();
    let m = sum(x) / c as f32;
    for (o, &v) in o.iter_mut().zip(x) {
        *o = v - m;
    }
    let var = dot(o, o) / c as f32;
    (m, 1.0 / (var + EPS).sqrt())
}

/// [`layernorm_forward`] writing its output in bf16 (`out` holds the bits of each f32 value
/// rounded to nearest even, as the bf16 products' packs round it): under bf16 products the
/// output is read only by products, which would round it so anyway, so they read the same
/// values from half the bytes. mean and rstd are the f32 forward's.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward_bf16(
    out: &mut [u16],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    n: usize,
    c: usize,
) {
    let (w, b) = (&w[..c], b.map(|b| &b[..c]));
    row_groups(out, (mean, rstd), inp, (n, c), |o, m, r, x| {
        // Each row centred in this thread's scratch (in L1), then written rounded into `o`.
        with_group_sums(c, |row| rows_forward_bf16(o, m, r, x, w, b, row))
    });
}

simd_fn! {
    fn rows_forward_bf16(out: &mut [u16], mean: &mut [f32], rstd: &mut [f32], inp: &[f32], w: &[f32], b: Option<&[f32]>, row: &mut [f32]) {
        let c = w.len();
        for (i, (o, x)) in out.chunks_exact_mut(c).zip(inp.chunks_exact(c)).enumerate() {
            let (m, s) = centre_row(row, x);
            match b {
                Some(b) => {
                    for (((o, &v), &w), &b) in o.iter_mut().zip(&*row).zip(w).zip(b) {
                        *o = bf16_bits_as_packed(v * s * w + b);
                    }
                }
                None => {
                    for ((o, &v), &w) in o.iter_mut().zip(&*row).zip(w) {
                        *o = bf16_bits_as_packed(v * s * w);
                    }
                }
            }
            (mean[i], rstd[i]) = (m, s);
        }
    }
}

/// Backward of [`layernorm_forward`]: `dinp += ...`, `dw += Σ norm * dout`, `db += Σ dout`.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    dinp: &mut [f32],
    dw: &mut [f32],
    db: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    mean: &[f32],
    rstd: &[f32],
    w: &[f32],
    n: usize,
    c: usize,
) {
    let (dinp, dout, inp) = (&mut dinp[..n * c], &dout[..n * c], &inp[..n * c]);
    let (mean, rstd, w) = (&mean[..n], &rstd[..n], &w[..c]);
    let (dw, mut db) = (&mut dw[..c], db.map(|db| &mut db[..c]));
    // Per group of rows: its sums of norm * dout (the weight's gradient), then of dout (the
    // bias's).
    let run = |sums: &mut [f32]| {
        sums.fill(0.0);
        dinp.par_chunks_mut(ROWS_PER_TASK * c)
            .zip(dout.par_chunks(ROWS_PER_TASK * c))
            .zip(inp.par_chunks(ROWS_PER_TASK * c))
            .zip(mean.par_chunks(ROWS_PER_TASK))
            .zip(rstd.par_chunks(ROWS_PER_TASK))
            .zip(sums.par_chunks_mut(2 * c))
            .for_each(|(((((di, d), x), m), r), s)| rows_backward(di, d, x, m, r, w, s));
        for group in sums.chunks_exact(2 * c) {
            let (gw, gb) = group.split_at(c);
            add_to(dw, gw);
            if let Some(db) = db.as_deref_mut() {
                add_to(db, gb);
            }
        }
    };
    with_group_sums(n.div_ceil(ROWS_PER_TASK) * 2 * c, run);
}

/// Runs `f` on `len` floats of this thread's group-sum buffer (its contents undefined), grown
/// to `len` on first use (the bf16 forward's row scratch too); a nested call (a thread that took another normalisation's job while
/// waiting for its own tasks) gets a fresh buffer instead of the one in use.
pub(super) fn with_group_sums(len: usize, f: impl FnOnce(&mut [f32])) {
    GROUP_SUMS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            if buf.len() < len {
                buf.resize(len, 0.0);
            }
            f(&mut buf[..len])
        }
        Err(_) => f(&mut vec![0.0; len]),
    });
}

thread_local! {
    /// The groups' sums of [`layernorm_backward`], kept per calling thread so that a training
    /// step does not allocate them for every call (the first call of a size grows it).
    static GROUP_SUMS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

simd_fn! {
    pub(super) fn add_to(acc: &mut [f32], x: &[f32]) {
        for (a, &v) in acc.iter_mut().zip(x) {
            *a += v;
        }
    }
}

simd_fn! {
    fn rows_backward(dinp: &mut [f32], dout: &[f32], inp: &[f32], mean: &[f32], rstd: &[f32], w: &[f32], sums: &mut [f32]) {
        let c = w.len();
        let (sum_w, sum_b) = sums.split_at_mut(c);
        for (i, ((di, d), x)) in dinp
            .chunks_exact_mut(c)
            .zip(dout.chunks_exact(c))
            .zip(inp.chunks_exact(c))
            .enumerate()
        {
            let (m, s) = (mean[i], rstd[i]);
            // dnorm = w * dout; dinp += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd
            let mut acc_d = [0f32; 16];
            let mut acc_dn = [0f32; 16];
            // Whole 16-lane chunks, then the tail: the same lanes as `j % 16`, in a shape LLVM
            // vectorizes.
            let full = c / 16 * 16;
            for ((dc, xc), wc) in d[..full]
                .chunks_exact(16)
                .zip(x[..full].chunks_exact(16))
                .zip(w[..full].chunks_exact(16))
            {
                for k in 0..16 {
                    let dn = wc[k] * dc[k];
                    acc_d[k] += dn;
                    acc_dn[k] += dn * ((xc[k] - m) * s);
                }
            }
            for j in full..c {
                let dn = w[j] * d[j];
                acc_d[j - full] += dn;
                acc_dn[j - full] += dn * ((x[j] - m) * s);
            }
            let dnorm_mean = acc_d.iter().sum::<f32>() / c as f32;
            let dnorm_norm_mean = acc_dn.iter().sum::<f32>() / c as f32;
            for ((((di, &d), &x), &w), (sw, sb)) in di
                .iter_mut()
                .zip(d)
                .zip(x)
                .zip(w)
                .zip(sum_w.iter_mut().zip(sum_b.iter_mut()))
            {
                let norm = (x - m) * s;
                *di += (w * d - dnorm_mean - norm * dnorm_norm_mean) * s;
                *sw += norm * d;
                *sb += d;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testing::{assert_close, check_grad, rand_vec, within_pool};

    fn reference(x: &[f64], w: &[f64], b: &[f64], n: usize, c: usize) -> Vec<f64> {
        let mut out = vec![0.0; n * c];
        for i in 0..n {
            let row = &x[i * c..(i + 1) * c];
            let m = row.iter().sum::<f64>() / c as f64;
            let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / c as f64;
            let s = 1.0 / (var + EPS as f64).sqrt();
            for j in 0..c {
                out[i * c + j] = (row[j] - m) * s * w[j] + b[j];
            }
        }
        out
    }

    /// Forward with bias `b`, then backward into dx, dw and db starting at 0.5, 0.25 and 0.0
    /// (they accumulate), on `threads` threads: (out, dx, dw, db).
    fn forward_backward(
        threads: usize,
        (x, w, b, dout): (&[f32], &[f32], &[f32], &[f32]),
        n: usize,
        c: usize,
    ) -> [Vec<f32>; 4] {
        let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        let mut dx = vec![0.5; n * c];
        let (mut dw, mut db) = (vec![0.25; c], vec![0.0; c]);
        within_pool(threads, || {
            layernorm_forward(&mut out, &mut mean, &mut rstd, x, w, Some(b), n, c);
            layernorm_backward(
                &mut dx,
                &mut dw,
                Some(&mut db),
                dout,
                x,
                &mean,
                &rstd,
                w,
                n,
                c,
            );
        });
        [out, dx, dw, db]
    }

    #[test]
    fn layernorm_matches_f64_and_finite_differences() {
        for threads in [1, 2] {
            let (n, c) = (67, 40);
            let x = rand_vec(n * c, 1);
            let w = rand_vec(c, 2);
            let b = rand_vec(c, 3);
            let dout = rand_vec(n * c, 4);
            let [out, dx, dw, db] = forward_backward(threads, (&x, &w, &b, &dout), n, c);
            let f = |x: &[f64], w: &[f64], b: &[f64]| reference(x, w, b, n, c);
            let (x64, w64, b64) = (
                crate::cpu::testing::f64s(&x),
                crate::cpu::testing::f64s(&w),
                crate::cpu::testing::f64s(&b),
            );
            assert_close(&out, &f(&x64, &w64, &b64), 1e-5, "out");
            check_grad("dx", &dx, 0.5, &x64, &dout, |x| f(x, &w64, &b64));
            check_grad("dw", &dw, 0.25, &w64, &dout, |w| f(&x64, w, &b64));
            check_grad("db", &db, 0.0, &b64, &dout, |b| f(&x64, &w64, b));
        }
    }

    /// The bf16 forward writes the f32 forward's values rounded to nearest even, bit for bit,
    /// with the same statistics: C a multiple of 16 and not (a tail), rows past one group,
    /// with and without a bias, on 1 and 2 threads.
    #[test]
    fn bf16_output_is_the_f32_output_rounded() {
        use crate::cpu::bf16::bf16_bits_as_packed;
        for (n, c) in [(3 * ROWS_PER_TASK + 5, 48), (ROWS_PER_TASK + 3, 37), (7, 5)] {
            let x: Vec<f32> = rand_vec(n * c, 9).iter().map(|v| 4.0 * v + 1.0).collect();
            let (w, b) = (rand_vec(c, 10), rand_vec(c, 11));
            for (threads, bias) in [(1, true), (2, true), (2, false)] {
                let b = bias.then_some(&b[..]);
                let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
                let (mut out16, mut mean16, mut rstd16) =
                    (vec![0u16; n * c], vec![0.0; n], vec![0.0; n]);
                within_pool(threads, || {
                    layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, b, n, c);
                    layernorm_forward_bf16(&mut out16, &mut mean16, &mut rstd16, &x, &w, b, n, c);
                });
                let what = format!("{n}x{c}, {threads} threads, bias {bias}");
                let want: Vec<u16> = out.iter().map(|&v| bf16_bits_as_packed(v)).collect();
                assert_eq!(out16, want, "out, {what}");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&mean16), bits(&mean), "mean, {what}");
                assert_eq!(bits(&rstd16), bits(&rstd), "rstd, {what}");
                // rounding really happened somewhere (not all values exact in bf16)
                assert!(out.iter().any(|&v| v.to_bits() & 0xffff != 0), "{what}");
            }
        }
    }

    #[test]
    fn backward_gives_the_same_bits_at_any_thread_count() {
        // rows past one group and not a multiple of it
        let (n, c) = (3 * ROWS_PER_TASK + 5, 48);
        let (x, w, b, dout) = (
            rand_vec(n * c, 5),
            rand_vec(c, 6),
            rand_vec(c, 8),
            rand_vec(n * c, 7),
        );
        let bits = |threads: usize| {
            forward_backward(threads, (&x, &w, &b, &dout), n, c)
                .map(|v| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>())
        };
        let one = bits(1);
        for threads in [2, 3] {
            assert!(bits(threads) == one, "{threads} threads changed the bits");
        }
    }
}

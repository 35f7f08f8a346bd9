//! SwiGLU, the gated MLP activation of Llama-style models: out = silu(gate) · up, where the
//! MLP's first product writes gate and up side by side in each row (N, 2F).
//!
//! Two row layouts of that product:
//! - natural, gate first (`[gate | up]`), as the weight (C, 2F) and its gradient are kept;
//! - interleaved, as the product fused with its SwiGLU writes it ([`matmul_swiglu_forward`]):
//!   tiles of [`TILE`] gate columns each followed by the same columns of up (the last tile
//!   narrower when F is not a multiple of [`TILE`]), so that one block of the product holds
//!   both halves of its outputs.
//!
//! Here are the fused products (forward, and backward's product that gives d(SwiGLU output)),
//! on the matrix kernels' epilogues (see `epilogue.rs`), and the passes of their own: the
//! unfused SwiGLU on the natural layout (decoding), the recomputation of the output from the
//! interleaved layout, and backward passes whose gradients come out in the natural layout (what
//! the weight gradient's product reads). Rows are independent and split over threads; nothing
//! here keeps state, and only the fallback of the fused forward allocates (a row per task).

use rayon::prelude::*;

use super::bf16::bf16_bits;
use super::epilogue::Epilogue;
use super::math::{swiglu, swiglu_backward_pair as pair_backward, swiglu_grads};
use super::matmul::{
    matmul_backward_input_with, matmul_forward, matmul_forward_bf16_input, matmul_forward_with,
    Input,
};
use super::{simd_fn, simd_level, SendPtr, SimdLevel};
use crate::DType;

const ROWS_PER_TASK: usize = 16;

/// Gate (and up) columns per tile of the interleaved layout (see the module doc).
pub(crate) const TILE: usize = 16;

/// Calls `f(t0, w)` for each tile of a row of F gate columns: natural columns t0..t0 + w of
/// gate (and of up); in the interleaved row, gate at 2·t0.. and up at 2·t0 + w...
#[inline(always)]
fn tiles(f: usize, mut each: impl FnMut(usize, usize)) {
    for t0 in (0..f).step_by(TILE) {
        each(t0, TILE.min(f - t0));
    }
}

/// out (N, F) = silu(inp[:, :F]) · inp[:, F:], inp (N, 2F) natural.
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
                *o = swiglu(g, u);
            }
        }
    }
}

/// [`swiglu_forward`] of an interleaved inp (N, 2F): the same bits from the same values.
pub fn swiglu_interleaved_forward(out: &mut [f32], inp: &[f32], n: usize, f: usize) {
    out[..n * f]
        .par_chunks_mut(ROWS_PER_TASK * f)
        .zip(inp[..2 * n * f].par_chunks(ROWS_PER_TASK * 2 * f))
        .for_each(|(o, x)| rows_interleaved_forward(o, x, f));
}

simd_fn! {
    fn rows_interleaved_forward(out: &mut [f32], inp: &[f32], f: usize) {
        for (o, x) in out.chunks_exact_mut(f).zip(inp.chunks_exact(2 * f)) {
            tiles(f, |t0, w| {
                let (g, u) = x[2 * t0..2 * t0 + 2 * w].split_at(w);
                for ((o, &g), &u) in o[t0..t0 + w].iter_mut().zip(g).zip(u) {
                    *o = swiglu(g, u);
                }
            });
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
        .for_each(|((di, d), x)| rows_backward(di, d, x, f, false));
}

/// [`swiglu_backward`] of an interleaved inp: dinp (N, 2F) natural, the same bits.
pub fn swiglu_interleaved_backward(
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    n: usize,
    f: usize,
) {
    dinp[..2 * n * f]
        .par_chunks_mut(ROWS_PER_TASK * 2 * f)
        .zip(dout[..n * f].par_chunks(ROWS_PER_TASK * f))
        .zip(inp[..2 * n * f].par_chunks(ROWS_PER_TASK * 2 * f))
        .for_each(|((di, d), x)| rows_backward(di, d, x, f, true));
}

simd_fn! {
    fn rows_backward(dinp: &mut [f32], dout: &[f32], inp: &[f32], f: usize, interleaved: bool) {
        for ((di, d), x) in dinp.chunks_exact_mut(2 * f).zip(dout.chunks_exact(f)).zip(inp.chunks_exact(2 * f)) {
            let (dg, du) = di.split_at_mut(f);
            if interleaved {
                tiles(f, |t0, w| {
                    let (g, u) = x[2 * t0..2 * t0 + 2 * w].split_at(w);
                    let r = t0..t0 + w;
                    let (dg, du, d) = (&mut dg[r.clone()], &mut du[r.clone()], &d[r]);
                    for ((((dg, du), &d), &g), &u) in dg.iter_mut().zip(du.iter_mut()).zip(d).zip(g).zip(u) {
                        (*dg, *du) = pair_backward(d, g, u);
                    }
                });
            } else {
                let (g, u) = x.split_at(f);
                for ((((dg, du), &d), &g), &u) in dg.iter_mut().zip(du.iter_mut()).zip(d).zip(g).zip(u) {
                    (*dg, *du) = pair_backward(d, g, u);
                }
            }
        }
    }
}

/// SwiGLU's backward from what the bf16 fused forward kept
/// ([`matmul_swiglu_forward_bf16`](super::matmul_swiglu_forward_bf16)): `grad` (N, 2F)
/// interleaved holds silu(gate) where gate was and up · silu'(gate) where up was, so
/// dinp (N, 2F) natural = (dout · grad[up] | dout · grad[gate]), overwritten. No sigmoid here.
pub fn swiglu_backward_with_grad(dinp: &mut [f32], dout: &[f32], grad: &[f32], n: usize, f: usize) {
    dinp[..2 * n * f]
        .par_chunks_mut(ROWS_PER_TASK * 2 * f)
        .zip(dout[..n * f].par_chunks(ROWS_PER_TASK * f))
        .zip(grad[..2 * n * f].par_chunks(ROWS_PER_TASK * 2 * f))
        .for_each(|((di, d), x)| rows_backward_with_grad(di, d, x, f));
}

simd_fn! {
    fn rows_backward_with_grad(dinp: &mut [f32], dout: &[f32], grad: &[f32], f: usize) {
        for ((di, d), x) in dinp.chunks_exact_mut(2 * f).zip(dout.chunks_exact(f)).zip(grad.chunks_exact(2 * f)) {
            let (dg, du) = di.split_at_mut(f);
            tiles(f, |t0, w| {
                let (silu, up_grad) = x[2 * t0..2 * t0 + 2 * w].split_at(w);
                let r = t0..t0 + w;
                let (dg, du, d) = (&mut dg[r.clone()], &mut du[r.clone()], &d[r]);
                for ((((dg, du), &d), &a), &b) in dg.iter_mut().zip(du.iter_mut()).zip(d).zip(silu).zip(up_grad) {
                    (*dg, *du) = (d * b, d * a);
                }
            });
        }
    }
}

/// Whether [`matmul_swiglu_forward`] can run its SwiGLU as the product's epilogue: on the
/// AVX-512 kernels, without a bias (none of the family has an MLP bias but by option), and with
/// whole tiles of the interleaved order. Elsewhere it runs the product, then a pass.
fn swiglu_fusable(f: usize, bias: Option<&[f32]>) -> bool {
    simd_level() == SimdLevel::Avx512 && f.is_multiple_of(TILE) && bias.is_none()
}

/// `pre (N, 2F) = inp (N, C) · w (C, 2F) + bias` and `out (N, F) = silu(gate) · up` in one
/// pass: the SwiGLU MLP's first layer (w's columns gate then up, as the model keeps them) and
/// its activation, each strip of `out` computed while the product's strip is in cache. `pre`
/// is left in the interleaved order (see the module doc), which
/// [`swiglu_interleaved_forward`] and [`matmul_backward_input_swiglu`] read. Each value is the
/// bits of [`matmul_forward`](super::matmul_forward) then [`swiglu_forward`].
pub fn matmul_swiglu_forward(
    dtype: DType,
    pre: &mut [f32],
    out: &mut [f32],
    inp: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    c: usize,
    f: usize,
) {
    assert!(
        out.len() >= n * f,
        "matmul swiglu out: {} elements, need {}",
        out.len(),
        n * f
    );
    if !swiglu_fusable(f, bias) {
        matmul_forward(dtype, pre, inp, w, bias, n, c, 2 * f);
        swiglu_finish_unfused(pre, SwiGluOut::F32(out), n, f);
        return;
    }
    let ep = Epilogue::SwiGlu {
        out: SendPtr(out.as_mut_ptr()),
        rs: f,
        half: f,
    };
    // SAFETY: ep's operand is `out`, (n, f) as checked, a distinct &mut (the epilogue writes
    // one output per pair of the product's 2·f columns).
    unsafe { matmul_forward_with(dtype, pre, Input::F32(inp), w, None, (n, c, 2 * f), ep) }
}

/// [`matmul_swiglu_forward`] of an input kept in bf16 (its bits, as
/// [`matmul_gelu_forward_bf16`](super::matmul_gelu_forward_bf16) reads), keeping SwiGLU's
/// output in bf16 (`out` holds its bits, the rounding of the f32 output), as [`matmul_gelu_forward_bf16`](super::matmul_gelu_forward_bf16) does; `grad` (N, 2F),
/// interleaved, receives what SwiGLU's backward needs instead of the pre-activation (silu(gate)
/// where gate was, up · silu'(gate) where up was), which
/// [`swiglu_backward_with_grad`] reads. Needs a backend of
/// `DType::Bf16`.
pub fn matmul_swiglu_forward_bf16(
    dtype: DType,
    grad: &mut [f32],
    out: &mut [u16],
    inp: &[u16],
    w: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    c: usize,
    f: usize,
) {
    assert!(
        out.len() >= n * f,
        "matmul swiglu out: {} elements, need {}",
        out.len(),
        n * f
    );
    assert!(
        dtype == DType::Bf16 && super::bf16_supported(),
        "bf16 activations need a backend of DType::Bf16"
    );
    if !swiglu_fusable(f, bias) {
        matmul_forward_bf16_input(dtype, grad, inp, w, bias, n, c, 2 * f);
        swiglu_finish_unfused(grad, SwiGluOut::Bf16(out), n, f);
        return;
    }
    let ep = Epilogue::SwiGluBf16 {
        out: SendPtr(out.as_mut_ptr() as *mut f32),
        rs: f,
        half: f,
    };
    // SAFETY: ep's operand is `out`, (n, f) u16 as checked, a distinct &mut.
    unsafe { matmul_forward_with(dtype, grad, Input::Bf16(inp), w, None, (n, c, 2 * f), ep) }
}

/// `dinp` (N, 2F), gate then up, = SwiGLU's backward at the interleaved pre-activation `pre`
/// (as [`matmul_swiglu_forward`] left it) for d(output) = `dout` (N, C) · `w`ᵀ, `w` (F, C) the
/// next layer's weight: the product (which `dact` (N, F) receives on the way) and
/// [`swiglu_interleaved_backward`] in one pass, each strip of the product turned into its
/// gradients while in cache. The same bits as the two.
pub fn matmul_backward_input_swiglu(
    dtype: DType,
    dinp: &mut [f32],
    dact: &mut [f32],
    dout: &[f32],
    w: &[f32],
    pre: &[f32],
    n: usize,
    f: usize,
    c: usize,
) {
    backward_input(dtype, (dinp, dact), dout, w, (pre, false), (n, f, c))
}

/// [`matmul_backward_input_swiglu`] from the derivatives [`matmul_swiglu_forward_bf16`] kept
/// in `grad`: the product and [`swiglu_backward_with_grad`] in one pass, the same bits.
pub fn matmul_backward_input_swiglu_with_grad(
    dtype: DType,
    dinp: &mut [f32],
    dact: &mut [f32],
    dout: &[f32],
    w: &[f32],
    grad: &[f32],
    n: usize,
    f: usize,
    c: usize,
) {
    backward_input(dtype, (dinp, dact), dout, w, (grad, true), (n, f, c))
}

/// The two above: `src` is the pre-activation, or the kept derivatives with `kept`.
fn backward_input(
    dtype: DType,
    (dinp, dact): (&mut [f32], &mut [f32]),
    dout: &[f32],
    w: &[f32],
    (src, kept): (&[f32], bool),
    (n, f, c): (usize, usize, usize),
) {
    let need = 2 * n * f;
    assert!(
        dinp.len() >= need && src.len() >= need,
        "swiglu backward: {} and {} floats, need {need}",
        dinp.len(),
        src.len()
    );
    let ep = Epilogue::SwiGluBwd {
        dinp: SendPtr(dinp.as_mut_ptr()),
        src: SendPtr(src.as_ptr() as *mut f32),
        f,
        kept,
    };
    // SAFETY: ep reads `src` and writes `dinp`, each (n, 2f) as checked, distinct from each
    // other and from the product's operands (dinp is a &mut; src is only read).
    unsafe { matmul_backward_input_with(dtype, dact, dout, w, (n, f, c), ep) }
}

/// Where the fused product's fallback writes SwiGLU's output.
pub(crate) enum SwiGluOut<'a> {
    /// f32; the product stays as it is (interleaved).
    F32(&'a mut [f32]),
    /// bf16 bits; the product is replaced by [`swiglu_grads`] (interleaved).
    Bf16(&'a mut [u16]),
}

/// The fused product's work after a product it could not fuse (a CPU without AVX-512, a bias,
/// or F not a multiple of [`TILE`]): `pre` (N, 2F) holds the product in the natural layout and
/// leaves in the interleaved one, SwiGLU's output written to `out`, each value the bits the
/// fused epilogue computes.
pub(crate) fn swiglu_finish_unfused(pre: &mut [f32], out: SwiGluOut, n: usize, f: usize) {
    let rows = pre[..2 * n * f].par_chunks_mut(ROWS_PER_TASK * 2 * f);
    match out {
        SwiGluOut::F32(out) => rows
            .zip(out[..n * f].par_chunks_mut(ROWS_PER_TASK * f))
            .for_each(|(x, o)| {
                let mut row = vec![0.0; 2 * f];
                for (x, o) in x.chunks_exact_mut(2 * f).zip(o.chunks_exact_mut(f)) {
                    row.copy_from_slice(x);
                    let (g, u) = row.split_at(f);
                    tiles(f, |t0, w| {
                        for j in 0..w {
                            let (g, u) = (g[t0 + j], u[t0 + j]);
                            o[t0 + j] = swiglu(g, u);
                            (x[2 * t0 + j], x[2 * t0 + w + j]) = (g, u);
                        }
                    });
                }
            }),
        SwiGluOut::Bf16(out) => rows
            .zip(out[..n * f].par_chunks_mut(ROWS_PER_TASK * f))
            .for_each(|(x, o)| {
                let mut row = vec![0.0; 2 * f];
                for (x, o) in x.chunks_exact_mut(2 * f).zip(o.chunks_exact_mut(f)) {
                    row.copy_from_slice(x);
                    let (g, u) = row.split_at(f);
                    tiles(f, |t0, w| {
                        for j in 0..w {
                            let (g, u) = (g[t0 + j], u[t0 + j]);
                            o[t0 + j] = bf16_bits(swiglu(g, u));
                            (x[2 * t0 + j], x[2 * t0 + w + j]) = swiglu_grads(g, u);
                        }
                    });
                }
            }),
    }
}

/// The interleaved layout of natural rows (N, 2F) (for tests).
#[cfg(test)]
pub(crate) fn interleave(x: &[f32], f: usize) -> Vec<f32> {
    let mut out = x.to_vec();
    for (o, x) in out.chunks_exact_mut(2 * f).zip(x.chunks_exact(2 * f)) {
        tiles(f, |t0, w| {
            o[2 * t0..2 * t0 + w].copy_from_slice(&x[t0..t0 + w]);
            o[2 * t0 + w..2 * t0 + 2 * w].copy_from_slice(&x[f + t0..f + t0 + w]);
        });
    }
    out
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

    #[test]
    fn interleaved_passes_are_the_natural_bits() {
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (n, f) in [(35, 24), (7, 32), (3, 5)] {
            let x: Vec<f32> = rand_vec(2 * n * f, 3).iter().map(|v| 3.0 * v).collect();
            let dout = rand_vec(n * f, 4);
            let xi = interleave(&x, f);
            let (mut out, mut want) = (vec![0.0; n * f], vec![0.0; n * f]);
            swiglu_forward(&mut want, &x, n, f);
            swiglu_interleaved_forward(&mut out, &xi, n, f);
            assert_eq!(bits(&out), bits(&want), "forward, f {f}");
            let (mut dx, mut want_dx) = (vec![7.0; 2 * n * f], vec![0.0; 2 * n * f]);
            swiglu_backward(&mut want_dx, &dout, &x, n, f);
            swiglu_interleaved_backward(&mut dx, &dout, &xi, n, f);
            assert_eq!(bits(&dx), bits(&want_dx), "backward, f {f}");
            // the fallback of the fused product: natural in, interleaved out
            let (mut pre, mut o) = (x.clone(), vec![0.0; n * f]);
            swiglu_finish_unfused(&mut pre, SwiGluOut::F32(&mut o), n, f);
            assert_eq!(bits(&pre), bits(&xi), "interleaved, f {f}");
            assert_eq!(bits(&o), bits(&want), "fallback out, f {f}");
            // bf16: the kept derivatives give the gradients within rounding of the others
            let (mut grad, mut o16) = (x.clone(), vec![0u16; n * f]);
            swiglu_finish_unfused(&mut grad, SwiGluOut::Bf16(&mut o16), n, f);
            let want16: Vec<u16> = want.iter().map(|&v| bf16_bits(v)).collect();
            assert_eq!(o16, want16, "bf16 out, f {f}");
            swiglu_backward_with_grad(&mut dx, &dout, &grad, n, f);
            let want_dx: Vec<f64> = want_dx.iter().map(|&v| v as f64).collect();
            assert_close(&dx, &want_dx, 1e-5, "backward with grad");
        }
    }

    #[test]
    fn interleaved_backward_matches_finite_differences() {
        let (n, f) = (9, 20);
        let x: Vec<f32> = rand_vec(2 * n * f, 5).iter().map(|v| 3.0 * v).collect();
        let xi = interleave(&x, f);
        let dout = rand_vec(n * f, 6);
        // out as a function of the interleaved input; its gradient, put back in the
        // interleaved order, is what the kernel writes in the natural one
        let reference = |x: &[f64]| -> Vec<f64> {
            let mut out = vec![0.0; n * f];
            for r in 0..n {
                tiles(f, |t0, w| {
                    for j in 0..w {
                        let (g, u) = (x[r * 2 * f + 2 * t0 + j], x[r * 2 * f + 2 * t0 + w + j]);
                        out[r * f + t0 + j] = g / (1.0 + (-g).exp()) * u;
                    }
                });
            }
            out
        };
        let mut dx = vec![0.0; 2 * n * f];
        within_pool(2, || swiglu_interleaved_backward(&mut dx, &dout, &xi, n, f));
        check_grad("dx", &interleave(&dx, f), 0.0, &f64s(&xi), &dout, reference);
    }

    #[test]
    fn fused_products_are_the_unfused_bits() {
        use crate::cpu::{matmul_forward, matmul_swiglu_forward, matmul_swiglu_forward_bf16};
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let mut dtypes = vec![DType::F32];
        if crate::cpu::bf16_supported() {
            dtypes.push(DType::Bf16);
        }
        for dtype in dtypes {
            for threads in [1, 2] {
                // Whole tiles (fused on AVX-512) split by rows and by columns, at splits of
                // 16 columns that are not whole tiles, K past a K block; F off a tile (the
                // fallback).
                for &(n, c, f) in &[
                    (5, 3, 16),
                    (70, 33, 48),
                    (30, 200, 48),
                    (40, 2100, 32),
                    (130, 300, 96),
                    (20, 40, 24),
                ] {
                    let what = format!("{dtype} {threads} threads {n}x{c}x{f}");
                    let inp: Vec<f32> = rand_vec(n * c, 1).iter().map(|v| v * 3.0).collect();
                    let w = rand_vec(c * 2 * f, 2);
                    let (mut pre, mut out) = (vec![0.0; 2 * n * f], vec![0.0; n * f]);
                    let (mut want_pre, mut want) = (vec![0.0; 2 * n * f], vec![0.0; n * f]);
                    let (mut grad, mut out16) = (vec![0.0; 2 * n * f], vec![0u16; n * f]);
                    within_pool(threads, || {
                        matmul_swiglu_forward(dtype, &mut pre, &mut out, &inp, &w, None, n, c, f);
                        matmul_forward(dtype, &mut want_pre, &inp, &w, None, n, c, 2 * f);
                        swiglu_forward(&mut want, &want_pre, n, f);
                        if dtype == DType::Bf16 {
                            // its input in bf16: the bits of the f32 one rounded
                            let inp16: Vec<u16> = inp.iter().map(|&v| bf16_bits(v)).collect();
                            matmul_swiglu_forward_bf16(
                                dtype, &mut grad, &mut out16, &inp16, &w, None, n, c, f,
                            );
                        }
                    });
                    assert_eq!(bits(&pre), bits(&interleave(&want_pre, f)), "pre, {what}");
                    assert_eq!(bits(&out), bits(&want), "out, {what}");
                    if dtype == DType::Bf16 {
                        let want16: Vec<u16> = want.iter().map(|&v| bf16_bits(v)).collect();
                        assert_eq!(out16, want16, "bf16 out, {what}");
                        let mut want_grad = want_pre.clone();
                        for row in want_grad.chunks_exact_mut(2 * f) {
                            let (g, u) = row.split_at_mut(f);
                            for (g, u) in g.iter_mut().zip(u) {
                                (*g, *u) = swiglu_grads(*g, *u);
                            }
                        }
                        let want_grad = interleave(&want_grad, f);
                        assert_eq!(bits(&grad), bits(&want_grad), "kept derivatives, {what}");
                    }
                }
            }
        }
    }

    #[test]
    fn fused_backward_products_are_the_unfused_bits() {
        use crate::cpu::matmul_backward_input;
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let mut dtypes = vec![DType::F32];
        if crate::cpu::bf16_supported() {
            dtypes.push(DType::Bf16);
        }
        for dtype in dtypes {
            for threads in [1, 2] {
                // split by rows and by columns (at 16), F off a tile, K past a K block
                for &(n, c, f) in &[(5, 3, 16), (70, 33, 48), (20, 300, 80), (40, 21, 24)] {
                    let what = format!("{dtype} {threads} threads {n}x{c}x{f}");
                    let pre: Vec<f32> = rand_vec(2 * n * f, 1).iter().map(|v| v * 3.0).collect();
                    let (w, dout) = (rand_vec(f * c, 2), rand_vec(n * c, 3));
                    let mut dact = vec![0.0; n * f];
                    let (mut want_dact, mut want) = (vec![0.0; n * f], vec![0.0; 2 * n * f]);
                    let (mut d1, mut d2, mut want2) = (
                        vec![9.0; 2 * n * f],
                        vec![9.0; 2 * n * f],
                        vec![0.0; 2 * n * f],
                    );
                    within_pool(threads, || {
                        matmul_backward_input(dtype, &mut want_dact, &dout, &w, n, f, c);
                        swiglu_interleaved_backward(&mut want, &want_dact, &pre, n, f);
                        swiglu_backward_with_grad(&mut want2, &want_dact, &pre, n, f);
                        let args = (&dout, &w, &pre);
                        matmul_backward_input_swiglu(
                            dtype, &mut d1, &mut dact, args.0, args.1, args.2, n, f, c,
                        );
                        matmul_backward_input_swiglu_with_grad(
                            dtype, &mut d2, &mut dact, args.0, args.1, args.2, n, f, c,
                        );
                    });
                    assert_eq!(bits(&dact), bits(&want_dact), "d(output), {what}");
                    assert_eq!(bits(&d1), bits(&want), "from pre, {what}");
                    assert_eq!(bits(&d2), bits(&want2), "from kept derivatives, {what}");
                }
            }
        }
    }
}

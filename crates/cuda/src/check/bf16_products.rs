//! The engine's backend on the GPU with bf16 products ([`CudaBackend`] of `DType::Bf16`)
//! against the CPU backend in fp32: an MLP's products as a bf16 model runs them (the product,
//! the LayerNorm writing bf16, the GELU kept in bf16 with its derivative, the product of that
//! bf16 input, its weight gradient), at bf16's tolerance. It has not run on a GPU yet.

use cohort_engine::cpu::Cpu;
use cohort_engine::{Backend, DType, EngineError};

use super::{max_err, rand_vec, CheckRow};
use crate::CudaBackend;

/// What one backend computed: (name, values), in order.
pub(super) type Outputs = Vec<(&'static str, Vec<f32>)>;

/// f32 of bf16 bits.
pub(super) fn widen(bits: &[u16]) -> Vec<f32> {
    bits.iter()
        .map(|&b| f32::from_bits(u32::from(b) << 16))
        .collect()
}

/// The bf16 bits of `x`, rounded to nearest even.
pub(super) fn bf16_bits_of(x: &[f32]) -> Vec<u16> {
    let mut bits = vec![0u16; x.len()];
    cohort_engine::cpu::round_to_bf16(&mut bits, x);
    bits
}

/// The MLP's products on `dev`: its bf16 kernels on a backend of `DType::Bf16`, else the fp32
/// kernels they stand for.
fn sequence(dev: &dyn Backend) -> Result<Outputs, EngineError> {
    let (n, c, f) = (64, 48, 80);
    let bf16 = dev.dtype() == DType::Bf16;
    let host = [
        rand_vec(n * c, 50, 1.0),
        rand_vec(c * f, 51, 0.3),
        rand_vec(f, 52, 0.1),
        rand_vec(f * c, 53, 0.3),
        rand_vec(c, 54, 0.1),
        rand_vec(n * c, 55, 1.0),
        rand_vec(c, 56, 1.0),
        rand_vec(c, 57, 0.1),
    ];
    let sizes = [
        n * c,
        c * f,
        f,
        f * c,
        c,
        n * c,
        c,
        c,
        n * f,
        n * f,
        n * f,
        n * c,
        f * c,
        c,
        n * f,
        n,
        n,
        n * c,
    ];
    // after the views: the bf16 activation (N, F), then the bf16 input (N, C)
    let mut buf = dev.alloc(sizes.iter().sum::<usize>() + n * f + n * c)?;
    let mut rest = buf.view_mut();
    let mut v = Vec::new();
    for len in sizes {
        let (head, tail) = rest.split_at_mut(len);
        v.push(head);
        rest = tail;
    }
    let (out16, x16) = rest.split_at_mut(n * f);
    let (mut out16, mut x16) = (out16.cast::<u16>(), x16.cast::<u16>().into_slice(..n * c));
    for (dst, src) in v.iter_mut().zip(&host) {
        dev.upload(dst.reborrow(), src)?;
    }
    let [x, w1, b1, w2, b2, dy, lnw, lnb, y1, grad, act, y2, dw2, db2, pre, mean, rstd, ln] =
        &mut v[..]
    else {
        unreachable!("eighteen views")
    };
    let (lnw, lnb) = (lnw.as_view(), lnb.as_view());
    let (x, w1, b1, w2, b2, dy) = (
        x.as_view(),
        w1.as_view(),
        b1.as_view(),
        w2.as_view(),
        b2.as_view(),
        dy.as_view(),
    );
    dev.matmul_forward(y1.reborrow(), x, w1, None, n, c, f);
    let mut out16 = out16.slice_mut(..n * f);
    if bf16 {
        let o = out16.reborrow();
        // the MLP's input as a bf16 model writes it: a LayerNorm's output in bf16
        let (m, r) = (mean.reborrow(), rstd.reborrow());
        dev.layernorm_forward_bf16(x16.reborrow(), m, r, x, lnw, Some(lnb), n, c);
        let x16 = x16.as_view();
        dev.matmul_gelu_forward_bf16(grad.reborrow(), o, x16, w1, Some(b1), n, c, f);
        dev.matmul_forward_bf16_input(y2.reborrow(), out16.as_view(), w2, Some(b2), n, f, c);
        let (d, o) = (db2.reborrow(), out16.as_view());
        dev.matmul_backward_weight_bf16_input(dw2.reborrow(), Some(d), dy, o, n, f, c, true);
    } else {
        let (m, r) = (mean.reborrow(), rstd.reborrow());
        dev.layernorm_forward(ln.reborrow(), m, r, x, lnw, Some(lnb), n, c);
        let ln = ln.as_view();
        dev.matmul_gelu_forward(pre.reborrow(), act.reborrow(), ln, w1, Some(b1), n, c, f);
        dev.matmul_forward(y2.reborrow(), act.as_view(), w2, Some(b2), n, f, c);
        let (d, a) = (db2.reborrow(), act.as_view());
        dev.matmul_backward(None, dw2.reborrow(), Some(d), dy, a, w2, n, f, c, true);
        // gelu'(pre) = 1 · gelu'(pre)
        dev.fill(grad.reborrow(), 1.0);
        dev.gelu_backward(grad.reborrow(), pre.as_view());
    }
    dev.sync()?;
    let read = |view: cohort_engine::View<'_, f32>| -> Result<Vec<f32>, EngineError> {
        let mut h = vec![0.0; view.len()];
        dev.download(&mut h, view)?;
        Ok(h)
    };
    let normalised = if bf16 {
        let mut bits = vec![0u16; n * c];
        dev.download(&mut bits, x16.as_view())?;
        widen(&bits)
    } else {
        read(ln.as_view())?
    };
    let activation = if bf16 {
        let mut bits = vec![0u16; n * f];
        dev.download(&mut bits, out16.as_view())?;
        widen(&bits)
    } else {
        read(act.as_view())?
    };
    Ok(vec![
        ("bf16.matmul_forward", read(y1.as_view())?),
        ("bf16.layernorm_forward_bf16.out", normalised),
        ("bf16.matmul_gelu_forward_bf16.grad", read(grad.as_view())?),
        ("bf16.matmul_gelu_forward_bf16.out", activation),
        ("bf16.matmul_forward_bf16_input", read(y2.as_view())?),
        (
            "bf16.matmul_backward_weight_bf16_input.dw",
            read(dw2.as_view())?,
        ),
        (
            "bf16.matmul_backward_weight_bf16_input.dbias",
            read(db2.as_view())?,
        ),
    ])
}

/// The bf16 sequence on `gpu` (switched to bf16 products) against a CPU backend in fp32:
/// one row per output, at bf16's tolerance; then the fused SwiGLU products' bf16 forms.
pub fn engine_backend_bf16(gpu: CudaBackend) -> Vec<CheckRow> {
    let cpu = Cpu::new(1).expect("a one-thread pool");
    let want = sequence(&cpu).expect("the CPU backend cannot fail here");
    let gpu = gpu.with_dtype(DType::Bf16);
    let mut rows = compare("bf16 products", 3e-2, sequence(&gpu), want);
    // and the fused SwiGLU products' bf16 forms
    rows.extend(super::swiglu_products::rows(&gpu));
    rows
}

/// One row per output of `got` against `want` at tolerance `tol`; one failed row named `what`
/// if `got` is an error.
pub(super) fn compare(
    what: &str,
    tol: f64,
    got: Result<Outputs, EngineError>,
    want: Outputs,
) -> Vec<CheckRow> {
    let got = match got {
        Ok(got) => got,
        Err(e) => {
            return vec![CheckRow {
                kernel: what.to_string(),
                max_err: f64::NAN,
                tolerance: tol,
                ok: false,
                error: Some(e.to_string()),
            }]
        }
    };
    got.into_iter()
        .zip(want)
        .map(|((kernel, got), (_, want))| {
            let e = max_err(&got, &want);
            CheckRow {
                kernel: kernel.to_string(),
                max_err: e,
                tolerance: tol,
                ok: e <= tol,
                error: None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_engine::Emulated;

    /// The sequence on the CPU's bf16 kernels (emulated device) against fp32: within bf16's
    /// tolerance, so on a GPU only the GPU's kernels can miss it. Skipped where the CPU has no
    /// bf16 product.
    #[test]
    fn the_bf16_sequence_is_within_tolerance_of_fp32_on_the_cpu() {
        let emu = Emulated::new(2, DType::Bf16).unwrap();
        if emu.dtype() != DType::Bf16 {
            eprintln!("skipped: this CPU has no bf16 product (AVX512_BF16 or AMX)");
            return;
        }
        let want = sequence(&Cpu::new(2).unwrap()).unwrap();
        let rows = compare("bf16 products", 3e-2, sequence(&emu), want);
        assert_eq!(rows.len(), 7);
        for r in rows {
            assert!(r.ok, "{}: {} > {}", r.kernel, r.max_err, r.tolerance);
        }
    }
}

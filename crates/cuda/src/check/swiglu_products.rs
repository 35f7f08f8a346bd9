//! The fused SwiGLU products of the engine's backend on the GPU against the CPU backend in
//! fp32: the MLP's first product with its SwiGLU (the interleaved pre-activation and the
//! output) and the backward product that gives d(SwiGLU input), and on a backend of
//! `DType::Bf16` the forms that keep the output in bf16 with the derivatives beside it, at
//! bf16's tolerance. F is not a multiple of the 16-column tile, so the last tile is narrow. It
//! has not run on a GPU yet.

use cohort_engine::cpu::Cpu;
use cohort_engine::{Backend, DType, EngineError};

use super::bf16_products::{compare, widen, Outputs};
use super::{rand_vec, CheckRow};
use crate::CudaBackend;

/// The fused products on `dev`: the bf16 forms on a backend of `DType::Bf16`, else fp32.
fn sequence(dev: &dyn Backend) -> Result<Outputs, EngineError> {
    let (n, c, f) = (64, 48, 40);
    let bf16 = dev.dtype() == DType::Bf16;
    let host = [
        rand_vec(n * c, 60, 1.0),
        rand_vec(c * 2 * f, 61, 0.3),
        rand_vec(f * c, 62, 0.3),
        rand_vec(n * c, 63, 1.0),
    ];
    // x, w1, w2, dy, pre (or grad), out, dact, dinp; then out's bf16 bits
    let sizes = [
        n * c,
        c * 2 * f,
        f * c,
        n * c,
        2 * n * f,
        n * f,
        n * f,
        2 * n * f,
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
    let mut out16 = out16.slice_mut(..n * f);
    for (dst, src) in v.iter_mut().zip(&host) {
        dev.upload(dst.reborrow(), src)?;
    }
    // the input as the bf16 kernels read it (a normalisation's output under bf16 products)
    dev.upload(
        x16.reborrow(),
        &super::bf16_products::bf16_bits_of(&host[0]),
    )?;
    let [x, w1, w2, dy, pre, out, dact, dinp] = &mut v[..] else {
        unreachable!("eight views")
    };
    let (x, w1, w2, dy) = (x.as_view(), w1.as_view(), w2.as_view(), dy.as_view());
    if bf16 {
        let (o, x16) = (out16.reborrow(), x16.as_view());
        dev.matmul_swiglu_forward_bf16(pre.reborrow(), o, x16, w1, None, n, c, f);
        let (di, da, g) = (dinp.reborrow(), dact.reborrow(), pre.as_view());
        dev.matmul_backward_input_swiglu_with_grad(di, da, dy, w2, g, n, f, c);
    } else {
        dev.matmul_swiglu_forward(pre.reborrow(), out.reborrow(), x, w1, None, n, c, f);
        let (di, da, p) = (dinp.reborrow(), dact.reborrow(), pre.as_view());
        dev.matmul_backward_input_swiglu(di, da, dy, w2, p, n, f, c);
    }
    dev.sync()?;
    let read = |view: cohort_engine::View<'_, f32>| -> Result<Vec<f32>, EngineError> {
        let mut h = vec![0.0; view.len()];
        dev.download(&mut h, view)?;
        Ok(h)
    };
    let activation = if bf16 {
        let mut bits = vec![0u16; n * f];
        dev.download(&mut bits, out16.as_view())?;
        widen(&bits)
    } else {
        read(out.as_view())?
    };
    // the rows are named by the kernels that ran (compare names a row by the GPU's side)
    let (dact, dinp) = (read(dact.as_view())?, read(dinp.as_view())?);
    Ok(if bf16 {
        vec![
            ("swiglu.matmul_swiglu_forward_bf16.out", activation),
            ("swiglu.matmul_backward_input_swiglu_with_grad.dact", dact),
            ("swiglu.matmul_backward_input_swiglu_with_grad.dinp", dinp),
        ]
    } else {
        vec![
            ("swiglu.matmul_swiglu_forward.out", activation),
            ("swiglu.matmul_swiglu_forward.pre", read(pre.as_view())?),
            ("swiglu.matmul_backward_input_swiglu.dact", dact),
            ("swiglu.matmul_backward_input_swiglu.dinp", dinp),
        ]
    })
}

/// The fused products on `gpu` against a CPU backend in fp32: fp32 rows at 1e-4 (cuBLAS sums
/// in its own order), or, on a backend of `DType::Bf16`, the bf16 forms at 3e-2.
pub(super) fn rows(gpu: &CudaBackend) -> Vec<CheckRow> {
    let cpu = Cpu::new(1).expect("a one-thread pool");
    let mut want = sequence(&cpu).expect("the CPU backend cannot fail here");
    let (what, tol) = if gpu.dtype() == DType::Bf16 {
        // the bf16 forms keep the derivatives instead of the pre-activation
        want.retain(|(k, _)| !k.ends_with(".pre"));
        ("swiglu products (bf16)", 3e-2)
    } else {
        ("swiglu products", 1e-4)
    };
    compare(what, tol, sequence(gpu), want)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_engine::Emulated;

    /// The fp32 sequence on the CPU and on the emulated device: the same bits; and its
    /// pre-activation is the interleaved product.
    #[test]
    fn the_sequence_runs_on_a_device_backend() {
        let (cpu, emu) = (Cpu::new(2).unwrap(), Emulated::new(2, DType::F32).unwrap());
        let (a, b) = (sequence(&cpu).unwrap(), sequence(&emu).unwrap());
        assert_eq!(a, b);
        assert_eq!(a.len(), 4);
    }

    /// The bf16 forms (emulated device) against fp32: within bf16's tolerance, so on a GPU
    /// only the GPU's kernels can miss it. Skipped where the CPU has no bf16 product.
    #[test]
    fn the_bf16_forms_are_within_tolerance_of_fp32_on_the_cpu() {
        let emu = Emulated::new(2, DType::Bf16).unwrap();
        if emu.dtype() != DType::Bf16 {
            eprintln!("skipped: this CPU has no bf16 product (AVX512_BF16 or AMX)");
            return;
        }
        let mut want = sequence(&Cpu::new(2).unwrap()).unwrap();
        want.retain(|(k, _)| !k.ends_with(".pre"));
        let rows = compare("swiglu (bf16)", 3e-2, sequence(&emu), want);
        assert_eq!(rows.len(), 3);
        for r in rows {
            assert!(r.ok, "{}: {} > {}", r.kernel, r.max_err, r.tolerance);
        }
    }
}

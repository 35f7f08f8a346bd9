//! The weight-gradient products with `accumulate` false (cuBLAS's beta 0) against the CPU's
//! adding into zeros: what the first backward after a model's lazy `zero_grad` relies on. The
//! GPU's dw starts as NaN, which beta 0 must never read. It has not run on a GPU yet.

use cohort_engine::cpu;
use cohort_engine::DType;

use super::{poisoned, rand_vec, row, Rows};
use crate::Device;

/// One row per product: `matmul_backward`'s and `head_backward`'s dw, overwritten.
pub(super) fn run(dev: &Device, rows: &mut Rows) {
    rows.case("weight gradients overwritten", || {
        let (n, c, oc) = (300, 70, 96);
        let (x, dout) = (rand_vec(n * c, 60, 1.0), rand_vec(n * oc, 61, 1.0));
        let w = rand_vec(c * oc, 62, 1.0);
        let (xd, dd, wd) = (dev.upload(&x)?, dev.upload(&dout)?, dev.upload(&w)?);
        // Conv1D: dw (C, OC) = xᵀ · dout
        let mut dw = poisoned(dev, c * oc)?;
        dev.matmul_backward(None, &mut dw, None, &dd, &xd, &wd, n, c, oc, false)?;
        let mut want_dw = vec![0.0; c * oc];
        let dw_ = &mut want_dw;
        cpu::matmul_backward(DType::F32, None, dw_, None, &dout, &x, &w, n, c, oc, true);
        // The head, V = OC: dw (V, C) = doutᵀ · x (its dinp is checked with the head)
        let (mut dinp, mut dwh) = (poisoned(dev, n * c)?, poisoned(dev, oc * c)?);
        dev.head_backward(&mut dinp, &mut dwh, &dd, &xd, &wd, n, c, oc, false)?;
        let (mut want_dinp, mut want_dwh) = (vec![0.0; n * c], vec![0.0; oc * c]);
        let (di, dw_) = (&mut want_dinp, &mut want_dwh);
        cpu::head_backward(DType::F32, di, dw_, &dout, &x, &w, n, c, oc, true);
        Ok(vec![
            row(
                "matmul_backward.dw overwritten",
                dev.download(&dw)?,
                want_dw,
                1e-5,
            ),
            row(
                "head_backward.dw overwritten",
                dev.download(&dwh)?,
                want_dwh,
                1e-5,
            ),
        ])
    });
}

//! The Llama-style block's kernels against the CPU's: the token embedding alone, RMSNorm, RoPE
//! and SwiGLU (natural and interleaved rows). Tolerances as the parent module's: bitwise for
//! the embedding (the same sums in the same order), float rounding for the rest (sums ordered
//! differently, fused multiply-adds, the math library's exp).

use cohort_engine::cpu::{self, RopeDims};

use super::{poisoned, rand_vec, row, Outputs, Rows};
use crate::{CudaError, Device, SwiGluLayout};

/// Adds the rows of every Llama-style kernel.
pub(super) fn run(dev: &Device, rows: &mut Rows) {
    rows.case("embedding", || embedding(dev));
    rows.case("rmsnorm", || rmsnorm(dev));
    rows.case("rope", || rope(dev));
    for layout in [SwiGluLayout::Natural, SwiGluLayout::Interleaved] {
        rows.case("swiglu", || swiglu(dev, layout));
    }
}

fn embedding(dev: &Device) -> Result<Outputs, CudaError> {
    let (n, c, v) = (111, 80, 50);
    let ids: Vec<u32> = (0..n).map(|i| (i * 7 % v) as u32).collect();
    let (wte, dout, g_te) = (
        rand_vec(v * c, 40, 1.0),
        rand_vec(n * c, 41, 1.0),
        rand_vec(v * c, 42, 1.0),
    );
    let idd = dev.upload(&ids)?;
    let mut out = poisoned(dev, n * c)?;
    dev.embedding_forward(&mut out, &idd, &dev.upload(&wte)?, n, c)?;
    let mut want = vec![0.0; n * c];
    cpu::embedding_forward(&mut want, &ids, &wte, n, c);
    let mut dte = dev.upload(&g_te)?;
    dev.embedding_backward(&mut dte, &dev.upload(&dout)?, &idd, n, c)?;
    let mut want_te = g_te.clone();
    cpu::embedding_backward(&mut want_te, &dout, &ids, n, c);
    Ok(vec![
        row("embedding_forward", dev.download(&out)?, want, 0.0),
        row("embedding_backward", dev.download(&dte)?, want_te, 0.0),
    ])
}

fn rmsnorm(dev: &Device) -> Result<Outputs, CudaError> {
    let (n, c, eps) = (111, 300, 1e-6); // c over a block and not a multiple of 32
    let x: Vec<f32> = rand_vec(n * c, 43, 3.0).iter().map(|v| v + 0.5).collect();
    let (w, dout) = (rand_vec(c, 44, 1.0), rand_vec(n * c, 45, 1.0));
    let (g_in, g_w) = (rand_vec(n * c, 46, 1.0), rand_vec(c, 47, 1.0));
    let (xd, wd, dd) = (dev.upload(&x)?, dev.upload(&w)?, dev.upload(&dout)?);
    let (mut out, mut rstd) = (poisoned(dev, n * c)?, poisoned(dev, n)?);
    dev.rmsnorm_forward(&mut out, &mut rstd, &xd, &wd, eps, n, c)?;
    let (mut w_out, mut w_rstd) = (vec![0.0; n * c], vec![0.0; n]);
    cpu::rmsnorm_forward(&mut w_out, &mut w_rstd, &x, &w, eps, n, c);
    // Backward from the CPU's rstd, so that its row compares backward alone.
    let (mut din, mut dw) = (dev.upload(&g_in)?, dev.upload(&g_w)?);
    let rd = dev.upload(&w_rstd)?;
    dev.rmsnorm_backward(&mut din, &mut dw, &dd, &xd, &rd, &wd, n, c)?;
    let (mut wi, mut ww) = (g_in.clone(), g_w.clone());
    cpu::rmsnorm_backward(&mut wi, &mut ww, &dout, &x, &w_rstd, &w, n, c);
    Ok(vec![
        row("rmsnorm_forward.out", dev.download(&out)?, w_out, 1e-5),
        row("rmsnorm_forward.rstd", dev.download(&rstd)?, w_rstd, 1e-5),
        row("rmsnorm_backward.dinp", dev.download(&din)?, wi, 1e-5),
        row("rmsnorm_backward.dw", dev.download(&dw)?, ww, 1e-5),
    ])
}

fn rope(dev: &Device) -> Result<Outputs, CudaError> {
    // q's 4 heads and k's 2 rotated, v's 2 left alone, in rows of 8 heads.
    let (n, hs, positions) = (111, 64, 40);
    let dims = RopeDims {
        n,
        width: 8 * hs,
        heads: 6,
        hs,
    };
    let inv: Vec<f32> = (0..hs / 2)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / hs as f32))
        .collect();
    let (cos, sin) = cpu::rope_tables(&inv, positions);
    let pos: Vec<u32> = (0..n).map(|i| (i * 7 % positions) as u32).collect();
    let (x, dx) = (
        rand_vec(n * dims.width, 48, 2.0),
        rand_vec(n * dims.width, 49, 1.0),
    );
    let (pd, cd, sd) = (dev.upload(&pos)?, dev.upload(&cos)?, dev.upload(&sin)?);
    let (mut xd, mut dxd) = (dev.upload(&x)?, dev.upload(&dx)?);
    dev.rope_forward(&mut xd, &pd, &cd, &sd, dims)?;
    dev.rope_backward(&mut dxd, &pd, &cd, &sd, dims)?;
    let (mut want_x, mut want_dx) = (x.clone(), dx.clone());
    cpu::rope_forward(&mut want_x, &pos, &cos, &sin, dims);
    cpu::rope_backward(&mut want_dx, &pos, &cos, &sin, dims);
    Ok(vec![
        row("rope_forward", dev.download(&xd)?, want_x, 1e-6),
        row("rope_backward", dev.download(&dxd)?, want_dx, 1e-6),
    ])
}

fn swiglu(dev: &Device, layout: SwiGluLayout) -> Result<Outputs, CudaError> {
    let (n, f) = (111, 40); // F not a multiple of the 16-column tiles: a narrow last tile
    let (x, dout) = (rand_vec(2 * n * f, 50, 4.0), rand_vec(n * f, 51, 1.0));
    let xd = dev.upload(&x)?;
    let mut out = poisoned(dev, n * f)?;
    dev.swiglu_forward(&mut out, &xd, layout, n, f)?;
    let mut din = poisoned(dev, 2 * n * f)?;
    dev.swiglu_backward(&mut din, &dev.upload(&dout)?, &xd, layout, n, f)?;
    let (mut want, mut want_d) = (vec![0.0; n * f], vec![0.0; 2 * n * f]);
    let tag = match layout {
        SwiGluLayout::Natural => {
            cpu::swiglu_forward(&mut want, &x, n, f);
            cpu::swiglu_backward(&mut want_d, &dout, &x, n, f);
            ""
        }
        SwiGluLayout::Interleaved => {
            cpu::swiglu_interleaved_forward(&mut want, &x, n, f);
            cpu::swiglu_interleaved_backward(&mut want_d, &dout, &x, n, f);
            "interleaved_"
        }
    };
    Ok(vec![
        row(
            &format!("swiglu_{tag}forward"),
            dev.download(&out)?,
            want,
            1e-5,
        ),
        row(
            &format!("swiglu_{tag}backward"),
            dev.download(&din)?,
            want_d,
            1e-5,
        ),
    ])
}

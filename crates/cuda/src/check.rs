//! Every CUDA kernel against the CPU engine's function for the same job, on random inputs,
//! with the GPU's outputs poisoned (NaN) beforehand so that an element the kernel forgets to
//! write fails. This is a library function, not a `#[test]`, so that the release binary runs
//! it where there is a GPU and no Rust toolchain (`cohort gpu check`); the crate's tests call
//! it when a GPU is present and skip with a message otherwise.
//!
//! The error of an output is `max |gpu - cpu| / (1 + |cpu|)` over its elements (a NaN or an
//! infinity where the CPU has a number counts as infinite), against a tolerance per kernel:
//! bitwise (0) where the two compute the same operations in the same order (the encoder's
//! backward, the casts), float rounding (1e-5) for fp32 kernels whose sums are ordered
//! differently, and wider where the math library differs (tanh, exp) or the products are bf16.
//! Must never report a row as checked that did not run: a kernel that fails to launch is a row
//! with `ok = false` and the error.

use cohort_engine::cpu::{self, AttnDims};
use cohort_engine::optim::{AdamW, AdamWConfig, DecayMask, Optimizer};
use cohort_engine::{DType, Dropout};
use half::bf16;

use crate::device::Operand;
use crate::{CudaError, Device, Mem};

mod bf16_products;
mod engine;
mod llama;
mod swiglu_products;
mod weight_overwrite;
pub use bf16_products::engine_backend_bf16;
pub use engine::{engine_backend, host_staging};

/// One compared output.
#[derive(Debug, Clone)]
pub struct CheckRow {
    /// "layernorm_forward.out".
    pub kernel: String,
    /// `max |gpu - cpu| / (1 + |cpu|)`; infinite when the GPU left a NaN; NaN when the check
    /// could not run.
    pub max_err: f64,
    /// The largest error that passes.
    pub tolerance: f64,
    /// Whether it passed.
    pub ok: bool,
    /// Why it failed to run, if it did.
    pub error: Option<String>,
}

/// Deterministic values in [-1, 1) times `scale`.
fn rand_vec(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = cohort_rng::SplitMix64::new(seed);
    (0..n)
        .map(|_| (((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale)
        .collect()
}

/// `max |got - want| / (1 + |want|)`; a non-finite `got` against a finite `want` is infinite
/// (both infinite of one sign, as the -inf of an empty softmax, is 0).
pub fn max_err(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let mut worst = 0f64;
    for (&g, &w) in got.iter().zip(want) {
        let e = if g == w {
            0.0
        } else if !g.is_finite() || !w.is_finite() {
            f64::INFINITY
        } else {
            (g as f64 - w as f64).abs() / (1.0 + (w as f64).abs())
        };
        worst = worst.max(e);
    }
    worst
}

/// Collects the rows of one case; a case that errors becomes one failed row named by it.
struct Rows(Vec<CheckRow>);

impl Rows {
    fn case(
        &mut self,
        name: &str,
        f: impl FnOnce() -> Result<Vec<(String, Vec<f32>, Vec<f32>, f64)>, CudaError>,
    ) {
        match f() {
            Ok(outs) => {
                for (kernel, got, want, tolerance) in outs {
                    let e = max_err(&got, &want);
                    self.0.push(CheckRow {
                        kernel,
                        max_err: e,
                        tolerance,
                        ok: e <= tolerance,
                        error: None,
                    });
                }
            }
            Err(e) => self.0.push(CheckRow {
                kernel: name.to_string(),
                max_err: f64::NAN,
                tolerance: 0.0,
                ok: false,
                error: Some(e.to_string()),
            }),
        }
    }
}

/// A NaN-filled device buffer of `n` floats: an output the kernel must overwrite.
fn poisoned(dev: &Device, n: usize) -> Result<cudarc::driver::CudaSlice<f32>, CudaError> {
    dev.upload(&vec![f32::NAN; n])
}

fn row(name: &str, got: Vec<f32>, want: Vec<f32>, tol: f64) -> (String, Vec<f32>, Vec<f32>, f64) {
    (name.to_string(), got, want, tol)
}

/// Runs every check on `dev` and returns one row per compared output.
pub fn run(dev: &Device) -> Vec<CheckRow> {
    let mut rows = Rows(Vec::new());
    elementwise(dev, &mut rows);
    encoder_and_layernorm(dev, &mut rows);
    llama::run(dev, &mut rows);
    crossentropy(dev, &mut rows);
    optim(dev, &mut rows);
    casts_and_matmul(dev, &mut rows);
    weight_overwrite::run(dev, &mut rows);
    // 4 query heads over 4 key/value heads (GPT-2's), 2 (GQA) or 1 (MQA); packed: segment ids.
    // B 2, T 70, head size 48: a few of the kernels' tiles (32 and 16 positions).
    let small = AttnDims {
        b: 2,
        t: 70,
        c: 192,
        nh: 4,
    };
    for (name, mask, dropout, packed, nkv) in [
        ("attention", false, false, false, 4),
        ("attention+mask", true, false, false, 4),
        ("attention+mask+dropout", true, true, false, 4),
        ("attention_gqa+mask+dropout", true, true, false, 2),
        ("attention_mqa+mask", true, false, false, 1),
        ("attention_gqa+mask+packed", true, false, true, 2),
    ] {
        rows.case(name, || {
            attention(dev, name, small, (mask, dropout, packed), nkv)
        });
    }
    // Many tiles along T (7 of forward's, 13 of backward's), a head size that is no multiple
    // of 32 (40) and the largest (128).
    let hd40 = AttnDims {
        b: 2,
        t: 200,
        c: 160,
        nh: 4,
    };
    let hd128 = AttnDims {
        b: 2,
        t: 150,
        c: 256,
        nh: 2,
    };
    for (name, dims, mask, dropout, packed, nkv) in [
        (
            "attention_hd40_t200_gqa+mask+dropout",
            hd40,
            true,
            true,
            false,
            2,
        ),
        ("attention_hd40_t200+packed", hd40, false, false, true, 4),
        ("attention_hd128_t150", hd128, false, false, false, 2),
        (
            "attention_hd128_t150_mqa+mask+packed+dropout",
            hd128,
            true,
            true,
            true,
            1,
        ),
    ] {
        rows.case(name, || {
            attention(dev, name, dims, (mask, dropout, packed), nkv)
        });
    }
    rows.0
}

fn elementwise(dev: &Device, rows: &mut Rows) {
    let n = 100_003; // not a multiple of a block: the tail must be written
    rows.case("fill/scale/add", || {
        let x = rand_vec(n, 1, 2.0);
        let mut out = poisoned(dev, n)?;
        dev.fill(&mut out, 0.5)?;
        let filled = dev.download(&out)?;
        let mut y = dev.upload(&x)?;
        dev.scale(&mut y, -3.0)?;
        dev.add(&mut y, &dev.upload(&x)?)?;
        let want: Vec<f32> = x.iter().map(|v| v * -3.0 + v).collect();
        Ok(vec![
            row("fill_f32", filled, vec![0.5; n], 0.0),
            row("scale_f32+add_f32", dev.download(&y)?, want, 0.0),
        ])
    });
    rows.case("gelu", || {
        let x = rand_vec(n, 2, 5.0);
        let d = rand_vec(n, 3, 1.0);
        let (xd, mut out) = (dev.upload(&x)?, poisoned(dev, n)?);
        dev.gelu_forward(&mut out, &xd)?;
        let mut want = vec![0.0; n];
        cpu::gelu_forward(&mut want, &x);
        let mut dd = dev.upload(&d)?;
        dev.gelu_backward(&mut dd, &xd)?;
        let mut want_d = d.clone();
        cpu::gelu_backward(&mut want_d, &x);
        let mut dg = dev.upload(&d)?;
        dev.gelu_backward_with_grad(&mut dg, &xd)?;
        let want_g: Vec<f32> = d.iter().zip(&x).map(|(a, b)| a * b).collect();
        let (mut pre, mut out2) = (dev.upload(&x)?, poisoned(dev, n)?);
        dev.gelu_forward_and_grad(&mut out2, &mut pre)?;
        let (mut want_out2, mut want_pre) = (vec![0.0; n], x.clone());
        cpu::gelu_forward_and_grad(&mut want_out2, &mut want_pre);
        Ok(vec![
            row("gelu_forward", dev.download(&out)?, want, 1e-5),
            row("gelu_backward", dev.download(&dd)?, want_d, 1e-5),
            row("gelu_backward_with_grad", dev.download(&dg)?, want_g, 0.0),
            row(
                "gelu_forward_and_grad",
                dev.download(&out2)?,
                want_out2,
                1e-5,
            ),
            row(
                "gelu_forward_and_grad (grad)",
                dev.download(&pre)?,
                want_pre,
                1e-5,
            ),
        ])
    });
    rows.case("residual/column_sums", || {
        let (r, c) = (333, 96);
        let (o, res, b) = (
            rand_vec(r * c, 4, 1.0),
            rand_vec(r * c, 5, 1.0),
            rand_vec(c, 6, 1.0),
        );
        let mut od = dev.upload(&o)?;
        dev.residual_forward(&mut od, &dev.upload(&res)?, Some(&dev.upload(&b)?), c, None)?;
        let mut want = o.clone();
        cpu::residual_forward(&mut want, &res, Some(&b), c, None);
        let drop = Dropout {
            p: 0.2,
            key: Dropout::key(7, 1, 3, 2),
        };
        let mut odd = dev.upload(&o)?;
        dev.residual_forward(
            &mut odd,
            &dev.upload(&res)?,
            Some(&dev.upload(&b)?),
            c,
            Some(drop),
        )?;
        let mut want_d = o.clone();
        cpu::residual_forward(&mut want_d, &res, Some(&b), c, Some(drop));
        // Dropout alone at an offset, and its backward.
        let offset = 12_345;
        let mut xd = dev.upload(&o)?;
        dev.dropout_forward(&mut xd, drop, offset)?;
        let mut want_x = o.clone();
        cpu::dropout_forward(&mut want_x, drop, offset);
        let mut dx = poisoned(dev, r * c)?;
        dev.dropout_backward(&mut dx, &dev.upload(&res)?, drop, offset)?;
        let mut want_dx = vec![0.0; r * c];
        cpu::dropout_backward(&mut want_dx, &res, drop, offset);
        let acc0 = rand_vec(c, 7, 1.0);
        let mut acc = dev.upload(&acc0)?;
        dev.column_sums(&mut acc, &dev.upload(&res)?)?;
        let mut want_acc = acc0.clone();
        cpu::column_sums(&mut want_acc, &res);
        Ok(vec![
            row("residual_forward", dev.download(&od)?, want, 0.0),
            row("residual_forward+dropout", dev.download(&odd)?, want_d, 0.0),
            row("dropout_forward", dev.download(&xd)?, want_x, 0.0),
            row("dropout_backward", dev.download(&dx)?, want_dx, 0.0),
            row("column_sums", dev.download(&acc)?, want_acc, 1e-5),
        ])
    });
}

fn encoder_and_layernorm(dev: &Device, rows: &mut Rows) {
    let (b, t, c, v) = (3, 37, 80, 50);
    rows.case("encoder", || {
        let ids: Vec<u32> = (0..b * t).map(|i| (i * 7 % v) as u32).collect();
        let (wte, wpe, dout) = (
            rand_vec(v * c, 8, 1.0),
            rand_vec(t * c, 9, 1.0),
            rand_vec(b * t * c, 10, 1.0),
        );
        let idd = dev.upload(&ids)?;
        let mut out = poisoned(dev, b * t * c)?;
        dev.encoder_forward(
            &mut out,
            &idd,
            &dev.upload(&wte)?,
            &dev.upload(&wpe)?,
            b,
            t,
            c,
        )?;
        let mut want = vec![0.0; b * t * c];
        cpu::encoder_forward(&mut want, &ids, &wte, &wpe, b, t, c);
        let (g_te, g_pe) = (rand_vec(v * c, 11, 1.0), rand_vec(t * c, 12, 1.0));
        let (mut dte, mut dpe) = (dev.upload(&g_te)?, dev.upload(&g_pe)?);
        dev.encoder_backward(&mut dte, &mut dpe, &dev.upload(&dout)?, &idd, b, t, c)?;
        let (mut want_te, mut want_pe) = (g_te.clone(), g_pe.clone());
        cpu::encoder_backward(&mut want_te, &mut want_pe, &dout, &ids, b, t, c);
        Ok(vec![
            row("encoder_forward", dev.download(&out)?, want, 0.0),
            row("encoder_backward.dwte", dev.download(&dte)?, want_te, 0.0),
            row("encoder_backward.dwpe", dev.download(&dpe)?, want_pe, 0.0),
        ])
    });
    rows.case("layernorm", || {
        let n = b * t;
        let c = 200; // not a multiple of 32: the lanes' tails
        let x: Vec<f32> = rand_vec(n * c, 13, 3.0).iter().map(|v| v + 0.5).collect();
        let (w, bias, dout) = (
            rand_vec(c, 14, 1.0),
            rand_vec(c, 15, 1.0),
            rand_vec(n * c, 16, 1.0),
        );
        let (xd, wd, bd) = (dev.upload(&x)?, dev.upload(&w)?, dev.upload(&bias)?);
        let (mut out, mut mean, mut rstd) =
            (poisoned(dev, n * c)?, poisoned(dev, n)?, poisoned(dev, n)?);
        dev.layernorm_forward(&mut out, &mut mean, &mut rstd, &xd, &wd, Some(&bd), n, c)?;
        let (mut w_out, mut w_mean, mut w_rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        cpu::layernorm_forward(
            &mut w_out,
            &mut w_mean,
            &mut w_rstd,
            &x,
            &w,
            Some(&bias),
            n,
            c,
        );
        // Backward from the CPU's mean and rstd, so that it is checked on its own.
        let (g_in, g_w, g_b) = (
            rand_vec(n * c, 17, 1.0),
            rand_vec(c, 18, 1.0),
            rand_vec(c, 19, 1.0),
        );
        let (mut din, mut dw, mut db) = (dev.upload(&g_in)?, dev.upload(&g_w)?, dev.upload(&g_b)?);
        let (md, rd) = (dev.upload(&w_mean)?, dev.upload(&w_rstd)?);
        dev.layernorm_backward(
            &mut din,
            &mut dw,
            Some(&mut db),
            &dev.upload(&dout)?,
            &xd,
            &md,
            &rd,
            &wd,
            n,
            c,
        )?;
        let (mut wi, mut ww, mut wb) = (g_in.clone(), g_w.clone(), g_b.clone());
        cpu::layernorm_backward(
            &mut wi,
            &mut ww,
            Some(&mut wb),
            &dout,
            &x,
            &w_mean,
            &w_rstd,
            &w,
            n,
            c,
        );
        Ok(vec![
            row("layernorm_forward.out", dev.download(&out)?, w_out, 1e-5),
            row("layernorm_forward.mean", dev.download(&mean)?, w_mean, 1e-6),
            row("layernorm_forward.rstd", dev.download(&rstd)?, w_rstd, 1e-5),
            row("layernorm_backward.dinp", dev.download(&din)?, wi, 1e-5),
            row("layernorm_backward.dw", dev.download(&dw)?, ww, 1e-5),
            row("layernorm_backward.db", dev.download(&db)?, wb, 1e-5),
        ])
    });
}

fn crossentropy(dev: &Device, rows: &mut Rows) {
    rows.case("crossentropy", || {
        let (n, v) = (70, 1000);
        let logits = rand_vec(n * v, 20, 4.0);
        let targets: Vec<i32> = (0..n)
            .map(|i| {
                if i % 9 == 4 {
                    -100
                } else {
                    (i * 131 % v) as i32
                }
            })
            .collect();
        let (ld, td) = (dev.upload(&logits)?, dev.upload(&targets)?);
        let (mut losses, mut lse) = (poisoned(dev, n)?, poisoned(dev, n)?);
        dev.crossentropy_forward(&mut losses, &mut lse, &ld, &td, n, v)?;
        let (mut w_loss, mut w_lse) = (vec![0.0; n], vec![0.0; n]);
        cpu::crossentropy_forward(&mut w_loss, &mut w_lse, &logits, &targets, n, v);
        // The same vocabulary in two blocks of columns, 600 then 400.
        let split = 600;
        let cols = |lo: usize, hi: usize| -> Vec<f32> {
            (0..n)
                .flat_map(|i| logits[i * v + lo..i * v + hi].to_vec())
                .collect()
        };
        let (left, right) = (cols(0, split), cols(split, v));
        let (mut blse, mut btl) = (dev.upload(&vec![f32::NEG_INFINITY; n])?, poisoned(dev, n)?);
        let (mut wblse, mut wbtl) = (vec![f32::NEG_INFINITY; n], vec![f32::NAN; n]);
        for (part, v0) in [(&left, 0), (&right, split)] {
            let w = part.len() / n;
            dev.crossentropy_forward_block(&mut blse, &mut btl, &dev.upload(part)?, &td, n, w, v0)?;
            cpu::crossentropy_forward_block(&mut wblse, &mut wbtl, part, &targets, n, w, v0);
        }
        let scale = 1.0 / 61.0;
        let mut dl = dev.upload(&right)?;
        dev.crossentropy_backward(
            &mut dl,
            &dev.upload(&w_lse)?,
            &td,
            scale,
            n,
            v - split,
            split,
        )?;
        let mut wdl = right.clone();
        cpu::crossentropy_backward(&mut wdl, &w_lse, &targets, scale, n, v - split, split);
        // Rows whose target is ignored leave target_logit unwritten on both sides (NaN = NaN).
        let (got_tl, want_tl) = counted_only(&dev.download(&btl)?, &wbtl, &targets);
        // The fold turns the target logits into losses (0 where ignored).
        dev.crossentropy_fold(&mut btl, &blse, &td)?;
        cpu::crossentropy_fold(&mut wbtl, &wblse, &targets);
        Ok(vec![
            row(
                "crossentropy_forward.losses",
                dev.download(&losses)?,
                w_loss,
                1e-5,
            ),
            row("crossentropy_forward.lse", dev.download(&lse)?, w_lse, 1e-5),
            row(
                "crossentropy_forward_block.lse",
                dev.download(&blse)?,
                wblse,
                1e-5,
            ),
            row(
                "crossentropy_forward_block.target_logit",
                got_tl,
                want_tl,
                0.0,
            ),
            row("crossentropy_backward", dev.download(&dl)?, wdl, 1e-5),
            row("crossentropy_fold", dev.download(&btl)?, wbtl, 1e-5),
        ])
    });
}

/// The elements of rows whose target counts.
fn counted_only(got: &[f32], want: &[f32], targets: &[i32]) -> (Vec<f32>, Vec<f32>) {
    let keep = |x: &[f32]| -> Vec<f32> {
        x.iter()
            .zip(targets)
            .filter(|p| *p.1 >= 0)
            .map(|(&x, _)| x)
            .collect()
    };
    (keep(got), keep(want))
}

fn optim(dev: &Device, rows: &mut Rows) {
    rows.case("adamw", || {
        let (n, exempt) = (50_000, 40_000..50_000);
        let cfg = AdamWConfig {
            weight_decay: 0.1,
            ..AdamWConfig::default()
        };
        let mask =
            DecayMask::with_exempt(n, [exempt.clone()]).map_err(|e| CudaError::Unsupported {
                kernel: "adamw_step",
                what: e.to_string(),
            })?;
        let mut opt = AdamW::new(cfg, mask).map_err(|e| CudaError::Unsupported {
            kernel: "adamw_step",
            what: e.to_string(),
        })?;
        let mut params = rand_vec(n, 21, 1.0);
        let mut segs = Vec::new();
        for r in [0..exempt.start, exempt.clone()] {
            segs.push((
                r.clone(),
                dev.upload(&params[r.clone()])?,
                dev.zeros::<f32>(r.len())?,
                dev.zeros::<f32>(r.len())?,
            ));
        }
        for step in 1..=3u64 {
            let lr = 1e-3 * step as f64;
            let grads = rand_vec(n, 100 + step, 0.1);
            opt.step(&mut params, &grads, lr)
                .map_err(|e| CudaError::Unsupported {
                    kernel: "adamw_step",
                    what: e.to_string(),
                })?;
            for (r, p, m, v) in segs.iter_mut() {
                let decayed = r.start == 0;
                let g = dev.upload(&grads[r.clone()])?;
                dev.adamw_step(
                    p,
                    &g,
                    m,
                    v,
                    crate::device::AdamWScalars::new(&cfg, step, lr, decayed),
                )?;
            }
        }
        let mut got_p = Vec::new();
        let mut got_m = Vec::new();
        let mut got_v = Vec::new();
        for (_, p, m, v) in &segs {
            got_p.extend(dev.download(p)?);
            got_m.extend(dev.download(m)?);
            got_v.extend(dev.download(v)?);
        }
        // sqrt and division are correctly rounded on both sides; the CPU's note in
        // optim/kernels.rs allows 1 ulp against PyTorch, so 1 ulp here too.
        Ok(vec![
            row("adamw_step.param", got_p, params.clone(), 2e-7),
            row("adamw_step.exp_avg", got_m, opt.exp_avg().to_vec(), 2e-7),
            row(
                "adamw_step.exp_avg_sq",
                got_v,
                opt.exp_avg_sq().to_vec(),
                2e-7,
            ),
        ])
    });
    rows.case("grad norm", || {
        let g = rand_vec(300_001, 22, 0.01);
        let norm = dev.sum_squares(&dev.upload(&g)?)?.sqrt() as f32;
        let want = cohort_engine::optim::grad_norm(&g);
        Ok(vec![row(
            "sum_squares (grad norm)",
            vec![norm],
            vec![want],
            1e-6,
        )])
    });
}

fn casts_and_matmul(dev: &Device, rows: &mut Rows) {
    rows.case("casts", || {
        let x = rand_vec(10_001, 23, 100.0);
        let mut b = dev.zeros::<bf16>(x.len())?;
        dev.f32_to_bf16(&mut b, &dev.upload(&x)?)?;
        let got: Vec<f32> = dev
            .download(&b)?
            .iter()
            .map(|h| h.to_bits() as f32)
            .collect();
        let mut want_bits = vec![0u16; x.len()];
        cpu::round_to_bf16(&mut want_bits, &x);
        let want: Vec<f32> = want_bits.iter().map(|&h| h as f32).collect();
        let mut back = poisoned(dev, x.len())?;
        dev.bf16_to_f32(&mut back, &b)?;
        let want_back: Vec<f32> = want_bits.iter().map(|&h| cpu::bf16_to_f32(h)).collect();
        Ok(vec![
            row("f32_to_bf16 (bits)", got, want, 0.0),
            row("bf16_to_f32", dev.download(&back)?, want_back, 0.0),
        ])
    });
    rows.case("matmul", || {
        let (n, c, oc) = (129, 96, 200);
        let (x, w, bias) = (
            rand_vec(n * c, 24, 1.0),
            rand_vec(c * oc, 25, 1.0),
            rand_vec(oc, 28, 1.0),
        );
        let (xd, wd) = (dev.upload(&x)?, dev.upload(&w)?);
        let mut out = poisoned(dev, n * oc)?;
        dev.matmul_forward(
            &mut out,
            Operand::F32(&xd),
            Operand::F32(&wd),
            Some(&dev.upload(&bias)?),
            n,
            c,
            oc,
        )?;
        let mut want = vec![0.0; n * oc];
        cpu::matmul_forward(DType::F32, &mut want, &x, &w, Some(&bias), n, c, oc);
        // bf16: the CPU's fp32 product of the bf16-rounded operands is the exact reference up
        // to the order of the f32 sums.
        let round = |v: &[f32]| -> (Vec<bf16>, Vec<f32>) {
            let mut bits = vec![0u16; v.len()];
            cpu::round_to_bf16(&mut bits, v);
            (
                bits.iter().map(|&b| bf16::from_bits(b)).collect(),
                bits.iter().map(|&b| cpu::bf16_to_f32(b)).collect(),
            )
        };
        let ((xb, xr), (wb, wr)) = (round(&x), round(&w));
        let mut outb = poisoned(dev, n * oc)?;
        dev.matmul_forward(
            &mut outb,
            Operand::Bf16(&dev.upload(&xb)?),
            Operand::Bf16(&dev.upload(&wb)?),
            None,
            n,
            c,
            oc,
        )?;
        let mut wantb = vec![0.0; n * oc];
        cpu::matmul_forward(DType::F32, &mut wantb, &xr, &wr, None, n, c, oc);
        // Backward: dinp overwritten, dw and dbias accumulated onto random values.
        let dout = rand_vec(n * oc, 29, 1.0);
        let (g_w, g_b) = (rand_vec(c * oc, 30, 1.0), rand_vec(oc, 31, 1.0));
        let (mut dinp, mut dw, mut db) =
            (poisoned(dev, n * c)?, dev.upload(&g_w)?, dev.upload(&g_b)?);
        dev.matmul_backward(
            Some(&mut dinp),
            &mut dw,
            Some(&mut db),
            &dev.upload(&dout)?,
            &xd,
            &wd,
            n,
            c,
            oc,
            true,
        )?;
        let (mut w_dinp, mut w_dw, mut w_db) = (vec![0.0; n * c], g_w.clone(), g_b.clone());
        cpu::matmul_backward(
            DType::F32,
            Some(&mut w_dinp),
            &mut w_dw,
            Some(&mut w_db),
            &dout,
            &x,
            &w,
            n,
            c,
            oc,
            true,
        );
        let mut dinp2 = poisoned(dev, n * c)?;
        let dd = dev.upload(&dout)?;
        dev.matmul_backward_input(&mut dinp2, Operand::F32(&dd), Operand::F32(&wd), n, c, oc)?;
        let mut w_dinp2 = vec![0.0; n * c];
        cpu::matmul_backward_input(DType::F32, &mut w_dinp2, &dout, &w, n, c, oc);
        let (mut pre, mut act) = (poisoned(dev, n * oc)?, poisoned(dev, n * oc)?);
        dev.matmul_gelu_forward(
            &mut pre,
            &mut act,
            Operand::F32(&xd),
            Operand::F32(&wd),
            Some(&dev.upload(&bias)?),
            n,
            c,
            oc,
        )?;
        let (mut w_pre, mut w_act) = (vec![0.0; n * oc], vec![0.0; n * oc]);
        cpu::matmul_gelu_forward(
            DType::F32,
            &mut w_pre,
            &mut w_act,
            &x,
            &w,
            Some(&bias),
            n,
            c,
            oc,
        );
        Ok(vec![
            row(
                "matmul_backward_input",
                dev.download(&dinp2)?,
                w_dinp2,
                1e-5,
            ),
            row("matmul_gelu_forward.pre", dev.download(&pre)?, w_pre, 1e-5),
            row("matmul_gelu_forward.out", dev.download(&act)?, w_act, 1e-5),
            row(
                "matmul_forward fp32 (COMPUTE_32F)",
                dev.download(&out)?,
                want,
                1e-5,
            ),
            row(
                "matmul_forward bf16 in, f32 out",
                dev.download(&outb)?,
                wantb,
                1e-4,
            ),
            row("matmul_backward.dinp", dev.download(&dinp)?, w_dinp, 1e-5),
            row("matmul_backward.dw", dev.download(&dw)?, w_dw, 1e-5),
            row("matmul_backward.dbias", dev.download(&db)?, w_db, 1e-5),
        ])
    });
    rows.case("head", || {
        let (n, c, v) = (70, 64, 515);
        let (x, w, dout) = (
            rand_vec(n * c, 32, 1.0),
            rand_vec(v * c, 33, 1.0),
            rand_vec(n * v, 34, 1.0),
        );
        let (xd, wd) = (dev.upload(&x)?, dev.upload(&w)?);
        let mut logits = poisoned(dev, n * v)?;
        dev.head_forward(&mut logits, Operand::F32(&xd), Operand::F32(&wd), n, c, v)?;
        let mut want = vec![0.0; n * v];
        cpu::head_forward(DType::F32, &mut want, &x, &w, n, c, v);
        let g_w = rand_vec(v * c, 35, 1.0);
        let (mut dinp, mut dw) = (poisoned(dev, n * c)?, dev.upload(&g_w)?);
        let dout_d = dev.upload(&dout)?;
        dev.head_backward(&mut dinp, &mut dw, &dout_d, &xd, &wd, n, c, v, true)?;
        let (mut w_dinp, mut w_dw) = (vec![0.0; n * c], g_w.clone());
        let (di, dw_) = (&mut w_dinp, &mut w_dw);
        cpu::head_backward(DType::F32, di, dw_, &dout, &x, &w, n, c, v, true);
        Ok(vec![
            row("head_forward", dev.download(&logits)?, want, 1e-5),
            row("head_backward.dinp", dev.download(&dinp)?, w_dinp, 1e-5),
            row("head_backward.dw", dev.download(&dw)?, w_dw, 1e-5),
        ])
    });
}

type Outputs = Vec<(String, Vec<f32>, Vec<f32>, f64)>;

fn attention(
    dev: &Device,
    tag: &str,
    dims: AttnDims,
    (masked, dropped, packed): (bool, bool, bool),
    nkv: usize,
) -> Result<Outputs, CudaError> {
    let AttnDims { b, t, c, nh } = dims;
    // rows of q's NH heads, then k's and v's NKV (GPT-2's 3C when NKV = NH)
    let rs = (nh + 2 * nkv) * (c / nh);
    let qkv = rand_vec(b * t * rs, 26, 1.0);
    let dout = rand_vec(b * t * c, 27, 1.0);
    // Batch row 1 left-padded by 5 (its first queries see no key), row 0 unpadded.
    let mask: Option<Vec<u8>> = masked.then(|| {
        (0..b * t)
            .map(|i| u8::from(!(i / t == 1 && i % t < 5)))
            .collect()
    });
    // Packed rows: row 0 holds runs of 20, 1, 24 and 25 positions, the last reusing the first's
    // id (a run, not an id, is a sequence); row 1 a run of 3 inside its padding (queries that
    // see no key), then runs of 30 and 37; then runs of 37 with ids of their own, the last
    // cut at T.
    let segments: Option<Vec<u32>> = packed.then(|| {
        let runs: [&[(u32, usize)]; 2] = [
            &[(0, 20), (1, 1), (2, 24), (0, 25)],
            &[(5, 3), (6, 30), (7, 37)],
        ];
        (0..b)
            .flat_map(|r| {
                let more = (0..).map(|i| (100 + i, 37));
                runs[r % 2]
                    .iter()
                    .copied()
                    .chain(more)
                    .flat_map(|(id, n)| std::iter::repeat_n(id, n))
                    .take(t)
            })
            .collect()
    });
    let (qd, md, sd) = (
        dev.upload(&qkv)?,
        mask.as_ref().map(|m| dev.upload(m)).transpose()?,
        segments.as_ref().map(|s| dev.upload(s)).transpose()?,
    );
    let drop = dropped.then(|| Dropout {
        p: 0.25,
        key: Dropout::key(3, 0, 5, 1),
    });
    let (mut out, mut lse) = (poisoned(dev, b * t * c)?, poisoned(dev, b * nh * t)?);
    let keys = (
        md.as_ref().map(|m| m as &dyn Mem<u8>),
        sd.as_ref().map(|s| s as &dyn Mem<u32>),
    );
    dev.attention_forward(&mut out, &mut lse, &qd, keys, dims, nkv, drop)?;
    let mut scratch = vec![0.0; cpu::attention_scratch_len(t, 1)];
    let (mut w_out, mut w_lse) = (vec![0.0; b * t * c], vec![0.0; b * nh * t]);
    cpu::attention_forward_grouped(
        DType::F32,
        &mut w_out,
        &mut w_lse,
        &qkv,
        mask.as_deref(),
        segments.as_deref(),
        dims,
        nkv,
        drop,
        &mut scratch,
    );
    let (mut dqkv, mut rout, mut delta) = (
        poisoned(dev, b * t * rs)?,
        poisoned(dev, b * t * c)?,
        poisoned(dev, b * nh * t)?,
    );
    // Backward from the CPU's lse, so that it is checked on its own.
    let wl = dev.upload(&w_lse)?;
    dev.attention_backward(
        &mut dqkv,
        Some(&mut rout),
        &mut delta,
        &dev.upload(&dout)?,
        &qd,
        &wl,
        keys,
        dims,
        nkv,
        drop,
    )?;
    let (mut w_dqkv, mut w_rout) = (vec![0.0; b * t * rs], vec![0.0; b * t * c]);
    cpu::attention_backward_grouped(
        DType::F32,
        &mut w_dqkv,
        Some(&mut w_rout),
        &dout,
        &qkv,
        &w_lse,
        mask.as_deref(),
        segments.as_deref(),
        dims,
        nkv,
        drop,
        &mut scratch,
    );
    Ok(vec![
        row(
            &format!("{tag}_forward.out"),
            dev.download(&out)?,
            w_out,
            1e-5,
        ),
        row(
            &format!("{tag}_forward.lse"),
            dev.download(&lse)?,
            w_lse,
            1e-5,
        ),
        row(
            &format!("{tag}_backward.dqkv"),
            dev.download(&dqkv)?,
            w_dqkv,
            1e-4,
        ),
        row(
            &format!("{tag}_backward.recompute_out"),
            dev.download(&rout)?,
            w_rout,
            1e-5,
        ),
    ])
}

/// The rows as a table: kernel, max error, tolerance, ok; failures with their error below.
pub fn table(rows: &[CheckRow]) -> String {
    let width = rows
        .iter()
        .map(|r| r.kernel.len())
        .max()
        .unwrap_or(6)
        .max(6);
    let mut s = format!(
        "{:<width$}  {:>10}  {:>9}  ok\n",
        "kernel", "max err", "tolerance"
    );
    for r in rows {
        s.push_str(&format!(
            "{:<width$}  {:>10.3e}  {:>9.1e}  {}\n",
            r.kernel,
            r.max_err,
            r.tolerance,
            if r.ok { "ok" } else { "FAIL" }
        ));
        if let Some(e) = &r.error {
            s.push_str(&format!("    error: {e}\n"));
        }
    }
    let failed = rows.iter().filter(|r| !r.ok).count();
    s.push_str(&format!(
        "{} outputs checked, {} failed (error = max |gpu - cpu| / (1 + |cpu|))\n",
        rows.len(),
        failed
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_count_nan_as_infinite_and_matching_infinities_as_equal() {
        assert_eq!(max_err(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert_eq!(max_err(&[f32::NAN], &[1.0]), f64::INFINITY);
        assert_eq!(max_err(&[f32::NEG_INFINITY], &[f32::NEG_INFINITY]), 0.0);
        assert!((max_err(&[1.5], &[1.0]) - 0.25).abs() < 1e-12);
        assert_eq!(max_err(&[1.0], &[1.0, 2.0]), f64::INFINITY);
    }

    #[test]
    fn a_failed_case_is_a_failed_row() {
        let mut rows = Rows(Vec::new());
        rows.case("x", || {
            Err(CudaError::NoDevice {
                ordinal: 0,
                count: 0,
            })
        });
        assert!(!rows.0[0].ok && rows.0[0].error.is_some());
        assert!(table(&rows.0).contains("1 failed"));
    }
}

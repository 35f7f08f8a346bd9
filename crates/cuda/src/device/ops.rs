//! The kernels of `kernels/*.cu` as methods of [`Device`]: each checks its buffers against
//! its dims (a [`CudaError::Shape`] naming the kernel and argument, before any launch), then
//! launches once. Arguments follow the engine's kernel list (crates/engine/src/backend.rs):
//! outputs first, then inputs, weights, dims. Buffers are device buffers; a `None` for an
//! optional one is passed as a null pointer. Must never launch with a buffer shorter than the
//! kernel reads or writes: the unsafe launches rest on these checks.

// Kernels take outputs, inputs, weights and dims explicitly, as llm.c does.
#![allow(clippy::too_many_arguments)]

use cohort_engine::cpu::AttnDims;
use cohort_engine::optim::AdamWConfig;
use cohort_engine::Dropout;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::bf16;

use super::{Device, Mem};
use crate::CudaError;

/// What an attention call's keys are limited by: the padding mask (B, T; 0 = padding) and the
/// segment ids (B, T), each optional.
pub type AttnKeys<'a> = (Option<&'a dyn Mem<u8>>, Option<&'a dyn Mem<u32>>);

/// Launches kernel `$k` with `$cfg` and the arguments (each a reference to a value that lives
/// past the launch: device pointers as `u64`, dims as `i32`/`i64`, scalars as `f32`).
macro_rules! launch {
    ($dev:expr, $k:literal, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let cfg: LaunchConfig = $cfg;
        // SAFETY: the arguments match the kernel's parameters in kernels/*.cu in number,
        // order and type (pointers as u64, `int` as i32, `long long` as i64, `float` as f32),
        // and the caller checked every buffer's length against the dims before this launch.
        unsafe {
            $dev.launch($k, cfg, |a| {
                $( a.arg($arg); )+
            })
        }
    }};
}

mod llama;
pub use llama::SwiGluLayout;

/// Threads per block of the elementwise and row kernels.
const THREADS: u32 = 256;

/// A grid-stride launch over `n` elements.
fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize).clamp(1, 1 << 16) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per row.
fn warp_per_row(rows: usize) -> LaunchConfig {
    let warps = (THREADS / 32) as usize;
    LaunchConfig {
        grid_dim: (rows.div_ceil(warps).max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Threads per block of the attention kernels (ATT_NT in kernels/attention.cu).
const ATT_THREADS: u32 = 128;
/// Queries per block of attention_forward and attention_backward_delta (FWD_Q).
const ATT_FWD_ROWS: usize = 32;
/// Queries (keys) per block of attention_backward_dq (attention_backward_dkv) (BWD_T).
const ATT_BWD_ROWS: usize = 16;

/// An attention kernel's grid: a block per tile of `rows` positions of the `t` and per one of
/// the `heads` (batch, head) pairs (grid y, at most 65535).
fn attn_tiles(
    kernel: &'static str,
    t: usize,
    rows: usize,
    heads: usize,
) -> Result<LaunchConfig, CudaError> {
    if heads > 65535 {
        return Err(CudaError::Unsupported {
            kernel,
            what: format!("{heads} (batch, head) pairs (at most 65535, the grid's y)"),
        });
    }
    Ok(LaunchConfig {
        grid_dim: (int(kernel, "T", t.div_ceil(rows))? as u32, heads as u32, 1),
        block_dim: (ATT_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// One thread per column.
fn thread_per_column(c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.div_ceil(128).max(1) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row.
fn block_per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `got >= need`, else a shape error.
fn check(
    kernel: &'static str,
    arg: &'static str,
    got: usize,
    need: usize,
) -> Result<(), CudaError> {
    if got < need {
        return Err(CudaError::Shape {
            kernel,
            arg,
            need,
            got,
        });
    }
    Ok(())
}

/// A dim as the kernels' `int`.
fn int(kernel: &'static str, what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Unsupported {
        kernel,
        what: format!("{what} = {v} does not fit a 32-bit int"),
    })
}

/// The scalars of one AdamW step, rounded to f32 as the CPU's `AdamW::step` rounds them
/// (crates/engine/src/optim/adamw.rs): f64 arithmetic on the hyperparameters, one rounding
/// where each meets the f32 buffers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWScalars {
    /// `1 - lr * weight_decay` (1 for segments without decay).
    pub decay: f32,
    /// `1 - beta1`.
    pub lerp_w: f32,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bc2_sqrt: f32,
    /// `eps`.
    pub eps: f32,
    /// `-lr / (1 - beta1^t)`.
    pub neg_step_size: f32,
}

impl AdamWScalars {
    /// The scalars of step `step` (1-based) at learning rate `lr`, for a segment that is
    /// decayed or not.
    pub fn new(cfg: &AdamWConfig, step: u64, lr: f64, decayed: bool) -> AdamWScalars {
        let t = step as f64;
        let bias_correction1 = 1.0 - cfg.beta1.powf(t);
        let bias_correction2 = 1.0 - cfg.beta2.powf(t);
        AdamWScalars {
            decay: if decayed && cfg.weight_decay != 0.0 {
                (1.0 - lr * cfg.weight_decay) as f32
            } else {
                1.0
            },
            lerp_w: (1.0 - cfg.beta1) as f32,
            beta2: cfg.beta2 as f32,
            one_minus_beta2: (1.0 - cfg.beta2) as f32,
            bc2_sqrt: bias_correction2.sqrt() as f32,
            eps: cfg.eps as f32,
            neg_step_size: (-(lr / bias_correction1)) as f32,
        }
    }
}

impl Device {
    /// The raw device pointer of `s`, or 0 (null) for `None`.
    fn opt<T>(&self, s: Option<&dyn Mem<T>>) -> u64 {
        s.map_or(0, |s| s.ptr(self))
    }

    /// out = value.
    pub fn fill(&self, out: &mut dyn Mem<f32>, value: f32) -> Result<(), CudaError> {
        let (o, n) = (out.ptr(self), out.len() as i64);
        launch!(self, "fill_f32", elementwise(out.len()), &o, &value, &n)
    }

    /// x *= s.
    pub fn scale(&self, x: &mut dyn Mem<f32>, s: f32) -> Result<(), CudaError> {
        let (p, n) = (x.ptr(self), x.len() as i64);
        launch!(self, "scale_f32", elementwise(x.len()), &p, &s, &n)
    }

    /// out += x.
    pub fn add(&self, out: &mut dyn Mem<f32>, x: &dyn Mem<f32>) -> Result<(), CudaError> {
        check("add_f32", "x", x.len(), out.len())?;
        let (o, xp, n) = (out.ptr(self), x.ptr(self), out.len() as i64);
        launch!(self, "add_f32", elementwise(out.len()), &o, &xp, &n)
    }

    /// out = gelu(inp) (tanh form).
    pub fn gelu_forward(
        &self,
        out: &mut dyn Mem<f32>,
        inp: &dyn Mem<f32>,
    ) -> Result<(), CudaError> {
        check("gelu_forward", "inp", inp.len(), out.len())?;
        let (o, i, n) = (out.ptr(self), inp.ptr(self), out.len() as i64);
        launch!(self, "gelu_forward", elementwise(out.len()), &o, &i, &n)
    }

    /// dinout *= gelu'(inp).
    pub fn gelu_backward(
        &self,
        dinout: &mut dyn Mem<f32>,
        inp: &dyn Mem<f32>,
    ) -> Result<(), CudaError> {
        check("gelu_backward", "inp", inp.len(), dinout.len())?;
        let (d, i, n) = (dinout.ptr(self), inp.ptr(self), dinout.len() as i64);
        launch!(self, "gelu_backward", elementwise(dinout.len()), &d, &i, &n)
    }

    /// out = gelu(pre), then pre = gelu'(pre), in one pass.
    pub fn gelu_forward_and_grad(
        &self,
        out: &mut dyn Mem<f32>,
        pre: &mut dyn Mem<f32>,
    ) -> Result<(), CudaError> {
        check("gelu_forward_and_grad", "pre", pre.len(), out.len())?;
        let (o, p, n) = (out.ptr(self), pre.ptr(self), out.len() as i64);
        launch!(
            self,
            "gelu_forward_and_grad",
            elementwise(out.len()),
            &o,
            &p,
            &n
        )
    }

    /// dinout *= grad (GELU's derivative, kept by the forward).
    pub fn gelu_backward_with_grad(
        &self,
        dinout: &mut dyn Mem<f32>,
        grad: &dyn Mem<f32>,
    ) -> Result<(), CudaError> {
        check("gelu_backward_with_grad", "grad", grad.len(), dinout.len())?;
        let (d, g, n) = (dinout.ptr(self), grad.ptr(self), dinout.len() as i64);
        launch!(
            self,
            "gelu_backward_with_grad",
            elementwise(dinout.len()),
            &d,
            &g,
            &n
        )
    }

    /// out = residual + dropout(out + bias), rows of `c`; dropout element `i` is the flat
    /// index in `out`.
    pub fn residual_forward(
        &self,
        out: &mut dyn Mem<f32>,
        residual: &dyn Mem<f32>,
        bias: Option<&dyn Mem<f32>>,
        c: usize,
        dropout: Option<Dropout>,
    ) -> Result<(), CudaError> {
        const K: &str = "residual_forward";
        check(K, "residual", residual.len(), out.len())?;
        if let Some(b) = bias {
            check(K, "bias", b.len(), c)?;
        }
        if c == 0 || !out.len().is_multiple_of(c) {
            return Err(CudaError::Unsupported {
                kernel: K,
                what: format!("{} elements are not rows of c = {c}", out.len()),
            });
        }
        let (o, r, b) = (out.ptr(self), residual.ptr(self), self.opt(bias));
        let (ci, n) = (int(K, "c", c)?, out.len() as i64);
        let (p, key) = dropout.map_or((0.0f32, 0u64), |d| (d.p, d.key));
        launch!(
            self,
            "residual_forward",
            elementwise(out.len()),
            &o,
            &r,
            &b,
            &ci,
            &n,
            &p,
            &key
        )
    }

    /// x = dropout(x), element `i` keyed by `offset + i`.
    pub fn dropout_forward(
        &self,
        x: &mut dyn Mem<f32>,
        d: Dropout,
        offset: u64,
    ) -> Result<(), CudaError> {
        let (xp, n, off) = (x.ptr(self), x.len() as i64, offset as i64);
        launch!(
            self,
            "dropout_forward",
            elementwise(x.len()),
            &xp,
            &d.p,
            &d.key,
            &off,
            &n
        )
    }

    /// dx = dropout's mask and scale applied to dy (overwritten).
    pub fn dropout_backward(
        &self,
        dx: &mut dyn Mem<f32>,
        dy: &dyn Mem<f32>,
        d: Dropout,
        offset: u64,
    ) -> Result<(), CudaError> {
        check("dropout_backward", "dy", dy.len(), dx.len())?;
        let (dxp, dyp, n, off) = (dx.ptr(self), dy.ptr(self), dx.len() as i64, offset as i64);
        launch!(
            self,
            "dropout_backward",
            elementwise(dx.len()),
            &dxp,
            &dyp,
            &d.p,
            &d.key,
            &off,
            &n
        )
    }

    /// out += bias over rows of c = bias's length.
    pub fn add_bias(&self, out: &mut dyn Mem<f32>, bias: &dyn Mem<f32>) -> Result<(), CudaError> {
        const K: &str = "add_bias_f32";
        let c = bias.len();
        if c == 0 || !out.len().is_multiple_of(c) {
            return Err(CudaError::Unsupported {
                kernel: K,
                what: format!("{} elements are not rows of c = {c}", out.len()),
            });
        }
        let (o, b) = (out.ptr(self), bias.ptr(self));
        let (ci, n) = (int(K, "c", c)?, out.len() as i64);
        launch!(
            self,
            "add_bias_f32",
            elementwise(out.len()),
            &o,
            &b,
            &ci,
            &n
        )
    }

    /// acc (c) += Σ_rows x (rows, c), with c = acc's length.
    pub fn column_sums(&self, acc: &mut dyn Mem<f32>, x: &dyn Mem<f32>) -> Result<(), CudaError> {
        const K: &str = "column_sums";
        let c = acc.len();
        if c == 0 || !x.len().is_multiple_of(c) {
            return Err(CudaError::Unsupported {
                kernel: K,
                what: format!("{} elements are not rows of c = {c}", x.len()),
            });
        }
        let (a, xp) = (acc.ptr(self), x.ptr(self));
        let (rows, ci) = (int(K, "rows", x.len() / c)?, int(K, "c", c)?);
        launch!(
            self,
            "column_sums",
            thread_per_column(c),
            &a,
            &xp,
            &rows,
            &ci
        )
    }

    /// out (B,T,C) = wte[ids] + wpe[t].
    pub fn encoder_forward(
        &self,
        out: &mut dyn Mem<f32>,
        ids: &dyn Mem<u32>,
        wte: &dyn Mem<f32>,
        wpe: &dyn Mem<f32>,
        b: usize,
        t: usize,
        c: usize,
    ) -> Result<(), CudaError> {
        const K: &str = "encoder_forward";
        check(K, "out", out.len(), b * t * c)?;
        check(K, "ids", ids.len(), b * t)?;
        check(K, "wpe", wpe.len(), t * c)?;
        check(K, "wte", wte.len(), c)?;
        let (o, i, te, pe) = (out.ptr(self), ids.ptr(self), wte.ptr(self), wpe.ptr(self));
        let (bi, ti, ci) = (int(K, "B", b)?, int(K, "T", t)?, int(K, "C", c)?);
        launch!(
            self,
            "encoder_forward",
            elementwise(b * t * c),
            &o,
            &i,
            &te,
            &pe,
            &bi,
            &ti,
            &ci
        )
    }

    /// dwte[ids] += dout, dwpe[t] += dout. The ids must be rows of dwte (the caller checked
    /// them against the vocabulary, as the model does on the CPU).
    pub fn encoder_backward(
        &self,
        dwte: &mut dyn Mem<f32>,
        dwpe: &mut dyn Mem<f32>,
        dout: &dyn Mem<f32>,
        ids: &dyn Mem<u32>,
        b: usize,
        t: usize,
        c: usize,
    ) -> Result<(), CudaError> {
        const K: &str = "encoder_backward";
        check(K, "dout", dout.len(), b * t * c)?;
        check(K, "ids", ids.len(), b * t)?;
        check(K, "dwpe", dwpe.len(), t * c)?;
        check(K, "dwte", dwte.len(), c)?;
        let (te, pe, d, i) = (
            dwte.ptr(self),
            dwpe.ptr(self),
            dout.ptr(self),
            ids.ptr(self),
        );
        let (bi, ti, ci) = (int(K, "B", b)?, int(K, "T", t)?, int(K, "C", c)?);
        launch!(
            self,
            "encoder_backward",
            thread_per_column(c),
            &te,
            &pe,
            &d,
            &i,
            &bi,
            &ti,
            &ci
        )
    }

    /// LayerNorm over C of N rows; mean and rstd (N) for backward.
    pub fn layernorm_forward(
        &self,
        out: &mut dyn Mem<f32>,
        mean: &mut dyn Mem<f32>,
        rstd: &mut dyn Mem<f32>,
        inp: &dyn Mem<f32>,
        w: &dyn Mem<f32>,
        b: Option<&dyn Mem<f32>>,
        n: usize,
        c: usize,
    ) -> Result<(), CudaError> {
        const K: &str = "layernorm_forward";
        check(K, "out", out.len(), n * c)?;
        check(K, "inp", inp.len(), n * c)?;
        check(K, "mean", mean.len(), n)?;
        check(K, "rstd", rstd.len(), n)?;
        check(K, "w", w.len(), c)?;
        if let Some(b) = b {
            check(K, "b", b.len(), c)?;
        }
        let (o, m, r, x, wp, bp) = (
            out.ptr(self),
            mean.ptr(self),
            rstd.ptr(self),
            inp.ptr(self),
            w.ptr(self),
            self.opt(b),
        );
        let (ni, ci) = (int(K, "N", n)?, int(K, "C", c)?);
        launch!(
            self,
            "layernorm_forward",
            warp_per_row(n),
            &o,
            &m,
            &r,
            &x,
            &wp,
            &bp,
            &ni,
            &ci
        )
    }

    /// dinp, dw, db += LayerNorm backward (two launches: rows, then columns).
    pub fn layernorm_backward(
        &self,
        dinp: &mut dyn Mem<f32>,
        dw: &mut dyn Mem<f32>,
        db: Option<&mut dyn Mem<f32>>,
        dout: &dyn Mem<f32>,
        inp: &dyn Mem<f32>,
        mean: &dyn Mem<f32>,
        rstd: &dyn Mem<f32>,
        w: &dyn Mem<f32>,
        n: usize,
        c: usize,
    ) -> Result<(), CudaError> {
        const K: &str = "layernorm_backward";
        check(K, "dinp", dinp.len(), n * c)?;
        check(K, "dout", dout.len(), n * c)?;
        check(K, "inp", inp.len(), n * c)?;
        check(K, "mean", mean.len(), n)?;
        check(K, "rstd", rstd.len(), n)?;
        check(K, "w", w.len(), c)?;
        check(K, "dw", dw.len(), c)?;
        if let Some(db) = db.as_deref() {
            check(K, "db", db.len(), c)?;
        }
        let (di, d, x, m, r, wp) = (
            dinp.ptr(self),
            dout.ptr(self),
            inp.ptr(self),
            mean.ptr(self),
            rstd.ptr(self),
            w.ptr(self),
        );
        let (dwp, dbp) = (dw.ptr(self), self.opt(db.as_deref()));
        let (ni, ci) = (int(K, "N", n)?, int(K, "C", c)?);
        launch!(
            self,
            "layernorm_backward_input",
            warp_per_row(n),
            &di,
            &d,
            &x,
            &m,
            &r,
            &wp,
            &ni,
            &ci
        )?;
        launch!(
            self,
            "layernorm_backward_params",
            thread_per_column(c),
            &dwp,
            &dbp,
            &d,
            &x,
            &m,
            &r,
            &ni,
            &ci
        )
    }

    /// Per-row loss (0 for ignored targets) and log-sum-exp over the whole vocabulary.
    pub fn crossentropy_forward(
        &self,
        losses: &mut dyn Mem<f32>,
        lse: &mut dyn Mem<f32>,
        logits: &dyn Mem<f32>,
        targets: &dyn Mem<i32>,
        n: usize,
        v: usize,
    ) -> Result<(), CudaError> {
        const K: &str = "crossentropy_forward";
        check(K, "losses", losses.len(), n)?;
        check(K, "lse", lse.len(), n)?;
        check(K, "logits", logits.len(), n * v)?;
        check(K, "targets", targets.len(), n)?;
        let (l, s, x, t) = (
            losses.ptr(self),
            lse.ptr(self),
            logits.ptr(self),
            targets.ptr(self),
        );
        let (ni, vi) = (int(K, "N", n)?, int(K, "V", v)?);
        launch!(
            self,
            "crossentropy_forward",
            block_per_row(n),
            &l,
            &s,
            &x,
            &t,
            &ni,
            &vi
        )
    }

    /// One block of vocabulary columns v0..v0+v: lse (start at -inf) takes in the block's
    /// log-sum-exp, target_logit the target's logit where it is in the block.
    pub fn crossentropy_forward_block(
        &self,
        lse: &mut dyn Mem<f32>,
        target_logit: &mut dyn Mem<f32>,
        logits: &dyn Mem<f32>,
        targets: &dyn Mem<i32>,
        n: usize,
        v: usize,
        v0: usize,
    ) -> Result<(), CudaError> {
        const K: &str = "crossentropy_forward_block";
        check(K, "lse", lse.len(), n)?;
        check(K, "target_logit", target_logit.len(), n)?;
        check(K, "logits", logits.len(), n * v)?;
        check(K, "targets", targets.len(), n)?;
        let (s, tl, x, t) = (
            lse.ptr(self),
            target_logit.ptr(self),
            logits.ptr(self),
            targets.ptr(self),
        );
        let (ni, vi, v0i) = (int(K, "N", n)?, int(K, "V", v)?, int(K, "v0", v0)?);
        launch!(
            self,
            "crossentropy_forward_block",
            block_per_row(n),
            &s,
            &tl,
            &x,
            &t,
            &ni,
            &vi,
            &v0i
        )
    }

    /// The logits become dlogits = scale * (softmax - onehot) for columns v0..v0+v, in place.
    #[allow(clippy::too_many_arguments)]
    pub fn crossentropy_backward(
        &self,
        logits: &mut dyn Mem<f32>,
        lse: &dyn Mem<f32>,
        targets: &dyn Mem<i32>,
        scale: f32,
        n: usize,
        v: usize,
        v0: usize,
    ) -> Result<(), CudaError> {
        const K: &str = "crossentropy_backward";
        check(K, "logits", logits.len(), n * v)?;
        check(K, "lse", lse.len(), n)?;
        check(K, "targets", targets.len(), n)?;
        let (x, s, t) = (logits.ptr(self), lse.ptr(self), targets.ptr(self));
        let (ni, vi, v0i) = (int(K, "N", n)?, int(K, "V", v)?, int(K, "v0", v0)?);
        launch!(
            self,
            "crossentropy_backward",
            elementwise(n * v),
            &x,
            &s,
            &t,
            &scale,
            &ni,
            &vi,
            &v0i
        )
    }

    /// After [`Device::crossentropy_forward_block`] over every block: `losses` holds each
    /// row's target logit and becomes its loss, lse - target logit (0 where ignored).
    pub fn crossentropy_fold(
        &self,
        losses: &mut dyn Mem<f32>,
        lse: &dyn Mem<f32>,
        targets: &dyn Mem<i32>,
    ) -> Result<(), CudaError> {
        const K: &str = "crossentropy_fold";
        let n = losses.len();
        check(K, "lse", lse.len(), n)?;
        check(K, "targets", targets.len(), n)?;
        let (l, s, t, ni) = (
            losses.ptr(self),
            lse.ptr(self),
            targets.ptr(self),
            int(K, "N", n)?,
        );
        launch!(self, "crossentropy_fold", elementwise(n), &l, &s, &t, &ni)
    }

    /// One AdamW step over a segment of fp32 master weights `p` with gradients `g` and
    /// moments `m`, `v` (all of one length).
    pub fn adamw_step(
        &self,
        p: &mut dyn Mem<f32>,
        g: &dyn Mem<f32>,
        m: &mut dyn Mem<f32>,
        v: &mut dyn Mem<f32>,
        s: AdamWScalars,
    ) -> Result<(), CudaError> {
        const K: &str = "adamw_step";
        let n = p.len();
        check(K, "g", g.len(), n)?;
        check(K, "m", m.len(), n)?;
        check(K, "v", v.len(), n)?;
        let (pp, gp, mp, vp, ni) = (p.ptr(self), g.ptr(self), m.ptr(self), v.ptr(self), n as i64);
        launch!(
            self,
            "adamw_step",
            elementwise(n),
            &pp,
            &gp,
            &mp,
            &vp,
            &ni,
            &s.decay,
            &s.lerp_w,
            &s.beta2,
            &s.one_minus_beta2,
            &s.bc2_sqrt,
            &s.eps,
            &s.neg_step_size
        )
    }

    /// Σ x² in f64, in a fixed order (blocks of 2^16 elements, then the blocks in order);
    /// waits for the result.
    pub fn sum_squares(&self, x: &dyn Mem<f32>) -> Result<f64, CudaError> {
        const PER_BLOCK: usize = 1 << 16;
        let blocks = x.len().div_ceil(PER_BLOCK).max(1);
        let partial = self.zeros::<f64>(blocks)?;
        let total = self.zeros::<f64>(1)?;
        let (pp, xp, n, per) = (
            partial.ptr(self),
            x.ptr(self),
            x.len() as i64,
            PER_BLOCK as i64,
        );
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(self, "sum_squares_partial", cfg, &pp, &xp, &n, &per)?;
        let (tp, nb) = (total.ptr(self), int("sum_f64", "blocks", blocks)?);
        launch!(self, "sum_f64", block_per_row(1), &tp, &pp, &nb)?;
        // The download waits for both kernels, so `partial` outlives its last use.
        Ok(self.download(&total)?[0])
    }

    /// out = bf16(inp), round to nearest even.
    pub fn f32_to_bf16(
        &self,
        out: &mut dyn Mem<bf16>,
        inp: &dyn Mem<f32>,
    ) -> Result<(), CudaError> {
        check("f32_to_bf16", "inp", inp.len(), out.len())?;
        let (o, i, n) = (out.ptr(self), inp.ptr(self), out.len() as i64);
        launch!(self, "f32_to_bf16", elementwise(out.len()), &o, &i, &n)
    }

    /// out = f32(inp).
    pub fn bf16_to_f32(
        &self,
        out: &mut dyn Mem<f32>,
        inp: &dyn Mem<bf16>,
    ) -> Result<(), CudaError> {
        check("bf16_to_f32", "inp", inp.len(), out.len())?;
        let (o, i, n) = (out.ptr(self), inp.ptr(self), out.len() as i64);
        launch!(self, "bf16_to_f32", elementwise(out.len()), &o, &i, &n)
    }

    /// The dims of an attention call with `nkv` key/value heads as the kernels take them,
    /// checked (head size at most 128, NKV dividing NH), and the qkv row length
    /// (NH + 2·NKV)·HS.
    fn attn_dims(
        kernel: &'static str,
        d: AttnDims,
        nkv: usize,
    ) -> Result<([i32; 5], usize), CudaError> {
        if d.nh == 0 || !d.c.is_multiple_of(d.nh) || d.c / d.nh > 128 {
            return Err(CudaError::Unsupported {
                kernel,
                what: format!(
                    "C = {} over {} heads (head size must divide C and be <= 128)",
                    d.c, d.nh
                ),
            });
        }
        if nkv == 0 || !d.nh.is_multiple_of(nkv) {
            return Err(CudaError::Unsupported {
                kernel,
                what: format!(
                    "{} query heads do not split into groups over {nkv} key/value heads",
                    d.nh
                ),
            });
        }
        let dims = [
            int(kernel, "B", d.b)?,
            int(kernel, "T", d.t)?,
            int(kernel, "C", d.c)?,
            int(kernel, "NH", d.nh)?,
            int(kernel, "NKV", nkv)?,
        ];
        Ok((dims, (d.nh + 2 * nkv) * (d.c / d.nh)))
    }

    /// The key padding mask and segment ids of an attention call, checked against its B·T
    /// positions, as the kernels take them (null pointers for None).
    fn attn_keys(
        &self,
        kernel: &'static str,
        (mask, segments): AttnKeys<'_>,
        n: usize,
    ) -> Result<(u64, u64), CudaError> {
        if let Some(m) = mask {
            check(kernel, "mask", m.len(), n)?;
        }
        if let Some(s) = segments {
            check(kernel, "segments", s.len(), n)?;
        }
        Ok((self.opt(mask), self.opt(segments)))
    }

    /// Causal attention with an optional key padding mask (B, T; 0 = padding), optional
    /// segment ids (B, T; a query sees only the keys of its run of equal ids, causally, as the
    /// CPU's segment_start) and dropout on the probabilities (numbered as the CPU's); lse
    /// (B, NH, T) kept for backward. qkv is (B, T, (NH + 2·NKV)·HS) with `nkv` key/value heads
    /// (NKV = NH: (B, T, 3C)).
    pub fn attention_forward(
        &self,
        out: &mut dyn Mem<f32>,
        lse: &mut dyn Mem<f32>,
        qkv: &dyn Mem<f32>,
        (mask, segments): AttnKeys<'_>,
        dims: AttnDims,
        nkv: usize,
        dropout: Option<Dropout>,
    ) -> Result<(), CudaError> {
        const K: &str = "attention_forward";
        let AttnDims { b, t, c, nh } = dims;
        let ([bi, ti, ci, hi, kvi], rs) = Self::attn_dims(K, dims, nkv)?;
        check(K, "out", out.len(), b * t * c)?;
        check(K, "lse", lse.len(), b * nh * t)?;
        check(K, "qkv", qkv.len(), b * t * rs)?;
        let (m, sg) = self.attn_keys(K, (mask, segments), b * t)?;
        let (o, l, q) = (out.ptr(self), lse.ptr(self), qkv.ptr(self));
        let (p, key) = dropout.map_or((0.0f32, 0u64), |d| (d.p, d.key));
        if b * t == 0 {
            return Ok(()); // nothing to attend; a grid of no blocks is not a launch
        }
        launch!(
            self,
            "attention_forward",
            attn_tiles(K, t, ATT_FWD_ROWS, b * nh)?,
            &o,
            &l,
            &q,
            &m,
            &sg,
            &bi,
            &ti,
            &ci,
            &hi,
            &kvi,
            &p,
            &key
        )
    }

    /// dqkv (qkv's layout) = attention backward (overwritten), each key/value head's gradient
    /// summed over its query group; `recompute_out` gets the forward's
    /// output again when given; `delta` is scratch of B·NH·T floats.
    pub fn attention_backward(
        &self,
        dqkv: &mut dyn Mem<f32>,
        recompute_out: Option<&mut dyn Mem<f32>>,
        delta: &mut dyn Mem<f32>,
        dout: &dyn Mem<f32>,
        qkv: &dyn Mem<f32>,
        lse: &dyn Mem<f32>,
        (mask, segments): AttnKeys<'_>,
        dims: AttnDims,
        nkv: usize,
        dropout: Option<Dropout>,
    ) -> Result<(), CudaError> {
        const K: &str = "attention_backward";
        let AttnDims { b, t, c, nh } = dims;
        let ([bi, ti, ci, hi, kvi], rs) = Self::attn_dims(K, dims, nkv)?;
        check(K, "dqkv", dqkv.len(), b * t * rs)?;
        if let Some(r) = recompute_out.as_deref() {
            check(K, "recompute_out", r.len(), b * t * c)?;
        }
        check(K, "delta", delta.len(), b * nh * t)?;
        check(K, "dout", dout.len(), b * t * c)?;
        check(K, "qkv", qkv.len(), b * t * rs)?;
        check(K, "lse", lse.len(), b * nh * t)?;
        let (m, sg) = self.attn_keys(K, (mask, segments), b * t)?;
        let (dq, ro, de) = (
            dqkv.ptr(self),
            self.opt(recompute_out.as_deref()),
            delta.ptr(self),
        );
        let (d, q, l) = (dout.ptr(self), qkv.ptr(self), lse.ptr(self));
        let (p, key) = dropout.map_or((0.0f32, 0u64), |d| (d.p, d.key));
        if b * t == 0 {
            return Ok(()); // nothing to attend; a grid of no blocks is not a launch
        }
        // delta first; dq and dk/dv read it and write disjoint columns of dqkv
        launch!(
            self,
            "attention_backward_delta",
            attn_tiles(K, t, ATT_FWD_ROWS, b * nh)?,
            &ro,
            &de,
            &d,
            &q,
            &l,
            &m,
            &sg,
            &bi,
            &ti,
            &ci,
            &hi,
            &kvi,
            &p,
            &key
        )?;
        launch!(
            self,
            "attention_backward_dq",
            attn_tiles(K, t, ATT_BWD_ROWS, b * nh)?,
            &dq,
            &de,
            &d,
            &q,
            &l,
            &m,
            &sg,
            &bi,
            &ti,
            &ci,
            &hi,
            &kvi,
            &p,
            &key
        )?;
        launch!(
            self,
            "attention_backward_dkv",
            attn_tiles(K, t, ATT_BWD_ROWS, b * nkv)?,
            &dq,
            &de,
            &d,
            &q,
            &l,
            &m,
            &sg,
            &bi,
            &ti,
            &ci,
            &hi,
            &kvi,
            &p,
            &key
        )
    }
}

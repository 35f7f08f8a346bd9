//! The Llama-style block's kernels (`kernels/llama.cu`, and the token embedding alone on
//! `encoder.cu`'s kernels) as methods of [`Device`], with the parent module's rules: every
//! buffer checked against the dims before the one launch, never a launch on a shorter buffer.

use cohort_engine::cpu::RopeDims;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::bf16;

use super::{block_per_row, check, elementwise, int, thread_per_column};
use crate::device::{Device, Mem};
use crate::CudaError;

/// The row layout of a SwiGLU input (N, 2F).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwiGluLayout {
    /// `[gate | up]`.
    Natural,
    /// Tiles of 16 gate columns, each followed by the same columns of up (the fused
    /// product's layout, `cohort_engine::cpu::matmul_swiglu_forward`).
    Interleaved,
}

impl SwiGluLayout {
    fn flag(self) -> i32 {
        (self == SwiGluLayout::Interleaved) as i32
    }
}

/// N and F of a SwiGLU kernel as `int`s; 2F (a row's length) must fit one too.
fn swiglu_dims(kernel: &'static str, n: usize, f: usize) -> Result<(i32, i32), CudaError> {
    int(kernel, "2F", 2 * f)?;
    Ok((int(kernel, "N", n)?, int(kernel, "F", f)?))
}

impl Device {
    /// out (N, C) = wte[ids[n]]. The ids must be rows of wte (the caller checked them against
    /// the vocabulary, as the model does on the CPU).
    pub fn embedding_forward(
        &self,
        out: &mut dyn Mem<f32>,
        ids: &dyn Mem<u32>,
        wte: &dyn Mem<f32>,
        n: usize,
        c: usize,
    ) -> Result<(), CudaError> {
        const K: &str = "embedding_forward";
        check(K, "out", out.len(), n * c)?;
        check(K, "ids", ids.len(), n)?;
        check(K, "wte", wte.len(), c)?;
        let (o, i, te, pe) = (out.ptr(self), ids.ptr(self), wte.ptr(self), 0u64);
        let (one, ni, ci) = (1i32, int(K, "N", n)?, int(K, "C", c)?);
        launch!(
            self,
            "encoder_forward",
            elementwise(n * c),
            &o,
            &i,
            &te,
            &pe,
            &one,
            &ni,
            &ci
        )
    }

    /// dwte[ids[n]] += dout[n], one thread per column, tokens in order (the CPU's sums, bit
    /// for bit). The ids must be rows of dwte.
    pub fn embedding_backward(
        &self,
        dwte: &mut dyn Mem<f32>,
        dout: &dyn Mem<f32>,
        ids: &dyn Mem<u32>,
        n: usize,
        c: usize,
    ) -> Result<(), CudaError> {
        const K: &str = "embedding_backward";
        check(K, "dout", dout.len(), n * c)?;
        check(K, "ids", ids.len(), n)?;
        check(K, "dwte", dwte.len(), c)?;
        let (te, pe, d, i) = (dwte.ptr(self), 0u64, dout.ptr(self), ids.ptr(self));
        let (one, ni, ci) = (1i32, int(K, "N", n)?, int(K, "C", c)?);
        launch!(
            self,
            "encoder_backward",
            thread_per_column(c),
            &te,
            &pe,
            &d,
            &i,
            &one,
            &ni,
            &ci
        )
    }

    /// RMSNorm over C of N rows (one block per row); rstd (N) for backward.
    pub fn rmsnorm_forward(
        &self,
        out: &mut dyn Mem<f32>,
        rstd: &mut dyn Mem<f32>,
        inp: &dyn Mem<f32>,
        w: &dyn Mem<f32>,
        eps: f32,
        n: usize,
        c: usize,
    ) -> Result<(), CudaError> {
        const K: &str = "rmsnorm_forward";
        check(K, "out", out.len(), n * c)?;
        check(K, "rstd", rstd.len(), n)?;
        check(K, "inp", inp.len(), n * c)?;
        check(K, "w", w.len(), c)?;
        let (o, r, x, wp) = (out.ptr(self), rstd.ptr(self), inp.ptr(self), w.ptr(self));
        let (ni, ci) = (int(K, "N", n)?, int(K, "C", c)?);
        launch!(
            self,
            "rmsnorm_forward",
            block_per_row(n),
            &o,
            &r,
            &x,
            &wp,
            &eps,
            &ni,
            &ci
        )
    }

    /// dinp, dw += RMSNorm backward (two launches: rows, then the weight's columns in row
    /// order).
    pub fn rmsnorm_backward(
        &self,
        dinp: &mut dyn Mem<f32>,
        dw: &mut dyn Mem<f32>,
        dout: &dyn Mem<f32>,
        inp: &dyn Mem<f32>,
        rstd: &dyn Mem<f32>,
        w: &dyn Mem<f32>,
        n: usize,
        c: usize,
    ) -> Result<(), CudaError> {
        const K: &str = "rmsnorm_backward";
        check(K, "dinp", dinp.len(), n * c)?;
        check(K, "dw", dw.len(), c)?;
        check(K, "dout", dout.len(), n * c)?;
        check(K, "inp", inp.len(), n * c)?;
        check(K, "rstd", rstd.len(), n)?;
        check(K, "w", w.len(), c)?;
        let (di, d, x, r, wp) = (
            dinp.ptr(self),
            dout.ptr(self),
            inp.ptr(self),
            rstd.ptr(self),
            w.ptr(self),
        );
        let dwp = dw.ptr(self);
        let (ni, ci) = (int(K, "N", n)?, int(K, "C", c)?);
        launch!(
            self,
            "rmsnorm_backward_input",
            block_per_row(n),
            &di,
            &d,
            &x,
            &r,
            &wp,
            &ni,
            &ci
        )?;
        launch!(
            self,
            "rmsnorm_backward_weight",
            thread_per_column(c),
            &dwp,
            &d,
            &x,
            &r,
            &ni,
            &ci
        )
    }

    /// RoPE in place (rotate_half): the first `dims.heads` heads of each row turned by the
    /// angles of `pos[row]` (tables positions × HS/2). A position past the tables makes its
    /// pairs NaN (the CPU refuses it; the device cannot see the positions without a copy).
    pub fn rope_forward(
        &self,
        x: &mut dyn Mem<f32>,
        pos: &dyn Mem<u32>,
        cos: &dyn Mem<f32>,
        sin: &dyn Mem<f32>,
        dims: RopeDims,
    ) -> Result<(), CudaError> {
        self.rope("rope_forward", x, pos, cos, sin, dims, 1.0)
    }

    /// Backward of [`Device::rope_forward`], in place: the opposite angles.
    pub fn rope_backward(
        &self,
        dx: &mut dyn Mem<f32>,
        pos: &dyn Mem<u32>,
        cos: &dyn Mem<f32>,
        sin: &dyn Mem<f32>,
        dims: RopeDims,
    ) -> Result<(), CudaError> {
        self.rope("rope_backward", dx, pos, cos, sin, dims, -1.0)
    }

    fn rope(
        &self,
        kernel: &'static str,
        x: &mut dyn Mem<f32>,
        pos: &dyn Mem<u32>,
        cos: &dyn Mem<f32>,
        sin: &dyn Mem<f32>,
        dims: RopeDims,
        sign: f32,
    ) -> Result<(), CudaError> {
        let RopeDims {
            n,
            width,
            heads,
            hs,
        } = dims;
        if !hs.is_multiple_of(2) || heads * hs > width {
            return Err(CudaError::Unsupported {
                kernel,
                what: format!("{heads} heads of {hs} in rows of {width}"),
            });
        }
        check(kernel, "x", x.len(), n * width)?;
        check(kernel, "pos", pos.len(), n)?;
        let table = cos.len().min(sin.len()) as i64;
        let (xp, pp, cp, sp) = (x.ptr(self), pos.ptr(self), cos.ptr(self), sin.ptr(self));
        let (ni, wi) = (int(kernel, "N", n)?, int(kernel, "width", width)?);
        let (hi, si) = (int(kernel, "heads", heads)?, int(kernel, "HS", hs)?);
        launch!(
            self,
            "rope_rotate",
            elementwise(n * heads * hs / 2),
            &xp,
            &pp,
            &cp,
            &sp,
            &sign,
            &table,
            &ni,
            &wi,
            &hi,
            &si
        )
    }

    /// out (N, F) = silu(gate) · up of inp (N, 2F) in `layout`.
    pub fn swiglu_forward(
        &self,
        out: &mut dyn Mem<f32>,
        inp: &dyn Mem<f32>,
        layout: SwiGluLayout,
        n: usize,
        f: usize,
    ) -> Result<(), CudaError> {
        const K: &str = "swiglu_forward";
        check(K, "out", out.len(), n * f)?;
        check(K, "inp", inp.len(), 2 * n * f)?;
        let (o, x, l) = (out.ptr(self), inp.ptr(self), layout.flag());
        let (ni, fi) = swiglu_dims(K, n, f)?;
        launch!(
            self,
            "swiglu_forward",
            elementwise(n * f),
            &o,
            &x,
            &l,
            &ni,
            &fi
        )
    }

    /// dinp (N, 2F) natural, overwritten = SwiGLU backward of dout (N, F) at inp (N, 2F) in
    /// `layout`.
    pub fn swiglu_backward(
        &self,
        dinp: &mut dyn Mem<f32>,
        dout: &dyn Mem<f32>,
        inp: &dyn Mem<f32>,
        layout: SwiGluLayout,
        n: usize,
        f: usize,
    ) -> Result<(), CudaError> {
        self.swiglu_bwd("swiglu_backward", dinp, dout, inp, (layout, 0), n, f)
    }

    /// [`Device::swiglu_backward`] from the derivatives [`Device::swiglu_interleave_bf16`]
    /// kept in `grad` (N, 2F) interleaved (the CPU's `swiglu_backward_with_grad`).
    pub fn swiglu_backward_with_grad(
        &self,
        dinp: &mut dyn Mem<f32>,
        dout: &dyn Mem<f32>,
        grad: &dyn Mem<f32>,
        n: usize,
        f: usize,
    ) -> Result<(), CudaError> {
        let kept = (SwiGluLayout::Interleaved, 1);
        self.swiglu_bwd("swiglu_backward_with_grad", dinp, dout, grad, kept, n, f)
    }

    fn swiglu_bwd(
        &self,
        kernel: &'static str,
        dinp: &mut dyn Mem<f32>,
        dout: &dyn Mem<f32>,
        inp: &dyn Mem<f32>,
        (layout, kept): (SwiGluLayout, i32),
        n: usize,
        f: usize,
    ) -> Result<(), CudaError> {
        check(kernel, "dinp", dinp.len(), 2 * n * f)?;
        check(kernel, "dout", dout.len(), n * f)?;
        check(kernel, "inp", inp.len(), 2 * n * f)?;
        let (di, d, x, l) = (dinp.ptr(self), dout.ptr(self), inp.ptr(self), layout.flag());
        let (ni, fi) = swiglu_dims(kernel, n, f)?;
        launch!(
            self,
            "swiglu_backward",
            elementwise(n * f),
            &di,
            &d,
            &x,
            &l,
            &kept,
            &ni,
            &fi
        )
    }

    /// The fused products' SwiGLU after their product `src` (N, 2F) natural: `pre` (N, 2F)
    /// the same values interleaved, `out` (N, F) = silu(gate) · up (the CPU's
    /// `matmul_swiglu_forward` after its product).
    pub fn swiglu_interleave(
        &self,
        pre: &mut dyn Mem<f32>,
        out: &mut dyn Mem<f32>,
        src: &dyn Mem<f32>,
        n: usize,
        f: usize,
    ) -> Result<(), CudaError> {
        check("swiglu_interleave", "out", out.len(), n * f)?;
        let o = out.ptr(self);
        self.interleave("swiglu_interleave", pre, (o, 0), src, n, f)
    }

    /// [`Device::swiglu_interleave`] keeping `out` in bf16 (rounded to nearest even) and, in
    /// `grad` (N, 2F) interleaved, (silu(gate), up · silu'(gate)) instead of the product (the
    /// CPU's `matmul_swiglu_forward_bf16` after its product).
    pub fn swiglu_interleave_bf16(
        &self,
        grad: &mut dyn Mem<f32>,
        out: &mut dyn Mem<bf16>,
        src: &dyn Mem<f32>,
        n: usize,
        f: usize,
    ) -> Result<(), CudaError> {
        check("swiglu_interleave_bf16", "out", out.len(), n * f)?;
        let o = out.ptr(self);
        self.interleave("swiglu_interleave_bf16", grad, (0, o), src, n, f)
    }

    fn interleave(
        &self,
        kernel: &'static str,
        pre: &mut dyn Mem<f32>,
        (out, out_bf16): (u64, u64),
        src: &dyn Mem<f32>,
        n: usize,
        f: usize,
    ) -> Result<(), CudaError> {
        check(kernel, "pre", pre.len(), 2 * n * f)?;
        check(kernel, "src", src.len(), 2 * n * f)?;
        let (p, x) = (pre.ptr(self), src.ptr(self));
        let (ni, fi) = swiglu_dims(kernel, n, f)?;
        launch!(
            self,
            "swiglu_interleave",
            elementwise(n * f),
            &p,
            &out,
            &out_bf16,
            &x,
            &ni,
            &fi
        )
    }
}

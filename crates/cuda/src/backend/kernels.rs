//! The [`Backend`] implementation of [`CudaBackend`]: each kernel of the engine's list as a call
//! of the device's kernel for the same job (see the parent module), or, for a kernel without a
//! CUDA body, an error kept for the next sync. It never launches on a view it has not checked.

#![allow(clippy::too_many_arguments)]

use cohort_engine::cpu::{AttnDims, DecodeDims, DecodeMatrix, RopeDims};
use cohort_engine::optim::AdamCoeffs;
use cohort_engine::{
    Backend, Buffer, DType, Device as EngineDevice, Dropout, EngineError, Event, Staging, View,
    ViewMut,
};

use super::bf16::as_bf16;
use super::{engine_buffer, host_bytes, opt, opt_mut, Attention, CudaBackend, MISSING};
use crate::device::{AdamWScalars, Mem, SwiGluLayout};

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn device(&self) -> EngineDevice {
        self.device
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn num_threads(&self) -> usize {
        1
    }
    fn install(&self, f: &mut (dyn FnMut() + Send)) {
        f()
    }
    fn attention_scratch_len(&self, _t: usize) -> usize {
        // The flash-style kernels keep no T×T scratch; the backward's row scratch is the
        // backend's own (it depends on B and NH, which this size does not see).
        0
    }
    fn alloc(&self, len: usize) -> Result<Buffer, EngineError> {
        engine_buffer::<f32>(self, len)
    }
    fn copy_from_host(&self, dst: ViewMut<'_, u8>, src: &[u8]) -> Result<(), EngineError> {
        let dst = self
            .w(dst)
            .map_err(|e| self.device_error("copy to the device", e))?;
        self.dev
            .copy_from_host(&dst, src)
            .map_err(|e| self.device_error("copy to the device", e))
    }
    fn copy_to_host(&self, dst: &mut [u8], src: View<'_, u8>) -> Result<(), EngineError> {
        let src = self
            .r(src)
            .map_err(|e| self.device_error("copy to the host", e))?;
        self.sync()?;
        self.dev
            .copy_to_host(dst, &src)
            .map_err(|e| self.device_error("copy to the host", e))
    }
    fn sync(&self) -> Result<(), EngineError> {
        let synced = self.dev.sync().map_err(|e| self.device_error("sync", e));
        let first = self.error.lock().unwrap_or_else(|p| p.into_inner()).take();
        match first {
            Some(e) => Err(e),
            None => synced,
        }
    }
    fn record_event(&self) -> Event {
        self.event()
    }
    fn copy_to_host_after(
        &self,
        dst: &mut [u8],
        src: View<'_, u8>,
        after: &Event,
    ) -> Result<(), EngineError> {
        self.copy_after(dst, src, after)
    }
    fn copy_from_host_beside(&self, dst: ViewMut<'_, u8>, src: &[u8]) -> Result<(), EngineError> {
        let what = "copy to the device beside the kernels";
        let dst = self.w(dst).map_err(|e| self.device_error(what, e))?;
        (self.dev.copy_from_host_beside(&dst, src)).map_err(|e| self.device_error(what, e))
    }
    fn alloc_staging(&self, len: usize) -> Result<Staging, EngineError> {
        self.staging(len)
    }
    fn missing_kernels(&self) -> &'static [&'static str] {
        MISSING
    }
    fn stream_handle(&self) -> Option<u64> {
        Some(self.dev.stream_handle())
    }

    fn encoder_forward(
        &self,
        out: ViewMut<f32>,
        ids: View<u32>,
        wte: View<f32>,
        wpe: View<f32>,
        b: usize,
        t: usize,
        c: usize,
    ) {
        self.run("encoder_forward", || {
            let (mut o, i, te, pe) = (self.w(out)?, self.r(ids)?, self.r(wte)?, self.r(wpe)?);
            self.dev.encoder_forward(&mut o, &i, &te, &pe, b, t, c)
        })
    }
    fn encoder_backward(
        &self,
        dwte: ViewMut<f32>,
        dwpe: ViewMut<f32>,
        dout: View<f32>,
        ids: View<u32>,
        b: usize,
        t: usize,
        c: usize,
    ) {
        self.run("encoder_backward", || {
            let (mut te, mut pe) = (self.w(dwte)?, self.w(dwpe)?);
            let (d, i) = (self.r(dout)?, self.r(ids)?);
            self.dev.encoder_backward(&mut te, &mut pe, &d, &i, b, t, c)
        })
    }
    fn embedding_forward(
        &self,
        out: ViewMut<f32>,
        ids: View<u32>,
        wte: View<f32>,
        n: usize,
        c: usize,
    ) {
        self.run("embedding_forward", || {
            let (mut o, i, te) = (self.w(out)?, self.r(ids)?, self.r(wte)?);
            self.dev.embedding_forward(&mut o, &i, &te, n, c)
        })
    }
    fn embedding_backward(
        &self,
        dwte: ViewMut<f32>,
        dout: View<f32>,
        ids: View<u32>,
        n: usize,
        c: usize,
    ) {
        self.run("embedding_backward", || {
            let (mut te, d, i) = (self.w(dwte)?, self.r(dout)?, self.r(ids)?);
            self.dev.embedding_backward(&mut te, &d, &i, n, c)
        })
    }
    fn rmsnorm_forward(
        &self,
        out: ViewMut<f32>,
        rstd: ViewMut<f32>,
        inp: View<f32>,
        w: View<f32>,
        eps: f32,
        n: usize,
        c: usize,
    ) {
        self.run("rmsnorm_forward", || {
            let (mut o, mut r, x, wp) = (self.w(out)?, self.w(rstd)?, self.r(inp)?, self.r(w)?);
            self.dev.rmsnorm_forward(&mut o, &mut r, &x, &wp, eps, n, c)
        })
    }
    fn rmsnorm_forward_bf16(
        &self,
        out: ViewMut<u16>,
        rstd: ViewMut<f32>,
        inp: View<f32>,
        w: View<f32>,
        eps: f32,
        n: usize,
        c: usize,
    ) {
        self.run("rmsnorm_forward_bf16", || {
            let (o, mut r, x, wp) = (self.w(out)?, self.w(rstd)?, self.r(inp)?, self.r(w)?);
            let mut o = as_bf16(&o, &self.dev);
            self.norm_to_bf16(&mut o, n * c, |y| {
                self.dev.rmsnorm_forward(y, &mut r, &x, &wp, eps, n, c)
            })
        })
    }
    fn rmsnorm_backward(
        &self,
        dinp: ViewMut<f32>,
        dw: ViewMut<f32>,
        dout: View<f32>,
        inp: View<f32>,
        rstd: View<f32>,
        w: View<f32>,
        n: usize,
        c: usize,
    ) {
        self.run("rmsnorm_backward", || {
            let (mut di, mut dwp) = (self.w(dinp)?, self.w(dw)?);
            let (d, x, r, wp) = (self.r(dout)?, self.r(inp)?, self.r(rstd)?, self.r(w)?);
            self.dev
                .rmsnorm_backward(&mut di, &mut dwp, &d, &x, &r, &wp, n, c)
        })
    }
    fn rope_forward(
        &self,
        x: ViewMut<f32>,
        pos: View<u32>,
        cos: View<f32>,
        sin: View<f32>,
        dims: RopeDims,
    ) {
        self.run("rope_forward", || {
            let (mut xp, p, c, s) = (self.w(x)?, self.r(pos)?, self.r(cos)?, self.r(sin)?);
            self.dev.rope_forward(&mut xp, &p, &c, &s, dims)
        })
    }
    fn rope_backward(
        &self,
        dx: ViewMut<f32>,
        pos: View<u32>,
        cos: View<f32>,
        sin: View<f32>,
        dims: RopeDims,
    ) {
        self.run("rope_backward", || {
            let (mut xp, p, c, s) = (self.w(dx)?, self.r(pos)?, self.r(cos)?, self.r(sin)?);
            self.dev.rope_backward(&mut xp, &p, &c, &s, dims)
        })
    }
    fn swiglu_forward(&self, out: ViewMut<f32>, inp: View<f32>, n: usize, f: usize) {
        self.run("swiglu_forward", || {
            let (mut o, x) = (self.w(out)?, self.r(inp)?);
            self.dev
                .swiglu_forward(&mut o, &x, SwiGluLayout::Natural, n, f)
        })
    }
    fn swiglu_interleaved_forward(&self, out: ViewMut<f32>, inp: View<f32>, n: usize, f: usize) {
        self.run("swiglu_interleaved_forward", || {
            let (mut o, x) = (self.w(out)?, self.r(inp)?);
            self.dev
                .swiglu_forward(&mut o, &x, SwiGluLayout::Interleaved, n, f)
        })
    }
    fn matmul_swiglu_forward(
        &self,
        pre: ViewMut<f32>,
        out: ViewMut<f32>,
        inp: View<f32>,
        w: View<f32>,
        bias: Option<View<f32>>,
        n: usize,
        c: usize,
        f: usize,
    ) {
        self.run("matmul_swiglu_forward", || {
            let (mut p, mut o) = (self.w(pre)?, self.w(out)?);
            let (i, w, b) = (self.r(inp)?, self.r(w)?, self.ro(bias)?);
            self.product_in_scratch(&i, &w, opt(&b), (n, c, 2 * f), |src| {
                self.dev.swiglu_interleave(&mut p, &mut o, src, n, f)
            })
        })
    }
    fn matmul_swiglu_forward_bf16(
        &self,
        grad: ViewMut<f32>,
        out: ViewMut<u16>,
        inp: View<u16>,
        w: View<f32>,
        bias: Option<View<f32>>,
        n: usize,
        c: usize,
        f: usize,
    ) {
        self.run("matmul_swiglu_forward_bf16", || {
            let (mut g, o) = (self.w(grad)?, self.w(out)?);
            let (i, w, b) = (self.r(inp)?, self.r(w)?, self.ro(bias)?);
            let (mut o, i) = (as_bf16(&o, &self.dev), as_bf16(&i, &self.dev));
            self.bf16_product_in_scratch(&i, &w, opt(&b), (n, c, 2 * f), |src| {
                self.dev.swiglu_interleave_bf16(&mut g, &mut o, src, n, f)
            })
        })
    }
    fn matmul_backward_input_swiglu(
        &self,
        dinp: ViewMut<f32>,
        dact: ViewMut<f32>,
        dout: View<f32>,
        w: View<f32>,
        pre: View<f32>,
        n: usize,
        f: usize,
        c: usize,
    ) {
        self.run("matmul_backward_input_swiglu", || {
            let (mut di, mut da) = (self.w(dinp)?, self.w(dact)?);
            let (d, w, p) = (self.r(dout)?, self.r(w)?, self.r(pre)?);
            self.operands(&d, &w, |d, w| {
                self.dev.matmul_backward_input(&mut da, d, w, n, f, c)
            })?;
            let layout = SwiGluLayout::Interleaved;
            self.dev.swiglu_backward(&mut di, &da, &p, layout, n, f)
        })
    }
    fn matmul_backward_input_swiglu_with_grad(
        &self,
        dinp: ViewMut<f32>,
        dact: ViewMut<f32>,
        dout: View<f32>,
        w: View<f32>,
        grad: View<f32>,
        n: usize,
        f: usize,
        c: usize,
    ) {
        self.run("matmul_backward_input_swiglu_with_grad", || {
            let (mut di, mut da) = (self.w(dinp)?, self.w(dact)?);
            let (d, w, g) = (self.r(dout)?, self.r(w)?, self.r(grad)?);
            self.operands(&d, &w, |d, w| {
                self.dev.matmul_backward_input(&mut da, d, w, n, f, c)
            })?;
            self.dev.swiglu_backward_with_grad(&mut di, &da, &g, n, f)
        })
    }
    fn layernorm_forward(
        &self,
        out: ViewMut<f32>,
        mean: ViewMut<f32>,
        rstd: ViewMut<f32>,
        inp: View<f32>,
        w: View<f32>,
        b: Option<View<f32>>,
        n: usize,
        c: usize,
    ) {
        self.run("layernorm_forward", || {
            let (mut o, mut m, mut r) = (self.w(out)?, self.w(mean)?, self.w(rstd)?);
            let (i, w, b) = (self.r(inp)?, self.r(w)?, self.ro(b)?);
            self.dev
                .layernorm_forward(&mut o, &mut m, &mut r, &i, &w, opt(&b), n, c)
        })
    }
    fn layernorm_forward_bf16(
        &self,
        out: ViewMut<u16>,
        mean: ViewMut<f32>,
        rstd: ViewMut<f32>,
        inp: View<f32>,
        w: View<f32>,
        b: Option<View<f32>>,
        n: usize,
        c: usize,
    ) {
        self.run("layernorm_forward_bf16", || {
            let (o, mut m, mut r) = (self.w(out)?, self.w(mean)?, self.w(rstd)?);
            let (i, w, b) = (self.r(inp)?, self.r(w)?, self.ro(b)?);
            let mut o = as_bf16(&o, &self.dev);
            self.norm_to_bf16(&mut o, n * c, |y| {
                self.dev
                    .layernorm_forward(y, &mut m, &mut r, &i, &w, opt(&b), n, c)
            })
        })
    }
    fn layernorm_backward(
        &self,
        dinp: ViewMut<f32>,
        dw: ViewMut<f32>,
        db: Option<ViewMut<f32>>,
        dout: View<f32>,
        inp: View<f32>,
        mean: View<f32>,
        rstd: View<f32>,
        w: View<f32>,
        n: usize,
        c: usize,
    ) {
        self.run("layernorm_backward", || {
            let (mut di, mut dw, mut db) = (self.w(dinp)?, self.w(dw)?, self.wo(db)?);
            let (d, i, m, r, w) = (
                self.r(dout)?,
                self.r(inp)?,
                self.r(mean)?,
                self.r(rstd)?,
                self.r(w)?,
            );
            self.dev.layernorm_backward(
                &mut di,
                &mut dw,
                opt_mut(&mut db),
                &d,
                &i,
                &m,
                &r,
                &w,
                n,
                c,
            )
        })
    }
    fn matmul_forward(
        &self,
        out: ViewMut<f32>,
        inp: View<f32>,
        w: View<f32>,
        bias: Option<View<f32>>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        self.run("matmul_forward", || {
            let (mut o, i, w, b) = (self.w(out)?, self.r(inp)?, self.r(w)?, self.ro(bias)?);
            self.operands(&i, &w, |i, w| {
                self.dev.matmul_forward(&mut o, i, w, opt(&b), n, c, oc)
            })
        })
    }
    fn matmul_backward(
        &self,
        dinp: Option<ViewMut<f32>>,
        dw: ViewMut<f32>,
        dbias: Option<ViewMut<f32>>,
        dout: View<f32>,
        inp: View<f32>,
        w: View<f32>,
        n: usize,
        c: usize,
        oc: usize,
        accumulate: bool,
    ) {
        self.run("matmul_backward", || {
            let (mut di, mut dw, mut db) = (self.wo(dinp)?, self.w(dw)?, self.wo(dbias)?);
            let (d, i, w) = (self.r(dout)?, self.r(inp)?, self.r(w)?);
            self.dev.matmul_backward(
                opt_mut(&mut di),
                &mut dw,
                opt_mut(&mut db),
                &d,
                &i,
                &w,
                n,
                c,
                oc,
                accumulate,
            )
        })
    }
    fn matmul_backward_input(
        &self,
        dinp: ViewMut<f32>,
        dout: View<f32>,
        w: View<f32>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        self.run("matmul_backward_input", || {
            let (mut di, d, w) = (self.w(dinp)?, self.r(dout)?, self.r(w)?);
            self.operands(&d, &w, |d, w| {
                self.dev.matmul_backward_input(&mut di, d, w, n, c, oc)
            })
        })
    }
    fn decode_matmul_forward(
        &self,
        _: ViewMut<f32>,
        _: View<f32>,
        _: &DecodeMatrix,
        _: Option<View<f32>>,
        _: usize,
    ) {
        self.missing("decode_matmul_forward")
    }
    fn matmul_forward_bf16_out(
        &self,
        _: ViewMut<f32>,
        _: ViewMut<u16>,
        _: View<u16>,
        _: View<f32>,
        _: Option<View<f32>>,
        _: usize,
        _: usize,
        _: usize,
    ) {
        self.missing("matmul_forward_bf16_out")
    }
    fn head_forward(
        &self,
        out: ViewMut<f32>,
        inp: View<f32>,
        w: View<f32>,
        n: usize,
        c: usize,
        v: usize,
    ) {
        self.run("head_forward", || {
            let (mut o, i, w) = (self.w(out)?, self.r(inp)?, self.r(w)?);
            self.operands(&i, &w, |i, w| self.dev.head_forward(&mut o, i, w, n, c, v))
        })
    }
    fn head_backward(
        &self,
        dinp: ViewMut<f32>,
        dw: ViewMut<f32>,
        dout: View<f32>,
        inp: View<f32>,
        w: View<f32>,
        n: usize,
        c: usize,
        v: usize,
        accumulate: bool,
    ) {
        self.run("head_backward", || {
            let (mut di, mut dw) = (self.w(dinp)?, self.w(dw)?);
            let (d, i, w) = (self.r(dout)?, self.r(inp)?, self.r(w)?);
            self.dev
                .head_backward(&mut di, &mut dw, &d, &i, &w, n, c, v, accumulate)
        })
    }
    fn matmul_gelu_forward(
        &self,
        pre: ViewMut<f32>,
        out: ViewMut<f32>,
        inp: View<f32>,
        w: View<f32>,
        bias: Option<View<f32>>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        self.run("matmul_gelu_forward", || {
            let (mut p, mut o) = (self.w(pre)?, self.w(out)?);
            let (i, w, b) = (self.r(inp)?, self.r(w)?, self.ro(bias)?);
            self.operands(&i, &w, |i, w| {
                self.dev
                    .matmul_gelu_forward(&mut p, &mut o, i, w, opt(&b), n, c, oc)
            })
        })
    }
    fn matmul_gelu_forward_bf16(
        &self,
        grad: ViewMut<f32>,
        out: ViewMut<u16>,
        inp: View<u16>,
        w: View<f32>,
        bias: Option<View<f32>>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        self.run("matmul_gelu_forward_bf16", || {
            let (mut g, o) = (self.w(grad)?, self.w(out)?);
            let (i, w, b) = (self.r(inp)?, self.r(w)?, self.ro(bias)?);
            let (mut o, i) = (as_bf16(&o, &self.dev), as_bf16(&i, &self.dev));
            self.gelu_forward_bf16_out(&mut g, &mut o, &i, &w, opt(&b), (n, c, oc))
        })
    }
    fn matmul_forward_bf16_input(
        &self,
        out: ViewMut<f32>,
        inp: View<u16>,
        w: View<f32>,
        bias: Option<View<f32>>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        self.run("matmul_forward_bf16_input", || {
            let (mut o, i, w, b) = (self.w(out)?, self.r(inp)?, self.r(w)?, self.ro(bias)?);
            let i = as_bf16(&i, &self.dev);
            self.forward_bf16_input(&mut o, &i, &w, opt(&b), (n, c, oc))
        })
    }
    fn matmul_backward_weight_bf16_input(
        &self,
        dw: ViewMut<f32>,
        dbias: Option<ViewMut<f32>>,
        dout: View<f32>,
        inp: View<u16>,
        n: usize,
        c: usize,
        oc: usize,
        accumulate: bool,
    ) {
        self.run("matmul_backward_weight_bf16_input", || {
            let (mut dw, mut db) = (self.w(dw)?, self.wo(dbias)?);
            let (d, i) = (self.r(dout)?, self.r(inp)?);
            let i = as_bf16(&i, &self.dev);
            let dims = (n, c, oc);
            self.backward_weight_bf16_input(&mut dw, opt_mut(&mut db), &d, &i, dims, accumulate)
        })
    }
    fn gelu_forward(&self, out: ViewMut<f32>, inp: View<f32>) {
        self.run("gelu_forward", || {
            let (mut o, i) = (self.w(out)?, self.r(inp)?);
            self.dev.gelu_forward(&mut o, &i)
        })
    }
    fn gelu_backward(&self, dinout: ViewMut<f32>, inp: View<f32>) {
        self.run("gelu_backward", || {
            let (mut d, i) = (self.w(dinout)?, self.r(inp)?);
            self.dev.gelu_backward(&mut d, &i)
        })
    }
    fn gelu_forward_and_grad(&self, out: ViewMut<f32>, pre: ViewMut<f32>) {
        self.run("gelu_forward_and_grad", || {
            let (mut o, mut p) = (self.w(out)?, self.w(pre)?);
            self.dev.gelu_forward_and_grad(&mut o, &mut p)
        })
    }
    fn gelu_backward_with_grad(&self, dinout: ViewMut<f32>, grad: View<f32>) {
        self.run("gelu_backward_with_grad", || {
            let (mut d, g) = (self.w(dinout)?, self.r(grad)?);
            self.dev.gelu_backward_with_grad(&mut d, &g)
        })
    }
    fn residual_forward(
        &self,
        out: ViewMut<f32>,
        residual: View<f32>,
        bias: Option<View<f32>>,
        c: usize,
        dropout: Option<Dropout>,
    ) {
        self.run("residual_forward", || {
            let (mut o, r, b) = (self.w(out)?, self.r(residual)?, self.ro(bias)?);
            self.dev.residual_forward(&mut o, &r, opt(&b), c, dropout)
        })
    }
    fn dropout_forward(&self, x: ViewMut<f32>, d: Dropout) {
        self.run("dropout_forward", || {
            let mut x = self.w(x)?;
            self.dev.dropout_forward(&mut x, d, 0)
        })
    }
    fn dropout_backward(&self, dx: ViewMut<f32>, dy: View<f32>, d: Dropout) {
        self.run("dropout_backward", || {
            let (mut dx, dy) = (self.w(dx)?, self.r(dy)?);
            self.dev.dropout_backward(&mut dx, &dy, d, 0)
        })
    }
    fn column_sums(&self, acc: ViewMut<f32>, x: View<f32>) {
        self.run("column_sums", || {
            let (mut a, x) = (self.w(acc)?, self.r(x)?);
            self.dev.column_sums(&mut a, &x)
        })
    }
    fn attention_forward(
        &self,
        out: ViewMut<f32>,
        lse: ViewMut<f32>,
        qkv: View<f32>,
        mask: Option<View<u8>>,
        segments: Option<View<u32>>,
        dims: AttnDims,
        dropout: Option<Dropout>,
        _scratch: ViewMut<f32>,
    ) {
        let a = Attention {
            mask,
            segments,
            dims,
            nkv: dims.nh,
            dropout,
        };
        self.attention_fwd("attention_forward", out, lse, qkv, a)
    }
    fn attention_backward(
        &self,
        dqkv: ViewMut<f32>,
        recompute_out: Option<ViewMut<f32>>,
        dout: View<f32>,
        qkv: View<f32>,
        lse: View<f32>,
        mask: Option<View<u8>>,
        segments: Option<View<u32>>,
        dims: AttnDims,
        dropout: Option<Dropout>,
        _scratch: ViewMut<f32>,
    ) {
        let a = Attention {
            mask,
            segments,
            dims,
            nkv: dims.nh,
            dropout,
        };
        self.attention_bwd("attention_backward", dqkv, recompute_out, dout, qkv, lse, a)
    }
    fn attention_forward_grouped(
        &self,
        out: ViewMut<f32>,
        lse: ViewMut<f32>,
        qkv: View<f32>,
        mask: Option<View<u8>>,
        segments: Option<View<u32>>,
        dims: AttnDims,
        nkv: usize,
        dropout: Option<Dropout>,
        _scratch: ViewMut<f32>,
    ) {
        let a = Attention {
            mask,
            segments,
            dims,
            nkv,
            dropout,
        };
        self.attention_fwd("attention_forward_grouped", out, lse, qkv, a)
    }
    fn attention_backward_grouped(
        &self,
        dqkv: ViewMut<f32>,
        recompute_out: Option<ViewMut<f32>>,
        dout: View<f32>,
        qkv: View<f32>,
        lse: View<f32>,
        mask: Option<View<u8>>,
        segments: Option<View<u32>>,
        dims: AttnDims,
        nkv: usize,
        dropout: Option<Dropout>,
        _scratch: ViewMut<f32>,
    ) {
        let a = Attention {
            mask,
            segments,
            dims,
            nkv,
            dropout,
        };
        self.attention_bwd(
            "attention_backward_grouped",
            dqkv,
            recompute_out,
            dout,
            qkv,
            lse,
            a,
        )
    }
    fn attention_forward_bf16_qkv(
        &self,
        _: ViewMut<f32>,
        _: ViewMut<f32>,
        _: View<u16>,
        _: Option<View<u8>>,
        _: Option<View<u32>>,
        _: AttnDims,
        _: usize,
        _: Option<Dropout>,
        _: ViewMut<f32>,
    ) {
        self.missing("attention_forward_bf16_qkv")
    }
    fn attention_backward_bf16_qkv(
        &self,
        _: ViewMut<f32>,
        _: Option<ViewMut<f32>>,
        _: View<f32>,
        _: View<u16>,
        _: View<f32>,
        _: Option<View<u8>>,
        _: Option<View<u32>>,
        _: AttnDims,
        _: usize,
        _: Option<Dropout>,
        _: ViewMut<f32>,
    ) {
        self.missing("attention_backward_bf16_qkv")
    }
    fn attention_decode_row(
        &self,
        _: &mut [f32],
        _: &mut [f32],
        _: &[f32],
        _: &[f32],
        _: &[f32],
        _: DecodeDims,
    ) {
        self.missing("attention_decode_row")
    }
    fn attention_decode_row_bf16(
        &self,
        _: &mut [f32],
        _: &mut [f32],
        _: &[f32],
        _: &[u16],
        _: &[u16],
        _: DecodeDims,
    ) {
        self.missing("attention_decode_row_bf16")
    }
    fn crossentropy_forward(
        &self,
        losses: ViewMut<f32>,
        lse: ViewMut<f32>,
        logits: View<f32>,
        targets: View<i32>,
        n: usize,
        v: usize,
    ) {
        self.run("crossentropy_forward", || {
            let (mut lo, mut ls) = (self.w(losses)?, self.w(lse)?);
            let (x, t) = (self.r(logits)?, self.r(targets)?);
            self.dev
                .crossentropy_forward(&mut lo, &mut ls, &x, &t, n, v)
        })
    }
    fn crossentropy_forward_block(
        &self,
        lse: ViewMut<f32>,
        target_logit: ViewMut<f32>,
        logits: View<f32>,
        targets: View<i32>,
        n: usize,
        v: usize,
        v0: usize,
    ) {
        self.run("crossentropy_forward_block", || {
            let (mut ls, mut tl) = (self.w(lse)?, self.w(target_logit)?);
            let (x, t) = (self.r(logits)?, self.r(targets)?);
            self.dev
                .crossentropy_forward_block(&mut ls, &mut tl, &x, &t, n, v, v0)
        })
    }
    fn crossentropy_backward(
        &self,
        logits: ViewMut<f32>,
        lse: View<f32>,
        targets: View<i32>,
        scale: f32,
        n: usize,
        v: usize,
        v0: usize,
    ) {
        self.run("crossentropy_backward", || {
            let mut x = self.w(logits)?;
            let (l, t) = (self.r(lse)?, self.r(targets)?);
            self.dev
                .crossentropy_backward(&mut x, &l, &t, scale, n, v, v0)
        })
    }
    fn fill(&self, x: ViewMut<f32>, value: f32) {
        self.run("fill", || self.dev.fill(&mut self.w(x)?, value))
    }
    fn add_into(&self, acc: ViewMut<f32>, x: View<f32>) {
        self.run("add_into", || {
            let (mut a, x) = (self.w(acc)?, self.r(x)?);
            self.dev.add(&mut a, &x)
        })
    }
    fn crossentropy_fold(&self, losses: ViewMut<f32>, lse: View<f32>, targets: View<i32>) {
        self.run("crossentropy_fold", || {
            let (mut lo, l, t) = (self.w(losses)?, self.r(lse)?, self.r(targets)?);
            self.dev.crossentropy_fold(&mut lo, &l, &t)
        })
    }
    fn loss_sum(&self, losses: View<f32>) -> f64 {
        // The N per-row losses come to the host and are summed there in the CPU's order:
        // the same bits as the CPU's for the same losses, for N floats of traffic.
        self.value("loss_sum", || {
            let l = self.r(losses)?;
            let mut host = vec![0f32; l.len()];
            self.dev.copy_to_host(host_bytes(&mut host), &l.bytes())?;
            Ok(cohort_engine::cpu::loss_sum(&host))
        })
    }
    fn adamw_step(
        &self,
        p: ViewMut<f32>,
        g: View<f32>,
        m: ViewMut<f32>,
        v: ViewMut<f32>,
        c: AdamCoeffs,
    ) {
        let s = AdamWScalars {
            decay: c.decay,
            lerp_w: c.lerp_w,
            beta2: c.beta2,
            one_minus_beta2: c.one_minus_beta2,
            bc2_sqrt: c.bc2_sqrt,
            eps: c.eps,
            neg_step_size: c.neg_step_size,
        };
        self.run("adamw_step", || {
            let (mut p, g, mut m, mut v) = (self.w(p)?, self.r(g)?, self.w(m)?, self.w(v)?);
            self.dev.adamw_step(&mut p, &g, &mut m, &mut v, s)
        })
    }
    fn sum_squares(&self, x: View<f32>) -> f64 {
        self.value("sum_squares", || self.dev.sum_squares(&self.r(x)?))
    }
    fn scale(&self, x: ViewMut<f32>, s: f32) {
        self.run("scale", || self.dev.scale(&mut self.w(x)?, s))
    }
}

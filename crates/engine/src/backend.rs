//! The device boundary: every kernel the model calls, as one trait. The model holds a
//! `Box<dyn Backend>` and never names a device; [`Cpu`](crate::cpu::Cpu) is the only
//! implementation today, and a CUDA one would implement the same trait.
//!
//! Conventions (llm.c's): outputs first, then inputs, then weights, then dims. Backward
//! kernels accumulate (`+=`) into parameter gradients; where a backward overwrites an
//! activation gradient instead, its doc says so.

use crate::cpu::{self, AttnDims, Cpu};
use crate::Dropout;

/// The kernels of a GPT-2 training step.
#[allow(clippy::too_many_arguments)]
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Short name for logs ("cpu").
    fn name(&self) -> &'static str;
    /// Intra-op threads.
    fn num_threads(&self) -> usize;
    /// Runs `f` with the backend's threads ready for the kernels it calls (one pool entry per
    /// forward or backward instead of one per kernel).
    fn install(&self, f: &mut (dyn FnMut() + Send));
    /// Scratch floats the attention kernels need for sequence length `t`.
    fn attention_scratch_len(&self, t: usize) -> usize;

    /// out (B,T,C) = wte[ids] + wpe[t].
    fn encoder_forward(
        &self,
        out: &mut [f32],
        ids: &[u32],
        wte: &[f32],
        wpe: &[f32],
        b: usize,
        t: usize,
        c: usize,
    );
    /// dwte[ids] += dout, dwpe[t] += dout.
    fn encoder_backward(
        &self,
        dwte: &mut [f32],
        dwpe: &mut [f32],
        dout: &[f32],
        ids: &[u32],
        b: usize,
        t: usize,
        c: usize,
    );
    /// LayerNorm over C; writes mean and rstd (N) for backward.
    fn layernorm_forward(
        &self,
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
        inp: &[f32],
        w: &[f32],
        b: Option<&[f32]>,
        n: usize,
        c: usize,
    );
    /// dinp, dw, db += LayerNorm backward.
    fn layernorm_backward(
        &self,
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
    );
    /// out (N,OC) = inp (N,C) · w (C,OC) + bias.
    fn matmul_forward(
        &self,
        out: &mut [f32],
        inp: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        n: usize,
        c: usize,
        oc: usize,
    );
    /// dinp = dout · wᵀ (overwritten), dw += inpᵀ · dout, dbias += Σ_rows dout.
    fn matmul_backward(
        &self,
        dinp: Option<&mut [f32]>,
        dw: &mut [f32],
        dbias: Option<&mut [f32]>,
        dout: &[f32],
        inp: &[f32],
        w: &[f32],
        n: usize,
        c: usize,
        oc: usize,
    );
    /// dinp = dout · wᵀ (overwritten) alone, for a dinp buffer that still holds the input.
    fn matmul_backward_input(
        &self,
        dinp: &mut [f32],
        dout: &[f32],
        w: &[f32],
        n: usize,
        c: usize,
        oc: usize,
    );
    /// logits (N,V) = inp (N,C) · wᵀ, w (V,C).
    fn head_forward(&self, out: &mut [f32], inp: &[f32], w: &[f32], n: usize, c: usize, v: usize);
    /// dinp = dout · w (overwritten), dw += doutᵀ · inp.
    fn head_backward(
        &self,
        dinp: &mut [f32],
        dw: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        w: &[f32],
        n: usize,
        c: usize,
        v: usize,
    );
    /// out = gelu(inp) (tanh form).
    fn gelu_forward(&self, out: &mut [f32], inp: &[f32]);
    /// dinout *= gelu'(inp).
    fn gelu_backward(&self, dinout: &mut [f32], inp: &[f32]);
    /// out = residual + dropout(out + bias), rows of c.
    fn residual_forward(
        &self,
        out: &mut [f32],
        residual: &[f32],
        bias: Option<&[f32]>,
        c: usize,
        dropout: Option<Dropout>,
    );
    /// x = dropout(x).
    fn dropout_forward(&self, x: &mut [f32], d: Dropout);
    /// dx = dropout mask applied to dy (overwritten).
    fn dropout_backward(&self, dx: &mut [f32], dy: &[f32], d: Dropout);
    /// acc += Σ_rows x.
    fn column_sums(&self, acc: &mut [f32], x: &[f32]);
    /// Causal attention with key padding mask; lse (B,NH,T) kept for backward.
    fn attention_forward(
        &self,
        out: &mut [f32],
        lse: &mut [f32],
        qkv: &[f32],
        mask: Option<&[u8]>,
        dims: AttnDims,
        dropout: Option<Dropout>,
        scratch: &mut [f32],
    );
    /// dqkv = attention backward (overwritten); optionally recomputes the forward output.
    fn attention_backward(
        &self,
        dqkv: &mut [f32],
        recompute_out: Option<&mut [f32]>,
        dout: &[f32],
        qkv: &[f32],
        lse: &[f32],
        mask: Option<&[u8]>,
        dims: AttnDims,
        dropout: Option<Dropout>,
        scratch: &mut [f32],
    );
    /// Per-row loss (0 for ignored targets) and log-sum-exp.
    fn crossentropy_forward(
        &self,
        losses: &mut [f32],
        lse: &mut [f32],
        logits: &[f32],
        targets: &[i32],
        n: usize,
        v: usize,
    );
    /// dlogits = scale * (softmax - onehot) (overwritten; zero rows for ignored targets).
    fn crossentropy_backward(
        &self,
        dlogits: &mut [f32],
        logits: &[f32],
        lse: &[f32],
        targets: &[i32],
        scale: f32,
        n: usize,
        v: usize,
    );
}

#[allow(clippy::too_many_arguments)]
impl Backend for Cpu {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn num_threads(&self) -> usize {
        Cpu::num_threads(self)
    }
    fn install(&self, f: &mut (dyn FnMut() + Send)) {
        Cpu::install(self, f)
    }
    fn attention_scratch_len(&self, t: usize) -> usize {
        cpu::attention_scratch_len(t, self.num_threads())
    }
    fn encoder_forward(
        &self,
        out: &mut [f32],
        ids: &[u32],
        wte: &[f32],
        wpe: &[f32],
        b: usize,
        t: usize,
        c: usize,
    ) {
        cpu::encoder_forward(out, ids, wte, wpe, b, t, c)
    }
    fn encoder_backward(
        &self,
        dwte: &mut [f32],
        dwpe: &mut [f32],
        dout: &[f32],
        ids: &[u32],
        b: usize,
        t: usize,
        c: usize,
    ) {
        cpu::encoder_backward(dwte, dwpe, dout, ids, b, t, c)
    }
    fn layernorm_forward(
        &self,
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
        inp: &[f32],
        w: &[f32],
        b: Option<&[f32]>,
        n: usize,
        c: usize,
    ) {
        cpu::layernorm_forward(out, mean, rstd, inp, w, b, n, c)
    }
    fn layernorm_backward(
        &self,
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
        cpu::layernorm_backward(dinp, dw, db, dout, inp, mean, rstd, w, n, c)
    }
    fn matmul_forward(
        &self,
        out: &mut [f32],
        inp: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        cpu::matmul_forward(out, inp, w, bias, n, c, oc)
    }
    fn matmul_backward(
        &self,
        dinp: Option<&mut [f32]>,
        dw: &mut [f32],
        dbias: Option<&mut [f32]>,
        dout: &[f32],
        inp: &[f32],
        w: &[f32],
        n: usize,
        c: usize,
        oc: usize,
    ) {
        cpu::matmul_backward(dinp, dw, dbias, dout, inp, w, n, c, oc)
    }
    fn matmul_backward_input(
        &self,
        dinp: &mut [f32],
        dout: &[f32],
        w: &[f32],
        n: usize,
        c: usize,
        oc: usize,
    ) {
        cpu::matmul_backward_input(dinp, dout, w, n, c, oc)
    }
    fn head_forward(&self, out: &mut [f32], inp: &[f32], w: &[f32], n: usize, c: usize, v: usize) {
        cpu::head_forward(out, inp, w, n, c, v)
    }
    fn head_backward(
        &self,
        dinp: &mut [f32],
        dw: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        w: &[f32],
        n: usize,
        c: usize,
        v: usize,
    ) {
        cpu::head_backward(dinp, dw, dout, inp, w, n, c, v)
    }
    fn gelu_forward(&self, out: &mut [f32], inp: &[f32]) {
        cpu::gelu_forward(out, inp)
    }
    fn gelu_backward(&self, dinout: &mut [f32], inp: &[f32]) {
        cpu::gelu_backward(dinout, inp)
    }
    fn residual_forward(
        &self,
        out: &mut [f32],
        residual: &[f32],
        bias: Option<&[f32]>,
        c: usize,
        dropout: Option<Dropout>,
    ) {
        cpu::residual_forward(out, residual, bias, c, dropout)
    }
    fn dropout_forward(&self, x: &mut [f32], d: Dropout) {
        cpu::dropout_forward(x, d, 0)
    }
    fn dropout_backward(&self, dx: &mut [f32], dy: &[f32], d: Dropout) {
        cpu::dropout_backward(dx, dy, d, 0)
    }
    fn column_sums(&self, acc: &mut [f32], x: &[f32]) {
        cpu::column_sums(acc, x)
    }
    fn attention_forward(
        &self,
        out: &mut [f32],
        lse: &mut [f32],
        qkv: &[f32],
        mask: Option<&[u8]>,
        dims: AttnDims,
        dropout: Option<Dropout>,
        scratch: &mut [f32],
    ) {
        cpu::attention_forward(out, lse, qkv, mask, dims, dropout, scratch)
    }
    fn attention_backward(
        &self,
        dqkv: &mut [f32],
        recompute_out: Option<&mut [f32]>,
        dout: &[f32],
        qkv: &[f32],
        lse: &[f32],
        mask: Option<&[u8]>,
        dims: AttnDims,
        dropout: Option<Dropout>,
        scratch: &mut [f32],
    ) {
        cpu::attention_backward(
            dqkv,
            recompute_out,
            dout,
            qkv,
            lse,
            mask,
            dims,
            dropout,
            scratch,
        )
    }
    fn crossentropy_forward(
        &self,
        losses: &mut [f32],
        lse: &mut [f32],
        logits: &[f32],
        targets: &[i32],
        n: usize,
        v: usize,
    ) {
        cpu::crossentropy_forward(losses, lse, logits, targets, n, v)
    }
    fn crossentropy_backward(
        &self,
        dlogits: &mut [f32],
        logits: &[f32],
        lse: &[f32],
        targets: &[i32],
        scale: f32,
        n: usize,
        v: usize,
    ) {
        cpu::crossentropy_backward(dlogits, logits, lse, targets, scale, n, v)
    }
}

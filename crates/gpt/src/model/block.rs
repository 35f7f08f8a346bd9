//! One transformer block's forward math, shared by every path that runs a block: training
//! (whole model and pipeline stage, through [`block_forward`](super::block_forward)) and
//! decoding (`sample`'s forward over KV-cached rows).
//!
//! x_mid = x + drop(attend(ln_1(x) · W_attn + b_attn) · W_proj + b_proj)
//! x_next = x_mid + drop(gelu(ln_2(x_mid) · W_fc + b_fc) · W_fcproj + b_fcproj)
//!
//! For the rest of the family, ln_1/ln_2 may be RMSNorms, the qkv product (N, (NH+2·NKV)·HS)
//! goes to `attend` as it is (the caller rotates q and k and serves grouped heads), and the
//! MLP may be SwiGLU: silu(gate) · up of the (N, 2F) product, then W_fcproj.
//!
//! The caller supplies the attention (causal over the batch in training, over each row's KV
//! cache in decoding) and the buffers; everything else is here, once, in one kernel order.
//! These functions only call backend kernels on the slices they are given: they never
//! allocate and never decide where an activation is kept.

use super::*;
use cohort_engine::cpu::DecodeMatrix;

/// One block's parameters, sliced out of a parameter buffer: the block as its layer functions
/// read it. Biases are None in a model without biases.
pub(crate) struct BlockWeights<'p> {
    pub(crate) ln_1_w: &'p [f32],
    pub(crate) ln_1_b: Option<&'p [f32]>,
    /// (C, 3C) in Conv1D layout.
    pub(crate) attn_w: &'p [f32],
    pub(crate) attn_b: Option<&'p [f32]>,
    /// (C, C).
    pub(crate) proj_w: &'p [f32],
    pub(crate) proj_b: Option<&'p [f32]>,
    pub(crate) ln_2_w: &'p [f32],
    pub(crate) ln_2_b: Option<&'p [f32]>,
    /// (C, F).
    pub(crate) fc_w: &'p [f32],
    pub(crate) fc_b: Option<&'p [f32]>,
    /// (F, C).
    pub(crate) fcproj_w: &'p [f32],
    pub(crate) fcproj_b: Option<&'p [f32]>,
    /// The same four matrices in a decode format (a decode with bf16 or 8-bit weights): the
    /// forward's products read these instead of the f32 ones. None in training.
    pub(crate) decode: Option<&'p DecodeBlock>,
}

/// One block's four matrices kept for decode-time products (see `sample::DecodeWeights`),
/// each output-major.
pub(crate) struct DecodeBlock {
    /// (W, C).
    pub(crate) attn: DecodeMatrix,
    /// (C, C).
    pub(crate) proj: DecodeMatrix,
    /// (F or 2F, C).
    pub(crate) fc: DecodeMatrix,
    /// (C, F).
    pub(crate) fcproj: DecodeMatrix,
}

impl<'p> BlockWeights<'p> {
    /// The block at `bl` in the parameter buffer `p`.
    pub(crate) fn new(p: &'p [f32], bl: &BlockLayout) -> BlockWeights<'p> {
        BlockWeights {
            ln_1_w: &p[bl.ln_1_w.clone()],
            ln_1_b: opt(p, &bl.ln_1_b),
            attn_w: &p[bl.attn_w.clone()],
            attn_b: opt(p, &bl.attn_b),
            proj_w: &p[bl.proj_w.clone()],
            proj_b: opt(p, &bl.proj_b),
            ln_2_w: &p[bl.ln_2_w.clone()],
            ln_2_b: opt(p, &bl.ln_2_b),
            fc_w: &p[bl.fc_w.clone()],
            fc_b: opt(p, &bl.fc_b),
            fcproj_w: &p[bl.fcproj_w.clone()],
            fcproj_b: opt(p, &bl.fcproj_b),
            decode: None,
        }
    }
}

/// The shapes of one block's products: N rows, C d_model, F d_ff, W the qkv row; and the
/// block's kind of normalisation and MLP.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockDims {
    pub(crate) n: usize,
    pub(crate) c: usize,
    pub(crate) f: usize,
    pub(crate) w: usize,
    pub(crate) norm: Norm,
    pub(crate) mlp: Mlp,
}

/// The normalisation `norm` over `n` rows of `c`: LayerNorm (writing mean and rstd) or RMSNorm
/// (writing rstd).
pub(crate) fn norm_forward(
    dev: &dyn Backend,
    norm: Norm,
    out: &mut [f32],
    stats: LnStats,
    inp: &[f32],
    (w, b): (&[f32], Option<&[f32]>),
    (n, c): (usize, usize),
) {
    match norm {
        Norm::LayerNorm => dev.layernorm_forward(out, stats.mean, stats.rstd, inp, w, b, n, c),
        Norm::RmsNorm { eps } => dev.rmsnorm_forward(out, stats.rstd, inp, w, eps, n, c),
    }
}

/// Backward of [`norm_forward`] from d(output) `dout` at input `inp`: dinp, dw (and db) += ...
pub(crate) fn norm_backward(
    dev: &dyn Backend,
    norm: Norm,
    (dinp, dw, db): (&mut [f32], &mut [f32], Option<&mut [f32]>),
    (dout, inp): (&[f32], &[f32]),
    (mean, rstd): (&[f32], &[f32]),
    w: &[f32],
    (n, c): (usize, usize),
) {
    match norm {
        Norm::LayerNorm => dev.layernorm_backward(dinp, dw, db, dout, inp, mean, rstd, w, n, c),
        Norm::RmsNorm { .. } => dev.rmsnorm_backward(dinp, dw, dout, inp, rstd, w, n, c),
    }
}

/// Where ln_1 and ln_2 write their (N, C) outputs: a buffer each (kept for backward), or one
/// for both (ln_1's output is dead once the qkv product has read it).
pub(crate) enum LnOut<'a> {
    Each {
        ln_1: &'a mut [f32],
        ln_2: &'a mut [f32],
    },
    Shared(&'a mut [f32]),
}

impl<'a> LnOut<'a> {
    /// ln_1's output.
    fn ln_1(&mut self) -> &mut [f32] {
        match self {
            LnOut::Each { ln_1, .. } => ln_1,
            LnOut::Shared(ln) => ln,
        }
    }
    /// ln_2's output: taken once ln_1's is no longer read.
    fn ln_2(self) -> &'a mut [f32] {
        match self {
            LnOut::Each { ln_2, .. } => ln_2,
            LnOut::Shared(ln) => ln,
        }
    }
}

/// A LayerNorm's per-row statistics (N each), written by its forward for its backward.
pub(crate) struct LnStats<'a> {
    pub(crate) mean: &'a mut [f32],
    pub(crate) rstd: &'a mut [f32],
}

/// Where the MLP's activation output (N, F) goes: f32, or bf16 bits under bf16 products (see
/// the arena: the products that read it round it to bf16 anyway).
pub(crate) enum GeluOut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [u16]),
}

/// The buffers of one block's forward, each of N rows.
pub(crate) struct BlockActs<'a> {
    /// The block's input (N, C).
    pub(crate) x: &'a [f32],
    /// The residual stream after attention (N, C).
    pub(crate) x_mid: &'a mut [f32],
    /// The block's output (N, C).
    pub(crate) x_next: &'a mut [f32],
    pub(crate) ln: LnOut<'a>,
    pub(crate) ln_1: LnStats<'a>,
    pub(crate) ln_2: LnStats<'a>,
    /// (N, W): q, k, v as GPT-2 concatenates them (W = 3C), or with NKV key/value heads.
    pub(crate) qkv: &'a mut [f32],
    /// The attention output (N, C).
    pub(crate) att: &'a mut [f32],
    /// The MLP pre-activation (N, F), (N, 2F) under SwiGLU (in the fused product's interleaved
    /// order, see `matmul_swiglu_forward`); under [`GeluOut::Bf16`], the activation's
    /// derivatives at it instead (see `matmul_gelu_forward_bf16`, `matmul_swiglu_forward_bf16`).
    pub(crate) fch: &'a mut [f32],
    pub(crate) gelu: GeluOut<'a>,
}

/// The dropouts of a block's two residual branches (None: off).
#[derive(Clone, Copy)]
pub(crate) struct BranchDropout {
    pub(crate) attn: Option<Dropout>,
    pub(crate) mlp: Option<Dropout>,
}

/// One block's forward over `acts`' rows: ln_1 -> qkv -> `attend(qkv, att)` -> projection and
/// residual -> ln_2 -> MLP (the GELU or SwiGLU fused into its first product) -> projection and
/// residual.
/// `attend` is the only step that differs between training and decoding (it may rotate q and k
/// in place). Each product's bias is added with its residual (`residual_forward`), after the
/// product, so every path computes the same bits from the same inputs.
pub(crate) fn block_forward_rows<T: Timer>(
    dev: &dyn Backend,
    prof: &mut T,
    w: &BlockWeights,
    acts: BlockActs,
    dims: BlockDims,
    drop: BranchDropout,
    attend: impl FnOnce(&mut [f32], &mut [f32]),
) {
    let BlockDims {
        n,
        c,
        f,
        w: qkv_w,
        norm,
        mlp,
    } = dims;
    let BlockActs {
        x,
        x_mid,
        x_next,
        ln,
        ln_1,
        ln_2,
        qkv,
        att,
        fch,
        gelu,
    } = acts;
    // A product over the f32 weights, or over the decode copy where there is one (which
    // adds the bias itself, as matmul_forward does).
    let product = |out: &mut [f32],
                   inp: &[f32],
                   (f32_w, decode): (&[f32], Option<&DecodeMatrix>),
                   bias: Option<&[f32]>,
                   (c_in, oc): (usize, usize)| match decode {
        Some(m) => dev.decode_matmul_forward(out, inp, m, bias, n),
        None => dev.matmul_forward(out, inp, f32_w, bias, n, c_in, oc),
    };
    let d = w.decode;
    let mut ln = ln;
    let ln_1_out = ln.ln_1();
    prof.time(K::LnFwd, || {
        norm_forward(dev, norm, ln_1_out, ln_1, x, (w.ln_1_w, w.ln_1_b), (n, c))
    });
    prof.time(K::MatmulFwd, || {
        let attn_w = (w.attn_w, d.map(|d| &d.attn));
        product(qkv, ln_1_out, attn_w, w.attn_b, (c, qkv_w))
    });
    prof.time(K::AttnFwd, || attend(qkv, att));
    prof.time(K::MatmulFwd, || {
        product(x_mid, att, (w.proj_w, d.map(|d| &d.proj)), None, (c, c))
    });
    prof.time(K::ResidualFwd, || {
        dev.residual_forward(x_mid, x, w.proj_b, c, drop.attn)
    });
    let ln_2_out = ln.ln_2();
    prof.time(K::LnFwd, || {
        norm_forward(
            dev,
            norm,
            ln_2_out,
            ln_2,
            x_mid,
            (w.ln_2_w, w.ln_2_b),
            (n, c),
        )
    });
    let (fc_w, fcproj_w) = (
        (w.fc_w, d.map(|d| &d.fc)),
        (w.fcproj_w, d.map(|d| &d.fcproj)),
    );
    // The GELU (SwiGLU) runs on each strip of the product's rows while the strip is in cache
    // (its time counted with the product's), rather than as a pass of its own over [n, f].
    match gelu {
        GeluOut::F32(act) if mlp == Mlp::SwiGlu && d.is_some() => {
            // the decode copy's product, then the SwiGLU (nothing keeps `fch` in a decode)
            prof.time(K::MatmulFwd, || {
                product(fch, ln_2_out, fc_w, w.fc_b, (c, 2 * f))
            });
            prof.time(K::GeluFwd, || dev.swiglu_forward(act, fch, n, f));
            prof.time(K::MatmulFwd, || {
                product(x_next, act, fcproj_w, None, (f, c))
            });
        }
        GeluOut::F32(act) if mlp == Mlp::SwiGlu => {
            prof.time(K::MatmulFwd, || {
                dev.matmul_swiglu_forward(fch, act, ln_2_out, w.fc_w, w.fc_b, n, c, f)
            });
            prof.time(K::MatmulFwd, || {
                dev.matmul_forward(x_next, act, w.fcproj_w, None, n, f, c)
            });
        }
        GeluOut::F32(gelu) if d.is_some() => {
            // the decode copy's product, then the GELU (the same bits as the fused kernel's
            // over the same product)
            prof.time(K::MatmulFwd, || {
                product(fch, ln_2_out, fc_w, w.fc_b, (c, f))
            });
            prof.time(K::GeluFwd, || dev.gelu_forward(gelu, fch));
            prof.time(K::MatmulFwd, || {
                product(x_next, gelu, fcproj_w, None, (f, c))
            });
        }
        GeluOut::F32(gelu) => {
            prof.time(K::MatmulFwd, || {
                dev.matmul_gelu_forward(fch, gelu, ln_2_out, w.fc_w, w.fc_b, n, c, f)
            });
            prof.time(K::MatmulFwd, || {
                dev.matmul_forward(x_next, gelu, w.fcproj_w, None, n, f, c)
            });
        }
        GeluOut::Bf16(g16) => {
            debug_assert!(d.is_none(), "a decode keeps its activations in f32");
            prof.time(K::MatmulFwd, || match mlp {
                Mlp::Gelu => {
                    dev.matmul_gelu_forward_bf16(fch, g16, ln_2_out, w.fc_w, w.fc_b, n, c, f)
                }
                Mlp::SwiGlu => {
                    dev.matmul_swiglu_forward_bf16(fch, g16, ln_2_out, w.fc_w, w.fc_b, n, c, f)
                }
            });
            prof.time(K::MatmulFwd, || {
                dev.matmul_forward_bf16_input(x_next, g16, w.fcproj_w, None, n, f, c)
            });
        }
    }
    prof.time(K::ResidualFwd, || {
        dev.residual_forward(x_next, x_mid, w.fcproj_b, c, drop.mlp)
    });
}

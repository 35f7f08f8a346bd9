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
//! These functions only call backend kernels on the views they are given: they never
//! allocate and never decide where an activation is kept.

use super::*;
use cohort_engine::cpu::DecodeMatrix;

/// One block's parameters, sliced out of a parameter buffer: the block as its layer functions
/// read it. Biases are None in a model without biases.
pub(crate) struct BlockWeights<'p> {
    pub(crate) ln_1_w: View<'p, f32>,
    pub(crate) ln_1_b: Option<View<'p, f32>>,
    /// (C, 3C) in Conv1D layout.
    pub(crate) attn_w: View<'p, f32>,
    pub(crate) attn_b: Option<View<'p, f32>>,
    /// (C, C).
    pub(crate) proj_w: View<'p, f32>,
    pub(crate) proj_b: Option<View<'p, f32>>,
    pub(crate) ln_2_w: View<'p, f32>,
    pub(crate) ln_2_b: Option<View<'p, f32>>,
    /// (C, F).
    pub(crate) fc_w: View<'p, f32>,
    pub(crate) fc_b: Option<View<'p, f32>>,
    /// (F, C).
    pub(crate) fcproj_w: View<'p, f32>,
    pub(crate) fcproj_b: Option<View<'p, f32>>,
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
    pub(crate) fn new(p: View<'p, f32>, bl: &BlockLayout) -> BlockWeights<'p> {
        BlockWeights {
            ln_1_w: p.slice(bl.ln_1_w.clone()),
            ln_1_b: opt(p, &bl.ln_1_b),
            attn_w: p.slice(bl.attn_w.clone()),
            attn_b: opt(p, &bl.attn_b),
            proj_w: p.slice(bl.proj_w.clone()),
            proj_b: opt(p, &bl.proj_b),
            ln_2_w: p.slice(bl.ln_2_w.clone()),
            ln_2_b: opt(p, &bl.ln_2_b),
            fc_w: p.slice(bl.fc_w.clone()),
            fc_b: opt(p, &bl.fc_b),
            fcproj_w: p.slice(bl.fcproj_w.clone()),
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
/// (writing rstd), its output in f32 or bf16.
pub(crate) fn norm_forward(
    dev: &dyn Backend,
    norm: Norm,
    out: NormOut,
    stats: LnStats,
    inp: View<f32>,
    (w, b): (View<f32>, Option<View<f32>>),
    (n, c): (usize, usize),
) {
    let (mean, rstd) = (stats.mean, stats.rstd);
    match (norm, out) {
        (Norm::LayerNorm, NormOut::F32(o)) => dev.layernorm_forward(o, mean, rstd, inp, w, b, n, c),
        (Norm::LayerNorm, NormOut::Bf16(o)) => {
            dev.layernorm_forward_bf16(o, mean, rstd, inp, w, b, n, c)
        }
        (Norm::RmsNorm { eps }, NormOut::F32(o)) => dev.rmsnorm_forward(o, rstd, inp, w, eps, n, c),
        (Norm::RmsNorm { eps }, NormOut::Bf16(o)) => {
            dev.rmsnorm_forward_bf16(o, rstd, inp, w, eps, n, c)
        }
    }
}

/// Where a normalisation writes its (N, C) output: f32, or bf16 bits under bf16 products
/// (see the arena: only products read it, and they round it to bf16 anyway).
pub(crate) enum NormOut<'a> {
    F32(ViewMut<'a, f32>),
    Bf16(ViewMut<'a, u16>),
}

/// A normalisation's output as the products read it (see [`NormOut`]).
#[derive(Clone, Copy)]
pub(crate) enum NormIn<'a> {
    F32(View<'a, f32>),
    Bf16(View<'a, u16>),
}

impl<'a> NormOut<'a> {
    pub(crate) fn reborrow(&mut self) -> NormOut<'_> {
        match self {
            NormOut::F32(v) => NormOut::F32(v.reborrow()),
            NormOut::Bf16(v) => NormOut::Bf16(v.reborrow()),
        }
    }
    pub(crate) fn as_view(&self) -> NormIn<'_> {
        match self {
            NormOut::F32(v) => NormIn::F32(v.as_view()),
            NormOut::Bf16(v) => NormIn::Bf16(v.as_view()),
        }
    }
    pub(crate) fn into_view(self) -> NormIn<'a> {
        match self {
            NormOut::F32(v) => NormIn::F32(v.into()),
            NormOut::Bf16(v) => NormIn::Bf16(v.into()),
        }
    }
}

/// The backward of a product of a normalisation's output in either precision: `dinp = dout ·
/// wᵀ` (overwritten), `dw += inpᵀ · dout` (overwritten unless `accumulate`), `dbias += Σ_rows
/// dout`; under bf16 the two halves of `matmul_backward` apart (the same
/// bits: the weight gradient's product rounds an f32 input to the same bf16).
#[allow(clippy::too_many_arguments)]
pub(crate) fn norm_product_backward(
    dev: &dyn Backend,
    (dinp, dw, db): (ViewMut<f32>, ViewMut<f32>, Option<ViewMut<f32>>),
    dout: View<f32>,
    inp: NormIn,
    w: View<f32>,
    (n, c, oc): (usize, usize, usize),
    accumulate: bool,
) {
    match inp {
        NormIn::F32(x) => dev.matmul_backward(Some(dinp), dw, db, dout, x, w, n, c, oc, accumulate),
        NormIn::Bf16(x) => {
            dev.matmul_backward_input(dinp, dout, w, n, c, oc);
            dev.matmul_backward_weight_bf16_input(dw, db, dout, x, n, c, oc, accumulate);
        }
    }
}

/// Backward of [`norm_forward`] from d(output) `dout` at input `inp`: dinp, dw (and db) += ...
pub(crate) fn norm_backward(
    dev: &dyn Backend,
    norm: Norm,
    (dinp, dw, db): (ViewMut<f32>, ViewMut<f32>, Option<ViewMut<f32>>),
    (dout, inp): (View<f32>, View<f32>),
    (mean, rstd): (View<f32>, View<f32>),
    w: View<f32>,
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
        ln_1: NormOut<'a>,
        ln_2: NormOut<'a>,
    },
    Shared(NormOut<'a>),
}

impl<'a> LnOut<'a> {
    /// ln_1's output.
    fn ln_1(&mut self) -> NormOut<'_> {
        match self {
            LnOut::Each { ln_1, .. } => ln_1.reborrow(),
            LnOut::Shared(ln) => ln.reborrow(),
        }
    }
    /// ln_2's output: taken once ln_1's is no longer read.
    fn ln_2(self) -> NormOut<'a> {
        match self {
            LnOut::Each { ln_2, .. } => ln_2,
            LnOut::Shared(ln) => ln,
        }
    }
}

/// A LayerNorm's per-row statistics (N each), written by its forward for its backward.
pub(crate) struct LnStats<'a> {
    pub(crate) mean: ViewMut<'a, f32>,
    pub(crate) rstd: ViewMut<'a, f32>,
}

/// Where the MLP's activation output (N, F) goes: f32, or bf16 bits under bf16 products (see
/// the arena: the products that read it round it to bf16 anyway).
pub(crate) enum GeluOut<'a> {
    F32(ViewMut<'a, f32>),
    Bf16(ViewMut<'a, u16>),
}

/// The buffers of one block's forward, each of N rows.
pub(crate) struct BlockActs<'a> {
    /// The block's input (N, C).
    pub(crate) x: View<'a, f32>,
    /// The residual stream after attention (N, C).
    pub(crate) x_mid: ViewMut<'a, f32>,
    /// The block's output (N, C).
    pub(crate) x_next: ViewMut<'a, f32>,
    pub(crate) ln: LnOut<'a>,
    pub(crate) ln_1: LnStats<'a>,
    pub(crate) ln_2: LnStats<'a>,
    /// (N, W): q, k, v as GPT-2 concatenates them (W = 3C), or with NKV key/value heads.
    pub(crate) qkv: QkvOut<'a>,
    /// The attention output (N, C).
    pub(crate) att: ViewMut<'a, f32>,
    /// The MLP pre-activation (N, F), (N, 2F) under SwiGLU (in the fused product's interleaved
    /// order, see `matmul_swiglu_forward`); under [`GeluOut::Bf16`], the activation's
    /// derivatives at it instead (see `matmul_gelu_forward_bf16`, `matmul_swiglu_forward_bf16`).
    pub(crate) fch: ViewMut<'a, f32>,
    pub(crate) gelu: GeluOut<'a>,
}

/// Where the qkv product writes its (N, W) rows: f32, or bf16 bits where attention is its
/// only reader (see the arena's `qkv16`: attention rounds them to bf16 anyway), the product
/// then summing into `sums` (N, W), scratch.
pub(crate) enum QkvOut<'a> {
    F32(ViewMut<'a, f32>),
    Bf16 {
        qkv: ViewMut<'a, u16>,
        sums: ViewMut<'a, f32>,
    },
}

/// The qkv rows as attention reads them (see [`QkvOut`]).
#[derive(Clone, Copy)]
pub(crate) enum QkvIn<'a> {
    F32(View<'a, f32>),
    Bf16(View<'a, u16>),
}

impl QkvOut<'_> {
    /// The rows the product wrote, for attention.
    pub(crate) fn rows(&self) -> QkvIn<'_> {
        match self {
            QkvOut::F32(x) => QkvIn::F32(x.as_view()),
            QkvOut::Bf16 { qkv, .. } => QkvIn::Bf16(qkv.as_view()),
        }
    }
}

/// What the attention kernels take besides their buffers: the batch's mask and segment ids,
/// the shapes, key/value heads and dropout.
#[derive(Clone, Copy)]
pub(crate) struct AttnCall<'a> {
    pub(crate) mask: Option<View<'a, u8>>,
    pub(crate) segments: Option<View<'a, u32>>,
    pub(crate) dims: AttnDims,
    pub(crate) nkv: usize,
    pub(crate) dropout: Option<Dropout>,
}

impl<'a> AttnCall<'a> {
    /// What the attention kernels of a pass of `dims` take, with the batch's mask and
    /// segments and `dropout`.
    pub(crate) fn of(
        dims: Dims,
        mask: Option<View<'a, u8>>,
        segments: Option<View<'a, u32>>,
        dropout: Option<Dropout>,
    ) -> AttnCall<'a> {
        let (nkv, dims) = (dims.nkv, dims.attn());
        AttnCall {
            mask,
            segments,
            dims,
            nkv,
            dropout,
        }
    }
}

/// Attention's forward over qkv rows in either precision (the bf16 rows' kernel gives the f32
/// rows' bits).
pub(crate) fn attention_forward(
    dev: &dyn Backend,
    (out, lse): (ViewMut<f32>, ViewMut<f32>),
    qkv: QkvIn,
    a: AttnCall,
    scratch: ViewMut<f32>,
) {
    let AttnCall {
        mask,
        segments,
        dims,
        nkv,
        dropout: d,
    } = a;
    match qkv {
        QkvIn::F32(q) => {
            dev.attention_forward_grouped(out, lse, q, mask, segments, dims, nkv, d, scratch)
        }
        QkvIn::Bf16(q) => {
            dev.attention_forward_bf16_qkv(out, lse, q, mask, segments, dims, nkv, d, scratch)
        }
    }
}

/// Attention's backward over qkv rows in either precision, as [`attention_forward`].
pub(crate) fn attention_backward(
    dev: &dyn Backend,
    (dqkv, recompute): (ViewMut<f32>, Option<ViewMut<f32>>),
    (dout, qkv, lse): (View<f32>, QkvIn, View<f32>),
    a: AttnCall,
    scratch: ViewMut<f32>,
) {
    let AttnCall {
        mask,
        segments,
        dims,
        nkv,
        dropout: d,
    } = a;
    let (m, s) = (mask, segments);
    match qkv {
        QkvIn::F32(q) => dev
            .attention_backward_grouped(dqkv, recompute, dout, q, lse, m, s, dims, nkv, d, scratch),
        QkvIn::Bf16(q) => dev.attention_backward_bf16_qkv(
            dqkv, recompute, dout, q, lse, m, s, dims, nkv, d, scratch,
        ),
    }
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
    attend: impl FnOnce(QkvOut, ViewMut<f32>),
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
        mut x_mid,
        mut x_next,
        ln,
        ln_1,
        ln_2,
        mut qkv,
        mut att,
        mut fch,
        gelu,
    } = acts;
    // A product over the f32 weights, or over the decode copy where there is one (which
    // adds the bias itself, as matmul_forward does).
    let product = |out: ViewMut<f32>,
                   inp: View<f32>,
                   (f32_w, decode): (View<f32>, Option<&DecodeMatrix>),
                   bias: Option<View<f32>>,
                   (c_in, oc): (usize, usize)| match decode {
        Some(m) => dev.decode_matmul_forward(out, inp, m, bias, n),
        None => dev.matmul_forward(out, inp, f32_w, bias, n, c_in, oc),
    };
    let d = w.decode;
    let mut ln = ln;
    let mut ln_1_out = ln.ln_1();
    prof.time(K::LnFwd, || {
        let out = ln_1_out.reborrow();
        norm_forward(dev, norm, out, ln_1, x, (w.ln_1_w, w.ln_1_b), (n, c))
    });
    prof.time(K::MatmulFwd, || match (ln_1_out.as_view(), &mut qkv) {
        (NormIn::F32(x), QkvOut::F32(qkv)) => {
            let attn_w = (w.attn_w, d.map(|d| &d.attn));
            product(qkv.reborrow(), x, attn_w, w.attn_b, (c, qkv_w))
        }
        (NormIn::Bf16(x), QkvOut::F32(qkv)) => {
            debug_assert!(d.is_none(), "a decode keeps its activations in f32");
            dev.matmul_forward_bf16_input(qkv.reborrow(), x, w.attn_w, w.attn_b, n, c, qkv_w)
        }
        (NormIn::Bf16(x), QkvOut::Bf16 { qkv, sums }) => {
            let (sums, out) = (sums.reborrow(), qkv.reborrow());
            dev.matmul_forward_bf16_out(sums, out, x, w.attn_w, w.attn_b, n, c, qkv_w)
        }
        (NormIn::F32(_), QkvOut::Bf16 { .. }) => {
            unreachable!("qkv kept in bf16 only beside bf16 LayerNorm outputs")
        }
    });
    prof.time(K::AttnFwd, || attend(qkv, att.reborrow()));
    prof.time(K::MatmulFwd, || {
        let proj_w = (w.proj_w, d.map(|d| &d.proj));
        product(x_mid.reborrow(), att.as_view(), proj_w, None, (c, c))
    });
    prof.time(K::ResidualFwd, || {
        dev.residual_forward(x_mid.reborrow(), x, w.proj_b, c, drop.attn)
    });
    let mut ln_2_out = ln.ln_2();
    prof.time(K::LnFwd, || {
        norm_forward(
            dev,
            norm,
            ln_2_out.reborrow(),
            ln_2,
            x_mid.as_view(),
            (w.ln_2_w, w.ln_2_b),
            (n, c),
        )
    });
    let ln_2_in = ln_2_out.as_view();
    let (fc_w, fcproj_w) = (
        (w.fc_w, d.map(|d| &d.fc)),
        (w.fcproj_w, d.map(|d| &d.fcproj)),
    );
    // The GELU (SwiGLU) runs on each strip of the product's rows while the strip is in cache
    // (its time counted with the product's), rather than as a pass of its own over [n, f].
    // The arena keeps the normalisations' and the MLP activation's outputs in bf16 together
    // (under bf16 products) or in f32 together.
    match (gelu, ln_2_in) {
        (GeluOut::F32(mut act), NormIn::F32(ln_2_out)) if mlp == Mlp::SwiGlu && d.is_some() => {
            // the decode copy's product, then the SwiGLU (nothing keeps `fch` in a decode)
            prof.time(K::MatmulFwd, || {
                product(fch.reborrow(), ln_2_out, fc_w, w.fc_b, (c, 2 * f))
            });
            prof.time(K::GeluFwd, || {
                dev.swiglu_forward(act.reborrow(), fch.as_view(), n, f)
            });
            prof.time(K::MatmulFwd, || {
                product(x_next.reborrow(), act.as_view(), fcproj_w, None, (f, c))
            });
        }
        (GeluOut::F32(mut act), NormIn::F32(ln_2_out)) if mlp == Mlp::SwiGlu => {
            prof.time(K::MatmulFwd, || {
                let (pre, out) = (fch.reborrow(), act.reborrow());
                dev.matmul_swiglu_forward(pre, out, ln_2_out, w.fc_w, w.fc_b, n, c, f)
            });
            prof.time(K::MatmulFwd, || {
                let out = x_next.reborrow();
                dev.matmul_forward(out, act.as_view(), w.fcproj_w, None, n, f, c)
            });
        }
        (GeluOut::F32(mut gelu), NormIn::F32(ln_2_out)) if d.is_some() => {
            // the decode copy's product, then the GELU (the same bits as the fused kernel's
            // over the same product)
            prof.time(K::MatmulFwd, || {
                product(fch.reborrow(), ln_2_out, fc_w, w.fc_b, (c, f))
            });
            prof.time(K::GeluFwd, || {
                dev.gelu_forward(gelu.reborrow(), fch.as_view())
            });
            prof.time(K::MatmulFwd, || {
                product(x_next.reborrow(), gelu.as_view(), fcproj_w, None, (f, c))
            });
        }
        (GeluOut::F32(mut gelu), NormIn::F32(ln_2_out)) => {
            prof.time(K::MatmulFwd, || {
                let (pre, out) = (fch.reborrow(), gelu.reborrow());
                dev.matmul_gelu_forward(pre, out, ln_2_out, w.fc_w, w.fc_b, n, c, f)
            });
            prof.time(K::MatmulFwd, || {
                let out = x_next.reborrow();
                dev.matmul_forward(out, gelu.as_view(), w.fcproj_w, None, n, f, c)
            });
        }
        (GeluOut::Bf16(mut g16), NormIn::Bf16(ln_2_out)) => {
            debug_assert!(d.is_none(), "a decode keeps its activations in f32");
            prof.time(K::MatmulFwd, || {
                let (grad, out) = (fch.reborrow(), g16.reborrow());
                match mlp {
                    Mlp::Gelu => {
                        dev.matmul_gelu_forward_bf16(grad, out, ln_2_out, w.fc_w, w.fc_b, n, c, f)
                    }
                    Mlp::SwiGlu => {
                        dev.matmul_swiglu_forward_bf16(grad, out, ln_2_out, w.fc_w, w.fc_b, n, c, f)
                    }
                }
            });
            prof.time(K::MatmulFwd, || {
                let out = x_next.reborrow();
                dev.matmul_forward_bf16_input(out, g16.as_view(), w.fcproj_w, None, n, f, c)
            });
        }
        _ => unreachable!("ln_2's and the MLP activation's outputs in different precisions"),
    }
    prof.time(K::ResidualFwd, || {
        dev.residual_forward(x_next, x_mid.as_view(), w.fcproj_b, c, drop.mlp)
    });
}

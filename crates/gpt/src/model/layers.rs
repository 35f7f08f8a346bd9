//! The model's layers as functions on flat buffers: embeddings, one transformer block and the
//! head, forward and backward, in the order llm.c's `train_gpt2.c` calls its kernels. The whole
//! model and a pipeline stage run the same functions, which is why their results agree bit for
//! bit.
//!
//! These functions only call backend kernels on the views they are given; they never allocate
//! and never touch an activation on the host.

use super::*;

/// `g[w]` and the bias right after it (empty range: None), as two disjoint views.
pub(crate) fn wb<'a>(
    g: &'a mut ViewMut<'_, f32>,
    off: usize,
    w: &Range<usize>,
    b: &Range<usize>,
) -> (ViewMut<'a, f32>, Option<ViewMut<'a, f32>>) {
    let (wg, rest) = g.slice_mut(w.start - off..).split_at_mut(w.len());
    let bg = if b.is_empty() {
        None
    } else {
        Some(rest.into_slice(..b.len()))
    };
    (wg, bg)
}

/// `p[r]`, or None for an empty range (a model without biases).
pub(crate) fn opt<'a>(p: View<'a, f32>, r: &Range<usize>) -> Option<View<'a, f32>> {
    if r.is_empty() {
        None
    } else {
        Some(p.slice(r.clone()))
    }
}

/// The dropout settings of one step; `site` hands out the key of each dropout location.
#[derive(Clone, Copy)]
pub(crate) struct DropKey {
    pub(crate) on: bool,
    pub(crate) p: f32,
    pub(crate) seed: u64,
    pub(crate) rank: u64,
    pub(crate) step: u64,
}

impl DropKey {
    /// Sites: 0 embeddings; per layer l: 1+3l attention probabilities, 2+3l attention
    /// output, 3+3l MLP output.
    pub(super) fn site(&self, site: u64) -> Option<Dropout> {
        self.on.then(|| Dropout {
            p: self.p,
            key: Dropout::key(self.seed, self.rank, self.step, site),
        })
    }
}

/// Block `l`'s slice of a per-layer buffer whose layers are `len` long.
pub(crate) fn layer<'b>(buf: &'b ViewMut<'_, f32>, l: usize, len: usize) -> View<'b, f32> {
    buf.slice(l * len..(l + 1) * len)
}

pub(super) fn layer_mut<'b>(
    buf: &'b mut ViewMut<'_, f32>,
    l: usize,
    len: usize,
) -> ViewMut<'b, f32> {
    buf.slice_mut(l * len..(l + 1) * len)
}

/// (layer l, read-only) and (layer l + 1, writable) of a per-layer buffer.
pub(super) fn layer_pair<'b>(
    buf: &'b mut ViewMut<'_, f32>,
    l: usize,
    len: usize,
) -> (View<'b, f32>, ViewMut<'b, f32>) {
    let (lo, hi) = buf.reborrow().split_at_mut((l + 1) * len);
    (View::from(lo).slice(l * len..), hi.into_slice(..len))
}

/// The shapes of one pass, named once: B batch, T sequence, C d_model, F d_ff, NH heads,
/// NKV key/value heads, V vocab; and the model's kind of normalisation, positions and MLP.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub(crate) b: usize,
    pub(crate) t: usize,
    pub(crate) c: usize,
    pub(crate) f: usize,
    pub(crate) nh: usize,
    pub(crate) nkv: usize,
    pub(crate) v: usize,
    pub(crate) norm: Norm,
    pub(crate) mlp: Mlp,
    /// Rotary positions (else learned).
    pub(crate) rope: bool,
}

impl Dims {
    /// The shapes of a (`b`, `t`) batch through a model of `cfg`.
    pub(crate) fn new(cfg: &GPTConfig, b: usize, t: usize) -> Dims {
        Dims {
            b,
            t,
            c: cfg.d_model,
            f: cfg.d_ff,
            nh: cfg.n_heads,
            nkv: cfg.kv_heads(),
            v: cfg.vocab_size,
            norm: cfg.norm,
            mlp: cfg.mlp,
            rope: cfg.positions != crate::Positions::Learned,
        }
    }
    /// Head size.
    pub(crate) fn hs(self) -> usize {
        self.c / self.nh
    }
    /// Width of the qkv product's rows: (NH + 2·NKV)·HS.
    pub(crate) fn qkv_width(self) -> usize {
        (self.nh + 2 * self.nkv) * self.hs()
    }
    /// Width of the MLP's first product: F, or 2F (gate and up) under SwiGLU.
    pub(crate) fn fc_width(self) -> usize {
        match self.mlp {
            Mlp::Gelu => self.f,
            Mlp::SwiGlu => 2 * self.f,
        }
    }
    /// What the rotary kernels take for the qkv rows: q's and k's heads.
    pub(crate) fn rope_dims(self, n: usize) -> RopeDims {
        RopeDims {
            n,
            width: self.qkv_width(),
            heads: self.nh + self.nkv,
            hs: self.hs(),
        }
    }
    /// N = B*T tokens.
    pub(crate) fn n(self) -> usize {
        self.b * self.t
    }
    /// What the attention kernels take.
    pub(crate) fn attn(self) -> AttnDims {
        AttnDims {
            b: self.b,
            t: self.t,
            c: self.c,
            nh: self.nh,
        }
    }
    /// What one block's products take.
    pub(crate) fn block(self) -> BlockDims {
        BlockDims {
            n: self.n(),
            c: self.c,
            f: self.f,
            w: self.qkv_width(),
            norm: self.norm,
            mlp: self.mlp,
        }
    }
}

/// Rotary embeddings' angle tables (positions × HS/2 each), computed once per model.
#[derive(Debug)]
pub(crate) struct RopeTables {
    pub(crate) cos: Vec<f32>,
    pub(crate) sin: Vec<f32>,
    /// cos then sin in a device's memory (None on the CPU, whose kernels read the vectors).
    device: Option<Buffer>,
}

impl RopeTables {
    /// The cosine table.
    pub(crate) fn cos(&self) -> View<'_, f32> {
        match &self.device {
            Some(b) => b.view().slice(..self.cos.len()),
            None => View::from(&self.cos[..]),
        }
    }
    /// The sine table.
    pub(crate) fn sin(&self) -> View<'_, f32> {
        match &self.device {
            Some(b) => b.view().slice(self.cos.len()..),
            None => View::from(&self.sin[..]),
        }
    }
    /// The tables of `cfg` where `dev`'s kernels read them; None with learned positions.
    pub(crate) fn on(cfg: &GPTConfig, dev: &dyn Backend) -> Result<Option<RopeTables>, GptError> {
        let Some(mut r) = RopeTables::new(cfg) else {
            return Ok(None);
        };
        if dev.device() != Device::Cpu {
            let both = [&r.cos[..], &r.sin[..]].concat();
            let mut b = alloc(dev, both.len(), "allocate the rotary tables")?;
            copy_in(dev, &mut b, &both, "copy the rotary tables to the device")?;
            r.device = Some(b);
        }
        Ok(Some(r))
    }
    /// The tables of `cfg`'s positions; None with learned positions.
    pub(crate) fn new(cfg: &GPTConfig) -> Option<RopeTables> {
        let inv = cfg.rope_inv_freq()?;
        let (cos, sin) = cohort_engine::cpu::rope_tables(&inv, cfg.max_position_embeddings);
        Some(RopeTables {
            cos,
            sin,
            device: None,
        })
    }
}

/// What every layer function of one pass shares: the backend, the shapes, the batch forward
/// saw, the dropout key, the rotary tables, and the attention scratch and profiler the pass
/// writes to.
pub(crate) struct Pass<'a> {
    pub(crate) dev: &'a dyn Backend,
    /// The model's rotary tables (None with learned positions).
    pub(crate) rope: Option<&'a RopeTables>,
    pub(crate) dims: Dims,
    pub(crate) batch: &'a Batch,
    pub(crate) drop: DropKey,
    /// The attention kernels' scratch.
    pub(crate) scratch: ViewMut<'a, f32>,
    pub(crate) prof: &'a mut Profile,
    /// In backward: whether the weight matrices' products add into their gradients, or
    /// overwrite them (after a lazy `zero_grad`, which left them unwritten). Forward: unused.
    pub(crate) accumulate_weight_grads: bool,
}

impl<'a> Pass<'a> {
    /// The batch's padding mask (None when every position is a token).
    pub(crate) fn mask(&self) -> Option<View<'a, u8>> {
        let batch: &'a Batch = self.batch;
        batch.mask()
    }

    /// The batch's segment ids (None when each row is one sequence).
    pub(crate) fn segments(&self) -> Option<View<'a, u32>> {
        let batch: &'a Batch = self.batch;
        batch.segments()
    }
}

/// The (start, length) of each sequence of a packed batch's rows: runs of equal segment ids.
fn segment_runs(segments: &[u32], t: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        let start = i;
        i += 1;
        while i < segments.len() && !i.is_multiple_of(t) && segments[i] == segments[start] {
            i += 1;
        }
        (start < segments.len()).then_some((start, i - start))
    })
}

/// Which block a layer function runs, and where its parameters are.
#[derive(Clone, Copy)]
pub(crate) struct BlockAt<'l> {
    /// Its index in the arena's per-layer buffers (among the blocks the arena holds).
    pub(crate) local: usize,
    /// Its index in the whole model: it keys the dropout sites.
    pub(crate) global: usize,
    pub(crate) layout: &'l BlockLayout,
}

impl BlockAt<'_> {
    /// The dropout site of the block's attention probabilities; its two residual branches
    /// are the next two.
    fn drop_site(self) -> u64 {
        1 + 3 * self.global as u64
    }
}

/// Where the head's backward writes: the head weight's gradient (wte's when tied) and ln_f's.
pub(crate) struct HeadGrads<'g> {
    pub(crate) head: ViewMut<'g, f32>,
    pub(crate) ln_f_w: ViewMut<'g, f32>,
    pub(crate) ln_f_b: Option<ViewMut<'g, f32>>,
}

/// Token + position embeddings (and their dropout) into `a.res[0]`.
pub(crate) fn embed_forward(pass: &mut Pass, lay: &Layout, p: View<f32>, a: &mut Acts) {
    let Dims { b, t, c, .. } = pass.dims;
    let (dev, batch, prof) = (pass.dev, pass.batch, &mut *pass.prof);
    let mut x0 = a.res.slice_mut(..b * t * c);
    let wte = p.slice(lay.wte.clone());
    prof.time(K::EncoderFwd, || {
        let (wpe, ids) = (p.slice(lay.wpe.clone()), batch.ids());
        match batch.segment_ids() {
            _ if pass.dims.rope => dev.embedding_forward(x0.reborrow(), ids, wte, b * t, c),
            // Learned positions restart at each packed sequence: one row of its own length each.
            Some(segments) => {
                for (i, len) in segment_runs(segments, t) {
                    let (x, ids) = (x0.slice_mut(i * c..(i + len) * c), ids.slice(i..i + len));
                    dev.encoder_forward(x, ids, wte, wpe, 1, len, c)
                }
            }
            None => dev.encoder_forward(x0.reborrow(), ids, wte, wpe, b, t, c),
        }
    });
    if let Some(d) = pass.drop.site(0) {
        prof.time(K::ResidualFwd, || dev.dropout_forward(x0, d));
    }
}

/// One block's forward from `a.res[l]` into `a.res[l + 1]` (`l` = `at.local`), keeping in the
/// arena what its backward reads.
pub(crate) fn block_forward(pass: &mut Pass, at: BlockAt, p: View<f32>, a: &mut Acts) {
    let dims = pass.dims;
    let Dims { c, f, nh, .. } = dims;
    let n = dims.n();
    let nc = n * c;
    let l = at.local;
    let ld = at.drop_site();
    let (ln1_slot, ln2_slot, atty_slot) = (a.ln_slot(l, 0), a.ln_slot(l, 1), a.atty_slot(l));
    // This layer's slot of the per-layer buffers (the one slot under activation checkpointing).
    let sl = a.layer_slot(l);
    let (x, x_next) = layer_pair(&mut a.res, l, nc);
    let ln = if ln1_slot == ln2_slot {
        // bf16 under bf16 products (see the arena)
        LnOut::Shared(ln_out(&mut a.s_ln, ln1_slot, nc, a.ln16))
    } else {
        // kept (in f32): ln_1's and ln_2's outputs are the two slots 2l and 2l + 1
        let (ln_1, ln_2) = layer_mut(&mut a.s_ln, l, 2 * nc).split_at_mut(nc);
        let (ln_1, ln_2) = (NormOut::F32(ln_1), NormOut::F32(ln_2));
        LnOut::Each { ln_1, ln_2 }
    };
    // s_big: the GELU output, or (under qkv16, where that is in gelu16) the qkv product's sums
    let mut big = Some(a.s_big.reborrow());
    let gelu = if !a.gelu16.is_empty() {
        // Under bf16 products the GELU output is kept in bf16 for backward (see the arena).
        GeluOut::Bf16(bf16_layer(&mut a.gelu16, sl, n * f))
    } else if a.keep {
        GeluOut::F32(layer_mut(&mut a.gelu, l, n * f))
    } else {
        GeluOut::F32(big.take().expect("s_big").into_slice(..n * f))
    };
    // The product's rows are kept (rotated) as they are, (N, (NH+2·NKV)·HS), and the attention
    // kernels read grouped key/value heads where they are.
    let qkv_w = dims.qkv_width();
    let qkv = qkv_out(&mut a.qkv, big, sl, n * qkv_w, a.qkv16);
    let acts = BlockActs {
        x,
        x_mid: layer_mut(&mut a.res_mid, sl, nc),
        x_next,
        ln,
        ln_1: LnStats {
            mean: layer_mut(&mut a.ln1_mean, sl, n),
            rstd: layer_mut(&mut a.ln1_rstd, sl, n),
        },
        ln_2: LnStats {
            mean: layer_mut(&mut a.ln2_mean, sl, n),
            rstd: layer_mut(&mut a.ln2_rstd, sl, n),
        },
        qkv,
        att: layer_mut(&mut a.s_atty, atty_slot, nc),
        fch: layer_mut(&mut a.fch, sl, n * dims.fc_width()),
        gelu,
    };
    let lse = layer_mut(&mut a.att_lse, sl, n * nh);
    let segments = pass.segments();
    let (mask, drop, scratch) = (pass.mask(), pass.drop, pass.scratch.reborrow());
    let (dev, rope, pos) = (pass.dev, pass.rope, pass.batch.pos());
    let branches = BranchDropout {
        attn: drop.site(ld + 1),
        mlp: drop.site(ld + 2),
    };
    let w = BlockWeights::new(p, at.layout);
    block_forward_rows(
        dev,
        pass.prof,
        &w,
        acts,
        dims.block(),
        branches,
        |mut qkv, att| {
            if let (Some(r), QkvOut::F32(qkv)) = (rope, &mut qkv) {
                dev.rope_forward(qkv.reborrow(), pos, r.cos(), r.sin(), dims.rope_dims(n));
            }
            let call = AttnCall::of(dims, mask, segments, drop.site(ld));
            attention_forward(dev, (att, lse), qkv.rows(), call, scratch)
        },
    );
}

/// ln_f, the head and (with targets) the cross-entropy, from `a.res[L]` (L the blocks of
/// `lay`); returns the mean loss over counted positions.
pub(crate) fn head_forward(
    pass: &mut Pass,
    lay: &Layout,
    p: View<f32>,
    a: &mut Acts,
) -> Option<f32> {
    let Dims { c, v, .. } = pass.dims;
    let n = pass.dims.n();
    let nc = n * c;
    let (dev, batch, prof) = (pass.dev, pass.batch, &mut *pass.prof);
    let x_last = layer(&a.res, lay.blocks.len(), nc);
    // ln_f's output stays f32 under bf16 products too: the head's weight gradient (dout^T ·
    // ln_f out) reads it as its right operand, which the bf16 product packs from f32 only.
    let mut lnf_out = a.lnf_out.slice_mut(..nc);
    let stats = LnStats {
        mean: a.lnf_mean.slice_mut(..n),
        rstd: a.lnf_rstd.slice_mut(..n),
    };
    let lnf = (p.slice(lay.ln_f_w.clone()), opt(p, &lay.ln_f_b));
    prof.time(K::LnFwd, || {
        norm_forward(
            dev,
            pass.dims.norm,
            NormOut::F32(lnf_out.reborrow()),
            stats,
            x_last,
            lnf,
            (n, c),
        )
    });
    let lnf_out = lnf_out.as_view();
    let w = p.slice(lay.lm_head.clone());
    let cols = a.logit_cols;
    let targets = batch.targets();
    if cols < v {
        // Blocks of the vocabulary: each block's logits fold into each row's log-sum-exp, and
        // the target's logit is picked up in its block; only those two stay.
        let mut lse = a.ce_lse.slice_mut(..n);
        dev.fill(lse.reborrow(), f32::NEG_INFINITY);
        let mut target_logit = a.losses.slice_mut(..n);
        for v0 in (0..v).step_by(cols) {
            let vc = cols.min(v - v0);
            let mut logits = a.logits.slice_mut(..n * vc);
            let wb = w.slice(v0 * c..(v0 + vc) * c);
            prof.time(K::HeadFwd, || {
                dev.head_forward(logits.reborrow(), lnf_out, wb, n, c, vc)
            });
            prof.time(K::CeFwd, || {
                let (lse, tl) = (lse.reborrow(), target_logit.reborrow());
                dev.crossentropy_forward_block(lse, tl, logits.as_view(), targets, n, vc, v0)
            });
        }
        dev.crossentropy_fold(target_logit, lse.as_view(), targets);
    } else {
        let mut logits = a.logits.slice_mut(..n * v);
        prof.time(K::HeadFwd, || {
            dev.head_forward(logits.reborrow(), lnf_out, w, n, c, v)
        });
        if batch.counted.is_some() {
            let losses = a.losses.slice_mut(..n);
            prof.time(K::CeFwd, || {
                let lse = a.ce_lse.slice_mut(..n);
                dev.crossentropy_forward(losses, lse, logits.as_view(), targets, n, v)
            });
        }
    }
    let counted = batch.counted?;
    if counted == 0 {
        return Some(0.0);
    }
    // f64 and a fixed order: the loss is the same bits whatever the thread count.
    let total = dev.loss_sum(a.losses.slice(..n));
    Some((total / counted as f64) as f32)
}

/// Backward of the cross-entropy, the head and ln_f: `a.dres` is set to d(`a.res[L]`) (L the
/// blocks of `lay`).
pub(crate) fn head_backward(
    pass: &mut Pass,
    lay: &Layout,
    p: View<f32>,
    mut grads: HeadGrads,
    a: &mut Acts,
    mut blocks: Option<HeadBlocks>,
) {
    let Dims { c, v, .. } = pass.dims;
    let n = pass.dims.n();
    let nc = n * c;
    let (dev, batch, prof) = (pass.dev, pass.batch, &mut *pass.prof);
    let acc = pass.accumulate_weight_grads;
    let counted = batch.counted.unwrap_or(0);
    let scale = if counted == 0 {
        0.0
    } else {
        1.0 / counted as f32
    };
    let lnf_out = a.lnf_out.slice(..nc);
    let w = p.slice(lay.lm_head.clone());
    // Whole, or block by block of the vocabulary with each block's logits recomputed (see
    // `LOGITS_MAX_BYTES`): each block adds its part of d(ln_f out) and writes its rows of the
    // head's weight gradient.
    let cols = a.logit_cols.min(v);
    let mut head = std::mem::take(&mut grads.head);
    let mut rows = blocks.as_mut().map(|hb| std::mem::take(&mut hb.rows));
    for v0 in (0..v).step_by(cols) {
        let vc = cols.min(v - v0);
        let wb = w.slice(v0 * c..(v0 + vc) * c);
        let mut logits = a.logits.slice_mut(..n * vc);
        if cols < v {
            prof.time(K::HeadFwd, || {
                dev.head_forward(logits.reborrow(), lnf_out, wb, n, c, vc)
            });
        }
        // The block's logits become their gradient in place.
        let (lse, targets) = (a.ce_lse.slice(..n), batch.targets().slice(..n));
        prof.time(K::CeBwd, || {
            dev.crossentropy_backward(logits.reborrow(), lse, targets, scale, n, vc, v0)
        });
        let dlogits = logits;
        // The first block writes d(ln_f out); later ones go through scratch and add to it.
        let dinp = if v0 == 0 {
            a.s_dl.slice_mut(..nc)
        } else {
            a.s_big.slice_mut(..nc)
        };
        // The block's rows of the weight gradient, split off the rest (still to be written);
        // handed over when final, when asked to.
        let at = blocks.as_ref().map_or(0, |hb| hb.at);
        let range = at + v0 * c..at + (v0 + vc) * c;
        let mut handed = None;
        let dwb = match (rows.as_mut(), blocks.as_mut()) {
            (Some(rows), Some(hb)) => {
                let (block, rest) = std::mem::take(rows).split_at_mut(vc * c);
                *rows = rest;
                let block = handed.insert(block);
                (hb.begin)(range.clone(), block.reborrow());
                block.reborrow()
            }
            _ => {
                let (block, rest) = std::mem::take(&mut head).split_at_mut(vc * c);
                head = rest;
                block
            }
        };
        prof.time(K::HeadBwd, || {
            dev.head_backward(dinp, dwb, dlogits.as_view(), lnf_out, wb, n, c, vc, acc)
        });
        if v0 > 0 {
            dev.add_into(a.s_dl.slice_mut(..nc), a.s_big.slice(..nc));
        }
        if let (Some(block), Some(hb)) = (handed, blocks.as_mut()) {
            (hb.done)(range, block);
        }
    }
    let mut dres = a.dres.slice_mut(..nc);
    dev.fill(dres.reborrow(), 0.0);
    let (dw, db) = (grads.ln_f_w, grads.ln_f_b);
    let x_last = layer(&a.res, lay.blocks.len(), nc);
    let dlnf = a.s_dl.slice(..nc);
    let stats = (a.lnf_mean.slice(..n), a.lnf_rstd.slice(..n));
    let lnf_w = p.slice(lay.ln_f_w.clone());
    prof.time(K::LnBwd, || {
        norm_backward(
            dev,
            pass.dims.norm,
            (dres, dw, db),
            (dlnf, x_last),
            stats,
            lnf_w,
            (n, c),
        )
    });
}

/// Backward of the embeddings (and their dropout) from d(`a.res[0]`) in `a.dres`, into
/// wte's and wpe's gradients.
pub(crate) fn embed_backward(
    pass: &mut Pass,
    dwte: ViewMut<f32>,
    dwpe: ViewMut<f32>,
    a: &mut Acts,
) {
    let batch = pass.batch;
    embed_scatter(pass, dwte, dwpe, batch.ids(), a);
}

/// The embeddings' backward with the token ids `ids` indexing `dwte`'s rows.
pub(crate) fn embed_scatter(
    pass: &mut Pass,
    dwte: ViewMut<f32>,
    dwpe: ViewMut<f32>,
    ids: View<u32>,
    a: &mut Acts,
) {
    let Dims { b, t, c, .. } = pass.dims;
    let (dev, batch, prof) = (pass.dev, pass.batch, &mut *pass.prof);
    let nc = b * t * c;
    let dres = a.dres.slice(..nc);
    let demb: View<f32> = match pass.drop.site(0) {
        Some(d) => {
            let mut s = a.s_drop.slice_mut(..nc);
            prof.time(K::DropoutBwd, || {
                dev.dropout_backward(s.reborrow(), dres, d)
            });
            s.into()
        }
        None => dres,
    };
    prof.time(K::EncoderBwd, || match batch.segment_ids() {
        _ if pass.dims.rope => dev.embedding_backward(dwte, demb, ids, b * t, c),
        Some(segments) => {
            let (mut dwte, mut dwpe) = (dwte, dwpe);
            for (i, len) in segment_runs(segments, t) {
                let (ids, d) = (ids.slice(i..i + len), demb.slice(i * c..(i + len) * c));
                dev.encoder_backward(dwte.reborrow(), dwpe.reborrow(), d, ids, 1, len, c)
            }
        }
        None => dev.encoder_backward(dwte, dwpe, demb, ids, b, t, c),
    });
}

/// One block's backward: `a.dres` holds d(block output) on entry and d(block input) on exit;
/// `g` is the block's gradient range (offset `at.layout.all.start`). With `ready` it hands it the
/// MLP's half (from `ln_2`, the top of the range: [`Layout::ready_order`]) as soon as `ln_2`'s
/// backward has finished it, while attention's backward still runs, then the attention's half
/// (see [`Backward::split_blocks`]); without, the caller hands over the whole block after.
pub(crate) fn block_backward<'g>(
    pass: &mut Pass,
    at: BlockAt,
    p: View<f32>,
    g: ViewMut<'g, f32>,
    a: &mut Acts,
    mut ready: Option<&mut dyn FnMut(Range<usize>, ViewMut<'g, f32>)>,
) {
    let dims = pass.dims;
    let Dims { c, f, nh, .. } = dims;
    let n = dims.n();
    let nc = n * c;
    let (dev, drop, mask, segments) = (pass.dev, pass.drop, pass.mask(), pass.segments());
    let acc = pass.accumulate_weight_grads;
    let (mut scratch, prof) = (pass.scratch.reborrow(), &mut *pass.prof);
    let (l, bl) = (at.local, at.layout);
    let w = BlockWeights::new(p, bl);
    let off = bl.all.start;
    let mlp_off = bl.ln_2_w.start;
    let (mut g, mut g_mlp) = g.split_at_mut(mlp_off - off);
    let ld = at.drop_site();
    let sl = a.layer_slot(l);
    let qkv_w = dims.qkv_width();
    let fx = dims.fc_width();
    let (ln1_slot, ln2_slot, atty_slot) = (a.ln_slot(l, 0), a.ln_slot(l, 1), a.atty_slot(l));
    let (keep, ln16, qkv16) = (a.keep, a.ln16, a.qkv16);
    // The activations backward reads, each borrowed apart from the scratch it writes.
    let Acts {
        res,
        res_mid,
        qkv,
        fch,
        ln1_mean,
        ln1_rstd,
        ln2_mean,
        ln2_rstd,
        att_lse,
        s_ln,
        s_atty,
        s_big,
        s_dl,
        s_drop,
        dres,
        gelu,
        gelu16,
        ..
    } = a;
    let x = layer(res, l, nc);
    let x_mid = layer(res_mid, sl, nc);
    let qkv = qkv_rows(qkv, sl, n * qkv_w, qkv16);
    let mut fch = layer_mut(fch, sl, n * fx);
    let lse = layer(att_lse, sl, n * nh);
    let mut s_dl = s_dl.slice_mut(..nc);

    // MLP: x_next = x_mid + drop(act(ln_2(x_mid) · W_fc + b_fc) · W_proj + b_proj)
    {
        let dres = dres.slice(..nc);
        let dproj: View<f32> = match drop.site(ld + 2) {
            Some(d) => {
                let mut s = s_drop.slice_mut(..nc);
                prof.time(K::DropoutBwd, || {
                    dev.dropout_backward(s.reborrow(), dres, d)
                });
                s.into()
            }
            None => dres,
        };
        let (dw, db) = wb(&mut g_mlp, mlp_off, &bl.fcproj_w, &bl.fcproj_b);
        // d(first product's output): (N, F) under GELU, in place of d(GELU output); (N, 2F)
        // under SwiGLU (gate then up, as the weight), below d(SwiGLU output) in the scratch.
        let dfc: View<f32> = if dims.mlp == Mlp::SwiGlu {
            let (mut dfc, mut act) = s_big.slice_mut(..3 * n * f).split_at_mut(2 * n * f);
            if gelu16.is_empty() {
                if !keep {
                    prof.time(K::GeluFwd, || {
                        dev.swiglu_interleaved_forward(act.reborrow(), fch.as_view(), n, f)
                    });
                }
                let act_in: View<f32> = if keep {
                    layer(gelu, l, n * f)
                } else {
                    act.as_view()
                };
                prof.time(K::MatmulBwd, || {
                    dev.matmul_backward(None, dw, db, dproj, act_in, w.fcproj_w, n, f, c, acc)
                });
            } else {
                let g16 = bf16_layer(gelu16, sl, n * f).into();
                prof.time(K::MatmulBwd, || {
                    dev.matmul_backward_weight_bf16_input(dw, db, dproj, g16, n, f, c, acc)
                });
            }
            // d(SwiGLU output) into `act` (its value is spent), SwiGLU's backward applied to
            // each strip of it while in cache; under bf16 from the derivatives the forward left
            // in `fch` (see the arena)
            let fcproj_w = w.fcproj_w;
            prof.time(K::MatmulBwd, || {
                let (dfc, act) = (dfc.reborrow(), act.reborrow());
                if gelu16.is_empty() {
                    let fch = fch.as_view();
                    dev.matmul_backward_input_swiglu(dfc, act, dproj, fcproj_w, fch, n, f, c)
                } else {
                    dev.matmul_backward_input_swiglu_with_grad(
                        dfc,
                        act,
                        dproj,
                        fcproj_w,
                        fch.as_view(),
                        n,
                        f,
                        c,
                    )
                }
            });
            dfc.into()
        } else {
            if gelu16.is_empty() {
                let mut s_big = s_big.slice_mut(..n * f);
                let gelu_out: View<f32> = if keep {
                    layer(gelu, l, n * f)
                } else {
                    // GELU's output for the weight gradient, and its derivative in place
                    // of the pre-activation, whose only other reader is the GELU backward
                    // below: one tanh instead of two.
                    prof.time(K::GeluFwd, || {
                        dev.gelu_forward_and_grad(s_big.reborrow(), fch.reborrow())
                    });
                    s_big.into()
                };
                prof.time(K::MatmulBwd, || {
                    dev.matmul_backward(None, dw, db, dproj, gelu_out, w.fcproj_w, n, f, c, acc)
                });
            } else {
                let g16 = bf16_layer(gelu16, sl, n * f).into();
                prof.time(K::MatmulBwd, || {
                    dev.matmul_backward_weight_bf16_input(dw, db, dproj, g16, n, f, c, acc)
                });
            }
            let mut s_big = s_big.slice_mut(..n * f);
            prof.time(K::MatmulBwd, || {
                dev.matmul_backward_input(s_big.reborrow(), dproj, w.fcproj_w, n, f, c)
            });
            if gelu16.is_empty() && keep {
                prof.time(K::GeluBwd, || {
                    dev.gelu_backward(s_big.reborrow(), fch.as_view())
                });
            } else {
                // the recompute above (or under bf16 the forward) left GELU's derivative in
                // `fch` (see the arena)
                prof.time(K::GeluBwd, || {
                    dev.gelu_backward_with_grad(s_big.reborrow(), fch.as_view())
                });
            }
            s_big.into()
        };
        let mut ln_2 = ln_out(s_ln, ln2_slot, nc, ln16);
        if !keep {
            let stats = LnStats {
                mean: layer_mut(ln2_mean, sl, n),
                rstd: layer_mut(ln2_rstd, sl, n),
            };
            prof.time(K::LnFwd, || {
                norm_forward(
                    dev,
                    dims.norm,
                    ln_2.reborrow(),
                    stats,
                    x_mid,
                    (w.ln_2_w, w.ln_2_b),
                    (n, c),
                )
            });
        }
        let (dw, db) = wb(&mut g_mlp, mlp_off, &bl.fc_w, &bl.fc_b);
        prof.time(K::MatmulBwd, || {
            let grads = (s_dl.reborrow(), dw, db);
            norm_product_backward(dev, grads, dfc, ln_2.into_view(), w.fc_w, (n, c, fx), acc)
        });
    }
    {
        let (dw, db) = wb(&mut g_mlp, mlp_off, &bl.ln_2_w, &bl.ln_2_b);
        let dres = dres.slice_mut(..nc);
        let stats = (layer(ln2_mean, sl, n), layer(ln2_rstd, sl, n));
        prof.time(K::LnBwd, || {
            norm_backward(
                dev,
                dims.norm,
                (dres, dw, db),
                (s_dl.as_view(), x_mid),
                stats,
                w.ln_2_w,
                (n, c),
            )
        });
    }
    if let Some(ready) = ready.as_mut() {
        ready(mlp_off..bl.all.end, g_mlp);
    }

    // Attention: x_mid = x + drop(attn(ln_1(x) · W_attn + b_attn) · W_proj + b_proj)
    {
        let dres = dres.slice(..nc);
        let dproj: View<f32> = match drop.site(ld + 1) {
            Some(d) => {
                let mut s = s_drop.slice_mut(..nc);
                prof.time(K::DropoutBwd, || {
                    dev.dropout_backward(s.reborrow(), dres, d)
                });
                s.into()
            }
            None => dres,
        };
        prof.time(K::MatmulBwd, || {
            dev.matmul_backward_input(s_dl.reborrow(), dproj, w.proj_w, n, c, c)
        });
        // d(qkv rows), grouped key/value heads' gradients summed over their query groups.
        let mut dqkv = s_big.slice_mut(..n * qkv_w);
        // Without kept outputs, backward recomputes the attention output the projection's
        // weight gradient needs.
        let recompute = (!keep).then(|| layer_mut(s_atty, atty_slot, nc));
        prof.time(K::AttnBwd, || {
            let call = AttnCall::of(dims, mask, segments, drop.site(ld));
            let ins = (s_dl.as_view(), qkv, lse);
            attention_backward(
                dev,
                (dqkv.reborrow(), recompute),
                ins,
                call,
                scratch.reborrow(),
            )
        });
        let (dw, db) = wb(&mut g, off, &bl.proj_w, &bl.proj_b);
        let s_atty = layer(s_atty, atty_slot, nc);
        prof.time(K::MatmulBwd, || {
            dev.matmul_backward(None, dw, db, dproj, s_atty, w.proj_w, n, c, c, acc)
        });
        let mut ln_1 = ln_out(s_ln, ln1_slot, nc, ln16);
        if !keep {
            let stats = LnStats {
                mean: layer_mut(ln1_mean, sl, n),
                rstd: layer_mut(ln1_rstd, sl, n),
            };
            let out = ln_1.reborrow();
            prof.time(K::LnFwd, || {
                norm_forward(dev, dims.norm, out, stats, x, (w.ln_1_w, w.ln_1_b), (n, c))
            });
        }
        // Back through the rotation to the product's rows.
        if let Some(r) = pass.rope {
            let pos = pass.batch.pos();
            dev.rope_backward(dqkv.reborrow(), pos, r.cos(), r.sin(), dims.rope_dims(n));
        }
        let (dw, db) = wb(&mut g, off, &bl.attn_w, &bl.attn_b);
        prof.time(K::MatmulBwd, || {
            let (grads, dq, x) = ((s_dl.reborrow(), dw, db), dqkv.as_view(), ln_1.into_view());
            norm_product_backward(dev, grads, dq, x, w.attn_w, (n, c, qkv_w), acc)
        });
    }
    let (dw, db) = wb(&mut g, off, &bl.ln_1_w, &bl.ln_1_b);
    let dres = dres.slice_mut(..nc);
    let stats = (layer(ln1_mean, sl, n), layer(ln1_rstd, sl, n));
    prof.time(K::LnBwd, || {
        norm_backward(
            dev,
            dims.norm,
            (dres, dw, db),
            (s_dl.as_view(), x),
            stats,
            w.ln_1_w,
            (n, c),
        )
    });
    if let Some(ready) = ready {
        ready(off..mlp_off, g);
    }
}

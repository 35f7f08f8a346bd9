//! The model's layers as functions on flat buffers: embeddings, one transformer block and the
//! head, forward and backward, in the order llm.c's `train_gpt2.c` calls its kernels. The whole
//! model and a pipeline stage run the same functions, which is why their results agree bit for
//! bit.
//!
//! These functions only call backend kernels on slices they are given; they never allocate.

use super::*;

/// `g[w]` and the bias right after it (empty range: None), as two disjoint slices.
pub(crate) fn wb<'a>(
    g: &'a mut [f32],
    off: usize,
    w: &Range<usize>,
    b: &Range<usize>,
) -> (&'a mut [f32], Option<&'a mut [f32]>) {
    let (wg, rest) = g[w.start - off..].split_at_mut(w.len());
    let bg = if b.is_empty() {
        None
    } else {
        Some(&mut rest[..b.len()])
    };
    (wg, bg)
}

/// `p[r]`, or None for an empty range (a model without biases).
pub(crate) fn opt<'a>(p: &'a [f32], r: &Range<usize>) -> Option<&'a [f32]> {
    if r.is_empty() {
        None
    } else {
        Some(&p[r.clone()])
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
pub(crate) fn layer(buf: &[f32], l: usize, len: usize) -> &[f32] {
    &buf[l * len..(l + 1) * len]
}

pub(super) fn layer_mut(buf: &mut [f32], l: usize, len: usize) -> &mut [f32] {
    &mut buf[l * len..(l + 1) * len]
}

/// (layer l, read-only) and (layer l + 1, writable) of a per-layer buffer.
pub(super) fn layer_pair(buf: &mut [f32], l: usize, len: usize) -> (&[f32], &mut [f32]) {
    let (lo, hi) = buf.split_at_mut((l + 1) * len);
    (&lo[l * len..], &mut hi[..len])
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
#[derive(Debug, Clone)]
pub(crate) struct RopeTables {
    pub(crate) cos: Vec<f32>,
    pub(crate) sin: Vec<f32>,
}

impl RopeTables {
    /// The tables of `cfg`'s positions; None with learned positions.
    pub(crate) fn new(cfg: &GPTConfig) -> Option<RopeTables> {
        let inv = cfg.rope_inv_freq()?;
        let (cos, sin) = cohort_engine::cpu::rope_tables(&inv, cfg.max_position_embeddings);
        Some(RopeTables { cos, sin })
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
    pub(crate) scratch: &'a mut [f32],
    pub(crate) prof: &'a mut Profile,
}

impl<'a> Pass<'a> {
    /// The batch's padding mask (None when every position is a token).
    pub(crate) fn mask(&self) -> Option<&'a [u8]> {
        let batch: &'a Batch = self.batch;
        batch.has_mask.then_some(&batch.mask[..])
    }

    /// The batch's segment ids (None when each row is one sequence).
    pub(crate) fn segments(&self) -> Option<&'a [u32]> {
        let batch: &'a Batch = self.batch;
        (!batch.segments.is_empty()).then_some(&batch.segments[..])
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
    pub(crate) head: &'g mut [f32],
    pub(crate) ln_f_w: &'g mut [f32],
    pub(crate) ln_f_b: Option<&'g mut [f32]>,
}

/// Token + position embeddings (and their dropout) into `a.res[0]`.
pub(crate) fn embed_forward(pass: &mut Pass, lay: &Layout, p: &[f32], a: &mut Acts) {
    let Dims { b, t, c, .. } = pass.dims;
    let segments = pass.segments();
    let (dev, batch, prof) = (pass.dev, pass.batch, &mut *pass.prof);
    let x0 = &mut a.res[..b * t * c];
    let wte = &p[lay.wte.clone()];
    prof.time(K::EncoderFwd, || {
        let wpe = &p[lay.wpe.clone()];
        match segments {
            _ if pass.dims.rope => dev.embedding_forward(x0, &batch.ids, wte, b * t, c),
            // Learned positions restart at each packed sequence: one row of its own length each.
            Some(segments) => {
                for (i, len) in segment_runs(segments, t) {
                    let ids = &batch.ids[i..i + len];
                    dev.encoder_forward(&mut x0[i * c..(i + len) * c], ids, wte, wpe, 1, len, c)
                }
            }
            None => dev.encoder_forward(x0, &batch.ids, wte, wpe, b, t, c),
        }
    });
    if let Some(d) = pass.drop.site(0) {
        prof.time(K::ResidualFwd, || dev.dropout_forward(x0, d));
    }
}

/// One block's forward from `a.res[l]` into `a.res[l + 1]` (`l` = `at.local`), keeping in the
/// arena what its backward reads.
pub(crate) fn block_forward(pass: &mut Pass, at: BlockAt, p: &[f32], a: &mut Acts) {
    let dims = pass.dims;
    let Dims { c, f, nh, .. } = dims;
    let n = dims.n();
    let nc = n * c;
    let l = at.local;
    let ld = at.drop_site();
    let (ln1_slot, ln2_slot, atty_slot) = (a.ln_slot(l, 0), a.ln_slot(l, 1), a.atty_slot(l));
    // This layer's slot of the per-layer buffers (the one slot under activation checkpointing).
    let sl = a.layer_slot(l);
    let (x, x_next) = layer_pair(a.res, l, nc);
    let ln = if ln1_slot == ln2_slot {
        LnOut::Shared(layer_mut(a.s_ln, ln1_slot, nc))
    } else {
        // kept: ln_1's and ln_2's outputs are the two slots 2l and 2l + 1
        let (ln_1, ln_2) = layer_mut(a.s_ln, l, 2 * nc).split_at_mut(nc);
        LnOut::Each { ln_1, ln_2 }
    };
    let gelu = if !a.gelu16.is_empty() {
        // Under bf16 products the GELU output is kept in bf16 for backward (see the arena).
        GeluOut::Bf16(bf16_layer(a.gelu16, sl, n * f))
    } else if a.keep {
        GeluOut::F32(layer_mut(a.gelu, l, n * f))
    } else {
        GeluOut::F32(&mut a.s_big[..n * f])
    };
    // The product's rows are kept (rotated) as they are, (N, (NH+2·NKV)·HS), and the attention
    // kernels read grouped key/value heads where they are.
    let qkv_w = dims.qkv_width();
    let qkv = layer_mut(a.qkv, sl, n * qkv_w);
    let acts = BlockActs {
        x,
        x_mid: layer_mut(a.res_mid, sl, nc),
        x_next,
        ln,
        ln_1: LnStats {
            mean: layer_mut(a.ln1_mean, sl, n),
            rstd: layer_mut(a.ln1_rstd, sl, n),
        },
        ln_2: LnStats {
            mean: layer_mut(a.ln2_mean, sl, n),
            rstd: layer_mut(a.ln2_rstd, sl, n),
        },
        qkv,
        att: layer_mut(a.s_atty, atty_slot, nc),
        fch: layer_mut(a.fch, sl, n * dims.fc_width()),
        gelu,
    };
    let lse = layer_mut(a.att_lse, sl, n * nh);
    let segments = pass.segments();
    let (mask, drop, scratch) = (pass.mask(), pass.drop, &mut *pass.scratch);
    let (dev, rope, pos) = (pass.dev, pass.rope, &pass.batch.pos[..]);
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
        |qkv, att| {
            if let Some(r) = rope {
                dev.rope_forward(qkv, pos, &r.cos, &r.sin, dims.rope_dims(n));
            }
            let (attn, nkv) = (dims.attn(), dims.nkv);
            dev.attention_forward_grouped(
                att,
                lse,
                qkv,
                mask,
                segments,
                attn,
                nkv,
                drop.site(ld),
                scratch,
            )
        },
    );
}

/// ln_f, the head and (with targets) the cross-entropy, from `a.res[L]` (L the blocks of
/// `lay`); returns the mean loss over counted positions.
pub(crate) fn head_forward(pass: &mut Pass, lay: &Layout, p: &[f32], a: &mut Acts) -> Option<f32> {
    let Dims { c, v, .. } = pass.dims;
    let n = pass.dims.n();
    let nc = n * c;
    let (dev, batch, prof) = (pass.dev, pass.batch, &mut *pass.prof);
    let x_last = layer(a.res, lay.blocks.len(), nc);
    let lnf_out = &mut a.lnf_out[..nc];
    let stats = LnStats {
        mean: &mut a.lnf_mean[..n],
        rstd: &mut a.lnf_rstd[..n],
    };
    let lnf = (&p[lay.ln_f_w.clone()], opt(p, &lay.ln_f_b));
    prof.time(K::LnFwd, || {
        norm_forward(dev, pass.dims.norm, lnf_out, stats, x_last, lnf, (n, c))
    });
    let w = &p[lay.lm_head.clone()];
    let cols = a.logit_cols;
    if cols < v {
        // Blocks of the vocabulary: each block's logits fold into each row's log-sum-exp, and
        // the target's logit is picked up in its block; only those two stay.
        let lse = &mut a.ce_lse[..n];
        lse.fill(f32::NEG_INFINITY);
        let target_logit = &mut a.losses[..n];
        for v0 in (0..v).step_by(cols) {
            let vc = cols.min(v - v0);
            let logits = &mut a.logits[..n * vc];
            let wb = &w[v0 * c..(v0 + vc) * c];
            prof.time(K::HeadFwd, || {
                dev.head_forward(logits, lnf_out, wb, n, c, vc)
            });
            prof.time(K::CeFwd, || {
                dev.crossentropy_forward_block(lse, target_logit, logits, &batch.targets, n, vc, v0)
            });
        }
        for ((l, &s), &t) in a.losses[..n]
            .iter_mut()
            .zip(&a.ce_lse[..n])
            .zip(&batch.targets)
        {
            *l = if t < 0 { 0.0 } else { s - *l };
        }
    } else {
        let logits = &mut a.logits[..n * v];
        prof.time(K::HeadFwd, || dev.head_forward(logits, lnf_out, w, n, c, v));
        if batch.counted.is_some() {
            let losses = &mut a.losses[..n];
            prof.time(K::CeFwd, || {
                dev.crossentropy_forward(losses, &mut a.ce_lse[..n], logits, &batch.targets, n, v)
            });
        }
    }
    let counted = batch.counted?;
    let losses = &a.losses[..n];
    if counted == 0 {
        return Some(0.0);
    }
    // f64 and a fixed order: the loss is the same bits whatever the thread count.
    let total: f64 = losses.iter().map(|&x| x as f64).sum();
    Some((total / counted as f64) as f32)
}

/// Backward of the cross-entropy, the head and ln_f: `a.dres` is set to d(`a.res[L]`) (L the
/// blocks of `lay`).
pub(crate) fn head_backward(
    pass: &mut Pass,
    lay: &Layout,
    p: &[f32],
    grads: HeadGrads,
    a: &mut Acts,
) {
    let Dims { c, v, .. } = pass.dims;
    let n = pass.dims.n();
    let nc = n * c;
    let (dev, batch, prof) = (pass.dev, pass.batch, &mut *pass.prof);
    let counted = batch.counted.unwrap_or(0);
    let scale = if counted == 0 {
        0.0
    } else {
        1.0 / counted as f32
    };
    let lnf_out = &a.lnf_out[..nc];
    let w = &p[lay.lm_head.clone()];
    // Whole, or block by block of the vocabulary with each block's logits recomputed (see
    // `LOGITS_MAX_BYTES`): each block adds its part of d(ln_f out) and writes its rows of the
    // head's weight gradient.
    let cols = a.logit_cols.min(v);
    for v0 in (0..v).step_by(cols) {
        let vc = cols.min(v - v0);
        let wb = &w[v0 * c..(v0 + vc) * c];
        let logits = &mut a.logits[..n * vc];
        if cols < v {
            prof.time(K::HeadFwd, || {
                dev.head_forward(logits, lnf_out, wb, n, c, vc)
            });
        }
        let dlogits = &mut a.dlogits[..n * vc];
        let (lse, targets) = (&a.ce_lse[..n], &batch.targets[..n]);
        prof.time(K::CeBwd, || {
            dev.crossentropy_backward(dlogits, logits, lse, targets, scale, n, vc, v0)
        });
        // The first block writes d(ln_f out); later ones go through scratch and add to it.
        let dinp = if v0 == 0 {
            &mut a.s_dl[..nc]
        } else {
            &mut a.s_big[..nc]
        };
        let dwb = &mut grads.head[v0 * c..(v0 + vc) * c];
        prof.time(K::HeadBwd, || {
            dev.head_backward(dinp, dwb, dlogits, lnf_out, wb, n, c, vc)
        });
        if v0 > 0 {
            for (d, &x) in a.s_dl[..nc].iter_mut().zip(&a.s_big[..nc]) {
                *d += x;
            }
        }
    }
    let dres = &mut a.dres[..nc];
    dres.fill(0.0);
    let (dw, db) = (grads.ln_f_w, grads.ln_f_b);
    let x_last = layer(a.res, lay.blocks.len(), nc);
    let dlnf = &a.s_dl[..nc];
    let stats = (&a.lnf_mean[..n], &a.lnf_rstd[..n]);
    let lnf_w = &p[lay.ln_f_w.clone()];
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
pub(crate) fn embed_backward(pass: &mut Pass, dwte: &mut [f32], dwpe: &mut [f32], a: &mut Acts) {
    let Dims { b, t, c, .. } = pass.dims;
    let segments = pass.segments();
    let (dev, batch, prof) = (pass.dev, pass.batch, &mut *pass.prof);
    let nc = b * t * c;
    let dres = &a.dres[..nc];
    let demb: &[f32] = match pass.drop.site(0) {
        Some(d) => {
            let s = &mut a.s_drop[..nc];
            prof.time(K::DropoutBwd, || dev.dropout_backward(s, dres, d));
            s
        }
        None => dres,
    };
    prof.time(K::EncoderBwd, || match segments {
        _ if pass.dims.rope => dev.embedding_backward(dwte, demb, &batch.ids, b * t, c),
        Some(segments) => {
            for (i, len) in segment_runs(segments, t) {
                let (ids, d) = (&batch.ids[i..i + len], &demb[i * c..(i + len) * c]);
                dev.encoder_backward(dwte, dwpe, d, ids, 1, len, c)
            }
        }
        None => dev.encoder_backward(dwte, dwpe, demb, &batch.ids, b, t, c),
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
    p: &[f32],
    g: &'g mut [f32],
    a: &mut Acts,
    mut ready: Option<&mut dyn FnMut(Range<usize>, &'g mut [f32])>,
) {
    let dims = pass.dims;
    let Dims { c, f, nh, .. } = dims;
    let n = dims.n();
    let nc = n * c;
    let (dev, drop, mask, segments) = (pass.dev, pass.drop, pass.mask(), pass.segments());
    let (scratch, prof) = (&mut *pass.scratch, &mut *pass.prof);
    let (l, bl) = (at.local, at.layout);
    let w = BlockWeights::new(p, bl);
    let off = bl.all.start;
    let mlp_off = bl.ln_2_w.start;
    let (g, g_mlp) = g.split_at_mut(mlp_off - off);
    let ld = at.drop_site();
    let x = layer(a.res, l, nc);
    let sl = a.layer_slot(l);
    let x_mid = layer(a.res_mid, sl, nc);
    let qkv_w = dims.qkv_width();
    let qkv = layer(a.qkv, sl, n * qkv_w);
    let fx = dims.fc_width();
    let fch = layer(a.fch, sl, n * fx);
    let lse = layer(a.att_lse, sl, n * nh);
    let (ln1_slot, ln2_slot, atty_slot) = (a.ln_slot(l, 0), a.ln_slot(l, 1), a.atty_slot(l));
    let keep = a.keep;
    let s_dl = &mut a.s_dl[..nc];

    // MLP: x_next = x_mid + drop(act(ln_2(x_mid) · W_fc + b_fc) · W_proj + b_proj)
    {
        let dres = &a.dres[..nc];
        let dproj: &[f32] = match drop.site(ld + 2) {
            Some(d) => {
                let s = &mut a.s_drop[..nc];
                prof.time(K::DropoutBwd, || dev.dropout_backward(s, dres, d));
                s
            }
            None => dres,
        };
        let (dw, db) = wb(g_mlp, mlp_off, &bl.fcproj_w, &bl.fcproj_b);
        // d(first product's output): (N, F) under GELU, in place of d(GELU output); (N, 2F)
        // under SwiGLU (gate then up, as the weight), below d(SwiGLU output) in the scratch.
        let dfc: &[f32] = if dims.mlp == Mlp::SwiGlu {
            let (dfc, act) = a.s_big[..3 * n * f].split_at_mut(2 * n * f);
            if a.gelu16.is_empty() {
                if !keep {
                    prof.time(K::GeluFwd, || {
                        dev.swiglu_interleaved_forward(act, fch, n, f)
                    });
                }
                let act_in: &[f32] = if keep { layer(a.gelu, l, n * f) } else { act };
                prof.time(K::MatmulBwd, || {
                    dev.matmul_backward(None, dw, db, dproj, act_in, w.fcproj_w, n, f, c)
                });
            } else {
                let g16 = bf16_layer(a.gelu16, sl, n * f);
                prof.time(K::MatmulBwd, || {
                    dev.matmul_backward_weight_bf16_input(dw, db, dproj, g16, n, f, c)
                });
            }
            // d(SwiGLU output) into `act` (its value is spent), SwiGLU's backward applied to
            // each strip of it while in cache; under bf16 from the derivatives the forward left
            // in `fch` (see the arena)
            let fcproj_w = w.fcproj_w;
            prof.time(K::MatmulBwd, || {
                if a.gelu16.is_empty() {
                    dev.matmul_backward_input_swiglu(dfc, act, dproj, fcproj_w, fch, n, f, c)
                } else {
                    dev.matmul_backward_input_swiglu_with_grad(
                        dfc, act, dproj, fcproj_w, fch, n, f, c,
                    )
                }
            });
            dfc
        } else {
            if a.gelu16.is_empty() {
                let s_big = &mut a.s_big[..n * f];
                let gelu_out: &[f32] = if keep {
                    layer(a.gelu, l, n * f)
                } else {
                    prof.time(K::GeluFwd, || dev.gelu_forward(s_big, fch));
                    s_big
                };
                prof.time(K::MatmulBwd, || {
                    dev.matmul_backward(None, dw, db, dproj, gelu_out, w.fcproj_w, n, f, c)
                });
            } else {
                let g16 = bf16_layer(a.gelu16, sl, n * f);
                prof.time(K::MatmulBwd, || {
                    dev.matmul_backward_weight_bf16_input(dw, db, dproj, g16, n, f, c)
                });
            }
            let s_big = &mut a.s_big[..n * f];
            prof.time(K::MatmulBwd, || {
                dev.matmul_backward_input(s_big, dproj, w.fcproj_w, n, f, c)
            });
            if a.gelu16.is_empty() {
                prof.time(K::GeluBwd, || dev.gelu_backward(s_big, fch));
            } else {
                // under bf16 the forward left GELU's derivative in `fch` (see the arena)
                prof.time(K::GeluBwd, || dev.gelu_backward_with_grad(s_big, fch));
            }
            s_big
        };
        if !keep {
            let s_ln = layer_mut(a.s_ln, ln2_slot, nc);
            let stats = LnStats {
                mean: layer_mut(a.ln2_mean, sl, n),
                rstd: layer_mut(a.ln2_rstd, sl, n),
            };
            prof.time(K::LnFwd, || {
                norm_forward(
                    dev,
                    dims.norm,
                    s_ln,
                    stats,
                    x_mid,
                    (w.ln_2_w, w.ln_2_b),
                    (n, c),
                )
            });
        }
        let s_ln = layer(a.s_ln, ln2_slot, nc);
        let (dw, db) = wb(g_mlp, mlp_off, &bl.fc_w, &bl.fc_b);
        prof.time(K::MatmulBwd, || {
            dev.matmul_backward(Some(s_dl), dw, db, dfc, s_ln, w.fc_w, n, c, fx)
        });
    }
    {
        let (dw, db) = wb(g_mlp, mlp_off, &bl.ln_2_w, &bl.ln_2_b);
        let dres = &mut a.dres[..nc];
        let stats = (layer(a.ln2_mean, sl, n), layer(a.ln2_rstd, sl, n));
        prof.time(K::LnBwd, || {
            norm_backward(
                dev,
                dims.norm,
                (dres, dw, db),
                (s_dl, x_mid),
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
        let dres = &a.dres[..nc];
        let dproj: &[f32] = match drop.site(ld + 1) {
            Some(d) => {
                let s = &mut a.s_drop[..nc];
                prof.time(K::DropoutBwd, || dev.dropout_backward(s, dres, d));
                s
            }
            None => dres,
        };
        prof.time(K::MatmulBwd, || {
            dev.matmul_backward_input(s_dl, dproj, w.proj_w, n, c, c)
        });
        // d(qkv rows), grouped key/value heads' gradients summed over their query groups.
        let dqkv = &mut a.s_big[..n * qkv_w];
        // Without kept outputs, backward recomputes the attention output the projection's
        // weight gradient needs.
        let recompute = (!keep).then(|| layer_mut(a.s_atty, atty_slot, nc));
        prof.time(K::AttnBwd, || {
            dev.attention_backward_grouped(
                dqkv,
                recompute,
                s_dl,
                qkv,
                lse,
                mask,
                segments,
                dims.attn(),
                dims.nkv,
                drop.site(ld),
                scratch,
            )
        });
        let (dw, db) = wb(g, off, &bl.proj_w, &bl.proj_b);
        let s_atty = layer(a.s_atty, atty_slot, nc);
        prof.time(K::MatmulBwd, || {
            dev.matmul_backward(None, dw, db, dproj, s_atty, w.proj_w, n, c, c)
        });
        if !keep {
            let s_ln = layer_mut(a.s_ln, ln1_slot, nc);
            let stats = LnStats {
                mean: layer_mut(a.ln1_mean, sl, n),
                rstd: layer_mut(a.ln1_rstd, sl, n),
            };
            prof.time(K::LnFwd, || {
                norm_forward(dev, dims.norm, s_ln, stats, x, (w.ln_1_w, w.ln_1_b), (n, c))
            });
        }
        // Back through the rotation to the product's rows.
        if let Some(r) = pass.rope {
            let pos = &pass.batch.pos[..];
            dev.rope_backward(dqkv, pos, &r.cos, &r.sin, dims.rope_dims(n));
        }
        let s_ln = layer(a.s_ln, ln1_slot, nc);
        let (dw, db) = wb(g, off, &bl.attn_w, &bl.attn_b);
        prof.time(K::MatmulBwd, || {
            dev.matmul_backward(Some(s_dl), dw, db, dqkv, s_ln, w.attn_w, n, c, qkv_w)
        });
    }
    let (dw, db) = wb(g, off, &bl.ln_1_w, &bl.ln_1_b);
    let dres = &mut a.dres[..nc];
    let stats = (layer(a.ln1_mean, sl, n), layer(a.ln1_rstd, sl, n));
    prof.time(K::LnBwd, || {
        norm_backward(
            dev,
            dims.norm,
            (dres, dw, db),
            (s_dl, x),
            stats,
            w.ln_1_w,
            (n, c),
        )
    });
    if let Some(ready) = ready {
        ready(off..mlp_off, g);
    }
}

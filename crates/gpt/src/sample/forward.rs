//! The decode forward: new tokens, one per row, through the model against their sequences' KV
//! caches, with logits only for the rows that will be sampled.
//!
//! Each block runs the training forward's block code (`block_forward_rows`: the same kernels in
//! the same order); only the attention differs: each row's keys and values are appended to its
//! cache, and each row attends over its own cache. Every kernel computes a row the same way
//! whatever other rows share the product (the products sum each output over K in one fixed
//! order), so a sequence decoded in a batch gets bit-for-bit the logits it gets alone.
//!
//! This module never changes the model, never advances a cache's length (its caller does) and
//! never allocates: it works in the workspace's buffers.

use cohort_engine::cpu::DecodeDims;
use cohort_engine::{View, ViewMut};
use rayon::prelude::*;

use super::cache::{Buffers, Caches, KvStore};
use super::weights::DecodeWeights;
use crate::layout::Layout;
use crate::model::{
    block_forward_rows, norm_forward, opt, BlockActs, BlockDims, BlockWeights, BranchDropout,
    GeluOut, LnOut, LnStats, NormOut, QkvOut, Untimed,
};
use crate::GPT;

/// Which sequence and position each row of a forward is, and which rows get logits.
#[derive(Clone, Copy)]
pub(super) enum Rows<'a> {
    /// Consecutive tokens of the one cache given, from position `p0`; only the last row's
    /// logits are computed (a prompt fed through a [`Decoder`]).
    Sequence { p0: usize },
    /// Row i is (cache index, position) `place[i]`; logits are computed for the rows in `last`
    /// (a step of many sequences: one row each for those decoding, all of a prompt or of a
    /// rebuilt window for the others).
    Mixed {
        place: &'a [(usize, usize)],
        last: &'a [usize],
    },
}

impl Rows<'_> {
    /// (cache index, position) of row `i`.
    fn at(self, i: usize) -> (usize, usize) {
        match self {
            Rows::Sequence { p0 } => (0, p0 + i),
            Rows::Mixed { place, .. } => place[i],
        }
    }
}
/// The forward of `tokens` (one per row, placed by `rows`), attending over each row's cache;
/// writes the logits `rows` asks for into `buf.logits`. The matrix products run once over all
/// rows; attention runs per row over its own cache. Dims: n rows, C, F, V, NH heads of HS,
/// NKV key/value heads (KW = NKV·HS floats per cached row), W = (NH+2·NKV)·HS per qkv row.
/// With `decode` weights the matrix products (and the head) read them instead of the f32
/// parameters.
pub(super) fn forward_rows<C: Caches + ?Sized>(
    model: &GPT,
    layout: &Layout,
    decode: Option<&DecodeWeights>,
    caches: &mut C,
    buf: &mut Buffers,
    tokens: &[u32],
    rows: Rows<'_>,
) {
    let cfg = model.config();
    let (n, c, f, v) = (tokens.len(), cfg.d_model, cfg.d_ff, cfg.vocab_size);
    let (max_t, nh) = (cfg.max_position_embeddings, cfg.n_heads);
    let hs = c / nh;
    let nkv = cfg.kv_heads();
    let (kw, w) = (nkv * hs, cfg.qkv_width());
    let scale = 1.0 / (hs as f32).sqrt();
    let p = model.params();
    let pv = View::from(p);
    let dev = model.backend();
    let (wte, wpe) = (&p[layout.wte.clone()], &p[layout.wpe.clone()]);
    let rope = model.rope_tables();
    let pos = &mut buf.pos[..n];
    for (i, p) in pos.iter_mut().enumerate() {
        *p = rows.at(i).1 as u32;
    }
    let pos = &*pos;

    // The residual stream alternates between two buffers: a block reads one, writes the other.
    let (mut x, mut x_next) = (&mut buf.x[..n * c], &mut buf.x_next[..n * c]);
    for (i, (row, &id)) in x.chunks_exact_mut(c).zip(tokens).enumerate() {
        let te = id as usize * c;
        if wpe.is_empty() {
            row.copy_from_slice(&wte[te..te + c]);
            continue;
        }
        let pe = pos[i] as usize * c;
        for ((o, a), b) in row.iter_mut().zip(&wte[te..te + c]).zip(&wpe[pe..pe + c]) {
            *o = a + b;
        }
    }
    for (l, bl) in layout.blocks.iter().enumerate() {
        let layer = l * max_t * kw..(l + 1) * max_t * kw;
        let scores = &mut buf.scores[..n * nh * max_t];
        let attend = |qkv: QkvOut, att: ViewMut<f32>| {
            let QkvOut::F32(mut qkv) = qkv else {
                unreachable!("a decode keeps its activations in f32")
            };
            if let Some(r) = rope {
                let dims = cohort_engine::cpu::RopeDims {
                    n,
                    width: w,
                    heads: nh + nkv,
                    hs,
                };
                dev.rope_forward(qkv.reborrow(), View::from(pos), r.cos(), r.sin(), dims);
            }
            // the decode's attention runs on the host, row by row over host caches
            let (qkv, att) = (qkv.host(), att.host());
            // every row's key and value first: a prompt's row i attends to rows before it
            for (i, row) in qkv.chunks_exact(w).enumerate() {
                let (ci, pos) = rows.at(i);
                caches
                    .cache(ci)
                    .put(layer.start + pos * kw, &row[c..c + kw], &row[c + kw..]);
            }
            // each row over its own cache, rows in parallel (they only read the caches)
            let shared: &C = caches;
            qkv.par_chunks_exact(w)
                .zip(att.par_chunks_exact_mut(c))
                .zip(scores.par_chunks_exact_mut(nh * max_t))
                .enumerate()
                .for_each(|(i, ((row, out), scores))| {
                    let (ci, pos) = rows.at(i);
                    let q = &row[..c];
                    let store = &shared.cache_ref(ci).store;
                    // Grouped heads read their cached head in place: NH/NKV query heads to
                    // one cached head of the rows of stride KW.
                    let dims = DecodeDims {
                        ctx: pos + 1,
                        nh,
                        hs,
                        c: kw,
                        scale,
                        group: nh / nkv,
                    };
                    attend_row(dev, store, layer.clone(), out, scores, q, dims);
                });
        };
        let acts = BlockActs {
            x: View::from(&*x),
            x_mid: ViewMut::from(&mut buf.x_mid[..n * c]),
            x_next: ViewMut::from(&mut *x_next),
            ln: LnOut::Shared(NormOut::F32(ViewMut::from(&mut buf.ln[..n * c]))),
            ln_1: LnStats {
                mean: ViewMut::from(&mut buf.mean[..n]),
                rstd: ViewMut::from(&mut buf.rstd[..n]),
            },
            ln_2: LnStats {
                mean: ViewMut::from(&mut buf.mean_2[..n]),
                rstd: ViewMut::from(&mut buf.rstd_2[..n]),
            },
            qkv: QkvOut::F32(ViewMut::from(&mut buf.qkv[..n * w])),
            att: ViewMut::from(&mut buf.att[..n * c]),
            fch: ViewMut::from(&mut buf.fc[..n * cfg.fc_width()]),
            gelu: GeluOut::F32(ViewMut::from(&mut buf.gelu[..n * f])),
        };
        let no_dropout = BranchDropout {
            attn: None,
            mlp: None,
        };
        let weights = BlockWeights {
            decode: decode.map(|d| &d.blocks[l]),
            ..BlockWeights::new(pv, bl)
        };
        let dims = BlockDims {
            n,
            c,
            f,
            w,
            norm: cfg.norm,
            mlp: cfg.mlp,
        };
        block_forward_rows(dev, &mut Untimed, &weights, acts, dims, no_dropout, attend);
        std::mem::swap(&mut x, &mut x_next);
    }
    // logits only where a token will be sampled: the last row of each sequence
    let (lnf_w, lnf_b) = (pv.slice(layout.ln_f_w.clone()), opt(pv, &layout.ln_f_b));
    let head = pv.slice(layout.lm_head.clone());
    let gathered = &mut buf.x_mid;
    let (m, from): (usize, &[f32]) = match rows {
        Rows::Sequence { .. } => (1, &x[(n - 1) * c..]),
        Rows::Mixed { last, .. } => {
            // gathered into the (now free) buffer of the residual after attention, contiguous
            // for the kernels
            for (j, &r) in last.iter().enumerate() {
                gathered[j * c..(j + 1) * c].copy_from_slice(&x[r * c..(r + 1) * c]);
            }
            (last.len(), &gathered[..last.len() * c])
        }
    };
    let mut ln = ViewMut::from(&mut buf.ln[..m * c]);
    let stats = LnStats {
        mean: ViewMut::from(&mut buf.mean[..m]),
        rstd: ViewMut::from(&mut buf.rstd[..m]),
    };
    let from = View::from(from);
    norm_forward(
        dev,
        cfg.norm,
        NormOut::F32(ln.reborrow()),
        stats,
        from,
        (lnf_w, lnf_b),
        (m, c),
    );
    let (ln, logits) = (ln.as_view(), ViewMut::from(&mut buf.logits[..m * v]));
    match decode {
        Some(d) => dev.decode_matmul_forward(logits, ln, &d.head, None, m),
        None => dev.head_forward(logits, ln, head, m, c, v),
    }
}

/// One decode row's attention over the cached rows `at` of one layer, in the cache's format.
fn attend_row(
    dev: &dyn cohort_engine::Backend,
    store: &KvStore,
    at: std::ops::Range<usize>,
    out: &mut [f32],
    scores: &mut [f32],
    q: &[f32],
    dims: DecodeDims,
) {
    match store {
        KvStore::F32 { k, v } => {
            let (k, v) = (&k[at.clone()], &v[at]);
            dev.attention_decode_row(out, scores, q, k, v, dims);
        }
        KvStore::Bf16 { k, v } => {
            let (k, v) = (&k[at.clone()], &v[at]);
            dev.attention_decode_row_bf16(out, scores, q, k, v, dims);
        }
    }
}

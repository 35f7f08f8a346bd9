//! Causal multi-head self-attention with a key padding mask, fused softmax and dropout on the
//! attention probabilities, in the flash-attention spirit: the (T, T) probabilities are never
//! stored. Forward keeps one log-sum-exp per query; backward recomputes the probabilities block
//! by block (and, for free, the attention output the projection's weight gradient needs).
//!
//! Grouped key/value heads (GQA, MQA) are read where the qkv product put them, rows of
//! (NH + 2·NKV)·HS: query head h reads key/value head h / (NH/NKV), and backward writes each
//! key/value head's gradient once, the sum over its query group taken in the group's order by
//! the one task that owns the group. With NKV = NH this is GPT-2's (N, 3C) and the same work.
//!
//! Work is split by (batch, head) (by (batch, key/value head) in backward, which is the same
//! split without grouping); each task walks its queries in blocks of `RB` rows, and a
//! block only looks at the keys the causal mask lets it see, in per-thread scratch that stays
//! in L1/L2. Products go through `matrixmultiply`'s sgemm on strided views of the qkv buffer
//! (no transposes are copied); under bf16 (AMX or AVX512_BF16), a head's products are instead
//! fused in `attention_fused`, with the same softmax, mask and dropout code. A query with no visible key
//! (a padding position at the start of a left-padded row) gets a zero output and zero
//! gradients. With segment ids (several sequences packed in one row), a query sees only the
//! keys of its own segment, causally: the keys before its segment's start are masked as
//! padding is.

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::epilogue::Epilogue;
#[cfg(target_arch = "x86_64")]
use super::gemm::{sgemm, Strided};
#[cfg(target_arch = "x86_64")]
use super::gemm_bf16::bgemm;
use super::math::{exp, max, sum};
use super::{simd_fn, simd_level, SendPtr, SimdLevel};
use crate::{DType, Dropout};

/// Query rows per block.
const RB: usize = 64;

/// Scratch floats [`attention_forward`] and [`attention_backward`] need for `threads` threads.
pub fn attention_scratch_len(t: usize, threads: usize) -> usize {
    threads * per_thread(t)
}

fn per_thread(t: usize) -> usize {
    3 * RB.min(t) * t + t
}

/// Dimensions of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    /// Batch size.
    pub b: usize,
    /// Sequence length.
    pub t: usize,
    /// Model width (all heads).
    pub c: usize,
    /// Number of heads.
    pub nh: usize,
}

/// Where query head `h`'s q, k and v start in a row of a qkv buffer with `nkv` key/value
/// heads, and the row's length: (row stride, q, k, v) in floats. q's NH heads come first, then
/// k's NKV, then v's NKV; with `nkv` = NH, GPT-2's order.
pub(super) fn head_cols(dims: AttnDims, nkv: usize, h: usize) -> (usize, usize, usize, usize) {
    let AttnDims { c, nh, .. } = dims;
    let hd = c / nh;
    let kv = h / (nh / nkv);
    let rs = (nh + 2 * nkv) * hd;
    (rs, h * hd, (nh + kv) * hd, (nh + nkv + kv) * hd)
}

/// Checks a key/value head count against the query heads.
fn check_groups(dims: AttnDims, nkv: usize) {
    assert!(
        nkv > 0 && dims.nh.is_multiple_of(nkv),
        "{} query heads do not split into groups over {nkv} key/value heads",
        dims.nh
    );
}

/// Raw strided product on one thread: c = a·b + beta * c, on bf16-rounded operands
/// with f32 sums when `bf16` (and the CPU has the bf16 product).
///
/// # Safety
/// As `matrixmultiply::sgemm`; `c` must not overlap `a` or `b`.
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn mm(
    bf16: bool,
    m: usize,
    k: usize,
    n: usize,
    a: *const f32,
    rsa: usize,
    csa: usize,
    b: *const f32,
    rsb: usize,
    csb: usize,
    beta: f32,
    c: *mut f32,
    rsc: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx512 && (beta == 0.0 || beta == 1.0) {
        let (a, b) = (
            Strided {
                ptr: a,
                rs: rsa,
                cs: csa,
            },
            Strided {
                ptr: b,
                rs: rsb,
                cs: csb,
            },
        );
        // SAFETY: the caller upholds `mm`'s contract (valid strided views, `c` disjoint from
        // `a` and `b`), which is `sgemm`'s; AVX-512 was detected just above.
        unsafe {
            if bf16 {
                bgemm(
                    m,
                    k,
                    n,
                    a,
                    b,
                    c,
                    rsc,
                    beta == 1.0,
                    None,
                    Epilogue::None,
                    n,
                    None,
                )
            } else {
                sgemm(m, k, n, a, b, c, rsc, beta == 1.0, None, Epilogue::None)
            }
        };
        return;
    }
    // SAFETY: the caller upholds `mm`'s contract, which is exactly `matrixmultiply::sgemm`'s.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a,
            rsa as isize,
            csa as isize,
            b,
            rsb as isize,
            csb as isize,
            beta,
            c,
            rsc as isize,
            1,
        )
    }
}

/// out (B, T, C) = softmax(mask(q kᵀ / sqrt(hd))) v per head, with q, k, v read from qkv
/// (B, T, 3C) in GPT-2's order; `lse` (B, NH, T) receives the log-sum-exp of each query.
/// `mask` (B, T) is 1 for tokens and 0 for padding (padding keys are never attended to).
/// `segments` (B, T): each run of equal ids in a row is one sequence, and a query attends only
/// to the keys of its own run ([`segment_start`]); None: each row is one sequence.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward(
    dtype: DType,
    out: &mut [f32],
    lse: &mut [f32],
    qkv: &[f32],
    mask: Option<&[u8]>,
    segments: Option<&[u32]>,
    dims: AttnDims,
    dropout: Option<Dropout>,
    scratch: &mut [f32],
) {
    attention_forward_grouped(
        dtype, out, lse, qkv, mask, segments, dims, dims.nh, dropout, scratch,
    )
}

/// [`attention_forward`] with `nkv` key/value heads: qkv (B, T, (NH + 2·NKV)·HS), query head h
/// attending with key/value head h / (NH/NKV) (GQA; MQA with one). `nkv` = NH is
/// [`attention_forward`].
pub fn attention_forward_grouped(
    dtype: DType,
    out: &mut [f32],
    lse: &mut [f32],
    qkv: &[f32],
    mask: Option<&[u8]>,
    segments: Option<&[u32]>,
    dims: AttnDims,
    nkv: usize,
    dropout: Option<Dropout>,
    scratch: &mut [f32],
) {
    forward_with(
        fused_heads(),
        dtype,
        out,
        lse,
        Qkv::F32(qkv),
        mask,
        segments,
        (dims, nkv),
        dropout,
        scratch,
    )
}

/// [`attention_forward`], its bf16 heads fused (`attention_fused`) when `fused_ok`.
#[allow(clippy::too_many_arguments)]
fn forward_with(
    fused_ok: bool,
    dtype: DType,
    out: &mut [f32],
    lse: &mut [f32],
    qkv: Qkv,
    mask: Option<&[u8]>,
    segments: Option<&[u32]>,
    (dims, nkv): (AttnDims, usize),
    dropout: Option<Dropout>,
    scratch: &mut [f32],
) {
    let AttnDims { b, t, c, nh } = dims;
    check_groups(dims, nkv);
    let rs = head_cols(dims, nkv, 0).0;
    let bf16 = dtype == DType::Bf16 && super::bf16_supported();
    assert!(out.len() >= b * t * c && qkv.len() >= b * t * rs && lse.len() >= b * nh * t);
    assert!(mask.is_none_or(|m| m.len() >= b * t));
    assert!(segments.is_none_or(|s| s.len() >= b * t));
    let out_p = SendPtr(out.as_mut_ptr());
    let lse_p = SendPtr(lse.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    let fused = fused_for(dtype, fused_ok);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = fused_ok;
    let general = qkv16::general(qkv);
    for_each_head(dims, 1, scratch, |bh, scr| {
        // safety: task bh writes only its own head's columns of out and its own lse row; the
        // fused path runs on the process's bf16 kernel only.
        unsafe {
            #[cfg(target_arch = "x86_64")]
            if let Some(tiles) = fused {
                return super::attention_fused::head_forward(
                    tiles,
                    out_p,
                    lse_p,
                    qkv,
                    mask,
                    segments,
                    (dims, nkv),
                    dropout,
                    bh,
                );
            }
            head_forward(
                bf16,
                out_p,
                lse_p,
                general,
                mask,
                segments,
                (dims, nkv),
                dropout,
                bh,
                scr,
            )
        }
    });
}

/// Whether bf16 heads run fused (`attention_fused`) on the bf16 kernel, unless
/// `COHORT_FUSED_ATTENTION=0` (or the older `COHORT_AMX_ATTENTION=0`) asks for the general
/// product per block: read once per process.
pub(super) fn fused_heads() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let off = |name| std::env::var(name).is_ok_and(|v| v.trim() == "0");
        !off("COHORT_FUSED_ATTENTION") && !off("COHORT_AMX_ATTENTION")
    })
}

/// The tiles a call's heads run fused on: this process's bf16 kernel's, for bf16 products
/// (`dtype` on a CPU that has them) when `fused_ok` ([`fused_heads`]); None where heads run
/// on the general path. The one decision forward, backward and the bf16 qkv buffer
/// (`qkv16::with_qkv`) make.
#[cfg(target_arch = "x86_64")]
pub(super) fn fused_for(dtype: DType, fused_ok: bool) -> Option<super::attention_fused::Tiles> {
    let bf16 = dtype == DType::Bf16 && super::bf16_supported();
    fused_tiles().filter(|_| bf16 && fused_ok)
}

/// The tiles fused heads run on: this process's bf16 kernel's (None without one).
#[cfg(target_arch = "x86_64")]
pub(super) fn fused_tiles() -> Option<super::attention_fused::Tiles> {
    use super::attention_fused::Tiles;
    use super::gemm_bf16::{chosen_kernel, Kernel};
    chosen_kernel().map(|k| match k {
        Kernel::Amx => Tiles::Amx,
        Kernel::Avx512 => Tiles::Zmm,
    })
}

/// Runs `f(bh, scratch)` for every (batch, head), heads split in contiguous ranges over threads,
/// in units of `group` consecutive heads (one task runs a unit's heads in order).
fn for_each_head(
    dims: AttnDims,
    group: usize,
    scratch: &mut [f32],
    f: impl Fn(usize, &mut [f32]) + Sync,
) {
    let n = dims.b * dims.nh / group;
    let per = per_thread(dims.t);
    let threads = (scratch.len() / per).min(n).max(1);
    assert!(scratch.len() >= per, "attention scratch too small");
    let chunk = n.div_ceil(threads);
    scratch[..threads * per]
        .par_chunks_mut(per)
        .enumerate()
        .for_each(|(p, scr)| {
            for unit in p * chunk..((p + 1) * chunk).min(n) {
                for bh in unit * group..(unit + 1) * group {
                    f(bh, scr);
                }
            }
        });
}

/// The mask row of batch `bi` as 1.0 / 0.0 floats.
pub(super) fn mask_row(mf: &mut [f32], mask: Option<&[u8]>, bi: usize, t: usize) {
    match mask {
        Some(m) => {
            for (f, &v) in mf.iter_mut().zip(&m[bi * t..(bi + 1) * t]) {
                *f = (v != 0) as u8 as f32;
            }
        }
        None => mf.fill(1.0),
    }
}

/// The first key query `tq` of batch row `bi` may see: the start of its segment (the run of
/// equal ids that ends at `tq`), 0 without segments. Scanning back costs no more than the
/// softmax over the same keys.
pub(super) fn segment_start(segments: Option<&[u32]>, bi: usize, t: usize, tq: usize) -> usize {
    let Some(s) = segments else { return 0 };
    let row = &s[bi * t..(bi + 1) * t];
    let mut lo = tq;
    while lo > 0 && row[lo - 1] == row[tq] {
        lo -= 1;
    }
    lo
}

/// [`softmax_row`] over the keys `lo..=tq` of query `tq`'s segment; the keys before `lo`
/// get probability 0.
pub(super) fn softmax_in(row: &mut [f32], mf: &[f32], tq: usize, lo: usize, scale: f32) -> f32 {
    row[..lo].fill(0.0);
    softmax_row(&mut row[lo..], &mf[lo..], tq - lo, scale)
}

/// [`probs_row`] over the keys `lo..=tq` of query `tq`'s segment; 0 before `lo`.
pub(super) fn probs_in(row: &mut [f32], mf: &[f32], tq: usize, lo: usize, lse: f32, scale: f32) {
    row[..lo].fill(0.0);
    probs_row(&mut row[lo..], &mf[lo..], tq - lo, lse, scale)
}

/// # Safety
/// `out` and `lse` point at buffers of the sizes `attention_forward` checked, and no other task
/// touches head `bh`'s part of them.
#[allow(clippy::too_many_arguments)]
unsafe fn head_forward(
    bf16: bool,
    out: SendPtr,
    lse: SendPtr,
    qkv: &[f32],
    mask: Option<&[u8]>,
    segments: Option<&[u32]>,
    (dims, nkv): (AttnDims, usize),
    dropout: Option<Dropout>,
    bh: usize,
    scr: &mut [f32],
) {
    let AttnDims { t, c, nh, .. } = dims;
    let (bi, h) = (bh / nh, bh % nh);
    let hd = c / nh;
    let scale = 1.0 / (hd as f32).sqrt();
    let (mf, rest) = scr.split_at_mut(t);
    let s = &mut rest[..RB.min(t) * t];
    mask_row(mf, mask, bi, t);
    let (rs, qo, ko, vo) = head_cols(dims, nkv, h);
    let row0 = qkv[bi * t * rs..].as_ptr();
    let (q, k, v) = (
        row0.wrapping_add(qo),
        row0.wrapping_add(ko),
        row0.wrapping_add(vo),
    );
    for r0 in (0..t).step_by(RB) {
        let r1 = (r0 + RB).min(t);
        let (rows, keys) = (r1 - r0, r1);
        // SAFETY: rows r0..r1 of Q and keys 0..r1 of K lie inside `qkv` (head `bh`, checked
        // sizes); `s` holds rows x keys floats and is this task's scratch, disjoint from `qkv`.
        unsafe {
            mm(
                bf16,
                rows,
                hd,
                keys,
                q.add(r0 * rs),
                rs,
                1,
                k,
                1,
                rs,
                0.0,
                s.as_mut_ptr(),
                keys,
            );
        }
        for i in 0..rows {
            let tq = r0 + i;
            let row = &mut s[i * keys..(i + 1) * keys];
            let lo = segment_start(segments, bi, t, tq);
            let l = softmax_in(row, &mf[..keys], tq, lo, scale);
            // SAFETY: `lse` has b*nh*t floats (checked by `attention_forward`) and entry
            // (bh, tq) belongs to this task alone.
            unsafe { *lse.0.add(bh * t + tq) = l };
            if let Some(d) = dropout {
                let base = ((bh * t + tq) * t) as u64;
                d.apply(&mut row[..=tq], base);
            }
        }
        // SAFETY: head `bh`'s columns of output rows r0..r1 lie inside `out` (checked sizes)
        // and no other task writes them; `s` and V are read-only here and disjoint from `out`.
        unsafe {
            let o = out.0.add((bi * t + r0) * c + h * hd);
            mm(
                bf16,
                rows,
                keys,
                hd,
                s.as_ptr(),
                keys,
                1,
                v,
                rs,
                1,
                0.0,
                o,
                c,
            );
        }
    }
}

simd_fn! {
    /// Masked softmax of `scale` times `row`, in place, over keys 0..=tq with `mf[j]` = 1 for
    /// real keys; zeros elsewhere. Returns the log-sum-exp, or -inf when no key is visible (row
    /// all zeros). The scale is applied in the masking pass, not as a pass of its own.
    pub(super) fn softmax_row(row: &mut [f32], mf: &[f32], tq: usize, scale: f32) -> f32 {
        let (vis, after) = row.split_at_mut(tq + 1);
        after.fill(0.0);
        let mf = &mf[..=tq];
        let mx = softmax_max(vis, mf, scale);
        if mx == f32::NEG_INFINITY {
            vis.fill(0.0);
            return f32::NEG_INFINITY;
        }
        for (x, &m) in vis.iter_mut().zip(mf) {
            *x = exp(*x - mx) * m;
        }
        let total = sum(vis);
        let inv = 1.0 / total;
        for x in vis.iter_mut() {
            *x *= inv;
        }
        mx + total.ln()
    }
}

/// [`softmax_row`]'s first two passes over the visible keys `vis` (`mf` as long): the
/// scores scaled, masked ones -inf, in place; returns their max (-inf: no key visible). The
/// fused heads find the same max in a pass that writes nothing (`rows::scaled_max`).
#[inline(always)]
pub(super) fn softmax_max(vis: &mut [f32], mf: &[f32], scale: f32) -> f32 {
    for (x, &m) in vis.iter_mut().zip(mf) {
        *x = if m > 0.0 {
            *x * scale
        } else {
            f32::NEG_INFINITY
        };
    }
    max(vis)
}

simd_fn! {
    /// Probabilities from `scale` times the scores and a stored log-sum-exp (the forward's
    /// softmax, recomputed).
    pub(super) fn probs_row(row: &mut [f32], mf: &[f32], tq: usize, lse: f32, scale: f32) {
        let (vis, after) = row.split_at_mut(tq + 1);
        after.fill(0.0);
        if lse == f32::NEG_INFINITY {
            vis.fill(0.0);
            return;
        }
        for (x, &m) in vis.iter_mut().zip(&mf[..=tq]) {
            *x = exp(*x * scale - lse) * m;
        }
    }
}

simd_fn! {
    /// dS = P * (dP - Σ_j P dP) * scale, written over dP.
    pub(super) fn softmax_back_row(dp: &mut [f32], p: &[f32], scale: f32) {
        let mut acc = [0f32; 16];
        for (j, (&d, &p)) in dp.iter().zip(p).enumerate() {
            acc[j % 16] += d * p;
        }
        let dsum = sum(&acc);
        for (d, &p) in dp.iter_mut().zip(p) {
            *d = p * (*d - dsum) * scale;
        }
    }
}

/// Backward of [`attention_forward`]: `dqkv` (B, T, 3C) is overwritten with the gradients of q,
/// k and v; `dout` is the gradient of the attention output. When `recompute_out` is given it
/// receives the forward's output again (the caller did not keep it).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dtype: DType,
    dqkv: &mut [f32],
    recompute_out: Option<&mut [f32]>,
    dout: &[f32],
    qkv: &[f32],
    lse: &[f32],
    mask: Option<&[u8]>,
    segments: Option<&[u32]>,
    dims: AttnDims,
    dropout: Option<Dropout>,
    scratch: &mut [f32],
) {
    attention_backward_grouped(
        dtype,
        dqkv,
        recompute_out,
        dout,
        qkv,
        lse,
        mask,
        segments,
        dims,
        dims.nh,
        dropout,
        scratch,
    )
}

/// Backward of [`attention_forward_grouped`]: `dqkv` (B, T, (NH + 2·NKV)·HS) is overwritten;
/// each key/value head's gradient is the sum of its query group's, added head after head in
/// the group's order (the same bits whatever the thread count).
pub fn attention_backward_grouped(
    dtype: DType,
    dqkv: &mut [f32],
    recompute_out: Option<&mut [f32]>,
    dout: &[f32],
    qkv: &[f32],
    lse: &[f32],
    mask: Option<&[u8]>,
    segments: Option<&[u32]>,
    dims: AttnDims,
    nkv: usize,
    dropout: Option<Dropout>,
    scratch: &mut [f32],
) {
    backward_with(
        fused_heads(),
        dtype,
        dqkv,
        recompute_out,
        dout,
        Qkv::F32(qkv),
        lse,
        mask,
        segments,
        (dims, nkv),
        dropout,
        scratch,
    )
}

/// [`attention_backward`], its bf16 heads fused (`attention_fused`) when `fused_ok`.
#[allow(clippy::too_many_arguments)]
fn backward_with(
    fused_ok: bool,
    dtype: DType,
    dqkv: &mut [f32],
    recompute_out: Option<&mut [f32]>,
    dout: &[f32],
    qkv: Qkv,
    lse: &[f32],
    mask: Option<&[u8]>,
    segments: Option<&[u32]>,
    (dims, nkv): (AttnDims, usize),
    dropout: Option<Dropout>,
    scratch: &mut [f32],
) {
    let AttnDims { b, t, c, nh } = dims;
    check_groups(dims, nkv);
    let rs = head_cols(dims, nkv, 0).0;
    let bf16 = dtype == DType::Bf16 && super::bf16_supported();
    assert!(dqkv.len() >= b * t * rs && qkv.len() >= b * t * rs && dout.len() >= b * t * c);
    assert!(lse.len() >= b * nh * t && mask.is_none_or(|m| m.len() >= b * t));
    assert!(segments.is_none_or(|s| s.len() >= b * t));
    let dqkv_p = SendPtr(dqkv.as_mut_ptr());
    let out_p = recompute_out.map(|o| {
        assert!(o.len() >= b * t * c);
        SendPtr(o.as_mut_ptr())
    });
    #[cfg(target_arch = "x86_64")]
    let fused = fused_for(dtype, fused_ok);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = fused_ok;
    let general = qkv16::general(qkv);
    // One task per (batch, key/value head): its query group's heads in order.
    let group = nh / nkv;
    for_each_head(dims, group, scratch, |bh, scr| {
        // The first head of a group writes its key/value head's gradient, the others add to
        // it, in order, on this task.
        let first = (bh % dims.nh).is_multiple_of(group);
        // safety: the task of group bh / group writes only its heads' columns of dq and of the
        // output and its key/value head's columns of dk and dv; the fused path runs on the
        // process's bf16 kernel only.
        unsafe {
            #[cfg(target_arch = "x86_64")]
            if let Some(tiles) = fused {
                return super::attention_fused::head_backward(
                    tiles,
                    dqkv_p,
                    out_p,
                    dout,
                    qkv,
                    lse,
                    mask,
                    segments,
                    (dims, nkv),
                    dropout,
                    (bh, first),
                );
            }
            head_backward(
                bf16,
                dqkv_p,
                out_p,
                dout,
                general,
                lse,
                mask,
                segments,
                (dims, nkv),
                dropout,
                (bh, first),
                scr,
            )
        }
    });
}

/// `first`: head `bh` is the first of its key/value group, and writes the group's dK and dV
/// (the others add to them).
///
/// # Safety
/// As `head_forward`, for `dqkv` and `out`; head `bh`'s key/value head's columns of dqkv are
/// touched by its group's heads only, run in order on this task.
#[allow(clippy::too_many_arguments)]
unsafe fn head_backward(
    bf16: bool,
    dqkv: SendPtr,
    out: Option<SendPtr>,
    dout: &[f32],
    qkv: &[f32],
    lse: &[f32],
    mask: Option<&[u8]>,
    segments: Option<&[u32]>,
    (dims, nkv): (AttnDims, usize),
    dropout: Option<Dropout>,
    (bh, first): (usize, bool),
    scr: &mut [f32],
) {
    let AttnDims { t, c, nh, .. } = dims;
    let (bi, h) = (bh / nh, bh % nh);
    let hd = c / nh;
    let scale = 1.0 / (hd as f32).sqrt();
    // dK and dV rows a block touches for the first time are written by the group's first
    // head, added to by the others.
    let fresh = if first { 0.0 } else { 1.0 };
    let blk = RB.min(t) * t;
    let (mf, rest) = scr.split_at_mut(t);
    let (p, rest) = rest.split_at_mut(blk);
    let (dp, rest) = rest.split_at_mut(blk);
    let pd = &mut rest[..blk];
    mask_row(mf, mask, bi, t);
    let (rs, qo, ko, vo) = head_cols(dims, nkv, h);
    let (row0, drow0) = (
        qkv[bi * t * rs..].as_ptr(),
        dqkv.0.wrapping_add(bi * t * rs),
    );
    let (q, k, v) = (
        row0.wrapping_add(qo),
        row0.wrapping_add(ko),
        row0.wrapping_add(vo),
    );
    let (dq, dk, dv) = (
        drow0.wrapping_add(qo),
        drow0.wrapping_add(ko),
        drow0.wrapping_add(vo),
    );
    let dy = dout[bi * t * c + h * hd..].as_ptr();
    for r0 in (0..t).step_by(RB) {
        let r1 = (r0 + RB).min(t);
        let (rows, keys) = (r1 - r0, r1);
        // SAFETY: rows r0..r1 of Q and keys 0..r1 of K lie inside `qkv`; `p` is this task's
        // scratch (rows x keys), disjoint from `qkv`.
        unsafe {
            mm(
                bf16,
                rows,
                hd,
                keys,
                q.add(r0 * rs),
                rs,
                1,
                k,
                1,
                rs,
                0.0,
                p.as_mut_ptr(),
                keys,
            );
            // dPd = dY · Vᵀ
            mm(
                bf16,
                rows,
                hd,
                keys,
                dy.add(r0 * c),
                c,
                1,
                v,
                1,
                rs,
                0.0,
                dp.as_mut_ptr(),
                keys,
            );
        }
        for i in 0..rows {
            let tq = r0 + i;
            probs_in(
                &mut p[i * keys..(i + 1) * keys],
                &mf[..keys],
                tq,
                segment_start(segments, bi, t, tq),
                lse[bh * t + tq],
                scale,
            );
        }
        // The probabilities as used in the forward product (after dropout), and dP from dPd.
        let used: &[f32] = match dropout {
            Some(d) => {
                pd[..rows * keys].copy_from_slice(&p[..rows * keys]);
                for i in 0..rows {
                    let off = ((bh * t + r0 + i) * t) as u64;
                    d.apply(&mut pd[i * keys..(i + 1) * keys], off);
                    d.apply(&mut dp[i * keys..(i + 1) * keys], off);
                }
                &pd[..rows * keys]
            }
            None => &p[..rows * keys],
        };
        // SAFETY: head `bh`'s dV columns for keys 0..r1 lie inside `dqkv` and belong to this
        // task alone (its key/value head's, shared only by its group, run on this task); the probabilities and dY are read-only and disjoint from `dqkv`.
        unsafe {
            // dV[0..keys] += usedᵀ · dY; keys r0..r1 are touched for the first time here.
            mm(
                bf16,
                r0,
                rows,
                hd,
                used.as_ptr(),
                1,
                keys,
                dy.add(r0 * c),
                c,
                1,
                1.0,
                dv,
                rs,
            );
            mm(
                bf16,
                rows,
                rows,
                hd,
                used.as_ptr().add(r0),
                1,
                keys,
                dy.add(r0 * c),
                c,
                1,
                fresh,
                dv.add(r0 * rs),
                rs,
            );
            if let Some(o) = out {
                let o = o.0.add((bi * t + r0) * c + h * hd);
                mm(
                    bf16,
                    rows,
                    keys,
                    hd,
                    used.as_ptr(),
                    keys,
                    1,
                    v,
                    rs,
                    1,
                    0.0,
                    o,
                    c,
                );
            }
        }
        for i in 0..rows {
            softmax_back_row(
                &mut dp[i * keys..(i + 1) * keys],
                &p[i * keys..(i + 1) * keys],
                scale,
            );
        }
        // SAFETY: head `bh`'s dQ rows r0..r1 and dK rows 0..r1 lie inside `dqkv` and belong to
        // this task alone; dS (scratch), Q and K are read-only and disjoint from `dqkv`.
        unsafe {
            // dQ[r0..r1] = dS · K; dK[0..keys] += dSᵀ · Q[r0..r1]
            mm(
                bf16,
                rows,
                keys,
                hd,
                dp.as_ptr(),
                keys,
                1,
                k,
                rs,
                1,
                0.0,
                dq.add(r0 * rs),
                rs,
            );
            mm(
                bf16,
                r0,
                rows,
                hd,
                dp.as_ptr(),
                1,
                keys,
                q.add(r0 * rs),
                rs,
                1,
                1.0,
                dk,
                rs,
            );
            mm(
                bf16,
                rows,
                rows,
                hd,
                dp.as_ptr().add(r0),
                1,
                keys,
                q.add(r0 * rs),
                rs,
                1,
                fresh,
                dk.add(r0 * rs),
                rs,
            );
        }
    }
}

mod qkv16;
pub(super) use qkv16::Qkv;
pub use qkv16::{attention_backward_bf16_qkv, attention_forward_bf16_qkv};

#[cfg(test)]
mod grouped_tests;

#[cfg(test)]
mod tests;

//! Causal attention of one (batch, head) with its products fused, for bf16 training on either
//! bf16 kernel (AMX tiles, or VDPBF16PS on zmm registers): the same arithmetic as
//! [`attention`](super::attention)'s bf16 path (operands rounded to bf16, sums in f32, the
//! same softmax, mask and dropout code), with the products of a head made here instead of one
//! general product call each. It must never give other results than the general path (a
//! test holds it to them).
//!
//! A head is small (T x 64 for each of Q, K and V), so the general product's fixed costs
//! (a call, a tile configuration, packing both operands every time) outweighed its
//! arithmetic: the keys were packed again for every block of queries. Here Q, K and V are
//! packed into bf16 pairs once per head, in the layouts each product reads, and the queries go
//! by in strips ([`Tiles::strip`]), each product of a strip one kernel call per 32 output
//! columns (and per 32 rows on AMX, per register tile of up to 12 on zmm). A strip attends to
//! keys up to its last row; on zmm each register tile also stops at its own last row's keys
//! (scores past them are never computed, sums over probabilities skip their causal zeros).
//! Each strip asks for its rows of the next head's operands, which come from beyond the
//! caches.
//!
//! The score matrix of a strip is gone over as few times as the arithmetic allows, each
//! pass writing the bf16 pairs its product reads as it makes the values (in `pack_a`'s layout
//! and rounding, for both kernels: only the row stride differs), instead of storing f32 and
//! packing them in a pass of their own (config B's bf16 step, Zen 5: attention 14% of the step
//! at a quarter of the machine's peak, its softmax passes and packing half of that). What
//! remains a row: forward, the max of the scaled, masked scores (written nowhere), exp with
//! the sum (scaling and masking again, the same bits), then 1/sum and dropout writing P's
//! pairs, four rows through each pass together so that one row's serial steps (the max
//! across lanes, the sum, ln) overlap the others' vector work; backward, P with both
//! dropouts and Σ dP·P (and, recomputing the output, the used probabilities' pairs), then dS
//! written in f32 and as pairs. The arithmetic is the
//! general path's operation for operation, on 16 lanes by hand (exp included; `rows`):
//! LLVM left loops that both compute and pack scalar. The transposed layouts (the used
//! probabilities and dS for dV and dK, pairs along queries) stay packs of their own from f32:
//! a fused transpose would store two rows' pairs at strided addresses.
//!
//! The qkv buffer may hold f32 or, under bf16 products, bf16 bits ([`Qkv`]: the qkv product
//! rounds its result as these packs would). From bf16, K and V go into their panels by the
//! same loop nest as from f32 (`pack_b_bf16`), their pairs moved rather than rounded; Q's pairs
//! are its row's, which the zmm kernel reads in place at the row's stride (AMX tiles read
//! packed rows: there Q is copied). Both give the bits of the f32 buffer (a test holds them to
//! it), and skip the per-head conversion that was ~15% of config B's attention (perf, Zen 5).
//!
//! Each output element sums its K in the same order as the general product (pairs in order, in
//! the same K blocks), so results are the general path's bits; on AMX, dK and dV sum over
//! strips of 32 queries rather than the general path's 64 and so differ by f32 rounding (a
//! test holds each kernel to that). It never allocates after a thread's first call: its
//! packing buffers are per thread.

use std::cell::RefCell;

use super::attention::{head_cols, mask_row, segment_start, AttnDims, Qkv};
use super::gemm::prefetch_run;
use super::gemm_bf16::amx::{self, Scratch};
use super::gemm_bf16::{pack_a, pack_a_bf16, pack_b, pack_b_bf16, zmm_product, Line, Upto, NR};
use super::SendPtr;
use crate::Dropout;
use rows::{grad_pairs, probs_pairs, softmax_rows, SoftRow};

mod rows;

/// Which kernel a head's products run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tiles {
    /// AMX tiles: strips of one 32-row block, K padded to 16 pairs.
    Amx,
    /// VDPBF16PS on zmm registers (`gemm_bf16`'s register tile), K in whole pairs.
    Zmm,
}

/// One thread's packed operands and strip buffers, grown to the largest head seen.
#[derive(Default)]
struct Bufs {
    lines: Vec<Line>,
    floats: Vec<f32>,
}

thread_local! {
    static BUFS: RefCell<Bufs> = RefCell::new(Bufs::default());
}

impl Tiles {
    /// Query rows per strip. AMX: one block. zmm: the general path's 64-query blocks, so that
    /// dK and dV (sums over a strip's queries, added strip after strip) keep its bits.
    fn strip(self) -> usize {
        match self {
            Tiles::Amx => 32,
            Tiles::Zmm => 64,
        }
    }

    /// Pairs of a K of `k` elements as packed: AMX pads to the 16 pairs one tile row holds.
    fn pairs(self, k: usize) -> usize {
        match self {
            Tiles::Amx => k.div_ceil(32) * 16,
            Tiles::Zmm => k.div_ceil(2),
        }
    }

    /// `n` rounded up to a whole number of strips.
    fn strips(self, n: usize) -> usize {
        n.div_ceil(self.strip()) * self.strip()
    }

    /// Readies this thread for [`Tiles::product`] (AMX: loads the tile configuration).
    ///
    /// # Safety
    /// This kernel is this process's bf16 kernel.
    unsafe fn begin(self) {
        if self == Tiles::Amx {
            // SAFETY: AMX is the chosen kernel (the caller's contract), so it is granted.
            unsafe { amx::configure() };
        }
    }

    /// Ends what [`Tiles::begin`] started.
    ///
    /// # Safety
    /// As [`Tiles::begin`].
    unsafe fn end(self) {
        if self == Tiles::Amx {
            // SAFETY: as in `begin`.
            unsafe { amx::release() };
        }
    }

    /// `c[0..rows, 0..n] (+)= a · b`: `a` as rows of `kp` pairs `rsa` u32 apart (`kp` on AMX,
    /// whose tiles read packed rows), `b` as panels of `kp` pairs by 32 columns (panel j at
    /// `b + j * 32 * bstride`, its first `kp` pairs read). The zmm kernel computes only what
    /// `upto` says each row needs (AMX all of it).
    ///
    /// # Safety
    /// [`Tiles::begin`] ran on this thread; the operands as described (on AMX, `a` readable to
    /// a whole number of 32-row blocks); c rows x n writable floats at row stride rsc.
    #[allow(clippy::too_many_arguments)]
    unsafe fn product(
        self,
        kp: usize,
        (a, rsa): (*const u32, usize),
        b: *const u32,
        bstride: usize,
        c: *mut f32,
        rsc: usize,
        rows: usize,
        n: usize,
        acc: bool,
        upto: Upto,
        scratch: &mut Scratch,
    ) {
        match self {
            // SAFETY: forwarded; the zmm kernel is present (it is the chosen one).
            Tiles::Zmm => unsafe {
                zmm_product(kp, a, rsa, b, bstride, c, rsc, rows, n, acc, upto)
            },
            Tiles::Amx => {
                debug_assert_eq!(rsa, kp, "AMX reads packed rows");
                for i in (0..rows).step_by(32) {
                    for j in (0..n).step_by(NR) {
                        // SAFETY: forwarded; rows i.. (32 readable) of a, panel j / 32 of b
                        // and block (i, j) of c lie inside the caller's.
                        unsafe {
                            amx::block(
                                kp,
                                a.add(i * kp),
                                b.add(j * bstride),
                                c.add(i * rsc + j),
                                rsc,
                                32.min(rows - i),
                                NR.min(n - j),
                                acc,
                                None,
                                scratch,
                            )
                        };
                    }
                }
            }
        }
    }

    /// [`Tiles::product`] into `keys` rows of `c` (`b`'s panels `kp` pairs apart), `a` the
    /// transposed probabilities (or their gradient) of the strip from query `r0`: key j's sum
    /// skips the strip's queries before it (zeros). Rows before `fresh` (a multiple of the
    /// strip) accumulate, the rest are written.
    ///
    /// # Safety
    /// As [`Tiles::product`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn tall_product(
        self,
        kp: usize,
        a: *const u32,
        b: *const u32,
        c: *mut f32,
        rsc: usize,
        keys: usize,
        n: usize,
        (r0, fresh): (usize, usize),
        scratch: &mut Scratch,
    ) {
        let old = fresh.min(keys);
        // SAFETY: forwarded; rows 0..old, then old..keys, of a and c.
        unsafe {
            let skip = Upto::KFrom(r0);
            self.product(kp, (a, kp), b, kp, c, rsc, old, n, true, skip, scratch);
            let (a, c) = (a.add(old * kp), c.add(old * rsc));
            let (rows, skip) = (keys - old, Upto::KFrom(r0.saturating_sub(old)));
            self.product(kp, (a, kp), b, kp, c, rsc, rows, n, false, skip, scratch);
        }
    }
}

/// Carves 64-byte aligned u32 regions of the given sizes (in u32) out of `lines`.
fn carve<const N: usize>(lines: &mut Vec<Line>, sizes: [usize; N]) -> [*mut u32; N] {
    let total: usize = sizes.iter().map(|n| n.div_ceil(16)).sum();
    if lines.len() < total {
        lines.resize(total, Line([0; 16]));
    }
    let base = lines.as_mut_ptr();
    let mut at = 0;
    sizes.map(|n| {
        // SAFETY: at + ⌈n/16⌉ ≤ total ≤ lines.len(): the region lies inside the buffer.
        let p = unsafe { base.add(at) } as *mut u32;
        at += n.div_ceil(16);
        p
    })
}

/// Rows of a qkv buffer as it holds them: f32, or bf16 bits (see [`Qkv`]), from one element.
#[derive(Clone, Copy)]
enum Rows {
    F32(*const f32),
    Bf16(*const u16),
}

impl Rows {
    /// The buffer's first element.
    fn of(qkv: Qkv) -> Rows {
        match qkv {
            Qkv::F32(x) => Rows::F32(x.as_ptr()),
            Qkv::Bf16(x) => Rows::Bf16(x.as_ptr()),
        }
    }

    /// `n` elements further (a pointer computed, nothing read).
    fn add(self, n: usize) -> Rows {
        match self {
            Rows::F32(p) => Rows::F32(p.wrapping_add(n)),
            Rows::Bf16(p) => Rows::Bf16(p.wrapping_add(n)),
        }
    }

    /// The address and the bytes of one element (for prefetches).
    fn bytes(self) -> (*const u8, usize) {
        match self {
            Rows::F32(p) => (p as *const u8, 4),
            Rows::Bf16(p) => (p as *const u8, 2),
        }
    }

    /// `pack_a` from these rows (bf16 ones copied: the same pairs).
    ///
    /// # Safety
    /// As `pack_a`, from this element.
    unsafe fn pack_a(self, pa: *mut u32, rs: usize, cs: usize, m: usize, k: usize, st: usize) {
        // SAFETY: the caller's contract; the bf16 kernel is present wherever a head is fused.
        unsafe {
            match self {
                Rows::F32(a) => pack_a(pa, a, rs, cs, m, k, st),
                Rows::Bf16(a) => pack_a_bf16(pa, a, rs, cs, m, k, st),
            }
        }
    }

    /// `pack_b` from these rows (bf16 ones moved: the same panels).
    ///
    /// # Safety
    /// As `pack_b`, from this element.
    unsafe fn pack_b(self, pb: *mut u32, rs: usize, cs: usize, k: usize, n: usize, st: usize) {
        // SAFETY: as in `pack_a`.
        unsafe {
            match self {
                Rows::F32(b) => pack_b(pb, b, rs, cs, k, n, st, None),
                Rows::Bf16(b) => pack_b_bf16(pb, b, rs, cs, k, n, st),
            }
        }
    }
}

/// The head's matrices: Q, K, V and their gradients at row stride 3C, dY and out at C.
struct Head {
    q: Rows,
    k: Rows,
    v: Rows,
    t: usize,
    hd: usize,
    /// Row stride of q, k, v (and of dq, dk, dv): 3C.
    rs: usize,
    scale: f32,
}

/// The next head's rows (its Q, K, V, and dY or out: a head's columns of rows
/// kilobytes apart, beyond the caches, which no hardware prefetcher follows), asked for a
/// strip's worth at a time while this head computes: packing a head's operands otherwise
/// stalled on memory (config B's attention, Zen 5, profiled: packing 32% of the fused heads'
/// time without this, 22% with it).
struct Ahead {
    /// (row 0, row stride, bytes of a head's row), in bytes, of each matrix.
    runs: [(*const u8, usize, usize); 4],
    n: usize,
    hd: usize,
}

impl Ahead {
    fn new(hd: usize) -> Ahead {
        Ahead {
            runs: [(std::ptr::null(), 0, 0); 4],
            n: 0,
            hd,
        }
    }

    /// Adds a matrix of rows `stride` elements apart from `row0`.
    fn push(&mut self, row0: Rows, stride: usize) {
        let (p, elem) = row0.bytes();
        self.runs[self.n] = (p, stride * elem, self.hd * elem);
        self.n += 1;
    }

    /// Adds head `bh`'s Q, K and V in `qkv` and its columns of each matrix of `per_head`
    /// (B, T, C). (Asking for the gradients' rows of the next head too, in backward, pushed
    /// as much out of L2 as it brought in.)
    fn head(
        &mut self,
        qkv: Rows,
        per_head: &[*const f32],
        (dims, nkv): (AttnDims, usize),
        bh: usize,
    ) {
        let AttnDims { t, c, nh, .. } = dims;
        let (bi, h) = (bh / nh, bh % nh);
        let (rs, qo, ko, vo) = head_cols(dims, nkv, h);
        let row0 = qkv.add(bi * t * rs);
        for off in [qo, ko, vo] {
            self.push(row0.add(off), rs);
        }
        for &m in per_head {
            self.push(Rows::F32(m).add(bi * t * c + h * (c / nh)), c);
        }
    }

    /// Asks for rows r0..r1 of every matrix.
    fn rows(&self, r0: usize, r1: usize) {
        for &(row0, stride, bytes) in &self.runs[..self.n] {
            for r in r0..r1 {
                prefetch_run(row0.wrapping_add(r * stride), bytes);
            }
        }
    }
}

/// Forward of head `bh`: as `head_forward` in the attention module, on `tiles`.
///
/// # Safety
/// `tiles` is this process's bf16 kernel; `out` and `lse` hold the sizes `attention_forward`
/// checked and head `bh`'s parts of them belong to this task alone.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn head_forward(
    tiles: Tiles,
    out: SendPtr,
    lse: SendPtr,
    qkv: Qkv,
    mask: Option<&[u8]>,
    segments: Option<&[u32]>,
    (dims, nkv): (AttnDims, usize),
    dropout: Option<Dropout>,
    bh: usize,
) {
    let AttnDims { t, c, nh, .. } = dims;
    let (bi, h) = (bh / nh, bh % nh);
    let hd = c / nh;
    let head = Head::at(qkv, (dims, nkv), bh);
    let s_rows = tiles.strip();
    let (pd, pt) = (tiles.pairs(hd), tiles.pairs(t));
    let (tp, hp) = (tiles.strips(t), hd.div_ceil(NR) * NR);
    let mut ahead = Ahead::new(hd);
    if bh + 1 < dims.b * nh {
        let outs = [out.0 as *const f32];
        ahead.head(Rows::of(qkv), &outs, (dims, nkv), bh + 1);
    }
    BUFS.with(|bufs| {
        let bufs = &mut *bufs.borrow_mut();
        let [qa, kb, vb, pa] = carve(&mut bufs.lines, [tp * pd, tp * pd, hp * pt, s_rows * pt]);
        grow(&mut bufs.floats, t + s_rows * t);
        let (mf, s) = bufs.floats.split_at_mut(t);
        mask_row(mf, mask, bi, t);
        let mut scratch = Scratch([0.0; 32 * NR]);
        // SAFETY: the packs read Q, K and V of this head (t rows of hd at stride 3C) and write
        // the regions carved for them; `tiles` is the chosen kernel (the caller's contract),
        // and every product writes this task's strip buffer or head `bh`'s columns of out.
        unsafe {
            let (qa, rsa) = head.pack(tiles, qa, kb, None, Some(vb), None);
            tiles.begin();
            for r0 in (0..t).step_by(s_rows) {
                let (rows, keys) = (s_rows.min(t - r0), (r0 + s_rows).min(t));
                ahead.rows(r0, r0 + rows);
                // S = Q[r0..] · K[0..keys]ᵀ
                let (qs, sp) = ((qa.add(r0 * rsa), rsa), s.as_mut_ptr());
                let cols = Upto::Cols(r0);
                tiles.product(pd, qs, kb, pd, sp, t, rows, keys, false, cols, &mut scratch);
                // P (after dropout) straight into its bf16 pairs, rows of kp pairs
                let kp = tiles.pairs(keys);
                let mut strip = s[..rows * t].chunks_mut(t).map(|row| &mut row[..keys]);
                let soft = |i: usize, row| {
                    let tq = r0 + i;
                    SoftRow {
                        row,
                        tq,
                        lo: segment_start(segments, bi, t, tq),
                        drop: dropout.map(|d| (d, ((bh * t + tq) * t) as u64)),
                        to: (pa.wrapping_add(i * kp), kp),
                    }
                };
                // TOGETHER rows at a time (see softmax_rows), the last few alone
                const TOGETHER: usize = 4;
                let lse_at = lse.0.add(bh * t + r0);
                let mut i = 0;
                while i + TOGETHER <= rows {
                    let some = std::array::from_fn(|j| soft(i + j, strip.next().expect("row")));
                    let l = softmax_rows::<TOGETHER>(some, &mf[..keys], head.scale);
                    lse_at.add(i).copy_from(l.as_ptr(), TOGETHER);
                    i += TOGETHER;
                }
                for (j, row) in strip.enumerate() {
                    *lse_at.add(i + j) =
                        softmax_rows([soft(i + j, row)], &mf[..keys], head.scale)[0];
                }
                // out[r0..] = P · V[0..keys]
                let o = out.0.add((bi * t + r0) * c + h * hd);
                tiles.product(
                    kp,
                    (pa, kp),
                    vb,
                    pt,
                    o,
                    c,
                    rows,
                    hd,
                    false,
                    Upto::K(r0),
                    &mut scratch,
                );
            }
            tiles.end();
        }
    });
}

/// Backward of head `bh`: as `head_backward` in the attention module, on `tiles` (`first`:
/// the first head of its key/value group, which writes the group's dK and dV; the others add).
///
/// # Safety
/// As [`head_forward`], for `dqkv` and `out`; head `bh`'s key/value head's columns of dqkv are
/// touched by its group's heads only, run in order on this task.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn head_backward(
    tiles: Tiles,
    dqkv: SendPtr,
    out: Option<SendPtr>,
    dout: &[f32],
    qkv: Qkv,
    lse: &[f32],
    mask: Option<&[u8]>,
    segments: Option<&[u32]>,
    (dims, nkv): (AttnDims, usize),
    dropout: Option<Dropout>,
    (bh, first): (usize, bool),
) {
    let AttnDims { t, c, nh, .. } = dims;
    let (bi, h) = (bh / nh, bh % nh);
    let hd = c / nh;
    let head = Head::at(qkv, (dims, nkv), bh);
    let (rs, qo, ko, vo) = head_cols(dims, nkv, h);
    let drow0 = dqkv.0.wrapping_add(bi * t * rs);
    let (dq, dk, dv) = (
        drow0.wrapping_add(qo),
        drow0.wrapping_add(ko),
        drow0.wrapping_add(vo),
    );
    // dK and dV strips from `fresh` on are written (by a group's first head), earlier ones
    // added to; the group's other heads add to all of them.
    let fresh = |r0: usize| if first { r0 } else { t };
    let dy = dout[bi * t * c + h * hd..].as_ptr();
    let s_rows = tiles.strip();
    let (pd, pt, ps) = (tiles.pairs(hd), tiles.pairs(t), tiles.pairs(s_rows));
    let (tp, hp) = (tiles.strips(t), hd.div_ceil(NR) * NR);
    let mut ahead = Ahead::new(hd);
    if bh + 1 < dims.b * nh {
        ahead.head(Rows::of(qkv), &[dout.as_ptr()], (dims, nkv), bh + 1);
    }
    BUFS.with(|bufs| {
        let bufs = &mut *bufs.borrow_mut();
        let recompute = if out.is_some() { 1 } else { 0 };
        let [qa, kb, vtb, kbk, vb, dya, dyb, qb, wide, uwide, tall] = carve(
            &mut bufs.lines,
            [
                tp * pd,
                tp * pd,
                tp * pd,
                hp * pt,
                recompute * hp * pt,
                s_rows * pd,
                hp * ps,
                hp * ps,
                s_rows * pt,
                recompute * s_rows * pt,
                tp * ps,
            ],
        );
        grow(&mut bufs.floats, t + 3 * s_rows * t);
        let (mf, rest) = bufs.floats.split_at_mut(t);
        let (p, rest) = rest.split_at_mut(s_rows * t);
        let (dp, pdrop) = rest.split_at_mut(s_rows * t);
        mask_row(mf, mask, bi, t);
        let mut scratch = Scratch([0.0; 32 * NR]);
        // SAFETY: as in head_forward; the products write this task's strip buffers, head
        // `bh`'s columns of dq and out, or its key/value head's columns of dk and dv.
        unsafe {
            let (qa, rsa) = head.pack(tiles, qa, kb, Some(vtb), out.map(|_| vb), Some(kbk));
            tiles.begin();
            for r0 in (0..t).step_by(s_rows) {
                let (rows, keys) = (s_rows.min(t - r0), (r0 + s_rows).min(t));
                let (kp, ps) = (tiles.pairs(keys), tiles.pairs(rows));
                ahead.rows(r0, r0 + rows);
                // P recomputed from S = Q·Kᵀ and the stored log-sum-exp; dPd = dY · Vᵀ
                let (qs, pp) = ((qa.add(r0 * rsa), rsa), p.as_mut_ptr());
                let cols = Upto::Cols(r0);
                tiles.product(pd, qs, kb, pd, pp, t, rows, keys, false, cols, &mut scratch);
                pack_a(dya, dy.add(r0 * c), c, 1, rows, hd, pd);
                let dpp = dp.as_mut_ptr();
                tiles.product(
                    pd,
                    (dya, pd),
                    vtb,
                    pd,
                    dpp,
                    t,
                    rows,
                    keys,
                    false,
                    cols,
                    &mut scratch,
                );
                // Two passes a row: P, its dropout and dP's, Σ dP·P (and the used
                // probabilities' pairs for the output); then dS, in f32 and as pairs.
                for i in 0..rows {
                    let tq = r0 + i;
                    let lo = segment_start(segments, bi, t, tq);
                    let at = i * t..i * t + keys;
                    let (pr, dpr) = (&mut p[at.clone()], &mut dp[at.clone()]);
                    let off = ((bh * t + tq) * t) as u64;
                    let drop = dropout.map(|d| (d, off, &mut pdrop[at]));
                    let l = (lse[bh * t + tq], head.scale);
                    let used = out.map(|_| (uwide.add(i * kp), kp));
                    let dsum = probs_pairs(pr, dpr, &mf[..keys], (tq, lo), l, drop, used);
                    let to = (wide.add(i * kp), kp);
                    grad_pairs(pr, dpr, tq, dsum, head.scale, to);
                }
                // The probabilities as the forward used them (after dropout)
                let used: &[f32] = if dropout.is_some() { pdrop } else { p };
                // dV[0..keys] (+)= usedᵀ · dY[r0..]; keys r0.. are touched for the first time
                pack_a(tall, used.as_ptr(), 1, t, keys, rows, ps);
                pack_b(dyb, dy.add(r0 * c), c, 1, rows, hd, ps, None);
                tiles.tall_product(
                    ps,
                    tall,
                    dyb,
                    dv,
                    rs,
                    keys,
                    hd,
                    (r0, fresh(r0)),
                    &mut scratch,
                );
                if let Some(o) = out {
                    let o = o.0.add((bi * t + r0) * c + h * hd);
                    let k = Upto::K(r0);
                    let a = (uwide as *const u32, kp);
                    tiles.product(kp, a, vb, pt, o, c, rows, hd, false, k, &mut scratch);
                }
                // dQ[r0..] = dS · K[0..keys]; dK[0..keys] (+)= dSᵀ · Q[r0..]
                let dqs = dq.add(r0 * rs);
                let k = Upto::K(r0);
                let a = (wide as *const u32, kp);
                tiles.product(kp, a, kbk, pt, dqs, rs, rows, hd, false, k, &mut scratch);
                pack_a(tall, dp.as_ptr(), 1, t, keys, rows, ps);
                head.q.add(r0 * rs).pack_b(qb, rs, 1, rows, hd, ps);
                tiles.tall_product(
                    ps,
                    tall,
                    qb,
                    dk,
                    rs,
                    keys,
                    hd,
                    (r0, fresh(r0)),
                    &mut scratch,
                );
            }
            tiles.end();
        }
    });
}

impl Head {
    fn at(qkv: Qkv, (dims, nkv): (AttnDims, usize), bh: usize) -> Head {
        let AttnDims { t, c, nh, .. } = dims;
        let hd = c / nh;
        let (rs, qo, ko, vo) = head_cols(dims, nkv, bh % nh);
        assert!(
            qkv.len() >= (bh / nh + 1) * t * rs,
            "qkv holds the head's rows"
        );
        let row0 = Rows::of(qkv).add((bh / nh) * t * rs);
        Head {
            q: row0.add(qo),
            k: row0.add(ko),
            v: row0.add(vo),
            t,
            hd,
            rs,
            scale: 1.0 / (hd as f32).sqrt(),
        }
    }

    /// Packs what the products read: Q as rows of pairs along its dimensions (`qa`); Kᵀ (`kb`)
    /// and Vᵀ (`vtb`) as panels of 32 keys, pairs along the dimensions; V (`vb`) and K (`kbk`)
    /// as panels of 32 dimensions, pairs along the keys. Returns Q's rows as the products
    /// read them, (row 0, stride in u32): `qa`, or on zmm the bf16 rows themselves where they
    /// are already Q's pairs (an even head size, pairs on 4-byte boundaries), read in place.
    ///
    /// # Safety
    /// Each region as carved by the callers for this head's sizes.
    unsafe fn pack(
        &self,
        tiles: Tiles,
        qa: *mut u32,
        kb: *mut u32,
        vtb: Option<*mut u32>,
        vb: Option<*mut u32>,
        kbk: Option<*mut u32>,
    ) -> (*const u32, usize) {
        let (t, hd, rs) = (self.t, self.hd, self.rs);
        let (pd, pt) = (tiles.pairs(hd), tiles.pairs(t));
        // SAFETY: q, k and v hold t rows of hd at stride rs; the regions are the callers'.
        unsafe {
            let q = match self.q {
                Rows::Bf16(q)
                    if tiles == Tiles::Zmm
                        && hd.is_multiple_of(2)
                        && rs.is_multiple_of(2)
                        && (q as usize).is_multiple_of(4) =>
                {
                    // Row r's pairs are the u32s from q + r * rs: aligned (rs and q are even
                    // in u16s), hd / 2 of them inside the row; the kernel reads no others.
                    (q as *const u32, rs / 2)
                }
                q => {
                    q.pack_a(qa, rs, 1, t, hd, pd);
                    (qa as *const u32, pd)
                }
            };
            self.k.pack_b(kb, 1, rs, hd, t, pd);
            if let Some(vtb) = vtb {
                self.v.pack_b(vtb, 1, rs, hd, t, pd);
            }
            if let Some(vb) = vb {
                self.v.pack_b(vb, rs, 1, t, hd, pt);
            }
            if let Some(kbk) = kbk {
                self.k.pack_b(kbk, rs, 1, t, hd, pt);
            }
            q
        }
    }
}

/// Grows `v` to at least `n` floats.
fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

#[cfg(test)]
mod row_tests;

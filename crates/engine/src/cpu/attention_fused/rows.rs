//! The fused heads' passes over a strip row of scores (see the parent module): each makes
//! its values with the general path's arithmetic, operation for operation on 16 lanes by hand,
//! and writes the bf16 pairs a product reads as it goes, in [`pack_a`]'s layout and bits
//! (LLVM left loops that both compute and pack scalar). They must never round or sum
//! otherwise than the general path's passes (a test holds them to those, at both kernels'
//! packed strides).

use std::arch::x86_64::*;

use crate::cpu::gemm_bf16::{lanes, pairs_of};
use crate::cpu::math::{sum, sum_lanes, EXP_LN2, EXP_MAGIC, EXP_POLY, EXP_RANGE, LANES};
use crate::Dropout;

#[cfg(doc)]
use crate::cpu::{attention::softmax_max, gemm_bf16::pack_a};

/// The lanes of keys e.. e + 16 that lie in `a..b`.
#[inline(always)]
fn span(e: usize, a: usize, b: usize) -> __mmask16 {
    lanes(b.saturating_sub(e)) & !lanes(a.saturating_sub(e))
}

/// Which of the 16 elements from `at` dropout keeps ([`Dropout::keep`], one bit a lane).
#[inline(always)]
fn kept(d: &Dropout, at: u64) -> __mmask16 {
    let mut m = 0;
    for l in 0..16 {
        m |= (d.keep(at + l) as u16) << l;
    }
    m
}

/// [`math::exp`](crate::cpu::math::exp) on 16 lanes, operation for operation (no fused
/// multiply-adds, the clamp keeping NaN as `f32::clamp` does): the bits the scalar code gives,
/// as LLVM vectorizes it in the general path's passes.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
pub(super) fn exp16(x: __m512) -> __m512 {
    let c = _mm512_set1_ps;
    let (lo, hi) = (c(EXP_RANGE.0), c(EXP_RANGE.1));
    let x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, lo), x, lo);
    let x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, hi), x, hi);
    let k = _mm512_add_ps(_mm512_mul_ps(x, c(std::f32::consts::LOG2_E)), c(EXP_MAGIC));
    let n = _mm512_sub_ps(k, c(EXP_MAGIC));
    let magic = _mm512_set1_epi32(EXP_MAGIC.to_bits() as i32);
    let ni = _mm512_sub_epi32(_mm512_castps_si512(k), magic);
    let f = _mm512_sub_ps(x, _mm512_mul_ps(n, c(EXP_LN2.0)));
    let f = _mm512_sub_ps(f, _mm512_mul_ps(n, c(EXP_LN2.1)));
    let mut p = c(EXP_POLY[0]);
    for &k in &EXP_POLY[1..] {
        p = _mm512_add_ps(_mm512_mul_ps(p, f), c(k));
    }
    let ef = _mm512_mul_ps(_mm512_mul_ps(p, f), f);
    let ef = _mm512_add_ps(_mm512_add_ps(ef, f), c(1.0));
    let two_n = _mm512_slli_epi32::<23>(_mm512_add_epi32(ni, _mm512_set1_epi32(127)));
    _mm512_mul_ps(ef, _mm512_castsi512_ps(two_n))
}

/// The scaled score of 16 keys as [`softmax_max`] leaves it: `x · scale` where the mask is
/// set (m > 0), -inf where it is not.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
fn scaled(x: __m512, m: __m512, scale: __m512) -> __m512 {
    let set = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(m, _mm512_setzero_ps());
    _mm512_mask_mul_ps(_mm512_set1_ps(f32::NEG_INFINITY), set, x, scale)
}

/// Stores 32 values (`v`: elements 2·p0.. of a row) as pairs p0.. of a row of [`pack_a`]'s
/// layout at `row`, `stride` pairs long: pack_a's conversion and bits, without the f32 row.
///
/// # Safety
/// `row` has `stride` (> p0) writable u32.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
unsafe fn store_pairs((row, stride): (*mut u32, usize), p0: usize, v: [__m512; 2]) {
    // SAFETY: pairs p0.. below stride, the caller's.
    unsafe {
        _mm512_mask_storeu_epi32(
            row.add(p0) as *mut i32,
            lanes(stride - p0),
            pairs_of(v[0], v[1]),
        )
    }
}

/// One strip row for [`softmax_rows`]: its scores (as long as the strip's keys, `mf` too),
/// the query `tq` whose keys `lo..=tq` of its segment are visible, its dropout (the mask and
/// the row's offset in it) and the row of bf16 pairs its probabilities go to.
pub(super) struct SoftRow<'a> {
    pub row: &'a mut [f32],
    pub tq: usize,
    pub lo: usize,
    pub drop: Option<(Dropout, u64)>,
    pub to: (*mut u32, usize),
}

/// The forward's softmax of `N` strip rows: each row gets
/// [`softmax_in`](crate::cpu::attention::softmax_in)'s probabilities, then dropout, but the
/// last pass writes them straight into its `to` as bf16 pairs, without storing P. Returns
/// each row's log-sum-exp.
///
/// The passes: the max of the scaled, masked scores, without writing them back (as
/// [`softmax_max`] finds it: a max is exact, so its lanes need not be `max`'s; NaN scores are
/// skipped, as `f32::max` skips them; only the sign of a zero max could differ, and no result
/// depends on it: x - (±0) and exp of ±0 agree, and the log-sum-exp adds ln(sum) ≥ +0 to it);
/// exp(s - max) · m in place with their sum, in `sum`'s lanes (element i adds to lane i % 16,
/// in order), so with its bits; then 1/sum, dropout and the pairs. A row's arithmetic does
/// not depend on `N`: several rows go through each pass together only so that one row's
/// serial steps (the max across lanes, the sum, ln) overlap another's vector work (row by
/// row, those chains left the core waiting).
///
/// # Safety
/// Each `to`: a row of `to.1` (≥ ⌈keys/2⌉) writable u32.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn softmax_rows<const N: usize>(
    mut rows: [SoftRow; N],
    mf: &[f32],
    scale: f32,
) -> [f32; N] {
    // (keys past tq hold whatever the product left there: only lo..hi is read)
    for r in &rows {
        assert!(r.lo <= r.tq && r.tq < r.row.len() && r.row.len() <= mf.len());
    }
    let n = rows.each_ref().map(|r| r.tq + 1 - r.lo);
    let x = rows
        .each_mut()
        .map(|r| r.row.as_mut_ptr().wrapping_add(r.lo));
    let k = rows.each_ref().map(|r| mf.as_ptr().wrapping_add(r.lo));
    let len = n.iter().copied().max().unwrap_or(0);
    let sc = _mm512_set1_ps(scale);
    // (loops, not closures: a closure would not inherit the target features)
    let mut acc = [_mm512_set1_ps(f32::NEG_INFINITY); N];
    for i in (0..len).step_by(16) {
        for r in 0..N {
            let m = lanes(n[r].saturating_sub(i));
            // SAFETY: the first n - i lanes from i, inside row r's lo..=tq and its mask.
            let (s, mk) = unsafe {
                (
                    _mm512_maskz_loadu_ps(m, x[r].wrapping_add(i)),
                    _mm512_maskz_loadu_ps(m, k[r].wrapping_add(i)),
                )
            };
            // lanes past n: their mask loads 0, so they are -inf. vmaxps returns its second
            // operand when the first is NaN.
            acc[r] = _mm512_max_ps(scaled(s, mk, sc), acc[r]);
        }
    }
    let mx = acc.map(|a| _mm512_reduce_max_ps(a));
    // no key visible: nothing to exponentiate, all zeros
    let live =
        std::array::from_fn::<_, N, _>(|r| if mx[r] == f32::NEG_INFINITY { 0 } else { n[r] });
    let mut sums = [_mm512_setzero_ps(); N];
    for i in (0..len).step_by(16) {
        for r in 0..N {
            let m = lanes(live[r].saturating_sub(i));
            if m == 0 {
                continue;
            }
            let at = x[r].wrapping_add(i);
            // SAFETY: as in the max pass.
            unsafe {
                let mk = _mm512_maskz_loadu_ps(m, k[r].wrapping_add(i));
                let s = scaled(_mm512_maskz_loadu_ps(m, at), mk, sc);
                let e = _mm512_mul_ps(exp16(_mm512_sub_ps(s, _mm512_set1_ps(mx[r]))), mk);
                _mm512_mask_storeu_ps(at, m, e);
                sums[r] = _mm512_mask_add_ps(sums[r], m, sums[r], e);
            }
        }
    }
    let mut out = [0.0; N];
    for r in 0..N {
        let SoftRow {
            tq, lo, drop, to, ..
        } = rows[r];
        let (lse, inv, hi) = if live[r] == 0 {
            (f32::NEG_INFINITY, 0.0, lo)
        } else {
            let mut lanes16 = [0f32; LANES];
            // SAFETY: 16 floats into a 16-float array.
            unsafe { _mm512_storeu_ps(lanes16.as_mut_ptr(), sums[r]) };
            let total = sum_lanes(&lanes16);
            (mx[r] + total.ln(), 1.0 / total, tq + 1)
        };
        out[r] = lse;
        let (inv, ds) = (_mm512_set1_ps(inv), drop.map_or(1.0, |(d, _)| d.scale()));
        let row = rows[r].row.as_ptr();
        for p0 in (0..to.1).step_by(16) {
            let mut v = [_mm512_setzero_ps(); 2];
            for (half, vh) in v.iter_mut().enumerate() {
                let e = 2 * p0 + 16 * half;
                let vis = span(e, lo, hi);
                // SAFETY: the lanes loaded lie in lo..hi ⊂ the row (a load of none reads
                // nothing).
                let y = _mm512_maskz_mul_ps(
                    vis,
                    unsafe { _mm512_maskz_loadu_ps(vis, row.wrapping_add(e)) },
                    inv,
                );
                // Dropout::apply's arithmetic: kept, times the scale; else 0
                *vh = match drop {
                    Some((d, off)) => {
                        _mm512_maskz_mul_ps(kept(&d, off + e as u64), y, _mm512_set1_ps(ds))
                    }
                    None => y,
                };
            }
            // SAFETY: p0 < to.1, the caller's row.
            unsafe { store_pairs(to, p0, v) };
        }
    }
    out
}

/// [`softmax_rows`] of one row.
///
/// # Safety
/// As [`softmax_rows`].
#[cfg(test)]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn softmax_pairs(
    row: &mut [f32],
    mf: &[f32],
    (tq, lo): (usize, usize),
    scale: f32,
    drop: Option<(Dropout, u64)>,
    to: (*mut u32, usize),
) -> f32 {
    let r = SoftRow {
        row,
        tq,
        lo,
        drop,
        to,
    };
    // SAFETY: the caller's.
    unsafe { softmax_rows([r], mf, scale)[0] }
}

/// The backward's first pass over a strip row (query `tq`, keys `lo..=tq` visible, `l` its
/// log-sum-exp and the scale): the probabilities from the scores in `p`, in place (as
/// [`probs_in`](crate::cpu::attention::probs_in)); dP from dPd in `dp` as the forward's dropout
/// used it (`drop`: the mask, the row's offset, and where the dropped probabilities go), zero
/// past tq; the probabilities the forward used as bf16 pairs in `used` when given. Returns
/// Σ dP·P, summed as [`softmax_back_row`](crate::cpu::attention::softmax_back_row) sums it.
///
/// # Safety
/// `used`: a row of `used.1` (≥ ⌈keys/2⌉) writable u32.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn probs_pairs(
    p: &mut [f32],
    dp: &mut [f32],
    mf: &[f32],
    (tq, lo): (usize, usize),
    (lse, scale): (f32, f32),
    mut drop: Option<(Dropout, u64, &mut [f32])>,
    used: Option<(*mut u32, usize)>,
) -> f32 {
    let keys = p.len();
    assert!(
        tq < keys
            && dp.len() == keys
            && mf.len() == keys
            && drop.as_ref().is_none_or(|d| d.2.len() == keys)
    );
    let hi = if lse == f32::NEG_INFINITY { lo } else { tq + 1 };
    let c = _mm512_set1_ps;
    let ds = c(drop.as_ref().map_or(1.0, |(d, ..)| d.scale()));
    // softmax_back_row's lanes: key j adds to lane j % 16, keys in order. Past tq both P and
    // dP are zero, and +0 added to a lane (never -0: it starts at +0) leaves it as it was.
    let mut acc = _mm512_setzero_ps();
    for p0 in (0..used.map_or(keys.div_ceil(2), |u| u.1)).step_by(16) {
        let mut v = [_mm512_setzero_ps(); 2];
        for (half, vh) in v.iter_mut().enumerate() {
            let e = 2 * p0 + 16 * half;
            let (vis, causal, all) = (span(e, lo, hi), span(e, 0, tq + 1), span(e, 0, keys));
            let (pe, dpe) = (
                p.as_mut_ptr().wrapping_add(e),
                dp.as_mut_ptr().wrapping_add(e),
            );
            // SAFETY: every lane loaded or stored lies below `keys` (each mask is inside
            // `all`), in the row slices, whose lengths were checked; none touches nothing.
            unsafe {
                let (x, m) = (
                    _mm512_maskz_loadu_ps(vis, pe),
                    _mm512_maskz_loadu_ps(vis, mf.as_ptr().wrapping_add(e)),
                );
                // probs_row's arithmetic: exp(x · scale - lse) · m, 0 outside lo..=tq (a
                // strip's rows end before its keys do: a block wholly outside is just 0)
                let pj = if vis == 0 {
                    _mm512_setzero_ps()
                } else {
                    let arg = _mm512_sub_ps(_mm512_mul_ps(x, c(scale)), c(lse));
                    _mm512_maskz_mul_ps(vis, exp16(arg), m)
                };
                _mm512_mask_storeu_ps(pe, all, pj);
                let d = _mm512_maskz_loadu_ps(causal, dpe);
                // Dropout::apply's arithmetic on P (all keys) and dP (..=tq)
                let (u, d) = match &mut drop {
                    Some((dr, off, to)) => {
                        let k = kept(dr, *off + e as u64);
                        let u = _mm512_maskz_mul_ps(k, pj, ds);
                        _mm512_mask_storeu_ps(to.as_mut_ptr().wrapping_add(e), all, u);
                        (u, _mm512_maskz_mul_ps(k, d, ds))
                    }
                    None => (pj, d),
                };
                _mm512_mask_storeu_ps(dpe, all, d);
                acc = _mm512_add_ps(acc, _mm512_mul_ps(d, pj));
                *vh = u;
            }
        }
        if let Some(used) = used {
            // SAFETY: p0 < used.1, the caller's row.
            unsafe { store_pairs(used, p0, v) };
        }
    }
    let mut lanes16 = [0f32; LANES];
    // SAFETY: 16 floats into a 16-float array.
    unsafe { _mm512_storeu_ps(lanes16.as_mut_ptr(), acc) };
    sum(&lanes16)
}

/// dS = P · (dP - Σ dP·P) · scale over keys ..=tq of a strip row, zero past tq (as
/// [`softmax_back_row`](crate::cpu::attention::softmax_back_row) leaves it), written over `dp`
/// (the transposed pack reads it) and as bf16 pairs in `to`.
///
/// # Safety
/// `to`: a row of `to.1` (≥ ⌈keys/2⌉) writable u32.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn grad_pairs(
    p: &[f32],
    dp: &mut [f32],
    tq: usize,
    dsum: f32,
    scale: f32,
    to: (*mut u32, usize),
) {
    let keys = p.len();
    assert!(dp.len() == keys && tq < keys);
    let (dsum, scale) = (_mm512_set1_ps(dsum), _mm512_set1_ps(scale));
    for p0 in (0..to.1).step_by(16) {
        let mut v = [_mm512_setzero_ps(); 2];
        for (half, vh) in v.iter_mut().enumerate() {
            let e = 2 * p0 + 16 * half;
            let (causal, all) = (span(e, 0, tq + 1), span(e, 0, keys));
            let at = dp.as_mut_ptr().wrapping_add(e);
            // SAFETY: lanes below tq + 1 ≤ keys, and below keys, of the checked slices.
            unsafe {
                let pj = _mm512_maskz_loadu_ps(causal, p.as_ptr().wrapping_add(e));
                let d = _mm512_maskz_loadu_ps(causal, at);
                let ds = _mm512_mul_ps(pj, _mm512_sub_ps(d, dsum));
                let ds = _mm512_maskz_mul_ps(causal, ds, scale);
                _mm512_mask_storeu_ps(at, all, ds);
                *vh = ds;
            }
        }
        // SAFETY: p0 < to.1, the caller's row.
        unsafe { store_pairs(to, p0, v) };
    }
}

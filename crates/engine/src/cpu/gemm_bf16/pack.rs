//! Packing for the bf16 product: f32 (or bf16) operands converted to bf16 pairs along K in the
//! layouts the kernels read (A as `[row][pair]`, B as micro-panels of `[pair][NR]`), with the
//! prefetches that keep the conversion fed. It must never compute a product: the kernels in the
//! parent module do; this file only lays operands out for them. Split from `gemm_bf16.rs` so the
//! loops and kernels read on their own; the packs are unchanged, bit for bit.

use std::arch::x86_64::*;

use super::NR;
use crate::cpu::bf16::{bf16_bits, bf16_to_f32};
use crate::cpu::gemm::{prefetch_line, prefetch_run, transpose16};

/// Mask of the first `n` lanes (all 16 from n = 16 on).
#[inline(always)]
pub(crate) fn lanes(n: usize) -> __mmask16 {
    if n >= 16 {
        0xffff
    } else {
        ((1u32 << n) - 1) as u16
    }
}

/// Rows of A between a row-major pack's loads and its prefetches. A comes from beyond the
/// caches (an activation of megabytes) and the hardware prefetchers stop at the end of each
/// row's run of a K block (1-2 KB), so each line loaded asks for the same line this many rows
/// further down. Asking for a whole row three rows ahead at once instead (on AMD Zen 5, config
/// B's fc projection 380 -> 426-453 GFLOP/s against none) left config G's A, cold, at 17 GB/s
/// of f32 read; a line per line, 3-6 rows ahead alike: 38 (21 -> 28 where K is split, a row's
/// run 2 KB of a 12 KB row). One thread, Zen 5, `examples/pack_rates.rs`, a busy machine.
const PREFETCH_ROWS: usize = 6;

/// Rows of a bf16 A between a row-major pack's loads and its prefetch of a whole row's run.
const PREFETCH_ROWS_BF16: usize = 3;

/// Pairs of B's rows between the row-major pack's loads and its prefetches: 1 pair was too
/// close (20-25 GB/s where 4 gave 25-30), 3-6 alike; bands of 2-8 pairs per sweep of the
/// columns (fewer panels written per row read) were slower (16-23).
const PREFETCH_PAIRS: usize = 4;

/// Two rows of 16 f32 (`x` the even K index, `y` the odd) as 16 bf16 pairs, `x` in the low half.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
pub(super) fn pair_up(x: __m512, y: __m512) -> __m512i {
    // One conversion of both rows (x's 16 bf16 then y's), then one permute of 16-bit words
    // into pairs: word 2j takes x's j, word 2j + 1 y's (word 16 + j). The same rounding as two
    // single conversions, in two instructions instead of six.
    // Word 2j of `INTERLEAVE` is j, word 2j + 1 is 16 + j (two words per u32, low first).
    const INTERLEAVE: [u32; 16] = {
        let mut w = [0; 16];
        let mut j = 0;
        while j < 16 {
            w[j] = j as u32 | ((16 + j as u32) << 16);
            j += 1;
        }
        w
    };
    // SAFETY: __m512bh and __m512i are both 512-bit vectors; transmute reinterprets the bits.
    // The unaligned load reads the 64 bytes of the constant.
    unsafe {
        let both = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(y, x));
        let idx = _mm512_loadu_si512(INTERLEAVE.as_ptr() as *const __m512i);
        _mm512_permutexvar_epi16(idx, both)
    }
}

/// 32 consecutive f32 along K as 16 bf16 pairs (`n` of the 32 are read, the rest are zero).
///
/// # Safety
/// `src` must have `n` (≤ 32) readable floats.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
unsafe fn pairs_along(src: *const f32, n: usize) -> __m512i {
    // SAFETY: masked loads read only the first n floats, which the caller guarantees.
    unsafe {
        let lo = _mm512_maskz_loadu_ps(lanes(n), src);
        let hi = _mm512_maskz_loadu_ps(lanes(n.saturating_sub(16)), src.add(16.min(n)));
        pairs_of(lo, hi)
    }
}

/// 32 consecutive f32 along K, `lo` the first 16 and `hi` the next, as 16 bf16 pairs (rounded
/// to nearest even): the conversion of every f32 pack here, and of attention's fused passes
/// that make a row's values and pack them in one go.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
pub(crate) fn pairs_of(lo: __m512, hi: __m512) -> __m512i {
    // SAFETY: __m512bh and __m512i are both 512-bit vectors; transmute reinterprets the bits.
    unsafe { std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo)) }
}

/// Packs a (mc, kc) block of A at strides (rs, cs) as `[row][pair]`, rows `stride` u32 apart
/// (at least ⌈kc/2⌉; the pairs past kc are zero).
///
/// # Safety
/// `a` must have mc x kc readable floats at these strides; `pa` mc x stride writable u32.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(crate) unsafe fn pack_a(
    pa: *mut u32,
    a: *const f32,
    rs: usize,
    cs: usize,
    mc: usize,
    kc: usize,
    stride: usize,
) {
    let kcp = kc.div_ceil(2);
    // SAFETY: for the whole body, reads stay inside the caller's block (row < mc, column < kc, via
    // masks at the edges); writes inside pa's mc x kcp.
    unsafe {
        if cs == 1 {
            for i in 0..mc {
                let (src, dst) = (a.add(i * rs), pa.add(i * stride));
                for p0 in (0..stride).step_by(16) {
                    // Rows past the block are the next block's, or nothing: a prefetch never
                    // faults.
                    for e in [2 * p0, 2 * p0 + 16] {
                        prefetch_line(src.wrapping_add(PREFETCH_ROWS * rs + e));
                    }
                    // Past kc the loads read nothing and the pairs are zero.
                    let v = pairs_along(src.add(2 * p0), kc.saturating_sub(2 * p0).min(32));
                    _mm512_mask_storeu_epi32(dst.add(p0) as *mut i32, lanes(stride - p0), v);
                }
            }
        } else if rs == 1 {
            // Rows are contiguous down each column: pair up two K rows of 16 A rows, then
            // transpose so each A row's pairs are contiguous. K goes outermost: 32 K rows are
            // read across the whole block before the next 32 (going down all of K for 16
            // columns at a time touched a new page with every row, and a weight gradient's A
            // has thousands).
            // While one band of 32 K rows is converted, the next band's lines at the same
            // columns are asked for: a band's sweep across the block hides their latency.
            let mut r = [_mm512_setzero_si512(); 16];
            for p0 in (0..stride).step_by(16) {
                let pairs = kcp.saturating_sub(p0).min(16);
                let next = kc.saturating_sub(2 * (p0 + 16)).min(32);
                for i0 in (0..mc).step_by(16) {
                    let rows = (mc - i0).min(16);
                    for e in 2 * (p0 + 16)..2 * (p0 + 16) + next {
                        prefetch_run(a.wrapping_add(e * cs + i0) as *const u8, 4 * rows);
                    }
                    for (q, v) in r.iter_mut().enumerate() {
                        let e = 2 * (p0 + q);
                        *v = if q < pairs {
                            let x = _mm512_maskz_loadu_ps(lanes(rows), a.add(e * cs + i0));
                            let y = if e + 1 < kc {
                                _mm512_maskz_loadu_ps(lanes(rows), a.add((e + 1) * cs + i0))
                            } else {
                                _mm512_setzero_ps()
                            };
                            pair_up(x, y)
                        } else {
                            _mm512_setzero_si512()
                        };
                    }
                    transpose16(&mut r);
                    for (i, v) in r.iter().enumerate().take(rows) {
                        let dst = pa.add((i0 + i) * stride + p0) as *mut i32;
                        _mm512_mask_storeu_epi32(dst, lanes(stride - p0), *v);
                    }
                }
            }
        } else {
            for i in 0..mc {
                for p in 0..stride {
                    let at = |e: usize| {
                        if e < kc {
                            bf16_bits(*a.add(i * rs + e * cs)) as u32
                        } else {
                            0
                        }
                    };
                    *pa.add(i * stride + p) = at(2 * p) | (at(2 * p + 1) << 16);
                }
            }
        }
    }
}

/// [`pack_a`] of an operand already in bf16: the pairs are copied, not converted.
///
/// # Safety
/// As [`pack_a`], `a` holding mc x kc readable bf16 at these strides.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(crate) unsafe fn pack_a_bf16(
    pa: *mut u32,
    a: *const u16,
    rs: usize,
    cs: usize,
    mc: usize,
    kc: usize,
    stride: usize,
) {
    let kcp = kc.div_ceil(2);
    // Mask of the first `n` (≤ 32) u16 lanes.
    let halves = |n: usize| -> __mmask32 {
        if n >= 32 {
            u32::MAX
        } else {
            (1u32 << n) - 1
        }
    };
    // SAFETY: for the whole body, reads stay inside the caller's block (row < mc, column < kc, via
    // masks at the edges); writes inside pa's mc x stride.
    unsafe {
        if cs == 1 {
            // A row's K run is already its pairs, low half first.
            for i in 0..mc {
                let (src, dst) = (a.add(i * rs), pa.add(i * stride));
                // A whole row's run a few rows ahead at once: in bf16 a K block's run is half
                // pack_a's (16 lines at K = 512), few enough for the miss buffers. pack_a's
                // line per line, 6 rows ahead, was slower here: config G's fc output, cold,
                // 28-31 -> 23-26 GB/s of bf16 read (one thread, Zen 5, `pack_rates`).
                if i + PREFETCH_ROWS_BF16 < mc {
                    prefetch_run(
                        a.wrapping_add((i + PREFETCH_ROWS_BF16) * rs) as *const u8,
                        2 * kc,
                    );
                }
                for p0 in (0..stride).step_by(16) {
                    let n = kc.saturating_sub(2 * p0).min(32);
                    let v = _mm512_maskz_loadu_epi16(halves(n), src.add(2 * p0) as *const i16);
                    _mm512_mask_storeu_epi32(dst.add(p0) as *mut i32, lanes(stride - p0), v);
                }
            }
        } else if rs == 1 {
            // As pack_a's transposed case: two K rows of 16 A rows become 16 pairs, and a
            // register transpose makes each A row's pairs contiguous.
            let mut r = [_mm512_setzero_si512(); 16];
            for p0 in (0..stride).step_by(16) {
                let pairs = kcp.saturating_sub(p0).min(16);
                let next = kc.saturating_sub(2 * (p0 + 16)).min(32);
                for i0 in (0..mc).step_by(16) {
                    let rows = (mc - i0).min(16);
                    for e in 2 * (p0 + 16)..2 * (p0 + 16) + next {
                        prefetch_run(a.wrapping_add(e * cs + i0) as *const u8, 2 * rows);
                    }
                    let load = |e: usize| {
                        let v = _mm512_maskz_loadu_epi16(
                            halves(rows),
                            a.add(e * cs + i0) as *const i16,
                        );
                        _mm512_cvtepu16_epi32(_mm512_castsi512_si256(v))
                    };
                    for (q, v) in r.iter_mut().enumerate() {
                        let e = 2 * (p0 + q);
                        *v = if q < pairs {
                            let lo = load(e);
                            let hi = if e + 1 < kc {
                                load(e + 1)
                            } else {
                                _mm512_setzero_si512()
                            };
                            _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi))
                        } else {
                            _mm512_setzero_si512()
                        };
                    }
                    transpose16(&mut r);
                    for (i, v) in r.iter().enumerate().take(rows) {
                        let dst = pa.add((i0 + i) * stride + p0) as *mut i32;
                        _mm512_mask_storeu_epi32(dst, lanes(stride - p0), *v);
                    }
                }
            }
        } else {
            for i in 0..mc {
                for p in 0..stride {
                    let at = |e: usize| {
                        if e < kc {
                            *a.add(i * rs + e * cs) as u32
                        } else {
                            0
                        }
                    };
                    *pa.add(i * stride + p) = at(2 * p) | (at(2 * p + 1) << 16);
                }
            }
        }
    }
}

/// Packs a (kc, nc) block of B at strides (rs, cs) as micro-panels of `stride` pairs (at least
/// ⌈kc/2⌉) x NR columns, zero past kc and nc. With `sums` (nc floats), also adds the block's kc
/// rows to it, in order: see [`bgemm`]'s `b_sums`.
///
/// # Safety
/// `b` must have kc x nc readable floats at these strides; `pb` ⌈nc/NR⌉ x NR x stride writable
/// u32, 64-byte aligned; `sums`, if any, nc writable floats not overlapping the others.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn pack_b(
    pb: *mut u32,
    b: *const f32,
    rs: usize,
    cs: usize,
    kc: usize,
    nc: usize,
    stride: usize,
    sums: Option<*mut f32>,
) {
    // SAFETY: the caller's contract, with B's columns in order.
    unsafe { pack_b_cols(pb, b, rs, cs, kc, nc, stride, sums, None) }
}

/// [`pack_b`] of an operand already in bf16 (its bits): the same panels as [`pack_b`] makes of
/// the f32 values these bits round from, their pairs moved, never rounded again.
///
/// # Safety
/// As [`pack_b`], `b` holding kc x nc readable bf16 at these strides.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn pack_b_bf16(
    pb: *mut u32,
    b: *const u16,
    rs: usize,
    cs: usize,
    kc: usize,
    nc: usize,
    stride: usize,
) {
    // SAFETY: the caller's contract, with B's columns in order.
    unsafe { pack_b_cols(pb, b, rs, cs, kc, nc, stride, None, None) }
}

/// An element type B's pack reads: f32 (rounded to bf16 as it is packed) or bf16 bits (moved
/// as they are). What [`pack_b_cols`] needs of it, so that one loop nest packs both and the
/// panels of the same bf16 values are the same bits. Never a layout decision: that is the
/// loop's.
pub(crate) trait PackElem: Copy {
    /// 16 consecutive elements from `p` (lanes past `m` zero) as f32: exact for bf16.
    ///
    /// # Safety
    /// The lanes of `m` readable from `p`; AVX-512 (F, BW) and AVX512_BF16 present.
    unsafe fn load16(p: *const Self, m: __mmask16) -> __m512;
    /// Two K rows of 16 values [`PackElem::load16`] gave (`x` the even K index) as 16 pairs.
    ///
    /// # Safety
    /// AVX-512 (F, BW) and AVX512_BF16 present.
    unsafe fn pairs(x: __m512, y: __m512) -> __m512i;
    /// Up to 32 consecutive elements along K from `src` (`n` read, the rest zero) as 16 pairs.
    ///
    /// # Safety
    /// `n` (≤ 32) elements readable from `src`; AVX-512 (F, BW) and AVX512_BF16 present.
    unsafe fn pairs_along(src: *const Self, n: usize) -> __m512i;
    /// The bf16 bits of one element (the scalar fallback's).
    ///
    /// # Safety
    /// `p` readable.
    unsafe fn bits(p: *const Self) -> u32;
    /// One element's value (B's column sums add it, unrounded).
    ///
    /// # Safety
    /// `p` readable.
    unsafe fn value(p: *const Self) -> f32;
}

impl PackElem for f32 {
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn load16(p: *const f32, m: __mmask16) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe { _mm512_maskz_loadu_ps(m, p) }
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn pairs(x: __m512, y: __m512) -> __m512i {
        pair_up(x, y)
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn pairs_along(src: *const f32, n: usize) -> __m512i {
        // SAFETY: the caller's contract.
        unsafe { pairs_along(src, n) }
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn bits(p: *const f32) -> u32 {
        // SAFETY: the caller's contract.
        bf16_bits(unsafe { *p }) as u32
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn value(p: *const f32) -> f32 {
        // SAFETY: the caller's contract.
        unsafe { *p }
    }
}

impl PackElem for u16 {
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn load16(p: *const u16, m: __mmask16) -> __m512 {
        // SAFETY: the caller's contract: the masked load reads the lanes of m only. A bf16's
        // bits shifted into the top half are its f32 value, exactly.
        unsafe {
            let v = _mm256_maskz_loadu_epi16(m, p as *const i16);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v)))
        }
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn pairs(x: __m512, y: __m512) -> __m512i {
        // x's bits (a bf16 in the top half) to the low half, y's kept in the top: the pair
        // as the bits were, no rounding (VCVTNE2PS2BF16 would flush a subnormal bf16).
        let (x, y) = (_mm512_castps_si512(x), _mm512_castps_si512(y));
        let hi = _mm512_set1_epi32(0xffff_0000u32 as i32);
        _mm512_or_si512(_mm512_srli_epi32::<16>(x), _mm512_and_si512(y, hi))
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn pairs_along(src: *const u16, n: usize) -> __m512i {
        // Consecutive bf16 along K are their pairs already, low half first.
        let m = if n >= 32 { u32::MAX } else { (1u32 << n) - 1 };
        // SAFETY: the masked load reads the first n elements only, per the caller.
        unsafe { _mm512_maskz_loadu_epi16(m, src as *const i16) }
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn bits(p: *const u16) -> u32 {
        // SAFETY: the caller's contract.
        unsafe { *p as u32 }
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn value(p: *const u16) -> f32 {
        // SAFETY: the caller's contract.
        unsafe { bf16_to_f32(*p) }
    }
}

/// [`pack_b`] of a row-major B whose block columns are read in SwiGLU's interleaved order
/// (see `Epilogue::b_halves`): column 32·t + j of the block is B's column 16·t + j for j < 16,
/// else 16·t + j - 16 + `half`, `b` pointing at the block's first gate column.
///
/// # Safety
/// As [`pack_b`] with cs = 1, nc a multiple of 32, and the block's nc / 2 gate columns (and the
/// same columns `half` further) readable in each of kc rows.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(crate) unsafe fn pack_b_halves(
    pb: *mut u32,
    b: *const f32,
    rs: usize,
    kc: usize,
    nc: usize,
    stride: usize,
    half: usize,
) {
    debug_assert!(nc.is_multiple_of(2 * 16));
    // SAFETY: the caller's contract.
    unsafe { pack_b_cols(pb, b, rs, 1, kc, nc, stride, None, Some(half)) }
}

/// [`pack_b`], or [`pack_b_halves`] with `half`, or [`pack_b_bf16`] (E = u16): one loop nest
/// for every source, so that the same bf16 values give the same panels.
///
/// # Safety
/// As those.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn pack_b_cols<E: PackElem>(
    pb: *mut u32,
    b: *const E,
    rs: usize,
    cs: usize,
    kc: usize,
    nc: usize,
    stride: usize,
    sums: Option<*mut f32>,
    half: Option<usize>,
) {
    // Where the block's 16 columns from j0 (a multiple of 16) start in B's row: j0 itself, or
    // in the interleaved order 16 per 32 columns plus `half` for the second 16; one formula
    // for both, so the loop below has no branch.
    let (per_32, second_16) = match half {
        None => (32, 16),
        Some(h) => (16, h),
    };
    let col = |j0: usize| (j0 / 32) * per_32 + ((j0 / 16) % 2) * second_16;
    let kcp = kc.div_ceil(2);
    // Column j0 lives in panel j0 / NR, at lane offset j0 % NR.
    let panel_of = |j0: usize| pb.wrapping_add((j0 / NR) * NR * stride + j0 % NR);
    // SAFETY: for the whole body, reads stay inside the caller's block (masked at the edges); writes
    // inside pb's panels.
    unsafe {
        if cs == 1 {
            // Row-major B: each pair of K rows is read along its whole width, two contiguous
            // streams the prefetchers follow. Going down 16 columns at a time instead reads 64
            // bytes from every row in turn, rows kilobytes apart, and on a weight gradient's B
            // (thousands of rows) each of those loads waited on memory.
            // Each 16 columns converted ask for the same columns PREFETCH_PAIRS pairs of rows
            // further down: one prefetch per line loaded, spread evenly. Asking for the next
            // pair's whole rows at once (256 lines at NC = 2048, far more than the miss
            // buffers hold) left the loads waiting on memory: config G's row-major Bs, cold,
            // 9-10 -> 19-30 GB/s of f32 read (one thread, Zen 5, `examples/pack_rates.rs`, a
            // busy machine). Hints to L2 or L3 instead (T1, T2) were no faster; asking for the
            // packed lines before writing them (PREFETCHW) and huge pages for the packed block
            // changed nothing measurable.
            // Rows past the block are asked for too: the next K block's, or nothing (a
            // prefetch never faults).
            let ahead = 2 * PREFETCH_PAIRS * rs;
            for p in 0..kcp {
                let (x_row, y_row) = (b.add(2 * p * rs), b.wrapping_add((2 * p + 1) * rs));
                let odd = 2 * p + 1 < kc;
                for j0 in (0..nc).step_by(16) {
                    let cols = lanes(nc - j0);
                    for row in [x_row, y_row] {
                        prefetch_line(row.wrapping_add(ahead + col(j0)) as *const f32);
                    }
                    let x = E::load16(x_row.add(col(j0)), cols);
                    let y = if odd {
                        E::load16(y_row.add(col(j0)), cols)
                    } else {
                        _mm512_setzero_ps()
                    };
                    let dst = panel_of(j0).add(p * NR) as *mut __m512i;
                    _mm512_store_si512(dst, E::pairs(x, y));
                    if let Some(s) = sums {
                        // row 2p, then row 2p + 1 (if the block has it): the rows in order
                        let mut acc = _mm512_add_ps(_mm512_maskz_loadu_ps(cols, s.add(j0)), x);
                        if odd {
                            acc = _mm512_add_ps(acc, y);
                        }
                        _mm512_mask_storeu_ps(s.add(j0), cols, acc);
                    }
                }
            }
        } else if let Some(s) = sums {
            // Only row-major Bs (a weight gradient's output gradient) are summed in practice.
            for r in 0..kc {
                for j in 0..nc {
                    *s.add(j) += E::value(b.add(r * rs + j * cs));
                }
            }
        }
        for j0 in (0..nc).step_by(16) {
            let cols = (nc - j0).min(16);
            let panel = panel_of(j0);
            // Zero pairs past kc (AMX's padding).
            for p in kcp..stride {
                _mm512_store_si512(panel.add(p * NR) as *mut __m512i, _mm512_setzero_si512());
            }
            if cs == 1 {
                continue; // packed above
            }
            if rs == 1 {
                // Each column is contiguous along K: pairs come straight from it, then a
                // transpose puts 16 columns side by side.
                // While 16 columns are converted, the next 16 columns' same lines are asked
                // for, a line per line loaded: config G's input gradients' W^T and its head's
                // wte^T, cold, 14-16 -> 23-26 GB/s of f32 read (one thread, Zen 5,
                // `examples/pack_rates.rs`); the same column's lines two loads ahead: 18-19.
                // (Its fc W^T gains least, 16 -> 23: columns 12 KB apart share an L1 set.)
                let mut r = [_mm512_setzero_si512(); 16];
                for p0 in (0..kcp).step_by(16) {
                    let pairs = (kcp - p0).min(16);
                    for q in 0..16 {
                        for e in [2 * p0, 2 * p0 + 16] {
                            prefetch_line(b.wrapping_add((j0 + 16 + q) * cs + e) as *const f32);
                        }
                    }
                    for (q, v) in r.iter_mut().enumerate() {
                        *v = if q < cols {
                            E::pairs_along(b.add((j0 + q) * cs + 2 * p0), (kc - 2 * p0).min(32))
                        } else {
                            _mm512_setzero_si512()
                        };
                    }
                    transpose16(&mut r);
                    for (p, v) in r.iter().enumerate().take(pairs) {
                        _mm512_store_si512(panel.add((p0 + p) * NR) as *mut __m512i, *v);
                    }
                }
            } else {
                for p in 0..kcp {
                    for q in 0..16 {
                        let v = if q < cols {
                            let x = E::bits(b.add(2 * p * rs + (j0 + q) * cs));
                            let y = if 2 * p + 1 < kc {
                                E::bits(b.add((2 * p + 1) * rs + (j0 + q) * cs))
                            } else {
                                0
                            };
                            x | (y << 16)
                        } else {
                            0
                        };
                        *panel.add(p * NR + q) = v;
                    }
                }
            }
        }
        // A last panel narrower than NR: zero its missing half so the kernel adds nothing.
        if !nc.is_multiple_of(NR) && nc % NR <= 16 {
            let panel = pb.add((nc / NR) * NR * stride + 16);
            for p in 0..stride {
                _mm512_store_si512(panel.add(p * NR) as *mut __m512i, _mm512_setzero_si512());
            }
        }
    }
}

//! The AVX-512 sgemm behind the matmul kernels: a 12 x 32 register tile (24 accumulators) over
//! B panels packed on the stack, blocked for L2 (K whole up to 1024, else KC rows of B per
//! panel, for L1) and MC rows of A.
//!
//! Written for this model's shapes (K of 128 to 2048, N of 65 to 1536), where
//! `matrixmultiply`'s 16 x 16 tile reached 60-80% of the core's FMA peak and this one 85-100%
//! (config A: 768x128x384 in 346 µs against 489 µs). A is never packed: its elements are
//! broadcast straight from memory, so a transposed A costs nothing. Each output element is
//! summed over K in the same order whatever part of C a call covers, so splitting C over
//! threads never changes the result. It never allocates and never reads C unless asked to
//! accumulate.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::epilogue::Epilogue;

/// Columns of the register tile (two zmm registers), and the width of a packed panel.
pub(crate) const NR: usize = 32;
/// Rows of the register tile.
const MR: usize = 12;
/// Rows of B per packed panel where K is split: KC x NR floats = 32 KB, which stays in L1.
const KC: usize = 256;
/// Up to this K, a product takes K whole in one block (a panel of up to 128 KB, read from L2)
/// rather than in blocks of KC: each element of C is then written once instead of read and
/// written again per block, which on the block products of config G (K of 768 and 1024, C of
/// up to 12 MB) and its LM head's forward (C of 206 MB) cost more than the panel's L2 reads.
/// Config G's twelve block products, one thread, Zen 5: 69-75% of the FMA peak -> 77-82%;
/// the head's forward 182-188 -> 224-235 GFLOP/s. Fixed per K, so a thread's share of C
/// never changes any sum.
const KC_WHOLE: usize = 1024;

/// Rows of B per K block of a product over `k`.
pub(crate) fn kc_for(k: usize) -> usize {
    if k <= KC_WHOLE {
        k
    } else {
        KC
    }
}
/// Rows of A per L2 block (a multiple of MR).
pub(crate) const MC: usize = 240;
/// Rows of A up to which a transposed B is packed once for all of them (1 MB of A per K block).
const MC_TRANSPOSED_B: usize = 1024;

/// A strided operand: element (r, c) at `ptr[r * rs + c * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct Strided {
    pub(crate) ptr: *const f32,
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

/// `c (m, n) = a (m, k) · b (k, n) + bias (n)` or, with `accumulate`, `c += a · b` (bias unused).
/// `c` is row-major with row stride `rsc`. `ep` finishes each block of c once its sums are
/// final.
///
/// # Safety
/// The CPU must support AVX-512F; the operands must describe valid matrices of these sizes;
/// `c` must be writable and not overlap `a`, `b` or `bias`; `ep`'s operand must hold an
/// (m, n) matrix.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: Strided,
    b: Strided,
    c: *mut f32,
    rsc: usize,
    accumulate: bool,
    bias: Option<*const f32>,
    ep: Epilogue,
) {
    #[repr(align(64))]
    struct Panel([f32; KC_WHOLE * NR]);
    // Uninitialised: pack_panel writes every float a kernel reads (a memset would cost as much
    // as the product for attention's small blocks).
    let mut panel = std::mem::MaybeUninit::<Panel>::uninit();
    // safety: a place projection on the uninitialised panel; nothing is read.
    let pp = unsafe { std::ptr::addr_of_mut!((*panel.as_mut_ptr()).0) } as *mut f32;
    if k == 0 {
        // Nothing to sum: c = bias (or 0), or unchanged.
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    // safety: inside c and bias per the contract.
                    unsafe { *c.add(i * rsc + j) = bias.map_or(0.0, |b| *b.add(j)) };
                }
            }
        }
        // SAFETY: the whole of c, per the contract.
        unsafe { ep.apply(c, rsc, m, n) };
        return;
    }
    let mc_max = strip_rows(m, b);
    let kc_max = kc_for(k);
    for k0 in (0..k).step_by(kc_max) {
        let kc = kc_max.min(k - k0);
        let (acc, bias) = first_block(k0, accumulate, bias);
        let panels = Panels::Pack { pp, b, ep };
        let ep = (k0 + kc == k).then_some(ep);
        // SAFETY: rows 0..m, columns 0..n of c, K block k0..k0 + kc, per the contract.
        unsafe {
            strips(
                (0, m),
                mc_max,
                (k0, kc),
                a,
                panels,
                c,
                rsc,
                (0, n),
                acc,
                bias,
                ep,
            )
        };
    }
}

/// Rows of A per strip of [`sgemm`] over `m` rows against `b`: its B panels are packed again
/// for each strip.
pub(crate) fn strip_rows(m: usize, b: Strided) -> usize {
    // A transposed B packs element by element, which costs as much as a tenth of the product
    // when repeated per L2 block of A: pack it once per panel where A's K block fits in L2.
    if b.cs != 1 && m <= MC_TRANSPOSED_B {
        m
    } else {
        MC
    }
}

/// How the first K block of a product at `k0` starts C: from the bias (or zero) unless
/// accumulating (acc false); later blocks add to it.
pub(crate) fn first_block(
    k0: usize,
    accumulate: bool,
    bias: Option<*const f32>,
) -> (bool, Option<*const f32>) {
    if k0 == 0 && !accumulate {
        (false, bias)
    } else {
        (true, None)
    }
}

/// Where [`strips`] gets a K block's panels of B.
#[derive(Clone, Copy)]
pub(crate) enum Panels {
    /// Packed here into `pp` (one panel of the K block), for each strip of rows again, from
    /// `b` (in SwiGLU's interleaved order where `ep` says so).
    Pack {
        pp: *mut f32,
        b: Strided,
        ep: Epilogue,
    },
    /// Packed already: the panel of columns from j at `ptr + (j - first) / NR · step`.
    Packed {
        ptr: *const f32,
        step: usize,
        first: usize,
    },
}

/// C's rows `i0..i1`, columns `j0..j1` (j0 a multiple of NR), over A's K block `k0..k0 + kc`:
/// strips of `mc` rows, each against every panel of B's block from `panels`, then (with
/// `ep`, after the last K block) the epilogue on the strip's rows while they are in L2. The
/// loops of [`sgemm`], [`sgemm_prepacked`] and the products whose B all threads share
/// (`gemm_bf16::shared`), which differ only in where the panels come from.
///
/// # Safety
/// The CPU must support AVX-512F; `a` must describe a readable matrix with those rows and K;
/// the panels as [`Panels`] says (B's block inside B, or packed kc x NR floats, 64-byte
/// aligned); `c` a writable matrix of row stride `rsc` with those rows and columns, not
/// overlapping the others; `bias`, if any, readable at those columns; `ep`'s operand as C.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn strips(
    (i0, i1): (usize, usize),
    mc: usize,
    (k0, kc): (usize, usize),
    a: Strided,
    panels: Panels,
    c: *mut f32,
    rsc: usize,
    (j0, j1): (usize, usize),
    acc: bool,
    bias: Option<*const f32>,
    ep: Option<Epilogue>,
) {
    for i in (i0..i1).step_by(mc) {
        let mc = mc.min(i1 - i);
        for j in (j0..j1).step_by(NR) {
            let nr = NR.min(j1 - j);
            let pp = match panels {
                Panels::Pack { pp, b, ep } => {
                    // SAFETY: the panel covers rows k0..k0+kc and columns j..j+nr of b.
                    unsafe { pack_panel_of(pp, b, ep, (k0, kc), j, nr) };
                    pp as *const f32
                }
                Panels::Packed { ptr, step, first } => ptr.wrapping_add((j - first) / NR * step),
            };
            // safety: rows i..i+mc, columns j..j+nr of c are inside it; pp holds the panel.
            unsafe { panel_tiles(i, mc, k0, kc, a, pp, c, rsc, j, nr, acc, bias) };
        }
        if let Some(ep) = ep {
            // The strip's rows are final and in L2; the epilogue reads and writes whole
            // rows (see the epilogue module on why not block by block).
            // SAFETY: rows i..i+mc, columns j0..j1 of c and of ep's operand.
            unsafe { ep.at(i, j0).apply(c.add(i * rsc + j0), rsc, mc, j1 - j0) };
        }
    }
}

/// Packs B's rows `k0..k0 + kc`, columns `j..j + nr` (nr ≤ NR) into the panel `pp`: read in
/// SwiGLU's interleaved order where `ep` says so (gate column j / 2 on; see
/// `Epilogue::b_halves`).
///
/// # Safety
/// As [`pack_panel`], for that block of `b`.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn pack_panel_of(
    pp: *mut f32,
    b: Strided,
    ep: Epilogue,
    (k0, kc): (usize, usize),
    j: usize,
    nr: usize,
) {
    // SAFETY: per the contract.
    unsafe {
        match ep.b_halves() {
            Some(half) => pack_panel_halves(pp, b.ptr.add(k0 * b.rs + j / 2), b.rs, half, kc),
            None => pack_panel(pp, b.ptr.add(k0 * b.rs + j * b.cs), b.rs, b.cs, kc, nr),
        }
    }
}

/// `c (m, n) = a (m, k) · b (k, n) + bias (n)` for columns `j0..j1` of c only, with b packed
/// beforehand ([`PackedMatrix`](super::PackedMatrix)): panel p (columns p·NR..p·NR+NR) is k
/// rows of NR floats at `b + p·k·NR`, zeros past n. Nothing is packed here, so a product
/// with a constant b reads each weight once, straight from its panel. With `vector` (the
/// caller's whole product is one row, m = 1) it runs the vector kernel [`gemv_panel`], whose
/// sums are in another order; otherwise each output element is summed in the same order
/// whichever rows and columns of c a call covers.
///
/// # Safety
/// The CPU must support AVX-512F; `a` must describe a readable (m, k) matrix; `b` a packed
/// matrix of k rows and at least j1 columns, 64-byte aligned; `j0` a multiple of NR; `c` a
/// writable (m, j1) matrix of row stride `rsc`, not overlapping `a`, `b` or `bias`; `bias`, if
/// any, j1 readable floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sgemm_prepacked(
    m: usize,
    k: usize,
    a: Strided,
    b: *const f32,
    j0: usize,
    j1: usize,
    c: *mut f32,
    rsc: usize,
    bias: Option<*const f32>,
    vector: bool,
) {
    if k == 0 {
        for i in 0..m {
            for j in j0..j1 {
                // safety: inside c and bias per the contract.
                unsafe { *c.add(i * rsc + j) = bias.map_or(0.0, |b| *b.add(j)) };
            }
        }
        return;
    }
    if vector && m == 1 {
        for j in (j0..j1).step_by(NR) {
            // safety: panel j / NR holds k rows of NR floats; c and bias have columns j..j1.
            unsafe {
                gemv_panel(
                    k,
                    a.ptr,
                    a.cs,
                    b.add(j / NR * k * NR),
                    c.add(j),
                    NR.min(j1 - j),
                    bias.map(|b| b.add(j)),
                )
            };
        }
        return;
    }
    let kc_max = kc_for(k);
    for k0 in (0..k).step_by(kc_max) {
        let kc = kc_max.min(k - k0);
        let (acc, bias) = first_block(k0, false, bias);
        // Rows k0..k0+kc of panel j / NR.
        let panels = Panels::Packed {
            ptr: b.wrapping_add(k0 * NR),
            step: k * NR,
            first: 0,
        };
        // safety: rows 0..m, columns j0..j1 of c, per the contract.
        unsafe {
            strips(
                (0, m),
                MC,
                (k0, kc),
                a,
                panels,
                c,
                rsc,
                (j0, j1),
                acc,
                bias,
                None,
            )
        };
    }
}

/// Rows `i0..i0 + mc` of c's columns `j..j + nr` from A's K block `k0..k0 + kc` against the
/// packed panel `pp` (kc rows of NR floats), a register tile of MR rows at a time: the inner
/// loop of [`strips`].
///
/// # Safety
/// The CPU must support AVX-512F; `a` must describe a readable matrix with rows
/// `i0..i0 + mc` and columns `k0..k0 + kc`; `pp` kc x NR readable floats, 64-byte aligned; `c`
/// a writable matrix of row stride `rsc` with those rows and columns `j..j + nr` (nr ≤ NR), not
/// overlapping the others; `bias`, if any, readable at columns `j..j + nr`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn panel_tiles(
    i0: usize,
    mc: usize,
    k0: usize,
    kc: usize,
    a: Strided,
    pp: *const f32,
    c: *mut f32,
    rsc: usize,
    j: usize,
    nr: usize,
    acc: bool,
    bias: Option<*const f32>,
) {
    for i in (i0..i0 + mc).step_by(MR) {
        let rows = MR.min(i0 + mc - i);
        // safety: the tile is rows i..i+rows, columns j..j+nr of c, inside it per the contract.
        unsafe {
            tile(
                rows,
                kc,
                a.ptr.add(i * a.rs + k0 * a.cs),
                a.rs,
                a.cs,
                pp,
                c.add(i * rsc + j),
                rsc,
                nr,
                acc,
                bias.map(|b| b.add(j)),
            )
        };
    }
}

/// One row against one packed panel: c[0..nr] = a[0..k] · panel + bias. The register tile's
/// one-row kernel would wait on a single chain of FMAs (their latency, not the loads, would
/// bound it): this one keeps four chains over interleaved k and adds them at the end.
///
/// # Safety
/// The CPU must support AVX-512F; `a` must have k readable floats at stride `csa`; `b` a packed
/// panel of k x NR floats, 64-byte aligned; `c` nr (≤ NR) writable floats, not overlapping the
/// others; `bias`, if any, nr readable floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn gemv_panel(
    k: usize,
    a: *const f32,
    csa: usize,
    b: *const f32,
    c: *mut f32,
    nr: usize,
    bias: Option<*const f32>,
) {
    const U: usize = 4;
    let mut c0 = [_mm512_setzero_ps(); U];
    let mut c1 = [_mm512_setzero_ps(); U];
    // SAFETY: a has k floats at stride csa and b k rows of NR aligned floats, per the caller;
    // every read below is at p < k.
    unsafe {
        let mut p = 0;
        while p + U <= k {
            for u in 0..U {
                let av = _mm512_set1_ps(*a.add((p + u) * csa));
                let bp = b.add((p + u) * NR);
                c0[u] = _mm512_fmadd_ps(av, _mm512_load_ps(bp), c0[u]);
                c1[u] = _mm512_fmadd_ps(av, _mm512_load_ps(bp.add(16)), c1[u]);
            }
            p += U;
        }
        while p < k {
            let av = _mm512_set1_ps(*a.add(p * csa));
            let bp = b.add(p * NR);
            c0[0] = _mm512_fmadd_ps(av, _mm512_load_ps(bp), c0[0]);
            c1[0] = _mm512_fmadd_ps(av, _mm512_load_ps(bp.add(16)), c1[0]);
            p += 1;
        }
        let s0 = _mm512_add_ps(_mm512_add_ps(c0[0], c0[1]), _mm512_add_ps(c0[2], c0[3]));
        let s1 = _mm512_add_ps(_mm512_add_ps(c1[0], c1[1]), _mm512_add_ps(c1[2], c1[3]));
        store_row(c, nr, (s0, s1), false, bias_row(bias, nr));
    }
}

/// Lane masks for the two halves of an `nr`-wide row (nr <= 32).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn masks(nr: usize) -> (__mmask16, __mmask16) {
    let bits = if nr >= 32 { u32::MAX } else { (1u32 << nr) - 1 };
    (bits as u16, (bits >> 16) as u16)
}

/// The bias under a 32-wide tile row, as two vectors (zeros past `nr` columns, or without a
/// bias).
///
/// # Safety
/// The CPU must support AVX-512F; `bias`, if any, must have `nr` (≤ 32) readable floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn bias_row(bias: Option<*const f32>, nr: usize) -> (__m512, __m512) {
    let (m0, m1) = masks(nr);
    match bias {
        // SAFETY: masked loads read only the first nr floats, which the caller guarantees.
        Some(b) => unsafe {
            (
                _mm512_maskz_loadu_ps(m0, b),
                _mm512_maskz_loadu_ps(m1, b.add(16.min(nr))),
            )
        },
        None => (_mm512_setzero_ps(), _mm512_setzero_ps()),
    }
}

/// Writes one tile row of 32 sums (`v`) to the first `nr` (≤ 32) floats at `cp`: added to what
/// is there when accumulating, else plus the bias row ([`bias_row`]). Every kernel's last step.
///
/// # Safety
/// The CPU must support AVX-512F; `cp` must have `nr` writable floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn store_row(
    cp: *mut f32,
    nr: usize,
    v: (__m512, __m512),
    acc: bool,
    bias: (__m512, __m512),
) {
    let (m0, m1) = masks(nr);
    // SAFETY: masked loads and stores touch only the first nr floats at cp, which the caller
    // guarantees writable.
    unsafe {
        let cp1 = cp.add(16.min(nr));
        let (x0, x1) = if acc {
            (
                _mm512_add_ps(_mm512_maskz_loadu_ps(m0, cp), v.0),
                _mm512_add_ps(_mm512_maskz_loadu_ps(m1, cp1), v.1),
            )
        } else {
            (_mm512_add_ps(v.0, bias.0), _mm512_add_ps(v.1, bias.1))
        };
        _mm512_mask_storeu_ps(cp, m0, x0);
        _mm512_mask_storeu_ps(cp1, m1, x1);
    }
}

/// Asks for the cache lines of `bytes` bytes from `p` (a hint: no fault, no effect on results):
/// every line the run touches, from the one `p` is in, so a run not aligned to 64 bytes gets its
/// last, partial line too.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_run(p: *const u8, bytes: usize) {
    let skew = p as usize % 64;
    let line = p.wrapping_sub(skew);
    for off in (0..skew + bytes).step_by(64) {
        // SAFETY: a prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line.wrapping_add(off) as *const i8) };
    }
}

/// Rows of a row-major B between [`pack_panel`]'s loads and its prefetches. A panel reads 128
/// bytes of each row, rows kilobytes apart (a page or more): no hardware prefetcher follows
/// that, and from beyond the caches each row's load waited on memory. Each row loaded asks for
/// its two lines this many rows further down (rows past the block are the next K block's, or
/// nothing: a prefetch never faults). Configs B's and G's Ws and dYs, cold, packed once per K
/// block: 8.5-12.7 -> 19-25 GB/s of panel written (one thread, Zen 5, `examples/pack_rates.rs
/// -- fp32`). 16 rows ahead gained a little less, 40 about as much (48 was slower where B is
/// packed again from L3, per strip of A); hints to L2 (T1) were slower.
const PREFETCH_ROWS: usize = 24;

/// Asks for the 64-byte line at `p` into L1 (a hint: no fault, no effect on results).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_line(p: *const f32) {
    // SAFETY: a prefetch never faults, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) };
}

/// Transposes a 16 x 16 block of 32-bit elements (f32, or bf16 pairs) in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn transpose16(r: &mut [__m512i; 16]) {
    let mut t = [_mm512_setzero_si512(); 16];
    for q in 0..8 {
        t[2 * q] = _mm512_unpacklo_epi32(r[2 * q], r[2 * q + 1]);
        t[2 * q + 1] = _mm512_unpackhi_epi32(r[2 * q], r[2 * q + 1]);
    }
    // u[4g + c], 128-bit lane l: rows 4g..4g+4 of column 4l + c.
    let mut u = [_mm512_setzero_si512(); 16];
    for g in 0..4 {
        let b = 4 * g;
        u[b] = _mm512_unpacklo_epi64(t[b], t[b + 2]);
        u[b + 1] = _mm512_unpackhi_epi64(t[b], t[b + 2]);
        u[b + 2] = _mm512_unpacklo_epi64(t[b + 1], t[b + 3]);
        u[b + 3] = _mm512_unpackhi_epi64(t[b + 1], t[b + 3]);
    }
    for c in 0..4 {
        let v = _mm512_shuffle_i32x4::<0x44>(u[c], u[4 + c]);
        let w = _mm512_shuffle_i32x4::<0x44>(u[8 + c], u[12 + c]);
        r[c] = _mm512_shuffle_i32x4::<0x88>(v, w);
        r[4 + c] = _mm512_shuffle_i32x4::<0xDD>(v, w);
        let v = _mm512_shuffle_i32x4::<0xEE>(u[c], u[4 + c]);
        let w = _mm512_shuffle_i32x4::<0xEE>(u[8 + c], u[12 + c]);
        r[8 + c] = _mm512_shuffle_i32x4::<0x88>(v, w);
        r[12 + c] = _mm512_shuffle_i32x4::<0xDD>(v, w);
    }
}

/// Copies b rows 0..kc, columns 0..nr into `pp` as kc rows of NR floats (zeros past nr).
///
/// # Safety
/// The CPU must support AVX-512F; `b` must have kc x nr readable floats at strides (rs, cs);
/// `pp` must have kc x NR writable floats, 64-byte aligned, not overlapping `b`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pack_panel(pp: *mut f32, b: *const f32, rs: usize, cs: usize, kc: usize, nr: usize) {
    // SAFETY: the caller guarantees `b` has kc rows of nr readable floats (strides rs, cs)
    // and `pp` has kc x NR writable floats aligned to 64 bytes; masked loads read no column
    // past nr; AVX-512F is enabled on this function.
    unsafe {
        if cs == 1 {
            let (m0, m1) = masks(nr);
            let ahead = PREFETCH_ROWS * rs;
            for p in 0..kc {
                let src = b.add(p * rs);
                prefetch_line(src.wrapping_add(ahead));
                prefetch_line(src.wrapping_add(ahead + 16));
                _mm512_store_ps(pp.add(p * NR), _mm512_maskz_loadu_ps(m0, src));
                _mm512_store_ps(pp.add(p * NR + 16), _mm512_maskz_loadu_ps(m1, src.add(16)));
            }
        } else if rs == 1 {
            // A transposed B (a weight read as its transpose, by an input gradient): each of
            // its columns is contiguous along K, so 16 columns x 16 rows are loaded as vectors
            // and turned in registers (an element at a time, this pack cost as much as a sixth
            // of the product where it repeats for every block of A's rows).
            let mut r = [_mm512_setzero_si512(); 16];
            for j0 in (0..nr).step_by(16) {
                let cols = (nr - j0).min(16);
                // Each line loaded asks for the same line of the column 16 further on: the
                // next half of the panel, then the first half of the next panel, which the
                // next call packs (straight after where a product packs a K block once for all
                // strips of A; else after the kernel's pass, whose reads of A may evict the
                // lines, to L3 on the machines here, still nearer than memory). Configs B's and
                // G's input gradients' W^T, cold, packed once: 7-11 -> 21-28 GB/s of panel
                // written (one thread, Zen 5, `examples/pack_rates.rs -- fp32`). The same
                // column's lines two loads ahead instead in the panel's second half: G's 13-15
                // (packed per strip); across both halves per 16 rows of K, each column's line
                // 1-4 loads ahead: 11-16.
                let next = 16 * cs;
                for p0 in (0..kc).step_by(16) {
                    let rows = (kc - p0).min(16);
                    let m = masks(rows).0;
                    for (jj, v) in r.iter_mut().enumerate() {
                        let col = b.wrapping_add((j0 + jj) * cs + p0);
                        prefetch_line(col.wrapping_add(next));
                        *v = if jj < cols {
                            _mm512_castps_si512(_mm512_maskz_loadu_ps(m, col))
                        } else {
                            _mm512_setzero_si512()
                        };
                    }
                    transpose16(&mut r);
                    for (q, v) in r.iter().enumerate().take(rows) {
                        _mm512_store_si512(pp.add((p0 + q) * NR + j0) as *mut __m512i, *v);
                    }
                }
            }
            if nr <= 16 {
                for p in 0..kc {
                    _mm512_store_ps(pp.add(p * NR + 16), _mm512_setzero_ps());
                }
            }
        } else {
            // Neither layout is unit-stride: element by element.
            for p in 0..kc {
                _mm512_store_ps(pp.add(p * NR), _mm512_setzero_ps());
                _mm512_store_ps(pp.add(p * NR + 16), _mm512_setzero_ps());
            }
            for jj in 0..nr {
                let src = b.add(jj * cs);
                for p in 0..kc {
                    *pp.add(p * NR + jj) = *src.add(p * rs);
                }
            }
        }
    }
}

/// [`pack_panel`] of a whole panel of a row-major b read in SwiGLU's interleaved order: its
/// first 16 columns from `b`, its last 16 from `b + half` (see `Epilogue::b_halves`).
///
/// # Safety
/// The CPU must support AVX-512F; `b` and `b + half` must each have kc rows (stride rs) of 16
/// readable floats; `pp` as [`pack_panel`]'s.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pack_panel_halves(pp: *mut f32, b: *const f32, rs: usize, half: usize, kc: usize) {
    for p in 0..kc {
        // SAFETY: row p's 16 gate and 16 up floats, per the contract; pp's row p.
        unsafe {
            let src = b.add(p * rs);
            _mm512_store_ps(pp.add(p * NR), _mm512_loadu_ps(src));
            _mm512_store_ps(pp.add(p * NR + 16), _mm512_loadu_ps(src.add(half)));
        }
    }
}

/// One register tile of `rows` (1..=MR) rows, dispatched to its monomorphised kernel.
///
/// # Safety
/// As [`kernel`], with R = `rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile(
    rows: usize,
    k: usize,
    a: *const f32,
    rsa: usize,
    csa: usize,
    b: *const f32,
    c: *mut f32,
    rsc: usize,
    nr: usize,
    acc: bool,
    bias: Option<*const f32>,
) {
    macro_rules! by_rows {
        ($($r:literal)*) => {
            match rows {
                // safety: forwarded from the caller.
                $($r => unsafe { kernel::<$r>(k, a, rsa, csa, b, c, rsc, nr, acc, bias) },)*
                _ => unreachable!("tile rows {rows} outside 1..={MR}"),
            }
        };
    }
    by_rows!(1 2 3 4 5 6 7 8 9 10 11 12)
}

/// c[0..R, 0..nr] (+)= a[0..R, 0..k] · panel[0..k, 0..nr], panel rows NR floats apart.
///
/// # Safety
/// The CPU must support AVX-512F; `a` must have R x k readable floats at strides (rsa, csa);
/// `b` a packed panel of k x NR floats, 64-byte aligned; `c` R rows of nr writable floats at
/// row stride rsc, not overlapping `a`, `b` or `bias`; `bias`, if any, nr readable floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel<const R: usize>(
    k: usize,
    a: *const f32,
    rsa: usize,
    csa: usize,
    b: *const f32,
    c: *mut f32,
    rsc: usize,
    nr: usize,
    acc: bool,
    bias: Option<*const f32>,
) {
    let mut c0 = [_mm512_setzero_ps(); R];
    let mut c1 = [_mm512_setzero_ps(); R];
    // SAFETY: the caller guarantees `mm`-style views: `a` has R rows of k floats (strides
    // rsa, csa), `b` is a packed panel of k x NR floats aligned to 64 bytes, and `c` has R rows
    // of nr writable floats (stride rsc); AVX-512F is enabled on this function.
    unsafe {
        // A tile that overwrites C (the first K block) asks for its rows now and writes them
        // after the K loop: rows kilobytes apart, which no hardware prefetcher follows. On the
        // LM head's forward (C of 16-32 MB) that was 3-10% faster, config G's fp32 step about
        // 1.5%; where the tile adds to C, the same hint made the head's backward slower.
        if !acc {
            for i in 0..R {
                prefetch_run(c.add(i * rsc) as *const u8, 4 * nr);
            }
        }
        let (mut ap, mut bp) = (a, b);
        for _ in 0..k {
            let b0 = _mm512_load_ps(bp);
            let b1 = _mm512_load_ps(bp.add(16));
            for i in 0..R {
                let av = _mm512_set1_ps(*ap.add(i * rsa));
                c0[i] = _mm512_fmadd_ps(av, b0, c0[i]);
                c1[i] = _mm512_fmadd_ps(av, b1, c1[i]);
            }
            ap = ap.add(csa);
            bp = bp.add(NR);
        }
        let bias = bias_row(bias, nr);
        for i in 0..R {
            store_row(c.add(i * rsc), nr, (c0[i], c1[i]), acc, bias);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The panel a plain copy makes: b's rows k0..k0 + kc, columns j..j + nr, zeros past nr.
    fn scalar_panel(
        b: &[f32],
        (rs, cs): (usize, usize),
        (k0, kc): (usize, usize),
        j: usize,
        nr: usize,
    ) -> Vec<u32> {
        let mut out = vec![0u32; kc * NR];
        for p in 0..kc {
            for jj in 0..nr {
                out[p * NR + jj] = b[(k0 + p) * rs + (j + jj) * cs].to_bits();
            }
        }
        out
    }

    #[test]
    fn panels_hold_the_scalar_packs_bits() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: this CPU has no AVX-512F");
            return;
        }
        #[repr(align(64))]
        struct Panel([f32; KC_WHOLE * NR]);
        let mut panel = Box::new(Panel([0.0; KC_WHOLE * NR]));
        // (k, n): K whole, K split in blocks with a short last one, edges of 16 and 32.
        for (k, n) in [(1, 1), (5, 7), (17, 33), (64, 48), (300, 95), (1030, 64)] {
            // Distinct bit patterns, NaN payloads and negative zero among them.
            let b: Vec<f32> = (0..k * n)
                .map(|i| f32::from_bits((i as u32).wrapping_mul(2_654_435_761) ^ 0x8000_0001))
                .collect();
            // row-major, transposed (column-major), neither unit-stride (a row-major
            // matrix of 2n columns, every other one)
            let wide: Vec<f32> = (0..2 * k * n).map(|i| b[i / 2]).collect();
            let layouts: [(&[f32], usize, usize); 3] = [(&b, n, 1), (&b, 1, k), (&wide, 2 * n, 2)];
            for (src, rs, cs) in layouts {
                let sb = Strided {
                    ptr: src.as_ptr(),
                    rs,
                    cs,
                };
                let kc_max = kc_for(k);
                for k0 in (0..k).step_by(kc_max) {
                    let kc = kc_max.min(k - k0);
                    for j in (0..n).step_by(NR) {
                        let nr = NR.min(n - j);
                        panel.0[..kc * NR].fill(f32::from_bits(0x7fc0_dead));
                        // SAFETY: AVX-512F checked above; the block is inside src; the panel
                        // holds kc x NR floats, 64-byte aligned.
                        unsafe {
                            pack_panel_of(panel.0.as_mut_ptr(), sb, Epilogue::None, (k0, kc), j, nr)
                        };
                        let got: Vec<u32> =
                            panel.0[..kc * NR].iter().map(|x| x.to_bits()).collect();
                        assert_eq!(
                            got,
                            scalar_panel(src, (rs, cs), (k0, kc), j, nr),
                            "k {k} n {n} strides ({rs}, {cs}) block {k0} panel {j}"
                        );
                    }
                }
            }
        }
    }
}

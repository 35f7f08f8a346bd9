//! Attention of one new query row over a sequence's cached keys and values: the inner loop of
//! generating with a KV cache, where each sequence of a batched decode step attends over its
//! own cache (so rows cannot share one matrix product as a training step's do).
//!
//! It reads the cache (a row at position p reads 2·p·C floats per layer) and does a few
//! operations per float read, so both the reads and the arithmetic around them count: each key
//! and value row is read once, contiguously, all heads at once. On AVX-512 the two passes over
//! the cache are written with intrinsics: the scores of 16 positions are summed across lanes
//! together (a register transpose, not 16 reductions one after another), and a group of up to
//! 16 output vectors stays in registers while the values stream by. Elsewhere the same
//! arithmetic runs as portable code, in the same order, so both give the same bits (a test
//! holds them to it). Softmax uses the engine's `exp`, not libm's. It never allocates and never
//! writes the cache.
//!
//! Under grouped-query attention ([`DecodeDims::group`] query heads to a cached head, as
//! Llama's and SmolLM2's) each query head reads its group's cached head in place: nothing is
//! copied out per query head, and the heads of a group read the same cached rows one after
//! another, while those rows are in L1. With one query head per cached head the code is the
//! multi-head one; a grouped call gives, bit for bit, what one call per query head over its
//! cached head gives.
//!
//! The cache may be kept in bf16 ([`attention_decode_row_bf16`], a bf16 KV cache as vLLM's
//! `--kv-cache-dtype`): half the bytes to read. Each element is widened to f32 as it is loaded
//! (exactly: its bits shifted left by 16), and everything after that is the f32 code's, in the
//! same order. Both element types go through one generic implementation (over `KvElement`).
//!
//! The order of every sum (which the results' bits depend on):
//! - a score: lane l of 16 sums q·k over dimensions l, l+16, ... of the head, from zero, in
//!   order; the 16 lanes are then added as a tree, l with l+8, then l+4, then l+2, then l+1;
//!   the sum is multiplied by the scale;
//! - softmax: `exp(s - max)`, summed by [`math::sum`](super::math::sum), each divided by the sum
//!   through one reciprocal;
//! - an output element: p·v over positions in order, from zero, each product rounded before it
//!   is added (no fused multiply-add).

use super::math::{exp, max, sum, LANES};
use super::simd_fn;

/// What the code needs of a cache element type (f32, or bf16 bits as u16): its f32 value
/// (exact), whether the AVX-512 code must widen it, and its clones of the portable code.
trait KvElement: Copy + Send + Sync + 'static {
    /// True for bf16 bits (the AVX-512 code loads 16 of them as 32 bytes and widens them).
    const BF16: bool;
    /// The element's f32 value (exact).
    fn to_f32(self) -> f32;
    /// [`scores_of`] for this type, compiled by `simd_fn!`.
    fn portable_scores(scores: &mut [f32], q: &[f32], k: &[Self], dims: DecodeDims);
    /// [`weighted_values_of`] for this type, compiled by `simd_fn!`.
    fn portable_weighted_values(out: &mut [f32], probs: &[f32], v: &[Self], dims: DecodeDims);
}

impl KvElement for f32 {
    const BF16: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    fn portable_scores(scores: &mut [f32], q: &[f32], k: &[f32], dims: DecodeDims) {
        portable_scores(scores, q, k, dims)
    }
    fn portable_weighted_values(out: &mut [f32], probs: &[f32], v: &[f32], dims: DecodeDims) {
        portable_weighted_values(out, probs, v, dims)
    }
}

impl KvElement for u16 {
    const BF16: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        super::bf16::bf16_to_f32(self)
    }
    fn portable_scores(scores: &mut [f32], q: &[f32], k: &[u16], dims: DecodeDims) {
        portable_scores_bf16(scores, q, k, dims)
    }
    fn portable_weighted_values(out: &mut [f32], probs: &[f32], v: &[u16], dims: DecodeDims) {
        portable_weighted_values_bf16(out, probs, v, dims)
    }
}

/// The shape of one decode row's attention: `ctx` cached positions, `nh` heads of size `hs`,
/// cache rows of stride `c` (≥ nh·hs), scores multiplied by `scale` (1/√hs in GPT-2).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeDims {
    /// Cached positions attended over (the new row's included).
    pub ctx: usize,
    /// Heads.
    pub nh: usize,
    /// Head size.
    pub hs: usize,
    /// Row stride of the cache (C).
    pub c: usize,
    /// The scores' scale.
    pub scale: f32,
    /// Query heads per cached key/value head: 1 for multi-head attention, NH/NKV under
    /// grouped-query attention, where query head h reads cached head h / group and a cache
    /// row holds nh / group heads (each cached head is read for its whole group, never
    /// copied out per query head).
    pub group: usize,
}

/// `out` (C) = softmax(q·kᵀ · scale) · v for each of `nh` heads of size `hs` (C = nh·hs),
/// over the first `ctx` rows of `k` and `v` (row stride `c`). `scores` needs `nh·ctx`
/// floats.
pub fn attention_decode_row(
    out: &mut [f32],
    scores: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: DecodeDims,
) {
    attention_decode(out, scores, q, k, v, dims);
}

/// [`attention_decode_row`] over a cache kept in bf16: `k` and `v` are bf16 bits (see
/// [`round_to_bf16`](super::round_to_bf16)). The result is the f32 function's on the f32
/// values of those elements, bit for bit.
pub fn attention_decode_row_bf16(
    out: &mut [f32],
    scores: &mut [f32],
    q: &[f32],
    k: &[u16],
    v: &[u16],
    dims: DecodeDims,
) {
    attention_decode(out, scores, q, k, v, dims);
}

/// Both public functions: checks the sizes, then the AVX-512 code or the portable code.
fn attention_decode<T: KvElement>(
    out: &mut [f32],
    scores: &mut [f32],
    q: &[f32],
    k: &[T],
    v: &[T],
    dims: DecodeDims,
) {
    let DecodeDims {
        ctx,
        nh,
        hs,
        c,
        group,
        ..
    } = dims;
    let w = nh * hs;
    assert!(
        group > 0 && nh.is_multiple_of(group),
        "attention_decode_row: {nh} query heads in groups of {group}"
    );
    // the cached heads' width
    let kw = nh / group * hs;
    let cache = ctx.saturating_sub(1) * c + kw;
    assert!(
        q.len() >= w
            && out.len() >= w
            && scores.len() >= nh * ctx
            && k.len() >= cache
            && v.len() >= cache
            && c >= kw
            && ctx > 0,
        "attention_decode_row: buffers too short for {ctx} positions of {nh} x {hs}"
    );
    let (out, scores) = (&mut out[..w], &mut scores[..nh * ctx]);
    #[cfg(target_arch = "x86_64")]
    if super::simd_level() == super::SimdLevel::Avx512 && hs.is_multiple_of(LANES) {
        // SAFETY: AVX-512F was detected; the sizes were checked above (q and out hold w
        // floats, scores nh·ctx, k and v ctx rows of stride c ≥ kw, the cached heads that
        // query heads / group index), and hs is a multiple of 16.
        unsafe {
            avx512::scores(scores, q, k, dims);
            softmax_rows(scores, ctx);
            avx512::weighted_values(out, scores, v, dims);
        }
        return;
    }
    T::portable_scores(scores, q, k, dims);
    softmax_rows(scores, ctx);
    T::portable_weighted_values(out, scores, v, dims);
}

/// The 16 lanes of a score's partial sums added as the module doc says.
#[inline(always)]
fn lane_tree(mut a: [f32; LANES]) -> f32 {
    for half in [8, 4, 2] {
        for l in 0..half {
            a[l] += a[l + half];
        }
    }
    a[0] + a[1]
}

/// scores[h·ctx + j] = (q_h · k_j,h) · scale, in the module doc's order; inlined into the
/// `simd_fn!` clones below, one per element type (the macro takes no generics).
#[inline(always)]
fn scores_of<T: KvElement>(scores: &mut [f32], q: &[f32], k: &[T], dims: DecodeDims) {
    let DecodeDims {
        ctx,
        nh,
        hs,
        c,
        scale,
        group,
    } = dims;
    for j in 0..ctx {
        for h in 0..nh {
            let kv = j * c + h / group * hs;
            let (qh, kh) = (&q[h * hs..(h + 1) * hs], &k[kv..kv + hs]);
            let mut acc = [0f32; LANES];
            for (d, (&x, &y)) in qh.iter().zip(kh).enumerate() {
                acc[d % LANES] += x * y.to_f32();
            }
            scores[h * ctx + j] = lane_tree(acc) * scale;
        }
    }
}

simd_fn! {
    /// [`scores_of`] over an f32 cache.
    fn portable_scores(scores: &mut [f32], q: &[f32], k: &[f32], dims: DecodeDims) {
        scores_of(scores, q, k, dims)
    }
}

simd_fn! {
    /// [`scores_of`] over a bf16 cache.
    fn portable_scores_bf16(scores: &mut [f32], q: &[f32], k: &[u16], dims: DecodeDims) {
        scores_of(scores, q, k, dims)
    }
}

simd_fn! {
    /// Each row of `ctx` scores becomes its softmax.
    fn softmax_rows(scores: &mut [f32], ctx: usize) {
        for s in scores.chunks_exact_mut(ctx) {
            let m = max(s);
            for x in s.iter_mut() {
                *x = exp(*x - m);
            }
            let inv = 1.0 / sum(s);
            for x in s.iter_mut() {
                *x *= inv;
            }
        }
    }
}

/// out[h, d] = Σ_j p[h][j] · v[j][h / group, d], positions in order; inlined into the
/// `simd_fn!` clones below.
#[inline(always)]
fn weighted_values_of<T: KvElement>(out: &mut [f32], probs: &[f32], v: &[T], dims: DecodeDims) {
    let DecodeDims {
        ctx, hs, c, group, ..
    } = dims;
    out.fill(0.0);
    for j in 0..ctx {
        for (h, o) in out.chunks_exact_mut(hs).enumerate() {
            let x = &v[j * c + h / group * hs..][..hs];
            let p = probs[h * ctx + j];
            for (o, &x) in o.iter_mut().zip(x) {
                *o += p * x.to_f32();
            }
        }
    }
}

simd_fn! {
    /// [`weighted_values_of`] over an f32 cache.
    fn portable_weighted_values(out: &mut [f32], probs: &[f32], v: &[f32], dims: DecodeDims) {
        weighted_values_of(out, probs, v, dims)
    }
}

simd_fn! {
    /// [`weighted_values_of`] over a bf16 cache.
    fn portable_weighted_values_bf16(out: &mut [f32], probs: &[f32], v: &[u16], dims: DecodeDims) {
        weighted_values_of(out, probs, v, dims)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{DecodeDims, KvElement, LANES};

    /// Elements p .. p+16 of a cache as f32: 64 bytes of f32, or 32 bytes of bf16 bits
    /// zero-extended to 32 bits and shifted into the top half (exact).
    ///
    /// # Safety
    /// AVX-512F; p .. p+16 readable.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load<T: KvElement>(p: *const T) -> __m512 {
        // SAFETY: 16 elements at p are readable (the caller's contract); unaligned loads.
        unsafe {
            if T::BF16 {
                let bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits))
            } else {
                _mm512_loadu_ps(p.cast())
            }
        }
    }

    /// Lane i of the result is the tree sum (l + l+8, + l+4, + l+2, + l+1) of `v[i]`'s lanes.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn lane_trees(v: &[__m512; 16]) -> __m512 {
        // l + l+8: 128-bit quarters 0,1 of each vector against 2,3; two vectors per result.
        let a: [__m512; 8] = std::array::from_fn(|i| {
            let (x, y) = (v[2 * i], v[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
            )
        });
        // l + l+4: quarters 0,2 against 1,3; quarter q of b[i] is vector 4i + q.
        let b: [__m512; 4] = std::array::from_fn(|i| {
            let (x, y) = (a[2 * i], a[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
            )
        });
        // l + l+2 inside each quarter: quarter q of c[i] holds vectors 8i + q (lanes 0, 1) and
        // 8i + 4 + q (lanes 2, 3).
        let c: [__m512; 2] = std::array::from_fn(|i| {
            let (x, y) = (_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
            _mm512_add_ps(
                _mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)),
            )
        });
        // l + l+1: lane 4q + p of r is vector 4p + q.
        let r = _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(c[0], c[1]),
            _mm512_shuffle_ps::<0xDD>(c[0], c[1]),
        );
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(order, r)
    }

    /// [`super::portable_scores`] on AVX-512, 16 positions at a time.
    ///
    /// # Safety
    /// AVX-512F; `hs` a multiple of 16; `q` nh·hs floats, `scores` nh·ctx, `k` ctx rows of
    /// stride `c` ≥ nh·hs.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores<T: KvElement>(
        scores: &mut [f32],
        q: &[f32],
        k: &[T],
        dims: DecodeDims,
    ) {
        let DecodeDims {
            ctx,
            nh,
            hs,
            c,
            scale,
            group,
        } = dims;
        let (q, k, s) = (q.as_ptr(), k.as_ptr(), scores.as_mut_ptr());
        let scale = _mm512_set1_ps(scale);
        for j0 in (0..ctx).step_by(16) {
            let n = (ctx - j0).min(16);
            let mask = ((1u32 << n) - 1) as u16;
            // The block's rows (16 x C) stay in L1 while each head goes over them.
            for h in 0..nh {
                let mut acc = [_mm512_setzero_ps(); 16];
                for (jj, a) in acc.iter_mut().enumerate().take(n) {
                    // SAFETY: row j0 + jj < ctx of k, columns of cached head h / group,
                    // inside c; q's head h; all inside the caller's slices.
                    unsafe {
                        let kr = k.add((j0 + jj) * c + h / group * hs);
                        let qh = q.add(h * hs);
                        for d in (0..hs).step_by(LANES) {
                            let p = _mm512_mul_ps(_mm512_loadu_ps(qh.add(d)), load(kr.add(d)));
                            *a = _mm512_add_ps(*a, p);
                        }
                    }
                }
                let row = _mm512_mul_ps(lane_trees(&acc), scale);
                // SAFETY: scores h·ctx + j0 .. + n are inside the caller's nh·ctx.
                unsafe { _mm512_mask_storeu_ps(s.add(h * ctx + j0), mask, row) };
            }
        }
    }

    /// [`super::portable_weighted_values`] on AVX-512: up to 16 output vectors stay in
    /// registers while every position's values go by.
    ///
    /// # Safety
    /// AVX-512F; `hs` a multiple of 16; `out` a multiple of 16 floats (its length is w, the
    /// query heads' width); `probs` (w / hs)·ctx floats; `v` ctx rows of stride `c` holding
    /// the (w / hs) / group cached heads.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weighted_values<T: KvElement>(
        out: &mut [f32],
        probs: &[f32],
        v: &[T],
        dims: DecodeDims,
    ) {
        let vectors = out.len() / LANES;
        let mut e = 0;
        while e < vectors {
            // SAFETY: forwarded; each group stays inside out's vectors.
            unsafe {
                e += match vectors - e {
                    16.. => group::<T, 16>(out, probs, v, dims, e),
                    8.. => group::<T, 8>(out, probs, v, dims, e),
                    4.. => group::<T, 4>(out, probs, v, dims, e),
                    2.. => group::<T, 2>(out, probs, v, dims, e),
                    _ => group::<T, 1>(out, probs, v, dims, e),
                };
            }
        }
    }

    /// Output vectors e0 .. e0 + G; returns G.
    ///
    /// # Safety
    /// As [`weighted_values`], with e0 + G ≤ out.len() / 16.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn group<T: KvElement, const G: usize>(
        out: &mut [f32],
        probs: &[f32],
        v: &[T],
        dims: DecodeDims,
        e0: usize,
    ) -> usize {
        let DecodeDims {
            ctx, hs, c, group, ..
        } = dims;
        let mut acc = [_mm512_setzero_ps(); G];
        // The query head of each vector: which row of probabilities scales it; and where in a
        // cache row its elements are (its head's cached head, the same offset in the head).
        let heads: [usize; G] = std::array::from_fn(|g| (e0 + g) * LANES / hs * ctx);
        let at: [usize; G] = std::array::from_fn(|g| {
            let e = (e0 + g) * LANES;
            e / hs / group * hs + e % hs
        });
        let (p, v) = (probs.as_ptr(), v.as_ptr());
        for j in 0..ctx {
            // SAFETY: row j < ctx of v, each vector inside its cached heads; the probability
            // of head(e) at position j inside probs.
            unsafe {
                let row = v.add(j * c);
                for g in 0..G {
                    let pj = _mm512_set1_ps(*p.add(heads[g] + j));
                    let x = load(row.add(at[g]));
                    acc[g] = _mm512_add_ps(acc[g], _mm512_mul_ps(pj, x));
                }
            }
        }
        for (g, a) in acc.iter().enumerate() {
            // SAFETY: vector e0 + g of out, inside it per the contract.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add((e0 + g) * LANES), *a) };
        }
        G
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(nh: usize, hs: usize, ctx: usize, c: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let val = |i: usize, m: usize| ((i * m % 101) as f32 - 50.0) * 0.02;
        let q: Vec<f32> = (0..nh * hs).map(|i| val(i, 7)).collect();
        let k: Vec<f32> = (0..ctx * c).map(|i| val(i, 13)).collect();
        let v: Vec<f32> = (0..ctx * c).map(|i| val(i, 29)).collect();
        (q, k, v)
    }

    /// Softmax attention in f64 of query row `q` over `ctx` rows of `k`, `v` (stride `c`).
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        ctx: usize,
        nh: usize,
        hs: usize,
        c: usize,
    ) -> Vec<f64> {
        let scale = 1.0 / (hs as f32).sqrt();
        let mut out = vec![0.0; nh * hs];
        for h in 0..nh {
            let s: Vec<f64> = (0..ctx)
                .map(|j| {
                    (0..hs)
                        .map(|d| q[h * hs + d] as f64 * k[j * c + h * hs + d] as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hs {
                out[h * hs + d] = (0..ctx)
                    .map(|j| e[j] / z * v[j * c + h * hs + d] as f64)
                    .sum();
            }
        }
        out
    }

    fn to_bf16(x: &[f32]) -> Vec<u16> {
        let mut out = vec![0; x.len()];
        crate::cpu::round_to_bf16(&mut out, x);
        out
    }

    fn widen(x: &[u16]) -> Vec<f32> {
        x.iter().map(|&b| crate::cpu::bf16_to_f32(b)).collect()
    }

    #[test]
    fn matches_a_softmax_attention_in_f64() {
        // hs 24 runs the portable code everywhere; hs 32 the AVX-512 code where the CPU has it
        for (nh, hs, ctx, pad) in [
            (3usize, 24usize, 37usize, 0usize),
            (3, 32, 37, 16),
            (2, 64, 5, 0),
        ] {
            let (c, group) = (nh * hs + pad, 1);
            let (q, k, v) = inputs(nh, hs, ctx, c);
            let scale = 1.0 / (hs as f32).sqrt();
            let (mut out, mut scores) = (vec![f32::NAN; nh * hs], vec![0.0; nh * ctx]);
            attention_decode_row(
                &mut out,
                &mut scores,
                &q,
                &k,
                &v,
                DecodeDims {
                    ctx,
                    nh,
                    hs,
                    c,
                    scale,
                    group,
                },
            );
            let want = reference(&q, &k, &v, ctx, nh, hs, c);
            for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                assert!(
                    (got as f64 - want).abs() < 1e-5,
                    "{nh}x{hs} ctx {ctx}: out[{i}] {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn a_bf16_cache_matches_a_softmax_attention_in_f64_over_its_rounded_values() {
        // the same shapes; the reference is exact attention over the bf16-rounded K and V, so
        // the only error left is the f32 arithmetic's (the rounding itself is not error here)
        for (nh, hs, ctx, pad) in [
            (3usize, 24usize, 37usize, 0usize),
            (3, 32, 37, 16),
            (2, 64, 5, 0),
        ] {
            let (c, group) = (nh * hs + pad, 1);
            let (q, k, v) = inputs(nh, hs, ctx, c);
            // values that bf16 rounds (the inputs' multiples of 0.02 are mostly not bf16)
            let k: Vec<f32> = k.iter().map(|x| x * 1.2345).collect();
            let (kb, vb) = (to_bf16(&k), to_bf16(&v));
            assert_ne!(widen(&kb), k, "the test's keys must round");
            let scale = 1.0 / (hs as f32).sqrt();
            let (mut out, mut scores) = (vec![f32::NAN; nh * hs], vec![0.0; nh * ctx]);
            attention_decode_row_bf16(
                &mut out,
                &mut scores,
                &q,
                &kb,
                &vb,
                DecodeDims {
                    ctx,
                    nh,
                    hs,
                    c,
                    scale,
                    group,
                },
            );
            let want = reference(&q, &widen(&kb), &widen(&vb), ctx, nh, hs, c);
            for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                assert!(
                    (got as f64 - want).abs() < 1e-5,
                    "{nh}x{hs} ctx {ctx}: out[{i}] {got} vs {want}"
                );
            }
            // and it is the f32 function's result on the widened cache, bit for bit
            let mut f32_out = vec![f32::NAN; nh * hs];
            let (kw, vw) = (widen(&kb), widen(&vb));
            attention_decode_row(
                &mut f32_out,
                &mut scores,
                &q,
                &kw,
                &vw,
                DecodeDims {
                    ctx,
                    nh,
                    hs,
                    c,
                    scale,
                    group,
                },
            );
            assert_eq!(
                out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                f32_out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{nh}x{hs} ctx {ctx}"
            );
        }
    }

    #[test]
    fn avx512_and_portable_code_give_the_same_bits() {
        if crate::cpu::simd_level() != crate::cpu::SimdLevel::Avx512 {
            eprintln!("skipped: this CPU has no AVX-512");
            return;
        }
        // every group width (6 x 64 = 24 vectors: 16 + 8; 7 x 16: 4 + 2 + 1) and partial
        // blocks of positions; for an f32 cache and a bf16 one; multi-head, grouped
        // (3 query heads a cached head) and multi-query
        for bf16 in [false, true] {
            for (nh, hs, pad, group) in [
                (6usize, 64usize, 0usize, 1usize),
                (7, 16, 32, 1),
                (6, 64, 0, 3),
                (7, 16, 32, 7),
            ] {
                for ctx in [1usize, 15, 16, 17, 66, 130] {
                    let c = nh / group * hs + pad;
                    let (q, k, v) = inputs(nh, hs, ctx, c);
                    let (kb, vb) = (to_bf16(&k), to_bf16(&v));
                    let scale = 1.0 / (hs as f32).sqrt();
                    let (mut fast, mut scores) = (vec![f32::NAN; nh * hs], vec![0.0; nh * ctx]);
                    if bf16 {
                        attention_decode_row_bf16(
                            &mut fast,
                            &mut scores,
                            &q,
                            &kb,
                            &vb,
                            DecodeDims {
                                ctx,
                                nh,
                                hs,
                                c,
                                scale,
                                group,
                            },
                        );
                    } else {
                        attention_decode_row(
                            &mut fast,
                            &mut scores,
                            &q,
                            &k,
                            &v,
                            DecodeDims {
                                ctx,
                                nh,
                                hs,
                                c,
                                scale,
                                group,
                            },
                        );
                    }
                    let fast_scores = scores.clone();
                    let mut slow = vec![f32::NAN; nh * hs];
                    if bf16 {
                        portable_scores_bf16(
                            &mut scores,
                            &q,
                            &kb,
                            DecodeDims {
                                ctx,
                                nh,
                                hs,
                                c,
                                scale,
                                group,
                            },
                        );
                    } else {
                        portable_scores(
                            &mut scores,
                            &q,
                            &k,
                            DecodeDims {
                                ctx,
                                nh,
                                hs,
                                c,
                                scale,
                                group,
                            },
                        );
                    }
                    softmax_rows(&mut scores, ctx);
                    assert_eq!(
                        fast_scores.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        scores.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        "bf16 {bf16} {nh}x{hs} ctx {ctx}: probabilities"
                    );
                    let dims = DecodeDims {
                        ctx,
                        nh,
                        hs,
                        c,
                        scale,
                        group,
                    };
                    if bf16 {
                        portable_weighted_values_bf16(&mut slow, &scores, &vb, dims);
                    } else {
                        portable_weighted_values(&mut slow, &scores, &v, dims);
                    }
                    for (i, (a, b)) in fast.iter().zip(&slow).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "bf16 {bf16} {nh}x{hs} ctx {ctx}: out[{i}] {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn grouped_heads_read_their_cached_head_as_one_head_calls_do() {
        // 6 query heads over 2 cached heads (and over 1: multi-query), against the f64
        // reference on the cache expanded per query head, and bit for bit against one call per
        // query head over its cached head (cache rows of stride c, one head each)
        for (hs, group) in [(32usize, 3usize), (24, 3), (16, 6)] {
            let (nh, ctx) = (6, 21);
            let nkv = nh / group;
            let c = nkv * hs;
            let (q, k, v) = inputs(nh, hs, ctx, c);
            let scale = 1.0 / (hs as f32).sqrt();
            let dims = DecodeDims {
                ctx,
                nh,
                hs,
                c,
                scale,
                group,
            };
            let (mut out, mut scores) = (vec![f32::NAN; nh * hs], vec![0.0; nh * ctx]);
            attention_decode_row(&mut out, &mut scores, &q, &k, &v, dims);
            let expand = |x: &[f32]| -> Vec<f32> {
                (0..ctx * nh * hs)
                    .map(|i| {
                        let (j, h, d) = (i / (nh * hs), i / hs % nh, i % hs);
                        x[j * c + h / group * hs + d]
                    })
                    .collect()
            };
            let want = reference(&q, &expand(&k), &expand(&v), ctx, nh, hs, nh * hs);
            for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                assert!(
                    (got as f64 - want).abs() < 1e-5,
                    "hs {hs}: out[{i}] {got} vs {want}"
                );
            }
            for h in 0..nh {
                let one = DecodeDims {
                    nh: 1,
                    group: 1,
                    ..dims
                };
                let (mut o, at) = (vec![f32::NAN; hs], h / group * hs);
                attention_decode_row(&mut o, &mut scores, &q[h * hs..], &k[at..], &v[at..], one);
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&o),
                    bits(&out[h * hs..(h + 1) * hs]),
                    "hs {hs} head {h}"
                );
            }
        }
    }
}

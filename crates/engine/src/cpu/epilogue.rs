//! What a matrix product does to its result once the sums are final, while the result is still
//! in cache: the MLP's activation (GELU, or SwiGLU), fused into the product that feeds it.
//!
//! Unfused, the GELU is a pass of its own over a [tokens x 4d] matrix the product has just
//! written to memory: it reads that matrix back and writes another. Fused, the kernels finish C
//! a strip of rows at a time and apply the epilogue to the strip while it is in L2; the
//! epilogue's own output is written whole rows at a time, which the hardware prefetchers follow.
//! (Finishing each 32 x 32 block as the kernel stores it was slower than the separate pass: it
//! touches 128 bytes of each of 32 distant rows, and those misses cost more than the pass.)
//! GELU's backward is not fused into the product before it: it reads the pre-activation from
//! memory either way, and fused it measured no faster. Under bf16 the forward epilogue instead
//! leaves GELU's derivative where the pre-activation was, so backward only multiplies.
//!
//! SwiGLU pairs each gate column with an up column F columns away, which a block of C would not
//! hold together. So its product is computed with B's columns in the interleaved order of
//! [`swiglu`](super::swiglu) (tiles of 16 gate columns, each followed by the same 16 up
//! columns; see [`Epilogue::b_halves`]): every 32-column block of C then holds both halves of
//! 16 outputs, and C (the kept pre-activation) stays in that order. The weight is never copied
//! or reordered in memory: the kernels' packing reads the two halves (see `gemm.rs`).
//!
//! SwiGLU's backward is fused into the product that gives d(SwiGLU output)
//! ([`Epilogue::SwiGluBwd`]): nothing else reads that product's result back, so the pass it
//! saves is a whole read of an (N, F) matrix (not yet timed against the separate pass).
//!
//! Every epilogue computes exactly what the unfused pass computes (the same scalar functions
//! of [`math`](super::math), the same order of operations), so fused and unfused results are
//! the same bits. An epilogue never reads or writes outside the block it is handed.

use super::math::gelu;
#[cfg(target_arch = "x86_64")]
use super::math::{gelu_and_grad, swiglu_grads};
use super::math::{swiglu, swiglu_backward_pair};
use super::swiglu::TILE;
use super::SendPtr;

/// The epilogue of one product, with pointers to its own operands (the same shape as the
/// product's result, row-major with their own row stride).
#[derive(Clone, Copy)]
pub(crate) enum Epilogue {
    /// Nothing: the product's result is final.
    None,
    /// `out[i][j] = gelu(c[i][j])`: C is the pre-activation, kept for backward.
    Gelu { out: SendPtr, rs: usize },
    /// The same with `out` in bf16 (its bits; `out` points at u16), rounded to nearest even
    /// by the instruction the bf16 products round their operands with: the next product reads
    /// the same bits it would have rounded from the f32 GELU. C is then overwritten with
    /// GELU's derivative at the pre-activation, all that backward needs of it: the tanh is
    /// computed once, here, instead of again in a backward pass. Only where the CPU has the
    /// bf16 product.
    GeluBf16 { out: SendPtr, rs: usize },
    /// `out[i][j] = bf16(c[i][j])` (bits, `out` points at u16), rounded as
    /// [`Epilogue::GeluBf16`]'s: a product whose only readers round it to bf16 as they pack it
    /// (attention's qkv under bf16 products) kept at the very bits they would read. C is left
    /// as it is (scratch to the caller). Only where the CPU has the bf16 product.
    Bf16 { out: SendPtr, rs: usize },
    /// SwiGLU of C in the interleaved order (see the module doc): for each tile of C's row,
    /// `out[i][t0 + j] = swiglu(gate j, up j)`, `out` (N, F) in the natural order. `half` is
    /// F: the columns between B's gate and up halves. C is the pre-activation, kept.
    SwiGlu {
        out: SendPtr,
        rs: usize,
        half: usize,
    },
    /// The same with `out` in bf16 bits (rounded as [`Epilogue::GeluBf16`]'s), and C
    /// overwritten by what SwiGLU's backward needs (`swiglu_grads`: silu(gate) where gate
    /// was, up · silu'(gate) where up was), so backward computes no sigmoid.
    SwiGluBf16 {
        out: SendPtr,
        rs: usize,
        half: usize,
    },
    /// SwiGLU's backward, on the product that gives d(SwiGLU output) (C, (N, F) natural): from
    /// `src` (N, 2F), the forward's interleaved pre-activation, or with `kept` the derivatives
    /// the bf16 forward left there, into `dinp` (N, 2F) gate then up, both of row stride 2F.
    /// C's blocks start at multiples of 16 columns (a tile of `src`), as every kernel's do.
    SwiGluBwd {
        dinp: SendPtr,
        src: SendPtr,
        f: usize,
        kept: bool,
    },
}

impl Epilogue {
    /// The same epilogue for the block of C starting at row `r`, column `c`.
    pub(crate) fn at(self, r: usize, c: usize) -> Epilogue {
        match self {
            Epilogue::None => Epilogue::None,
            Epilogue::Gelu { out, rs } => Epilogue::Gelu {
                out: SendPtr(out.get().wrapping_add(r * rs + c)),
                rs,
            },
            Epilogue::GeluBf16 { out, rs } => Epilogue::GeluBf16 {
                out: SendPtr((out.get() as *mut u16).wrapping_add(r * rs + c) as *mut f32),
                rs,
            },
            Epilogue::Bf16 { out, rs } => Epilogue::Bf16 {
                out: SendPtr((out.get() as *mut u16).wrapping_add(r * rs + c) as *mut f32),
                rs,
            },
            // c is a multiple of 2·TILE (a tile boundary): its outputs start at c / 2.
            Epilogue::SwiGlu { out, rs, half } => Epilogue::SwiGlu {
                out: SendPtr(out.get().wrapping_add(r * rs + c / 2)),
                rs,
                half,
            },
            Epilogue::SwiGluBf16 { out, rs, half } => Epilogue::SwiGluBf16 {
                out: SendPtr((out.get() as *mut u16).wrapping_add(r * rs + c / 2) as *mut f32),
                rs,
                half,
            },
            // c is a multiple of TILE: natural column c, interleaved tile at 2·c.
            Epilogue::SwiGluBwd { dinp, src, f, kept } => Epilogue::SwiGluBwd {
                dinp: SendPtr(dinp.get().wrapping_add(r * 2 * f + c)),
                src: SendPtr(src.get().wrapping_add(r * 2 * f + 2 * c)),
                f,
                kept,
            },
        }
    }

    /// Whether B's columns are read in SwiGLU's interleaved order, and then the columns
    /// between B's gate and up halves (F): column 32·t + j of the product is B's column
    /// 16·t + j for j < 16, else 16·t + j - 16 + F. A kernel given such an epilogue packs B
    /// that way and starts its calls at multiples of 32 columns (B's column c / 2).
    pub(crate) fn b_halves(self) -> Option<usize> {
        match self {
            Epilogue::SwiGlu { half, .. } | Epilogue::SwiGluBf16 { half, .. } => Some(half),
            _ => None,
        }
    }

    /// Applies the epilogue to C's block of `rows` x `cols` at `c` (row stride `rsc`), which is
    /// this epilogue's block (0, 0) (see [`Epilogue::at`]). Inlined into the kernels, so the
    /// loops are vectorized for the kernel's instruction set.
    ///
    /// # Safety
    /// `c` and the epilogue's operand must each hold the block (rows x cols at their row
    /// strides); `out` must not overlap C.
    #[inline(always)]
    pub(crate) unsafe fn apply(self, c: *mut f32, rsc: usize, rows: usize, cols: usize) {
        match self {
            Epilogue::None => {}
            Epilogue::Gelu { out, rs } => {
                for i in 0..rows {
                    // SAFETY: row i of the block, inside both matrices per the contract.
                    let (src, dst) = unsafe {
                        (
                            std::slice::from_raw_parts(c.add(i * rsc), cols),
                            std::slice::from_raw_parts_mut(out.get().add(i * rs), cols),
                        )
                    };
                    for (o, &x) in dst.iter_mut().zip(src) {
                        *o = gelu(x);
                    }
                }
            }
            Epilogue::GeluBf16 { out, rs } => {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the block, per the contract; the variant is only made where the CPU
                // has the bf16 product (AVX512_BF16, with AVX-512BW and VL).
                unsafe {
                    gelu_rows_bf16(c, rsc, out.get() as *mut u16, rs, rows, cols)
                };
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!("bf16 activations without the bf16 product");
            }
            Epilogue::Bf16 { out, rs } => {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the block, per the contract; the variant is only made where the CPU
                // has the bf16 product (AVX512_BF16, with AVX-512BW and VL).
                unsafe {
                    rows_bf16(c, rsc, out.get() as *mut u16, rs, rows, cols)
                };
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!("bf16 activations without the bf16 product");
            }
            Epilogue::SwiGlu { out, rs, .. } => {
                debug_assert_eq!(cols % (2 * TILE), 0, "SwiGLU blocks are whole tiles");
                for i in 0..rows {
                    // SAFETY: row i of the block: cols floats of C, cols / 2 of out, inside
                    // both matrices per the contract.
                    let (src, dst) = unsafe {
                        (
                            std::slice::from_raw_parts(c.add(i * rsc), cols),
                            std::slice::from_raw_parts_mut(out.get().add(i * rs), cols / 2),
                        )
                    };
                    for (x, o) in src.chunks_exact(2 * TILE).zip(dst.chunks_exact_mut(TILE)) {
                        let (g, u) = x.split_at(TILE);
                        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                            *o = swiglu(g, u);
                        }
                    }
                }
            }
            Epilogue::SwiGluBwd { dinp, src, f, kept } => {
                for i in 0..rows {
                    // SAFETY: row i of the block: cols floats of C, 2·cols of src from the
                    // block's tile, cols of dinp's gate and of its up half, inside the matrices
                    // per the contract; dinp overlaps neither.
                    let (d, x, dg, du) = unsafe {
                        let dg = dinp.get().add(i * 2 * f);
                        (
                            std::slice::from_raw_parts(c.add(i * rsc), cols),
                            std::slice::from_raw_parts(src.get().add(i * 2 * f), 2 * cols),
                            std::slice::from_raw_parts_mut(dg, cols),
                            std::slice::from_raw_parts_mut(dg.add(f), cols),
                        )
                    };
                    // Tiles of TILE columns (the last one narrower where the block ends at F).
                    for t0 in (0..cols).step_by(TILE) {
                        let w = TILE.min(cols - t0);
                        let (a, b) = x[2 * t0..2 * t0 + 2 * w].split_at(w);
                        let r = t0..t0 + w;
                        let (dg, du, d) = (&mut dg[r.clone()], &mut du[r.clone()], &d[r]);
                        for j in 0..w {
                            (dg[j], du[j]) = if kept {
                                (d[j] * b[j], d[j] * a[j])
                            } else {
                                swiglu_backward_pair(d[j], a[j], b[j])
                            };
                        }
                    }
                }
            }
            Epilogue::SwiGluBf16 { out, rs, .. } => {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the block, per the contract; the variant is only made where the CPU
                // has the bf16 product (AVX512_BF16, with AVX-512BW and VL).
                unsafe {
                    swiglu_rows_bf16(c, rsc, out.get() as *mut u16, rs, rows, cols)
                };
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!("bf16 activations without the bf16 product");
            }
        }
    }
}

/// Over a block of whole interleaved tiles: `out` = bf16(swiglu(gate, up)) in the natural
/// order, and C's tiles replaced by `swiglu_grads` (see [`Epilogue::SwiGluBf16`]).
///
/// # Safety
/// AVX512_BF16, AVX-512BW and VL must be present; `c` rows x cols readable and writable floats
/// at row stride `rsc`, cols a multiple of 2·TILE; `out` rows x cols / 2 writable u16 at row
/// stride `rs`, not overlapping c.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn swiglu_rows_bf16(
    c: *mut f32,
    rsc: usize,
    out: *mut u16,
    rs: usize,
    rows: usize,
    cols: usize,
) {
    use std::arch::x86_64::*;
    for i in 0..rows {
        for t in (0..cols).step_by(2 * TILE) {
            // SAFETY: the tile's 2·TILE floats of row i, inside c per the contract.
            let tile = unsafe { std::slice::from_raw_parts_mut(c.add(i * rsc + t), 2 * TILE) };
            let (g, u) = tile.split_at_mut(TILE);
            let mut o = [0f32; TILE];
            for ((o, g), u) in o.iter_mut().zip(g.iter_mut()).zip(u.iter_mut()) {
                *o = swiglu(*g, *u);
                (*g, *u) = swiglu_grads(*g, *u);
            }
            // SAFETY: o is 16 floats; the store writes the 16 u16 of row i's outputs t / 2..,
            // inside out per the contract. __m256bh and __m256i are both 256 bits.
            unsafe {
                let v = _mm512_cvtneps_pbh(_mm512_loadu_ps(o.as_ptr()));
                let v = std::mem::transmute::<__m256bh, __m256i>(v);
                _mm256_storeu_si256(out.add(i * rs + t / 2) as *mut __m256i, v);
            }
        }
    }
}

/// `out[i][j] = bf16(gelu(c[i][j]))` and `c[i][j] = gelu'(c[i][j])` over a block (see
/// [`Epilogue::GeluBf16`]).
///
/// # Safety
/// AVX512_BF16, AVX-512BW and VL must be present; `c` rows x cols readable and writable floats
/// at row stride `rsc`; `out` rows x cols writable u16 at row stride `rs`, not overlapping c.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn gelu_rows_bf16(
    c: *mut f32,
    rsc: usize,
    out: *mut u16,
    rs: usize,
    rows: usize,
    cols: usize,
) {
    use std::arch::x86_64::*;
    for i in 0..rows {
        for j0 in (0..cols).step_by(16) {
            let m = (cols - j0).min(16);
            let mask: __mmask16 = if m == 16 { 0xffff } else { (1u16 << m) - 1 };
            // A fixed 16 lanes (zero past m), so the GELU compiles to one vector pass. The
            // row's m floats go in and out by masked moves: slice copies of a length known
            // only at run time were two calls to memmove per 16 values (1.3% of config B's
            // bf16 step).
            let (mut g, mut d) = ([0f32; 16], [0f32; 16]);
            let row = c.wrapping_add(i * rsc + j0);
            // SAFETY: the masked load reads columns j0..j0 + m of row i, inside c per the
            // contract; g is 16 floats.
            unsafe { _mm512_storeu_ps(g.as_mut_ptr(), _mm512_maskz_loadu_ps(mask, row)) };
            for (x, d) in g.iter_mut().zip(d.iter_mut()) {
                (*x, *d) = gelu_and_grad(*x);
            }
            // SAFETY: g and d are 16 floats; the masked stores write the m floats of row i's
            // columns j0..j0 + m, inside c, and their m u16, inside out, per the contract.
            unsafe {
                _mm512_mask_storeu_ps(row, mask, _mm512_loadu_ps(d.as_ptr()));
                store_bf16(out.add(i * rs + j0), mask, _mm512_loadu_ps(g.as_ptr()));
            }
        }
    }
}

/// `out[i][j] = bf16(c[i][j])` over a block (see [`Epilogue::Bf16`]).
///
/// # Safety
/// AVX512_BF16, AVX-512BW and VL must be present; `c` rows x cols readable floats at row
/// stride `rsc`; `out` rows x cols writable u16 at row stride `rs`, not overlapping c.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn rows_bf16(c: *const f32, rsc: usize, out: *mut u16, rs: usize, rows: usize, cols: usize) {
    use std::arch::x86_64::*;
    for i in 0..rows {
        for j0 in (0..cols).step_by(16) {
            let m = (cols - j0).min(16);
            let mask: __mmask16 = if m == 16 { 0xffff } else { (1u16 << m) - 1 };
            // SAFETY: the masked load reads, and the store writes, columns j0..j0 + m of row
            // i, inside c and out per the contract.
            unsafe {
                let v = _mm512_maskz_loadu_ps(mask, c.add(i * rsc + j0));
                store_bf16(out.add(i * rs + j0), mask, v);
            }
        }
    }
}

/// Stores the lanes of `mask` of `v` rounded to bf16 (VCVTNEPS2BF16: the rounding of the bf16
/// products' packs) at `dst`.
///
/// # Safety
/// AVX512_BF16, AVX-512BW and VL must be present; the lanes of `mask` writable from `dst`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
unsafe fn store_bf16(
    dst: *mut u16,
    mask: std::arch::x86_64::__mmask16,
    v: std::arch::x86_64::__m512,
) {
    use std::arch::x86_64::*;
    // SAFETY: __m256bh and __m256i are both 256 bits; the masked store writes the lanes of
    // mask, which the caller guarantees writable.
    unsafe {
        let v = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v));
        _mm256_mask_storeu_epi16(dst as *mut i16, mask, v);
    }
}

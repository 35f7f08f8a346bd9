//! What a matrix product does to its result once the sums are final, while the result is still
//! in cache: the MLP's GELU, fused into the product that feeds it.
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
//! Every epilogue computes exactly what the unfused pass computes (the same scalar functions
//! of [`math`](super::math), the same order of operations), so fused and unfused results are
//! the same bits. An epilogue never reads or writes outside the block it is handed.

use super::math::gelu;
#[cfg(target_arch = "x86_64")]
use super::math::gelu_and_grad;
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
            // A fixed 16 lanes (zero past m), so the GELU compiles to one vector pass.
            let (mut g, mut d) = ([0f32; 16], [0f32; 16]);
            // SAFETY: columns j0..j0 + m of row i, inside c per the contract.
            let row = unsafe { std::slice::from_raw_parts_mut(c.add(i * rsc + j0), m) };
            g[..m].copy_from_slice(row);
            for (x, d) in g.iter_mut().zip(d.iter_mut()) {
                (*x, *d) = gelu_and_grad(*x);
            }
            row.copy_from_slice(&d[..m]);
            // SAFETY: g is 16 floats; the masked store writes the m u16 of row i's columns
            // j0..j0 + m, inside out per the contract. __m256bh and __m256i are both 256 bits.
            unsafe {
                let v = _mm512_cvtneps_pbh(_mm512_loadu_ps(g.as_ptr()));
                let v = std::mem::transmute::<__m256bh, __m256i>(v);
                let mask = if m == 16 { 0xffff } else { (1u16 << m) - 1 };
                _mm256_mask_storeu_epi16(out.add(i * rs + j0) as *mut i16, mask, v);
            }
        }
    }
}

//! What a matrix product does to its result once the sums are final, while the result is still
//! in cache: the MLP's GELU, fused into the product that feeds it.
//!
//! Unfused, the GELU is a pass of its own over a [tokens x 4d] matrix the product has just
//! written to memory: it reads that matrix back and writes another. Fused, the kernels finish C
//! a strip of rows at a time and apply the epilogue to the strip while it is in L2; the
//! epilogue's own output is written whole rows at a time, which the hardware prefetchers follow.
//! (Finishing each 32 x 32 block as the kernel stores it was slower than the separate pass: it
//! touches 128 bytes of each of 32 distant rows, and those misses cost more than the pass.)
//! GELU's backward is not fused: it reads the pre-activation from memory either way, and fused
//! it measured no faster.
//!
//! Every epilogue computes exactly what the unfused pass computes (the same scalar functions
//! of [`math`](super::math), the same order of operations), so fused and unfused results are
//! the same bits. An epilogue never reads or writes outside the block it is handed.

use super::math::gelu;
use super::SendPtr;

/// The epilogue of one product, with pointers to its own operands (the same shape as the
/// product's result, row-major with their own row stride).
#[derive(Clone, Copy)]
pub(crate) enum Epilogue {
    /// Nothing: the product's result is final.
    None,
    /// `out[i][j] = gelu(c[i][j])`: C is the pre-activation, kept for backward.
    Gelu { out: SendPtr, rs: usize },
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
        }
    }
}

//! Matrix products: the Conv1D layers (weights `[in, out]`), the LM head (weights `[out, in]`,
//! nn.Linear / tied embedding) and their backward passes, on our AVX-512 sgemm (`gemm.rs`) where
//! the CPU has AVX-512 and on `matrixmultiply` elsewhere.
//!
//! Threads split the output into disjoint row or column blocks; each output element is always
//! computed by one thread over the full K, in the same order whatever block it is in, so results
//! do not depend on the thread count. The operand every block reads (B split by rows; A split by
//! columns, under bf16) is packed once for all threads (`gemm_bf16::shared`). Transposes are
//! strides, never copies. Nothing here allocates per call.
//!
//! The weight-gradient products (`matmul_backward`, `matmul_backward_weight_bf16_input`,
//! `head_backward`) add into `dw` or, without `accumulate`, overwrite it: the first backward
//! after a lazy `zero_grad` then neither needs the zeros written nor reads them back. The two
//! give the same bits where `dw` held +0.0: the AVX-512 kernels' last step writes `sum + 0.0`
//! (a zero bias row) when overwriting and `0.0 + sum` when adding into zeros, and IEEE
//! addition commutes (NaN, infinities and signed zeros included); `matrixmultiply` writes
//! `1·sum` against `1·sum + 1·0.0`, equal because a sum started from +0.0 is never -0.0.
//! Later K blocks add to what the first wrote either way. A bias gradient (column sums)
//! always adds.

use rayon::prelude::*;

use super::epilogue::Epilogue;
#[cfg(target_arch = "x86_64")]
use super::gemm::{sgemm, strip_rows, Strided};
#[cfg(target_arch = "x86_64")]
use super::gemm_bf16::{bgemm, bgemm_bf16_a, bgemm_parts, sgemm_parts, AOperand, StridedBf16};
use super::{simd_fn, simd_level, SendPtr, SimdLevel};
use crate::DType;

/// A matrix operand: pointer plus row and column strides (in elements), of f32 or, for a left
/// operand kept in bf16, of bf16 bits (`bf16`; the pointer then points at u16).
#[derive(Clone, Copy)]
struct Mat {
    ptr: SendPtr,
    rs: isize,
    cs: isize,
    bf16: bool,
}

impl Mat {
    fn rm(ptr: *const f32, cols: usize) -> Mat {
        Mat {
            ptr: SendPtr(ptr as *mut f32),
            rs: cols as isize,
            cs: 1,
            bf16: false,
        }
    }
    fn rm_bf16(ptr: *const u16, cols: usize) -> Mat {
        Mat {
            ptr: SendPtr(ptr as *mut f32),
            rs: cols as isize,
            cs: 1,
            bf16: true,
        }
    }
    fn t(self) -> Mat {
        Mat {
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }
    fn at(self, r: usize, c: usize) -> *mut f32 {
        // safety of the offset is the caller's: r and c stay inside the matrix it describes.
        let off = r as isize * self.rs + c as isize * self.cs;
        if self.bf16 {
            (self.ptr.0 as *mut u16).wrapping_offset(off) as *mut f32
        } else {
            self.ptr.0.wrapping_offset(off)
        }
    }
    /// The AVX-512 kernels' view of the matrix from element (r, c) on (f32; see [`Mat::left`]
    /// for a left operand that may be bf16).
    #[cfg(target_arch = "x86_64")]
    fn strided(self, r: usize, c: usize) -> Strided {
        Strided {
            ptr: self.at(r, c),
            rs: self.rs as usize,
            cs: self.cs as usize,
        }
    }
    /// A left operand of the bf16 product from row r on: f32, or bf16 bits where `bf16`.
    #[cfg(target_arch = "x86_64")]
    fn left(self, r: usize) -> AOperand {
        let s = self.strided(r, 0);
        if self.bf16 {
            AOperand::Bf16(StridedBf16 {
                ptr: s.ptr as *const u16,
                rs: s.rs,
                cs: s.cs,
            })
        } else {
            AOperand::F32(s)
        }
    }
}

/// Below this many multiply-adds a product runs on one thread (a fork costs a few µs).
const PAR_MIN_MACS: usize = 1 << 17;

/// c (m, n) = a (m, k) · b (k, n) + bias (n), or `c += a · b` with `accumulate` (no bias),
/// split over the current rayon pool. With `DType::Bf16` (on a CPU that has the bf16 product)
/// a and b are rounded to bf16 and the sums kept in f32. `ep` finishes each block of c once
/// its sums are final.
///
/// # Safety
/// The three descriptors must describe valid matrices of the given sizes, `c` must not overlap
/// `a`, `b` or `bias`, and `c` must be writable; `ep`'s operand must hold an (m, n) matrix.
unsafe fn gemm(
    dtype: DType,
    m: usize,
    k: usize,
    n: usize,
    a: Mat,
    b: Mat,
    c: Mat,
    accumulate: bool,
    bias: Option<&[f32]>,
    ep: Epilogue,
) {
    // safety: forwarded from the caller.
    unsafe {
        gemm_on(
            rayon::current_num_threads(),
            dtype,
            m,
            k,
            n,
            a,
            b,
            c,
            accumulate,
            bias,
            ep,
            None,
        )
    }
}

/// [`gemm`] with no bias or epilogue that also adds each column's sum over b's k rows to
/// `b_sums` (n floats), in row order: the bits of [`column_sums`] of b. Under bf16 the pass
/// that packs b does it (see [`bgemm`]), so a weight gradient's product yields its layer's
/// bias gradient without another read of the output gradient. The sums always add to
/// `b_sums`, whether c is accumulated into or overwritten.
///
/// # Safety
/// As [`gemm`]; `b_sums` must not overlap the matrices.
unsafe fn gemm_summing_b(
    dtype: DType,
    (m, k, n): (usize, usize, usize),
    a: Mat,
    b: Mat,
    c: Mat,
    accumulate: bool,
    b_sums: &mut [f32],
) {
    check("b's column sums", b_sums.len(), n);
    let sums = SendPtr(b_sums.as_mut_ptr());
    // safety: forwarded from the caller.
    unsafe {
        gemm_on(
            rayon::current_num_threads(),
            dtype,
            m,
            k,
            n,
            a,
            b,
            c,
            accumulate,
            None,
            Epilogue::None,
            Some(sums),
        )
    }
}

/// [`gemm`] split over at most `threads` tasks of the current rayon pool (1: the calling
/// thread alone).
///
/// # Safety
/// As [`gemm`].
unsafe fn gemm_on(
    threads: usize,
    dtype: DType,
    m: usize,
    k: usize,
    n: usize,
    a: Mat,
    b: Mat,
    c: Mat,
    accumulate: bool,
    bias: Option<&[f32]>,
    ep: Epilogue,
    b_sums: Option<SendPtr>,
) {
    let parts = if m * n * k < PAR_MIN_MACS {
        1
    } else {
        threads.min(m.max(n) / 16).max(1)
    };
    assert!(
        ep.b_halves().is_none() || (bias.is_none() && b.cs == 1),
        "SwiGLU's interleaved product takes no bias and a row-major B"
    );
    let bias = bias.map(|b| SendPtr(b.as_ptr() as *mut f32));
    let avx512 = simd_level() == SimdLevel::Avx512;
    let bf16 = dtype == DType::Bf16 && super::bf16_supported();
    assert!(
        bf16 || !a.bf16,
        "a bf16 operand needs the bf16 product (a backend of DType::Bf16)"
    );
    if !avx512 && !accumulate {
        if let Some(b) = bias {
            // safety: the caller's bias has n elements and c is (m, n) with row stride c.rs.
            unsafe { fill_rows(c, m, n, std::slice::from_raw_parts(b.get(), n)) };
        }
    }
    // The bf16 kernels sum b's columns as they pack it; elsewhere a pass of its own does.
    let bf16_product = avx512 && (a.bf16 || bf16);
    if let (Some(sums), false) = (b_sums, bf16_product) {
        // safety: b is (k, n) and sums n floats per the caller.
        unsafe { add_column_sums(sums.get(), b, k, n) };
    }
    let call = |r0: usize, r1: usize, c0: usize, c1: usize| {
        // b's column sums for this part's columns, by the part that has c's first rows (a
        // split by rows gives every part all of b's columns)
        let sums = b_sums
            .filter(|_| r0 == 0 && bf16_product)
            .map(|s| s.get().wrapping_add(c0));
        // safety: sub-blocks of the caller's valid matrices; distinct calls write disjoint
        // blocks of c (and of b_sums).
        unsafe {
            #[cfg(target_arch = "x86_64")]
            if avx512 {
                let n_whole = n;
                // Under SwiGLU's interleaved order, c's column c0 (a multiple of 32) reads
                // from B's gate column c0 / 2 on (see `Epilogue::b_halves`).
                let b_col = if ep.b_halves().is_some() { c0 / 2 } else { c0 };
                let (sb, cc) = (b.strided(0, b_col), c.at(r0, c0));
                let bias = bias.map(|b| b.get().add(c0) as *const f32);
                let (m, n, rsc) = (r1 - r0, c1 - c0, c.rs as usize);
                let ep = ep.at(r0, c0);
                let sa = match a.left(r0) {
                    AOperand::Bf16(sa) => {
                        bgemm_bf16_a(
                            m, k, n, sa, sb, cc, rsc, accumulate, bias, ep, n_whole, sums,
                        );
                        return;
                    }
                    AOperand::F32(sa) => sa,
                };
                if bf16 {
                    bgemm(
                        m, k, n, sa, sb, cc, rsc, accumulate, bias, ep, n_whole, sums,
                    );
                } else if m <= strip_rows(m, sb)
                    || !sgemm_parts(
                        1,
                        &|_| (0, m),
                        (m, k, n),
                        sa,
                        sb,
                        (cc, rsc),
                        accumulate,
                        bias,
                        ep,
                    )
                {
                    // One strip of A's rows: B packed panel by panel, each read from L1.
                    sgemm(m, k, n, sa, sb, cc, rsc, accumulate, bias, ep);
                }
                // Else (a thread's whole product, or its columns of a split by columns) with
                // A's rows in several strips: B's K blocks packed once for all the strips (the
                // shared product with one part) rather than again for each strip, its panels
                // then read contiguously, which the hardware prefetchers follow. Same sums in
                // the same order. `matmul_rates -- fp32`, one thread, Zen 5: config B's block
                // products 203-227 -> 228-239 GFLOP/s (77-87% -> 86-91% of the FMA peak),
                // config G's 192-208 -> 205-221.
                return;
            }
            assert!(
                ep.b_halves().is_none(),
                "SwiGLU's interleaved product needs AVX-512"
            );
            let beta = if accumulate || bias.is_some() {
                1.0
            } else {
                0.0
            };
            matrixmultiply::sgemm(
                r1 - r0,
                k,
                c1 - c0,
                1.0,
                a.at(r0, 0),
                a.rs,
                a.cs,
                b.at(0, c0),
                b.rs,
                b.cs,
                beta,
                c.at(r0, c0),
                c.rs,
                c.cs,
            );
            // c is row-major here (every caller's c is).
            ep.at(r0, c0)
                .apply(c.at(r0, c0), c.rs as usize, r1 - r0, c1 - c0);
        }
    };
    if parts == 1 {
        call(0, m, 0, n);
        return;
    }
    // Split the longer output side, in multiples of 16 (the kernel's register tile), or of 32
    // columns under SwiGLU's interleaved order (whole tiles of gate and up).
    let unit = if ep.b_halves().is_some() { 32 } else { 16 };
    let split = |len: usize, p: usize| {
        let step = len.div_ceil(parts).div_ceil(unit) * unit;
        ((p * step).min(len), ((p + 1) * step).min(len))
    };
    // The operand every part reads (B split by rows, A by columns, where A is packed) packed
    // once, by all the parts together.
    #[cfg(target_arch = "x86_64")]
    if avx512 {
        let len = if m >= n { m } else { n };
        let (sb, cc, bias) = (
            b.strided(0, 0),
            (c.at(0, 0), c.rs as usize),
            bias.map(|b| b.get()),
        );
        let bias = bias.map(|b| b as *const f32);
        // safety: forwarded from the caller; the parts are the split below.
        let shared = unsafe {
            if bf16_product {
                let sums = b_sums.map(|s| s.get());
                let by_rows = m >= n;
                bgemm_parts(
                    parts,
                    &|p| split(len, p),
                    by_rows,
                    (m, k, n),
                    a.left(0),
                    sb,
                    cc,
                    accumulate,
                    bias,
                    ep,
                    sums,
                )
            } else {
                sgemm_parts(
                    parts,
                    &|p| split(len, p),
                    (m, k, n),
                    a.strided(0, 0),
                    sb,
                    cc,
                    accumulate,
                    bias,
                    ep,
                )
            }
        };
        if shared {
            return;
        }
    }
    (0..parts).into_par_iter().for_each(|p| {
        if m >= n {
            let (r0, r1) = split(m, p);
            if r0 < r1 {
                call(r0, r1, 0, n);
            }
        } else {
            let (c0, c1) = split(n, p);
            if c0 < c1 {
                call(0, m, c0, c1);
            }
        }
    });
}

/// `sums[j] += Σ_r b[r, j]` over b's k rows, row by row in order: [`gemm_summing_b`]'s sums
/// where the product's kernel does not make them.
///
/// # Safety
/// `b` must describe a readable (k, n) matrix; `sums` n writable floats not overlapping it.
unsafe fn add_column_sums(sums: *mut f32, b: Mat, k: usize, n: usize) {
    // safety: per the contract.
    let sums = unsafe { std::slice::from_raw_parts_mut(sums, n) };
    if b.cs == 1 && b.rs as usize == n {
        // safety: b's rows are contiguous: k x n floats.
        column_sums(sums, unsafe {
            std::slice::from_raw_parts(b.at(0, 0), k * n)
        });
        return;
    }
    for r in 0..k {
        for (j, s) in sums.iter_mut().enumerate() {
            // safety: inside b per the contract.
            *s += unsafe { *b.at(r, j) };
        }
    }
}

fn check(what: &str, len: usize, want: usize) {
    assert!(len >= want, "{what}: {len} elements, need {want}");
}

/// The forward product of a Conv1D layer, whatever its input's type and epilogue:
/// `out (N, OC) = a (N, C) · w (C, OC) + bias (OC)`, `ep` applied to C as the kernels finish it.
///
/// # Safety
/// `a` must describe `a_len` readable elements (checked against N x C here); `ep`'s operand
/// must hold an (N, OC) matrix that overlaps nothing else.
unsafe fn conv1d_product(
    dtype: DType,
    out: &mut [f32],
    a: Mat,
    a_len: usize,
    w: &[f32],
    bias: Option<&[f32]>,
    (n, c, oc): (usize, usize, usize),
    ep: Epilogue,
) {
    check("matmul out", out.len(), n * oc);
    check("matmul inp", a_len, n * c);
    check("matmul w", w.len(), c * oc);
    if let Some(b) = bias {
        check("matmul bias", b.len(), oc);
    }
    // SAFETY: sizes checked above; out is a distinct &mut; a and ep per the contract.
    unsafe {
        gemm(
            dtype,
            n,
            c,
            oc,
            a,
            Mat::rm(w.as_ptr(), oc),
            Mat::rm(out.as_mut_ptr(), oc),
            false,
            bias.map(|b| &b[..oc]),
            ep,
        )
    }
}

/// out (N, OC) = inp (N, C) · w (C, OC) + bias (OC). `w` is in Conv1D layout `[in, out]`.
pub fn matmul_forward(
    dtype: DType,
    out: &mut [f32],
    inp: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    c: usize,
    oc: usize,
) {
    let a = Mat::rm(inp.as_ptr(), c);
    // SAFETY: `a` is `inp`; no epilogue.
    unsafe {
        conv1d_product(
            dtype,
            out,
            a,
            inp.len(),
            w,
            bias,
            (n, c, oc),
            Epilogue::None,
        )
    }
}

/// `pre (N, OC) = inp (N, C) · w (C, OC) + bias (OC)` and `out = gelu(pre)`: the MLP's first
/// layer and its activation in one pass, each strip of `out` computed while the product's
/// strip is still in cache. Both results are the same bits as [`matmul_forward`] then
/// [`gelu_forward`](super::gelu_forward).
pub fn matmul_gelu_forward(
    dtype: DType,
    pre: &mut [f32],
    out: &mut [f32],
    inp: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    c: usize,
    oc: usize,
) {
    check("matmul gelu out", out.len(), n * oc);
    let ep = Epilogue::Gelu {
        out: SendPtr(out.as_mut_ptr()),
        rs: oc,
    };
    let a = Mat::rm(inp.as_ptr(), c);
    // SAFETY: `a` is `inp`; ep's operand is `out`, (n, oc) as checked, a distinct &mut.
    unsafe { conv1d_product(dtype, pre, a, inp.len(), w, bias, (n, c, oc), ep) }
}

/// [`matmul_gelu_forward`] of an input kept in bf16 (its bits: a LayerNorm's output under bf16
/// products, the same bits as its f32 values rounded), keeping the GELU's output in bf16 (`out` holds its bits): the
/// products that read it (the next layer's forward and its weight gradient) round their left
/// operand to bf16 anyway, so they read the same values from half the bytes, and a forward
/// can keep them for backward at half the memory. `grad` receives GELU's derivative at the
/// pre-activation, not the pre-activation: backward needs nothing else of it
/// ([`gelu_backward_with_grad`](super::gelu_backward_with_grad)). Needs a backend of
/// `DType::Bf16`.
pub fn matmul_gelu_forward_bf16(
    dtype: DType,
    grad: &mut [f32],
    out: &mut [u16],
    inp: &[u16],
    w: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    c: usize,
    oc: usize,
) {
    let ep = |out, rs| Epilogue::GeluBf16 { out, rs };
    bf16_out_product(
        "matmul gelu out",
        dtype,
        (grad, out),
        inp,
        w,
        bias,
        (n, c, oc),
        ep,
    )
}

/// The forward product of a bf16 input whose epilogue (`ep(out, row stride)`) keeps an (N, OC)
/// result in bf16 in `out` (`what` names it in the size check), C (N, OC) f32 in `c_f32`:
/// [`matmul_gelu_forward_bf16`] and [`matmul_forward_bf16_out`]. Needs a backend of
/// `DType::Bf16`.
#[allow(clippy::too_many_arguments)]
fn bf16_out_product(
    what: &str,
    dtype: DType,
    (c_f32, out): (&mut [f32], &mut [u16]),
    inp: &[u16],
    w: &[f32],
    bias: Option<&[f32]>,
    (n, c, oc): (usize, usize, usize),
    ep: impl FnOnce(SendPtr, usize) -> Epilogue,
) {
    check(what, out.len(), n * oc);
    assert!(
        dtype == DType::Bf16 && super::bf16_supported(),
        "bf16 activations need a backend of DType::Bf16"
    );
    let ep = ep(SendPtr(out.as_mut_ptr() as *mut f32), oc);
    let a = Mat::rm_bf16(inp.as_ptr(), c);
    // SAFETY: `a` is `inp`; ep's operand is `out`, (n, oc) u16 as checked, a distinct &mut.
    unsafe { conv1d_product(dtype, c_f32, a, inp.len(), w, bias, (n, c, oc), ep) }
}

/// [`matmul_forward`] with `ep` applied to the product as the kernels finish it: the fused
/// products of other modules (SwiGLU's).
///
/// # Safety
/// `ep`'s operand must hold what it writes for an (N, OC) product and overlap nothing else.
pub(super) unsafe fn matmul_forward_with(
    dtype: DType,
    out: &mut [f32],
    inp: Input,
    w: &[f32],
    bias: Option<&[f32]>,
    (n, c, oc): (usize, usize, usize),
    ep: Epilogue,
) {
    let (a, len) = match inp {
        Input::F32(x) => (Mat::rm(x.as_ptr(), c), x.len()),
        Input::Bf16(x) => (Mat::rm_bf16(x.as_ptr(), c), x.len()),
    };
    // SAFETY: `a` is `inp`, `len` its elements; ep per the contract.
    unsafe { conv1d_product(dtype, out, a, len, w, bias, (n, c, oc), ep) }
}

/// The left operand of a forward product as its caller holds it: f32, or bf16 bits (on a
/// backend of `DType::Bf16` only).
#[derive(Clone, Copy)]
pub(super) enum Input<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

/// [`matmul_forward`] of an input kept in bf16 (its bits): the same bits as [`matmul_forward`]
/// in `DType::Bf16` of the f32 values they round from. Needs a backend of `DType::Bf16`.
pub fn matmul_forward_bf16_input(
    dtype: DType,
    out: &mut [f32],
    inp: &[u16],
    w: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    c: usize,
    oc: usize,
) {
    let a = Mat::rm_bf16(inp.as_ptr(), c);
    // SAFETY: `a` is `inp`; no epilogue.
    unsafe {
        conv1d_product(
            dtype,
            out,
            a,
            inp.len(),
            w,
            bias,
            (n, c, oc),
            Epilogue::None,
        )
    }
}

/// [`matmul_forward_bf16_input`] with the result kept in bf16 (`out` holds its bits, rounded
/// as the bf16 products' packs round an operand), for a product whose every reader rounds it
/// to bf16 anyway (attention's qkv: the fused heads read the same bits from half the bytes).
/// `sums` (N, OC) receives the f32 product as scratch: each strip is rounded while in cache.
/// Needs a backend of `DType::Bf16`.
pub fn matmul_forward_bf16_out(
    dtype: DType,
    sums: &mut [f32],
    out: &mut [u16],
    inp: &[u16],
    w: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    c: usize,
    oc: usize,
) {
    let ep = |out, rs| Epilogue::Bf16 { out, rs };
    bf16_out_product(
        "matmul bf16 out",
        dtype,
        (sums, out),
        inp,
        w,
        bias,
        (n, c, oc),
        ep,
    )
}

/// The weight half of [`matmul_backward`] for an input kept in bf16: `dw += inpᵀ · dout`
/// (`dw = inpᵀ · dout` unless `accumulate`), `dbias += column sums of dout`. Needs a backend
/// of `DType::Bf16`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward_weight_bf16_input(
    dtype: DType,
    dw: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[u16],
    n: usize,
    c: usize,
    oc: usize,
    accumulate: bool,
) {
    check("matmul dout", dout.len(), n * oc);
    check("matmul inp", inp.len(), n * c);
    check("matmul dw", dw.len(), c * oc);
    // safety: sizes checked; dw is a distinct &mut.
    unsafe {
        let (a, b, dw) = (
            Mat::rm_bf16(inp.as_ptr(), c).t(),
            Mat::rm(dout.as_ptr(), oc),
            Mat::rm(dw.as_mut_ptr(), oc),
        );
        match dbias {
            Some(db) => {
                check("matmul dbias", db.len(), oc);
                gemm_summing_b(dtype, (c, n, oc), a, b, dw, accumulate, &mut db[..oc])
            }
            None => gemm(dtype, c, n, oc, a, b, dw, accumulate, None, Epilogue::None),
        }
    }
}

/// Every row of the (m, n) matrix `c` becomes `b` (the bias, for the `matrixmultiply` path).
///
/// # Safety
/// `c` must describe a writable (m, n) matrix with unit column stride.
unsafe fn fill_rows(c: Mat, m: usize, n: usize, b: &[f32]) {
    for r in 0..m {
        // safety: row r of the caller's matrix.
        unsafe { std::slice::from_raw_parts_mut(c.at(r, 0), n) }.copy_from_slice(b);
    }
}

/// Backward of [`matmul_forward`]: `dinp = dout · wᵀ` (overwritten, skipped if None),
/// `dw += inpᵀ · dout` (`dw = inpᵀ · dout` unless `accumulate`, the same
/// bits as adding into zeros: see the module doc),
/// `dbias += column sums of dout` (always added).
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward(
    dtype: DType,
    dinp: Option<&mut [f32]>,
    dw: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    w: &[f32],
    n: usize,
    c: usize,
    oc: usize,
    accumulate: bool,
) {
    check("matmul dout", dout.len(), n * oc);
    check("matmul inp", inp.len(), n * c);
    check("matmul w", w.len(), c * oc);
    check("matmul dw", dw.len(), c * oc);
    let dout_m = Mat::rm(dout.as_ptr(), oc);
    // safety: sizes checked; outputs are distinct &mut slices.
    unsafe {
        if let Some(dinp) = dinp {
            check("matmul dinp", dinp.len(), n * c);
            gemm(
                dtype,
                n,
                oc,
                c,
                dout_m,
                Mat::rm(w.as_ptr(), oc).t(),
                Mat::rm(dinp.as_mut_ptr(), c),
                false,
                None,
                Epilogue::None,
            );
        }
        let (a, dw) = (Mat::rm(inp.as_ptr(), c).t(), Mat::rm(dw.as_mut_ptr(), oc));
        match dbias {
            Some(db) => {
                check("matmul dbias", db.len(), oc);
                gemm_summing_b(dtype, (c, n, oc), a, dout_m, dw, accumulate, &mut db[..oc])
            }
            None => gemm(
                dtype,
                c,
                n,
                oc,
                a,
                dout_m,
                dw,
                accumulate,
                None,
                Epilogue::None,
            ),
        }
    }
}

/// `dinp = dout · wᵀ` (overwritten): the input half of [`matmul_backward`], for callers whose
/// `dinp` buffer still holds the forward input the weight gradient needs (call it after).
pub fn matmul_backward_input(
    dtype: DType,
    dinp: &mut [f32],
    dout: &[f32],
    w: &[f32],
    n: usize,
    c: usize,
    oc: usize,
) {
    // SAFETY: no epilogue.
    unsafe { matmul_backward_input_with(dtype, dinp, dout, w, (n, c, oc), Epilogue::None) }
}

/// [`matmul_backward_input`] with `ep` applied to dinp as the kernels finish it: the fused
/// backward products of other modules (SwiGLU's).
///
/// # Safety
/// `ep`'s operands must hold what it reads and writes for an (N, C) dinp and overlap nothing
/// it does not read.
pub(super) unsafe fn matmul_backward_input_with(
    dtype: DType,
    dinp: &mut [f32],
    dout: &[f32],
    w: &[f32],
    (n, c, oc): (usize, usize, usize),
    ep: Epilogue,
) {
    check("matmul dout", dout.len(), n * oc);
    check("matmul w", w.len(), c * oc);
    check("matmul dinp", dinp.len(), n * c);
    // safety: sizes checked; dinp is a distinct &mut.
    unsafe {
        gemm(
            dtype,
            n,
            oc,
            c,
            Mat::rm(dout.as_ptr(), oc),
            Mat::rm(w.as_ptr(), oc).t(),
            Mat::rm(dinp.as_mut_ptr(), c),
            false,
            None,
            ep,
        );
    }
}

/// logits (N, V) = inp (N, C) · wᵀ with `w` (V, C): the LM head, nn.Linear layout, no bias.
pub fn head_forward(
    dtype: DType,
    out: &mut [f32],
    inp: &[f32],
    w: &[f32],
    n: usize,
    c: usize,
    v: usize,
) {
    check("head out", out.len(), n * v);
    check("head inp", inp.len(), n * c);
    check("head w", w.len(), v * c);
    // safety: sizes checked.
    unsafe {
        gemm(
            dtype,
            n,
            c,
            v,
            Mat::rm(inp.as_ptr(), c),
            Mat::rm(w.as_ptr(), c).t(),
            Mat::rm(out.as_mut_ptr(), v),
            false,
            None,
            Epilogue::None,
        )
    }
}

/// Backward of [`head_forward`]: `dinp = dout · w` (overwritten), `dw += doutᵀ · inp`
/// (`dw = doutᵀ · inp` unless `accumulate`, the same
/// bits as adding into zeros: see the module doc).
#[allow(clippy::too_many_arguments)]
pub fn head_backward(
    dtype: DType,
    dinp: &mut [f32],
    dw: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    w: &[f32],
    n: usize,
    c: usize,
    v: usize,
    accumulate: bool,
) {
    check("head dout", dout.len(), n * v);
    check("head inp", inp.len(), n * c);
    check("head w", w.len(), v * c);
    check("head dw", dw.len(), v * c);
    check("head dinp", dinp.len(), n * c);
    let dout_m = Mat::rm(dout.as_ptr(), v);
    // safety: sizes checked; outputs are distinct &mut slices.
    unsafe {
        gemm(
            dtype,
            n,
            v,
            c,
            dout_m,
            Mat::rm(w.as_ptr(), c),
            Mat::rm(dinp.as_mut_ptr(), c),
            false,
            None,
            Epilogue::None,
        );
        gemm(
            dtype,
            v,
            n,
            c,
            dout_m.t(),
            Mat::rm(inp.as_ptr(), c),
            Mat::rm(dw.as_mut_ptr(), c),
            accumulate,
            None,
            Epilogue::None,
        );
    }
}

/// `acc[j] += Σ_i x[i, j]` over the rows of `x` (row length `acc.len()`). Threads take column
/// blocks and each sums its rows in order, so the result is independent of the thread count.
pub fn column_sums(acc: &mut [f32], x: &[f32]) {
    let cols = acc.len();
    let rows = x.len() / cols;
    let parts = if rows * cols < 1 << 15 {
        1
    } else {
        rayon::current_num_threads()
    };
    let block = cols.div_ceil(parts).div_ceil(16) * 16;
    acc.par_chunks_mut(block).enumerate().for_each(|(p, a)| {
        column_sums_block(a, x, p * block, cols, rows);
    });
}

simd_fn! {
    fn column_sums_block(a: &mut [f32], x: &[f32], c0: usize, cols: usize, rows: usize) {
        let w = a.len();
        for r in 0..rows {
            let row = &x[r * cols + c0..r * cols + c0 + w];
            for (s, v) in a.iter_mut().zip(row) {
                *s += v;
            }
        }
    }
}

mod packed;
pub use packed::{packed_matmul_forward, PackedMatrix};

#[cfg(test)]
mod tests;

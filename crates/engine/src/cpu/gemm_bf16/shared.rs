//! Products split over threads with the operand every part reads packed once, by all the parts
//! together, as BLIS does. Split by rows, each part of C needs all of B (a layer's weight, in a
//! forward product) and, under bf16, split by columns all of A: packed per part, every thread
//! would pack the same panels for itself (the fp32 kernel never packs A, and packed B again
//! for each strip of 240 rows).
//!
//! Per K block of the product (most products take K whole: one block), two parallel phases:
//! the parts pack the shared block between them (B's panels, or A's rows), then each computes
//! its part of C over it, packing its own operand in its own thread's buffers as one thread
//! does. The pieces are the single-thread loop nests' own ([`Product`]'s methods for bf16,
//! `gemm`'s [`strips`] for fp32), so every element of C sums the same products in the same
//! order, K split where one thread splits it, the first block from the bias, the epilogue after
//! the last: the bits of one thread, whatever the split.
//!
//! It must never make a rayon task wait for another (no barrier inside a phase: rayon may run
//! every part on one thread, or a thread may be busy in a nested call), never allocate per call
//! (the shared buffers come from a pool, grown once, and go back to it), and it runs the bf16
//! product only on the zmm kernel: AMX keeps one product per part.

use std::sync::Mutex;

use rayon::prelude::*;

use super::{amx, with_packs, AOperand, ARows, Kernel, Line, Product, Strided, MR_AMX, NR};
use crate::cpu::epilogue::Epilogue;
use crate::cpu::gemm::{first_block, kc_for, pack_panel_of, strips, Panels, MC};

/// u32 in a shared buffer: the zmm kernel's largest block of B (2048 columns of 512 pairs,
/// 4 MB), which also bounds the rows of A packed for all parts at once.
const SHARED_U32: usize = 2048 * 512;

/// Shared buffers not in use, each of [`SHARED_U32`]: one per product in flight at a time
/// (a product run inside another's task takes a second one).
static POOL: Mutex<Vec<Vec<Line>>> = Mutex::new(Vec::new());

/// A buffer taken from [`POOL`], given back when dropped.
struct Buffer(Vec<Line>);

impl Buffer {
    /// A buffer of at least `u32s`.
    fn take(u32s: usize) -> Buffer {
        let mut v = POOL
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default();
        if v.len() < u32s / 16 {
            v.resize(u32s / 16, Line([0; 16]));
        }
        Buffer(v)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        POOL.lock().unwrap_or_else(|e| e.into_inner()).push(v);
    }
}

/// What the phases' tasks share: pointers to operands (only read), to C (of which each task
/// writes its own part), or into the shared buffer (of which the tasks of a phase write
/// disjoint parts, or which they only read).
#[derive(Clone, Copy)]
struct Shared<T>(T);
// SAFETY: as above.
unsafe impl<T> Send for Shared<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Shared<T> {}

impl<T: Copy> Shared<T> {
    /// The value (a method, so closures capture the whole wrapper, not the field).
    fn get(self) -> T {
        self.0
    }
}

// SAFETY: a product's descriptors are only read by the tasks, which write disjoint blocks of
// C (their parts of the split) and of `b_sums` (the columns each packs).
unsafe impl Sync for Product {}

/// Part q's share of `len` things packed in units of `unit` (B's panels, or A's rows in the
/// 16 that its transposing pack turns at a time).
fn share(len: usize, unit: usize, parts: usize, q: usize) -> (usize, usize) {
    let step = len.div_ceil(parts).div_ceil(unit) * unit;
    ((q * step).min(len), ((q + 1) * step).min(len))
}

/// One parallel phase: `f(q)` for each part q, returning when all are done (one part on the
/// calling thread, which may be outside any pool).
fn phase(parts: usize, f: impl Fn(usize) + Sync + Send) {
    if parts == 1 {
        f(0);
    } else {
        (0..parts).into_par_iter().for_each(f);
    }
}

/// The whole bf16 product of [`bgemm`](super::bgemm) (or `bgemm_bf16_a`'s, as `a` says),
/// split over `parts` rayon tasks, part q covering `split(q)`: rows of C where `by_rows`,
/// else columns. The operand every part reads (B by rows, A by columns) is packed once per
/// block, by all the parts. Returns false, having done nothing, where this does not apply (the
/// AMX kernel, K = 0): the caller then runs each part as a product of its own.
///
/// # Safety
/// As [`bgemm`](super::bgemm) for the whole (m, n) product; `split`'s ranges disjoint, within
/// m (or n), starting at multiples of 16 (of 32 under SwiGLU's interleaved order).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn bgemm_parts(
    parts: usize,
    split: &(dyn Fn(usize) -> (usize, usize) + Sync),
    by_rows: bool,
    (m, k, n): (usize, usize, usize),
    a: AOperand,
    b: Strided,
    (c, rsc): (*mut f32, usize),
    accumulate: bool,
    bias: Option<*const f32>,
    ep: Epilogue,
    b_sums: Option<*mut f32>,
) -> bool {
    let kernel = super::chosen_kernel().expect("bgemm called on a CPU without the bf16 product");
    if kernel != Kernel::Avx512 || k == 0 || parts < 2 {
        return false;
    }
    let p = Product {
        kernel,
        m,
        k,
        n,
        a,
        b,
        c,
        rsc,
        accumulate,
        bias,
        ep,
        b_sums,
    };
    let bl = kernel.blocking(k, n);
    debug_assert!(bl.nc * bl.kcp <= SHARED_U32 && kernel.buffers().1 <= SHARED_U32);
    let buffer = Buffer::take(SHARED_U32);
    let shared = Shared(buffer.0.as_ptr() as *mut u32);
    let blocks_of_k = |pc: usize| {
        let kc = (2 * bl.kcp).min(k - pc);
        (kc, p.stride(kc))
    };
    if by_rows {
        // Blocks of B as one thread packs them (at most nc x kcp u32, the buffer's size), a
        // range of its panels per part; each column's sum made by the one part that packs it.
        for jc in (0..n).step_by(bl.nc) {
            let nc = bl.nc.min(n - jc);
            for pc in (0..k).step_by(2 * bl.kcp) {
                let (kc, stride) = blocks_of_k(pc);
                phase(parts, |q| {
                    let (j0, j1) = share(nc, NR, parts, q);
                    if j0 < j1 {
                        // SAFETY: columns of this block of B, into their own panels of the
                        // shared buffer; AVX512_BF16 is present (a kernel was chosen).
                        unsafe {
                            p.pack_b_block(shared.get(), (pc, kc), jc, (j0, j1), stride, true)
                        };
                    }
                });
                phase(parts, |q| {
                    let rows = split(q);
                    if rows.0 >= rows.1 {
                        return;
                    }
                    with_packs(kernel, |pa, _| {
                        let mut scratch = amx::Scratch([0.0; MR_AMX * NR]);
                        let (a, pb) = (ARows::Pack(pa), shared.get());
                        // SAFETY: this part's rows of C over the block packed above; A's rows
                        // packed into this thread's buffer.
                        unsafe {
                            p.c_rows(&bl, rows, a, pb, (pc, kc), stride, (jc, nc), &mut scratch)
                        }
                    });
                });
            }
        }
    } else {
        // A's rows in chunks of at most the buffer's size (one chunk up to 2048 rows); each
        // part packs its columns of B once per chunk, adding B's sums with the first.
        let chunk = (SHARED_U32 / bl.kcp / bl.mc).max(1) * bl.mc;
        // (the tests' products are small: two blocks of rows, so that they cover chunks too)
        let chunk = if cfg!(test) {
            chunk.min(2 * bl.mc)
        } else {
            chunk
        };
        for pc in (0..k).step_by(2 * bl.kcp) {
            let (kc, stride) = blocks_of_k(pc);
            for i0 in (0..m).step_by(chunk) {
                let i1 = (i0 + chunk).min(m);
                phase(parts, |q| {
                    let (r0, r1) = share(i1 - i0, 16, parts, q);
                    if r0 < r1 {
                        // SAFETY: rows of this chunk of A, into their own rows of the shared
                        // buffer ((i1 - i0) x stride u32 fit); AVX512_BF16 is present.
                        unsafe {
                            let pa = shared.get().add(r0 * stride);
                            p.pack_a_rows(pa, (i0 + r0, i0 + r1), (pc, kc), stride)
                        };
                    }
                });
                phase(parts, |q| {
                    let (c0, c1) = split(q);
                    if c0 >= c1 {
                        return;
                    }
                    with_packs(kernel, |_, pb| {
                        let mut scratch = amx::Scratch([0.0; MR_AMX * NR]);
                        let a = ARows::Packed {
                            ptr: shared.get(),
                            first: i0,
                        };
                        for jc in (c0..c1).step_by(bl.nc) {
                            let nc = bl.nc.min(c1 - jc);
                            // SAFETY: this part's columns of B into this thread's buffer,
                            // then of C over the chunk of A packed above.
                            unsafe {
                                p.pack_b_block(pb, (pc, kc), jc, (0, nc), stride, i0 == 0);
                                let (ks, cols) = ((pc, kc), (jc, nc));
                                p.c_rows(&bl, (i0, i1), a, pb, ks, stride, cols, &mut scratch);
                            }
                        }
                    });
                });
            }
        }
    }
    drop(buffer);
    true
}

/// Floats of B packed for all parts of an fp32 product (2 MB): a K block's whole width up to
/// 512 columns at K 1024, else in blocks of columns. Every thread that runs an fp32 product
/// keeps one resident, so it is sized for memory: ZeRO-3's peak per rank on config G
/// (checkpointing, fp32) was 1,229.6 MB with 8 MB and is 1,226.4 with 2 MB, against DDP's 2,029
/// (the aim is 0.6x); config G's fp32 step took 0-1% longer, config B's no longer.
pub(super) const FP32_SHARED: usize = 1 << 19;

/// (rows of B per K block, columns per block) of [`sgemm_parts`] over a (k, n) B: blocks of
/// columns of nearly equal width (multiples of NR: of 32 under SwiGLU's order) that fit
/// [`FP32_SHARED`] at the K block's length.
pub(super) fn fp32_blocks(k: usize, n: usize) -> (usize, usize) {
    let kc_max = kc_for(k);
    let fit = FP32_SHARED / kc_max / NR * NR;
    // (the tests' products are small: blocks of 64 columns, so that they cover blocks too)
    let fit = if cfg!(test) { fit.min(2 * NR) } else { fit };
    (kc_max, n.div_ceil(n.div_ceil(fit)).div_ceil(NR) * NR)
}

/// [`sgemm`](crate::cpu::gemm::sgemm)'s product split over `parts` rayon tasks by rows, part q
/// covering rows `split(q)`: B's K blocks packed once, by all the parts, rather than by each
/// for each of its strips of rows (with one part, a one-thread product whose A has several
/// strips). Returns false, having done nothing, where this does not apply (a split by columns,
/// whose parts share no packing: A is never packed; K = 0): the caller then runs each part as
/// a product of its own.
///
/// # Safety
/// As `sgemm` for the whole (m, n) product; `split`'s ranges disjoint, within m.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn sgemm_parts(
    parts: usize,
    split: &(dyn Fn(usize) -> (usize, usize) + Sync),
    (m, k, n): (usize, usize, usize),
    a: Strided,
    b: Strided,
    (c, rsc): (*mut f32, usize),
    accumulate: bool,
    bias: Option<*const f32>,
    ep: Epilogue,
) -> bool {
    if (parts > 1 && m < n) || k == 0 || parts == 0 {
        return false;
    }
    let (kc_max, width) = fp32_blocks(k, n);
    let buffer = Buffer::take(FP32_SHARED);
    let shared = Shared(buffer.0.as_ptr() as *mut f32);
    let ops = Shared((a, b, c, bias));
    for j0 in (0..n).step_by(width) {
        let j1 = (j0 + width).min(n);
        for k0 in (0..k).step_by(kc_max) {
            let kc = kc_max.min(k - k0);
            phase(parts, |q| {
                let (_, b, _, _) = ops.get();
                let (p0, p1) = share(j1 - j0, NR, parts, q);
                for j in (j0 + p0..j0 + p1).step_by(NR) {
                    // SAFETY: panel (j - j0) / NR of the shared buffer (width x kc floats fit),
                    // this task's own, from B's block; AVX-512F is present (the caller's).
                    unsafe {
                        let pp = shared.get().add((j - j0) / NR * kc * NR);
                        pack_panel_of(pp, b, ep, (k0, kc), j, NR.min(j1 - j))
                    };
                }
            });
            let first = Shared(first_block(k0, accumulate, bias));
            let last = (k0 + kc == k).then_some(ep);
            phase(parts, |q| {
                let rows = split(q);
                let ((a, _, c, _), (acc, bias)) = (ops.get(), first.get());
                if rows.0 < rows.1 {
                    let panels = Panels::Packed {
                        ptr: shared.get(),
                        step: kc * NR,
                        first: j0,
                    };
                    // SAFETY: this part's rows of C, columns j0..j1, over the panels packed
                    // above.
                    unsafe {
                        strips(
                            rows,
                            MC,
                            (k0, kc),
                            a,
                            panels,
                            c,
                            rsc,
                            (j0, j1),
                            acc,
                            bias,
                            last,
                        )
                    };
                }
            });
        }
    }
    drop(buffer);
    true
}

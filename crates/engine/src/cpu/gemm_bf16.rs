//! The bf16 matrix product behind `DType::Bf16`: f32 operands rounded to bf16 as they are
//! packed, products summed in f32 by the AVX512_BF16 dot-product instruction (VDPBF16PS), which
//! does two multiply-adds per f32 lane and so twice the fp32 FMA's work per instruction. This is
//! what PyTorch's CPU autocast does to a Linear layer: bf16 inputs, f32 accumulation, an f32
//! result.
//!
//! The instruction multiplies *pairs*: lane j of the accumulator gets a[2p]·b[2p][j] +
//! a[2p+1]·b[2p+1][j]. So both operands are packed as pairs along K, one u32 per pair:
//! - A, `[row][pair]` per block of MC rows and KC columns, so the kernel broadcasts one row's
//!   pair to all lanes;
//! - B, `[panel][pair][NR]` per block of KC rows and NC columns, each micro-panel (pairs x 32
//!   columns) contiguous so it stays in L1 while the A micro-panels stream past.
//!
//! The loops are BLIS's: NC columns of B (in L3), KC rows of them packed, MC rows of A packed (in
//! L2), then NR x MR register tiles (the AMX kernel takes a strip of 32 rows across a sweep of
//! panels before the next strip, so that C is written a row at a time). Packing converts with
//! the rounding instruction (round-to-nearest-even), vectorised for both unit-stride layouts the
//! model uses; a transposed operand goes through a 16 x 16 register transpose. An odd K is
//! padded with a zero pair half.
//!
//! Each output element sums its K in the same order whatever block of C a call covers, so the
//! result does not depend on how C is split over threads. The packing buffers are per thread,
//! grown once to their fixed block sizes and reused: no allocation per call after the first.
//! Split over threads, the operand every thread reads is packed once for all of them
//! ([`shared`]), by the same pieces of the loop nest.

use std::arch::x86_64::*;
use std::cell::RefCell;

pub(crate) mod amx;
mod pack;
#[doc(hidden)]
pub mod rates;
mod shared;

use super::epilogue::Epilogue;
use super::gemm::{bias_row, prefetch_run, store_row, Strided};
use pack::pack_b_halves;
pub(crate) use pack::{lanes, pack_a, pack_a_bf16, pack_b, pack_b_bf16, pairs_of};
pub(crate) use shared::{bgemm_parts, sgemm_parts};

/// A strided operand of bf16 elements (their bits): element (r, c) at `ptr[r * rs + c * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct StridedBf16 {
    pub(crate) ptr: *const u16,
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

/// The left operand: f32, rounded to bf16 as it is packed, or bf16 already (an activation
/// kept in bf16), copied as it is packed. Both give the same bits for the same bf16 values.
#[derive(Clone, Copy)]
pub(crate) enum AOperand {
    F32(Strided),
    Bf16(StridedBf16),
}

/// Columns of a register tile (two zmm registers, or two AMX tiles).
pub(crate) const NR: usize = 32;
/// Rows of the AVX-512 register tile.
const MR: usize = 12;
/// Rows of the AMX tile block: two tiles of 16 rows.
const MR_AMX: usize = 32;

/// Pairs of K per block of the zmm kernel where K is split.
const AVX512_KCP: usize = 256;
/// Up to this many pairs of K (1024 of K) the zmm kernel takes K in one block.
const AVX512_WHOLE_KCP: usize = 512;

/// Pairs per K block of the zmm kernel for a K of `kp` pairs: all of them up to
/// [`AVX512_WHOLE_KCP`], else [`AVX512_KCP`]. Where K is split decides a result's bits (each
/// block's sum is added to C), so every caller of [`tile`] on one product splits it here.
fn avx512_kcp(kp: usize) -> usize {
    if kp <= AVX512_WHOLE_KCP {
        kp
    } else {
        AVX512_KCP
    }
}

/// Which instruction computes the products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// AVX512_BF16's VDPBF16PS on zmm registers: a 12 x 32 tile, 2 x fp32's multiply-adds per
    /// instruction (AMD Zen 4/5, Intel Cooper Lake and later).
    Avx512,
    /// AMX tiles (TDPBF16PS): a 32 x 32 block of four 16 x 16 f32 tiles, 8192 multiply-adds per
    /// instruction (Intel Sapphire Rapids and later).
    Amx,
}

/// Block sizes of one kernel, in K pairs, rows of A and columns of B.
struct Blocking {
    /// Pairs of K per packed block.
    kcp: usize,
    /// Rows of A per packed block (a multiple of the kernel's rows).
    mc: usize,
    /// Columns of B per packed block (a multiple of NR).
    nc: usize,
}

/// u32 of packed B that the AMX kernel sweeps with each strip of A's rows (1 MB): it stays
/// in L2 beside A's block.
const AMX_SWEEP_B_BUDGET: usize = 1 << 18;
/// u32 of packed A per block under AMX (512 KB): as many rows as fit share each B micro-panel.
const AMX_A_BUDGET: usize = 1 << 17;
/// u32 of packed B per block under AMX (4 MB). Against 256 KB and 1 MB (both blocks in L2),
/// weight gradients (K = 2048) ran 20-30% faster and the rest no slower: reusing each B panel
/// over more rows of A matters more than keeping all of B in L2.
const AMX_B_BUDGET: usize = 1 << 20;
/// Above this many bytes of B packed at full K (all of the product's columns), AMX K blocks are
/// [`AMX_SHORT_KCP`] pairs long: see [`Kernel::blocking`].
const AMX_SHORT_K_ABOVE: usize = 3 << 19;
/// Pairs of K per block when B is wide (512 of K).
const AMX_SHORT_KCP: usize = 256;

impl Kernel {
    /// The blocks for a product of inner dimension `k` whose whole output (before any split
    /// over threads, so that the split never changes a result's bits) has `n_whole` columns.
    fn blocking(self, k: usize, n_whole: usize) -> Blocking {
        match self {
            // Up to K = 1024, K whole: a micro-panel of B is up to 512 pairs x 32 columns =
            // 64 KB (L2) and A's block 384 KB (L2), and each element of C is written once
            // rather than once per K block (see the fp32 kernel's `KC_WHOLE`: config G's block
            // products 76-77% -> 79-82% of VDPBF16PS's peak, one thread, Zen 5; its LM head's
            // forward 367-371 -> 441-453 GFLOP/s). Longer K in blocks of 256 pairs (32 KB, L1).
            Kernel::Avx512 => Blocking {
                kcp: avx512_kcp(k.div_ceil(2)),
                mc: 192,
                nc: 2048,
            },
            // AMX consumes a K block 20x faster than the zmm kernel, so what limits it is
            // memory: the blocks are sized to K within the budgets above, and the K blocks are
            // long (C's tiles go through memory once per block).
            // Where all of B packed at full K would not stay in L2 beside A's block, the K
            // blocks are shorter: a strip of A (32 rows of 256 pairs, 32 KB) then stays in L1
            // and one block of A's rows covers more of them, so B's panels are read from beyond
            // L2 fewer times, for one more pass of C per K block. On config B's weight
            // gradients (K = 2048) and most of config G's products that was 10-35% faster;
            // where B fits (config B's products of K 1152 and 1536 into 384 columns) it was
            // 10-20% slower, hence the test on B's size.
            Kernel::Amx => {
                let full = k.div_ceil(32).clamp(1, 64) * 16;
                let kcp = if n_whole * full * 4 > AMX_SHORT_K_ABOVE {
                    full.min(AMX_SHORT_KCP)
                } else {
                    full
                };
                Blocking {
                    kcp,
                    mc: (AMX_A_BUDGET / kcp / MR_AMX).clamp(1, 64) * MR_AMX,
                    nc: (AMX_B_BUDGET / kcp / NR).max(1) * NR,
                }
            }
        }
    }

    /// The packing buffers' sizes in u32 (A, B): the largest blocks of any K.
    fn buffers(self) -> (usize, usize) {
        match self {
            Kernel::Avx512 => {
                let bl = self.blocking(2 * AVX512_WHOLE_KCP, 0);
                (bl.mc * bl.kcp, bl.nc * bl.kcp)
            }
            // Every AMX blocking stays within the budgets, plus one A block of 32 rows for K
            // blocks so long that the budget holds fewer.
            Kernel::Amx => (AMX_A_BUDGET + MR_AMX * 1024, AMX_B_BUDGET + NR * 1024),
        }
    }
}

/// A 64-byte line of packed pairs: the buffers are vectors of these, so every micro-panel is
/// aligned for the kernel's loads.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Line(pub(crate) [u32; 16]);

/// One thread's packing buffers.
struct Packs {
    a: Vec<Line>,
    b: Vec<Line>,
}

thread_local! {
    static PACKS: RefCell<Packs> = const { RefCell::new(Packs { a: Vec::new(), b: Vec::new() }) };
}

/// The kernel this process uses: AMX where the CPU has it and Linux grants this process its
/// tile state (`COHORT_AMX=0` turns it off), else AVX512_BF16, else none.
pub(crate) fn chosen_kernel() -> Option<Kernel> {
    static KERNEL: std::sync::OnceLock<Option<Kernel>> = std::sync::OnceLock::new();
    *KERNEL.get_or_init(|| {
        if !avx512_bf16() {
            return None;
        }
        let off = std::env::var("COHORT_AMX").is_ok_and(|v| v.trim() == "0");
        if !off && amx_granted() {
            Some(Kernel::Amx)
        } else {
            Some(Kernel::Avx512)
        }
    })
}

/// Whether this CPU runs the bf16 product (AVX-512F, AVX-512BW and AVX512_BF16).
pub(crate) fn supported() -> bool {
    chosen_kernel().is_some()
}

fn avx512_bf16() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512bf16")
}

/// Whether the CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22) and Linux lets
/// this process use the tile registers: their 8 KB of state is off until a process asks for it
/// (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), once, for all its threads.
fn amx_granted() -> bool {
    // CPUID leaf 7 exists on every x86-64 CPU with AVX-512, checked by the caller.
    let leaf7 = __cpuid_count(7, 0);
    if (leaf7.edx >> 24) & 1 == 0 || (leaf7.edx >> 22) & 1 == 0 {
        return false;
    }
    #[cfg(target_os = "linux")]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with this request only changes the process's permission to use
        // the AMX register state; it reads and writes no memory of ours.
        let r = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        r == 0
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// `c (m, n) = a (m, k) · b (k, n) + bias (n)` or, with `accumulate`, `c += a · b` (bias
/// unused), with a and b rounded to bf16 and the sums kept in f32. `c` is row-major with row
/// stride `rsc`. `ep` finishes each block of c once its sums are final. `n_whole` is the
/// columns of the whole product this call is a part of (its own n when it is all of it): the
/// blocking depends on it, never on the part. With `b_sums` (n floats), each column's sum over
/// b's k rows is added to it, row by row in order (the bits of
/// [`column_sums`](super::column_sums)), by the pass that packs b: a layer's bias gradient, from
/// the weight gradient's read of the output gradient, instead of a pass of its own over a
/// matrix that is beyond the caches.
///
/// # Safety
/// [`supported`] must be true; the operands must describe valid matrices of these sizes; `c`
/// must be writable and not overlap `a`, `b` or `bias`; `ep`'s operand must hold an (m, n)
/// matrix.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn bgemm(
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
    n_whole: usize,
    b_sums: Option<*mut f32>,
) {
    let kernel = chosen_kernel().expect("bgemm called on a CPU without the bf16 product");
    let a = AOperand::F32(a);
    // SAFETY: forwarded from the caller; `kernel` is what this CPU supports.
    unsafe {
        bgemm_with(
            kernel, m, k, n, a, b, c, rsc, accumulate, bias, ep, n_whole, b_sums,
        )
    }
}

/// [`bgemm`] with a left operand already in bf16.
///
/// # Safety
/// As [`bgemm`], `a` describing an (m, k) matrix of bf16 bits.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn bgemm_bf16_a(
    m: usize,
    k: usize,
    n: usize,
    a: StridedBf16,
    b: Strided,
    c: *mut f32,
    rsc: usize,
    accumulate: bool,
    bias: Option<*const f32>,
    ep: Epilogue,
    n_whole: usize,
    b_sums: Option<*mut f32>,
) {
    let kernel = chosen_kernel().expect("bgemm called on a CPU without the bf16 product");
    let a = AOperand::Bf16(a);
    // SAFETY: forwarded from the caller; `kernel` is what this CPU supports.
    unsafe {
        bgemm_with(
            kernel, m, k, n, a, b, c, rsc, accumulate, bias, ep, n_whole, b_sums,
        )
    }
}

/// [`bgemm`] on a chosen kernel (the tests run each one the CPU has).
///
/// # Safety
/// As [`bgemm`], and the CPU (and OS, for AMX) must support `kernel`.
#[allow(clippy::too_many_arguments)]
unsafe fn bgemm_with(
    kernel: Kernel,
    m: usize,
    k: usize,
    n: usize,
    a: AOperand,
    b: Strided,
    c: *mut f32,
    rsc: usize,
    accumulate: bool,
    bias: Option<*const f32>,
    ep: Epilogue,
    n_whole: usize,
    b_sums: Option<*mut f32>,
) {
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    // SAFETY: inside c and bias per the contract.
                    unsafe { *c.add(i * rsc + j) = bias.map_or(0.0, |b| *b.add(j)) };
                }
            }
        }
        // SAFETY: the whole of c, per the contract.
        unsafe { ep.apply(c, rsc, m, n) };
        return;
    }
    let bl = kernel.blocking(k, n_whole);
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
    // SAFETY: the buffers hold mc x kcp and nc x kcp u32 of this kernel's blocking, the
    // largest blocks packed below; the caller's contract covers the rest.
    with_packs(kernel, |pa, pb| unsafe { blocks(&p, &bl, pa, pb) })
}

/// Runs `f` on this thread's packing buffers (A, B), grown once to `kernel`'s largest blocks.
/// `f` must not call into rayon (a task run meanwhile on this thread would find them taken).
fn with_packs<R>(kernel: Kernel, f: impl FnOnce(*mut u32, *mut u32) -> R) -> R {
    PACKS.with(|packs| {
        let mut packs = packs.borrow_mut();
        let packs = &mut *packs;
        let (a_len, b_len) = kernel.buffers();
        for (buf, len) in [(&mut packs.a, a_len), (&mut packs.b, b_len)] {
            if buf.len() < len / 16 {
                buf.resize(len / 16, Line([0; 16]));
            }
        }
        f(
            packs.a.as_mut_ptr() as *mut u32,
            packs.b.as_mut_ptr() as *mut u32,
        )
    })
}

/// One product's operands and options, as [`bgemm_with`] takes them (for the whole product,
/// not a thread's part of it): what every piece of the loop nest reads.
#[derive(Clone, Copy)]
struct Product {
    kernel: Kernel,
    m: usize,
    k: usize,
    n: usize,
    a: AOperand,
    b: Strided,
    c: *mut f32,
    rsc: usize,
    accumulate: bool,
    bias: Option<*const f32>,
    ep: Epilogue,
    b_sums: Option<*mut f32>,
}

/// Where the packed rows of A for a block of C come from.
#[derive(Clone, Copy)]
enum ARows {
    /// Packed here, a block of MC rows at a time, into this buffer (the thread's own).
    Pack(*mut u32),
    /// Packed already, for every part of the product ([`shared`]): row i at
    /// `ptr + (i - first) · stride`.
    Packed { ptr: *const u32, first: usize },
}

/// The BLIS loop nest over packed blocks (see the module doc), on one thread.
///
/// # Safety
/// As [`bgemm_with`] for `p`, `bl` its blocking, plus `pa` and `pb` writable for mc x kcp and
/// nc x kcp u32 of `bl`, 64-byte aligned.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn blocks(p: &Product, bl: &Blocking, pa: *mut u32, pb: *mut u32) {
    let amx = p.kernel == Kernel::Amx;
    if amx {
        // SAFETY: the tile configuration is this thread's; AMX was granted to the process.
        unsafe { amx::configure() };
    }
    // C tiles go through this buffer on their way to C under AMX.
    let mut scratch = amx::Scratch([0.0; MR_AMX * NR]);
    for jc in (0..p.n).step_by(bl.nc) {
        let nc = bl.nc.min(p.n - jc);
        for pc in (0..p.k).step_by(2 * bl.kcp) {
            let kc = (2 * bl.kcp).min(p.k - pc);
            let stride = p.stride(kc);
            // SAFETY: the block is inside B and C; the buffers hold it, per the contract.
            unsafe {
                p.pack_b_block(pb, (pc, kc), jc, (0, nc), stride, true);
                let a = ARows::Pack(pa);
                p.c_rows(
                    bl,
                    (0, p.m),
                    a,
                    pb,
                    (pc, kc),
                    stride,
                    (jc, nc),
                    &mut scratch,
                );
            }
        }
    }
    if amx {
        amx::release();
    }
}

impl Product {
    /// Row stride of a K block of `kc`'s packed pairs: AMX loads 16 pairs at a time, so its
    /// rows are padded with zero pairs to a multiple of 16.
    fn stride(&self, kc: usize) -> usize {
        if self.kernel == Kernel::Amx {
            kc.div_ceil(32) * 16
        } else {
            kc.div_ceil(2)
        }
    }

    /// Packs columns `jc + j0..jc + j1` (j0 a multiple of NR) of B's K rows `pc..pc + kc` into
    /// `pb`'s panels from j0 / NR on; with `sums`, adds those rows to the columns' `b_sums`.
    ///
    /// # Safety
    /// AVX512_BF16 present; the rows and columns inside B; `pb` holding the block's panels,
    /// 64-byte aligned; no other pack of the same columns of `b_sums` at the same time.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn pack_b_block(
        &self,
        pb: *mut u32,
        (pc, kc): (usize, usize),
        jc: usize,
        (j0, j1): (usize, usize),
        stride: usize,
        sums: bool,
    ) {
        let (b, j, nc) = (self.b, jc + j0, j1 - j0);
        // SAFETY: per the contract.
        unsafe {
            let pb = pb.add(j0 * stride);
            match self.ep.b_halves() {
                // SwiGLU's interleaved columns: column j (a multiple of 32) starts at B's
                // gate column j / 2 (see `Epilogue::b_halves`).
                Some(half) => pack_b_halves(pb, b.at(pc, j / 2), b.rs, kc, nc, stride, half),
                None => {
                    let sums = self.b_sums.filter(|_| sums).map(|s| s.add(j));
                    pack_b(pb, b.at(pc, j), b.rs, b.cs, kc, nc, stride, sums)
                }
            }
        }
    }

    /// Packs A's rows `i0..i1`, K `pc..pc + kc`, into `pa` (row i0 first, `stride` u32 apart).
    ///
    /// # Safety
    /// AVX512_BF16 present; the rows inside A; `pa` (i1 - i0) x stride writable u32.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn pack_a_rows(
        &self,
        pa: *mut u32,
        (i0, i1): (usize, usize),
        (pc, kc): (usize, usize),
        stride: usize,
    ) {
        // SAFETY: per the contract.
        unsafe {
            match self.a {
                AOperand::F32(a) => pack_a(pa, a.at(i0, pc), a.rs, a.cs, i1 - i0, kc, stride),
                AOperand::Bf16(a) => pack_a_bf16(pa, a.at(i0, pc), a.rs, a.cs, i1 - i0, kc, stride),
            }
        }
    }

    /// C's rows `r0..r1`, columns `jc..jc + nc`, over K block `pc..pc + kc`: B's block packed
    /// at `pb`, A's rows from `a` (packed here MC rows at a time, or already). The first K block
    /// starts C from the bias (or zero) unless accumulating; after the last, the epilogue.
    ///
    /// # Safety
    /// AVX512_BF16 present (AMX configured under it); the block inside C; `pb` B's packed
    /// block, `a`'s buffer per [`ARows`] (MC x kcp u32 to pack into).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn c_rows(
        &self,
        bl: &Blocking,
        (r0, r1): (usize, usize),
        a: ARows,
        pb: *const u32,
        (pc, kc): (usize, usize),
        stride: usize,
        (jc, nc): (usize, usize),
        scratch: &mut amx::Scratch,
    ) {
        let (c, rsc, ep) = (self.c, self.rsc, self.ep);
        let amx = self.kernel == Kernel::Amx;
        // Under AMX, columns of a packed block of B per sweep of A's strips: what stays in L2
        // beside A's block (see below).
        let sweep = (AMX_SWEEP_B_BUDGET / bl.kcp / NR).max(1) * NR;
        let last = pc + kc == self.k;
        let (acc, bias) = if pc == 0 && !self.accumulate {
            (false, self.bias.map(|b| b.wrapping_add(jc)))
        } else {
            (true, None)
        };
        // SAFETY: for the whole body, every pointer offset stays inside C's block, the caller's
        // bias and the packed blocks, per the contract.
        unsafe {
            for ic in (r0..r1).step_by(bl.mc) {
                let mc = bl.mc.min(r1 - ic);
                let pa = match a {
                    ARows::Pack(pa) => {
                        self.pack_a_rows(pa, (ic, ic + mc), (pc, kc), stride);
                        pa as *const u32
                    }
                    ARows::Packed { ptr, first } => ptr.add((ic - first) * stride),
                };
                if amx {
                    // Strips of 32 rows across a sweep of B's panels, then the next
                    // strip: C is written row by row, a run of the sweep's width in each
                    // row, which the hardware prefetchers follow (going down 32-row blocks
                    // of one panel instead writes 128 bytes to each of 32 distant rows,
                    // and those misses cost as much as the products on config B's
                    // shapes). A strip of C is final at the end of its last K block and
                    // gets its epilogue while it is in cache. The sweep's panels (1 MB)
                    // stay in L2 beside A's block; one strip of A stays in L1.
                    for js in (0..nc).step_by(sweep) {
                        let ns = sweep.min(nc - js);
                        for ir in (0..mc).step_by(MR_AMX) {
                            let rows = MR_AMX.min(mc - ir);
                            let ap = pa.add(ir * stride);
                            for jr in (js..js + ns).step_by(NR) {
                                let nr = NR.min(nc - jr);
                                let cp = c.add((ic + ir) * rsc + jc + jr);
                                let bias = bias.map(|b| b.add(jr));
                                let panel = pb.add(jr * stride);
                                amx::block(
                                    stride, ap, panel, cp, rsc, rows, nr, acc, bias, scratch,
                                );
                            }
                            if last {
                                let cp = c.add((ic + ir) * rsc + jc + js);
                                ep.at(ic + ir, jc + js).apply(cp, rsc, rows, ns);
                            }
                        }
                    }
                } else {
                    // BLIS's order: each micro-panel of B stays in L1 while A's stream by.
                    for jr in (0..nc).step_by(NR) {
                        let nr = NR.min(nc - jr);
                        let panel = pb.add(jr * stride);
                        for ir in (0..mc).step_by(MR) {
                            let rows = MR.min(mc - ir);
                            let (ap, cp) = (pa.add(ir * stride), c.add((ic + ir) * rsc + jc + jr));
                            let bias = bias.map(|b| b.add(jr));
                            tile(rows, stride, ap, stride, panel, cp, rsc, nr, acc, bias);
                        }
                    }
                    if last {
                        let cp = c.add(ic * rsc + jc);
                        ep.at(ic, jc).apply(cp, rsc, mc, nc);
                    }
                }
            }
        }
    }
}

impl Strided {
    /// Pointer to element (r, c).
    fn at(self, r: usize, c: usize) -> *const f32 {
        self.ptr.wrapping_add(r * self.rs + c * self.cs)
    }
}

impl StridedBf16 {
    /// Pointer to element (r, c).
    fn at(self, r: usize, c: usize) -> *const u16 {
        self.ptr.wrapping_add(r * self.rs + c * self.cs)
    }
}

/// Which part of a [`zmm_product`] each row needs.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Upto {
    /// Row i needs only its first `d + i + 1` columns (a causal mask's visible scores): the
    /// others are left as they were.
    Cols(usize),
    /// Row i has zeros past its first `d + i + 1` elements of K (causal probabilities): its
    /// sum stops there. Dropping zero products from the end of a sum that starts at +0 leaves
    /// its bits as they are, and K is still split where the whole K would be.
    K(usize),
    /// Row i has zeros in its first `i - d` elements of K (a strip's causal probabilities,
    /// transposed): its sum starts after them. Zero products at the start of a sum from +0
    /// leave it +0, so its bits are as they were. Only where K is not split.
    KFrom(usize),
}

/// `c[0..m, 0..n] (+)= a · b` on the zmm kernel over operands packed once by the caller: `a`
/// as rows of pairs `rsa` u32 apart (the first `kp` read), `b` as micro-panels of `bstride`
/// pairs x NR columns (panel j at `b + j · NR · bstride`, its first `kp` pairs read). K is
/// split in blocks as [`bgemm`] splits a K of `kp` pairs and every element sums its pairs in
/// the same order, so the result has `bgemm`'s bits for the same operands; the first block
/// writes C unless `acc`. For products too small for `bgemm`'s packing to pay (attention's
/// per-head products, packed once per head).
///
/// # Safety
/// AVX512_BF16 must be present; `a` m rows of at least kp u32 at row stride rsa; `b`
/// ⌈n/NR⌉ panels of bstride (≥ kp) x NR u32, 64-byte aligned; `c` m x n writable floats at row
/// stride rsc, not overlapping the rest.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn zmm_product(
    kp: usize,
    a: *const u32,
    rsa: usize,
    b: *const u32,
    bstride: usize,
    c: *mut f32,
    rsc: usize,
    m: usize,
    n: usize,
    acc: bool,
    upto: Upto,
) {
    if m == 0 || n == 0 {
        return;
    }
    // Rows in ⌈m/MR⌉ tiles of nearly equal height (64 rows as 11,11,11,11,10,10 rather than
    // 12 x 5 + 4: a short tile broadcasts as much B per multiply-add as it does work).
    let tiles = m.div_ceil(MR);
    let kcp = avx512_kcp(kp);
    let mut i = 0;
    for t in 0..tiles {
        let rows = (m - i) / (tiles - t);
        // The columns and pairs of K this tile's rows need.
        let (n, kp, from) = match upto {
            Upto::Cols(d) => (n.min(d + i + rows), kp, 0),
            Upto::K(d) => (n, kp.min((d + i + rows).div_ceil(2)), 0),
            // (a pair that starts before i - d may hold a nonzero element)
            Upto::KFrom(d) if kcp == kp => (n, kp, (i.saturating_sub(d) / 2).min(kp)),
            Upto::KFrom(_) => (n, kp, 0),
        };
        if from == kp {
            // nothing but zeros: the sums are +0
            if !acc {
                for r in 0..rows {
                    // SAFETY: row i + r < m of c, its first n columns, per the contract.
                    unsafe { std::slice::from_raw_parts_mut(c.add((i + r) * rsc), n).fill(0.0) };
                }
            }
            i += rows;
            continue;
        }
        for p0 in (from..kp).step_by(kcp) {
            let kc = kcp.min(kp - p0);
            for j in (0..n).step_by(NR) {
                // SAFETY: rows i..i + rows < m of a and c, pairs p0..p0 + kc ≤ kp, and panel
                // j / NR of b, per the contract.
                unsafe {
                    tile(
                        rows,
                        kc,
                        a.add(i * rsa + p0),
                        rsa,
                        b.add(j * bstride + p0 * NR),
                        c.add(i * rsc + j),
                        rsc,
                        NR.min(n - j),
                        acc || p0 > from,
                        None,
                    )
                };
            }
        }
        i += rows;
    }
}

/// One register tile of `rows` (1..=MR) rows, dispatched to its monomorphised kernel.
///
/// # Safety
/// As [`kernel`], with R = `rows`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile(
    rows: usize,
    kcp: usize,
    a: *const u32,
    rsa: usize,
    b: *const u32,
    c: *mut f32,
    rsc: usize,
    nr: usize,
    acc: bool,
    bias: Option<*const f32>,
) {
    macro_rules! by_rows {
        ($($r:literal)*) => {
            match rows {
                // SAFETY: forwarded from the caller.
                $($r => unsafe { kernel::<$r>(kcp, a, rsa, b, c, rsc, nr, acc, bias) },)*
                _ => unreachable!("tile rows {rows} outside 1..={MR}"),
            }
        };
    }
    by_rows!(1 2 3 4 5 6 7 8 9 10 11 12)
}

/// c[0..R, 0..nr] (+)= a[0..R] · panel over `kcp` pairs; row i's pairs at `a + i * rsa`.
///
/// # Safety
/// AVX512_BF16 must be present; `a` R rows of kcp u32 at row stride rsa; `b` a packed panel of
/// kcp x NR u32, 64-byte aligned; `c` R rows of nr writable floats at row stride rsc, not
/// overlapping the rest; `bias`, if any, nr readable floats.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel<const R: usize>(
    kcp: usize,
    a: *const u32,
    rsa: usize,
    b: *const u32,
    c: *mut f32,
    rsc: usize,
    nr: usize,
    acc: bool,
    bias: Option<*const f32>,
) {
    let mut c0 = [_mm512_setzero_ps(); R];
    let mut c1 = [_mm512_setzero_ps(); R];
    // SAFETY: pointer ranges per the contract above; the transmutes reinterpret 512-bit
    // vectors of pairs as the instruction's bf16 vector type.
    unsafe {
        // The tile's rows of C are asked for now and read (or written) after the K loop's
        // thousands of cycles: rows kilobytes apart, which no hardware prefetcher follows
        // (the LM head's forward over 4096 words, C of 32 MB: about 310 -> 420 GFLOP/s).
        for i in 0..R {
            prefetch_run(c.add(i * rsc) as *const u8, 4 * nr);
        }
        let (mut ap, mut bp) = (a, b);
        for _ in 0..kcp {
            let b0 =
                std::mem::transmute::<__m512i, __m512bh>(_mm512_load_si512(bp as *const __m512i));
            let b1 = std::mem::transmute::<__m512i, __m512bh>(_mm512_load_si512(
                bp.add(16) as *const __m512i
            ));
            for i in 0..R {
                let av = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(
                    *ap.add(i * rsa) as i32,
                ));
                c0[i] = _mm512_dpbf16_ps(c0[i], av, b0);
                c1[i] = _mm512_dpbf16_ps(c1[i], av, b1);
            }
            ap = ap.add(1);
            bp = bp.add(NR);
        }
        let bias = bias_row(bias, nr);
        for i in 0..R {
            store_row(c.add(i * rsc), nr, (c0[i], c1[i]), acc, bias);
        }
    }
}

#[cfg(test)]
mod tests;

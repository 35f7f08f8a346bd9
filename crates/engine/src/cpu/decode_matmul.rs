//! The matrix products of a decode step against weights kept in a compact format: bf16, or
//! 8-bit blocks as llama.cpp's Q8_0. A decode step multiplies a few rows (one per stream) by
//! every weight matrix, so it reads each weight once per token and does two flops per weight
//! read: its speed is the memory's, and half (bf16) or about a quarter (Q8) of fp32's bytes is
//! up to that much faster.
//!
//! [`DecodeMatrix`] is a weight matrix kept output-major, (OC, C) with each row padded with
//! zeros to a multiple of 32, in one of the [`DecodeFormat`]s; [`decode_matmul_forward`]
//! computes out (N, OC) = inp (N, C) · Wᵀ + bias with it:
//! - **bf16**: each input row is rounded to bf16 (to nearest even; once per call, into a
//!   per-thread buffer, where the CPU has AVX512_BF16, rather than again for every output row)
//!   and the products are summed in f32, by AVX512_BF16's VDPBF16PS where the CPU has it (16
//!   lanes, two products each; the lanes then summed by `_mm512_reduce_add_ps`), else by
//!   portable code
//!   (the same pairs in the same lanes, summed in a fixed tree). Products of two bf16 are exact
//!   in f32, but the instruction flushes subnormals and the two paths add lanes in different
//!   orders: the results agree to rounding, not to the bit.
//! - **Q8**: each row of W in blocks of 32 int8 with an f32 scale (max |w| / 127); each input
//!   row is quantised the same way when the call starts. A block's dot product is exact in
//!   int32 (AVX512-VNNI's VPDPBUSD on |x| and w·sign(x), else AVX2's VPMADDUBSW and VPMADDWD,
//!   else plain code: the same eight partial sums), turned to f32 and multiplied-added with
//!   the two scales into eight f32 lanes, summed in a fixed tree at the end: every path gives
//!   the same bits.
//!
//! Each output element is computed the same way whatever rows share the call and however the
//! outputs are split over threads, so a stream decoded in a batch gets the logits it gets
//! alone, and no result depends on the number of threads. Deterministic on one machine; the
//! bf16 path may differ in the last bits between a CPU with AVX512_BF16 and one without.
//!
//! It never allocates per call after the first on a thread (the quantised input rows of Q8
//! live in a per-thread buffer grown once, taken for a call and put back) and never changes
//! the weights.

use std::cell::RefCell;

use rayon::prelude::*;

use super::bf16::{bf16_bits, bf16_to_f32};
use super::SendPtr;

/// Elements per block: a bf16 row is padded to a multiple of it, a Q8 block holds it.
const BLOCK: usize = 32;
/// Output rows converted together when a matrix is made (a transpose reads runs of this many
/// floats from each input row).
const BUILD_ROWS: usize = 64;
/// Output rows a part of a product's split over threads takes at least.
const TILE: usize = 4;

/// The number format of a [`DecodeMatrix`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DecodeFormat {
    /// bf16, rounded to nearest even: 2 bytes a weight.
    Bf16,
    /// Blocks of 32 int8 with an f32 scale each (llama.cpp's Q8_0 with an f32 scale):
    /// 1.125 bytes a weight.
    Q8,
}

/// A weight matrix kept for decode-time products: output-major (OC, C), each row padded with
/// zeros to `cp` (a multiple of 32) elements.
pub struct DecodeMatrix {
    oc: usize,
    c: usize,
    cp: usize,
    data: Data,
}

enum Data {
    /// (OC, cp) bf16 bits, from `buf[at]` (the first element on a 64-byte boundary, so
    /// that no 64-byte load of a row straddles two cache lines).
    Bf16 { buf: Vec<u16>, at: usize },
    /// (OC, cp) int8 and (OC, cp / 32) scales.
    Q8 { qs: Vec<i8>, scales: Vec<f32> },
}

impl std::fmt::Debug for DecodeMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeMatrix")
            .field("format", &self.format())
            .field("oc", &self.oc)
            .field("c", &self.c)
            .finish()
    }
}

impl DecodeMatrix {
    /// The matrix `w` (C, OC) input-major, as GPT-2's Conv1D weights and the engine's
    /// `matmul_forward` keep them, in `format`.
    pub fn from_input_major(w: &[f32], c: usize, oc: usize, format: DecodeFormat) -> DecodeMatrix {
        assert!(w.len() >= c * oc, "weights: {} < {c} x {oc}", w.len());
        // rows o0.. of the transpose, read a run of them from each input row in turn
        DecodeMatrix::build(oc, c, format, |o0, rows| {
            let r = rows.len() / c;
            for k in 0..c {
                for (i, &v) in w[k * oc + o0..][..r].iter().enumerate() {
                    rows[i * c + k] = v;
                }
            }
        })
    }

    /// The matrix `w` (OC, C) output-major, as `head_forward`'s (V, C) weights, in `format`.
    pub fn from_output_major(w: &[f32], oc: usize, c: usize, format: DecodeFormat) -> DecodeMatrix {
        assert!(w.len() >= c * oc, "weights: {} < {oc} x {c}", w.len());
        DecodeMatrix::build(oc, c, format, |o0, rows| {
            rows.copy_from_slice(&w[o0 * c..o0 * c + rows.len()])
        })
    }

    /// Converts the rows in runs of [`BUILD_ROWS`], runs in parallel (on the caller's rayon
    /// pool): `rows(o0, f32s)` fills f32s with rows o0.. (C each, as many as it holds).
    fn build(
        oc: usize,
        c: usize,
        format: DecodeFormat,
        rows: impl Fn(usize, &mut [f32]) + Sync,
    ) -> Self {
        let cp = c.div_ceil(BLOCK).max(1) * BLOCK;
        let run = |o0: usize, f: &mut dyn FnMut(usize, &[f32])| {
            let r = BUILD_ROWS.min(oc - o0);
            let mut f32s = vec![0f32; r * c];
            rows(o0, &mut f32s);
            for i in 0..r {
                f(i, &f32s[i * c..(i + 1) * c]);
            }
        };
        let data = match format {
            DecodeFormat::Bf16 => {
                let mut buf = vec![0u16; oc * cp + 32];
                let at = buf.as_ptr().align_offset(64).min(32);
                buf[at..at + oc * cp]
                    .par_chunks_mut(BUILD_ROWS * cp)
                    .enumerate()
                    .for_each(|(b, out)| {
                        run(b * BUILD_ROWS, &mut |i, row| {
                            for (o, &v) in out[i * cp..].iter_mut().zip(row) {
                                *o = bf16_bits(v);
                            }
                        })
                    });
                Data::Bf16 { buf, at }
            }
            DecodeFormat::Q8 => {
                let (mut qs, mut scales) = (vec![0i8; oc * cp], vec![0f32; oc * cp / BLOCK]);
                let blocks = cp / BLOCK;
                qs.par_chunks_mut(BUILD_ROWS * cp)
                    .zip(scales.par_chunks_mut(BUILD_ROWS * blocks))
                    .enumerate()
                    .for_each(|(b, (q, d))| {
                        run(b * BUILD_ROWS, &mut |i, row| {
                            let q = &mut q[i * cp..(i + 1) * cp];
                            quantize_row(q, &mut d[i * blocks..], row)
                        })
                    });
                Data::Q8 { qs, scales }
            }
        };
        DecodeMatrix { oc, c, cp, data }
    }

    /// Its format.
    pub fn format(&self) -> DecodeFormat {
        match self.data {
            Data::Bf16 { .. } => DecodeFormat::Bf16,
            Data::Q8 { .. } => DecodeFormat::Q8,
        }
    }

    /// Output rows (OC).
    pub fn out_features(&self) -> usize {
        self.oc
    }

    /// Input columns (C).
    pub fn in_features(&self) -> usize {
        self.c
    }

    /// Bytes its weights take.
    pub fn bytes(&self) -> usize {
        match &self.data {
            Data::Bf16 { .. } => 2 * self.oc * self.cp,
            Data::Q8 { qs, scales } => qs.len() + 4 * scales.len(),
        }
    }
}

/// Quantises `x` (padded with zeros to `q.len()`, a multiple of 32) into int8 blocks `q` and
/// their scales `d` as llama.cpp's `quantize_row_q8_0` does: scale max|x| / 127, values
/// round(x / scale) (half away from zero).
fn quantize_row(q: &mut [i8], d: &mut [f32], x: &[f32]) {
    for (b, q) in q.chunks_exact_mut(BLOCK).enumerate() {
        let lo = (b * BLOCK).min(x.len());
        let xs = &x[lo..(lo + BLOCK).min(x.len())];
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        q.fill(0);
        for (q, &v) in q.iter_mut().zip(xs) {
            *q = (v * inv).round() as i8;
        }
        d[b] = scale;
    }
}

thread_local! {
    /// The calling thread's quantised input rows (Q8): int8 values and block scales.
    static QUANTISED: RefCell<(Vec<i8>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    /// The calling thread's input rows rounded to bf16 (rows of cp, zero-padded).
    static ROUNDED: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
}

/// out (N, OC) = inp (N, C) · wᵀ + bias, for `w` kept in a [`DecodeFormat`] (see the module
/// doc for how each rounds and sums). Outputs are split over the pool's threads.
pub fn decode_matmul_forward(
    out: &mut [f32],
    inp: &[f32],
    w: &DecodeMatrix,
    bias: Option<&[f32]>,
    n: usize,
) {
    let (c, oc) = (w.c, w.oc);
    assert!(
        out.len() >= n * oc && inp.len() >= n * c && bias.is_none_or(|b| b.len() >= oc),
        "decode_matmul_forward: out {} / inp {} / bias {:?} for {n} rows of {c} -> {oc}",
        out.len(),
        inp.len(),
        bias.map(<[f32]>::len)
    );
    if n == 0 || oc == 0 {
        return;
    }
    let ptr = SendPtr(out.as_mut_ptr());
    match &w.data {
        Data::Bf16 { buf, at } => {
            let bits = &buf[*at..*at + oc * w.cp];
            #[cfg(target_arch = "x86_64")]
            if super::bf16_supported() {
                // The rows rounded once, not once per output row; taken out of the thread's
                // slot for the call as QUANTISED is (see there).
                let mut xb = ROUNDED.with(|slot| std::mem::take(&mut *slot.borrow_mut()));
                xb.resize(xb.len().max(n * w.cp), 0);
                let xb_rows = &mut xb[..n * w.cp];
                // SAFETY: AVX512F/BW/BF16 were detected at run time (bf16_supported); the
                // sizes are the ones checked above.
                unsafe { bf16_avx512::round_rows(xb_rows, inp, w, n) };
                let xb_rows = &*xb_rows;
                for_each_part(oc, |o0, o1| {
                    // SAFETY: as round_rows; each part owns its columns o0..o1.
                    unsafe { bf16_avx512::part(ptr, xb_rows, bits, w, bias, n, o0..o1) }
                });
                ROUNDED.with(|slot| *slot.borrow_mut() = xb);
                return;
            }
            for_each_part(oc, |o0, o1| {
                bf16_portable_part(ptr, inp, bits, w, bias, n, o0..o1)
            });
        }
        Data::Q8 { qs, scales } => {
            // Taken out of the thread's slot for the call rather than borrowed across it: while
            // this thread waits for the parts it may run another call's work (a pool shared by
            // two forwards), which then finds the slot empty and uses a buffer of its own.
            let (mut xq, mut xd) = QUANTISED.with(|slot| std::mem::take(&mut *slot.borrow_mut()));
            let blocks = w.cp / BLOCK;
            xq.resize(xq.len().max(n * w.cp), 0);
            xd.resize(xd.len().max(n * blocks), 0.0);
            for m in 0..n {
                let (q, d) = (&mut xq[m * w.cp..(m + 1) * w.cp], &mut xd[m * blocks..]);
                quantize_row(q, d, &inp[m * c..(m + 1) * c]);
            }
            let x = Q8Rows {
                qs: &xq[..n * w.cp],
                scales: &xd[..n * blocks],
            };
            let wq = Q8Rows { qs, scales };
            let kernel = q8_kernel();
            for_each_part(oc, |o0, o1| kernel(ptr, x, wq, w, bias, n, o0..o1));
            QUANTISED.with(|slot| *slot.borrow_mut() = (xq, xd));
        }
    }
}

/// Runs `part(o0, o1)` over the output rows 0..oc split in tiles among the pool's threads:
/// four parts a thread, so that a thread the OS holds up leaves less for the others to wait on.
fn for_each_part(oc: usize, part: impl Fn(usize, usize) + Sync) {
    let tiles = oc.div_ceil(TILE);
    let parts = (4 * rayon::current_num_threads()).clamp(1, tiles);
    let per = tiles.div_ceil(parts);
    (0..parts).into_par_iter().for_each(|p| {
        let (o0, o1) = ((p * per * TILE).min(oc), ((p + 1) * per * TILE).min(oc));
        if o0 < o1 {
            part(o0, o1);
        }
    });
}

/// One part's outputs: rows `o` of W for every input row, written through `out` (N, OC).
/// Quantised rows: int8 values (rows of cp) and their block scales (rows of cp / 32).
#[derive(Clone, Copy)]
struct Q8Rows<'a> {
    qs: &'a [i8],
    scales: &'a [f32],
}

type Q8Kernel =
    fn(SendPtr, Q8Rows, Q8Rows, &DecodeMatrix, Option<&[f32]>, usize, std::ops::Range<usize>);

/// Writes `v + bias[o]` to out[m, o].
///
/// # Safety
/// `out` must hold (N, OC) floats with m < N, o < OC, and no other task may write out[m, o]
/// (each part owns its columns o).
#[inline(always)]
unsafe fn store(out: SendPtr, w: &DecodeMatrix, bias: Option<&[f32]>, m: usize, o: usize, v: f32) {
    let b = bias.map_or(0.0, |b| b[o]);
    // SAFETY: the caller's contract: in bounds, and this part's column.
    unsafe { *out.get().add(m * w.oc + o) = v + b };
}

/// The bf16 product without AVX512_BF16: lane i of 16 takes the pair (2i, 2i+1) of each block
/// of 32, as VDPBF16PS does, odd element first; the lanes are summed in a fixed tree.
fn bf16_portable_part(
    out: SendPtr,
    inp: &[f32],
    bits: &[u16],
    w: &DecodeMatrix,
    bias: Option<&[f32]>,
    n: usize,
    o: std::ops::Range<usize>,
) {
    let (c, cp) = (w.c, w.cp);
    let mut x = [0f32; BLOCK];
    for o in o {
        let row = &bits[o * cp..(o + 1) * cp];
        for m in 0..n {
            let inp = &inp[m * c..(m + 1) * c];
            let mut lanes = [0f32; 16];
            for (b, wb) in row.chunks_exact(BLOCK).enumerate() {
                x.fill(0.0);
                for (x, &v) in x.iter_mut().zip(&inp[(b * BLOCK).min(c)..]) {
                    *x = bf16_to_f32(bf16_bits(v));
                }
                for (i, l) in lanes.iter_mut().enumerate() {
                    *l += x[2 * i + 1] * bf16_to_f32(wb[2 * i + 1]);
                    *l += x[2 * i] * bf16_to_f32(wb[2 * i]);
                }
            }
            let mut width = 8;
            while width > 0 {
                for i in 0..width {
                    lanes[i] += lanes[i + width];
                }
                width /= 2;
            }
            // SAFETY: m < n, o < OC, and this part owns column o.
            unsafe { store(out, w, bias, m, o, lanes[0]) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod bf16_avx512 {
    //! VDPBF16PS, one output row at a time (each weight row read straight through: four rows
    //! read side by side streamed at a half to a third of the rate on Zen 5), over input rows
    //! rounded to bf16 once per call ([`round_rows`]).
    use std::arch::x86_64::*;

    use super::{store, DecodeMatrix, SendPtr, BLOCK};

    /// `xb` (N, cp) = the input rows (N, C) rounded to bf16 by VCVTNE2PS2BF16, zero-padded.
    ///
    /// # Safety
    /// The CPU must have AVX512F, AVX512BW and AVX512_BF16; `inp` holds n rows of w.c and `xb`
    /// n rows of w.cp.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn round_rows(xb: &mut [u16], inp: &[f32], w: &DecodeMatrix, n: usize) {
        let (c, cp) = (w.c, w.cp);
        let blocks = cp / BLOCK;
        // the last block's input elements (1..=32): loaded under a mask, the rest read as 0
        let tail = c - (blocks - 1) * BLOCK;
        let (lo_mask, hi_mask) = (
            ((1u32 << tail.min(16)) - 1) as u16,
            ((1u32 << tail.saturating_sub(16)) - 1) as u16,
        );
        for m in 0..n {
            let (x, out) = (inp[m * c..].as_ptr(), xb[m * cp..(m + 1) * cp].as_mut_ptr());
            for b in 0..blocks {
                // SAFETY: the input row has c elements: the last block reads only `tail` of
                // them (masked); the output row has cp = 32·blocks elements.
                unsafe {
                    let at = x.add(b * BLOCK);
                    let (lo, hi) = if b + 1 < blocks {
                        (_mm512_loadu_ps(at), _mm512_loadu_ps(at.add(16)))
                    } else {
                        (
                            _mm512_maskz_loadu_ps(lo_mask, at),
                            _mm512_maskz_loadu_ps(hi_mask, at.add(16)),
                        )
                    };
                    let xb = _mm512_cvtne2ps_pbh(hi, lo);
                    _mm512_storeu_si512(
                        out.add(b * BLOCK) as *mut _,
                        std::mem::transmute::<__m512bh, __m512i>(xb),
                    );
                }
            }
        }
    }

    /// Input rows a weight row is multiplied with at once: one weight load for four products,
    /// and four independent chains of VDPBF16PS (one chain waits out each instruction's
    /// latency; four keep the unit busy). Each row still sums its blocks in the same order.
    const ROWS: usize = 4;

    /// # Safety
    /// As [`round_rows`], `xb` holding its output; sizes as `decode_matmul_forward` checked
    /// them; this part owns the columns `o`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn part(
        out: SendPtr,
        xb: &[u16],
        bits: &[u16],
        w: &DecodeMatrix,
        bias: Option<&[f32]>,
        n: usize,
        o: std::ops::Range<usize>,
    ) {
        let cp = w.cp;
        let blocks = cp / BLOCK;
        let bh = |v: __m512i| -> __m512bh {
            // SAFETY: the same 512 bits, read as 32 bf16.
            unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
        };
        for o in o {
            let wrow = bits[o * cp..].as_ptr();
            let mut m = 0;
            while m + ROWS <= n {
                let x: [*const u16; ROWS] = std::array::from_fn(|r| xb[(m + r) * cp..].as_ptr());
                let mut acc = [_mm512_setzero_ps(); ROWS];
                for b in 0..blocks {
                    // SAFETY: every row has cp = 32·blocks elements.
                    unsafe {
                        let wv = bh(_mm512_loadu_si512(wrow.add(b * BLOCK) as *const _));
                        for r in 0..ROWS {
                            let xv = bh(_mm512_loadu_si512(x[r].add(b * BLOCK) as *const _));
                            acc[r] = _mm512_dpbf16_ps(acc[r], xv, wv);
                        }
                    }
                }
                for (r, acc) in acc.into_iter().enumerate() {
                    // SAFETY: m + r < n, o < OC, this part's column.
                    unsafe { store(out, w, bias, m + r, o, _mm512_reduce_add_ps(acc)) };
                }
                m += ROWS;
            }
            for m in m..n {
                let x = xb[m * cp..].as_ptr();
                let mut acc = _mm512_setzero_ps();
                for b in 0..blocks {
                    // SAFETY: both rows have cp = 32·blocks elements.
                    unsafe {
                        let xv = bh(_mm512_loadu_si512(x.add(b * BLOCK) as *const _));
                        let wv = bh(_mm512_loadu_si512(wrow.add(b * BLOCK) as *const _));
                        acc = _mm512_dpbf16_ps(acc, xv, wv);
                    }
                }
                // SAFETY: m < n, o < OC, this part's column.
                unsafe { store(out, w, bias, m, o, _mm512_reduce_add_ps(acc)) };
            }
        }
    }
}

fn q8_kernel() -> Q8Kernel {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512vnni")
            && std::arch::is_x86_feature_detected!("avx512vl")
        {
            return |out, x, wq, w, bias, n, o| {
                // SAFETY: AVX512-VNNI and AVX512VL were detected at run time.
                unsafe { q8_x86::part_vnni(out, x, wq, w, bias, n, o) }
            };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return |out, x, wq, w, bias, n, o| {
                // SAFETY: AVX2 and FMA were detected at run time.
                unsafe { q8_x86::part_avx2(out, x, wq, w, bias, n, o) }
            };
        }
    }
    q8_portable_part
}

/// Sums eight lanes in the fixed tree every Q8 path uses.
#[inline(always)]
fn sum8(l: [f32; 8]) -> f32 {
    let s = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

/// The Q8 product in plain code: lane j of 8 takes elements 4j..4j+3 of each block (as
/// VPDPBUSD's lanes do), its integer sum times the two scales added with one rounding.
fn q8_portable_part(
    out: SendPtr,
    x: Q8Rows,
    wq: Q8Rows,
    w: &DecodeMatrix,
    bias: Option<&[f32]>,
    n: usize,
    o: std::ops::Range<usize>,
) {
    let (cp, blocks) = (w.cp, w.cp / BLOCK);
    for o in o {
        for m in 0..n {
            let mut lanes = [0f32; 8];
            for b in 0..blocks {
                let xs = &x.qs[m * cp + b * BLOCK..][..BLOCK];
                let ws = &wq.qs[o * cp + b * BLOCK..][..BLOCK];
                let d = wq.scales[o * blocks + b] * x.scales[m * blocks + b];
                for (j, l) in lanes.iter_mut().enumerate() {
                    let p: i32 = (0..4)
                        .map(|k| i32::from(xs[4 * j + k]) * i32::from(ws[4 * j + k]))
                        .sum();
                    *l = (p as f32).mul_add(d, *l);
                }
            }
            // SAFETY: m < n, o < OC, and this part owns column o.
            unsafe { store(out, w, bias, m, o, sum8(lanes)) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod q8_x86 {
    //! The Q8 block dot products on 256-bit registers: |x| (unsigned) times w with x's sign
    //! (signed), four products to an int32 lane, by VPDPBUSD or by VPMADDUBSW + VPMADDWD.
    use std::arch::x86_64::*;

    use super::{store, sum8, DecodeMatrix, Q8Rows, SendPtr, BLOCK};

    /// # Safety
    /// The CPU must have AVX512-VNNI and AVX512VL; this part owns the columns `o`.
    #[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2,fma")]
    pub(super) unsafe fn part_vnni(
        out: SendPtr,
        x: Q8Rows,
        wq: Q8Rows,
        w: &DecodeMatrix,
        bias: Option<&[f32]>,
        n: usize,
        o: std::ops::Range<usize>,
    ) {
        // SAFETY: as this function's.
        unsafe {
            part(out, x, wq, w, bias, n, o, |ax, sw| {
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sw)
            })
        }
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA; this part owns the columns `o`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn part_avx2(
        out: SendPtr,
        x: Q8Rows,
        wq: Q8Rows,
        w: &DecodeMatrix,
        bias: Option<&[f32]>,
        n: usize,
        o: std::ops::Range<usize>,
    ) {
        // SAFETY: as this function's.
        unsafe {
            part(out, x, wq, w, bias, n, o, |ax, sw| {
                // pairs to i16 (at most 2·127·127: no saturation), then pairs of those to i32
                let pairs = _mm256_maddubs_epi16(ax, sw);
                _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
            })
        }
    }

    /// Every (input row, output row) of the part, one output row at a time (each weight row
    /// read straight through), with `dot4(|x|, w·sign(x))` giving the eight int32 sums of a
    /// block.
    #[inline(always)]
    unsafe fn part(
        out: SendPtr,
        x: Q8Rows,
        wq: Q8Rows,
        w: &DecodeMatrix,
        bias: Option<&[f32]>,
        n: usize,
        o: std::ops::Range<usize>,
        dot4: impl Fn(__m256i, __m256i) -> __m256i + Copy,
    ) {
        for o in o {
            // SAFETY: as this function's (row o is this part's).
            unsafe { row(out, x, wq, w, bias, n, o, dot4) };
        }
    }

    /// Output row o for every input row.
    #[inline(always)]
    unsafe fn row(
        out: SendPtr,
        x: Q8Rows,
        wq: Q8Rows,
        w: &DecodeMatrix,
        bias: Option<&[f32]>,
        n: usize,
        o: usize,
        dot4: impl Fn(__m256i, __m256i) -> __m256i,
    ) {
        let (cp, blocks) = (w.cp, w.cp / BLOCK);
        let (wrow, wd) = (wq.qs[o * cp..].as_ptr(), &wq.scales[o * blocks..]);
        for m in 0..n {
            let (xrow, xd) = (x.qs[m * cp..].as_ptr(), &x.scales[m * blocks..]);
            let mut acc = _mm256_setzero_ps();
            for b in 0..blocks {
                // SAFETY: both rows hold cp = 32·blocks int8.
                unsafe {
                    let xv = _mm256_loadu_si256(xrow.add(b * BLOCK) as *const __m256i);
                    let wv = _mm256_loadu_si256(wrow.add(b * BLOCK) as *const __m256i);
                    let p = dot4(_mm256_abs_epi8(xv), _mm256_sign_epi8(wv, xv));
                    let d = _mm256_set1_ps(wd[b] * xd[b]);
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc);
                }
            }
            let mut lanes = [0f32; 8];
            // SAFETY: 8 floats to an array of 8.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
            // SAFETY: m < n, o < OC, and this part owns the column.
            unsafe { store(out, w, bias, m, o, sum8(lanes)) };
        }
    }
}

#[cfg(test)]
mod tests;

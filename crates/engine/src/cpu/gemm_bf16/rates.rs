//! Timing hooks for `examples/pack_rates.rs`: each packing path of the bf16 product over a whole
//! operand, block by block as the zmm kernel's loop nest ([`blocks`](super::blocks)) packs it,
//! and the fp32 product's B panels as [`sgemm`](crate::cpu::gemm::sgemm) packs them. It must
//! never be used by a product: only the example calls it, to time the packs alone.

use super::{pack, shared, Kernel, Line, NR};
use crate::cpu::epilogue::Epilogue;
use crate::cpu::gemm::{self, Strided};

/// A thread's packing buffers at the zmm kernel's block sizes, as the product's own.
pub struct Packer {
    a: Vec<Line>,
    b: Vec<Line>,
}

impl Packer {
    /// The buffers, or `None` where this CPU has no AVX512_BF16.
    pub fn new() -> Option<Packer> {
        super::avx512_bf16().then(|| {
            let (a, b) = Kernel::Avx512.buffers();
            Packer {
                a: vec![Line([0; 16]); a.div_ceil(16)],
                b: vec![Line([0; 16]); b.div_ceil(16)],
            }
        })
    }

    /// Packs all of B, (k, n) at strides (rs, cs), as the product does: NC columns at a time,
    /// K blocks of the product's length; with `sums` (n floats), adds B's rows to them.
    ///
    /// # Panics
    /// If `b` is shorter than the strides say, or `sums` shorter than n.
    pub fn pack_b(
        &mut self,
        b: &[f32],
        (k, n): (usize, usize),
        (rs, cs): (usize, usize),
        mut sums: Option<&mut [f32]>,
    ) {
        assert!(k > 0 && n > 0 && b.len() > (k - 1) * rs + (n - 1) * cs);
        assert!(sums.as_ref().is_none_or(|s| s.len() >= n));
        let bl = Kernel::Avx512.blocking(k, n);
        let (kcp, nc) = (bl.kcp, bl.nc);
        let pb = self.b.as_mut_ptr() as *mut u32;
        for jc in (0..n).step_by(nc) {
            let nc = nc.min(n - jc);
            debug_assert!(nc.div_ceil(NR) * NR * kcp <= self.b.len() * 16);
            for pc in (0..k).step_by(2 * kcp) {
                let kc = (2 * kcp).min(k - pc);
                let s = sums.as_deref_mut().map(|s| s[jc..].as_mut_ptr());
                // SAFETY: AVX512_BF16 checked in `new`; the block is inside b (asserted above);
                // the buffer holds the largest block, 64-byte aligned; `s` n - jc floats.
                unsafe {
                    let at = b.as_ptr().add(pc * rs + jc * cs);
                    pack::pack_b(pb, at, rs, cs, kc, nc, kc.div_ceil(2), s);
                }
            }
        }
    }

    /// Packs all of A, (m, k) at strides (rs, cs), as the product does: MC rows at a time in
    /// K blocks of the product's length.
    ///
    /// # Panics
    /// If `a` is shorter than the strides say.
    pub fn pack_a(&mut self, a: &[f32], mk: (usize, usize), (rs, cs): (usize, usize)) {
        assert!(mk.0 > 0 && mk.1 > 0 && a.len() > (mk.0 - 1) * rs + (mk.1 - 1) * cs);
        // SAFETY: AVX512_BF16 checked in `new`; each block is inside a (asserted above); the
        // buffer holds MC x kcp.
        self.a_blocks(mk, |pa, (i, e), mc, kc| unsafe {
            let at = a.as_ptr().add(i * rs + e * cs);
            pack::pack_a(pa, at, rs, cs, mc, kc, kc.div_ceil(2));
        });
    }

    /// [`Packer::pack_a`] of an A already in bf16 (its bits).
    ///
    /// # Panics
    /// If `a` is shorter than the strides say.
    pub fn pack_a_bf16(&mut self, a: &[u16], mk: (usize, usize), (rs, cs): (usize, usize)) {
        assert!(mk.0 > 0 && mk.1 > 0 && a.len() > (mk.0 - 1) * rs + (mk.1 - 1) * cs);
        // SAFETY: as pack_a's.
        self.a_blocks(mk, |pa, (i, e), mc, kc| unsafe {
            let at = a.as_ptr().add(i * rs + e * cs);
            pack::pack_a_bf16(pa, at, rs, cs, mc, kc, kc.div_ceil(2));
        });
    }

    /// Calls `pack` on A's blocks in the product's order: (buffer, first (row, K), rows, kc).
    fn a_blocks(
        &mut self,
        (m, k): (usize, usize),
        mut pack: impl FnMut(*mut u32, (usize, usize), usize, usize),
    ) {
        let bl = Kernel::Avx512.blocking(k, m);
        let (kcp, mc) = (bl.kcp, bl.mc);
        let pa = self.a.as_mut_ptr() as *mut u32;
        for pc in (0..k).step_by(2 * kcp) {
            let kc = (2 * kcp).min(k - pc);
            for ic in (0..m).step_by(mc) {
                pack(pa, (ic, pc), mc.min(m - ic), kc);
            }
        }
    }
}

/// Packs all of B, (k, n) at strides (rs, cs), into fp32 panels as a one-thread product of `m`
/// rows does (the kernel, which would read them, left out): where A spans several strips of
/// rows, once per K block into the shared buffer, block of columns by block
/// ([`sgemm_parts`](super::shared::sgemm_parts) with one part); else panel by panel into one
/// buffer ([`sgemm`](crate::cpu::gemm::sgemm)). Returns the floats packed, or `None` where this
/// CPU has no AVX-512F.
///
/// # Panics
/// If `b` is shorter than the strides say.
pub fn pack_panels_f32(
    b: &[f32],
    m: usize,
    (k, n): (usize, usize),
    (rs, cs): (usize, usize),
) -> Option<usize> {
    assert!(k > 0 && n > 0 && m > 0 && b.len() > (k - 1) * rs + (n - 1) * cs);
    if !std::arch::is_x86_feature_detected!("avx512f") {
        return None;
    }
    let sb = Strided {
        ptr: b.as_ptr(),
        rs,
        cs,
    };
    let once = m > gemm::strip_rows(m, sb);
    let (kc_max, width) = if once {
        shared::fp32_blocks(k, n)
    } else {
        (gemm::kc_for(k), n)
    };
    thread_local! {
        // Kept from call to call, as the product's pool keeps its buffers (a fresh one would
        // time the kernel's first touch of its pages).
        static BUFFER: std::cell::RefCell<Vec<Line>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let mut buffer = BUFFER.take();
    buffer.resize(shared::FP32_SHARED / 16, Line([0; 16]));
    let pp = buffer.as_mut_ptr() as *mut f32;
    let mut packed = 0;
    for j0 in (0..n).step_by(width) {
        let j1 = (j0 + width).min(n);
        for k0 in (0..k).step_by(kc_max) {
            let kc = kc_max.min(k - k0);
            for j in (j0..j1).step_by(gemm::NR) {
                let at = if once {
                    (j - j0) / gemm::NR * kc * gemm::NR
                } else {
                    0
                };
                // SAFETY: AVX-512F checked above; the block is inside b (asserted above); the
                // buffer holds the block's panels (kc x width ≤ FP32_SHARED floats, or one
                // panel), 64-byte aligned.
                unsafe {
                    let nr = gemm::NR.min(j1 - j);
                    gemm::pack_panel_of(pp.add(at), sb, Epilogue::None, (k0, kc), j, nr)
                };
                packed += kc * gemm::NR;
            }
            std::hint::black_box(&mut buffer);
        }
    }
    BUFFER.set(buffer);
    Some(packed)
}

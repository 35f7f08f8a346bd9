//! Timing hooks for `examples/pack_rates.rs`: each packing path of the bf16 product over a whole
//! operand, block by block as the zmm kernel's loop nest ([`blocks`](super::blocks)) packs it.
//! It must never be used by a product: only the example calls it, to time the packs alone.

use super::{avx512_kcp, pack, Kernel, Line, NR};

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
        let (kcp, nc) = (avx512_kcp(k.div_ceil(2)), 2048);
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
    pub fn pack_a(&mut self, a: &[f32], (m, k): (usize, usize), (rs, cs): (usize, usize)) {
        assert!(m > 0 && k > 0 && a.len() > (m - 1) * rs + (k - 1) * cs);
        let (kcp, mc) = (avx512_kcp(k.div_ceil(2)), 192);
        let pa = self.a.as_mut_ptr() as *mut u32;
        for pc in (0..k).step_by(2 * kcp) {
            let kc = (2 * kcp).min(k - pc);
            for ic in (0..m).step_by(mc) {
                let mc = mc.min(m - ic);
                // SAFETY: AVX512_BF16 checked in `new`; the block is inside a (asserted
                // above); the buffer holds MC x kcp.
                unsafe {
                    let at = a.as_ptr().add(ic * rs + pc * cs);
                    pack::pack_a(pa, at, rs, cs, mc, kc, kc.div_ceil(2));
                }
            }
        }
    }
}

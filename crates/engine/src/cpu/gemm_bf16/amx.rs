//! The AMX kernel of the bf16 product: a 32 x 32 block of C held in four 16 x 16 f32 tile
//! registers while TDPBF16PS multiplies 16-row A tiles by 16-pair B tiles, 16 pairs of K at a
//! time. It reads the same packed buffers as the AVX-512 kernel (A as `[row][pair]`, B as
//! `[pair][32 columns]`), padded with zero pairs to a multiple of 16.
//!
//! Written with `asm!` because Rust's AMX intrinsics are not stable. The compiler never uses
//! the tile registers, so tile state carried between `asm!` blocks is ours alone; each thread
//! loads its own tile configuration ([`configure`]) and releases the tiles after a product
//! ([`release`]) so that a context switch does not save 8 KB of tile state for nothing.

use std::arch::asm;
use std::arch::x86_64::*;

use super::NR;
use crate::cpu::gemm::{bias_row, store_row};

/// C's block on its way from the tiles to C (row-major, NR columns).
#[repr(C, align(64))]
pub(crate) struct Scratch(pub(crate) [f32; 32 * NR]);

/// The 64-byte operand of LDTILECFG (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// Configures this thread's eight tiles as 16 rows of 64 bytes (16 f32, or 16 bf16 pairs).
///
/// # Safety
/// The CPU must have AMX and the OS must have granted this process the tile state.
pub(crate) unsafe fn configure() {
    let mut cfg = TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        colsb: [0; 16],
        rows: [0; 16],
    };
    for t in 0..8 {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    // SAFETY: LDTILECFG reads the 64-byte, 64-aligned config above; AMX is available per the
    // caller.
    unsafe { asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly)) };
}

/// Releases this thread's tiles.
///
/// # Safety
/// As [`configure`].
pub(crate) unsafe fn release() {
    // SAFETY: TILERELEASE only resets tile state; AMX is available per the caller.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// c[0..rows, 0..nr] (+)= a (32 rows of `stride` pairs, row stride `stride`) · b (a packed
/// panel of `stride` pairs x NR columns), plus `bias` when not accumulating.
///
/// # Safety
/// [`configure`] must have run on this thread; `stride` a multiple of 16; `a` 32 readable rows
/// (rows past `rows` may hold anything: they only reach discarded rows of the block); `b`
/// stride x NR readable u32; `c` rows x nr writable floats at row stride rsc, not overlapping
/// the rest; `bias`, if any, nr readable floats.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn block(
    stride: usize,
    a: *const u32,
    b: *const u32,
    c: *mut f32,
    rsc: usize,
    rows: usize,
    nr: usize,
    acc: bool,
    bias: Option<*const f32>,
    scratch: &mut Scratch,
) {
    // SAFETY: every tile load reads 16 rows of 64 bytes inside the caller's a and b (row
    // strides stride x 4 and NR x 4 bytes); the stores write the 4 KB scratch; the epilogue
    // touches rows < rows and columns < nr of c.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        );
        let a1 = a.add(16 * stride);
        for p0 in (0..stride).step_by(16) {
            asm!(
                "tileloadd tmm4, [{a0} + {sa}*1]",
                "tileloadd tmm5, [{a1} + {sa}*1]",
                "tileloadd tmm6, [{b0} + {sb}*1]",
                "tileloadd tmm7, [{b1} + {sb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a.add(p0),
                a1 = in(reg) a1.add(p0),
                sa = in(reg) stride * 4,
                b0 = in(reg) b.add(p0 * NR),
                b1 = in(reg) b.add(p0 * NR + 16),
                sb = in(reg) NR * 4,
                options(nostack, readonly)
            );
        }
        let s = scratch.0.as_mut_ptr();
        asm!(
            "tilestored [{s0} + {st}*1], tmm0",
            "tilestored [{s1} + {st}*1], tmm1",
            "tilestored [{s2} + {st}*1], tmm2",
            "tilestored [{s3} + {st}*1], tmm3",
            s0 = in(reg) s,
            s1 = in(reg) s.add(16),
            s2 = in(reg) s.add(16 * NR),
            s3 = in(reg) s.add(16 * NR + 16),
            st = in(reg) NR * 4,
            options(nostack)
        );
        let bias = bias_row(bias, nr);
        for i in 0..rows {
            let sp = s.add(i * NR);
            let v = (_mm512_load_ps(sp), _mm512_load_ps(sp.add(16)));
            store_row(c.add(i * rsc), nr, v, acc, bias);
        }
    }
}

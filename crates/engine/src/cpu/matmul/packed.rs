//! Products with a constant right-hand matrix packed once beforehand ([`PackedMatrix`]): an
//! inference's fixed weights, laid out in the sgemm kernel's panels so no product packs them
//! again. Training's weights change every step and never come here. It must never change a
//! result with the thread count (the same sums in the same order whichever part of C a thread
//! computes).

use rayon::prelude::*;

use super::{check, gemm_on, Mat, PAR_MIN_MACS};
#[cfg(target_arch = "x86_64")]
use super::{simd_level, SendPtr, SimdLevel, Strided};
use crate::cpu::epilogue::Epilogue;
use crate::DType;

/// A constant right-hand matrix `w` (K, N) of [`packed_matmul_forward`], laid out once for
/// every later product: on a CPU with AVX-512, in the panels the sgemm kernel reads (N split
/// into 32-column panels, each K rows of 32 floats, zero-padded, 64-byte aligned), so that no
/// product packs it again; elsewhere, row-major as given. For inference with fixed weights
/// (an ONNX Gemm's B); training's weights change every step and take [`matmul_forward`].
pub struct PackedMatrix {
    k: usize,
    n: usize,
    /// Panels (AVX-512) or the row-major matrix; `Line`s keep the panels 64-byte aligned.
    data: PackedData,
}

/// 16 floats, one cache line, so that a `Vec<Line>` is 64-byte aligned.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

enum PackedData {
    #[cfg(target_arch = "x86_64")]
    Panels(Vec<Line>),
    RowMajor(Vec<f32>),
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedMatrix")
            .field("k", &self.k)
            .field("n", &self.n)
            .finish()
    }
}

impl PackedMatrix {
    /// Packs `w`: row-major (K, N), or with `transposed` row-major (N, K) standing for its
    /// transpose (nn.Linear's `[out, in]`, an ONNX Gemm's `transB = 1`).
    pub fn new(w: &[f32], k: usize, n: usize, transposed: bool) -> PackedMatrix {
        check("packed w", w.len(), k * n);
        let at = |r: usize, c: usize| {
            if transposed {
                w[c * k + r]
            } else {
                w[r * n + c]
            }
        };
        #[cfg(target_arch = "x86_64")]
        if simd_level() == SimdLevel::Avx512 {
            use crate::cpu::gemm::NR;
            let panels = n.div_ceil(NR);
            let mut lines = vec![Line([0.0; 16]); panels * k * NR / 16];
            for (i, line) in lines.iter_mut().enumerate() {
                // line i holds floats 16i..16i+16: panel p, row r, columns c0..c0+16 of it
                let (p, within) = ((i * 16) / (k * NR), (i * 16) % (k * NR));
                let (r, c0) = (within / NR, p * NR + within % NR);
                for (x, c) in line.0.iter_mut().zip(c0..(c0 + 16).min(n)) {
                    *x = at(r, c);
                }
            }
            return PackedMatrix {
                k,
                n,
                data: PackedData::Panels(lines),
            };
        }
        let data = (0..k)
            .flat_map(|r| (0..n).map(move |c| (r, c)))
            .map(|(r, c)| at(r, c))
            .collect();
        PackedMatrix {
            k,
            n,
            data: PackedData::RowMajor(data),
        }
    }

    /// Rows (the products' inner dimension).
    pub fn k(&self) -> usize {
        self.k
    }

    /// Columns (the products' output width).
    pub fn n(&self) -> usize {
        self.n
    }
}

/// out (M, N) = inp (M, K) · w (K, N) + bias (N), with `w` packed beforehand. Called from
/// inside a rayon pool (`Cpu::install`, or any pool's `install`) it splits over that pool's
/// threads; from anywhere else it runs on the calling thread alone, without a hand-off (a
/// batch-1 inference is over in tens of microseconds). The result does not depend on the
/// thread count.
pub fn packed_matmul_forward(
    out: &mut [f32],
    inp: &[f32],
    w: &PackedMatrix,
    bias: Option<&[f32]>,
    m: usize,
) {
    let (k, n) = (w.k, w.n);
    check("packed out", out.len(), m * n);
    check("packed inp", inp.len(), m * k);
    if let Some(b) = bias {
        check("packed bias", b.len(), n);
    }
    let threads = match rayon::current_thread_index() {
        Some(_) => rayon::current_num_threads(),
        None => 1,
    };
    match &w.data {
        #[cfg(target_arch = "x86_64")]
        PackedData::Panels(lines) => {
            use crate::cpu::gemm::{sgemm_prepacked, NR};
            let parts = if m * n * k < PAR_MIN_MACS {
                1
            } else {
                threads.min(m.max(n) / 16).max(1)
            };
            let (a, b) = (SendPtr(inp.as_ptr() as *mut f32), lines.as_ptr() as usize);
            let (c, bias) = (SendPtr(out.as_mut_ptr()), bias.map(|b| b.as_ptr() as usize));
            let call = |r0: usize, r1: usize, j0: usize, j1: usize| {
                let sa = Strided {
                    ptr: a.get().wrapping_add(r0 * k),
                    rs: k,
                    cs: 1,
                };
                // safety: sizes checked above; the panels cover k rows and n columns, 64-byte
                // aligned (Line); distinct calls write disjoint blocks of out (rows r0..r1,
                // columns j0..j1, j0 a multiple of NR), and out is a distinct &mut.
                unsafe {
                    sgemm_prepacked(
                        r1 - r0,
                        k,
                        sa,
                        b as *const f32,
                        j0,
                        j1,
                        c.get().add(r0 * n),
                        n,
                        bias.map(|b| b as *const f32),
                        m == 1,
                    )
                }
            };
            if parts == 1 {
                call(0, m, 0, n);
                return;
            }
            (0..parts).into_par_iter().for_each(|p| {
                if m >= n {
                    let step = m.div_ceil(parts);
                    let (r0, r1) = ((p * step).min(m), ((p + 1) * step).min(m));
                    if r0 < r1 {
                        call(r0, r1, 0, n);
                    }
                } else {
                    let step = n.div_ceil(parts).div_ceil(NR) * NR;
                    let (j0, j1) = ((p * step).min(n), ((p + 1) * step).min(n));
                    if j0 < j1 {
                        call(0, m, j0, j1);
                    }
                }
            });
        }
        // safety: sizes checked above; out is a distinct &mut.
        PackedData::RowMajor(b) => unsafe {
            gemm_on(
                threads,
                DType::F32,
                m,
                k,
                n,
                Mat::rm(inp.as_ptr(), k),
                Mat::rm(b.as_ptr(), n),
                Mat::rm(out.as_mut_ptr(), n),
                false,
                bias.map(|b| &b[..n]),
                Epilogue::None,
                None,
            )
        },
    }
}

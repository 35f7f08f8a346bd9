//! Matrix products through cuBLAS's `cublasGemmEx` (the engine's matmul and head kernels): bf16 operands with f32 accumulation and
//! f32 output for bf16 training, and true fp32 (`CUBLAS_COMPUTE_32F`, never TF32) for
//! `--precision fp32`. Row-major (N, C) · (C, OC) is computed as the column-major product
//! (OC, C) · (C, N), so no operand is transposed in memory. Must never pick a TF32 or
//! reduced-precision compute type on its own. cuBLASLt epilogues (bias, GELU) are later work.

// The products take outputs, inputs, weights and dims explicitly, as the engine's kernels do.
#![allow(clippy::too_many_arguments)]

use std::sync::Arc;

use cudarc::cublas::{result as cublas, sys, CudaBlas};
use cudarc::driver::CudaStream;
use half::bf16;

use super::{Device, Mem};
use crate::CudaError;

/// The cuBLAS handle bound to the device's stream.
pub(super) struct Blas(CudaBlas);

impl Blas {
    pub(super) fn new(stream: Arc<CudaStream>) -> Result<Blas, CudaError> {
        CudaBlas::new(stream)
            .map(Blas)
            .map_err(|e| CudaError::Blas {
                call: "cublasCreate",
                reason: format!("{:?}", e.0),
            })
    }
}

/// An operand of a product: f32 or bf16.
#[derive(Clone, Copy)]
pub enum Operand<'a> {
    /// fp32.
    F32(&'a dyn Mem<f32>),
    /// bf16.
    Bf16(&'a dyn Mem<bf16>),
}

impl Operand<'_> {
    fn len(&self) -> usize {
        match self {
            Operand::F32(s) => s.len(),
            Operand::Bf16(s) => s.len(),
        }
    }

    fn dtype(&self) -> sys::cudaDataType {
        match self {
            Operand::F32(_) => sys::cudaDataType::CUDA_R_32F,
            Operand::Bf16(_) => sys::cudaDataType::CUDA_R_16BF,
        }
    }

    fn ptr(&self, dev: &Device) -> u64 {
        match self {
            Operand::F32(s) => s.ptr(dev),
            Operand::Bf16(s) => s.ptr(dev),
        }
    }
}

/// A row-major operand as the product uses it: as stored, or transposed.
#[derive(Clone, Copy)]
pub struct Op<'a> {
    /// The buffer.
    pub m: Operand<'a>,
    /// Whether the product uses its transpose (the buffer then holds the transpose's shape).
    pub t: bool,
}

impl Device {
    /// out (m, n) = op(a) (m, k) · op(b) (k, n), row-major, f32 out with f32 accumulation;
    /// `accumulate` adds to `out` (beta = 1) instead of overwriting it. Both operands f32:
    /// true fp32; both bf16: tensor cores on bf16 (mixed is refused).
    ///
    /// Row-major `out` is column-major `outᵀ` (n, m) = op(b)ᵀ · op(a)ᵀ, so cuBLAS gets b
    /// first; a row-major (r, c) buffer is column-major (c, r) with leading dimension c, and
    /// a transposed use flips the operation instead of copying.
    pub fn gemm(
        &self,
        out: &mut dyn Mem<f32>,
        a: Op<'_>,
        b: Op<'_>,
        (m, n, k): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<(), CudaError> {
        const K: &str = "gemm (cublasGemmEx)";
        for (arg, got, need) in [
            ("out", out.len(), m * n),
            ("a", a.m.len(), m * k),
            ("b", b.m.len(), k * n),
        ] {
            if got < need {
                return Err(CudaError::Shape {
                    kernel: K,
                    arg,
                    need,
                    got,
                });
            }
        }
        if a.m.dtype() as u32 != b.m.dtype() as u32 {
            return Err(CudaError::Unsupported {
                kernel: K,
                what: "a and b must have one dtype".to_string(),
            });
        }
        let dim = |what: &str, v: usize| {
            i32::try_from(v).map_err(|_| CudaError::Unsupported {
                kernel: K,
                what: format!("{what} = {v} does not fit a 32-bit int"),
            })
        };
        let (mi, ni, ki) = (dim("m", m)?, dim("n", n)?, dim("k", k)?);
        let op = |t: bool| {
            if t {
                sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        // cuBLAS's first operand is b: stored (k, n) row-major = (n, k) column-major, ld n;
        // transposed it is stored (n, k), ld k. Its second is a: stored (m, k), ld k; or
        // transposed, stored (k, m), ld m.
        let ldb = if b.t { ki } else { ni };
        let lda = if a.t { mi } else { ki };
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let (ap, bp, o) = (a.m.ptr(self), b.m.ptr(self), out.ptr(self));
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = "gemm";
        // SAFETY: the handle is bound to this device's stream; the operands' shapes and
        // leading dimensions are those derived above from buffers whose lengths were checked;
        // out is (n, m) column-major with ldc = n; alpha and beta are host f32 scalars (the
        // handle's default pointer mode), as compute type 32F expects.
        unsafe {
            cublas::gemm_ex(
                *self.blas.0.handle(),
                op(b.t),
                op(a.t),
                ni,
                mi,
                ki,
                &alpha as *const f32 as *const _,
                bp as *const _,
                b.m.dtype(),
                ldb,
                ap as *const _,
                a.m.dtype(),
                lda,
                &beta as *const f32 as *const _,
                o as *mut _,
                sys::cudaDataType::CUDA_R_32F,
                ni,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CudaError::Blas {
            call: "cublasGemmEx",
            reason: format!("{:?}", e.0),
        })
    }

    /// out (N, OC) = inp (N, C) · w (C, OC) + bias, overwritten (the engine's
    /// `matmul_forward`).
    pub fn matmul_forward(
        &self,
        out: &mut dyn Mem<f32>,
        inp: Operand<'_>,
        w: Operand<'_>,
        bias: Option<&dyn Mem<f32>>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<(), CudaError> {
        let (a, b) = (Op { m: inp, t: false }, Op { m: w, t: false });
        self.gemm(out, a, b, (n, oc, c), false)?;
        match bias {
            Some(bias) => self.add_bias(out, bias),
            None => Ok(()),
        }
    }

    /// dinp = dout · wᵀ (overwritten), dw += inpᵀ · dout (overwritten unless `accumulate`:
    /// beta 0, so dw is never read), dbias += Σ_rows dout (the engine's `matmul_backward`), in
    /// true fp32.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_backward(
        &self,
        dinp: Option<&mut dyn Mem<f32>>,
        dw: &mut dyn Mem<f32>,
        dbias: Option<&mut dyn Mem<f32>>,
        dout: &dyn Mem<f32>,
        inp: &dyn Mem<f32>,
        w: &dyn Mem<f32>,
        n: usize,
        c: usize,
        oc: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let f = |s, t| Op {
            m: Operand::F32(s),
            t,
        };
        if let Some(dinp) = dinp {
            self.gemm(dinp, f(dout, false), f(w, true), (n, c, oc), false)?;
        }
        self.gemm(dw, f(inp, true), f(dout, false), (c, oc, n), accumulate)?;
        match dbias {
            Some(db) => self.column_sums(db, dout),
            None => Ok(()),
        }
    }

    /// dinp = dout · wᵀ (overwritten) alone (the engine's `matmul_backward_input`).
    pub fn matmul_backward_input(
        &self,
        dinp: &mut dyn Mem<f32>,
        dout: Operand<'_>,
        w: Operand<'_>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<(), CudaError> {
        let (a, b) = (Op { m: dout, t: false }, Op { m: w, t: true });
        self.gemm(dinp, a, b, (n, c, oc), false)
    }

    /// pre (N, OC) = inp · w + bias, out = gelu(pre) (the engine's `matmul_gelu_forward`; a
    /// cuBLASLt GELU epilogue would fuse the two).
    pub fn matmul_gelu_forward(
        &self,
        pre: &mut dyn Mem<f32>,
        out: &mut dyn Mem<f32>,
        inp: Operand<'_>,
        w: Operand<'_>,
        bias: Option<&dyn Mem<f32>>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<(), CudaError> {
        self.matmul_forward(pre, inp, w, bias, n, c, oc)?;
        self.gelu_forward(out, pre)
    }

    /// logits (N, V) = inp (N, C) · wᵀ, w (V, C) (the engine's `head_forward`).
    pub fn head_forward(
        &self,
        out: &mut dyn Mem<f32>,
        inp: Operand<'_>,
        w: Operand<'_>,
        n: usize,
        c: usize,
        v: usize,
    ) -> Result<(), CudaError> {
        let (a, b) = (Op { m: inp, t: false }, Op { m: w, t: true });
        self.gemm(out, a, b, (n, v, c), false)
    }

    /// dinp = dout · w (overwritten), dw += doutᵀ · inp (overwritten unless `accumulate`) (the
    /// engine's `head_backward`), in true fp32.
    #[allow(clippy::too_many_arguments)]
    pub fn head_backward(
        &self,
        dinp: &mut dyn Mem<f32>,
        dw: &mut dyn Mem<f32>,
        dout: &dyn Mem<f32>,
        inp: &dyn Mem<f32>,
        w: &dyn Mem<f32>,
        n: usize,
        c: usize,
        v: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let f = |s, t| Op {
            m: Operand::F32(s),
            t,
        };
        self.gemm(dinp, f(dout, false), f(w, false), (n, c, v), false)?;
        self.gemm(dw, f(dout, true), f(inp, false), (v, c, n), accumulate)
    }
}

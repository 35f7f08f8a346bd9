//! Matrix products through cuBLAS's `cublasGemmEx`: bf16 operands with f32 accumulation and
//! f32 output for bf16 training, and true fp32 (`CUBLAS_COMPUTE_32F`, never TF32) for
//! `--precision fp32`. Row-major (N, C) · (C, OC) is computed as the column-major product
//! (OC, C) · (C, N), so no operand is transposed in memory. Must never pick a TF32 or
//! reduced-precision compute type on its own. cuBLASLt epilogues (bias, GELU) are later work.

use std::sync::Arc;

use cudarc::cublas::{result as cublas, sys, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;

use super::Device;
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
    F32(&'a CudaSlice<f32>),
    /// bf16.
    Bf16(&'a CudaSlice<bf16>),
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
            Operand::F32(s) => dev.p(s),
            Operand::Bf16(s) => dev.p(s),
        }
    }
}

impl Device {
    /// out (N, OC) = inp (N, C) · w (C, OC), f32 out, f32 accumulation. Both operands f32:
    /// true fp32; both bf16: tensor cores on bf16 (mixed is refused).
    pub fn matmul(
        &self,
        out: &mut CudaSlice<f32>,
        inp: Operand<'_>,
        w: Operand<'_>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<(), CudaError> {
        const K: &str = "matmul (cublasGemmEx)";
        for (arg, got, need) in [
            ("out", out.len(), n * oc),
            ("inp", inp.len(), n * c),
            ("w", w.len(), c * oc),
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
        if inp.dtype() as u32 != w.dtype() as u32 {
            return Err(CudaError::Unsupported {
                kernel: K,
                what: "inp and w must have one dtype".to_string(),
            });
        }
        let dim = |what: &str, v: usize| {
            i32::try_from(v).map_err(|_| CudaError::Unsupported {
                kernel: K,
                what: format!("{what} = {v} does not fit a 32-bit int"),
            })
        };
        let (ni, ci, oci) = (dim("N", n)?, dim("C", c)?, dim("OC", oc)?);
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (a, b, o) = (w.ptr(self), inp.ptr(self), self.p(out));
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = "matmul";
        // SAFETY: the handle is bound to this device's stream; A = w is (OC, C) column-major
        // with lda = OC, B = inp is (C, N) column-major with ldb = C, C = out is (OC, N)
        // column-major with ldc = OC, and their lengths were checked above; alpha and beta
        // are host f32 scalars (the handle's default pointer mode), matching compute 32F.
        unsafe {
            cublas::gemm_ex(
                *self.blas.0.handle(),
                sys::cublasOperation_t::CUBLAS_OP_N,
                sys::cublasOperation_t::CUBLAS_OP_N,
                oci,
                ni,
                ci,
                &alpha as *const f32 as *const _,
                a as *const _,
                w.dtype(),
                oci,
                b as *const _,
                inp.dtype(),
                ci,
                &beta as *const f32 as *const _,
                o as *mut _,
                sys::cudaDataType::CUDA_R_32F,
                oci,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CudaError::Blas {
            call: "cublasGemmEx",
            reason: format!("{:?}", e.0),
        })
    }
}

//! bf16 products of [`CudaBackend`] (`--precision bf16`): each product's operands copied to
//! bf16 in scratch owned by the backend, then `cublasGemmEx` with bf16 inputs and f32
//! accumulation and output (tensor cores); fp32 master weights, gradients and every other
//! kernel stay f32. The kernels a bf16 model adds (GELU's output kept in bf16 with its
//! derivative beside it, products of that bf16 input) are built from the device's kernels, as
//! are the fused SwiGLU products (the product into scratch, then one kernel that writes the
//! interleaved layout and the activation).
//!
//! It never runs in fp32 (`--precision fp32` stays true fp32) and never reads device memory
//! on the host. It has not run on a GPU yet.

use std::sync::Mutex;

use cudarc::driver::CudaSlice;
use half::bf16;

use super::CudaBackend;
use crate::device::{Mem, Op, Operand, Raw};
use crate::CudaError;

/// Growable device scratch: two bf16 operand copies and one f32 buffer.
#[derive(Default)]
pub(super) struct Scratch {
    bf16: [Option<CudaSlice<bf16>>; 2],
    f32: Option<CudaSlice<f32>>,
}

/// The scratch, locked for one kernel call.
pub(super) type Lock<'a> = std::sync::MutexGuard<'a, Scratch>;

/// `slot` grown to at least `len` elements; its first `len` as raw memory.
fn grown<T>(
    backend: &CudaBackend,
    slot: &mut Option<CudaSlice<T>>,
    len: usize,
) -> Result<Raw<T>, CudaError>
where
    T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits,
{
    if slot.as_ref().is_none_or(|s| s.len() < len.max(1)) {
        // Freed before the new one is taken (stream-ordered), so peak memory is one copy.
        *slot = None;
        *slot = Some(backend.dev.zeros(len.max(1))?);
    }
    let s = slot.as_ref().expect("allocated above");
    Ok(Raw::new(Mem::ptr(s, &backend.dev), len))
}

impl CudaBackend {
    pub(super) fn scratch(&self) -> Lock<'_> {
        self.scratch.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `x` copied to bf16 in scratch slot `k` (0 or 1).
    fn to_bf16(&self, s: &mut Scratch, k: usize, x: &dyn Mem<f32>) -> Result<Raw<bf16>, CudaError> {
        let mut copy = grown(self, &mut s.bf16[k], x.len())?;
        self.dev.f32_to_bf16(&mut copy, x)?;
        Ok(copy)
    }

    /// Runs `f` on the operands `a` and `b` as this backend's products take them: as they are
    /// in fp32, or as bf16 copies.
    pub(super) fn operands(
        &self,
        a: &dyn Mem<f32>,
        b: &dyn Mem<f32>,
        f: impl FnOnce(Operand<'_>, Operand<'_>) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        if !self.bf16_products() {
            return f(Operand::F32(a), Operand::F32(b));
        }
        let mut s = self.scratch();
        let (a16, b16) = (self.to_bf16(&mut s, 0, a)?, self.to_bf16(&mut s, 1, b)?);
        f(Operand::Bf16(&a16), Operand::Bf16(&b16))
    }

    /// `inp · w + bias` (N, OC) by this backend's products (fp32, or bf16 copies) into its
    /// f32 scratch, handed to `then` while the scratch is held: the fused SwiGLU products
    /// rearrange it into their outputs.
    pub(super) fn product_in_scratch(
        &self,
        inp: &dyn Mem<f32>,
        w: &dyn Mem<f32>,
        bias: Option<&dyn Mem<f32>>,
        (n, c, oc): (usize, usize, usize),
        then: impl FnOnce(&Raw<f32>) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let mut s = self.scratch();
        let mut pre = grown(self, &mut s.f32, n * oc)?;
        if self.bf16_products() {
            let (i16, w16) = (self.to_bf16(&mut s, 0, inp)?, self.to_bf16(&mut s, 1, w)?);
            let (i16, w16) = (Operand::Bf16(&i16), Operand::Bf16(&w16));
            self.dev
                .matmul_forward(&mut pre, i16, w16, bias, n, c, oc)?;
        } else {
            let (i, w) = (Operand::F32(inp), Operand::F32(w));
            self.dev.matmul_forward(&mut pre, i, w, bias, n, c, oc)?;
        }
        then(&pre)
    }

    /// `inp (bf16) · w + bias` (N, OC) in a bf16 product into this backend's f32 scratch,
    /// handed to `then` while the scratch is held: the bf16 MLP products finish it into their
    /// outputs.
    pub(super) fn bf16_product_in_scratch(
        &self,
        inp: &Raw<bf16>,
        w: &dyn Mem<f32>,
        bias: Option<&dyn Mem<f32>>,
        (n, c, oc): (usize, usize, usize),
        then: impl FnOnce(&Raw<f32>) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let mut s = self.scratch();
        let mut pre = grown(self, &mut s.f32, n * oc)?;
        let w16 = self.to_bf16(&mut s, 1, w)?;
        let (i16, w16) = (Operand::Bf16(inp), Operand::Bf16(&w16));
        self.dev
            .matmul_forward(&mut pre, i16, w16, bias, n, c, oc)?;
        then(&pre)
    }

    /// The engine's `matmul_gelu_forward_bf16`: `out` = bf16(gelu(pre)), `grad` = gelu'(pre),
    /// pre = inp (bf16) · w + bias in a bf16 product (pre itself in f32 scratch).
    pub(super) fn gelu_forward_bf16_out(
        &self,
        grad: &mut dyn Mem<f32>,
        out: &mut dyn Mem<bf16>,
        inp: &Raw<bf16>,
        w: &dyn Mem<f32>,
        bias: Option<&dyn Mem<f32>>,
        dims: (usize, usize, usize),
    ) -> Result<(), CudaError> {
        self.bf16_product_in_scratch(inp, w, bias, dims, |pre| {
            // grad holds gelu(pre) on the way to out, then the derivative: 1 · gelu'(pre).
            self.dev.gelu_forward(grad, pre)?;
            self.dev.f32_to_bf16(out, grad)?;
            self.dev.fill(grad, 1.0)?;
            self.dev.gelu_backward(grad, pre)
        })
    }

    /// A normalisation's output in bf16 (the engine's `layernorm_forward_bf16`,
    /// `rmsnorm_forward_bf16`): `norm` writes its `len` f32 values into this backend's f32
    /// scratch, then `out` receives them rounded to bf16.
    pub(super) fn norm_to_bf16(
        &self,
        out: &mut dyn Mem<bf16>,
        len: usize,
        norm: impl FnOnce(&mut Raw<f32>) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let mut s = self.scratch();
        let mut x = grown(self, &mut s.f32, len)?;
        norm(&mut x)?;
        self.dev.f32_to_bf16(out, &x)
    }

    /// The engine's `matmul_forward_bf16_input`: out = inp (bf16) · w + bias.
    pub(super) fn forward_bf16_input(
        &self,
        out: &mut dyn Mem<f32>,
        inp: &Raw<bf16>,
        w: &dyn Mem<f32>,
        bias: Option<&dyn Mem<f32>>,
        (n, c, oc): (usize, usize, usize),
    ) -> Result<(), CudaError> {
        let mut s = self.scratch();
        let w16 = self.to_bf16(&mut s, 1, w)?;
        let (i, w) = (Operand::Bf16(inp), Operand::Bf16(&w16));
        self.dev.matmul_forward(out, i, w, bias, n, c, oc)
    }

    /// The engine's `matmul_backward_weight_bf16_input`: dw += inpᵀ (bf16) · dout in a bf16
    /// product (overwritten unless `accumulate`), dbias += Σ_rows dout (in f32).
    pub(super) fn backward_weight_bf16_input(
        &self,
        dw: &mut dyn Mem<f32>,
        dbias: Option<&mut dyn Mem<f32>>,
        dout: &dyn Mem<f32>,
        inp: &Raw<bf16>,
        (n, c, oc): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let mut s = self.scratch();
        let d16 = self.to_bf16(&mut s, 0, dout)?;
        let a = Op {
            m: Operand::Bf16(inp),
            t: true,
        };
        let b = Op {
            m: Operand::Bf16(&d16),
            t: false,
        };
        self.dev.gemm(dw, a, b, (c, oc, n), accumulate)?;
        match dbias {
            Some(db) => self.dev.column_sums(db, dout),
            None => Ok(()),
        }
    }
}

/// A u16 view's memory as the bf16 it holds.
pub(super) fn as_bf16(m: &Raw<u16>, dev: &crate::Device) -> Raw<bf16> {
    Raw::new(Mem::ptr(m, dev), Mem::len(m))
}

/// A fresh, empty scratch.
pub(super) fn scratch() -> Mutex<Scratch> {
    Mutex::new(Scratch::default())
}

//! [`CudaBackend`]: the engine's [`Backend`](cohort_engine::Backend) on one GPU, each kernel of
//! the engine's list mapped to the [`Device`]'s kernel of the same job, on the views of buffers
//! it allocated (the mapping is in `kernels.rs`).
//!
//! Buffers are cudarc allocations handed to the engine as [`Buffer::on_device`] (the cudarc
//! buffer is the owner: dropping the engine buffer frees it). A kernel call checks that every
//! view is memory of this device, then launches on the views' addresses ([`Raw`]); launches are
//! asynchronous, so a kernel's error (a shape the device refuses, a launch that fails, a kernel
//! with no CUDA body yet) is kept and returned by the next
//! [`Backend::sync`](cohort_engine::Backend::sync). The kernels without a CUDA body are listed
//! in [`MISSING`] (the model refuses to build on this backend when it needs one of them); the
//! attention kernels serve grouped key/value heads and packed segments.
//! Matrix products are true fp32, or on a backend of `DType::Bf16` bf16 copies of their
//! operands multiplied on tensor cores with f32 accumulation (`bf16.rs`; the weight gradients
//! of fp32 inputs stay fp32).
//!
//! This module never panics on a device error and never reads device memory on the host
//! except through an explicit copy; it knows buffers and dimensions only.

#![allow(clippy::too_many_arguments)]

mod bf16;
mod kernels;

use std::sync::Mutex;

use cohort_engine::cpu::AttnDims;
use cohort_engine::{
    Buffer, DType, Device as EngineDevice, Dropout, Elem, EngineError, Event, Staging, View,
    ViewMut,
};
use cudarc::driver::{CudaEvent, CudaSlice, DeviceRepr};

use crate::device::{Device, Mem, Raw};
use crate::libraries::Search;
use crate::CudaError;

/// The kernels of the engine's list with no CUDA body yet.
pub const MISSING: &[&str] = &[
    "decode_matmul_forward",
    "attention_decode_row",
    "attention_decode_row_bf16",
    // optional: a model keeps qkv in f32 without them
    "matmul_forward_bf16_out",
    "attention_forward_bf16_qkv",
    "attention_backward_bf16_qkv",
];

/// The engine's backend on one GPU (see the module doc).
pub struct CudaBackend {
    dev: Device,
    /// The engine's name of the device (`cuda:N`).
    device: EngineDevice,
    /// The first error of a kernel since the last sync.
    error: Mutex<Option<EngineError>>,
    /// The attention backward's per-row scratch (B·NH·T floats), grown on demand.
    delta: Mutex<Option<CudaSlice<f32>>>,
    /// What the matrix products compute in.
    dtype: DType,
    /// The bf16 products' operand copies, grown on demand.
    scratch: Mutex<bf16::Scratch>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.device)
            .field("name", &self.dev.info().name)
            .finish()
    }
}

impl CudaBackend {
    /// Opens GPU `ordinal` ([`Device::open`]) as a backend whose matrix products compute in
    /// `dtype` (bf16: bf16 copies of the operands, f32 accumulation).
    pub fn open(ordinal: usize, dtype: DType, search: &Search) -> Result<CudaBackend, CudaError> {
        Ok(CudaBackend::on(Device::open(ordinal, search)?).with_dtype(dtype))
    }

    /// The same backend with its products in `dtype`.
    pub fn with_dtype(self, dtype: DType) -> CudaBackend {
        CudaBackend { dtype, ..self }
    }

    /// Whether the products take bf16 copies of their operands.
    fn bf16_products(&self) -> bool {
        self.dtype == DType::Bf16
    }

    /// The fp32 backend on an opened device.
    pub fn on(dev: Device) -> CudaBackend {
        CudaBackend {
            device: EngineDevice::Cuda(dev.info().ordinal as u32),
            dev,
            error: Mutex::new(None),
            delta: Mutex::new(None),
            dtype: DType::F32,
            scratch: bf16::scratch(),
        }
    }

    /// The device it launches on.
    pub fn device_handle(&self) -> &Device {
        &self.dev
    }

    /// [`Backend::record_event`](cohort_engine::Backend::record_event): an event, or (unable to record one) a wait for the kernels
    /// with the error kept for the next sync.
    fn event(&self) -> Event {
        match self.dev.record_event() {
            Ok(event) => Event::on_device(Box::new(event)),
            // The contract: wait for the kernels instead, the error kept for the next sync.
            Err(e) => {
                self.fail(self.device_error("record an event", e));
                if let Err(e) = self.dev.sync() {
                    self.fail(self.device_error("sync in place of an event", e));
                }
                Event::done()
            }
        }
    }

    /// [`Backend::copy_to_host_after`](cohort_engine::Backend::copy_to_host_after): on the
    /// copy queue after `after` where it is this device's event, else the ordinary copy.
    fn copy_after(
        &self,
        dst: &mut [u8],
        src: View<'_, u8>,
        after: &Event,
    ) -> Result<(), EngineError> {
        let what = "copy to the host after an event";
        let src = self.r(src).map_err(|e| self.device_error(what, e))?;
        match after.device().and_then(|e| e.downcast_ref::<CudaEvent>()) {
            Some(event) => self.dev.copy_to_host_after(dst, &src, event),
            // Done already (recorded in place of a failed event, or by another backend):
            // the ordinary copy, after every kernel so far, is as late as it needs to be.
            None => self.dev.copy_to_host(dst, &src),
        }
        .map_err(|e| self.device_error(what, e))
    }

    /// [`Backend::alloc_staging`](cohort_engine::Backend::alloc_staging): page-locked host floats.
    fn staging(&self, len: usize) -> Result<Staging, EngineError> {
        let alloc_error = |e: CudaError| EngineError::Alloc {
            device: self.device,
            bytes: 4 * len,
            reason: format!("page-locked host memory: {e}"),
        };
        let mut pinned = self.dev.alloc_pinned(len).map_err(alloc_error)?;
        let ptr = pinned
            .as_mut_ptr()
            .map_err(|e| alloc_error(CudaError::driver("cuEventSynchronize", e)))?;
        // SAFETY: `ptr` is the start of `len` zeroed f32s of page-locked memory (alloc_pinned)
        // that `pinned` keeps allocated at that address until the owner is dropped; the owner's
        // drop waits for every copy of the context before `pinned` frees them, and this
        // backend's copies into them return only once the bytes have landed.
        Ok(unsafe { Staging::from_raw(ptr, len, Box::new(PinnedStaging(pinned))) })
    }

    /// Keeps the first error for the next sync.
    fn fail(&self, e: EngineError) {
        let mut first = self.error.lock().unwrap_or_else(|p| p.into_inner());
        first.get_or_insert(e);
    }

    fn device_error(&self, kernel: &str, e: CudaError) -> EngineError {
        EngineError::Device {
            device: self.device,
            reason: format!("{kernel}: {e}"),
        }
    }

    /// Runs one kernel's launches, keeping an error for the next sync.
    fn run(&self, kernel: &'static str, f: impl FnOnce() -> Result<(), CudaError>) {
        if let Err(e) = f() {
            self.fail(self.device_error(kernel, e));
        }
    }

    /// A kernel with no CUDA body: an error for the next sync.
    fn missing(&self, kernel: &'static str) {
        self.fail(EngineError::Unsupported {
            device: self.device,
            kernel,
        });
    }

    /// The memory of a view, if it is this device's.
    fn mem<T: Elem>(
        &self,
        what: &'static str,
        device: EngineDevice,
        addr: u64,
        len: usize,
    ) -> Result<Raw<T>, CudaError> {
        if device != self.device {
            return Err(CudaError::Unsupported {
                kernel: what,
                what: format!("a view on {device} given to {}", self.device),
            });
        }
        Ok(Raw::new(addr, len))
    }

    fn r<T: Elem>(&self, v: View<'_, T>) -> Result<Raw<T>, CudaError> {
        self.mem("a kernel", v.device(), v.addr(), v.len())
    }

    fn w<T: Elem>(&self, v: ViewMut<'_, T>) -> Result<Raw<T>, CudaError> {
        self.mem("a kernel", v.device(), v.addr(), v.len())
    }

    fn ro<T: Elem>(&self, v: Option<View<'_, T>>) -> Result<Option<Raw<T>>, CudaError> {
        v.map(|v| self.r(v)).transpose()
    }

    fn wo<T: Elem>(&self, v: Option<ViewMut<'_, T>>) -> Result<Option<Raw<T>>, CudaError> {
        v.map(|v| self.w(v)).transpose()
    }

    /// A value computed on the device and read back (after the kernels before it).
    fn value(&self, kernel: &'static str, f: impl FnOnce() -> Result<f64, CudaError>) -> f64 {
        f().unwrap_or_else(|e| {
            self.fail(self.device_error(kernel, e));
            f64::NAN
        })
    }
}

/// What an attention call attends with, besides its buffers.
struct Attention<'a> {
    mask: Option<View<'a, u8>>,
    segments: Option<View<'a, u32>>,
    dims: AttnDims,
    nkv: usize,
    dropout: Option<Dropout>,
}

impl CudaBackend {
    fn attention_fwd(
        &self,
        kernel: &'static str,
        out: ViewMut<'_, f32>,
        lse: ViewMut<'_, f32>,
        qkv: View<'_, f32>,
        a: Attention<'_>,
    ) {
        self.run(kernel, || {
            let (mut o, mut l) = (self.w(out)?, self.w(lse)?);
            let (q, m, s) = (self.r(qkv)?, self.ro(a.mask)?, self.ro(a.segments)?);
            let keys = (opt(&m), opt(&s));
            self.dev
                .attention_forward(&mut o, &mut l, &q, keys, a.dims, a.nkv, a.dropout)
        })
    }

    fn attention_bwd(
        &self,
        kernel: &'static str,
        dqkv: ViewMut<'_, f32>,
        recompute_out: Option<ViewMut<'_, f32>>,
        dout: View<'_, f32>,
        qkv: View<'_, f32>,
        lse: View<'_, f32>,
        a: Attention<'_>,
    ) {
        self.run(kernel, || {
            let (mut dq, mut ro) = (self.w(dqkv)?, self.wo(recompute_out)?);
            let (d, q, l) = (self.r(dout)?, self.r(qkv)?, self.r(lse)?);
            let (m, s) = (self.ro(a.mask)?, self.ro(a.segments)?);
            let dims = a.dims;
            let rows = dims.b * dims.nh * dims.t;
            let mut delta = self.delta.lock().unwrap_or_else(|p| p.into_inner());
            if delta.as_ref().is_none_or(|s| s.len() < rows) {
                *delta = None;
                *delta = Some(self.dev.zeros(rows)?);
            }
            let delta = delta.as_mut().expect("allocated above");
            let (ro, keys) = (opt_mut(&mut ro), (opt(&m), opt(&s)));
            self.dev
                .attention_backward(&mut dq, ro, delta, &d, &q, &l, keys, dims, a.nkv, a.dropout)
        })
    }
}

/// `Option<Raw<T>>` as the kernel methods take optional memory.
fn opt<T>(m: &Option<Raw<T>>) -> Option<&dyn Mem<T>> {
    m.as_ref().map(|m| m as &dyn Mem<T>)
}

fn opt_mut<T>(m: &mut Option<Raw<T>>) -> Option<&mut dyn Mem<T>> {
    m.as_mut().map(|m| m as &mut dyn Mem<T>)
}

/// A buffer of `len` zeroed elements on `dev`, owned by the engine buffer.
fn engine_buffer<T: DeviceRepr + cudarc::driver::ValidAsZeroBits + Send + Sync + 'static>(
    backend: &CudaBackend,
    len: usize,
) -> Result<Buffer, EngineError> {
    let s: CudaSlice<T> = backend.dev.zeros(len).map_err(|e| EngineError::Alloc {
        device: backend.device,
        bytes: len * std::mem::size_of::<T>(),
        reason: e.to_string(),
    })?;
    let addr = s.ptr(&backend.dev);
    Ok(Buffer::on_device(backend.device, addr, len, Box::new(s)))
}

/// The owner of a [`Staging`](cohort_engine::Staging) in page-locked memory: waits for every
/// operation of the context before the memory is freed (an upload from it may still be queued:
/// a copy from page-locked memory runs after the call returns).
struct PinnedStaging(cudarc::driver::PinnedHostSlice<f32>);

impl Drop for PinnedStaging {
    fn drop(&mut self) {
        // An error here is the context's own, which its next call reports.
        let _ = self.0.context().synchronize();
    }
}

/// `host` as bytes.
fn host_bytes(host: &mut [f32]) -> &mut [u8] {
    ViewMut::from(host).cast::<u8>().host()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_missing_kernels_are_kernels_of_the_engines_list() {
        for k in MISSING {
            assert!(
                cohort_engine::KERNELS.contains(k),
                "{k} is not an engine kernel"
            );
        }
    }

    #[test]
    fn opening_without_a_gpu_is_an_error_not_a_panic() {
        for dtype in [DType::F32, DType::Bf16] {
            match CudaBackend::open(0, dtype, &Search::from_env()) {
                Ok(b) => eprintln!("a GPU is here: {b:?}"),
                Err(e) => assert!(!e.to_string().contains('\n'), "one line: {e}"),
            }
        }
    }
}

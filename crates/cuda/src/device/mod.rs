//! A GPU opened for the kernels: its context and stream, the kernel families compiled by
//! NVRTC for its architecture and loaded, and copies between host and device.
//!
//! [`Device::open`] finds and opens the driver before cudarc's first call, so no GPU is a
//! [`CudaError`], never a panic. Launches are asynchronous: a kernel's fault surfaces at the
//! next [`Device::sync`], which names the last kernel launched. The kernels themselves (shape
//! checks, then one launch each) are in `ops.rs` and `blas.rs`. Must never hand out a buffer
//! another stream writes: every kernel runs on the one stream; the two others, made on first
//! use, only copy: to the host after an event of it ([`Device::copy_to_host_after`]), and
//! to memory no kernel in flight touches ([`Device::copy_from_host_beside`]).

mod blas;
mod mem;
mod ops;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DeviceRepr, LaunchArgs,
    LaunchConfig, PinnedHostSlice, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

pub use blas::{Op, Operand};
pub use mem::{Mem, Raw};
pub use ops::{AdamWScalars, SwiGluLayout};

use crate::kernels;
use crate::libraries::{Library, Search};
use crate::nvrtc::{Arch, Compiler};
use crate::CudaError;

/// What the driver says about a device.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// The ordinal opened.
    pub ordinal: usize,
    /// "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// Compute capability (9, 0).
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub sm_count: i32,
    /// Device memory, bytes.
    pub total_memory: usize,
    /// The driver's CUDA version (13000 = 13.0).
    pub driver_version: i32,
    /// Devices the driver sees.
    pub device_count: usize,
}

/// An opened GPU with every kernel family loaded.
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: HashMap<&'static str, CudaFunction>,
    blas: blas::Blas,
    info: DeviceInfo,
    arch: Arch,
    compiler: Compiler,
    /// The last kernel launched, for the error of the sync that finds it failed.
    last: Mutex<&'static str>,
    /// The stream of [`Device::copy_to_host_after`] (non-blocking: it never waits for the
    /// kernels' stream but through an event), made on its first use.
    copies: OnceLock<Arc<CudaStream>>,
    /// The stream of [`Device::copy_from_host_beside`], apart from the downloads' so that an
    /// upload never queues behind a download's wait for the kernels.
    uploads: OnceLock<Arc<CudaStream>>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("info", &self.info).finish()
    }
}

/// Opens the driver and initialises it; returns the number of devices. Safe to call without a
/// GPU: a missing driver is [`CudaError::LibraryNotFound`].
pub fn device_count(search: &Search) -> Result<usize, CudaError> {
    search.open(&[Library::Driver])?;
    cudarc::driver::result::init().map_err(|e| CudaError::driver("cuInit", e))?;
    let n = CudaContext::device_count().map_err(|e| CudaError::driver("cuDeviceGetCount", e))?;
    Ok(n.max(0) as usize)
}

impl Device {
    /// Opens device `ordinal`: the driver, then NVRTC, cuBLAS, the kernels compiled for the
    /// device's architecture and loaded.
    pub fn open(ordinal: usize, search: &Search) -> Result<Device, CudaError> {
        let count = device_count(search)?;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        search.open(&[Library::CublasLt, Library::Cublas])?;
        let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::driver("cuCtxCreate", e))?;
        let stream = ctx.default_stream();
        let compute_capability = ctx
            .compute_capability()
            .map_err(|e| CudaError::driver("cuDeviceGetAttribute(compute capability)", e))?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| CudaError::driver("cuDeviceGetAttribute(SM count)", e))?;
        let mut driver_version = 0;
        // SAFETY: the driver is open and initialised (device_count); the out-pointer is valid.
        unsafe { sys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .map_err(|e| CudaError::driver("cuDriverGetVersion", e))?;
        let info = DeviceInfo {
            ordinal,
            name: ctx
                .name()
                .map_err(|e| CudaError::driver("cuDeviceGetName", e))?,
            compute_capability,
            sm_count,
            total_memory: ctx
                .total_mem()
                .map_err(|e| CudaError::driver("cuDeviceTotalMem", e))?,
            driver_version,
            device_count: count,
        };
        let arch = Arch((compute_capability.0 * 10 + compute_capability.1) as u32);
        let compiler = Compiler::new(search)?;
        let mut functions = HashMap::new();
        for family in kernels::FAMILIES {
            let compiled = compiler.compile(family, arch)?;
            let module = ctx
                .load_module(Ptx::from_binary(compiled.cubin))
                .map_err(|e| {
                    CudaError::driver(format!("cuModuleLoadData({}.cu)", family.name), e)
                })?;
            for &k in family.kernels {
                let f = module
                    .load_function(k)
                    .map_err(|e| CudaError::driver(format!("cuModuleGetFunction({k})"), e))?;
                functions.insert(k, f);
            }
        }
        let blas = blas::Blas::new(stream.clone())?;
        Ok(Device {
            ctx,
            stream,
            functions,
            blas,
            info,
            arch,
            compiler,
            last: Mutex::new("(none)"),
            copies: OnceLock::new(),
            uploads: OnceLock::new(),
        })
    }

    /// What the driver says about this device.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The architecture the kernels were compiled for.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// The stream every kernel and copy runs on, as a raw `CUstream` (0 is the context's
    /// default stream): what a collective library queues its work on to stay in order.
    pub fn stream_handle(&self) -> u64 {
        self.stream.cu_stream() as usize as u64
    }

    /// The NVRTC that compiled them.
    pub fn compiler(&self) -> &Compiler {
        &self.compiler
    }

    /// (free, total) device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize), CudaError> {
        self.ctx
            .mem_get_info()
            .map_err(|e| CudaError::driver("cuMemGetInfo", e))
    }

    /// A new device buffer holding `host`.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        self.stream.clone_htod(host).map_err(|e| {
            CudaError::driver(format!("copy {} elements to the device", host.len()), e)
        })
    }

    /// A new zeroed device buffer of `len` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        self.stream
            .alloc_zeros(len)
            .map_err(|e| CudaError::driver(format!("allocate {len} elements"), e))
    }

    /// `dev`'s contents, after every kernel before it on the stream.
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        let mut host = vec![T::default(); dev.len()];
        self.stream
            .memcpy_dtoh(dev, &mut host)
            .map_err(|e| self.after_last("copy to the host", e))?;
        self.sync()?;
        Ok(host)
    }

    /// Overwrites `dev` with `host` (the lengths must match).
    pub fn copy_to<T: DeviceRepr>(
        &self,
        dev: &mut CudaSlice<T>,
        host: &[T],
    ) -> Result<(), CudaError> {
        if dev.len() != host.len() {
            return Err(CudaError::Shape {
                kernel: "copy to the device",
                arg: "host buffer",
                need: dev.len(),
                got: host.len(),
            });
        }
        self.stream
            .memcpy_htod(host, dev)
            .map_err(|e| CudaError::driver("copy to the device", e))
    }

    /// Copies host bytes into device memory `dst` of the same length, in stream order (the
    /// host bytes may be reused on return: pageable memory is staged before it).
    pub fn copy_from_host(&self, dst: &dyn Mem<u8>, src: &[u8]) -> Result<(), CudaError> {
        if dst.len() != src.len() {
            return Err(CudaError::Shape {
                kernel: "copy to the device",
                arg: "host bytes",
                need: dst.len(),
                got: src.len(),
            });
        }
        // SAFETY: `dst` is `src.len()` bytes of this context's memory (checked above), kept
        // allocated by its owner while the copy is queued on this stream, which is the only
        // stream that touches it.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dst.ptr(self), src, self.stream.cu_stream())
        }
        .map_err(|e| CudaError::driver("copy to the device", e))
    }

    /// Copies device memory `src` into host bytes of the same length, after every kernel
    /// before it on the stream.
    pub fn copy_to_host(&self, dst: &mut [u8], src: &dyn Mem<u8>) -> Result<(), CudaError> {
        if dst.len() != src.len() {
            return Err(CudaError::Shape {
                kernel: "copy to the host",
                arg: "host bytes",
                need: src.len(),
                got: dst.len(),
            });
        }
        // SAFETY: `src` is `dst.len()` bytes of this context's memory (checked above), alive
        // until the sync below, and `dst` is not touched until the copy has completed.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(dst, src.ptr(self), self.stream.cu_stream())
        }
        .map_err(|e| self.after_last("copy to the host", e))?;
        self.sync()
    }

    /// An event after every launch so far on the kernels' stream.
    pub fn record_event(&self) -> Result<CudaEvent, CudaError> {
        self.stream
            .record_event(None)
            .map_err(|e| self.after_last("record an event", e))
    }

    /// Copies device memory `src` into host bytes of the same length once the work before
    /// `after` (an event of [`Device::record_event`]) is done, on the copy stream, so that the
    /// copy overlaps the kernels launched after the event; returns when the bytes have landed.
    /// Into page-locked memory ([`Device::alloc_pinned`]) the copy runs at the link's speed.
    pub fn copy_to_host_after(
        &self,
        dst: &mut [u8],
        src: &dyn Mem<u8>,
        after: &CudaEvent,
    ) -> Result<(), CudaError> {
        if dst.len() != src.len() {
            return Err(CudaError::Shape {
                kernel: "copy to the host after an event",
                arg: "host bytes",
                need: src.len(),
                got: dst.len(),
            });
        }
        let copies = self.side_stream(&self.copies, "copies")?;
        copies
            .wait(after)
            .map_err(|e| self.after_last("cuStreamWaitEvent(copies)", e))?;
        // The calling thread (a reducer's) may never have used the context.
        self.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::driver("cuCtxSetCurrent", e))?;
        // SAFETY: `src` is `dst.len()` bytes of this context's memory (checked above), kept
        // allocated by its owner (the caller's view borrows it) until the synchronize below;
        // the copy stream waits for `after`, the caller's promise that the kernels writing
        // `src` come before it and none after it; `dst` is not touched by the host until the
        // copy has completed (the synchronize below, before return).
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(dst, src.ptr(self), copies.cu_stream())
        }
        .map_err(|e| self.after_last("copy to the host after an event", e))?;
        copies
            .synchronize()
            .map_err(|e| self.after_last("copy to the host after an event", e))
    }

    /// Copies host bytes into device memory `dst` of the same length on the uploads' stream,
    /// apart from the kernels' (so that it overlaps them), and returns when they have landed.
    /// The caller promises that no kernel in flight reads or writes `dst`.
    pub fn copy_from_host_beside(&self, dst: &dyn Mem<u8>, src: &[u8]) -> Result<(), CudaError> {
        if dst.len() != src.len() {
            return Err(CudaError::Shape {
                kernel: "copy to the device beside the kernels",
                arg: "host bytes",
                need: dst.len(),
                got: src.len(),
            });
        }
        let uploads = self.side_stream(&self.uploads, "uploads")?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::driver("cuCtxSetCurrent", e))?;
        // SAFETY: `dst` is `src.len()` bytes of this context's memory (checked above), kept
        // allocated by its owner (the caller's view borrows it) until the synchronize below;
        // no kernel touches it meanwhile (the caller's promise); `src` is read until the copy
        // has completed (the synchronize below, before return).
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dst.ptr(self), src, uploads.cu_stream())
        }
        .map_err(|e| self.after_last("copy to the device beside the kernels", e))?;
        uploads
            .synchronize()
            .map_err(|e| self.after_last("copy to the device beside the kernels", e))
    }

    /// One of the side streams, made on its first use (non-blocking: it waits for the
    /// kernels' stream only through events).
    fn side_stream<'a>(
        &self,
        slot: &'a OnceLock<Arc<CudaStream>>,
        name: &str,
    ) -> Result<&'a Arc<CudaStream>, CudaError> {
        if let Some(s) = slot.get() {
            return Ok(s);
        }
        let made = self
            .ctx
            .new_stream()
            .map_err(|e| CudaError::driver(format!("cuStreamCreate({name})"), e))?;
        Ok(slot.get_or_init(|| made))
    }

    /// `len` zeroed f32s of page-locked host memory (cacheable: the host reads and writes what
    /// it stages, which write-combined memory makes slow).
    pub fn alloc_pinned(&self, len: usize) -> Result<PinnedHostSlice<f32>, CudaError> {
        let what = || format!("cuMemHostAlloc({} bytes)", 4 * len);
        // SAFETY: the memory is uninitialised on return: it is zeroed below before anything
        // reads it. Flags 0: page-locked, cacheable, this context's.
        let mut pinned = unsafe { self.ctx.alloc_pinned_with_flags::<f32>(len, 0) }
            .map_err(|e| CudaError::driver(what(), e))?;
        let ptr = pinned
            .as_mut_ptr()
            .map_err(|e| CudaError::driver(what(), e))?;
        // SAFETY: `ptr` is the start of the `len` f32s just allocated (aligned, as the driver
        // allocates pages), which nothing else reaches yet; all-zero bits are 0.0.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(pinned)
    }

    /// Waits for every launch so far; a fault is reported with the last kernel's name.
    pub fn sync(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(|e| self.after_last("synchronize", e))
    }

    fn after_last(&self, what: &str, e: cudarc::driver::DriverError) -> CudaError {
        let last = *self.last.lock().unwrap_or_else(|p| p.into_inner());
        CudaError::driver(format!("{what} (after kernel {last})"), e)
    }

    /// Launches `kernel` with the arguments `push` adds, and notes it as the last kernel.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type, and every
    /// buffer must hold what the kernel reads and writes for `cfg` (the callers in `ops.rs`
    /// check the lengths against the dims first).
    unsafe fn launch<'a>(
        &'a self,
        kernel: &'static str,
        cfg: LaunchConfig,
        push: impl FnOnce(&mut LaunchArgs<'a>),
    ) -> Result<(), CudaError> {
        let f = self
            .functions
            .get(kernel)
            .ok_or_else(|| CudaError::Unsupported {
                kernel,
                what: "not loaded (missing from kernels::FAMILIES)".to_string(),
            })?;
        let mut args = self.stream.launch_builder(f);
        push(&mut args);
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = kernel;
        // SAFETY: the caller's contract (above).
        unsafe { args.launch(cfg) }
            .map(|_| ())
            .map_err(|e| CudaError::driver(format!("launch {kernel}"), e))
    }
}

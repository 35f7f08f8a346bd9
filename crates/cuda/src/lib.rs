//! The CUDA device: finding the NVIDIA libraries at run time, compiling the kernels with NVRTC,
//! launching them, and the engine's [`Backend`](cohort_engine::Backend) on a GPU
//! ([`CudaBackend`]), whose buffers are device memory; its kernels are checked one by one
//! against the CPU backend's ([`check`]).
//!
//! - [`libraries`] finds libcuda, NVRTC, cuBLAS(Lt) and NCCL (system paths, `LD_LIBRARY_PATH`,
//!   the `nvidia/*/lib` folders of Python environments) and the CUDA runtime headers, and
//!   opens them before cudarc's first call.
//! - [`kernels`] holds the CUDA C sources, one file per family, with the engine's kernel
//!   signatures (outputs first, llm.c's conventions).
//! - [`nvrtc`] compiles them for an `sm_XX`, failing on an error or a register spill (CI does
//!   this for sm_80 and sm_90 with no GPU).
//! - [`Device`] opens a GPU, loads the compiled kernels, copies buffers and launches.
//! - [`CudaBackend`] maps each kernel of the engine's list to the device's kernel for the same
//!   job, on the views of buffers it allocated; the kernels without a CUDA body yet are
//!   [`backend::MISSING`] (a model that needs one refuses to build on it).
//! - [`check`] runs every kernel against the CPU engine on random inputs (`cohort gpu check`).
//!
//! This crate builds and its tests pass with no GPU and no CUDA installed: nothing is linked
//! at build time, and every library is looked for before cudarc touches it. It must never
//! panic on a missing library or device (that is a one-line [`CudaError`] naming what was
//! looked for and where), never claim a GPU result it did not measure, and never depend on a
//! model, a collective or the training loop: it knows buffers and dimensions only.
//!
//! ```no_run
//! use cohort_cuda::{libraries::Search, Device};
//!
//! let search = Search::from_env();
//! let dev = Device::open(0, &search)?; // "no GPU/driver: looked for libcuda.so.1 ..." without one
//! let x = dev.upload(&[1.0f32, -2.0])?;
//! let mut y = dev.upload(&[0.0f32; 2])?;
//! dev.gelu_forward(&mut y, &x)?;
//! println!("{:?}", dev.download(&y)?);
//! # Ok::<(), cohort_cuda::CudaError>(())
//! ```

#![deny(missing_docs)]

pub mod backend;
pub mod check;
mod device;
mod error;
pub mod info;
pub mod kernels;
pub mod libraries;
pub mod nvrtc;

pub use backend::CudaBackend;
pub use device::{
    device_count, AdamWScalars, Device, DeviceInfo, Mem, Op, Operand, Raw, SwiGluLayout,
};
pub use error::CudaError;

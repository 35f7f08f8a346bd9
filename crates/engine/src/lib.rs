//! The compute engine: fused forward/backward kernels for a GPT-2 training step, the thread pool
//! they run on, and the optimizers that consume their gradients.
//!
//! - [`Backend`] is the device boundary: every kernel the model calls, the memory they work on
//!   ([`Backend::alloc`], copies to and from the host) and [`Backend::sync`], the error channel
//!   of a device that runs kernels asynchronously. [`cpu::Cpu`] implements it on a persistent
//!   rayon pool sized by `COHORT_NUM_THREADS` (default: the cores this process may use), with
//!   AVX-512 / AVX2 code picked at run time and matrix products on `matrixmultiply`'s sgemm.
//! - [`Buffer`] is what a backend allocates: host memory (an [`AlignedFloats`]) or a device's
//!   (an address and an owner object the device backend supplies, so the engine links no device
//!   library). Kernels take [`View`]s / [`ViewMut`]s of buffers, carved as slices are (ranges,
//!   `split_at_mut`) under the same borrow rules; the CPU turns each into its slice in O(1).
//!   A device backend (`cohort-cuda`) implements [`Backend`] over [`Device::Cuda`] buffers;
//!   [`Emulated`] is one whose device memory is host memory, to test device code paths (a
//!   model that never reads its buffers on the host) on machines without a GPU.
//! - [`Event`] and [`Staging`] are what a host-staged collective needs from a device: a point
//!   in its queue of kernels and page-locked host memory, for a copy of finished gradients
//!   that overlaps the kernels still running ([`Backend::copy_to_host_after`]).
//! - [`Dropout`] derives every dropout decision from (seed, rank, step, site, index), so masks
//!   are reproducible and never stored.
//! - [`optim`] holds AdamW, SGD, the LR schedule and gradient clipping over flat buffers; AdamW's
//!   update and the squared gradient norm are also backend kernels, for state in a device's
//!   memory ([`optim::AdamW::step_on`], [`optim::clip_grad_norm_on`]).
//! - [`AlignedFloats`] is the f32 buffer the kernels stream through (activations, parameters,
//!   gradients, optimizer state): it starts on a cache line, so no vector of a row straddles two.
//!
//! The engine knows buffers and dimensions, never models or networks: it must never allocate
//! inside a kernel, and no result may depend on the number of threads.
//!
//! ```
//! use cohort_engine::{cpu::Cpu, Backend};
//!
//! let cpu = Cpu::new(2).unwrap();
//! let dev: &dyn Backend = &cpu;
//! let (x, w) = ([1.0f32, 2.0, 3.0, 4.0], [1.0f32, 0.0, 0.0, 1.0]); // (2, 2) · identity
//! let mut buf = dev.alloc(12).unwrap(); // x, w and out in one allocation
//! let (mut xw, mut out) = buf.view_mut().split_at_mut(8);
//! dev.upload(xw.reborrow(), &[x, w].concat()).unwrap();
//! let (x_v, w_v) = xw.as_view().split_at(4);
//! dev.install(&mut || dev.matmul_forward(out.reborrow(), x_v, w_v, None, 2, 2, 2));
//! dev.sync().unwrap();
//! let mut got = [0.0f32; 4];
//! dev.download(&mut got, buf.view().slice(8..)).unwrap();
//! assert_eq!(got, x);
//! ```

#![deny(missing_docs)]

mod aligned;
mod backend;
mod buffer;
pub mod cpu;
mod dropout;
mod emulated;
pub mod optim;
mod staging;

pub use aligned::AlignedFloats;
pub use backend::{Backend, DType, Device, KERNELS};
pub use buffer::{Buffer, Elem, View, ViewMut};
pub use dropout::Dropout;
pub use emulated::Emulated;
pub use staging::{Event, Staging};

/// What went wrong setting up the engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// `COHORT_NUM_THREADS` is not a positive integer.
    #[error("COHORT_NUM_THREADS={value:?} is not a positive integer")]
    BadThreadCount {
        /// The variable's value.
        value: String,
    },
    /// A device could not allocate memory.
    #[error("cannot allocate {bytes} bytes on {device}: {reason}")]
    Alloc {
        /// Where.
        device: Device,
        /// How many.
        bytes: usize,
        /// The driver's error.
        reason: String,
    },
    /// A device reported an error (a kernel's launch or run, a copy).
    #[error("{device}: {reason}")]
    Device {
        /// Which device.
        device: Device,
        /// What failed, with the device library's error.
        reason: String,
    },
    /// A kernel this device has no implementation of yet.
    #[error("not yet on {device}: {kernel}")]
    Unsupported {
        /// The device.
        device: Device,
        /// The kernel (its name in the backend's list).
        kernel: &'static str,
    },
    /// The thread pool could not be started.
    #[error("cannot start a pool of {threads} threads: {reason}")]
    ThreadPool {
        /// Threads asked for.
        threads: usize,
        /// The OS / rayon error.
        reason: String,
    },
}

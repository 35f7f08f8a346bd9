//! The compute engine: fused forward/backward kernels for a GPT-2 training step, the thread pool
//! they run on, and the optimizers that consume their gradients.
//!
//! - [`Backend`] is the device boundary: every kernel the model calls. [`cpu::Cpu`] implements
//!   it on a persistent rayon pool sized by `COHORT_NUM_THREADS` (default: the cores this process
//!   may use), with AVX-512 / AVX2 code picked at run time and matrix products on
//!   `matrixmultiply`'s sgemm.
//! - [`Dropout`] derives every dropout decision from (seed, rank, step, site, index), so masks
//!   are reproducible and never stored.
//! - [`optim`] holds AdamW, SGD, the LR schedule and gradient clipping over flat buffers.
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
//! let (x, w) = ([1.0f32, 2.0, 3.0, 4.0], [1.0f32, 0.0, 0.0, 1.0]); // (2, 2) · identity
//! let mut out = [0.0f32; 4];
//! cpu.install(&mut || cpu.matmul_forward(&mut out, &x, &w, None, 2, 2, 2));
//! assert_eq!(out, x);
//! ```

#![deny(missing_docs)]

mod aligned;
mod backend;
pub mod cpu;
mod dropout;
pub mod optim;

pub use aligned::AlignedFloats;
pub use backend::{Backend, DType, Device};
pub use dropout::Dropout;

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
    /// The thread pool could not be started.
    #[error("cannot start a pool of {threads} threads: {reason}")]
    ThreadPool {
        /// Threads asked for.
        threads: usize,
        /// The OS / rayon error.
        reason: String,
    },
}

//! Optimizers, learning-rate schedules and gradient clipping over flat f32 buffers.
//!
//! Everything here works on plain slices: a parameter buffer, a gradient buffer of the same
//! length, and optimizer state buffers of that length again. The optimizers know nothing of the
//! model; which elements are exempt from weight decay comes in as a [`DecayMask`] of ranges, built
//! by the model from its parameter names. This module must never allocate per step, never depend
//! on the model, and never change results with the thread count (every update is elementwise and
//! every reduction runs in a fixed block order).
//!
//! The updates follow `torch.optim.AdamW` / `torch.optim.SGD` (single-tensor CPU path) operation
//! by operation in f32, with the scalar coefficients computed in f64 and rounded to f32 as PyTorch
//! does, and its fused multiply-adds where its CPU kernels use them (`lerp`, `addcmul`, `add` with
//! `alpha`). Measured against torch 2.15 on an AVX-512 CPU: SGD bitwise equal; AdamW moments
//! bitwise equal, parameters within 1 ulp (PyTorch's `sqrt` is MKL's, not correctly rounded).

mod adamw;
mod clip;
mod decay;
mod kernels;
mod schedule;
mod sgd;

pub use adamw::{AdamW, AdamWConfig};
pub use clip::{clip_grad_norm, clip_grad_value, grad_norm};
pub use decay::DecayMask;
pub use schedule::LrSchedule;
pub use sgd::{Sgd, SgdConfig};

/// What went wrong in an optimizer, schedule or clipping call.
#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum OptimError {
    /// A buffer handed to `op` has the wrong number of elements.
    #[error("{op}: {what} has {found} elements, expected {expected}")]
    LengthMismatch {
        /// The operation that checked the length.
        op: &'static str,
        /// Which buffer was wrong (`params`, `grads`, a state buffer name).
        what: String,
        /// The length the optimizer was built for.
        expected: usize,
        /// The length passed in.
        found: usize,
    },
    /// A weight-decay exemption range does not lie inside the buffer.
    #[error("weight-decay exemption range {start}..{end} is outside the {len}-element buffer")]
    RangeOutOfBounds {
        /// Range start.
        start: usize,
        /// Range end (exclusive).
        end: usize,
        /// Buffer length.
        len: usize,
    },
    /// A hyperparameter is outside its valid domain (PyTorch rejects the same values).
    #[error("{optimizer}: invalid {name} = {value}: {why}")]
    InvalidHyperparameter {
        /// `AdamW`, `SGD`, `LrSchedule` or the clipping function.
        optimizer: &'static str,
        /// The hyperparameter's name.
        name: &'static str,
        /// The value given.
        value: f64,
        /// The rule it breaks.
        why: &'static str,
    },
    /// The global gradient norm is NaN or infinite; the gradients were left untouched so the
    /// caller can skip the step.
    #[error("gradient L2 norm is {norm}, not finite; gradients left unchanged")]
    NonFiniteGradNorm {
        /// The norm as computed (NaN or +inf).
        norm: f32,
    },
    /// Loaded state belongs to another optimizer.
    #[error("loading optimizer state: the state is for {found}, this optimizer is {expected}")]
    WrongOptimizer {
        /// This optimizer's name.
        expected: &'static str,
        /// The name recorded in the state.
        found: String,
    },
    /// Loaded state lacks a buffer this optimizer needs.
    #[error("loading {optimizer} state: buffer {name:?} is missing")]
    MissingStateBuffer {
        /// This optimizer's name.
        optimizer: &'static str,
        /// The missing buffer.
        name: &'static str,
    },
}

/// A borrowed view of an optimizer's state: what a checkpoint stores and hands back.
///
/// `buffers` are named like PyTorch's state keys (`exp_avg`, `exp_avg_sq`, `momentum_buffer`),
/// each as long as the parameter buffer.
#[derive(Debug, Clone)]
pub struct OptimizerState<'a> {
    /// `"adamw"` or `"sgd"`.
    pub optimizer: String,
    /// Number of steps taken so far (PyTorch's `state["step"]`).
    pub step: u64,
    /// The state buffers by name.
    pub buffers: Vec<(String, &'a [f32])>,
}

impl OptimizerState<'_> {
    fn buffer(&self, optimizer: &'static str, name: &'static str) -> Result<&[f32], OptimError> {
        self.buffers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, b)| *b)
            .ok_or(OptimError::MissingStateBuffer { optimizer, name })
    }
}

/// An optimizer over one flat parameter buffer. Implemented by [`AdamW`] and [`Sgd`] so that a
/// training loop and the checkpoint code can hold either.
pub trait Optimizer: Send {
    /// Short name recorded in checkpoints (`"adamw"`, `"sgd"`).
    fn name(&self) -> &'static str;
    /// Number of parameters this optimizer was built for.
    fn len(&self) -> usize;
    /// True when built for zero parameters.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// One update of `params` from `grads` at learning rate `lr`.
    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f64) -> Result<(), OptimError>;
    /// Steps taken so far.
    fn steps_taken(&self) -> u64;
    /// The state to save.
    fn state(&self) -> OptimizerState<'_>;
    /// Restore saved state (checked for optimizer name, buffer names and lengths).
    fn load_state(&mut self, state: &OptimizerState<'_>) -> Result<(), OptimError>;
}

fn check_len(
    op: &'static str,
    what: &str,
    expected: usize,
    found: usize,
) -> Result<(), OptimError> {
    if expected == found {
        Ok(())
    } else {
        Err(OptimError::LengthMismatch {
            op,
            what: what.to_string(),
            expected,
            found,
        })
    }
}

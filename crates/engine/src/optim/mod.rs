//! Optimizers, learning-rate schedules and gradient clipping over flat f32 buffers.
//!
//! Everything here works on plain slices: a parameter buffer, a gradient buffer of the same
//! length, and optimizer state buffers of that length again. The optimizers know nothing of the
//! model; which elements are exempt from weight decay comes in as a [`DecayMask`] of ranges, built
//! by the model from its parameter names. Called inside the engine's pool (`Cpu::install`), the
//! work is split over its threads; called outside any pool, it runs on the calling thread. This
//! module must never allocate in an optimizer step, never depend on the model, and never change
//! results with the thread count (every update is elementwise and every reduction adds fixed
//! blocks in a fixed order).
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

pub use adamw::{adamw_segment, AdamW, AdamWConfig};
pub use clip::{
    clip_grad_norm, clip_grad_norm_on, clip_grad_value, grad_norm, grad_norm_on, scale, sum_squares,
};
pub use decay::DecayMask;
pub use kernels::AdamCoeffs;
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
    /// The optimizer's state is in a device's memory, where a host call cannot reach it.
    #[error("{op}: the optimizer state is on {device}; use the backend's kernels (step_on) or copy it to the host")]
    OnDevice {
        /// The host call.
        op: &'static str,
        /// Where the state is.
        device: crate::Device,
    },
    /// The backend could not allocate or reach the optimizer's state.
    #[error("{op}: {reason}")]
    Engine {
        /// What was being done.
        op: &'static str,
        /// The backend's error.
        reason: String,
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

/// Elements per parallel task (64 KiB of each buffer): large enough to amortise scheduling, small
/// enough to balance 10M parameters over a few threads.
const BLOCK: usize = 1 << 14;

/// Whether to split work over the rayon pool we are running in. Only inside a pool (the caller
/// ran us under the engine's `Cpu::install`): outside one, rayon would start its global pool,
/// which nobody sized. Splitting never changes results: every update is elementwise and
/// reductions add fixed blocks in order.
fn parallel() -> bool {
    rayon::current_thread_index().is_some() && rayon::current_num_threads() > 1
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::Cpu;

    /// Runs three steps of `opt` and a clip on fresh copies of the same buffers.
    fn run(mut opt: Box<dyn Optimizer>, p: &[f32], g: &[f32]) -> (Vec<f32>, f32, Vec<f32>) {
        let mut p = p.to_vec();
        for step in 0..3 {
            opt.step(&mut p, g, 1e-2 / (step as f64 + 1.0)).unwrap();
        }
        let mut gc = g.to_vec();
        let norm = clip_grad_norm(&mut gc, 0.5).unwrap();
        clip_grad_value(&mut gc, 1e-3).unwrap();
        (p, norm, gc)
    }

    /// AdamW and clipping through the backend's kernels (the path of state in a device's
    /// memory) against the host calls: the same bits, inside and outside a pool.
    #[test]
    fn kernel_path_equals_host_path() {
        use crate::{Backend, Buffer};
        let n = 3 * BLOCK + 77;
        let p0: Vec<f32> = (0..n)
            .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let g0: Vec<f32> = (0..n)
            .map(|i| ((i * 53) % 97) as f32 / 97.0 - 0.5)
            .collect();
        let mask = DecayMask::with_exempt(n, [BLOCK + 5..2 * BLOCK + 17, n - 40..n]).unwrap();
        let cpu = Cpu::new(3).unwrap();
        let dev: &dyn Backend = &cpu;
        for pooled in [false, true] {
            let mut host = AdamW::new(AdamWConfig::default(), mask.clone()).unwrap();
            let mut on = AdamW::new_on(dev, AdamWConfig::default(), mask.clone()).unwrap();
            let (mut p, mut g) = (p0.clone(), g0.clone());
            let (mut pb, mut gb) = (Buffer::host(n), Buffer::host(n));
            dev.upload(pb.view_mut(), &p0).unwrap();
            dev.upload(gb.view_mut(), &g0).unwrap();
            let mut run = || {
                for step in 0..3 {
                    let lr = 1e-2 / (step as f64 + 1.0);
                    host.step(&mut p, &g, lr).unwrap();
                    on.step_on(dev, pb.view_mut(), gb.view(), lr).unwrap();
                }
                let norm = clip_grad_norm(&mut g, 0.5).unwrap();
                let norm_on = clip_grad_norm_on(dev, gb.view_mut(), 0.5).unwrap();
                assert_eq!(norm.to_bits(), norm_on.to_bits());
            };
            if pooled {
                dev.install(&mut run);
            } else {
                run();
            }
            dev.sync().unwrap();
            assert_eq!(pb.host_slice().unwrap(), &p[..], "params");
            assert_eq!(gb.host_slice().unwrap(), &g[..], "clipped grads");
            assert_eq!(on.exp_avg(), host.exp_avg());
            assert_eq!(on.exp_avg_sq(), host.exp_avg_sq());
            assert_eq!(on.steps_taken(), 3);
        }
    }

    #[test]
    fn thread_count_does_not_change_results() {
        let n = 5 * BLOCK + 123;
        let p: Vec<f32> = (0..n)
            .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let g: Vec<f32> = (0..n)
            .map(|i| ((i * 53) % 97) as f32 / 970.0 - 0.05)
            .collect();
        let mask = DecayMask::with_exempt(n, [BLOCK + 5..2 * BLOCK + 17, n - 40..n]).unwrap();
        let optimizers = || -> Vec<Box<dyn Optimizer>> {
            vec![
                Box::new(AdamW::new(AdamWConfig::default(), mask.clone()).unwrap()),
                Box::new(
                    Sgd::new(
                        SgdConfig {
                            momentum: 0.9,
                            weight_decay: 0.1,
                            ..Default::default()
                        },
                        mask.clone(),
                    )
                    .unwrap(),
                ),
                Box::new(Sgd::new(SgdConfig::default(), mask.clone()).unwrap()),
            ]
        };
        let sequential: Vec<_> = optimizers().into_iter().map(|o| run(o, &p, &g)).collect();
        assert!(!parallel(), "tests run outside any pool");
        for threads in [2, 3] {
            let cpu = Cpu::new(threads).unwrap();
            let pooled: Vec<_> = cpu.install(|| {
                assert!(parallel());
                optimizers().into_iter().map(|o| run(o, &p, &g)).collect()
            });
            for (i, (a, b)) in sequential.iter().zip(&pooled).enumerate() {
                assert_eq!(a.0, b.0, "optimizer {i}, {threads} threads: params");
                assert_eq!(a.1.to_bits(), b.1.to_bits(), "{threads} threads: norm");
                assert_eq!(a.2, b.2, "{threads} threads: clipped grads");
            }
        }
    }
}

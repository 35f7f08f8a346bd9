//! The built-in kernel profiler: time per kernel, summed over a run, in a fixed report order.
//!
//! It only measures; it never changes what is computed or in which order.

use super::*;

/// Kernels timed by the built-in profiler, in report order.
pub(crate) const KERNELS: [&str; 16] = [
    "encoder_fwd",
    "layernorm_fwd",
    "matmul_fwd",
    "attention_fwd",
    "gelu_fwd",
    "residual_fwd",
    "head_fwd",
    "crossentropy_fwd",
    "crossentropy_bwd",
    "head_bwd",
    "layernorm_bwd",
    "matmul_bwd",
    "attention_bwd",
    "gelu_bwd",
    "dropout_bwd",
    "encoder_bwd",
];

#[derive(Clone, Copy)]
pub(crate) enum K {
    EncoderFwd,
    LnFwd,
    MatmulFwd,
    AttnFwd,
    GeluFwd,
    ResidualFwd,
    HeadFwd,
    CeFwd,
    CeBwd,
    HeadBwd,
    LnBwd,
    MatmulBwd,
    AttnBwd,
    GeluBwd,
    DropoutBwd,
    EncoderBwd,
}

/// Accumulated wall time per kernel (always on: one `Instant` pair per kernel call).
#[derive(Default)]
pub(crate) struct Profile(pub(crate) [Duration; KERNELS.len()]);

/// Times a kernel call under its name: [`Profile`] where a pass is profiled, [`Untimed`] where
/// nobody reads the times (decoding).
pub(crate) trait Timer {
    /// Runs `f`, counting its wall time to kernel `k`.
    fn time<R>(&mut self, k: K, f: impl FnOnce() -> R) -> R;
}

impl Timer for Profile {
    #[inline]
    fn time<R>(&mut self, k: K, f: impl FnOnce() -> R) -> R {
        let t0 = Instant::now();
        let r = f();
        self.0[k as usize] += t0.elapsed();
        r
    }
}

/// A [`Timer`] that only runs the kernel.
pub(crate) struct Untimed;

impl Timer for Untimed {
    #[inline]
    fn time<R>(&mut self, _: K, f: impl FnOnce() -> R) -> R {
        f()
    }
}

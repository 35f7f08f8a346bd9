//! Gradient clipping over a flat gradient buffer: by value (`clip_grad_value_`) and by global L2
//! norm (`clip_grad_norm_`). The norm is summed in f64 over fixed blocks added in order, so it
//! does not depend on how the work is split; a non-finite norm must never be applied silently.

use rayon::prelude::*;

use super::kernels;
use super::{parallel, OptimError, BLOCK};
use crate::{Backend, View, ViewMut};

/// Elements per block of the norm reduction. Fixed (not derived from a thread count) so the sum's
/// rounding is the same however the blocks are scheduled.
const NORM_BLOCK: usize = 1 << 16;

/// Σ x² over `grads` in f64, in fixed blocks added in order (the CPU body of
/// [`Backend::sum_squares`](crate::Backend::sum_squares)).
pub fn sum_squares(grads: &[f32]) -> f64 {
    if parallel() {
        // Block sums in parallel, then added in block order: the same bits as sequentially.
        let sums: Vec<f64> = grads
            .par_chunks(NORM_BLOCK)
            .map(kernels::sum_squares)
            .collect();
        sums.iter().sum()
    } else {
        grads.chunks(NORM_BLOCK).map(kernels::sum_squares).sum()
    }
}

/// `grads *= s` (the CPU body of [`Backend::scale`](crate::Backend::scale)).
pub fn scale(grads: &mut [f32], s: f32) {
    if parallel() {
        grads
            .par_chunks_mut(BLOCK)
            .for_each(|g| kernels::scale(g, s));
    } else {
        kernels::scale(grads, s);
    }
}

/// Global L2 norm of `grads`, summed in f64 and rounded to f32.
pub fn grad_norm(grads: &[f32]) -> f32 {
    sum_squares(grads).sqrt() as f32
}

/// [`grad_norm`] of gradients in `dev`'s memory, by its kernel: the same bits on the CPU.
pub fn grad_norm_on(dev: &dyn Backend, grads: View<'_, f32>) -> f32 {
    dev.sum_squares(grads).sqrt() as f32
}

/// Scale `grads` so that their global L2 norm is at most `max_norm`, like
/// `torch.nn.utils.clip_grad_norm_`: the factor is `max_norm / (norm + 1e-6)` when below 1.
///
/// Returns the norm before clipping. A NaN or infinite norm is
/// [`OptimError::NonFiniteGradNorm`] and leaves `grads` unchanged, so the caller can skip the
/// step (PyTorch would scale everything to NaN).
pub fn clip_grad_norm(grads: &mut [f32], max_norm: f32) -> Result<f32, OptimError> {
    clip_by(grad_norm(grads), max_norm, |coef| scale(grads, coef))
}

/// [`clip_grad_norm`] of gradients in `dev`'s memory, by its kernels: the same bits on the CPU.
pub fn clip_grad_norm_on(
    dev: &dyn Backend,
    grads: ViewMut<'_, f32>,
    max_norm: f32,
) -> Result<f32, OptimError> {
    let norm = grad_norm_on(dev, grads.as_view());
    clip_by(norm, max_norm, |coef| dev.scale(grads, coef))
}

/// The clipping rule around a norm: checks, and scales by `max_norm / (norm + 1e-6)` when below 1.
fn clip_by(norm: f32, max_norm: f32, scale: impl FnOnce(f32)) -> Result<f32, OptimError> {
    if !(max_norm >= 0.0 && max_norm.is_finite()) {
        return Err(OptimError::InvalidHyperparameter {
            optimizer: "clip_grad_norm",
            name: "max_norm",
            value: f64::from(max_norm),
            why: "must be finite and >= 0",
        });
    }
    if !norm.is_finite() {
        return Err(OptimError::NonFiniteGradNorm { norm });
    }
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        scale(coef);
    }
    Ok(norm)
}

/// Clamp every gradient into `[-clip_value, clip_value]`, like
/// `torch.nn.utils.clip_grad_value_` (NaN stays NaN).
pub fn clip_grad_value(grads: &mut [f32], clip_value: f32) -> Result<(), OptimError> {
    if !(clip_value >= 0.0 && clip_value.is_finite()) {
        return Err(OptimError::InvalidHyperparameter {
            optimizer: "clip_grad_value",
            name: "clip_value",
            value: f64::from(clip_value),
            why: "must be finite and >= 0",
        });
    }
    if parallel() {
        grads
            .par_chunks_mut(BLOCK)
            .for_each(|g| kernels::clamp(g, -clip_value, clip_value));
    } else {
        kernels::clamp(grads, -clip_value, clip_value);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_of_known_vectors() {
        assert_eq!(grad_norm(&[]), 0.0);
        assert_eq!(grad_norm(&[3.0, 4.0]), 5.0);
        // 200_001 ones span several blocks and a ragged tail
        let ones = vec![1.0f32; 200_001];
        assert_eq!(grad_norm(&ones), (200_001f64).sqrt() as f32);
        // f64 accumulation: squares of 1e20 overflow f32 but not the sum
        assert_eq!(grad_norm(&[1e20, 1e20]), (2e40f64).sqrt() as f32);
    }

    #[test]
    fn clip_grad_norm_scales_down_and_returns_the_pre_clip_norm() {
        let mut g = vec![3.0f32, 4.0, 0.0, 0.0];
        let norm = clip_grad_norm(&mut g, 1.0).unwrap();
        assert_eq!(norm, 5.0);
        let coef = 1.0f32 / (5.0 + 1e-6);
        assert_eq!(g, vec![3.0 * coef, 4.0 * coef, 0.0, 0.0]);
        assert!((grad_norm(&g) - 1.0).abs() < 1e-6);
    }

    #[test]
    fn clip_grad_norm_leaves_small_gradients_alone() {
        let mut g = vec![0.3f32, -0.4];
        let before = g.clone();
        assert_eq!(clip_grad_norm(&mut g, 1.0).unwrap(), 0.5);
        assert_eq!(g, before);
    }

    #[test]
    fn non_finite_norm_is_reported_and_gradients_kept() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut g = vec![1.0f32; 100];
            g[57] = bad;
            let before = g.clone();
            match clip_grad_norm(&mut g, 1.0) {
                Err(OptimError::NonFiniteGradNorm { norm }) => assert!(!norm.is_finite()),
                other => panic!("{bad}: expected NonFiniteGradNorm, got {other:?}"),
            }
            assert_eq!(format!("{g:?}"), format!("{before:?}"));
        }
        assert!(clip_grad_norm(&mut [1.0], -1.0).is_err());
    }

    #[test]
    fn clip_grad_value_clamps_every_element() {
        let mut g: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.1).collect();
        g[5] = f32::NAN;
        clip_grad_value(&mut g, 0.5).unwrap();
        for (i, x) in g.iter().enumerate() {
            if i == 5 {
                assert!(x.is_nan());
            } else {
                let want = ((i as f32 - 18.0) * 0.1).clamp(-0.5, 0.5);
                assert_eq!(*x, want, "element {i}");
            }
        }
        assert!(clip_grad_value(&mut g, f32::NAN).is_err());
    }
}

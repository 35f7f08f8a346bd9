//! Learning rate as a function of the step: constant, or nanoGPT's `get_lr` (linear warmup, then
//! cosine decay to a floor). A pure function of the step, so resuming from a checkpoint only needs
//! the step number; must never hold mutable state.

use super::OptimError;

/// The learning rate at each optimizer step (steps count from 0).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LrSchedule {
    /// The same rate at every step.
    Constant(f64),
    /// nanoGPT's `get_lr(it)`: `max_lr * (it + 1) / (warmup + 1)` while `it < warmup`, then
    /// cosine from `max_lr` down to `min_lr` at `it == decay_steps`, and `min_lr` after.
    WarmupCosine {
        /// Peak rate, reached at the end of warmup.
        max_lr: f64,
        /// Floor after decay.
        min_lr: f64,
        /// Warmup steps.
        warmup_steps: u64,
        /// Step at which the decay reaches `min_lr` (nanoGPT's `lr_decay_iters`).
        decay_steps: u64,
    },
}

impl LrSchedule {
    /// Warmup + cosine, checked: rates finite and `0 <= min_lr <= max_lr`, `warmup <= decay`.
    pub fn warmup_cosine(
        max_lr: f64,
        min_lr: f64,
        warmup_steps: u64,
        decay_steps: u64,
    ) -> Result<Self, OptimError> {
        let bad = |name, value, why| {
            Err(OptimError::InvalidHyperparameter {
                optimizer: "LrSchedule",
                name,
                value,
                why,
            })
        };
        if !(max_lr >= 0.0 && max_lr.is_finite()) {
            return bad("max_lr", max_lr, "must be finite and >= 0");
        }
        if !(min_lr >= 0.0 && min_lr <= max_lr) {
            return bad("min_lr", min_lr, "must be in [0, max_lr]");
        }
        if decay_steps < warmup_steps {
            return bad("decay_steps", decay_steps as f64, "must be >= warmup_steps");
        }
        Ok(Self::WarmupCosine {
            max_lr,
            min_lr,
            warmup_steps,
            decay_steps,
        })
    }

    /// The learning rate for step `it`.
    pub fn lr(&self, it: u64) -> f64 {
        match *self {
            Self::Constant(lr) => lr,
            Self::WarmupCosine {
                max_lr,
                min_lr,
                warmup_steps,
                decay_steps,
            } => {
                if it < warmup_steps {
                    return max_lr * (it + 1) as f64 / (warmup_steps + 1) as f64;
                }
                if it > decay_steps {
                    return min_lr;
                }
                // it == warmup == decay: the decay has no length; start of the cosine.
                if decay_steps == warmup_steps {
                    return max_lr;
                }
                let decay_ratio = (it - warmup_steps) as f64 / (decay_steps - warmup_steps) as f64;
                let coeff = 0.5 * (1.0 + (std::f64::consts::PI * decay_ratio).cos());
                min_lr + coeff * (max_lr - min_lr)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_cosine_matches_nanogpt_at_known_steps() {
        // nanoGPT shakespeare-char: lr 1e-3, min 1e-4, warmup 100, decay 5000.
        let s = LrSchedule::warmup_cosine(1e-3, 1e-4, 100, 5000).unwrap();
        assert_eq!(s.lr(0), 1e-3 * 1.0 / 101.0);
        assert_eq!(s.lr(49), 1e-3 * 50.0 / 101.0);
        assert_eq!(s.lr(99), 1e-3 * 100.0 / 101.0);
        assert_eq!(s.lr(100), 1e-3);
        // halfway through the decay the cosine is 0: the mean of max and min
        assert!((s.lr(2550) - 5.5e-4).abs() < 1e-15);
        // a quarter of the way: coeff = 0.5 (1 + cos(pi/4))
        let q = 0.5 * (1.0 + std::f64::consts::FRAC_1_SQRT_2);
        assert!((s.lr(1325) - (1e-4 + q * 9e-4)).abs() < 1e-15);
        assert!((s.lr(5000) - 1e-4).abs() < 1e-18);
        assert_eq!(s.lr(5001), 1e-4);
        assert_eq!(s.lr(u64::MAX), 1e-4);
        // monotone after warmup
        let mut prev = s.lr(100);
        for it in 101..5100 {
            let lr = s.lr(it);
            assert!(lr <= prev, "step {it}: {lr} > {prev}");
            prev = lr;
        }
    }

    #[test]
    fn degenerate_schedules() {
        let s = LrSchedule::warmup_cosine(1.0, 0.5, 3, 3).unwrap();
        assert_eq!(s.lr(2), 0.75);
        assert_eq!(s.lr(3), 1.0);
        assert_eq!(s.lr(4), 0.5);
        let s = LrSchedule::warmup_cosine(1.0, 0.0, 0, 2).unwrap();
        assert_eq!(s.lr(0), 1.0);
        assert!((s.lr(1) - 0.5).abs() < 1e-15);
        assert_eq!(LrSchedule::Constant(0.3).lr(12345), 0.3);
    }

    #[test]
    fn invalid_schedules_are_errors() {
        assert!(LrSchedule::warmup_cosine(1.0, 2.0, 0, 10).is_err());
        assert!(LrSchedule::warmup_cosine(f64::NAN, 0.0, 0, 10).is_err());
        let e = LrSchedule::warmup_cosine(1.0, 0.1, 10, 5).unwrap_err();
        assert!(e.to_string().contains("decay_steps"), "{e}");
    }
}

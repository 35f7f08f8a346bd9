//! SGD with optional momentum, dampening, Nesterov and (coupled, L2) weight decay, as
//! `torch.optim.SGD` computes it. Must never allocate in `step`.

use rayon::prelude::*;

use super::kernels::{self, SgdCoeffs};
use super::{check_len, parallel, DecayMask, OptimError, Optimizer, OptimizerState, BLOCK};
use crate::AlignedFloats;

/// SGD hyperparameters; defaults are PyTorch's (plain SGD). The learning rate is passed to every
/// [`Optimizer::step`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SgdConfig {
    /// Momentum factor (0 = none, no buffer kept).
    pub momentum: f64,
    /// Dampening of the gradient added to the momentum buffer.
    pub dampening: f64,
    /// L2 penalty added to the gradient; exempt segments of the [`DecayMask`] get none.
    pub weight_decay: f64,
    /// Nesterov momentum (needs momentum > 0 and dampening 0, as in PyTorch).
    pub nesterov: bool,
}

impl SgdConfig {
    fn validate(&self) -> Result<(), OptimError> {
        let bad = |name, value, why| {
            Err(OptimError::InvalidHyperparameter {
                optimizer: "SGD",
                name,
                value,
                why,
            })
        };
        if !(self.momentum >= 0.0 && self.momentum.is_finite()) {
            return bad("momentum", self.momentum, "must be finite and >= 0");
        }
        if !self.dampening.is_finite() {
            return bad("dampening", self.dampening, "must be finite");
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return bad("weight_decay", self.weight_decay, "must be finite and >= 0");
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return bad(
                "dampening",
                self.dampening,
                "Nesterov momentum requires a momentum and zero dampening",
            );
        }
        Ok(())
    }
}

/// SGD over a flat parameter buffer, with a momentum buffer when momentum is on.
#[derive(Debug, Clone)]
pub struct Sgd {
    cfg: SgdConfig,
    mask: DecayMask,
    step: u64,
    momentum_buffer: AlignedFloats,
}

impl Sgd {
    /// An optimizer for `mask.len()` parameters.
    pub fn new(cfg: SgdConfig, mask: DecayMask) -> Result<Self, OptimError> {
        cfg.validate()?;
        let n = if cfg.momentum != 0.0 { mask.len() } else { 0 };
        Ok(Self {
            cfg,
            mask,
            step: 0,
            momentum_buffer: AlignedFloats::zeroed_written(n),
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &SgdConfig {
        &self.cfg
    }

    /// The momentum buffer (empty without momentum).
    pub fn momentum_buffer(&self) -> &[f32] {
        &self.momentum_buffer
    }
}

impl Optimizer for Sgd {
    fn name(&self) -> &'static str {
        "sgd"
    }

    fn len(&self) -> usize {
        self.mask.len()
    }

    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f64) -> Result<(), OptimError> {
        check_len("Sgd::step", "params", self.len(), params.len())?;
        check_len("Sgd::step", "grads", self.len(), grads.len())?;
        if !(lr >= 0.0 && lr.is_finite()) {
            return Err(OptimError::InvalidHyperparameter {
                optimizer: "SGD",
                name: "lr",
                value: lr,
                why: "must be finite and >= 0",
            });
        }
        let cfg = self.cfg;
        let with_momentum = cfg.momentum != 0.0;
        let coeffs = SgdCoeffs {
            weight_decay: None,
            momentum: with_momentum.then_some(cfg.momentum as f32),
            one_minus_dampening: (1.0 - cfg.dampening) as f32,
            nesterov: cfg.nesterov,
            first: self.step == 0,
            neg_lr: -lr as f32,
        };
        for (r, decay) in self.mask.segments() {
            let c = SgdCoeffs {
                weight_decay: (*decay && cfg.weight_decay != 0.0)
                    .then_some(cfg.weight_decay as f32),
                ..coeffs
            };
            let (p, g) = (&mut params[r.clone()], &grads[r.clone()]);
            match (with_momentum, parallel()) {
                (true, true) => p
                    .par_chunks_mut(BLOCK)
                    .zip(g.par_chunks(BLOCK))
                    .zip(self.momentum_buffer[r.clone()].par_chunks_mut(BLOCK))
                    .for_each(|((p, g), b)| kernels::sgd(p, g, b, c)),
                (true, false) => kernels::sgd(p, g, &mut self.momentum_buffer[r.clone()], c),
                (false, true) => p
                    .par_chunks_mut(BLOCK)
                    .zip(g.par_chunks(BLOCK))
                    .for_each(|(p, g)| kernels::sgd(p, g, &mut [], c)),
                (false, false) => kernels::sgd(p, g, &mut [], c),
            }
        }
        self.step += 1;
        Ok(())
    }

    fn steps_taken(&self) -> u64 {
        self.step
    }

    fn state(&self) -> OptimizerState<'_> {
        OptimizerState {
            optimizer: self.name().to_string(),
            step: self.step,
            buffers: vec![("momentum_buffer".to_string(), &self.momentum_buffer[..])],
        }
    }

    fn load_state(&mut self, state: &OptimizerState<'_>) -> Result<(), OptimError> {
        if state.optimizer != self.name() {
            return Err(OptimError::WrongOptimizer {
                expected: self.name(),
                found: state.optimizer.clone(),
            });
        }
        let b = state.buffer("sgd", "momentum_buffer")?;
        check_len(
            "Sgd::load_state",
            "momentum_buffer",
            self.momentum_buffer.len(),
            b.len(),
        )?;
        self.momentum_buffer.copy_from_slice(b);
        self.step = state.step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// torch.optim.SGD's update in f64.
    fn reference(cfg: SgdConfig, decayed: &[bool], p: &mut [f64], grads: &[Vec<f32>], lr: f64) {
        let mut buf = vec![0.0f64; p.len()];
        for (t, g) in grads.iter().enumerate() {
            for i in 0..p.len() {
                let mut d = f64::from(g[i]);
                if decayed[i] {
                    d += cfg.weight_decay * p[i];
                }
                if cfg.momentum != 0.0 {
                    buf[i] = if t == 0 {
                        d
                    } else {
                        cfg.momentum * buf[i] + (1.0 - cfg.dampening) * d
                    };
                    d = if cfg.nesterov {
                        d + cfg.momentum * buf[i]
                    } else {
                        buf[i]
                    };
                }
                p[i] -= lr * d;
            }
        }
    }

    #[test]
    fn momentum_by_hand() {
        let cfg = SgdConfig {
            momentum: 0.9,
            ..Default::default()
        };
        let mut opt = Sgd::new(cfg, DecayMask::all(1)).unwrap();
        let mut p = [1.0f32];
        opt.step(&mut p, &[0.5], 0.1).unwrap();
        assert_eq!(opt.momentum_buffer(), &[0.5]);
        assert!((p[0] - 0.95).abs() < 1e-7);
        opt.step(&mut p, &[0.5], 0.1).unwrap();
        assert!((opt.momentum_buffer()[0] - 0.95).abs() < 1e-7);
        assert!((p[0] - 0.855).abs() < 1e-7, "{}", p[0]);
    }

    #[test]
    fn variants_match_an_f64_reference() {
        let n = 16 * 3 + 5;
        let exempt = 10..20;
        let decayed: Vec<bool> = (0..n).map(|i| !exempt.contains(&i)).collect();
        let grads: Vec<Vec<f32>> = (0..5)
            .map(|t| {
                (0..n)
                    .map(|i| ((i * 7 + t * 13) % 11) as f32 * 0.1 - 0.5)
                    .collect()
            })
            .collect();
        let configs = [
            SgdConfig::default(),
            SgdConfig {
                momentum: 0.9,
                dampening: 0.1,
                weight_decay: 0.01,
                nesterov: false,
            },
            SgdConfig {
                momentum: 0.8,
                dampening: 0.0,
                weight_decay: 0.05,
                nesterov: true,
            },
        ];
        for cfg in configs {
            let mask = DecayMask::with_exempt(n, [exempt.clone()]).unwrap();
            let mut opt = Sgd::new(cfg, mask).unwrap();
            let mut p: Vec<f32> = (0..n).map(|i| i as f32 * 0.03 - 0.7).collect();
            let mut want: Vec<f64> = p.iter().map(|&x| f64::from(x)).collect();
            for g in &grads {
                opt.step(&mut p, g, 0.05).unwrap();
            }
            reference(cfg, &decayed, &mut want, &grads, 0.05);
            for i in 0..n {
                let got = f64::from(p[i]);
                assert!(
                    (got - want[i]).abs() < 1e-6,
                    "{cfg:?} p[{i}]: {got} vs {}",
                    want[i]
                );
            }
        }
    }

    #[test]
    fn state_round_trip_and_errors() {
        let cfg = SgdConfig {
            momentum: 0.9,
            ..Default::default()
        };
        let mut a = Sgd::new(cfg, DecayMask::all(3)).unwrap();
        let mut pa = [1.0f32, 2.0, 3.0];
        a.step(&mut pa, &[0.1, 0.2, 0.3], 0.1).unwrap();
        let buf = a.momentum_buffer().to_vec();
        let mut b = Sgd::new(cfg, DecayMask::all(3)).unwrap();
        b.load_state(&OptimizerState {
            optimizer: "sgd".into(),
            step: 1,
            buffers: vec![("momentum_buffer".into(), &buf)],
        })
        .unwrap();
        let mut pb = pa;
        a.step(&mut pa, &[0.3, 0.2, 0.1], 0.1).unwrap();
        b.step(&mut pb, &[0.3, 0.2, 0.1], 0.1).unwrap();
        assert_eq!(pa, pb);

        assert!(b.load_state(&a.state()).is_ok());
        let adam = crate::optim::AdamW::new(Default::default(), DecayMask::all(3)).unwrap();
        assert!(matches!(
            b.load_state(&adam.state()),
            Err(OptimError::WrongOptimizer { .. })
        ));
        assert!(Sgd::new(
            SgdConfig {
                nesterov: true,
                ..Default::default()
            },
            DecayMask::all(3)
        )
        .is_err());
        assert!(b.step(&mut [0.0; 2], &[0.0; 3], 0.1).is_err());
    }
}

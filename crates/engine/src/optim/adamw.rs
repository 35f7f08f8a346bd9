//! AdamW (Loshchilov & Hutter) exactly as `torch.optim.AdamW` computes it on CPU: decoupled
//! weight decay applied to the parameter before the Adam update, bias-corrected moments. Must
//! never allocate in `step`.

use rayon::prelude::*;

use super::kernels::{self, AdamCoeffs};
use super::{check_len, parallel, DecayMask, OptimError, Optimizer, OptimizerState, BLOCK};
use crate::{AlignedFloats, Backend, Buffer, View, ViewMut};

/// AdamW hyperparameters; the defaults are PyTorch's, except that the learning rate is passed to
/// every [`Optimizer::step`] (it comes from an [`LrSchedule`](super::LrSchedule)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// First-moment decay (0.9).
    pub beta1: f64,
    /// Second-moment decay (0.999).
    pub beta2: f64,
    /// Added to the denominator (1e-8).
    pub eps: f64,
    /// Decoupled weight decay (0.01); exempt segments of the [`DecayMask`] get none.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

impl AdamWConfig {
    fn validate(&self) -> Result<(), OptimError> {
        let bad = |name, value, why| {
            Err(OptimError::InvalidHyperparameter {
                optimizer: "AdamW",
                name,
                value,
                why,
            })
        };
        if !(0.0..1.0).contains(&self.beta1) {
            return bad("beta1", self.beta1, "must be in [0, 1)");
        }
        if !(0.0..1.0).contains(&self.beta2) {
            return bad("beta2", self.beta2, "must be in [0, 1)");
        }
        if !(self.eps >= 0.0 && self.eps.is_finite()) {
            return bad("eps", self.eps, "must be finite and >= 0");
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return bad("weight_decay", self.weight_decay, "must be finite and >= 0");
        }
        Ok(())
    }
}

/// AdamW over a flat parameter buffer, with its two moment buffers: in host memory
/// ([`AdamW::new`], stepped by [`Optimizer::step`]) or in a backend's ([`AdamW::new_on`],
/// stepped by [`AdamW::step_on`], one kernel per segment; the same bits on the CPU).
///
/// ```
/// use cohort_engine::optim::{AdamW, AdamWConfig, DecayMask, Optimizer};
/// let mut params = vec![1.0f32; 8];
/// let grads = vec![0.5f32; 8];
/// // elements 6..8 (say, a bias) get no weight decay
/// let mask = DecayMask::with_exempt(8, [6..8]).unwrap();
/// let mut opt = AdamW::new(AdamWConfig::default(), mask).unwrap();
/// opt.step(&mut params, &grads, 1e-3).unwrap();
/// assert!(params[0] < params[7]);
/// ```
#[derive(Debug)]
pub struct AdamW {
    cfg: AdamWConfig,
    mask: DecayMask,
    step: u64,
    exp_avg: Buffer,
    exp_avg_sq: Buffer,
}

impl AdamW {
    /// An optimizer for `mask.len()` parameters with zeroed moments in host memory.
    pub fn new(cfg: AdamWConfig, mask: DecayMask) -> Result<Self, OptimError> {
        cfg.validate()?;
        let n = mask.len();
        Ok(Self {
            cfg,
            mask,
            step: 0,
            exp_avg: AlignedFloats::zeroed_written(n).into(),
            exp_avg_sq: AlignedFloats::zeroed_written(n).into(),
        })
    }

    /// An optimizer whose zeroed moments `dev` allocates, for parameters and gradients in its
    /// memory ([`AdamW::step_on`]).
    pub fn new_on(
        dev: &dyn Backend,
        cfg: AdamWConfig,
        mask: DecayMask,
    ) -> Result<Self, OptimError> {
        cfg.validate()?;
        let n = mask.len();
        let alloc = || {
            dev.alloc(n).map_err(|e| OptimError::Engine {
                op: "AdamW moments",
                reason: e.to_string(),
            })
        };
        Ok(Self {
            cfg,
            step: 0,
            exp_avg: alloc()?,
            exp_avg_sq: alloc()?,
            mask,
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }

    /// First moments (PyTorch's `exp_avg`). Panics for moments in a device's memory.
    pub fn exp_avg(&self) -> &[f32] {
        host(&self.exp_avg)
    }

    /// Second moments (PyTorch's `exp_avg_sq`). Panics for moments in a device's memory.
    pub fn exp_avg_sq(&self) -> &[f32] {
        host(&self.exp_avg_sq)
    }

    /// Checks a step's arguments and advances the step count; the coefficients of the step for
    /// segments without and with weight decay.
    fn begin_step(
        &mut self,
        params: usize,
        grads: usize,
        lr: f64,
    ) -> Result<(AdamCoeffs, AdamCoeffs), OptimError> {
        check_len("AdamW::step", "params", self.len(), params)?;
        check_len("AdamW::step", "grads", self.len(), grads)?;
        if !(lr >= 0.0 && lr.is_finite()) {
            return Err(OptimError::InvalidHyperparameter {
                optimizer: "AdamW",
                name: "lr",
                value: lr,
                why: "must be finite and >= 0",
            });
        }
        self.step += 1;
        let AdamWConfig {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.cfg;
        // PyTorch's step counter is a float tensor and these are Python floats (f64); each is
        // rounded to f32 where it meets a tensor.
        let t = self.step as f64;
        let bias_correction1 = 1.0 - beta1.powf(t);
        let bias_correction2 = 1.0 - beta2.powf(t);
        let step_size = lr / bias_correction1;
        let coeffs = AdamCoeffs {
            decay: 1.0,
            lerp_w: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            bc2_sqrt: bias_correction2.sqrt() as f32,
            eps: eps as f32,
            neg_step_size: -step_size as f32,
        };
        let decayed = AdamCoeffs {
            decay: (1.0 - lr * weight_decay) as f32,
            ..coeffs
        };
        Ok((coeffs, if weight_decay != 0.0 { decayed } else { coeffs }))
    }

    /// One update of `params` from `grads` in `dev`'s memory (where [`AdamW::new_on`] put the
    /// moments), one [`Backend::adamw_step`] per segment of the decay mask.
    pub fn step_on(
        &mut self,
        dev: &dyn Backend,
        mut params: ViewMut<'_, f32>,
        grads: View<'_, f32>,
        lr: f64,
    ) -> Result<(), OptimError> {
        let (plain, decayed) = self.begin_step(params.len(), grads.len(), lr)?;
        let (mut m, mut v) = (self.exp_avg.view_mut(), self.exp_avg_sq.view_mut());
        for (r, decay) in self.mask.segments() {
            let c = if *decay { decayed } else { plain };
            dev.adamw_step(
                params.slice_mut(r.clone()),
                grads.slice(r.clone()),
                m.slice_mut(r.clone()),
                v.slice_mut(r.clone()),
                c,
            );
        }
        Ok(())
    }
}

impl AdamW {
    /// A host copy of this optimizer (its step count and moments, copied from `dev`'s memory):
    /// what a checkpoint of an optimizer on a device writes.
    pub fn to_host(&self, dev: &dyn Backend) -> Result<AdamW, OptimError> {
        let mut host = AdamW::new(self.cfg, self.mask.clone())?;
        host.step = self.step;
        let copy = |dst: &mut Buffer, src: &Buffer| {
            let out = dst.host_slice_mut().expect("allocated on the host above");
            dev.download(out, src.view())
                .map_err(|e| OptimError::Engine {
                    op: "AdamW moments to the host",
                    reason: e.to_string(),
                })
        };
        copy(&mut host.exp_avg, &self.exp_avg)?;
        copy(&mut host.exp_avg_sq, &self.exp_avg_sq)?;
        Ok(host)
    }

    /// Takes the step count and moments of `host` (an optimizer in host memory, say resumed
    /// from a checkpoint) into this one's buffers in `dev`'s memory.
    pub fn load_from_host(&mut self, dev: &dyn Backend, host: &AdamW) -> Result<(), OptimError> {
        check_len("AdamW::load_from_host", "moments", self.len(), host.len())?;
        let (m, v) = (host.exp_avg(), host.exp_avg_sq());
        let copy = |dst: &mut Buffer, src: &[f32]| {
            dev.upload(dst.view_mut(), src)
                .map_err(|e| OptimError::Engine {
                    op: "AdamW moments from the host",
                    reason: e.to_string(),
                })
        };
        copy(&mut self.exp_avg, m)?;
        copy(&mut self.exp_avg_sq, v)?;
        self.step = host.step;
        Ok(())
    }
}

/// A moment buffer's floats, for the host calls.
fn host(b: &Buffer) -> &[f32] {
    match b.host_slice() {
        Some(s) => s,
        None => panic!(
            "AdamW moments on {}: copy them to the host to read them",
            b.device()
        ),
    }
}

/// One AdamW update of a segment (`p`, `g`, moments `m`, `v` of equal length) with the step's
/// coefficients, split over the pool's threads when called inside one (the CPU body of
/// [`Backend::adamw_step`]).
pub fn adamw_segment(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: AdamCoeffs) {
    if parallel() {
        p.par_chunks_mut(BLOCK)
            .zip(g.par_chunks(BLOCK))
            .zip(m.par_chunks_mut(BLOCK))
            .zip(v.par_chunks_mut(BLOCK))
            .for_each(|(((p, g), m), v)| kernels::adamw(p, g, m, v, c));
    } else {
        kernels::adamw(p, g, m, v, c);
    }
}

impl Optimizer for AdamW {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn len(&self) -> usize {
        self.mask.len()
    }

    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f64) -> Result<(), OptimError> {
        if self.exp_avg.host_slice().is_none() {
            return Err(OptimError::OnDevice {
                op: "AdamW::step",
                device: self.exp_avg.device(),
            });
        }
        let (plain, decayed) = self.begin_step(params.len(), grads.len(), lr)?;
        let m = self.exp_avg.host_slice_mut().expect("checked above");
        let v = self
            .exp_avg_sq
            .host_slice_mut()
            .expect("allocated with exp_avg");
        for (r, decay) in self.mask.segments() {
            let c = if *decay { decayed } else { plain };
            let (p, g) = (&mut params[r.clone()], &grads[r.clone()]);
            adamw_segment(p, g, &mut m[r.clone()], &mut v[r.clone()], c);
        }
        Ok(())
    }

    fn steps_taken(&self) -> u64 {
        self.step
    }

    fn state(&self) -> OptimizerState<'_> {
        OptimizerState {
            optimizer: self.name().to_string(),
            step: self.step,
            buffers: vec![
                ("exp_avg".to_string(), self.exp_avg()),
                ("exp_avg_sq".to_string(), self.exp_avg_sq()),
            ],
        }
    }

    fn load_state(&mut self, state: &OptimizerState<'_>) -> Result<(), OptimError> {
        if state.optimizer != self.name() {
            return Err(OptimError::WrongOptimizer {
                expected: self.name(),
                found: state.optimizer.clone(),
            });
        }
        let m = state.buffer("adamw", "exp_avg")?;
        let v = state.buffer("adamw", "exp_avg_sq")?;
        check_len("AdamW::load_state", "exp_avg", self.len(), m.len())?;
        check_len("AdamW::load_state", "exp_avg_sq", self.len(), v.len())?;
        let device = self.exp_avg.device();
        let on_device = || OptimError::OnDevice {
            op: "AdamW::load_state",
            device,
        };
        let em = self.exp_avg.host_slice_mut().ok_or_else(on_device)?;
        em.copy_from_slice(m);
        let ev = self.exp_avg_sq.host_slice_mut().ok_or_else(on_device)?;
        ev.copy_from_slice(v);
        self.step = state.step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = cohort_rng::SplitMix64::new(seed);
        (0..n)
            .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            .collect()
    }

    /// The textbook AdamW update in f64.
    struct Reference {
        cfg: AdamWConfig,
        decayed: Vec<bool>,
        t: i32,
        p: Vec<f64>,
        m: Vec<f64>,
        v: Vec<f64>,
    }

    impl Reference {
        fn step(&mut self, g: &[f32], lr: f64) {
            let c = self.cfg;
            self.t += 1;
            let bc1 = 1.0 - c.beta1.powi(self.t);
            let bc2 = 1.0 - c.beta2.powi(self.t);
            for i in 0..self.p.len() {
                let g = f64::from(g[i]);
                if self.decayed[i] {
                    self.p[i] *= 1.0 - lr * c.weight_decay;
                }
                self.m[i] = c.beta1 * self.m[i] + (1.0 - c.beta1) * g;
                self.v[i] = c.beta2 * self.v[i] + (1.0 - c.beta2) * g * g;
                let m_hat = self.m[i] / bc1;
                let v_hat = self.v[i] / bc2;
                self.p[i] -= lr * m_hat / (v_hat.sqrt() + c.eps);
            }
        }
    }

    #[test]
    fn first_step_by_hand() {
        // Step 1: m_hat = g and v_hat = g^2, so the update is lr * g / (|g| + eps).
        let mut p = vec![1.0f32, 1.0];
        let mut opt = AdamW::new(
            AdamWConfig::default(),
            DecayMask::with_exempt(2, std::iter::once(1..2)).unwrap(),
        )
        .unwrap();
        opt.step(&mut p, &[0.5, -0.25], 1e-3).unwrap();
        let want0 = 1.0 * (1.0 - 1e-3 * 0.01) - 1e-3 * 0.5 / (0.5 + 1e-8);
        let want1 = 1.0 + 1e-3 * 0.25 / (0.25 + 1e-8);
        assert!(
            (f64::from(p[0]) - want0).abs() < 1e-7,
            "{} vs {want0}",
            p[0]
        );
        assert!(
            (f64::from(p[1]) - want1).abs() < 1e-7,
            "{} vs {want1}",
            p[1]
        );
        assert_eq!(opt.exp_avg(), &[0.05, -0.025]);
        assert_eq!(opt.steps_taken(), 1);
    }

    #[test]
    fn several_steps_match_an_f64_reference() {
        let n = 16 * 5 + 7;
        let exempt = [5..9, 70..n];
        for cfg in [
            AdamWConfig::default(),
            AdamWConfig {
                beta1: 0.8,
                beta2: 0.95,
                eps: 1e-6,
                weight_decay: 0.1,
            },
        ] {
            let mask = DecayMask::with_exempt(n, exempt.clone()).unwrap();
            let decayed = (0..n).map(|i| !exempt.iter().any(|r| r.contains(&i)));
            let mut p = values(n, 1);
            let mut reference = Reference {
                cfg,
                decayed: decayed.collect(),
                t: 0,
                p: p.iter().map(|&x| f64::from(x)).collect(),
                m: vec![0.0; n],
                v: vec![0.0; n],
            };
            let mut opt = AdamW::new(cfg, mask).unwrap();
            for step in 0..6u64 {
                let g: Vec<f32> = values(n, 100 + step)
                    .iter()
                    .map(|x| x * (step as f32 + 1.0))
                    .collect();
                let lr = 1e-2 / (step as f64 + 1.0);
                opt.step(&mut p, &g, lr).unwrap();
                reference.step(&g, lr);
            }
            for (i, pi) in p.iter().enumerate() {
                let (got, want) = (f64::from(*pi), reference.p[i]);
                assert!((got - want).abs() < 2e-6, "p[{i}]: {got} vs {want}");
                // gradients reach |6|: f32 rounding of the moments is a few 1e-7 of that
                let (got, want) = (f64::from(opt.exp_avg()[i]), reference.m[i]);
                assert!((got - want).abs() < 2e-6, "m[{i}]: {got} vs {want}");
                let (got, want) = (f64::from(opt.exp_avg_sq()[i]), reference.v[i]);
                assert!((got - want).abs() < 1e-6 * want, "v[{i}]: {got} vs {want}");
            }
        }
    }

    #[test]
    fn exempt_ranges_get_no_weight_decay() {
        // Zero gradients: Adam's update is 0 / (0 + eps) = 0, so only decay moves parameters.
        let n = 40;
        let mut p = vec![2.0f32; n];
        let mask = DecayMask::with_exempt(n, std::iter::once(10..20)).unwrap();
        let mut opt = AdamW::new(AdamWConfig::default(), mask).unwrap();
        opt.step(&mut p, &vec![0.0; n], 0.5).unwrap();
        let decayed = 2.0 * (1.0 - 0.5 * 0.01) as f32;
        for (i, x) in p.iter().enumerate() {
            let want = if (10..20).contains(&i) { 2.0 } else { decayed };
            assert_eq!(*x, want, "element {i}");
        }
    }

    #[test]
    fn state_round_trip_continues_bitwise() {
        let n = 50;
        let mask = DecayMask::with_exempt(n, std::iter::once(0..3)).unwrap();
        let mut a = AdamW::new(AdamWConfig::default(), mask.clone()).unwrap();
        let mut pa = values(n, 7);
        for s in 0..3 {
            a.step(&mut pa, &values(n, 20 + s), 1e-3).unwrap();
        }
        let mut b = AdamW::new(AdamWConfig::default(), mask).unwrap();
        let (m, v) = (a.exp_avg().to_vec(), a.exp_avg_sq().to_vec());
        b.load_state(&OptimizerState {
            optimizer: "adamw".into(),
            step: 3,
            buffers: vec![("exp_avg_sq".into(), &v), ("exp_avg".into(), &m)],
        })
        .unwrap();
        let mut pb = pa.clone();
        for s in 3..6 {
            a.step(&mut pa, &values(n, 20 + s), 1e-3).unwrap();
            b.step(&mut pb, &values(n, 20 + s), 1e-3).unwrap();
        }
        assert_eq!(pa, pb);
        assert_eq!(a.exp_avg_sq(), b.exp_avg_sq());
        assert_eq!(b.steps_taken(), 6);
    }

    /// Moments on a device come to the host and go back with the step count: a host copy
    /// continues the device's run bitwise, and so does a device optimizer loaded from it.
    #[test]
    fn device_state_round_trips_through_host_copies() {
        let emulated = crate::Emulated::new(1, crate::DType::F32).unwrap();
        let dev: &dyn Backend = &emulated;
        let n = 40;
        let mask = DecayMask::with_exempt(n, std::iter::once(0..5)).unwrap();
        let mut on_dev = AdamW::new_on(dev, AdamWConfig::default(), mask.clone()).unwrap();
        let mut params = dev.alloc(n).unwrap();
        let mut grads = dev.alloc(n).unwrap();
        let mut host_p = values(n, 3);
        dev.upload(params.view_mut(), &host_p).unwrap();
        for s in 0..2 {
            dev.upload(grads.view_mut(), &values(n, 30 + s)).unwrap();
            on_dev
                .step_on(dev, params.view_mut(), grads.view(), 1e-2)
                .unwrap();
        }
        dev.download(&mut host_p, params.view()).unwrap();
        let mut host = on_dev.to_host(dev).unwrap();
        assert_eq!(host.steps_taken(), 2);
        let mut back = AdamW::new_on(dev, AdamWConfig::default(), mask).unwrap();
        back.load_from_host(dev, &host).unwrap();
        let g = values(n, 40);
        host.step(&mut host_p, &g, 1e-2).unwrap();
        dev.upload(grads.view_mut(), &g).unwrap();
        back.step_on(dev, params.view_mut(), grads.view(), 1e-2)
            .unwrap();
        let mut got = vec![0.0; n];
        dev.download(&mut got, params.view()).unwrap();
        assert_eq!(got, host_p);
    }

    #[test]
    fn bad_input_is_an_error() {
        let mut opt = AdamW::new(AdamWConfig::default(), DecayMask::all(4)).unwrap();
        let e = opt.step(&mut [0.0; 4], &[0.0; 3], 1e-3).unwrap_err();
        assert_eq!(
            e.to_string(),
            "AdamW::step: grads has 3 elements, expected 4"
        );
        assert!(opt.step(&mut [0.0; 4], &[0.0; 4], -1.0).is_err());
        assert!(opt.step(&mut [0.0; 4], &[0.0; 4], f64::NAN).is_err());
        assert_eq!(opt.steps_taken(), 0);
        let bad = AdamWConfig {
            beta2: 1.0,
            ..Default::default()
        };
        assert!(AdamW::new(bad, DecayMask::all(4)).is_err());
        let short = [0.0f32; 3];
        let e = opt
            .load_state(&OptimizerState {
                optimizer: "adamw".into(),
                step: 1,
                buffers: vec![("exp_avg".into(), &short), ("exp_avg_sq".into(), &short)],
            })
            .unwrap_err();
        assert!(matches!(e, OptimError::LengthMismatch { .. }), "{e}");
        let e = opt
            .load_state(&OptimizerState {
                optimizer: "adamw".into(),
                step: 1,
                buffers: vec![],
            })
            .unwrap_err();
        assert!(e.to_string().contains("exp_avg"), "{e}");
        let e = opt
            .load_state(&OptimizerState {
                optimizer: "sgd".into(),
                step: 1,
                buffers: vec![],
            })
            .unwrap_err();
        assert!(matches!(e, OptimError::WrongOptimizer { .. }), "{e}");
    }
}

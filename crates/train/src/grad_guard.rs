//! The gradient guard of every training step: the gradients scaled by the
//! micro-batch count and clipped by value then by global norm, and a NaN or
//! infinite loss or gradient skipping that update on every rank at once.
//!
//! The skip is decided collectively: each rank contributes whether its loss
//! and its (averaged) gradient were finite, one all_reduce sums the flags,
//! and every rank skips when any rank saw a non-finite value, so the ranks'
//! parameters never diverge. Too many skips in a row means the run has
//! diverged, and it stops with [`TrainError::Diverged`].
//!
//! The finite check and the norm are one pass over the flat gradient: the
//! squares are summed in f64, where no finite f32 overflows, so the sum is
//! finite exactly when every element is (a norm beyond f32's range counts
//! as non-finite too: such a step is no better than a NaN).
//!
//! Test hook: `COHORT_INJECT_NAN=STEP[-LAST][@RANK]` (or
//! [`TrainConfig::inject_nan`](crate::TrainConfig::inject_nan)) writes a NaN
//! into the averaged gradient of rank RANK (every rank without `@`) at the
//! steps STEP..=LAST (0-based, as the loop counts them), so the tests can
//! make one rank see what the others do not. It exists for tests only.
//!
//! This module must never let one rank update while another skips.

use crate::error::TrainError;
use cohort_comm::{ProcessGroup, ReduceOp};
use cohort_engine::optim::{grad_norm, grad_norm_on};
use cohort_engine::{Backend, ViewMut};

/// The environment variable of the NaN test hook.
pub const INJECT_NAN_VAR: &str = "COHORT_INJECT_NAN";

/// Test hook: where to write a NaN into the averaged gradient (see the
/// module docs). Parsed from `STEP[-LAST][@RANK]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NanInjection {
    /// First step (0-based) whose gradient is poisoned.
    pub first_step: u64,
    /// Last step poisoned (inclusive).
    pub last_step: u64,
    /// The rank whose gradient is poisoned; `None`: every rank.
    pub rank: Option<usize>,
}

impl NanInjection {
    /// Parses `STEP[-LAST][@RANK]`, e.g. `3@1` or `2-5`.
    pub fn parse(spec: &str) -> Result<Self, TrainError> {
        let bad = || TrainError::Hook {
            var: INJECT_NAN_VAR,
            value: spec.to_string(),
            expected: "STEP[-LAST][@RANK], e.g. 3@1 or 2-5",
        };
        let (steps, rank) = match spec.trim().split_once('@') {
            Some((steps, rank)) => (steps, Some(rank.parse().map_err(|_| bad())?)),
            None => (spec.trim(), None),
        };
        let (first, last) = match steps.split_once('-') {
            Some((a, b)) => (a.parse(), b.parse()),
            None => (steps.parse(), steps.parse()),
        };
        let (Ok(first_step), Ok(last_step)) = (first, last) else {
            return Err(bad());
        };
        if last_step < first_step {
            return Err(bad());
        }
        Ok(Self {
            first_step,
            last_step,
            rank,
        })
    }

    /// The hook the environment asks for, if any.
    pub fn from_env() -> Result<Option<Self>, TrainError> {
        match std::env::var(INJECT_NAN_VAR) {
            Ok(spec) if !spec.trim().is_empty() => Self::parse(&spec).map(Some),
            _ => Ok(None),
        }
    }

    fn hits(&self, step: u64, rank: usize) -> bool {
        (self.first_step..=self.last_step).contains(&step) && self.rank.is_none_or(|r| r == rank)
    }
}

/// What the one pass over the gradient found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct GradStats {
    /// Every element was finite (before any clamping), and so is the norm.
    pub finite: bool,
    /// L2 norm of the gradient after scaling and clamping.
    pub norm: f32,
}

/// Accumulator lanes of the fused pass (one AVX-512 register of f32, two of
/// f64): lane `i` sums elements `i, i + 16, ...`, a fixed order whatever the
/// instruction set, so every rank computes the same bits.
const LANES: usize = 16;

/// One pass: `g = clamp(g * scale, -clip_value, clip_value)` (no clamp when
/// `clip_value` is 0), returning the L2 norm of the result and whether every
/// input was finite. Clamping maps an infinity to a finite value, so
/// finiteness is judged on the value before it.
pub(crate) fn scale_clamp_norm(grads: &mut [f32], scale: f32, clip_value: f32) -> GradStats {
    if scale == 1.0 && clip_value == 0.0 {
        // Nothing to write: the engine's (vectorised, parallel) norm alone.
        let norm = grad_norm(grads);
        return GradStats {
            finite: norm.is_finite(),
            norm,
        };
    }
    let limit = if clip_value > 0.0 {
        clip_value
    } else {
        f32::INFINITY
    };
    let (squares, poison) = fused(grads, scale, limit);
    let norm = squares.sqrt() as f32;
    GradStats {
        finite: poison == 0.0 && norm.is_finite(),
        norm,
    }
}

/// [`fused_body`] compiled for AVX-512 and AVX2 as well as the baseline, and
/// picked at run time: the baseline (SSE2) loop is 4x slower than AVX-512's
/// (1.2 vs 0.25 ms on config A's 810k gradients), slower than the three
/// engine passes it replaces.
fn fused(g: &mut [f32], scale: f32, limit: f32) -> (f64, f32) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512(g: &mut [f32], scale: f32, limit: f32) -> (f64, f32) {
            fused_body(g, scale, limit)
        }
        #[target_feature(enable = "avx2")]
        unsafe fn avx2(g: &mut [f32], scale: f32, limit: f32) -> (f64, f32) {
            fused_body(g, scale, limit)
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            // safety: the CPU was just checked to have AVX-512F.
            return unsafe { avx512(g, scale, limit) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // safety: the CPU was just checked to have AVX2.
            return unsafe { avx2(g, scale, limit) };
        }
    }
    fused_body(g, scale, limit)
}

/// Returns (sum of squares of the clamped values in f64, sum of `x * 0`
/// over the scaled values: zero when all are finite, NaN otherwise).
#[inline(always)]
fn fused_body(g: &mut [f32], scale: f32, limit: f32) -> (f64, f32) {
    let mut squares = [0f64; LANES];
    let mut poison = [0f32; LANES];
    let mut visit = |g: &mut f32, lane: usize| {
        let x = *g * scale;
        // x * 0 is (signed) zero for finite x and NaN for NaN or an infinity.
        poison[lane] += x * 0.0;
        // Written out (not f32::clamp) so that it vectorises to min/max.
        let y = if x < -limit { -limit } else { x };
        let y = if y > limit { limit } else { y };
        *g = y;
        squares[lane] += f64::from(y) * f64::from(y);
    };
    let mut chunks = g.chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        for (lane, g) in chunk.iter_mut().enumerate() {
            visit(g, lane);
        }
    }
    for (lane, g) in chunks.into_remainder().iter_mut().enumerate() {
        visit(g, lane);
    }
    (squares.iter().sum(), poison.iter().sum())
}

/// Scales `grads` so that their L2 norm (`norm`, as [`scale_clamp_norm`]
/// measured it) is at most `max_norm`, as `torch.nn.utils.clip_grad_norm_`:
/// by `max_norm / (norm + 1e-6)` when that is below 1. `max_norm` 0: no
/// clipping. Returns the factor applied.
pub(crate) fn clip_to_norm(grads: &mut [f32], norm: f32, max_norm: f32) -> f32 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    let coef = max_norm / (norm + 1e-6);
    if coef >= 1.0 {
        return 1.0;
    }
    grads.iter_mut().for_each(|g| *g *= coef);
    coef
}

/// [`clip_to_norm`] of gradients in `dev`'s memory, by its `scale` kernel (the same bits on
/// the CPU).
pub(crate) fn clip_to_norm_on(
    dev: &dyn Backend,
    grads: ViewMut<'_, f32>,
    norm: f32,
    max_norm: f32,
) -> f32 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    let coef = max_norm / (norm + 1e-6);
    if coef >= 1.0 {
        return 1.0;
    }
    dev.scale(grads, coef);
    coef
}

/// Decides, with the other ranks, whether each step's update is applied,
/// and counts the skipped ones.
#[derive(Debug)]
pub(crate) struct StepGuard {
    clip_value: f32,
    clip_norm: f32,
    max_consecutive: u64,
    inject: Option<NanInjection>,
    consecutive: u64,
    total: u64,
}

/// A skipped update, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Skip {
    /// Ranks whose loss was not finite.
    pub loss_ranks: i32,
    /// Ranks whose averaged gradient was not finite.
    pub grad_ranks: i32,
    /// Skips in a row, this one included.
    pub consecutive: u64,
    /// Skips in this run.
    pub total: u64,
}

impl std::fmt::Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "non-finite loss on {} rank(s), non-finite gradient on {} rank(s): update skipped \
             on every rank ({} in a row, {} in this run)",
            self.loss_ranks, self.grad_ranks, self.consecutive, self.total
        )
    }
}

impl StepGuard {
    /// `max_consecutive`: skips in a row that end the run (0: never).
    pub(crate) fn new(
        clip_value: f32,
        clip_norm: f32,
        max_consecutive: u64,
        inject: Option<NanInjection>,
    ) -> Self {
        Self {
            clip_value,
            clip_norm,
            max_consecutive,
            inject,
            consecutive: 0,
            total: 0,
        }
    }

    /// Updates skipped so far.
    pub(crate) fn skipped(&self) -> u64 {
        self.total
    }

    /// After the gradients of `step` are synchronised (`grads`, summed over
    /// `accum` micro-steps): scales them by 1/`accum` and clamps them, and
    /// returns whether they are finite and their norm on this rank. Local;
    /// [`StepGuard::decide`] follows with the other ranks.
    pub(crate) fn scale(
        &self,
        step: u64,
        rank: usize,
        grads: &mut [f32],
        accum: usize,
    ) -> GradStats {
        if let Some(hook) = &self.inject {
            if hook.hits(step, rank) && !grads.is_empty() {
                grads[0] = f32::NAN;
            }
        }
        scale_clamp_norm(grads, 1.0 / accum as f32, self.clip_value)
    }

    /// [`StepGuard::scale`] of gradients in `dev`'s memory, by its kernels: the scale, then
    /// the f64 sum of squares, read back as one float (finite exactly when every element is).
    /// No clamp: the config refuses `clip_value` on a device. With one micro-batch, the CPU's
    /// bits; with more, the norm's sum runs in another order than the host's fused pass.
    pub(crate) fn scale_on(
        &self,
        step: u64,
        rank: usize,
        dev: &dyn Backend,
        mut grads: ViewMut<'_, f32>,
        accum: usize,
    ) -> Result<GradStats, TrainError> {
        if let Some(hook) = &self.inject {
            if hook.hits(step, rank) && !grads.is_empty() {
                dev.upload(grads.slice_mut(0..1), &[f32::NAN])
                    .map_err(|e| {
                        TrainError::Model(cohort_gpt::GptError::Engine {
                            op: "poison the gradient (COHORT_INJECT_NAN)",
                            reason: e.to_string(),
                        })
                    })?;
            }
        }
        if accum != 1 {
            dev.scale(grads.reborrow(), 1.0 / accum as f32);
        }
        let norm = grad_norm_on(dev, grads.as_view());
        Ok(GradStats {
            finite: norm.is_finite(),
            norm,
        })
    }

    /// Decides with the other ranks of `pg` whether the update of `step` is
    /// applied: `None`, apply it (clip by the global norm first, with
    /// [`clip_to_norm`]); `Some(skip)`, every rank skips it because some
    /// rank's loss (`loss_finite`) or gradients (`stats`) were not finite;
    /// an error when the skips in a row reach the limit. The `bool` beside
    /// it: whether any rank wanted to stop (`stop_wanted`). Collective: every
    /// rank calls it once per step.
    pub(crate) fn decide(
        &mut self,
        pg: &ProcessGroup,
        step: u64,
        loss_finite: bool,
        stats: GradStats,
        stop_wanted: bool,
    ) -> Result<(Option<Skip>, bool), TrainError> {
        // The third flag is a request to save and stop (`stop_request`): it
        // rides on this all-reduce so that every rank stops after the same step.
        let mut flags = [
            i32::from(!loss_finite),
            i32::from(!stats.finite),
            i32::from(stop_wanted),
        ];
        pg.all_reduce(&mut flags, ReduceOp::Sum)
            .map_err(TrainError::comm("non-finite check all_reduce"))?;
        let stop = flags[2] > 0;
        if flags[..2] == [0, 0] {
            self.consecutive = 0;
            return Ok((None, stop));
        }
        self.consecutive += 1;
        self.total += 1;
        if self.max_consecutive > 0 && self.consecutive >= self.max_consecutive {
            return Err(TrainError::Diverged {
                step: step + 1,
                skipped: self.consecutive,
                total: self.total,
            });
        }
        let skip = Skip {
            loss_ranks: flags[0],
            grad_ranks: flags[1],
            consecutive: self.consecutive,
            total: self.total,
        };
        Ok((Some(skip), stop))
    }

    /// The norm gradients are clipped to (0: no clipping).
    pub(crate) fn clip_norm(&self) -> f32 {
        self.clip_norm
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_then_norm_clipping_matches_a_hand_computation() {
        // clip_value 5: 12 -> 5 and -7 -> -5; squares 9 + 16 + 0.25 + 25 + 25 = 75.25
        let mut g = vec![3.0f32, -4.0, 0.5, 12.0, -7.0];
        let stats = scale_clamp_norm(&mut g, 1.0, 5.0);
        assert_eq!(g, [3.0, -4.0, 0.5, 5.0, -5.0]);
        assert!(stats.finite);
        assert_eq!(stats.norm, 75.25f64.sqrt() as f32);
        // then to norm 1: every element times 1 / (sqrt(75.25) + 1e-6)
        let coef = clip_to_norm(&mut g, stats.norm, 1.0);
        assert_eq!(coef, 1.0 / (75.25f32.sqrt() + 1e-6));
        let want: Vec<f32> = [3.0f32, -4.0, 0.5, 5.0, -5.0]
            .iter()
            .map(|x| x * coef)
            .collect();
        assert_eq!(g, want);
        let norm: f32 = g.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-6, "{norm}");
        // a norm already within the limit, and clipping off, leave it alone
        let before = g.clone();
        assert_eq!(clip_to_norm(&mut g, 0.5, 1.0), 1.0);
        assert_eq!(clip_to_norm(&mut g, 100.0, 0.0), 1.0);
        assert_eq!(g, before);
    }

    #[test]
    fn scaling_for_accumulation_comes_before_the_clamp() {
        // 4 micro-steps summed: 8 / 4 = 2 (under the clamp of 3), 20 / 4 = 5 -> 3
        let mut g = vec![8.0f32, 20.0, -4.0];
        let stats = scale_clamp_norm(&mut g, 0.25, 3.0);
        assert_eq!(g, [2.0, 3.0, -1.0]);
        assert_eq!(stats.norm, 14f64.sqrt() as f32);
        // without a clamp: only the scale
        let mut g = vec![8.0f32, 20.0, -4.0];
        assert_eq!(
            scale_clamp_norm(&mut g, 0.5, 0.0).norm,
            120f64.sqrt() as f32
        );
        assert_eq!(g, [4.0, 10.0, -2.0]);
    }

    #[test]
    fn the_fused_norm_agrees_with_the_engine_and_sees_every_bad_element() {
        let n = 1000 * LANES + 5; // whole lane groups and a tail
        let base: Vec<f32> = (0..n)
            .map(|i| ((i * 37) % 101) as f32 * 0.01 - 0.5)
            .collect();
        let mut g = base.clone();
        let fused = scale_clamp_norm(&mut g, 1.0, 100.0);
        let engine = grad_norm(&base);
        assert!(fused.finite);
        assert!(
            (fused.norm - engine).abs() <= 1e-6 * engine,
            "{fused:?} vs {engine}"
        );
        assert_eq!(g, base, "a clamp wider than every value changes nothing");
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, 3, LANES + 1, n - 1] {
                for clip_value in [0.0, 0.5] {
                    for scale in [1.0, 0.5] {
                        let mut g = base.clone();
                        g[at] = bad;
                        let stats = scale_clamp_norm(&mut g, scale, clip_value);
                        assert!(
                            !stats.finite,
                            "{bad} at {at} (clip {clip_value}, scale {scale}) unseen"
                        );
                    }
                }
            }
        }
        // finite values whose squares overflow f32 are still finite in f64
        let mut big = vec![1e30f32; 16];
        assert!(scale_clamp_norm(&mut big, 1.0, 0.0).finite);
        assert!(scale_clamp_norm(&mut big, 0.5, 0.0).finite);
    }

    #[test]
    fn injection_specs_parse_or_are_clear_errors() {
        let one = NanInjection::parse("3@1").unwrap();
        assert_eq!(
            one,
            NanInjection {
                first_step: 3,
                last_step: 3,
                rank: Some(1)
            }
        );
        assert!(one.hits(3, 1) && !one.hits(3, 0) && !one.hits(4, 1));
        let range = NanInjection::parse("2-5").unwrap();
        assert!(range.hits(2, 0) && range.hits(5, 7) && !range.hits(6, 0));
        for bad in ["", "x", "3@", "5-2", "1-2-3", "-1"] {
            let err = NanInjection::parse(bad).unwrap_err().to_string();
            assert!(
                err.contains(INJECT_NAN_VAR) && err.contains("STEP"),
                "{bad}: {err}"
            );
        }
    }
}

//! DiLoCo and local SGD, the data-parallel sync for slow links: every rank
//! takes its own AdamW steps (the inner optimizer) without communicating,
//! and every `sync_every` (H) steps the ranks meet once:
//!
//! 1. each rank's pseudo-gradient is Δ_r = θ − θ_r, the global parameters of
//!    the last sync minus its own now;
//! 2. the ranks average them (one all-reduce of the model's size, in fp32
//!    or bf16): Δ = mean_r Δ_r;
//! 3. the outer optimizer, SGD with Nesterov momentum as in the DiLoCo
//!    paper (Douillard et al. 2023, `torch.optim.SGD(nesterov=True)`),
//!    steps θ by Δ at the outer learning rate;
//! 4. every rank sets its parameters to the new θ. The inner AdamW
//!    moments stay each rank's own.
//!
//! Local SGD is the special case outer lr 1 and no momentum: θ − 1·(θ −
//! mean θ_r) is the ranks' mean parameters (to rounding). The last step of
//! a run always syncs, so a run ends with one model.
//!
//! By default the outer all-reduce is synchronous: the ranks wait for it at
//! the sync step. It moves the model once per H steps, where DDP moves its
//! gradient every step, so at H = 50 the wire carries 1/50th of DDP's bytes.
//!
//! **Overlapped** (`--outer-overlap`), the outer step is delayed by τ inner
//! steps (`--outer-overlap-steps`, default 5, at most H), so that its
//! all-reduce runs while they do (on a group of its own, beside the
//! training group's per-step collectives). Each rank keeps s_r, the
//! reference of its next pseudo-gradient. With x_r its parameters:
//!
//! 1. at a sync: d_r = s_r − x_r is the rank's pseudo-gradient; s_r = x_r;
//!    the all-reduce of d_r starts and the inner steps go on;
//! 2. τ steps later: wait for the average p (normally long arrived), step
//!    θ by p with the outer optimizer, and set x_r = θ − (s_r − x_r): the
//!    new global parameters plus this rank's own progress since the sync;
//!    s_r = θ, so the next pseudo-gradient holds that progress too.
//!
//! With τ = H, step 2 falls on the next sync, one round late: there d_r is
//! taken first, x_r = θ − d_r, and step 1 goes on from there. At the run's
//! last step an outer step still pending is taken as in step 2, then the
//! last pseudo-gradient is all-reduced at once and applied, and every rank
//! takes θ. On one rank with lr 1 and no momentum this is plain training
//! (to rounding). A checkpoint waits for the all-reduce in flight and saves
//! its result (the same on every rank) with each rank's s_r: the resume
//! takes the outer step where the run would have, bitwise. One round late,
//! DiLoCo's Nesterov momentum on a stale average lost the loss on the
//! Markov corpus, where local SGD kept it (docs/guides/slow-links.md).

//! A checkpoint (DDP's format, written by rank 0) holds the global θ as its
//! model, rank 0's AdamW moments as its optimizer (so DDP and ZeRO resume
//! it), and beside them the outer momentum and every rank's own parameters
//! and moments ([`DILOCO_PREFIX`] buffers), gathered to rank 0: a resume on
//! the same number of ranks continues bitwise. A resume on another number
//! of ranks regroups at the last sync: every rank starts from θ with rank
//! 0's moments and the outer momentum, and the local steps since the last
//! sync are dropped (an overlapped run keeps the average in flight, which
//! every rank had a share in, and applies it at the next sync).
//!
//! This module never communicates between syncs (an overlapped all-reduce
//! only runs on), and never leaves the ranks with different parameters
//! after a synchronous sync or the last one.

use std::path::Path;
use std::time::{Duration, Instant};

use cohort_comm::{bf16, ProcessGroup, ReduceOp, Work};
use cohort_engine::optim::{AdamW, DecayMask, Optimizer, OptimizerState, Sgd, SgdConfig};
use cohort_gpt::checkpoint::{self as ckpt, CheckpointError, TensorFile};
use cohort_gpt::{GPTConfig, GPT};

use crate::checkpoint::trainer_files::{self, OPTIMIZER_FILE};
use crate::checkpoint::Restore;
use crate::config::{Precision, Strategy, TrainConfig};
use crate::error::TrainError;

/// The prefix of the optimizer file's DiLoCo buffers and metadata keys.
pub(crate) const DILOCO_PREFIX: &str = "diloco.";

/// The outer optimizer's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OuterConfig {
    /// Inner steps between syncs (H).
    pub sync_every: u64,
    /// The outer learning rate.
    pub lr: f64,
    /// The outer momentum (0: none).
    pub momentum: f64,
    /// Nesterov momentum (only with a momentum).
    pub nesterov: bool,
    /// Average the pseudo-gradients in bf16 rather than fp32.
    pub bf16: bool,
    /// Overlap the outer all-reduce with the next inner steps, the outer
    /// step delayed (see the module docs).
    pub overlap: bool,
    /// Overlapped: the inner steps after a sync at whose end its outer
    /// step is taken (τ), at most `sync_every` (one round late).
    pub delay: u64,
}

impl OuterConfig {
    /// The settings of `cfg`: `--strategy local-sgd` fixes lr 1 and no momentum.
    pub fn of(cfg: &TrainConfig) -> OuterConfig {
        let local = cfg.strategy == Strategy::LocalSgd;
        let momentum = if local { 0.0 } else { cfg.outer_momentum };
        OuterConfig {
            sync_every: cfg.sync_every,
            lr: if local { 1.0 } else { cfg.outer_lr },
            momentum,
            nesterov: cfg.outer_nesterov && momentum > 0.0,
            bf16: cfg.pseudo_grad_dtype == Precision::Bf16,
            overlap: cfg.outer_overlap,
            delay: cfg.outer_overlap_steps.clamp(1, cfg.sync_every.max(1)),
        }
    }

    /// How the header describes it.
    pub fn line(&self) -> String {
        let (kind, outer) = if self.lr == 1.0 && self.momentum == 0.0 {
            ("local SGD", "parameters averaged".to_string())
        } else {
            let nesterov = if self.nesterov { "Nesterov " } else { "" };
            let outer = format!(
                "outer SGD lr {} with {nesterov}momentum {}",
                self.lr, self.momentum
            );
            ("DiLoCo", outer)
        };
        let dtype = if self.bf16 { "bf16" } else { "fp32" };
        let how = match self.overlap {
            true if self.delay >= self.sync_every => {
                "all-reduce overlapped with the next round, applied one round late".to_string()
            }
            true => format!(
                "all-reduce overlapped with the next inner steps, applied {} steps late",
                self.delay
            ),
            false => "synchronous all-reduce".to_string(),
        };
        format!(
            "{kind}: inner AdamW on each rank, every {} steps {outer} over the {dtype} \
             pseudo-gradient ({how})",
            self.sync_every
        )
    }
}

/// The outer half of DiLoCo: the global parameters of the last sync and the
/// outer optimizer over them.
pub struct Outer {
    cfg: OuterConfig,
    /// θ: the global parameters as of the last outer step.
    global: Vec<f32>,
    /// The outer SGD (its momentum buffer, and how many outer steps it took).
    sgd: Sgd,
    /// The pseudo-gradient, reused between syncs.
    pseudo: Vec<f32>,
    /// Overlapped: this rank's parameters at the start of the round, the
    /// reference of its next pseudo-gradient (empty when synchronous).
    start: Vec<f32>,
    /// Overlapped: the group the all-reduces run on, beside the training
    /// group (whose blocking collectives would queue behind them).
    side: Option<ProcessGroup>,
    /// Overlapped: the last round's averaged pseudo-gradient, on the wire
    /// or arrived, applied at the next sync.
    pending: Option<Pending>,
}

/// An overlapped all-reduce of the averaged pseudo-gradient.
enum Pending {
    F32(Work<Vec<f32>>),
    Bf16(Work<Vec<bf16>>),
    Arrived(Vec<f32>),
}

impl Pending {
    /// The average, once the all-reduce has finished.
    fn wait(self) -> Result<Vec<f32>, TrainError> {
        let what = "DiLoCo overlapped pseudo-gradient all_reduce";
        match self {
            Pending::F32(work) => work.wait().map_err(TrainError::comm(what)),
            Pending::Bf16(work) => {
                let wire = work.wait().map_err(TrainError::comm(what))?;
                Ok(wire.iter().map(|w| w.to_f32()).collect())
            }
            Pending::Arrived(avg) => Ok(avg),
        }
    }
}

impl Outer {
    /// The outer optimizer of `cfg` for a model whose parameters (the same
    /// on every rank) are `params`. Overlapped, its all-reduces run on
    /// `side` (a group of the same ranks), else on the training group.
    pub fn new(
        cfg: OuterConfig,
        params: &[f32],
        side: Option<ProcessGroup>,
    ) -> Result<Outer, TrainError> {
        let sgd = Sgd::new(
            SgdConfig {
                momentum: cfg.momentum,
                nesterov: cfg.nesterov,
                ..SgdConfig::default()
            },
            DecayMask::all(params.len()),
        )?;
        Ok(Outer {
            cfg,
            global: params.to_vec(),
            sgd,
            pseudo: vec![0.0; params.len()],
            start: if cfg.overlap {
                params.to_vec()
            } else {
                Vec::new()
            },
            side,
            pending: None,
        })
    }

    /// The settings.
    pub fn config(&self) -> &OuterConfig {
        &self.cfg
    }

    /// The global parameters of the last sync.
    pub fn global(&self) -> &[f32] {
        &self.global
    }

    /// Outer steps taken.
    pub fn syncs(&self) -> u64 {
        self.sgd.steps_taken()
    }

    /// Whether the end of step `step` (0-based) syncs, in a run of `steps`:
    /// every `sync_every` steps, and at the last.
    pub fn due(&self, step: u64, steps: u64) -> bool {
        (step + 1).is_multiple_of(self.cfg.sync_every) || step + 1 == steps
    }

    /// The sync at the end of a round, `last` at the end of the run: the
    /// ranks' pseudo-gradients averaged and θ stepped, synchronously or
    /// overlapped as the module says; `params`, this rank's parameters, set
    /// to what the next round starts from. Returns the time this rank
    /// waited for all-reduces. Collective.
    pub fn sync(
        &mut self,
        pg: &ProcessGroup,
        params: &mut [f32],
        last: bool,
    ) -> Result<Duration, TrainError> {
        if !self.cfg.overlap {
            for ((d, g), p) in self.pseudo.iter_mut().zip(&self.global).zip(&*params) {
                *d = g - p;
            }
            let waited = self.average(pg)?;
            self.sgd.step(&mut self.global, &self.pseudo, self.cfg.lr)?;
            params.copy_from_slice(&self.global);
            return Ok(waited);
        }
        for ((d, s), p) in self.pseudo.iter_mut().zip(&self.start).zip(&*params) {
            *d = s - p;
        }
        let t = Instant::now();
        let arrived = self.pending.take().map(Pending::wait).transpose()?;
        let mut waited = t.elapsed();
        if let Some(avg) = arrived {
            self.sgd.step(&mut self.global, &avg, self.cfg.lr)?;
            for ((p, g), d) in params.iter_mut().zip(&self.global).zip(&self.pseudo) {
                *p = g - d;
            }
        }
        if last {
            let side = self.side.clone();
            waited += self.average(side.as_ref().unwrap_or(pg))?;
            self.sgd.step(&mut self.global, &self.pseudo, self.cfg.lr)?;
            params.copy_from_slice(&self.global);
        } else {
            let group = self.side.as_ref().unwrap_or(pg);
            self.pending = Some(if self.cfg.bf16 {
                let wire = self.pseudo.iter().map(|&x| bf16::from_f32(x)).collect();
                Pending::Bf16(group.all_reduce_async(wire, ReduceOp::Avg))
            } else {
                Pending::F32(group.all_reduce_async(self.pseudo.clone(), ReduceOp::Avg))
            });
        }
        self.start.copy_from_slice(params);
        Ok(waited)
    }

    /// Whether the end of step `step` takes the overlapped outer step in
    /// flight: `delay` steps after the sync that started it, when that
    /// comes before the next sync (which takes it otherwise).
    pub fn apply_due(&self, step: u64) -> bool {
        let (h, delay) = (self.cfg.sync_every, self.cfg.delay);
        self.pending.is_some() && delay < h && (step + 1) % h == delay
    }

    /// The overlapped outer step in flight, `delay` steps after its sync:
    /// waits for the average, steps θ by it, and sets `params` to θ plus
    /// this rank's progress since the sync, which its next pseudo-gradient
    /// (from θ) then holds. Returns the wait.
    pub fn apply_pending(&mut self, params: &mut [f32]) -> Result<Duration, TrainError> {
        let t = Instant::now();
        let Some(pending) = self.pending.take() else {
            return Ok(Duration::ZERO);
        };
        let avg = pending.wait()?;
        let waited = t.elapsed();
        self.sgd.step(&mut self.global, &avg, self.cfg.lr)?;
        for ((p, g), s) in params.iter_mut().zip(&self.global).zip(&self.start) {
            *p = g - (s - *p);
        }
        self.start.copy_from_slice(&self.global);
        Ok(waited)
    }

    /// Waits for the overlapped all-reduce in flight, if any, keeping its
    /// result for the next sync (a checkpoint saves it). Returns the wait.
    pub fn drain(&mut self) -> Result<Duration, TrainError> {
        let t = Instant::now();
        if let Some(pending) = self.pending.take() {
            self.pending = Some(Pending::Arrived(pending.wait()?));
        }
        Ok(t.elapsed())
    }

    /// Averages `self.pseudo` over `pg` in place, in fp32 or bf16. Returns
    /// the all-reduce's time. Collective.
    fn average(&mut self, pg: &ProcessGroup) -> Result<Duration, TrainError> {
        let t = Instant::now();
        if self.cfg.bf16 {
            let mut wire: Vec<bf16> = self.pseudo.iter().map(|&x| bf16::from_f32(x)).collect();
            pg.all_reduce(&mut wire, ReduceOp::Avg)
                .map_err(TrainError::comm("DiLoCo pseudo-gradient all_reduce"))?;
            for (d, w) in self.pseudo.iter_mut().zip(&wire) {
                *d = w.to_f32();
            }
        } else {
            pg.all_reduce(&mut self.pseudo, ReduceOp::Avg)
                .map_err(TrainError::comm("DiLoCo pseudo-gradient all_reduce"))?;
        }
        Ok(t.elapsed())
    }
}

/// The name of rank `r`'s buffer `what` in the optimizer file.
fn rank_buffer(r: usize, what: &str) -> String {
    format!("{DILOCO_PREFIX}rank{r}.{what}")
}

const MOMENTUM_BUFFER: &str = "diloco.outer_momentum";
/// An overlapped run's averaged pseudo-gradient not yet applied.
const PENDING_BUFFER: &str = "diloco.pending";
const WORLD_KEY: &str = "diloco.world_size";
const SYNCS_KEY: &str = "diloco.outer_steps";

/// Every rank's own parameters and AdamW moments (overlapped: and its
/// round's start), gathered to rank 0 (`None` on the others), for the
/// checkpoint. Collective.
pub(crate) fn gather_ranks(
    pg: &ProcessGroup,
    params: &[f32],
    opt: &AdamW,
    outer: &Outer,
) -> Result<Option<Vec<f32>>, TrainError> {
    let mine: Vec<f32> = [params, opt.exp_avg(), opt.exp_avg_sq(), &outer.start].concat();
    let master = pg.rank() == 0;
    let mut all = vec![0f32; if master { mine.len() * pg.size() } else { 0 }];
    pg.gather(&mine, master.then_some(&mut all[..]), 0)
        .map_err(TrainError::comm("DiLoCo checkpoint gather"))?;
    Ok(master.then_some(all))
}

/// The buffers of each rank in a checkpoint, in [`gather_ranks`]' order.
const RANK_BUFFERS: [&str; 4] = ["params", "exp_avg", "exp_avg_sq", "start"];

/// The optimizer file of a DiLoCo checkpoint: rank 0's AdamW state under
/// its own names (DDP reads those), the outer momentum and `ranks` (from
/// [`gather_ranks`]: each rank's parameters and moments, overlapped its
/// round's start) as [`DILOCO_PREFIX`] buffers, and overlapped the average
/// in flight ([`Outer::drain`] first: a save never holds a half-done one).
pub(crate) fn optimizer_file<'a>(
    opt: &'a AdamW,
    outer: &'a Outer,
    ranks: &'a [f32],
    world: usize,
) -> TensorFile<'a> {
    let mut file = trainer_files::optimizer_file(&opt.state());
    let momentum = outer.sgd.momentum_buffer();
    if !momentum.is_empty() {
        file.tensors.push((MOMENTUM_BUFFER.to_string(), momentum));
    }
    if let Some(Pending::Arrived(avg)) = &outer.pending {
        file.tensors.push((PENDING_BUFFER.to_string(), avg));
    }
    let n = outer.global.len();
    let per = if outer.cfg.overlap { 4 } else { 3 };
    for (r, own) in ranks.chunks(per * n).enumerate() {
        for (i, what) in RANK_BUFFERS[..per].iter().enumerate() {
            file.tensors
                .push((rank_buffer(r, what), &own[i * n..(i + 1) * n]));
        }
    }
    let meta = [(WORLD_KEY, world as u64), (SYNCS_KEY, outer.syncs())];
    file.metadata
        .extend(meta.map(|(k, v)| (k.to_string(), v.to_string())));
    file
}

/// What a resume of DiLoCo restores into: the model (this rank's own
/// parameters), the inner AdamW, and the outer state. Any checkpoint of
/// DDP's format resumes; the notes say how.
pub(crate) struct DilocoTarget<'a> {
    pub model: &'a mut GPT,
    pub opt: &'a mut AdamW,
    pub outer: &'a mut Outer,
    pub rank: usize,
    pub world: usize,
    /// What the resume did beyond the plain restore, for the header.
    pub notes: Vec<String>,
}

impl Restore for DilocoTarget<'_> {
    fn config(&self) -> &GPTConfig {
        self.model.config()
    }

    fn restore(&mut self, dir: &Path) -> Result<bool, TrainError> {
        ckpt::load_params_into(dir, self.model)?;
        self.outer.global.copy_from_slice(self.model.params());
        if self.outer.cfg.overlap {
            self.outer.start.copy_from_slice(self.model.params());
        }
        if !trainer_files::load_optimizer_into(dir, self.opt)? {
            return Ok(false);
        }
        let Some(file) = ckpt::read_tensor_file(dir, OPTIMIZER_FILE)? else {
            // A sharded checkpoint (ZeRO): a new outer optimizer from its model.
            self.notes.push(outer_fresh(dir));
            return Ok(true);
        };
        let bad = |reason: String| CheckpointError::Format {
            path: file.path.clone(),
            reason,
        };
        let meta = |key: &str| -> Result<Option<u64>, CheckpointError> {
            (file.metadata.get(key))
                .map(|v| v.parse().map_err(|e| bad(format!("metadata {key}: {e}"))))
                .transpose()
        };
        let Some(saved_world) = meta(WORLD_KEY)? else {
            self.notes.push(outer_fresh(dir));
            return Ok(true);
        };
        let syncs = meta(SYNCS_KEY)?.unwrap_or(0);
        let tensor = |name: &str| file.tensors.iter().find(|(n, _)| n == name);
        let none: &[f32] = &[];
        let momentum = match (tensor(MOMENTUM_BUFFER), self.outer.cfg.momentum > 0.0) {
            (Some((_, b)), true) => b.as_slice(),
            _ => none,
        };
        let mut zeros = Vec::new();
        let momentum = if self.outer.cfg.momentum > 0.0 && momentum.is_empty() {
            zeros.resize(self.outer.global.len(), 0.0);
            &zeros[..]
        } else {
            momentum
        };
        let state = OptimizerState {
            optimizer: "sgd".into(),
            step: syncs,
            buffers: vec![("momentum_buffer".into(), momentum)],
        };
        self.outer
            .sgd
            .load_state(&state)
            .map_err(|e| bad(format!("outer momentum: {e}")))?;
        if let Some((_, avg)) = tensor(PENDING_BUFFER) {
            let n = self.outer.global.len();
            if avg.len() != n {
                let got = avg.len();
                let why = format!("{PENDING_BUFFER} has {got} elements, the model {n}");
                return Err(bad(why).into());
            }
            if self.outer.cfg.overlap {
                self.outer.pending = Some(Pending::Arrived(avg.clone()));
            } else {
                // A synchronous round starts from θ: the outer step the
                // overlapped run had in flight is taken now.
                let outer = &mut *self.outer;
                outer.sgd.step(&mut outer.global, avg, outer.cfg.lr)?;
                self.model.params_mut().copy_from_slice(&outer.global);
                self.notes.push(format!(
                    "DiLoCo resumed an overlapped run synchronously: its outer step in flight \
                     was taken, and every rank starts from the global parameters with rank \
                     0's AdamW moments (the local steps since the last sync of {} are dropped)",
                    dir.display()
                ));
                return Ok(true);
            }
        }
        if saved_world as usize != self.world {
            self.notes.push(format!(
                "DiLoCo regrouped from {saved_world} to {} ranks: every rank starts from the \
                 global parameters of the last sync with rank 0's AdamW moments and the outer \
                 momentum (the local steps since that sync are dropped; an outer step in \
                 flight is kept)",
                self.world
            ));
            return Ok(true);
        }
        let own = |what| {
            let name = rank_buffer(self.rank, what);
            tensor(&name)
                .map(|(_, b)| b.as_slice())
                .ok_or_else(|| bad(format!("no tensor {name:?}")))
        };
        let (params, m, v) = (own("params")?, own("exp_avg")?, own("exp_avg_sq")?);
        if params.len() != self.model.num_params() {
            let n = self.model.num_params();
            return Err(bad(format!(
                "{} has {} elements, the model {n}",
                "params",
                params.len()
            ))
            .into());
        }
        self.model.params_mut().copy_from_slice(params);
        if self.outer.cfg.overlap {
            // A synchronous run's round started from θ, set above.
            if let Some((_, start)) = tensor(&rank_buffer(self.rank, "start")) {
                if start.len() != params.len() {
                    let why = format!("{} elements, the model {}", start.len(), params.len());
                    return Err(bad(format!("rank {}'s start has {why}", self.rank)).into());
                }
                self.outer.start.copy_from_slice(start);
            }
        }
        let inner = OptimizerState {
            optimizer: self.opt.name().into(),
            step: self.opt.steps_taken(),
            buffers: vec![("exp_avg".into(), m), ("exp_avg_sq".into(), v)],
        };
        self.opt
            .load_state(&inner)
            .map_err(|e| bad(format!("rank {}'s AdamW state: {e}", self.rank)))?;
        Ok(true)
    }
}

/// The note of a resume from a checkpoint without DiLoCo's state.
fn outer_fresh(dir: &Path) -> String {
    format!(
        "{} holds no DiLoCo state: the outer optimizer starts afresh from its model",
        dir.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_comm::{spawn, GroupOptions};

    fn opts() -> GroupOptions {
        GroupOptions {
            timeout: Duration::from_secs(60),
            ..GroupOptions::from_env().unwrap()
        }
    }

    /// Two syncs of two ranks against the update written out by hand in f64:
    /// Δ = θ − mean θ_r; b = μ b + Δ (b = Δ the first time); θ −= lr (Δ + μ b).
    #[test]
    fn the_outer_nesterov_step_is_the_papers() {
        let cfg = OuterConfig {
            sync_every: 1,
            lr: 0.7,
            momentum: 0.9,
            nesterov: true,
            bf16: false,
            overlap: false,
            delay: 1,
        };
        let theta0 = [1.0f32, -2.0, 0.5];
        // Each rank's parameters before the first and the second sync.
        let local = |r: usize, sync: usize| -> Vec<f32> {
            let s = (r as f32 + 1.0) * 0.25 + sync as f32 * 0.125;
            vec![1.0 - s, -2.0 + 2.0 * s, 0.5 + s * s]
        };
        let got = spawn::threads_with(2, opts(), |pg: &ProcessGroup| {
            let mut outer = Outer::new(cfg, &theta0, None)?;
            let mut seen = Vec::new();
            for sync in 0..2 {
                let mut p = local(pg.rank(), sync);
                outer.sync(pg, &mut p, false)?;
                seen.push(p);
            }
            Ok::<_, TrainError>(seen)
        })
        .unwrap();
        assert_eq!(got[0], got[1], "the ranks agree bitwise");
        let (lr, mu) = (0.7f64, 0.9f64);
        let mut theta: Vec<f64> = theta0.iter().map(|&x| x as f64).collect();
        let mut b = [0f64; 3];
        for (sync, seen) in got[0].iter().enumerate() {
            for i in 0..3 {
                let mean = (local(0, sync)[i] as f64 + local(1, sync)[i] as f64) / 2.0;
                let d = theta[i] - mean;
                b[i] = if sync == 0 { d } else { mu * b[i] + d };
                theta[i] -= lr * (d + mu * b[i]);
            }
            for i in 0..3 {
                let err = (seen[i] as f64 - theta[i]).abs();
                assert!(err < 1e-6, "sync {sync} [{i}]: {} vs {}", seen[i], theta[i]);
            }
        }
    }

    /// Local SGD: every rank leaves the sync with the ranks' mean parameters,
    /// in fp32 to rounding and in bf16 to bf16's precision.
    #[test]
    fn local_sgd_averages_the_parameters() {
        for bf16 in [false, true] {
            let cfg = OuterConfig {
                sync_every: 4,
                lr: 1.0,
                momentum: 0.0,
                nesterov: false,
                bf16,
                overlap: false,
                delay: 1,
            };
            let got = spawn::threads_with(2, opts(), |pg: &ProcessGroup| {
                let mut outer = Outer::new(cfg, &[0.0, 1.0], None)?;
                let mut p = if pg.rank() == 0 {
                    vec![1.0, 3.0]
                } else {
                    vec![2.0, 5.0]
                };
                outer.sync(pg, &mut p, false)?;
                Ok::<_, TrainError>(p)
            })
            .unwrap();
            let tol = if bf16 { 2e-2 } else { 1e-6 };
            assert!(
                (got[0][0] - 1.5).abs() < tol && (got[0][1] - 4.0).abs() < tol,
                "{got:?}"
            );
            assert_eq!(got[0], got[1]);
        }
    }

    /// Overlapped, against the delayed update written out by hand in f64
    /// (the module's steps 1-3, then the drain at the last sync), over four
    /// rounds of two ranks whose inner "training" pulls each parameter a
    /// third of the way to a target of its own, and on its own group.
    #[test]
    fn the_overlapped_outer_step_is_one_round_late() {
        let cfg = OuterConfig {
            sync_every: 1,
            lr: 0.7,
            momentum: 0.9,
            nesterov: true,
            bf16: false,
            overlap: true,
            delay: 1,
        };
        let theta0 = [1.0f32, -2.0, 0.5];
        let target = |r: usize, round: usize| -> [f64; 3] {
            let s = (r as f64 + 1.0) * 0.5 + round as f64 * 0.25;
            [s, -s, 2.0 * s]
        };
        let inner = |x: f64, t: f64| x + (t - x) / 3.0;
        let rounds = 4;
        let got = spawn::threads_with(2, opts(), |pg: &ProcessGroup| {
            let side = pg
                .new_group(&[0, 1])
                .map_err(TrainError::comm("new_group"))?;
            assert!(side.is_some());
            let mut outer = Outer::new(cfg, &theta0, side)?;
            let mut p = theta0.to_vec();
            for round in 0..rounds {
                let t = target(pg.rank(), round);
                for (x, t) in p.iter_mut().zip(t) {
                    *x = inner(*x as f64, t) as f32;
                }
                outer.sync(pg, &mut p, round + 1 == rounds)?;
            }
            Ok::<_, TrainError>((p, outer.global().to_vec(), outer.syncs()))
        })
        .unwrap();
        assert_eq!(got[0], got[1], "the ranks agree bitwise");
        assert_eq!(got[0].2, rounds as u64, "one outer step per round");
        // The reference: every rank's x and s, θ and the momentum b.
        let (lr, mu) = (0.7f64, 0.9f64);
        let mut theta: Vec<f64> = theta0.iter().map(|&x| x as f64).collect();
        let mut b = [0f64; 3];
        let mut steps = 0;
        let mut outer_step = |theta: &mut Vec<f64>, avg: &[f64]| {
            for i in 0..3 {
                b[i] = if steps == 0 {
                    avg[i]
                } else {
                    mu * b[i] + avg[i]
                };
                theta[i] -= lr * (avg[i] + mu * b[i]);
            }
            steps += 1;
        };
        let mut x = [theta.clone(), theta.clone()];
        let mut s = x.clone();
        let mut pending: Option<Vec<f64>> = None;
        for round in 0..rounds {
            let mut d = [vec![0.0; 3], vec![0.0; 3]];
            for r in 0..2 {
                let t = target(r, round);
                for i in 0..3 {
                    x[r][i] = inner(x[r][i], t[i]);
                    d[r][i] = s[r][i] - x[r][i];
                }
            }
            if let Some(avg) = pending.take() {
                outer_step(&mut theta, &avg);
                for r in 0..2 {
                    for i in 0..3 {
                        x[r][i] = theta[i] - d[r][i];
                    }
                }
            }
            let avg: Vec<f64> = (0..3).map(|i| (d[0][i] + d[1][i]) / 2.0).collect();
            if round + 1 == rounds {
                outer_step(&mut theta, &avg);
                x = [theta.clone(), theta.clone()];
            } else {
                pending = Some(avg);
            }
            s = x.clone();
        }
        for (i, (g, t)) in got[0].0.iter().zip(&theta).enumerate() {
            let err = (*g as f64 - t).abs();
            assert!(err < 1e-5, "[{i}]: {g} vs {t}");
        }
        assert_eq!(got[0].0, got[0].1, "the run ends on θ");
    }

    /// Overlapped with a delay under H (H = 3, τ = 1; 8 steps: syncs after
    /// steps 3, 6 and 8, outer steps taken after 4 and 7), step by step as
    /// the training loop's `end_step` runs it, against the rules in f64: at
    /// a sync d = s − x is sent and s = x; τ steps later θ takes the
    /// average and x = θ − (s − x), s = θ; the last sync drains.
    #[test]
    fn the_overlapped_outer_step_is_taken_tau_steps_late() {
        let cfg = OuterConfig {
            sync_every: 3,
            lr: 0.7,
            momentum: 0.9,
            nesterov: true,
            bf16: false,
            overlap: true,
            delay: 1,
        };
        let steps = 8u64;
        let theta0 = [0.5f32, -1.0];
        let target = |r: usize, step: u64| [r as f64 + 0.1 * step as f64, -(r as f64)];
        let inner = |x: f64, t: f64| x + (t - x) / 4.0;
        let got = spawn::threads_with(2, opts(), |pg: &ProcessGroup| {
            let side = pg
                .new_group(&[0, 1])
                .map_err(TrainError::comm("new_group"))?;
            let mut outer = Outer::new(cfg, &theta0, side)?;
            let mut p = theta0.to_vec();
            for step in 0..steps {
                for (x, t) in p.iter_mut().zip(target(pg.rank(), step)) {
                    *x = inner(*x as f64, t) as f32;
                }
                if outer.apply_due(step) {
                    outer.apply_pending(&mut p)?;
                }
                if outer.due(step, steps) {
                    outer.sync(pg, &mut p, step + 1 == steps)?;
                }
            }
            Ok::<_, TrainError>((p, outer.syncs()))
        })
        .unwrap();
        assert_eq!(got[0], got[1], "the ranks agree bitwise");
        assert_eq!(got[0].1, 3, "two delayed outer steps and the last sync's");
        let (lr, mu) = (0.7f64, 0.9f64);
        let mut theta: Vec<f64> = theta0.iter().map(|&x| x as f64).collect();
        let (mut b, mut taken) = (vec![0f64; 2], 0);
        let mut outer_step = |theta: &mut [f64], avg: &[f64]| {
            for ((th, bi), a) in theta.iter_mut().zip(b.iter_mut()).zip(avg) {
                *bi = if taken == 0 { *a } else { mu * *bi + a };
                *th -= lr * (a + mu * *bi);
            }
            taken += 1;
        };
        let mut x = [theta.clone(), theta.clone()];
        let mut s = x.clone();
        let mut pending: Option<Vec<f64>> = None;
        for step in 0..steps {
            for (r, xr) in x.iter_mut().enumerate() {
                for (xi, t) in xr.iter_mut().zip(target(r, step)) {
                    *xi = inner(*xi, t);
                }
            }
            if pending.is_some() && (step + 1) % 3 == 1 {
                outer_step(&mut theta, &pending.take().unwrap());
                for (xr, sr) in x.iter_mut().zip(s.iter_mut()) {
                    for ((xi, si), th) in xr.iter_mut().zip(sr.iter()).zip(&theta) {
                        *xi = th - (si - *xi);
                    }
                    sr.clone_from(&theta);
                }
            }
            if (step + 1) % 3 == 0 || step + 1 == steps {
                let d: Vec<Vec<f64>> = (0..2)
                    .map(|r| s[r].iter().zip(&x[r]).map(|(si, xi)| si - xi).collect())
                    .collect();
                let avg: Vec<f64> = (0..2).map(|i| (d[0][i] + d[1][i]) / 2.0).collect();
                if step + 1 == steps {
                    outer_step(&mut theta, &avg);
                    x = [theta.clone(), theta.clone()];
                } else {
                    pending = Some(avg);
                }
                s = x.clone();
            }
        }
        for (i, (g, t)) in got[0].0.iter().zip(&theta).enumerate() {
            let err = (*g as f64 - t).abs();
            assert!(err < 1e-5, "[{i}]: {g} vs {t}");
        }
    }

    #[test]
    fn syncs_fall_every_h_steps_and_at_the_end() {
        let cfg = OuterConfig {
            sync_every: 3,
            lr: 0.7,
            momentum: 0.9,
            nesterov: true,
            bf16: false,
            overlap: false,
            delay: 1,
        };
        let outer = Outer::new(cfg, &[0.0], None).unwrap();
        let due: Vec<u64> = (0..8).filter(|&s| outer.due(s, 8)).collect();
        assert_eq!(due, [2, 5, 7]);
        let outer = Outer::new(cfg, &[0.0], None).unwrap();
        let file_meta = {
            let opt = AdamW::new(Default::default(), DecayMask::all(1)).unwrap();
            let ranks = vec![0f32; 6];
            let file = optimizer_file(&opt, &outer, &ranks, 2);
            assert_eq!(
                file.tensors.len(),
                2 + 1 + 2 * 3,
                "AdamW, the momentum, 3 per rank"
            );
            file.metadata.get(WORLD_KEY).cloned()
        };
        assert_eq!(file_meta.as_deref(), Some("2"));
    }
}

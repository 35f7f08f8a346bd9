//! Pipeline parallelism (`cohort run -n S train --strategy pipeline --stages S`): the GPT's
//! blocks split into S contiguous stages on S consecutive ranks, the embeddings with the first
//! and ln_f + the head with the last. Each step's batch is cut into `micro_batches`
//! micro-batches; a stage's forward output goes to the next stage and its input gradient to the
//! previous one point to point (`isend`/`recv`), so while stage 1 computes micro-batch k,
//! stage 0 computes micro-batch k + 1. Schedules: GPipe (all forwards, then all backwards) and
//! 1F1B (after S - 1 - stage warm-up forwards, one forward then one backward; the same bubble,
//! at most S - stage micro-batches' activations in flight instead of all of them).
//!
//! Gradients equal one process's that accumulates the same micro-batches: every stage runs
//! backward in micro-batch order, so each block's gradient is the same sum in the same order.
//! With tied embeddings the last stage holds a copy of wte (Megatron's scheme): after backward
//! the first and last stage all-reduce (sum) the two partial wte gradients, so both copies take
//! the same optimizer step and stay equal. Gradient clipping uses the norm over all stages
//! (counting wte once).
//!
//! With `world = S x D` ranks, D pipelines (replicas) train on different data, rank
//! `d * S + s` being stage s of replica d; each stage's gradients are averaged over its D
//! replicas before the tied sum (data parallelism across pipelines).
//!
//! Checkpoints are the whole model's, as `train` writes them: at each save the stages of
//! replica 0 assemble the parameters and the AdamW state, and rank 0 writes them with the data
//! position of replica 0. Resuming, every rank reads the whole checkpoint and keeps its stage's
//! part.
//!
//! This module schedules and communicates; the model (`GptStage`) only sees buffers.

use std::io::Write;
use std::time::{Duration, Instant};

use cohort_comm::{ProcessGroup, ReduceOp};
use cohort_data::DistributedSampler;
use cohort_engine::optim::{AdamW, AdamWConfig, LrSchedule, Optimizer, OptimizerState};
use cohort_gpt::optim_groups::decay_mask;
use cohort_gpt::{GPTConfig, GptStage, StageInput, StageOutput, StagePart, GPT};

use crate::checkpoint::{self, TrainState};
use crate::config::{PipelineSchedule, TrainConfig};
use crate::phases::{Phase, Phases};
use crate::train::{model_config, Outcome};
use crate::{ConfigError, TrainError};
use cohort_data::{Dataset, Split};

/// One unit of a stage's work in a step: the forward or backward of a micro-batch, in an
/// activation slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Forward { micro: usize, slot: usize },
    Backward { micro: usize, slot: usize },
}

/// The order in which `stage` of `stages` runs `micro` micro-batches.
fn schedule(kind: PipelineSchedule, stage: usize, stages: usize, micro: usize) -> Vec<Op> {
    let mut ops = Vec::with_capacity(2 * micro);
    match kind {
        PipelineSchedule::Gpipe => {
            ops.extend((0..micro).map(|m| Op::Forward { micro: m, slot: m }));
            ops.extend((0..micro).map(|m| Op::Backward { micro: m, slot: m }));
        }
        PipelineSchedule::OneFOneB => {
            // Micro-batch m's backward comes after forward m + warmup, so at most warmup + 1
            // are in flight and slots can be reused modulo that.
            let warmup = (stages - 1 - stage).min(micro);
            let slots = warmup + 1;
            let fwd = |m: usize| Op::Forward {
                micro: m,
                slot: m % slots,
            };
            let bwd = |m: usize| Op::Backward {
                micro: m,
                slot: m % slots,
            };
            ops.extend((0..warmup).map(fwd));
            for m in warmup..micro {
                ops.push(fwd(m));
                ops.push(bwd(m - warmup));
            }
            ops.extend((micro - warmup..micro).map(bwd));
        }
    }
    ops
}

/// Where this rank sits: its stage and replica, its neighbours, and the groups it reduces in.
struct Topology {
    stages: usize,
    replicas: usize,
    stage: usize,
    replica: usize,
    /// The first and last stage of this replica (tied embeddings), when this rank is one of them.
    tied: Option<ProcessGroup>,
    /// This stage's ranks across replicas, when there are several.
    dp: Option<ProcessGroup>,
}

impl Topology {
    /// Collective: every rank builds the same groups in the same order.
    fn new(pg: &ProcessGroup, stages: usize, tied: bool) -> Result<Topology, TrainError> {
        let world = pg.size();
        let replicas = world / stages;
        let (stage, replica) = (pg.rank() % stages, pg.rank() / stages);
        let mut topo = Topology {
            stages,
            replicas,
            stage,
            replica,
            tied: None,
            dp: None,
        };
        let group = |ranks: &[usize]| {
            pg.new_group(ranks)
                .map_err(TrainError::comm("creating the pipeline's groups"))
        };
        if tied && stages > 1 {
            for d in 0..replicas {
                if let Some(g) = group(&[d * stages, d * stages + stages - 1])? {
                    topo.tied = Some(g);
                }
            }
        }
        if replicas > 1 {
            for s in 0..stages {
                let ranks: Vec<usize> = (0..replicas).map(|d| d * stages + s).collect();
                if let Some(g) = group(&ranks)? {
                    topo.dp = Some(g);
                }
            }
        }
        Ok(topo)
    }

    fn first(&self) -> bool {
        self.stage == 0
    }
    fn last(&self) -> bool {
        self.stage + 1 == self.stages
    }
    fn rank_of(&self, stage: usize) -> usize {
        self.replica * self.stages + stage
    }
}

/// Tag of micro-batch `m`'s activations (forward) or their gradient (backward).
fn tag(m: usize, backward: bool) -> u32 {
    (2 * m + usize::from(backward)) as u32
}

/// Times of one run of a schedule on this rank.
#[derive(Default, Clone, Copy)]
struct RunTimes {
    forward: Duration,
    backward: Duration,
    /// Blocked receiving, or waiting for sends to be taken at the end.
    wait: Duration,
}

/// One stage of one pipeline, with its buffers for the messages in flight.
struct Pipe<'p> {
    pg: &'p ProcessGroup,
    topo: Topology,
    stage: GptStage,
    /// Receive buffer (B, T, C).
    inbox: Vec<f32>,
    /// Send buffers handed back by finished sends.
    spare: Vec<Vec<f32>>,
    /// Dropout keys: (seed, rank, step * micro_batches); micro-batch m adds m, as one process
    /// accumulating the micro-batches would.
    drop_key: (u64, u64, u64),
}

impl Pipe<'_> {
    fn recv(&mut self, stage: usize, tag: u32, len: usize) -> Result<(), TrainError> {
        self.inbox.resize(len, 0.0);
        self.pg
            .recv(&mut self.inbox, self.topo.rank_of(stage), tag)
            .map_err(TrainError::comm("pipeline receive"))
    }

    /// Runs `ops` on micro-batches (`tokens[m]`, `labels[m]`; only the first stage reads the
    /// tokens and only the last the labels). Returns the sum of the last stage's losses.
    fn run(
        &mut self,
        ops: &[Op],
        tokens: &[Vec<u32>],
        labels: &[Vec<i32>],
        b: usize,
        t: usize,
        times: &mut RunTimes,
    ) -> Result<f32, TrainError> {
        let (s, len) = (self.topo.stage, self.stage.activation_len(b, t));
        let (first, last) = (self.topo.first(), self.topo.last());
        let mut sends = Vec::new();
        let mut loss_sum = 0f32;
        for &op in ops {
            match op {
                Op::Forward { micro, slot } => {
                    if !first {
                        let t0 = Instant::now();
                        self.recv(s - 1, tag(micro, false), len)?;
                        times.wait += t0.elapsed();
                    }
                    let input = if first {
                        StageInput::Tokens(&tokens[micro])
                    } else {
                        StageInput::Activations(&self.inbox)
                    };
                    let lab = last.then(|| &labels[micro][..]);
                    let (seed, rank, base) = self.drop_key;
                    self.stage.set_dropout_key(seed, rank, base + micro as u64);
                    let t0 = Instant::now();
                    let out = self.stage.forward(slot, input, None, lab, b, t)?;
                    times.forward += t0.elapsed();
                    match out {
                        StageOutput::Loss(l) => loss_sum += l.unwrap_or(0.0),
                        StageOutput::Activations(x) => {
                            let mut buf = self.spare.pop().unwrap_or_default();
                            buf.clear();
                            buf.extend_from_slice(x);
                            let to = self.topo.rank_of(s + 1);
                            sends.push(self.pg.isend(buf, to, tag(micro, false)));
                        }
                    }
                }
                Op::Backward { micro, slot } => {
                    if !last {
                        let t0 = Instant::now();
                        self.recv(s + 1, tag(micro, true), len)?;
                        times.wait += t0.elapsed();
                    }
                    let t0 = Instant::now();
                    let grad = (!last).then_some(&self.inbox[..]);
                    let dx = self.stage.backward(slot, grad)?;
                    times.backward += t0.elapsed();
                    if !first {
                        let mut buf = self.spare.pop().unwrap_or_default();
                        buf.clear();
                        buf.extend_from_slice(dx);
                        let to = self.topo.rank_of(s - 1);
                        sends.push(self.pg.isend(buf, to, tag(micro, true)));
                    }
                }
            }
        }
        let t0 = Instant::now();
        for w in sends {
            let buf = w.wait().map_err(TrainError::comm("pipeline send"))?;
            self.spare.push(buf);
        }
        times.wait += t0.elapsed();
        Ok(loss_sum)
    }

    /// After a step's backwards: average over replicas, sum the tied wte, scale by
    /// `1 / micro`, clip by the norm over all stages. Returns the time spent communicating.
    fn reduce_and_clip(&mut self, micro: usize, clip: f32) -> Result<Duration, TrainError> {
        let t0 = Instant::now();
        if let Some(dp) = &self.topo.dp {
            dp.all_reduce(self.stage.grads_mut(), ReduceOp::Avg)
                .map_err(TrainError::comm("pipeline data-parallel all_reduce"))?;
        }
        if let (Some(g), Some(r)) = (&self.topo.tied, self.stage.tied_range()) {
            g.all_reduce(&mut self.stage.grads_mut()[r], ReduceOp::Sum)
                .map_err(TrainError::comm("tied embedding gradient all_reduce"))?;
        }
        let mut comm = t0.elapsed();
        let inv = 1.0 / micro as f32;
        let grads = self.stage.grads_mut();
        if micro > 1 {
            grads.iter_mut().for_each(|g| *g *= inv);
        }
        if clip > 0.0 {
            let copy = self
                .stage
                .holds_tied_copy()
                .then(|| self.stage.tied_range())
                .flatten()
                .unwrap_or(0..0);
            let grads = self.stage.grads();
            let own = |i: usize| !copy.contains(&i);
            let mut sq = [grads
                .iter()
                .enumerate()
                .filter(|&(i, _)| own(i))
                .map(|(_, &g)| g as f64 * g as f64)
                .sum::<f64>()];
            let t0 = Instant::now();
            self.pg
                .all_reduce(&mut sq, ReduceOp::Sum)
                .map_err(TrainError::comm("gradient norm all_reduce"))?;
            comm += t0.elapsed();
            // Every replica counted the same (averaged) gradients.
            let norm = (sq[0] / self.topo.replicas as f64).sqrt() as f32;
            if !norm.is_finite() {
                return Err(TrainError::Optim(
                    cohort_engine::optim::OptimError::NonFiniteGradNorm { norm },
                ));
            }
            let coef = clip / (norm + 1e-6);
            if coef < 1.0 {
                self.stage.grads_mut().iter_mut().for_each(|g| *g *= coef);
            }
        }
        Ok(comm)
    }

    /// The whole model's parameters, assembled from replica 0's stages, on every rank.
    fn gather_params(&self) -> Result<Vec<f32>, TrainError> {
        self.gather(self.stage.params(), "gathering the parameters")
    }

    /// A whole-model buffer assembled from replica 0's stages' `local` buffers (laid out as
    /// their parameters), on every rank. Collective.
    fn gather(&self, local: &[f32], what: &'static str) -> Result<Vec<f32>, TrainError> {
        let mut full = vec![0f32; self.stage.whole_num_params()];
        if self.topo.replica == 0 {
            let copy = self.stage.holds_tied_copy();
            for (l, g) in self
                .stage
                .param_views()
                .iter()
                .zip(self.stage.global_views())
            {
                if copy && g.name == "wte.weight" {
                    continue;
                }
                full[g.range.clone()].copy_from_slice(&local[l.range.clone()]);
            }
        }
        self.pg
            .all_reduce(&mut full, ReduceOp::Sum)
            .map_err(TrainError::comm(what))?;
        Ok(full)
    }

    /// The whole model and its AdamW state, assembled from the stages, on rank 0 (None on
    /// the others). Collective.
    fn gather_model(
        &self,
        opt: &AdamW,
        model_cfg: &GPTConfig,
        cfg: &TrainConfig,
    ) -> Result<Option<(GPT, AdamW)>, TrainError> {
        let params = self.gather_params()?;
        let exp_avg = self.gather(opt.exp_avg(), "gathering the optimizer state")?;
        let exp_avg_sq = self.gather(opt.exp_avg_sq(), "gathering the optimizer state")?;
        if self.pg.rank() != 0 {
            return Ok(None);
        }
        let mut model = GPT::zeroed(model_cfg.clone(), cfg.seed)?;
        model.params_mut().copy_from_slice(&params);
        let mut whole = AdamW::new(cfg.adamw(), decay_mask(model.param_views()))?;
        whole.load_state(&adamw_state(opt.steps_taken(), &exp_avg, &exp_avg_sq))?;
        Ok(Some((model, whole)))
    }
}

fn invalid(key: &'static str, value: String, why: &'static str) -> TrainError {
    TrainError::Config(ConfigError::Invalid { key, value, why })
}

/// The number of stages of a run on `world` ranks (`stages = 0`: all of them), checked.
fn stage_count(stages: usize, world: usize, n_layers: usize) -> Result<usize, TrainError> {
    let s = if stages == 0 { world } else { stages };
    if !world.is_multiple_of(s) {
        return Err(invalid(
            "stages",
            s.to_string(),
            "must divide the number of ranks (ranks = stages x data-parallel replicas)",
        ));
    }
    if s > n_layers {
        return Err(invalid(
            "stages",
            s.to_string(),
            "must not exceed n_layers (every stage holds at least one block)",
        ));
    }
    Ok(s)
}

/// AdamW's state after `step` steps, from its two moment buffers.
fn adamw_state<'a>(step: u64, exp_avg: &'a [f32], exp_avg_sq: &'a [f32]) -> OptimizerState<'a> {
    OptimizerState {
        optimizer: "adamw".to_string(),
        step,
        buffers: vec![
            ("exp_avg".to_string(), exp_avg),
            ("exp_avg_sq".to_string(), exp_avg_sq),
        ],
    }
}

/// A stage's optimizer: AdamW with the whole model's decay rules, on the stage's buffer.
fn optimizer(cfg: &TrainConfig, stage: &GptStage) -> Result<AdamW, TrainError> {
    Ok(AdamW::new(cfg.adamw(), decay_mask(stage.param_views()))?)
}

/// Restores this stage's part of the whole-model checkpoint at `dir`: its parameters and
/// AdamW state (a tied wte copy takes wte's). Collective: the ranks check they resume at the
/// same step.
fn resume_stage(
    dir: &std::path::Path,
    cfg: &TrainConfig,
    pg: &ProcessGroup,
    replicas: usize,
    model_cfg: &GPTConfig,
    stage: &mut GptStage,
    opt: &mut AdamW,
) -> Result<checkpoint::Resumed, TrainError> {
    let mut model = GPT::zeroed(model_cfg.clone(), cfg.seed)?;
    let mut whole = AdamW::new(cfg.adamw(), decay_mask(model.param_views()))?;
    let resumed = checkpoint::resume_split(dir, cfg, pg, replicas, &mut model, &mut whole)?;
    stage.load_from_full(model.params())?;
    let local = |full: &[f32]| {
        let mut out = vec![0f32; stage.num_params()];
        for (l, g) in stage.param_views().iter().zip(stage.global_views()) {
            out[l.range.clone()].copy_from_slice(&full[g.range.clone()]);
        }
        out
    };
    let (exp_avg, exp_avg_sq) = (local(whole.exp_avg()), local(whole.exp_avg_sq()));
    opt.load_state(&adamw_state(whole.steps_taken(), &exp_avg, &exp_avg_sq))?;
    Ok(resumed)
}

/// This replica's stream of training samples: its sampler's order, epoch after epoch.
struct Samples {
    sampler: DistributedSampler,
    order: Vec<usize>,
    next: usize,
}

impl Samples {
    fn next(&mut self) -> usize {
        if self.next == self.order.len() {
            let epoch = self.sampler.epoch() + 1;
            self.sampler.set_epoch(epoch);
            self.order = self.sampler.indices();
            self.next = 0;
        }
        self.next += 1;
        self.order[self.next - 1]
    }
}

/// Reads `tokens.len()` micro-batches of `b` rows from `split` at `index(..)`; labels are the
/// tokens (the model shifts them).
fn read_micro_batches(
    data: &dyn Dataset,
    split: Split,
    mut index: impl FnMut() -> usize,
    tokens: &mut [Vec<u32>],
    labels: &mut [Vec<i32>],
) {
    let t = data.seq_len();
    for (tok, lab) in tokens.iter_mut().zip(labels.iter_mut()) {
        for row in tok.chunks_mut(t) {
            data.read(split, index(), row);
        }
        lab.iter_mut()
            .zip(tok.iter())
            .for_each(|(l, &x)| *l = x as i32);
    }
}

/// Trains with pipeline parallelism as rank `pg.rank()`; rank 0 writes the log. Collective:
/// every rank calls it with the same config. The outcome's parameters are the whole model's
/// (assembled from the stages) on every rank.
pub fn train_pipeline(
    cfg: &TrainConfig,
    pg: &ProcessGroup,
    log: &mut dyn Write,
) -> Result<Outcome, TrainError> {
    cfg.validate()?;
    let master = pg.rank() == 0;
    let mut say = |line: String| -> Result<(), TrainError> {
        if master {
            writeln!(log, "{line}").map_err(TrainError::Log)?;
        }
        Ok(())
    };
    if cfg.grad_accum != 1 {
        return Err(invalid(
            "grad_accum",
            cfg.grad_accum.to_string(),
            "must be 1 with --strategy pipeline (use micro_batches)",
        ));
    }
    let data = crate::file_data::build(cfg, pg)?;
    if data.variable_length() {
        return Err(invalid(
            "data",
            cfg.data.clone(),
            "--strategy pipeline needs fixed-length sequences (documents of different lengths \
             are not supported yet)",
        ));
    }
    let (b, t, m) = (cfg.batch_size, data.seq_len(), cfg.micro_batches);
    let model_cfg = model_config(cfg, data.vocab_size());
    let stages = stage_count(cfg.stages, pg.size(), model_cfg.n_layers)?;
    let topo = Topology::new(pg, stages, model_cfg.tie_word_embeddings)?;
    let part = StagePart::split(model_cfg.n_layers, stages)?.swap_remove(topo.stage);
    let mut stage = GptStage::new(model_cfg.clone(), cfg.seed, part)?;
    let mut opt = optimizer(cfg, &stage)?;
    let replicas = topo.replicas;
    let mut start = TrainState::default();
    if let Some(dir) = &cfg.resume {
        let resumed = resume_stage(dir, cfg, pg, replicas, &model_cfg, &mut stage, &mut opt)?;
        for note in resumed.notes {
            say(note)?;
        }
        say(format!(
            "resumed from {} at step {}",
            resumed.dir.display(),
            resumed.state.step
        ))?;
        start = resumed.state;
    }
    let schedule_lr =
        LrSchedule::warmup_cosine(cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.decay_steps())?;
    let tokens_per_step = (b * t * m * replicas) as f64;
    say(format!("data: {}", data.describe()))?;
    let blocks: Vec<usize> = StagePart::split(model_cfg.n_layers, stages)?
        .iter()
        .map(|p| p.blocks.len())
        .collect();
    say(format!(
        "pipeline: {stages} stage(s) x {replicas} replica(s), blocks per stage {blocks:?}, \
         {m} micro-batches of {b} sequences, {:?} schedule{}",
        cfg.pipeline_schedule,
        if model_cfg.tie_word_embeddings && stages > 1 {
            "; the last stage holds a copy of the tied wte, its gradient summed with the first's"
        } else {
            ""
        }
    ))?;
    say(format!(
        "global batch: {} sequences = {m} micro-batches x {b} x {replicas} replica(s) ({tokens_per_step} tokens/step)",
        b * m * replicas
    ))?;
    let ops = schedule(cfg.pipeline_schedule, topo.stage, stages, m);
    let mut sampler = DistributedSampler::new(
        data.len(Split::Train),
        replicas,
        topo.replica,
        true,
        cfg.seed,
        false,
    )?;
    sampler.set_epoch(start.epoch);
    let mut samples = Samples {
        order: sampler.indices(),
        sampler,
        next: start.offset,
    };
    let reads = topo.first() || topo.last();
    let mut tokens = vec![vec![0u32; b * t]; m];
    let mut labels = vec![vec![0i32; b * t]; m];
    let mut pipe = Pipe {
        pg,
        topo,
        stage,
        inbox: Vec::new(),
        spare: Vec::new(),
        drop_key: (cfg.seed, 0, 0),
    };

    let mut outcome = Outcome::starting_at(start.step, data.loss_floor());
    let mut window = Phases::default();
    let (mut window_steps, mut window_loss) = (0u64, 0f32);
    let mut window_time = Duration::ZERO;
    let mut window_compute = Duration::ZERO;
    let mut timed_from = None;
    for step in start.step..cfg.steps {
        let t_step = Instant::now();
        let lr = schedule_lr.lr(step);
        if reads {
            window.time(Phase::Data, || {
                read_micro_batches(
                    &*data,
                    Split::Train,
                    || samples.next(),
                    &mut tokens,
                    &mut labels,
                )
            });
        }
        pipe.stage.set_training(true);
        pipe.drop_key = (cfg.seed, pipe.topo.replica as u64, step * m as u64);
        let mut times = RunTimes::default();
        let loss_sum = pipe.run(&ops, &tokens, &labels, b, t, &mut times)?;
        window.add(Phase::Forward, times.forward);
        window.add(Phase::Backward, times.backward);
        window.add(Phase::Comm, times.wait);
        window_compute += times.forward + times.backward;
        let t_opt = Instant::now();
        let comm = pipe.reduce_and_clip(m, cfg.grad_clip)?;
        window.add(Phase::Comm, comm);
        let (params, grads) = pipe.stage.params_and_grads_mut();
        opt.step(params, grads, lr)?;
        pipe.stage.zero_grad();
        window.add(Phase::Optimizer, t_opt.elapsed().saturating_sub(comm));
        window_time += t_step.elapsed();
        window_loss += loss_sum / m as f32;
        window_steps += 1;
        let done = step + 1;
        if timed_from.is_none() {
            timed_from = Some(Instant::now());
        }

        let t_log = Instant::now();
        if done % cfg.log_interval == 0 || done == cfg.steps {
            // The loss lives on the last stages; every rank learns the mean.
            let mut stats = [
                if pipe.topo.last() {
                    (window_loss / window_steps as f32) as f64 / replicas as f64
                } else {
                    0.0
                },
                1.0 - window_compute.as_secs_f64() / window_time.as_secs_f64().max(1e-9),
            ];
            pg.all_reduce(&mut stats, ReduceOp::Sum)
                .map_err(TrainError::comm("loss all_reduce"))?;
            let loss = stats[0] as f32;
            let bubble = stats[1] / pg.size() as f64;
            outcome.train_losses.push((done, loss));
            say(format!(
                "[step {done} / {}] loss = {loss:.4} | lr {lr:.2e} | {:.0} tok/s | idle {:.0}% | {}",
                cfg.steps,
                tokens_per_step * window_steps as f64 / window_time.as_secs_f64().max(1e-9),
                100.0 * bubble,
                window.per_step(window_steps),
            ))?;
            outcome.phases.merge(&window);
            window = Phases::default();
            (window_steps, window_loss) = (0, 0.0);
            (window_time, window_compute) = (Duration::ZERO, Duration::ZERO);
        }
        if (cfg.eval_interval > 0 && done % cfg.eval_interval == 0) || done == cfg.steps {
            let val = evaluate(cfg, &*data, &mut pipe, b, t)?;
            outcome.val_losses.push((done, val));
            let floor = data
                .loss_floor()
                .map(|f| format!(" (floor {f:.4})"))
                .unwrap_or_default();
            say(format!(
                "[step {done} / {}] val loss = {val:.4}{floor}",
                cfg.steps
            ))?;
        }
        let save_now = cfg.save_interval > 0 && done % cfg.save_interval == 0;
        if let (true, Some(out)) = (save_now || done == cfg.steps, &cfg.out) {
            if let Some((model, whole)) = pipe.gather_model(&opt, &model_cfg, cfg)? {
                // Rank 0 is stage 0 of replica 0: its position is replica 0's.
                let state = TrainState {
                    step: done,
                    epoch: samples.sampler.epoch(),
                    offset: samples.next,
                };
                let tokenizer = data.tokenizer_json();
                let notes = checkpoint::save_or_report(
                    out,
                    cfg,
                    replicas,
                    &model,
                    &whole,
                    &state,
                    tokenizer.as_deref(),
                );
                for line in notes {
                    say(format!("[step {done} / {}] {line}", cfg.steps))?;
                }
            }
        }
        window.add(Phase::Logging, t_log.elapsed());
        outcome.steps_run += 1;
        outcome.final_step = done;
    }
    outcome.phases.merge(&window);
    if let Some(t0) = timed_from {
        let secs = t0.elapsed().as_secs_f64();
        let timed = outcome.steps_run.saturating_sub(1);
        if timed > 0 && secs > 0.0 {
            outcome.tokens_per_s = tokens_per_step * timed as f64 / secs;
        }
    }
    outcome.params = pipe.gather_params()?;
    let last = |v: &[(u64, f32)]| {
        v.last()
            .map(|x| format!("{:.4}", x.1))
            .unwrap_or("-".into())
    };
    say(format!(
        "done: {} steps; train loss {}, val loss {}; {:.0} tokens/s on {} rank(s)",
        outcome.final_step,
        last(&outcome.train_losses),
        last(&outcome.val_losses),
        outcome.tokens_per_s,
        pg.size()
    ))?;
    let n = outcome.steps_run.max(1);
    say(format!(
        "time per step (rank 0, stage 0): {} | {}",
        outcome.phases.per_step(n),
        outcome.phases.shares()
    ))?;
    Ok(outcome)
}

/// Mean validation loss over `eval_batches` batches per replica, through the pipeline
/// (forwards only), averaged over replicas; known to every rank.
fn evaluate(
    cfg: &TrainConfig,
    data: &dyn Dataset,
    pipe: &mut Pipe,
    b: usize,
    t: usize,
) -> Result<f32, TrainError> {
    let n = data.len(Split::Val);
    if n == 0 || cfg.eval_batches == 0 {
        return Ok(f32::NAN);
    }
    let (replicas, replica) = (pipe.topo.replicas, pipe.topo.replica);
    let order = DistributedSampler::new(n, replicas, replica, false, cfg.seed, false)?.indices();
    let e = cfg.eval_batches;
    let mut tokens = vec![vec![0u32; b * t]; e];
    let mut labels = vec![vec![0i32; b * t]; e];
    if pipe.topo.first() || pipe.topo.last() {
        let mut k = 0;
        read_micro_batches(
            data,
            Split::Val,
            || {
                k += 1;
                order[(k - 1) % order.len()]
            },
            &mut tokens,
            &mut labels,
        );
    }
    // Forwards only; each slot is free again once its output is sent.
    let ops: Vec<Op> = (0..e).map(|m| Op::Forward { micro: m, slot: 0 }).collect();
    pipe.stage.set_training(false);
    let sum = pipe.run(&ops, &tokens, &labels, b, t, &mut RunTimes::default())?;
    pipe.stage.set_training(true);
    let mut mean = [if pipe.topo.last() {
        sum as f64 / e as f64 / replicas as f64
    } else {
        0.0
    }];
    pipe.pg
        .all_reduce(&mut mean, ReduceOp::Sum)
        .map_err(TrainError::comm("val loss all_reduce"))?;
    Ok(mean[0] as f32)
}

/// Flags of `cohort bench pipeline`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchPipelineArgs {
    /// Benchmark config: A (vocab 65, seq 64, 4x128) or B (seq 256, 6x384).
    #[arg(long, default_value = "B")]
    pub config: String,
    /// Pipeline stages (default: one per rank; ranks = stages x replicas).
    #[arg(long)]
    pub stages: Option<usize>,
    /// Sequences per step of each pipeline (default: the config's per-rank batch, 12 or 8,
    /// times the ranks: what `bench ddp` on as many ranks processes per step).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Micro-batches per step; must divide the batch.
    #[arg(long, default_value_t = 4)]
    pub micro_batches: usize,
    /// gpipe or 1f1b.
    #[arg(long, value_enum, default_value_t = PipelineSchedule::OneFOneB)]
    pub schedule: PipelineSchedule,
    /// Measured steps (default: 30 on A, 5 on B).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Unmeasured steps first.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Print one JSON object instead of a text line.
    #[arg(long)]
    pub json: bool,
}

/// What `cohort bench pipeline` measured (rank 0's view).
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchPipelineResult {
    /// Always `pipeline`.
    pub bench: &'static str,
    /// `A` or `B`.
    pub config: String,
    /// Ranks.
    pub world: usize,
    /// Stages per pipeline.
    pub stages: usize,
    /// Pipelines (data-parallel replicas).
    pub replicas: usize,
    /// `gpipe` or `1f1b`.
    pub schedule: PipelineSchedule,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Sequences per micro-batch.
    pub micro_batch_size: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The slowest rank's median step time, ms.
    pub ms_per_step: f64,
    /// Tokens per second of the whole job.
    pub tokens_per_s: f64,
    /// Mean over ranks of the share of the step a stage does not compute (1 - compute / step):
    /// the measured bubble, including the time spent copying and receiving messages.
    pub bubble_fraction: f64,
    /// Per rank: 1 - compute / step.
    pub bubble_per_rank: Vec<f64>,
    /// Per rank: the share of the step blocked in receives or waiting for sends.
    pub wait_fraction_per_rank: Vec<f64>,
    /// Per rank: median forward + backward compute per step, ms.
    pub compute_ms_per_rank: Vec<f64>,
    /// GPipe's idealised bubble for these stages and micro-batches, (S - 1) / (M + S - 1).
    pub ideal_bubble_fraction: f64,
    /// Rank 0's process CPU time per step (all its threads), ms.
    pub cpu_ms_per_step: f64,
    /// Measured steps.
    pub steps: usize,
}

/// Random token ids of micro-batch `micro` of `step` on `replica` (seed 000's data).
fn random_tokens(vocab: usize, out: &mut [u32], replica: usize, step: usize, micro: usize) {
    let mut s = ((replica as u64) << 40) ^ ((step as u64) << 20) ^ micro as u64 ^ 0x5eed;
    for x in out {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *x = ((s >> 33) % vocab as u64) as u32;
    }
}

/// Runs the pipeline benchmark as a rank of `pg`; rank 0 writes the result to `out`.
pub fn run_pipeline_bench(
    args: &BenchPipelineArgs,
    pg: &ProcessGroup,
    out: &mut dyn Write,
) -> Result<BenchPipelineResult, TrainError> {
    let (cfg, per_rank, default_steps) = match args.config.as_str() {
        "A" | "a" => (cohort_gpt::GPTConfig::config_a(), 12, 30),
        "B" | "b" => (cohort_gpt::GPTConfig::config_b(), 8, 5),
        other => return Err(invalid("config", other.to_string(), "must be A or B")),
    };
    let world = pg.size();
    let stages = stage_count(args.stages.unwrap_or(0), world, cfg.n_layers)?;
    let batch = args.batch.unwrap_or(per_rank * world);
    let m = args.micro_batches;
    if m == 0 || !batch.is_multiple_of(m) {
        return Err(invalid(
            "micro_batches",
            m.to_string(),
            "must be at least 1 and divide the batch",
        ));
    }
    let (b, t) = (batch / m, cfg.max_position_embeddings);
    let steps = args.steps.unwrap_or(default_steps).max(1);
    let topo = Topology::new(pg, stages, cfg.tie_word_embeddings)?;
    let part = StagePart::split(cfg.n_layers, stages)?.swap_remove(topo.stage);
    let stage = GptStage::new(cfg.clone(), 1234, part)?;
    let mut opt = AdamW::new(AdamWConfig::default(), decay_mask(stage.param_views()))?;
    let ops = schedule(args.schedule, topo.stage, stages, m);
    let replica = topo.replica;
    let mut tokens = vec![vec![0u32; b * t]; m];
    let mut labels = vec![vec![0i32; b * t]; m];
    let mut pipe = Pipe {
        pg,
        topo,
        stage,
        inbox: Vec::new(),
        spare: Vec::new(),
        drop_key: (1234, 0, 0),
    };
    let (mut step_s, mut compute_s, mut wait_s) = (vec![], vec![], vec![]);
    let mut cpu0 = 0.0;
    for i in 0..args.warmup + steps {
        if i == args.warmup {
            pg.barrier()
                .map_err(TrainError::comm("barrier before the timed steps"))?;
            cpu0 = cohort_gpt::bench::process_cpu_ms();
        }
        let t0 = Instant::now();
        for (k, (tok, lab)) in tokens.iter_mut().zip(labels.iter_mut()).enumerate() {
            random_tokens(cfg.vocab_size, tok, replica, i, k);
            lab.iter_mut()
                .zip(tok.iter())
                .for_each(|(l, &x)| *l = x as i32);
        }
        let mut times = RunTimes::default();
        pipe.run(&ops, &tokens, &labels, b, t, &mut times)?;
        let comm = pipe.reduce_and_clip(m, 0.0)?;
        let (params, grads) = pipe.stage.params_and_grads_mut();
        opt.step(params, grads, 1e-3)?;
        pipe.stage.zero_grad();
        if i >= args.warmup {
            step_s.push(t0.elapsed().as_secs_f64());
            compute_s.push((times.forward + times.backward).as_secs_f64());
            wait_s.push((times.wait + comm).as_secs_f64());
        }
    }
    let cpu_ms = (cohort_gpt::bench::process_cpu_ms() - cpu0) / steps as f64;
    let sum = |v: &[f64]| v.iter().sum::<f64>();
    let mut med = step_s.clone();
    med.sort_by(f64::total_cmp);
    let mut cmed = compute_s.clone();
    cmed.sort_by(f64::total_cmp);
    let mine = [
        med[med.len() / 2],
        1.0 - sum(&compute_s) / sum(&step_s),
        sum(&wait_s) / sum(&step_s),
        cmed[cmed.len() / 2],
    ];
    let mut all = vec![0f64; 4 * world];
    pg.all_gather(&mine, &mut all)
        .map_err(TrainError::comm("gathering the timings"))?;
    let col = |j: usize| -> Vec<f64> { all.chunks(4).map(|r| r[j]).collect() };
    let slowest = col(0).into_iter().fold(0.0, f64::max);
    let bubbles = col(1);
    let replicas = world / stages;
    let result = BenchPipelineResult {
        bench: "pipeline",
        config: args.config.to_uppercase(),
        world,
        stages,
        replicas,
        schedule: args.schedule,
        micro_batches: m,
        micro_batch_size: b,
        seq: t,
        ms_per_step: slowest * 1e3,
        tokens_per_s: (replicas * batch * t) as f64 / slowest,
        bubble_fraction: sum(&bubbles) / world as f64,
        bubble_per_rank: bubbles,
        wait_fraction_per_rank: col(2),
        compute_ms_per_rank: col(3).iter().map(|x| x * 1e3).collect(),
        ideal_bubble_fraction: (stages - 1) as f64 / (m + stages - 1) as f64,
        cpu_ms_per_step: cpu_ms,
        steps,
    };
    if pg.rank() == 0 {
        let line = if args.json {
            serde_json::to_string(&result).unwrap_or_default()
        } else {
            format!(
                "config {}, {} stage(s) x {} replica(s), {:?}, {} micro-batches of {}: \
                 ms_per_step {:.1}, tokens_per_s {:.0}, bubble {:.3} (per rank {:?}, ideal {:.3}), \
                 wait share per rank {:?}, compute ms per rank {:?}",
                result.config,
                stages,
                replicas,
                args.schedule,
                m,
                b,
                result.ms_per_step,
                result.tokens_per_s,
                result.bubble_fraction,
                result
                    .bubble_per_rank
                    .iter()
                    .map(|x| (x * 1e3).round() / 1e3)
                    .collect::<Vec<_>>(),
                result.ideal_bubble_fraction,
                result
                    .wait_fraction_per_rank
                    .iter()
                    .map(|x| (x * 1e3).round() / 1e3)
                    .collect::<Vec<_>>(),
                result
                    .compute_ms_per_rank
                    .iter()
                    .map(|x| x.round())
                    .collect::<Vec<_>>(),
            )
        };
        writeln!(out, "{line}").map_err(TrainError::Log)?;
    }
    Ok(result)
}

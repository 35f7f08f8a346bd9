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
//! the same optimizer step and stay equal. The one training loop does the rest, as for DDP: a
//! NaN/Inf on any stage skips the step on every stage, and clipping uses the norm over all
//! stages (counting wte once).
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
use cohort_engine::optim::{AdamW, AdamWConfig, Optimizer};
use cohort_gpt::optim_groups::decay_mask;
use cohort_gpt::{GPTConfig, GptStage, StagePart, GPT};

use crate::checkpoint::{self, SaveReport, TrainState};
use crate::config::{PipelineSchedule, TrainConfig};
use crate::error::{ConfigError, TrainError};
use crate::input::{val_rows, val_share};
use crate::phases::{Phase, Phases};
use crate::replica::model_config;
use crate::step_loop::{self, Outcome, ParallelStrategy, Start, StepGradients};
use cohort_data::{Dataset, Split};

mod pipe;
mod schedule;

use pipe::{adamw_state, Pipe, RunTimes, Topology};
use schedule::{schedule, Op};

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

/// Reads `tokens.len()` micro-batches of `b` rows from `split` at `index(..)`: each sample's
/// `seq_len + 1` tokens become a row of inputs and, one place on, its next-token targets.
fn read_micro_batches(
    data: &dyn Dataset,
    split: Split,
    mut index: impl FnMut() -> usize,
    tokens: &mut [Vec<u32>],
    targets: &mut [Vec<i32>],
) {
    let t = data.seq_len();
    let mut sample = vec![0u32; t + 1];
    for (tok, tgt) in tokens.iter_mut().zip(targets.iter_mut()) {
        for (row, next) in tok.chunks_mut(t).zip(tgt.chunks_mut(t)) {
            data.read(split, index(), &mut sample);
            row.copy_from_slice(&sample[..t]);
            next.iter_mut()
                .zip(&sample[1..])
                .for_each(|(y, &x)| *y = x as i32);
        }
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
    let mut strategy = Pipeline::new(cfg, pg)?;
    step_loop::run(cfg, &mut strategy, log, 1)
}

/// This rank's stage of a pipeline, as a strategy of the one training loop.
struct Pipeline<'a> {
    cfg: &'a TrainConfig,
    data: Box<dyn Dataset>,
    model_cfg: GPTConfig,
    pipe: Pipe<'a>,
    opt: AdamW,
    ops: Vec<Op>,
    samples: Samples,
    /// This step's micro-batches (read on the first and last stage only).
    tokens: Vec<Vec<u32>>,
    labels: Vec<Vec<i32>>,
    start: Start,
    /// Since the last log line: the steps' time, and the part spent computing.
    step_started: Instant,
    window_time: Duration,
    window_compute: Duration,
}

impl<'a> Pipeline<'a> {
    fn new(cfg: &'a TrainConfig, pg: &'a ProcessGroup) -> Result<Self, TrainError> {
        if cfg.grad_accum != 1 {
            return Err(invalid(
                "grad_accum",
                cfg.grad_accum.to_string(),
                "must be 1 with --strategy pipeline (use micro_batches)",
            ));
        }
        let data = crate::input::build(cfg, pg)?;
        if data.variable_length() {
            return Err(invalid(
                "data",
                cfg.data.clone(),
                "--strategy pipeline needs fixed-length sequences (documents of different lengths \
                 are not supported yet)",
            ));
        }
        let (b, t, m) = (cfg.batch_size, data.seq_len(), cfg.micro_batches);
        let model_cfg = model_config(cfg, data.vocab_size())?;
        let stages = stage_count(cfg.stages, pg.size(), model_cfg.n_layers)?;
        let topo = Topology::new(pg, stages, model_cfg.tie_word_embeddings)?;
        let part = StagePart::split(model_cfg.n_layers, stages)?.swap_remove(topo.stage);
        let mut stage = GptStage::new(model_cfg.clone(), cfg.seed, part)?;
        let mut opt = optimizer(cfg, &stage)?;
        let replicas = topo.replicas;
        let mut header = Vec::new();
        header.extend(crate::replica::apply_precision(cfg, |d| {
            stage.set_precision(d)
        })?);
        let mut start = TrainState::default();
        if let Some(dir) = &cfg.resume {
            let resumed = resume_stage(dir, cfg, pg, replicas, &model_cfg, &mut stage, &mut opt)?;
            header.extend(resumed.notes);
            header.push(format!(
                "resumed from {} at step {}",
                resumed.dir.display(),
                resumed.state.step
            ));
            start = resumed.state;
        }
        header.extend(crate::input::data_lines(&*data));
        let blocks: Vec<usize> = StagePart::split(model_cfg.n_layers, stages)?
            .iter()
            .map(|p| p.blocks.len())
            .collect();
        header.push(format!(
            "pipeline: {stages} stage(s) x {replicas} replica(s), blocks per stage {blocks:?}, \
             {m} micro-batches of {b} sequences, {} schedule{}",
            cfg.pipeline_schedule,
            if model_cfg.tie_word_embeddings && stages > 1 {
                "; the last stage holds a copy of the tied wte, its gradient summed with the first's"
            } else {
                ""
            }
        ));
        header.push(format!(
            "global batch: {} sequences = {m} micro-batches x {b} x {replicas} replica(s) ({} tokens/step)",
            b * m * replicas,
            b * t * m * replicas
        ));
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
        let samples = Samples {
            order: sampler.indices(),
            sampler,
            next: start.offset,
        };
        Ok(Pipeline {
            cfg,
            model_cfg,
            pipe: Pipe::new(pg, topo, stage, cfg.seed),
            opt,
            ops,
            samples,
            tokens: vec![vec![0u32; b * t]; m],
            labels: vec![vec![0i32; b * t]; m],
            start: Start {
                step: start.step,
                header,
                loss_floor: data.loss_floor(),
            },
            data,
            step_started: Instant::now(),
            window_time: Duration::ZERO,
            window_compute: Duration::ZERO,
        })
    }
}

impl ParallelStrategy for Pipeline<'_> {
    fn group(&self) -> &ProcessGroup {
        self.pipe.pg
    }

    fn start(&self) -> Start {
        self.start.clone()
    }

    fn gradients(&mut self, step: u64, phases: &mut Phases) -> Result<StepGradients, TrainError> {
        self.step_started = Instant::now();
        let (b, t, m) = (
            self.cfg.batch_size,
            self.data.seq_len(),
            self.cfg.micro_batches,
        );
        let topo = &self.pipe.topo;
        if topo.first() || topo.last() {
            let (data, samples) = (&*self.data, &mut self.samples);
            let (tokens, labels) = (&mut self.tokens, &mut self.labels);
            phases.time(Phase::Data, || {
                read_micro_batches(data, Split::Train, || samples.next(), tokens, labels)
            });
        }
        self.pipe.stage.set_training(true);
        self.pipe.drop_key = (
            self.cfg.seed,
            self.pipe.topo.replica as u64,
            step * m as u64,
        );
        let mut times = RunTimes::default();
        let loss_sum = self
            .pipe
            .run(&self.ops, &self.tokens, &self.labels, b, t, &mut times)?;
        phases.add(Phase::Forward, times.forward);
        phases.add(Phase::Backward, times.backward);
        phases.add(Phase::Comm, times.wait);
        self.window_compute += times.forward + times.backward;
        phases.add(Phase::Comm, self.pipe.reduce_grads()?);
        // The loss lives on the last stages, one per replica.
        let last = self.pipe.topo.last();
        let replicas = self.pipe.topo.replicas as f64;
        Ok(StepGradients {
            loss_share: if last {
                loss_sum as f64 / m as f64 / replicas
            } else {
                0.0
            },
            loss_finite: loss_sum.is_finite(),
            tokens: if last { (b * t * m) as f64 } else { 0.0 },
            micro_batches: m,
        })
    }

    fn grads_mut(&mut self) -> &mut [f32] {
        self.pipe.stage.grads_mut()
    }

    fn global_norm(&mut self, local: f32) -> Result<f32, TrainError> {
        self.pipe.global_norm(local)
    }

    fn apply(&mut self, _step: u64, lr: Option<f64>) -> Result<(), TrainError> {
        if let Some(lr) = lr {
            let (params, grads) = self.pipe.stage.params_and_grads_mut();
            self.opt.step(params, grads, lr)?;
        }
        self.pipe.stage.zero_grad();
        self.window_time += self.step_started.elapsed();
        Ok(())
    }

    fn log_note(&mut self) -> Result<String, TrainError> {
        let pg = self.pipe.pg;
        let mut idle =
            [1.0 - self.window_compute.as_secs_f64() / self.window_time.as_secs_f64().max(1e-9)];
        pg.all_reduce(&mut idle, ReduceOp::Sum)
            .map_err(TrainError::comm("idle time all_reduce"))?;
        (self.window_time, self.window_compute) = (Duration::ZERO, Duration::ZERO);
        Ok(format!(
            " | idle {:.0}%",
            100.0 * idle[0] / pg.size() as f64
        ))
    }

    fn evaluate(&mut self) -> Result<f32, TrainError> {
        let (b, t) = (self.cfg.batch_size, self.data.seq_len());
        evaluate(self.cfg, &*self.data, &mut self.pipe, b, t)
    }

    fn save(
        &mut self,
        out: &std::path::Path,
        step: u64,
        saver: &mut checkpoint::Saver,
    ) -> Result<SaveReport, TrainError> {
        let Some((model, whole)) = self
            .pipe
            .gather_model(&self.opt, &self.model_cfg, self.cfg)?
        else {
            return Ok(SaveReport::default());
        };
        // Rank 0 is stage 0 of replica 0: its position is replica 0's.
        let state = TrainState {
            step,
            epoch: self.samples.sampler.epoch(),
            offset: self.samples.next,
        };
        let tokenizer = self.data.tokenizer_json();
        Ok(saver.save_whole(
            out,
            self.cfg,
            self.pipe.topo.replicas,
            &model,
            &whole,
            &state,
            tokenizer.as_deref(),
        ))
    }

    fn final_params(&mut self) -> Result<Vec<f32>, TrainError> {
        self.pipe.gather_params()
    }

    fn who(&self) -> String {
        format!("{} rank(s)", self.pipe.pg.size())
    }
}

/// One rank of a pipeline driven step by step from outside the training loop (a benchmark):
/// the same stage, schedule and point-to-point pipe as `train_pipeline`, without data, logs,
/// skips or checkpoints. Built collectively by every rank of the group.
pub struct PipelineRank<'pg> {
    pipe: Pipe<'pg>,
    opt: AdamW,
    ops: Vec<Op>,
    micro_batches: usize,
    micro_batch_size: usize,
}

/// Where the time of one [`PipelineRank::step`] went on this rank.
#[derive(Debug, Clone, Copy, Default)]
pub struct PipelineStepTimes {
    /// Computing forwards.
    pub forward: Duration,
    /// Computing backwards.
    pub backward: Duration,
    /// Blocked on a neighbour stage (receiving, or its sends being taken).
    pub wait: Duration,
    /// Reducing gradients across replicas and the tied embedding.
    pub reduce: Duration,
}

impl<'pg> PipelineRank<'pg> {
    /// Splits `model` into `stages` stages over the ranks of `pg` (0: one per rank; the other
    /// ranks form data-parallel replicas), each step being `micro_batches` micro-batches of
    /// `micro_batch_size` sequences run by `schedule`; parameters drawn from `seed`, AdamW's
    /// defaults. Collective.
    pub fn new(
        pg: &'pg ProcessGroup,
        model: GPTConfig,
        stages: usize,
        schedule: PipelineSchedule,
        micro_batches: usize,
        micro_batch_size: usize,
        seed: u64,
    ) -> Result<Self, TrainError> {
        let stages = stage_count(stages, pg.size(), model.n_layers)?;
        if micro_batches == 0 || micro_batch_size == 0 {
            return Err(invalid(
                "micro_batches",
                format!("{micro_batches} of {micro_batch_size}"),
                "needs at least one micro-batch of at least one sequence",
            ));
        }
        let topo = Topology::new(pg, stages, model.tie_word_embeddings)?;
        let part = StagePart::split(model.n_layers, stages)?.swap_remove(topo.stage);
        let stage = GptStage::new(model, seed, part)?;
        let opt = AdamW::new(AdamWConfig::default(), decay_mask(stage.param_views()))?;
        let ops = self::schedule::schedule(schedule, topo.stage, stages, micro_batches);
        Ok(PipelineRank {
            pipe: Pipe::new(pg, topo, stage, seed),
            opt,
            ops,
            micro_batches,
            micro_batch_size,
        })
    }

    /// Stages per pipeline.
    pub fn stages(&self) -> usize {
        self.pipe.topo.stages
    }

    /// Pipelines (data-parallel replicas).
    pub fn replicas(&self) -> usize {
        self.pipe.topo.replicas
    }

    /// This rank's pipeline.
    pub fn replica(&self) -> usize {
        self.pipe.topo.replica
    }

    /// One training step on this replica's micro-batches (`tokens[k]` and `labels[k]` hold
    /// micro-batch k, `micro_batch_size x seq` row-major; only the first and last stage read
    /// them): the schedule's forwards and backwards, the gradient reduction, the mean over
    /// micro-batches and an AdamW step at `lr`. Collective. Returns where the time went.
    pub fn step(
        &mut self,
        tokens: &[Vec<u32>],
        labels: &[Vec<i32>],
        lr: f64,
    ) -> Result<PipelineStepTimes, TrainError> {
        let m = self.micro_batches;
        let b = self.micro_batch_size;
        if tokens.len() != m || labels.len() != m {
            return Err(invalid(
                "micro_batches",
                format!(
                    "{} token and {} label micro-batches",
                    tokens.len(),
                    labels.len()
                ),
                "must match the pipeline's micro_batches",
            ));
        }
        let t = tokens[0].len() / b;
        let mut times = RunTimes::default();
        self.pipe.run(&self.ops, tokens, labels, b, t, &mut times)?;
        let reduce = self.pipe.reduce_grads()?;
        let inv = 1.0 / m as f32;
        let grads = self.pipe.stage.grads_mut();
        grads.iter_mut().for_each(|g| *g *= inv);
        let (params, grads) = self.pipe.stage.params_and_grads_mut();
        self.opt.step(params, grads, lr)?;
        self.pipe.stage.zero_grad();
        Ok(PipelineStepTimes {
            forward: times.forward,
            backward: times.backward,
            wait: times.wait,
            reduce,
        })
    }
}

/// The validation loss over the job's `eval_batches` batches (the list every strategy uses,
/// whatever the world size), through the pipeline (forwards only), the batches shared out
/// among the replicas; known to every rank.
fn evaluate(
    cfg: &TrainConfig,
    data: &dyn Dataset,
    pipe: &mut Pipe,
    b: usize,
    t: usize,
) -> Result<f32, TrainError> {
    let n = data.len(Split::Val);
    let total = if n == 0 { 0 } else { cfg.eval_batches };
    let (replicas, replica) = (pipe.topo.replicas, pipe.topo.replica);
    let mine = val_share(total, replicas, replica);
    let e = mine.len();
    let mut tokens = vec![vec![0u32; b * t]; e];
    let mut labels = vec![vec![0i32; b * t]; e];
    if pipe.topo.first() || pipe.topo.last() {
        let mut rows = mine.iter().flat_map(|&k| val_rows(k, b, n));
        read_micro_batches(
            data,
            Split::Val,
            || rows.next().expect("b rows per batch"),
            &mut tokens,
            &mut labels,
        );
    }
    // Forwards only; each slot is free again once its output is sent.
    let ops: Vec<Op> = (0..e).map(|m| Op::Forward { micro: m, slot: 0 }).collect();
    pipe.stage.set_training(false);
    pipe.run(&ops, &tokens, &labels, b, t, &mut RunTimes::default())?;
    pipe.stage.set_training(true);
    // Only the last stages saw losses.
    let losses: Vec<(usize, f32)> = pipe.losses.iter().map(|&(m, l)| (mine[m], l)).collect();
    step_loop::mean_val_loss(Some(pipe.pg), total, &losses)
}

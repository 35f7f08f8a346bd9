//! Where each stage and replica sits among the ranks, and the pipe between neighbouring stages:
//! activations forward, their gradients backward, tagged by micro-batch, timed per phase. It
//! never decides the order of the micro-batches: the schedule does.

use std::time::{Duration, Instant};

use cohort_comm::{ProcessGroup, ReduceOp};
use cohort_engine::optim::{AdamW, Optimizer, OptimizerState};
use cohort_gpt::optim_groups::decay_mask;
use cohort_gpt::{GPTConfig, GptStage, Labels, StageInput, StageOutput, GPT};

use super::schedule::Op;
use crate::config::TrainConfig;
use crate::error::TrainError;

/// Where this rank sits: its stage and replica, its neighbours, and the groups it reduces in.
pub(super) struct Topology {
    pub(super) stages: usize,
    pub(super) replicas: usize,
    pub(super) stage: usize,
    pub(super) replica: usize,
    /// The first and last stage of this replica (tied embeddings), when this rank is one of them.
    pub(super) tied: Option<ProcessGroup>,
    /// This stage's ranks across replicas, when there are several.
    pub(super) dp: Option<ProcessGroup>,
}

impl Topology {
    /// Collective: every rank builds the same groups in the same order.
    pub(super) fn new(
        pg: &ProcessGroup,
        stages: usize,
        tied: bool,
    ) -> Result<Topology, TrainError> {
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

    pub(super) fn first(&self) -> bool {
        self.stage == 0
    }
    pub(super) fn last(&self) -> bool {
        self.stage + 1 == self.stages
    }
    pub(super) fn rank_of(&self, stage: usize) -> usize {
        self.replica * self.stages + stage
    }
}

/// Tag of micro-batch `m`'s activations (forward) or their gradient (backward).
pub(super) fn tag(m: usize, backward: bool) -> u32 {
    (2 * m + usize::from(backward)) as u32
}

/// Times of one run of a schedule on this rank.
#[derive(Default, Clone, Copy)]
pub(super) struct RunTimes {
    pub(super) forward: Duration,
    pub(super) backward: Duration,
    /// Blocked receiving, or waiting for sends to be taken at the end.
    pub(super) wait: Duration,
}

/// One stage of one pipeline, with its buffers for the messages in flight.
pub(super) struct Pipe<'p> {
    pub(super) pg: &'p ProcessGroup,
    pub(super) topo: Topology,
    pub(super) stage: GptStage,
    /// Receive buffer (B, T, C).
    pub(super) inbox: Vec<f32>,
    /// Send buffers handed back by finished sends.
    pub(super) spare: Vec<Vec<f32>>,
    /// Dropout keys: (seed, rank, step * micro_batches); micro-batch m adds m, as one process
    /// accumulating the micro-batches would.
    pub(super) drop_key: (u64, u64, u64),
    /// On the last stage, each micro-batch's loss in the last run, as (micro-batch, loss).
    pub(super) losses: Vec<(usize, f32)>,
}

impl<'p> Pipe<'p> {
    /// The pipe of `stage`, placed at `topo` among the ranks of `pg`, its dropout keyed by `seed`.
    pub(super) fn new(pg: &'p ProcessGroup, topo: Topology, stage: GptStage, seed: u64) -> Self {
        Pipe {
            pg,
            topo,
            stage,
            inbox: Vec::new(),
            spare: Vec::new(),
            drop_key: (seed, 0, 0),
            losses: Vec::new(),
        }
    }
}

impl Pipe<'_> {
    pub(super) fn recv(&mut self, stage: usize, tag: u32, len: usize) -> Result<(), TrainError> {
        self.inbox.resize(len, 0.0);
        self.pg
            .recv(&mut self.inbox, self.topo.rank_of(stage), tag)
            .map_err(TrainError::comm("pipeline receive"))
    }

    /// Runs `ops` on micro-batches (`tokens[m]`, `labels[m]`; only the first stage reads the
    /// tokens and only the last the labels, next-token targets). Returns the sum of the last stage's losses.
    pub(super) fn run(
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
        self.losses.clear();
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
                    let lab = last.then(|| Labels::Next(&labels[micro][..]));
                    let (seed, rank, base) = self.drop_key;
                    self.stage.set_dropout_key(seed, rank, base + micro as u64);
                    let t0 = Instant::now();
                    let out = self.stage.forward(slot, input, None, lab, b, t)?;
                    times.forward += t0.elapsed();
                    match out {
                        StageOutput::Loss(l) => {
                            let l = l.unwrap_or(0.0);
                            loss_sum += l;
                            self.losses.push((micro, l));
                        }
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

    /// After backward: averages this stage's gradients over its replicas and sums the tied wte
    /// gradient of the first and last stage. Returns the time spent communicating.
    pub(super) fn reduce_grads(&mut self) -> Result<Duration, TrainError> {
        let t0 = Instant::now();
        if let Some(dp) = &self.topo.dp {
            dp.all_reduce(self.stage.grads_mut(), ReduceOp::Avg)
                .map_err(TrainError::comm("pipeline data-parallel all_reduce"))?;
        }
        if let (Some(g), Some(r)) = (&self.topo.tied, self.stage.tied_range()) {
            g.all_reduce(&mut self.stage.grads_mut()[r], ReduceOp::Sum)
                .map_err(TrainError::comm("tied embedding gradient all_reduce"))?;
        }
        Ok(t0.elapsed())
    }

    /// The whole model's gradient norm from this stage's (`local`, over its whole buffer):
    /// the stages' squares summed, a tied wte copy counted once, every replica having counted
    /// the same averaged gradients. Collective over all ranks.
    pub(super) fn global_norm(&self, local: f32) -> Result<f32, TrainError> {
        let copy = self
            .stage
            .holds_tied_copy()
            .then(|| self.stage.tied_range())
            .flatten()
            .unwrap_or(0..0);
        let copy_sq: f64 = self.stage.grads()[copy]
            .iter()
            .map(|&g| g as f64 * g as f64)
            .sum();
        let mut sq = [(local as f64 * local as f64 - copy_sq).max(0.0)];
        self.pg
            .all_reduce(&mut sq, ReduceOp::Sum)
            .map_err(TrainError::comm("gradient norm all_reduce"))?;
        Ok((sq[0] / self.topo.replicas as f64).sqrt() as f32)
    }

    /// The whole model's parameters, assembled from replica 0's stages, on every rank.
    pub(super) fn gather_params(&self) -> Result<Vec<f32>, TrainError> {
        self.gather(self.stage.params(), "gathering the parameters")
    }

    /// A whole-model buffer assembled from replica 0's stages' `local` buffers (laid out as
    /// their parameters), on every rank. Collective.
    pub(super) fn gather(&self, local: &[f32], what: &'static str) -> Result<Vec<f32>, TrainError> {
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
    pub(super) fn gather_model(
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

/// AdamW's state after `step` steps, from its two moment buffers.
pub(super) fn adamw_state<'a>(
    step: u64,
    exp_avg: &'a [f32],
    exp_avg_sq: &'a [f32],
) -> OptimizerState<'a> {
    OptimizerState {
        optimizer: "adamw".to_string(),
        step,
        buffers: vec![
            ("exp_avg".to_string(), exp_avg),
            ("exp_avg_sq".to_string(), exp_avg_sq),
        ],
    }
}

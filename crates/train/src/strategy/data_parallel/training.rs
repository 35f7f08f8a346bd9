//! Data-parallel training as a strategy of the one training loop: the run's
//! data, the model replica and its gradient sync ([`DataParallel`]) built
//! from the config (resumed from any checkpoint), the rank's batches, and
//! the saves (DDP's whole checkpoint by rank 0, or every rank's shard). One
//! type for DDP, every ZeRO stage and DiLoCo: what differs is the [`GradSync`]
//! value. It never decides when to log, evaluate or save: the loop does.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use cohort_comm::ProcessGroup;
use cohort_data::Dataset;
use cohort_ddp::{Compression, DdpOptions};
use cohort_engine::optim::AdamW;
use cohort_engine::{Backend, ViewMut};
use cohort_gpt::optim_groups::decay_mask;
use cohort_gpt::GPT;

use super::diloco::{self, DilocoTarget, Outer, OuterConfig};
use super::link;
use super::sharded::{ShardedDp, ZeroStage};
use super::staged::{self, StagedDdp, StagedZero1};
use super::step::{DataParallel, GradSync};
use super::zero1::Zero1;
use crate::checkpoint::{self, OwnedShard, SaveReport, Saver, ShardTarget, TrainState};
use crate::config::TrainConfig;
use crate::device_comm::DeviceSync;
use crate::error::TrainError;
use crate::input::{val_batches, TrainBatches, ValBatches};
use crate::memory::Sharding;
use crate::phases::Phases;
use crate::replica::{
    global_batch_line, memory_line, replicated_start, resume_replica, resume_shard, save_replica,
    save_shard, share_rank0_params, ReplicatedStart,
};
use crate::step_loop::{self, Outcome, ParallelStrategy, Start, StepGradients};

/// Which gradient sync a data-parallel run uses (`--strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SyncKind {
    /// DDP.
    Ddp,
    /// ZeRO stage 1.
    Zero1,
    /// ZeRO stage 2 or 3.
    Sharded(ZeroStage),
    /// DiLoCo or local SGD (no gradient sync; an outer step every H steps).
    Diloco,
}

impl SyncKind {
    /// The memory accounting's name for the sync over `world` ranks.
    fn sharding(self, world: usize) -> Sharding {
        match self {
            SyncKind::Ddp | SyncKind::Diloco => Sharding::Replicated,
            SyncKind::Zero1 => Sharding::Zero1 { world },
            SyncKind::Sharded(ZeroStage::Two) => Sharding::Zero2 { world },
            SyncKind::Sharded(ZeroStage::Three) => Sharding::Zero3 { world },
        }
    }
}

/// Trains as configured, data parallel with the gradient sync `kind`, as
/// rank `pg.rank()` of `pg.size()`; rank 0 writes the log to `log`.
/// Collective: every rank must call it with the same config.
pub(crate) fn train(
    cfg: &TrainConfig,
    pg: &ProcessGroup,
    log: &mut dyn Write,
    kind: SyncKind,
) -> Result<Outcome, TrainError> {
    cfg.validate()?;
    let mut run = DataParallelRun::new(cfg, pg, kind)?;
    step_loop::run(cfg, &mut run, log, 1)
}

/// Data parallelism as a strategy of the training loop: every rank trains
/// its replica on its own shard of the data.
struct DataParallelRun<'a> {
    cfg: &'a TrainConfig,
    data: Arc<dyn Dataset>,
    step: DataParallel<'a>,
    batches: TrainBatches,
    /// This rank's share of the job's validation batches.
    val: ValBatches,
    start: Start,
    /// DiLoCo: the outer syncs so far in this process and their all-reduces' time.
    outer_syncs: (u64, std::time::Duration),
}

impl<'a> DataParallelRun<'a> {
    fn new(cfg: &'a TrainConfig, pg: &'a ProcessGroup, kind: SyncKind) -> Result<Self, TrainError> {
        let (rank, world) = (pg.rank(), pg.size());
        let sharding = kind.sharding(world);
        let ReplicatedStart {
            data,
            mut model,
            mut header,
        } = replicated_start(cfg, pg, sharding)?;
        let t = data.seq_len();
        let threads = model.backend().num_threads();
        let sharded = matches!(kind, SyncKind::Zero1 | SyncKind::Sharded(_));
        header.extend(link::hierarchy_line(pg, sharded));
        // DiLoCo sends no gradients (its pseudo-gradients' dtype is a flag).
        let compression = match kind {
            SyncKind::Diloco => Compression::None,
            _ => {
                let choice = link::choose(cfg.compression(), pg, model.num_params())?;
                header.extend(choice.line);
                choice.compression
            }
        };
        let overlap = match kind {
            SyncKind::Zero1 | SyncKind::Diloco => false,
            _ => cfg.overlap.enabled(world, pg.local_world_size(), threads),
        };
        let nice = match kind {
            SyncKind::Ddp if overlap => link::reducer_nice(threads, pg.local_world_size())?,
            _ => 0,
        };
        let wire = (overlap, compression, nice);
        let built = build_sync(cfg, pg, kind, wire, &mut model, &mut header);
        let (sync, state) = built?;
        header.push(model_line(cfg, &data, &model, &sync, world, overlap));
        header.extend(staged::gradients_line(&sync, world, overlap, compression));
        header.push(memory_line(cfg, &model, t, sharding));
        header.push(global_batch_line(cfg, world, t));
        let batches = TrainBatches::new(data.clone(), cfg, world, rank, state.epoch, state.offset)?;
        let val = val_batches(&data, cfg, world, rank, cfg.eval_batches)?;
        Ok(DataParallelRun {
            cfg,
            step: DataParallel::new(pg, model, sync),
            batches,
            val,
            start: Start {
                step: state.step,
                header,
                loss_floor: data.loss_floor(),
            },
            data,
            outer_syncs: Default::default(),
        })
    }
}

/// The gradient sync `kind` over `model` (rank 0's parameters made every
/// rank's), its collectives overlapping the model's work when `overlap`,
/// its gradients travelling as `compression` says (DDP's reducer thread
/// `reducer_nice` steps below backward's), resumed from `cfg.resume` when set (any checkpoint: a sharded
/// sync reads only its own shard), noting it in `header`. Returns where the
/// run starts. Collective.
fn build_sync<'a>(
    cfg: &TrainConfig,
    pg: &'a ProcessGroup,
    kind: SyncKind,
    (overlap, compression, reducer_nice): (bool, Compression, u8),
    model: &mut GPT,
    header: &mut Vec<String>,
) -> Result<(GradSync<'a>, TrainState), TrainError> {
    if cfg.device.is_device() {
        return build_device(cfg, pg, kind, (overlap, compression), model, header);
    }
    if kind == SyncKind::Ddp {
        // Every rank resumes the whole state; DDP checks that the shapes
        // agree and broadcasts rank 0's parameters to the others.
        let mut opt = AdamW::new(cfg.adamw(), decay_mask(model.param_views()))?;
        let state = resume_replica(cfg, pg, model, &mut opt, header)?;
        let options = DdpOptions {
            bucket_cap_mb: cfg.bucket_cap_mb,
            overlap,
            compression,
            reducer_nice,
            ..DdpOptions::default()
        };
        return Ok((GradSync::ddp(pg, model, opt, options)?, state));
    }
    share_rank0_params(pg, model)?;
    if kind == SyncKind::Diloco {
        return build_diloco(cfg, pg, model, header);
    }
    let sync = match kind {
        SyncKind::Sharded(stage) => {
            let mut zero = ShardedDp::new(pg, model, stage, cfg.adamw())?;
            zero.set_compression(compression);
            zero.set_overlap(overlap);
            GradSync::Sharded(Box::new(zero))
        }
        _ => {
            let full_mask = decay_mask(model.param_views());
            let mut zero = Zero1::new(pg, model.params(), &full_mask, cfg.adamw())?;
            zero.set_compression(compression);
            GradSync::Zero1(zero)
        }
    };
    // A checkpoint of any kind and world size: this rank reads its own
    // shard of it, and the ranks' shards make the model again.
    let config = model.config().clone();
    let (pieces, len) = match &sync {
        GradSync::Zero1(zero) => (zero.pieces(), zero.shard_len()),
        GradSync::Sharded(zero) => (zero.pieces(), zero.shard_len()),
        _ => unreachable!("resumed above"),
    };
    let mut target = ShardTarget::new(&config, pieces, len);
    let Some(state) = resume_shard(cfg, pg, &mut target, header)? else {
        return Ok((sync, TrainState::default()));
    };
    let mut sync = sync;
    match &mut sync {
        GradSync::Zero1(zero) => zero.restore(pg, &target, model.params_mut())?,
        GradSync::Sharded(zero) => zero.restore(pg, model, &target)?,
        _ => unreachable!("resumed above"),
    }
    Ok((sync, state))
}

/// DDP or ZeRO-1 (`kind`) over a model in a device's memory, its gradients staged through
/// the host (see `staged`), overlapped and compressed as `wire` says. DDP: AdamW's moments in
/// the device's memory; with `cfg.resume`, every rank's whole state read into host copies and
/// uploaded. ZeRO-1: AdamW over this rank's shard on the host, resumed from its shard of any
/// checkpoint. Rank 0's parameters are made every rank's through the host. Collective.
fn build_device<'a>(
    cfg: &TrainConfig,
    pg: &'a ProcessGroup,
    kind: SyncKind,
    (overlap, compression): (bool, Compression),
    model: &mut GPT,
    header: &mut Vec<String>,
) -> Result<(GradSync<'a>, TrainState), TrainError> {
    if kind == SyncKind::Zero1 {
        let mut zero = StagedZero1::new(pg, model, cfg.adamw(), compression)?;
        let config = model.config().clone();
        let (pieces, len) = (zero.zero().pieces(), zero.zero().shard_len());
        let mut target = ShardTarget::new(&config, pieces, len);
        let state = match resume_shard(cfg, pg, &mut target, header)? {
            Some(state) => {
                zero.restore(pg, &target, model)?;
                state
            }
            None => TrainState::default(),
        };
        return Ok((GradSync::DeviceZero1(Box::new(zero)), state));
    }
    let mask = decay_mask(model.param_views());
    let mut opt = AdamW::new_on(model.backend(), cfg.adamw(), mask.clone())?;
    let state = match &cfg.resume {
        Some(_) => {
            let mut staged = GPT::staging(model.config().clone())?;
            let mut host_opt = AdamW::new(cfg.adamw(), mask)?;
            let state = resume_replica(cfg, pg, &mut staged, &mut host_opt, header)?;
            model.copy_params_from_host(staged.params())?;
            opt.load_from_host(model.backend(), &host_opt)?;
            state
        }
        None => TrainState::default(),
    };
    let options = DdpOptions {
        bucket_cap_mb: cfg.bucket_cap_mb,
        overlap,
        compression,
        ..DdpOptions::default()
    };
    // NCCL where every rank has a GPU of its own (or `--backend nccl`), else host staging.
    let (nccl, staged_because) = match pg.size() {
        1 => (None, None),
        _ => match crate::device_comm::device_sync(&cfg.backend, pg, model.backend())? {
            DeviceSync::Collectives(c) => (Some(c), None),
            DeviceSync::Staged(why) => (None, Some(why)),
        },
    };
    let ddp = StagedDdp::new(pg, model, options, nccl.is_none())?;
    let sync = GradSync::Device {
        ddp,
        opt,
        nccl,
        staged_because,
    };
    Ok((sync, state))
}

/// DiLoCo's sync over `model` (rank 0's parameters already every rank's):
/// the inner AdamW and the outer optimizer, resumed from `cfg.resume` when
/// set (see `diloco`: bitwise on as many ranks, regrouped on another
/// number). Collective.
fn build_diloco<'a>(
    cfg: &TrainConfig,
    pg: &'a ProcessGroup,
    model: &mut GPT,
    header: &mut Vec<String>,
) -> Result<(GradSync<'a>, TrainState), TrainError> {
    let mut opt = AdamW::new(cfg.adamw(), decay_mask(model.param_views()))?;
    let outer_cfg = OuterConfig::of(cfg);
    // Overlapped, the outer all-reduces get a group of their own, so that
    // the training group's per-step collectives never queue behind them.
    let side = match outer_cfg.overlap {
        true => {
            let all: Vec<usize> = (0..pg.size()).collect();
            pg.new_group(&all)
                .map_err(TrainError::comm("DiLoCo's all-reduce group"))?
        }
        false => None,
    };
    let mut outer = Box::new(Outer::new(outer_cfg, model.params(), side)?);
    let Some(dir) = &cfg.resume else {
        return Ok((GradSync::Diloco { opt, outer }, TrainState::default()));
    };
    let mut target = DilocoTarget {
        model,
        opt: &mut opt,
        outer: &mut outer,
        rank: pg.rank(),
        world: pg.size(),
        notes: Vec::new(),
    };
    let resumed = checkpoint::resume_into(dir, cfg, pg, pg.size(), &mut target)?;
    header.extend(resumed.notes);
    header.extend(target.notes);
    header.push(format!(
        "resumed from {} at step {}",
        resumed.dir.display(),
        resumed.state.step
    ));
    Ok((GradSync::Diloco { opt, outer }, resumed.state))
}

/// The header line that describes the model and how it is spread.
fn model_line(
    cfg: &TrainConfig,
    data: &Arc<dyn Dataset>,
    model: &GPT,
    sync: &GradSync<'_>,
    world: usize,
    overlap: bool,
) -> String {
    let n = model.num_params();
    let spread = match sync {
        GradSync::Ddp { ddp, .. } => {
            let nice = ddp.options().reducer_nice;
            let reducer = match nice {
                0 => String::new(),
                n => format!(", its thread {n} nice steps below backward's (no core free for it)"),
            };
            format!(
                "DDP buckets: {} in launch order of {} (cap {} MB, the last at most {} MB where \
                 it can be cut; overlap {}{reducer})",
                ddp.buckets().len(),
                cohort_ddp::describe_sizes(ddp.buckets()),
                cfg.bucket_cap_mb,
                ddp.options().last_bucket_mb,
                on_off(overlap)
            )
        }
        GradSync::Zero1(zero) => format!(
            "ZeRO-1: {world} shards of {} ({} padding)",
            zero.shard_len(),
            zero.shard_len() * world - n,
        ),
        GradSync::Sharded(zero) => {
            let (name, what) = match zero.stage() {
                ZeroStage::Two => ("ZeRO-2", "optimizer state and gradients"),
                ZeroStage::Three => ("ZeRO-3", "parameters, gradients and optimizer state"),
            };
            let f32s = std::mem::size_of::<f32>();
            let units: Vec<usize> = zero.reduce_units().iter().map(|u| u.len() * f32s).collect();
            format!(
                "{name}: {what} in {world} shards by unit, {} elements per rank ({} padding); \
                 {} reduce-scatters in launch order of {} (each block's MLP apart from its \
                 attention, so that of block 0 only the attention is left with the embeddings \
                 when backward ends); overlap {}",
                zero.shard_len(),
                zero.shard_len() * world - n,
                units.len(),
                cohort_ddp::describe_bytes(&units),
                on_off(overlap),
            )
        }
        GradSync::Diloco { outer, .. } => outer.config().line(),
        GradSync::Device { ddp, nccl, .. } => format!(
            "on {}: forward, backward, the gradient norm and AdamW as its kernels; {}",
            model.backend().device(),
            match nccl {
                Some(c) if ddp.ddp().options().overlap => format!(
                    "DDP's gradients averaged on the device by {} in buckets while backward goes \
                     on: {} in launch order of {} (cap {} MB, the last at most {} MB where it can \
                     be cut; overlap on)",
                    c.name(),
                    ddp.ddp().buckets().len(),
                    cohort_ddp::describe_sizes(ddp.ddp().buckets()),
                    cfg.bucket_cap_mb,
                    ddp.ddp().options().last_bucket_mb,
                ),
                Some(c) => format!(
                    "DDP's gradients averaged on the device by {} after backward (one \
                     all-reduce; overlap off)",
                    c.name()
                ),
                None => format!(
                    "DDP buckets: {} in launch order of {} (cap {} MB, the last at most {} MB \
                     where it can be cut)",
                    ddp.ddp().buckets().len(),
                    cohort_ddp::describe_sizes(ddp.ddp().buckets()),
                    cfg.bucket_cap_mb,
                    ddp.ddp().options().last_bucket_mb,
                ),
            }
        ),
        GradSync::DeviceZero1(zero) => format!(
            "on {}: forward, backward and the gradient as its kernels; ZeRO-1: {world} shards of \
             {} ({} padding), AdamW over this rank's shard on the host",
            model.backend().device(),
            zero.zero().shard_len(),
            zero.zero().shard_len() * world - n,
        ),
    };
    format!(
        "model: {} layers, {} heads, d_model {}, d_ff {}, vocab {}, seq {}: {n} parameters; \
         {spread}",
        cfg.n_layers,
        cfg.n_heads,
        cfg.d_model,
        cfg.d_ff,
        data.vocab_size(),
        data.seq_len(),
    )
}

fn on_off(on: bool) -> &'static str {
    if on {
        "on"
    } else {
        "off"
    }
}

impl DataParallelRun<'_> {
    /// DiLoCo's save: every rank's own parameters and moments gathered to
    /// rank 0, which writes them beside the global parameters (the model)
    /// and the outer momentum (see `diloco`). Collective.
    fn save_diloco(&mut self, out: &Path, step: u64) -> Result<SaveReport, TrainError> {
        let (cfg, pg) = (self.cfg, self.step.group());
        let (model, sync) = self.step.model_and_sync_mut();
        let GradSync::Diloco { opt, outer } = sync else {
            unreachable!("only DiLoCo saves this way")
        };
        // An overlapped all-reduce in flight is waited for, and saved.
        self.outer_syncs.1 += outer.drain()?;
        let Some(ranks) = diloco::gather_ranks(pg, model.params(), opt, outer)? else {
            return Ok(SaveReport::default());
        };
        // The checkpoint's model is the global one; this rank's own (the
        // first of the gathered) goes back after.
        model.params_mut().copy_from_slice(outer.global());
        let file = diloco::optimizer_file(opt, outer, &ranks, pg.size());
        let (epoch, offset) = self.batches.position();
        let state = TrainState {
            step,
            epoch,
            offset,
        };
        let tokenizer = self.data.tokenizer_json();
        let report = checkpoint::save_file_or_report(
            out,
            cfg,
            pg.size(),
            model,
            file,
            &state,
            tokenizer.as_deref(),
        );
        let n = model.num_params();
        model.params_mut().copy_from_slice(&ranks[..n]);
        Ok(report)
    }
}

impl ParallelStrategy for DataParallelRun<'_> {
    fn group(&self) -> &ProcessGroup {
        self.step.group()
    }

    fn start(&self) -> Start {
        self.start.clone()
    }

    fn gradients(&mut self, step: u64, phases: &mut Phases) -> Result<StepGradients, TrainError> {
        let (cfg, rank, world) = (self.cfg, self.group().rank(), self.group().size());
        let (loss_sum, tokens) =
            step_loop::accumulate(&mut self.step, &mut self.batches, cfg, rank, step, phases)?;
        Ok(StepGradients::data_parallel(
            loss_sum,
            tokens,
            cfg.grad_accum,
            world,
        ))
    }

    fn grads_mut(&mut self) -> &mut [f32] {
        self.step.grads_mut()
    }

    fn device_grads(&mut self) -> Option<(&dyn Backend, ViewMut<'_, f32>)> {
        self.step.device_grads()
    }

    fn global_norm(&mut self, local: f32) -> Result<f32, TrainError> {
        self.step.global_norm(local)
    }

    fn apply(&mut self, step: u64, lr: Option<f64>) -> Result<(), TrainError> {
        // A skipped step changes nothing: nothing to gather either.
        if let Some(lr) = lr {
            self.step.update(lr)?;
        }
        self.step.clear_grads();
        let (synced, waited) = self.step.end_step(step, self.cfg.steps)?;
        self.outer_syncs.0 += u64::from(synced);
        self.outer_syncs.1 += waited;
        Ok(())
    }

    fn evaluate(&mut self) -> Result<f32, TrainError> {
        let mine = self.step.val_losses(&self.val.mine)?;
        step_loop::mean_val_loss(Some(self.group()), self.val.total, &mine)
    }

    /// DDP: rank 0 writes the whole model and optimizer. ZeRO: every rank
    /// writes its own shard (its slice of the parameters and its moments),
    /// rank 0 the index that commits them.
    fn save(&mut self, out: &Path, step: u64, saver: &mut Saver) -> Result<SaveReport, TrainError> {
        let (cfg, pg, data) = (self.cfg, self.step.group(), &*self.data);
        let (model, batches) = (self.step.model(), &self.batches);
        let save =
            |shard: &OwnedShard<'_>| save_shard(out, cfg, pg, model, shard, batches, data, step);
        match self.step.sync() {
            GradSync::Ddp { .. } if pg.rank() != 0 => Ok(SaveReport::default()),
            GradSync::Ddp { opt, .. } => Ok(save_replica(
                saver, out, cfg, pg, model, opt, batches, data, step,
            )),
            GradSync::Zero1(zero) => zero.with_owned_shard(save),
            GradSync::DeviceZero1(zero) => zero.zero().with_owned_shard(save),
            // The flat shards, never the model's buffer (which ZeRO-2 with
            // overlap leaves stale after an update, for the next forward).
            GradSync::Sharded(zero) => zero.with_owned_shard(pg.size(), save),
            GradSync::Diloco { .. } => self.save_diloco(out, step),
            GradSync::Device { .. } if pg.rank() != 0 => Ok(SaveReport::default()),
            GradSync::Device { opt, .. } => {
                // Host copies of the model and the optimizer, which the saver writes.
                let mut staged = GPT::staging(model.config().clone())?;
                model.copy_params_to_host(staged.params_mut())?;
                let host_opt = opt.to_host(model.backend())?;
                Ok(save_replica(
                    saver, out, cfg, pg, &staged, &host_opt, batches, data, step,
                ))
            }
        }
    }

    fn final_params(&mut self) -> Result<Vec<f32>, TrainError> {
        self.step.final_params()
    }

    fn summary(&self) -> Vec<String> {
        let (syncs, comm) = self.outer_syncs;
        let GradSync::Diloco { outer, .. } = self.step.sync() else {
            return Vec::new();
        };
        if syncs == 0 {
            return Vec::new();
        }
        let what = if outer.config().overlap {
            "waited for the pseudo-gradient all-reduce (overlapped with the next round; the \
             last sync's and checkpoints' waits included)"
        } else {
            "in the pseudo-gradient all-reduce (exposed: the ranks wait for it)"
        };
        vec![format!(
            "outer syncs (rank 0): {syncs}, {:.1} ms each {what}",
            comm.as_secs_f64() * 1e3 / syncs as f64
        )]
    }

    fn who(&self) -> String {
        let ranks = self.group().size();
        match self.step.zero_stage() {
            None if self.cfg.strategy != crate::config::Strategy::Ddp => {
                format!("{ranks} rank(s), {}", self.cfg.strategy.name())
            }
            None => format!("{ranks} rank(s)"),
            Some(stage) => format!("{ranks} rank(s), ZeRO-{stage}"),
        }
    }
}

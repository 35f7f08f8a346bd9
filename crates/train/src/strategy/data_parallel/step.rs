//! The data-parallel step: a model replica on every rank, and how its
//! gradients are synchronised, as a value ([`GradSync`]): DDP's bucketed
//! all-reduce, ZeRO-1's reduce-scatter into a sharded optimizer, or ZeRO-2/3's
//! reduce-scatter part by part (parameters sharded too under stage 3), or
//! DiLoCo's outer step every H steps (local SGD its special case).
//! [`DataParallel`] runs a step's pieces (forward, backward with the sync,
//! update) the same way for the training loop and for callers with their
//! own loop (`cohort bench ddp`). It never reads data, logs or decides
//! when to step.

use std::time::{Duration, Instant};

use cohort_comm::{ProcessGroup, ReduceOp};
use cohort_data::Batch;
use cohort_ddp::{Ddp, DdpOptions};
use cohort_engine::optim::{AdamW, Optimizer};
use cohort_engine::{Backend, ViewMut};
use cohort_gpt::{Backward, Forward, Labels, GPT};

use super::device_buckets;
use super::diloco::Outer;
use super::sharded::{ShardedDp, ZeroStage};
use super::staged::{StagedDdp, StagedZero1};
use super::zero1::Zero1;
use crate::device_comm::DeviceCollectives;
use crate::error::TrainError;
use crate::phases::{Phase, Phases};
use crate::replica::param_specs;
use crate::step_loop::{self, MicroBatches};

/// How a data-parallel step synchronises its gradients, with the optimizer
/// state that goes with it.
pub enum GradSync<'pg> {
    /// PyTorch's DDP: the gradients all-reduced in buckets during the last
    /// micro-batch's backward; AdamW over the whole model on every rank.
    Ddp {
        /// The buckets and their all-reduces.
        ddp: Ddp<'pg>,
        /// AdamW over the whole model.
        opt: AdamW,
    },
    /// ZeRO-1: the summed gradient reduce-scattered once after the last
    /// backward; AdamW over this rank's shard; the parameters all-gathered.
    Zero1(Zero1),
    /// ZeRO-2 or ZeRO-3: each unit's gradient (a block's MLP, then its
    /// attention) reduce-scattered as every backward finishes it (stage 3: each part's parameters gathered
    /// around its forward and backward); AdamW over this rank's flat shard.
    Sharded(Box<ShardedDp>),
    /// DiLoCo or local SGD: no gradient sync at all; AdamW over the whole
    /// model on each rank's own gradient, and every `sync_every` steps the
    /// outer step over the averaged pseudo-gradient (see `diloco`).
    Diloco {
        /// The inner AdamW over the whole model, this rank's own.
        opt: AdamW,
        /// The global parameters and the outer optimizer.
        outer: Box<Outer>,
    },
    /// DDP of a model in a device's memory (`--device`): forward, backward, the gradient
    /// guard and AdamW as its backend's kernels; DDP's buckets staged through the host as
    /// backward finishes them and all-reduced there while it goes on (see `staged`), or, where
    /// NCCL moves them, the same buckets averaged on the device while backward goes on (see
    /// `device_buckets`; with overlap off, the whole gradient after the last backward).
    Device {
        /// The buckets, their host staging and their all-reduces.
        ddp: StagedDdp<'pg>,
        /// AdamW with its moments in the device's memory.
        opt: AdamW,
        /// NCCL's collectives where they average the gradients on the device (then `ddp`
        /// stages nothing).
        nccl: Option<Box<dyn DeviceCollectives>>,
        /// Why the gradients are staged through the host rather than averaged by NCCL (`None`
        /// on one rank and under NCCL).
        staged_because: Option<String>,
    },
    /// ZeRO-1 of a model in a device's memory: the gradient staged through the host and
    /// reduce-scattered there, AdamW over this rank's shard on the host, the parameters
    /// all-gathered and uploaded (see `staged`).
    DeviceZero1(Box<StagedZero1>),
}

/// Where the time of a backward and its synchronisation went.
#[derive(Debug, Clone, Copy, Default)]
pub struct SyncTimes {
    /// The model's backward (with overlap, the communication it hid included).
    pub backward: Duration,
    /// Waiting for the gradients' collectives beyond the backward.
    pub comm_wait: Duration,
    /// Inside the gradients' collectives, overlapped or not.
    pub comm_busy: Duration,
}

/// One rank of data-parallel training: its model replica (whole, or under
/// ZeRO-3 filled part by part) and the gradient sync, in the group `pg`.
pub struct DataParallel<'pg> {
    pg: &'pg ProcessGroup,
    model: GPT,
    sync: GradSync<'pg>,
}

impl<'pg> GradSync<'pg> {
    /// DDP over `model` with `opt` over all of it (rank 0's parameters are
    /// broadcast to the others). Collective.
    pub fn ddp(
        pg: &'pg ProcessGroup,
        model: &mut GPT,
        opt: AdamW,
        options: DdpOptions,
    ) -> Result<Self, TrainError> {
        let mut ddp = Ddp::new(pg, param_specs(model), model.params_mut(), options)?;
        // The buckets along the ranges backward will report, from the
        // start: the header states the sizes the run uses.
        ddp.plan_along(&model.split_ready_ranges());
        Ok(GradSync::Ddp { ddp, opt })
    }

    /// The ZeRO stage, if any.
    fn zero_stage(&self) -> Option<u8> {
        match self {
            GradSync::Ddp { .. } | GradSync::Diloco { .. } | GradSync::Device { .. } => None,
            GradSync::Zero1(_) | GradSync::DeviceZero1(_) => Some(1),
            GradSync::Sharded(zero) => Some(match zero.stage() {
                ZeroStage::Two => 2,
                ZeroStage::Three => 3,
            }),
        }
    }
}

impl<'pg> DataParallel<'pg> {
    /// Data parallelism over `pg` of `model` (the same on every rank, or
    /// made so by `sync`) with its gradients synchronised by `sync`.
    pub fn new(pg: &'pg ProcessGroup, model: GPT, sync: GradSync<'pg>) -> Self {
        DataParallel { pg, model, sync }
    }

    /// The group the replicas train in.
    pub fn group(&self) -> &'pg ProcessGroup {
        self.pg
    }

    /// The model (under ZeRO-3 its parameter buffer holds only what a pass
    /// gathered; under ZeRO-2 with overlap, after an update, the previous
    /// step's parameters until the next forward or
    /// [`DataParallel::complete_params`]).
    pub fn model(&self) -> &GPT {
        &self.model
    }

    /// The model, to change how it runs (training mode, dropout keys).
    pub fn model_mut(&mut self) -> &mut GPT {
        &mut self.model
    }

    /// The gradient sync.
    pub fn sync(&self) -> &GradSync<'pg> {
        &self.sync
    }

    /// The model and the gradient sync, both to change (a save that puts
    /// DiLoCo's global parameters in the model for a moment).
    pub(crate) fn model_and_sync_mut(&mut self) -> (&mut GPT, &mut GradSync<'pg>) {
        (&mut self.model, &mut self.sync)
    }

    /// Makes the model's parameters whole and current where the last update
    /// left that to the next forward (ZeRO-2 with overlap: see
    /// [`ShardedDp::complete_params`]); anything that reads them other than
    /// the next training forward calls this first. Returns the time spent
    /// in collectives. Collective under ZeRO-2.
    pub fn complete_params(&mut self) -> Result<Duration, TrainError> {
        match &mut self.sync {
            GradSync::Sharded(zero) => zero.complete_params(self.pg, &mut self.model),
            _ => Ok(Duration::ZERO),
        }
    }

    /// The ZeRO stage (1, 2 or 3), or `None` for DDP.
    pub fn zero_stage(&self) -> Option<u8> {
        self.sync.zero_stage()
    }

    /// The forward of `input_ids` (B = `b`, T = `t`) with `labels` (and
    /// the segment ids of packed rows), as [`GPT::forward`]; ZeRO-3 gathers each part's parameters
    /// around it. Collective under ZeRO-3.
    pub fn forward(
        &mut self,
        input_ids: &[u32],
        attention_mask: Option<&[u8]>,
        segments: Option<&[u32]>,
        labels: Option<Labels<'_>>,
        b: usize,
        t: usize,
    ) -> Result<Option<f32>, TrainError> {
        let model = &mut self.model;
        match &mut self.sync {
            GradSync::Sharded(zero) => zero.forward(
                self.pg,
                model,
                input_ids,
                attention_mask,
                segments,
                labels,
                b,
                t,
            ),
            _ => {
                let pass = Forward::new(input_ids, b, t)
                    .attention_mask(attention_mask)
                    .segments(segments);
                Ok(model.forward(pass.labels(labels))?)
            }
        }
    }

    /// The forward of `batch` with next-token targets: its mean loss.
    fn forward_batch(&mut self, batch: &Batch) -> Result<Option<f32>, TrainError> {
        let labels = Some(Labels::Next(&batch.targets));
        let mask = step_loop::padding_mask(batch);
        let segments = batch.segments.as_deref();
        self.forward(
            &batch.input_ids,
            mask,
            segments,
            labels,
            batch.batch,
            batch.seq,
        )
    }

    /// The backward of the last forward, accumulating into the gradients;
    /// `last` for the step's last micro-batch, after which the gradients
    /// are synchronised: DDP averages them during it (PyTorch's `no_sync`
    /// for the others), ZeRO-1 reduce-scatters the sum after it, ZeRO-2/3
    /// reduce-scatter every micro-batch's part by part (the shard
    /// accumulates them). Collective where it synchronises.
    pub fn backward(&mut self, last: bool) -> Result<SyncTimes, TrainError> {
        let (pg, model) = (self.pg, &mut self.model);
        let plain = |model: &mut GPT| -> Result<Duration, TrainError> {
            let t = Instant::now();
            model.backward(Backward::new())?;
            Ok(t.elapsed())
        };
        match &mut self.sync {
            GradSync::Ddp { ddp, .. } if last => {
                let stats = ddp
                    .backward(|ready| {
                        // The CPU's gradients: each view is the host slice it is.
                        let pass = Backward::new()
                            .on_ready(|range, grads| ready(range, ViewMut::host(grads)));
                        model.backward(pass.split_blocks())
                    })?
                    .finish(model.grads_mut())?;
                Ok(SyncTimes {
                    backward: stats.backward,
                    comm_wait: stats.comm_wait,
                    comm_busy: stats.comm_busy,
                })
            }
            GradSync::Device {
                ddp,
                nccl: Some(nccl),
                ..
            } if last && ddp.ddp().options().overlap => {
                let buckets: Vec<_> = ddp
                    .ddp()
                    .buckets()
                    .iter()
                    .map(|b| b.range.clone())
                    .collect();
                device_buckets::backward(model, &buckets, &**nccl)
            }
            GradSync::Device { ddp, nccl, .. } if last => {
                let stats = ddp.backward(model)?;
                let mut times = SyncTimes {
                    backward: stats.backward,
                    comm_wait: stats.comm_wait,
                    comm_busy: stats.comm_busy,
                };
                if let Some(nccl) = nccl {
                    let t = Instant::now();
                    let (backend, grads) = model.grads_view_mut();
                    nccl.all_reduce_avg(backend, grads)
                        .map_err(TrainError::DeviceComm)?;
                    times.comm_wait = t.elapsed();
                    times.comm_busy = times.comm_wait;
                }
                Ok(times)
            }
            GradSync::DeviceZero1(zero) if last => {
                let (backward, comm) = zero.backward(pg, model)?;
                Ok(SyncTimes {
                    backward,
                    comm_wait: comm,
                    comm_busy: comm,
                })
            }
            GradSync::Ddp { .. }
            | GradSync::Diloco { .. }
            | GradSync::Device { .. }
            | GradSync::DeviceZero1(_) => Ok(SyncTimes {
                backward: plain(model)?,
                ..SyncTimes::default()
            }),
            GradSync::Zero1(zero) => {
                let backward = plain(model)?;
                let mut comm = Duration::ZERO;
                if last {
                    let t = Instant::now();
                    zero.reduce_scatter(pg, model.grads())?;
                    comm = t.elapsed();
                }
                Ok(SyncTimes {
                    backward,
                    comm_wait: comm,
                    comm_busy: comm,
                })
            }
            GradSync::Sharded(zero) => {
                let t = Instant::now();
                let comm = zero.backward(pg, model)?;
                Ok(SyncTimes {
                    backward: t.elapsed().saturating_sub(comm),
                    comm_wait: comm,
                    comm_busy: comm,
                })
            }
        }
    }

    /// This rank's synchronised gradient, for the loop to scale, check and
    /// clip: the whole mean gradient under DDP, this rank's shard of it
    /// under ZeRO (its padding zero, counting for nothing in the norm).
    pub fn grads_mut(&mut self) -> &mut [f32] {
        match &mut self.sync {
            GradSync::Ddp { .. } | GradSync::Diloco { .. } | GradSync::Device { .. } => {
                self.model.grads_mut()
            }
            GradSync::Zero1(zero) => zero.shard_grads_mut(),
            GradSync::Sharded(zero) => zero.shard_grads_mut(),
            GradSync::DeviceZero1(zero) => zero.shard_grads_mut(),
        }
    }

    /// The gradient in a device's memory, with its backend, where the model lives on one
    /// (`None`: [`DataParallel::grads_mut`] is the host's).
    pub(crate) fn device_grads(&mut self) -> Option<(&dyn Backend, ViewMut<'_, f32>)> {
        match self.sync {
            GradSync::Device { .. } => Some(self.model.grads_view_mut()),
            _ => None,
        }
    }

    /// The whole gradient's norm given this rank's norm of
    /// [`DataParallel::grads_mut`]: DDP's ranks hold the same whole
    /// gradient, so theirs is it; DiLoCo's ranks step on their own
    /// gradients, clipped by their own norms; the ZeRO shards' squares are
    /// summed. Collective under ZeRO.
    pub fn global_norm(&self, local: f32) -> Result<f32, TrainError> {
        if let GradSync::Ddp { .. } | GradSync::Diloco { .. } | GradSync::Device { .. } = self.sync
        {
            return Ok(local);
        }
        let mut squares = [f64::from(local) * f64::from(local)];
        (self.pg)
            .all_reduce(&mut squares, ReduceOp::Sum)
            .map_err(TrainError::comm("gradient norm all_reduce"))?;
        Ok(squares[0].sqrt() as f32)
    }

    /// AdamW at `lr` on what this rank holds of the synchronised gradient,
    /// then every rank's parameters made whole again where the sync needs
    /// it (ZeRO-1 and 2 all-gather; ZeRO-3, and ZeRO-2 with overlap, gather
    /// in the next forward). Returns the time spent in collectives.
    /// Collective under ZeRO-1/2.
    pub fn update(&mut self, lr: f64) -> Result<Duration, TrainError> {
        let (pg, model) = (self.pg, &mut self.model);
        match &mut self.sync {
            GradSync::Ddp { opt, .. } | GradSync::Diloco { opt, .. } => {
                model.update_params(|params, grads| opt.step(params, grads, lr))?;
                Ok(Duration::ZERO)
            }
            GradSync::Device { opt, .. } => {
                let (dev, params, grads) = model.params_and_grads_views();
                opt.step_on(dev, params, grads, lr)?;
                Ok(Duration::ZERO)
            }
            GradSync::DeviceZero1(zero) => zero.update(pg, model, lr),
            GradSync::Zero1(zero) => {
                // On the model's threads, as the whole model's update is.
                let (dev, mut stepped) = (model.backend_handle(), Ok(()));
                dev.install(&mut || stepped = zero.update(lr));
                stepped?;
                let t = Instant::now();
                zero.all_gather(pg, model.params_mut())?;
                Ok(t.elapsed())
            }
            GradSync::Sharded(zero) => zero.update(pg, model, lr),
        }
    }

    /// What ends step `step` of `steps` (0-based), updated or skipped:
    /// DiLoCo's overlapped outer step when its delay is up, and its outer
    /// sync when it is due (every rank takes part, whether its step was
    /// skipped or not). Returns whether it synced and the time it waited
    /// for all-reduces. Collective under DiLoCo at a sync.
    pub fn end_step(&mut self, step: u64, steps: u64) -> Result<(bool, Duration), TrainError> {
        let GradSync::Diloco { outer, .. } = &mut self.sync else {
            return Ok((false, Duration::ZERO));
        };
        let params = self.model.params_mut();
        let mut waited = Duration::ZERO;
        if outer.apply_due(step) {
            waited += outer.apply_pending(params)?;
        }
        let due = outer.due(step, steps);
        if due {
            waited += outer.sync(self.pg, params, step + 1 == steps)?;
        }
        Ok((due, waited))
    }

    /// Clears the gradients for the next step. ZeRO-2/3 give the shard's
    /// pages back instead of writing zeros (the model's gradient buffer is
    /// already zero, released part by part: zeroing it would only bring its
    /// pages back).
    pub fn clear_grads(&mut self) {
        match &mut self.sync {
            GradSync::Sharded(zero) => zero.clear_grads(),
            _ => self.model.zero_grad(),
        }
    }

    /// The loss of the model on each of `val` ((place in the job's list,
    /// batch)), in eval mode. Under ZeRO-3 the forward is collective, but
    /// the job's batches need not share out evenly: a rank with fewer runs
    /// forwards whose results it drops, until every rank has run as many
    /// as the busiest. Collective under ZeRO-3.
    pub(crate) fn val_losses(
        &mut self,
        val: &[(usize, Batch)],
    ) -> Result<Vec<(usize, f32)>, TrainError> {
        // ZeRO-2's deferred gathers, by every rank: one whose share of the
        // batches is empty runs no forward to do them in.
        self.complete_params()?;
        let GradSync::Sharded(zero) = &mut self.sync else {
            return step_loop::batch_losses(val, &mut self.model);
        };
        let (pg, model) = (self.pg, &mut self.model);
        let mut most = [val.len() as i64];
        if zero.stage() == ZeroStage::Three {
            pg.all_reduce(&mut most, ReduceOp::Max)
                .map_err(TrainError::comm("val batch count all_reduce"))?;
        }
        let forward = |zero: &mut ShardedDp, model: &mut GPT, batch: &Batch| {
            let labels = Some(Labels::Next(&batch.targets));
            let mask = step_loop::padding_mask(batch);
            zero.forward(
                pg,
                model,
                &batch.input_ids,
                mask,
                batch.segments.as_deref(),
                labels,
                batch.batch,
                batch.seq,
            )
        };
        let mine = step_loop::batch_losses_with(val, model, &mut |m, b| forward(zero, m, b))?;
        model.set_training(false);
        for _ in val.len() as i64..most[0] {
            let ran = match val.first() {
                Some((_, batch)) => forward(zero, model, batch),
                None => zero.forward(pg, model, &[0], None, None, None, 1, 1),
            };
            ran?;
        }
        model.set_training(true);
        Ok(mine)
    }

    /// The whole model's parameters, on every rank. Collective under ZeRO-2
    /// and 3.
    pub fn final_params(&mut self) -> Result<Vec<f32>, TrainError> {
        self.complete_params()?;
        match &mut self.sync {
            GradSync::Sharded(zero) if zero.stage() == ZeroStage::Three => {
                zero.gather_params(self.pg)
            }
            GradSync::Device { .. } => {
                let mut params = vec![0f32; self.model.num_params()];
                self.model.copy_params_to_host(&mut params)?;
                Ok(params)
            }
            GradSync::DeviceZero1(zero) => Ok(zero.params().to_vec()),
            _ => Ok(self.model.params().to_vec()),
        }
    }

    /// Floats of AdamW state this rank keeps: two moments of the whole
    /// model under DDP, of one shard under ZeRO.
    pub fn optimizer_floats(&self) -> usize {
        match &self.sync {
            GradSync::Ddp { .. } | GradSync::Device { .. } => 2 * self.model.num_params(),
            // The inner moments, the global parameters and the outer
            // momentum; overlapped, the round's start and the average in flight.
            GradSync::Diloco { outer, .. } => {
                let momentum = usize::from(outer.config().momentum > 0.0);
                let overlap = 2 * usize::from(outer.config().overlap);
                (3 + momentum + overlap) * self.model.num_params()
            }
            GradSync::Zero1(zero) => 2 * zero.shard_len(),
            GradSync::DeviceZero1(zero) => 2 * zero.zero().shard_len(),
            GradSync::Sharded(zero) => 2 * zero.shard_len(),
        }
    }

    /// DDP's gradient buckets (0 under ZeRO: ZeRO-1 reduces the buffer at
    /// once, ZeRO-2 and 3 part by part).
    pub fn buckets(&self) -> usize {
        match &self.sync {
            GradSync::Ddp { ddp, .. } => ddp.buckets().len(),
            GradSync::Device { ddp, .. } => ddp.ddp().buckets().len(),
            GradSync::Zero1(_)
            | GradSync::Sharded(_)
            | GradSync::Diloco { .. }
            | GradSync::DeviceZero1(_) => 0,
        }
    }
}

/// The training loop's micro-batches through the step: each backward times
/// itself and its synchronisation into the step's phases.
impl MicroBatches for DataParallel<'_> {
    fn model(&mut self) -> &mut GPT {
        &mut self.model
    }

    fn forward(&mut self, batch: &Batch) -> Result<Option<f32>, TrainError> {
        self.forward_batch(batch)
    }

    fn backward(&mut self, last: bool, phases: &mut Phases) -> Result<(), TrainError> {
        let times = DataParallel::backward(self, last)?;
        phases.add(Phase::Backward, times.backward);
        phases.add(Phase::Comm, times.comm_wait);
        Ok(())
    }
}

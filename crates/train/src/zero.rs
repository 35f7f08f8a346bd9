//! ZeRO stage 1 (PyTorch's `ZeroRedundancyOptimizer`, DeepSpeed ZeRO-1):
//! data parallelism whose optimizer state is sharded. Every rank holds the
//! whole model and its whole gradient, as under DDP, but AdamW's two moments
//! only for its own shard of the flat parameter buffer: 1/N of DDP's
//! optimizer bytes on each of N ranks.
//!
//! The scheme. The n parameters are padded to P = N x s, s = ceil(n / N),
//! and rank r owns the contiguous shard `r*s .. (r+1)*s` (the padding, at
//! most N - 1 zeros at the end, belongs to the last ranks and stays zero:
//! its gradient is zero and it is exempt from weight decay). Each step:
//!
//! 1. forward and backward of the step's micro-batches, the gradients
//!    summing locally in the model (no communication until the last);
//! 2. one reduce-scatter (average) of the whole gradient: rank r receives
//!    the job's mean gradient of its shard, and nothing else;
//! 3. the training loop scales, checks and clips the shard; the norm to clip
//!    by is the whole gradient's, so the shards' sums of squares are
//!    all-reduced; a NaN in any shard skips the update on every rank (the
//!    loop's skip vote);
//! 4. AdamW steps the shard's parameters with the shard's moments;
//! 5. one all-gather of the updated shards: every rank has the whole model
//!    again, bitwise the same.
//!
//! Checkpoints are sharded: at a save each rank writes its own shard (its
//! slice of the parameters and its moments) and rank 0 the index that
//! commits them (`cohort_gpt::checkpoint`'s sharded format), so nothing is
//! gathered. A resume reads any checkpoint, sharded (at any world size, by
//! any strategy) or DDP's, whole, keeps this rank's shard and frees the rest
//! (so resuming holds the whole state for a moment; what ZeRO-1 saves is the
//! state held while training).
//!
//! This module must never keep optimizer state for parameters outside its
//! shard between steps, and never let one rank's parameters differ from
//! another's after a step.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_comm::{ProcessGroup, ReduceOp};
use cohort_data::Dataset;
use cohort_ddp::{Compression, CompressionScratch};
use cohort_engine::optim::{AdamW, AdamWConfig, DecayMask, Optimizer};
use cohort_gpt::checkpoint::Piece;
use cohort_gpt::optim_groups::decay_mask;
use cohort_gpt::GPT;

use crate::batches::{val_batches, TrainBatches, ValBatches};
use crate::checkpoint::{OwnedShard, SaveReport, ShardTarget, TrainState};
use crate::config::TrainConfig;
use crate::memory::Sharding;
use crate::phases::{Phase, Phases};
use crate::step_loop::{self, Start, StepGradients, Strategy};
use crate::train::{
    apply_checkpointing, apply_precision, check_memory, global_batch_line, memory_line,
    model_config, resume_shard, save_shard,
};
use crate::TrainError;

/// Where one rank's shard lies in the flat buffer of `n` parameters split
/// over `world` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shard {
    /// Parameters in the model.
    pub n: usize,
    /// Ranks the buffer is split over.
    pub world: usize,
    /// This rank.
    pub rank: usize,
    /// Elements per shard, padding included: ceil(n / world).
    pub len: usize,
}

impl Shard {
    pub(crate) fn new(n: usize, world: usize, rank: usize) -> Shard {
        Shard {
            n,
            world,
            rank,
            len: n.div_ceil(world.max(1)),
        }
    }

    /// The padded buffer's length: `world` shards of `len`.
    pub(crate) fn padded(&self) -> usize {
        self.len * self.world
    }

    /// This shard in the padded buffer.
    pub(crate) fn range(&self) -> Range<usize> {
        self.rank * self.len..(self.rank + 1) * self.len
    }

    /// The part of this shard that is model (not padding), in the model's
    /// buffer; its length is `len` except on the last ranks.
    pub(crate) fn real(&self) -> Range<usize> {
        let r = self.range();
        r.start.min(self.n)..r.end.min(self.n)
    }
}

/// The weight-decay mask of the elements `range` of a buffer whose mask is
/// `full`, re-based to start at 0; elements past `full`'s end (padding) are
/// exempt, so that they stay zero.
pub(crate) fn shard_mask(full: &DecayMask, range: Range<usize>) -> DecayMask {
    let base = range.start;
    let exempt = full
        .segments()
        .iter()
        .filter(|(_, decayed)| !decayed)
        .map(|(r, _)| r.start.max(range.start)..r.end.min(range.end))
        .chain(std::iter::once(full.len().max(range.start)..range.end))
        .filter(|r| r.start < r.end)
        .map(|r| r.start - base..r.end - base)
        .collect::<Vec<_>>();
    DecayMask::with_exempt(range.len(), exempt).expect("the ranges were cut to the shard")
}

/// ZeRO-1's step on flat buffers, for any model whose parameters and
/// gradients are one flat buffer each: steps 2, 4 and 5 of the module's
/// scheme. The training strategy below runs it inside the training loop;
/// `cohort bench ddp --strategy zero1` drives it directly.
///
/// It holds AdamW's moments for this rank's shard only, a copy of the
/// shard's parameters and its mean gradient, and, when the parameter count
/// does not divide into the ranks, one padded whole buffer that the
/// collectives need.
pub struct Zero1 {
    shard: Shard,
    /// AdamW over this rank's shard only (`shard.len` elements).
    opt: AdamW,
    /// This rank's shard of the parameters (padding zero), which `opt`
    /// steps; the model's buffer is refilled from all the ranks' shards.
    params: Vec<f32>,
    /// The job's mean gradient of this rank's shard, after the reduce-scatter.
    grads: Vec<f32>,
    /// The padded whole buffer the collectives need when the parameter
    /// count is not a multiple of the world size; empty when it is (the
    /// collectives then read and write the caller's buffers directly).
    padded: Vec<f32>,
    /// How the gradient travels in the reduce-scatter (`--bf16-compress`).
    compression: Compression,
    scratch: CompressionScratch,
}

/// Where the time of one [`Zero1::step`] went.
#[derive(Debug, Clone, Copy, Default)]
pub struct Zero1Times {
    /// In the reduce-scatter and the all-gather.
    pub comm: Duration,
    /// AdamW on the shard.
    pub optimizer: Duration,
}

impl Zero1 {
    /// ZeRO-1 over `params` (the whole model, the same on every rank),
    /// whose weight decay `mask` covers the whole buffer, with AdamW
    /// configured by `adamw`. Collective: fails on every rank unless every
    /// rank passed the same number of parameters.
    pub fn new(
        pg: &ProcessGroup,
        params: &[f32],
        mask: &DecayMask,
        adamw: AdamWConfig,
    ) -> Result<Zero1, TrainError> {
        let n = params.len();
        agree_on_size(pg, n)?;
        let shard = Shard::new(n, pg.size(), pg.rank());
        let opt = AdamW::new(adamw, shard_mask(mask, shard.range()))?;
        let mut own = vec![0f32; shard.len];
        own[..shard.real().len()].copy_from_slice(&params[shard.real()]);
        let padded = if n == shard.padded() {
            Vec::new()
        } else {
            vec![0f32; shard.padded()]
        };
        Ok(Zero1 {
            shard,
            opt,
            params: own,
            grads: vec![0f32; shard.len],
            padded,
            compression: Compression::None,
            scratch: CompressionScratch::default(),
        })
    }

    /// Sends the gradient as bf16 (PyTorch's `bf16_compress_hook`: half
    /// the bytes, about three significant digits) or as f32 (the default).
    pub fn set_compression(&mut self, compression: Compression) {
        self.compression = compression;
    }

    /// Fails unless `len` is the parameter count: checked before any
    /// collective starts, so that the error names the buffer at fault
    /// rather than a collective's length check or a slice copy's panic.
    fn check_len(&self, what: &'static str, len: usize) -> Result<(), TrainError> {
        if len != self.shard.n {
            return Err(TrainError::BufferLength {
                what,
                len,
                expected: self.shard.n,
            });
        }
        Ok(())
    }

    /// Elements of this rank's shard, padding included: AdamW keeps two
    /// moments of this many floats.
    pub fn shard_len(&self) -> usize {
        self.shard.len
    }

    /// One whole step: the job's mean gradient of this rank's shard from
    /// every rank's `grads`, AdamW on the shard at `lr`, and every rank's
    /// updated shard into `params`. Collective.
    pub fn step(
        &mut self,
        pg: &ProcessGroup,
        grads: &[f32],
        params: &mut [f32],
        lr: f64,
    ) -> Result<Zero1Times, TrainError> {
        let t = Instant::now();
        self.reduce_scatter(pg, grads)?;
        let comm = t.elapsed();
        let t = Instant::now();
        self.update(lr)?;
        let optimizer = t.elapsed();
        let t = Instant::now();
        self.all_gather(pg, params)?;
        Ok(Zero1Times {
            comm: comm + t.elapsed(),
            optimizer,
        })
    }

    /// Step 2 of the scheme: the job's mean gradient of this rank's shard
    /// into [`Self::shard_grads_mut`]. Collective.
    pub fn reduce_scatter(&mut self, pg: &ProcessGroup, grads: &[f32]) -> Result<(), TrainError> {
        self.check_len("the gradient", grads.len())?;
        let input: &[f32] = if self.padded.is_empty() {
            grads
        } else {
            let n = grads.len();
            self.padded[..n].copy_from_slice(grads);
            self.padded[n..].fill(0.0);
            &self.padded
        };
        self.compression
            .reduce_scatter_mean(pg, input, &mut self.grads, &mut self.scratch)
            .map_err(TrainError::comm("gradient reduce_scatter"))
    }

    /// This rank's shard of the parameters and optimizer state from a
    /// checkpoint (`target`, restored), and every rank's shard into `params`
    /// (the whole model). Collective.
    pub(crate) fn restore(
        &mut self,
        pg: &ProcessGroup,
        target: &ShardTarget<'_>,
        params: &mut [f32],
    ) -> Result<(), TrainError> {
        if let Some(state) = target.optimizer_state() {
            self.opt.load_state(&state)?;
        }
        self.params.copy_from_slice(&target.params);
        self.all_gather(pg, params)
    }

    /// This rank's shard of the mean gradient (its padding is zero), for the
    /// loop to scale, check and clip.
    pub fn shard_grads_mut(&mut self) -> &mut [f32] {
        &mut self.grads
    }

    /// Step 4: AdamW on the shard's parameters with its mean gradient.
    pub fn update(&mut self, lr: f64) -> Result<(), TrainError> {
        self.opt.step(&mut self.params, &self.grads, lr)?;
        Ok(())
    }

    /// Step 5: every rank's updated shard into `params` (the whole model).
    /// Collective.
    pub fn all_gather(&mut self, pg: &ProcessGroup, params: &mut [f32]) -> Result<(), TrainError> {
        self.check_len("the parameter buffer", params.len())?;
        if self.padded.is_empty() {
            return pg
                .all_gather(&self.params, params)
                .map_err(TrainError::comm("parameter all_gather"));
        }
        pg.all_gather(&self.params, &mut self.padded)
            .map_err(TrainError::comm("parameter all_gather"))?;
        let n = self.shard.n;
        params.copy_from_slice(&self.padded[..n]);
        Ok(())
    }
}

/// ZeRO-1 as a strategy of the training loop (see the module docs).
pub(crate) struct ZeroOne<'a> {
    cfg: &'a TrainConfig,
    pg: &'a ProcessGroup,
    data: Arc<dyn Dataset>,
    model: GPT,
    /// The sharded optimizer and its buffers.
    zero: Zero1,
    batches: TrainBatches,
    /// This rank's share of the job's validation batches.
    val: ValBatches,
    start: Start,
}

impl<'a> ZeroOne<'a> {
    pub(crate) fn new(cfg: &'a TrainConfig, pg: &'a ProcessGroup) -> Result<Self, TrainError> {
        let (rank, world) = (pg.rank(), pg.size());
        let ReplicatedStart {
            data,
            mut model,
            mut header,
        } = replicated_start(cfg, pg, Sharding::Zero1 { world })?;
        let (t, n) = (data.seq_len(), model.num_params());
        let full_mask = decay_mask(model.param_views());
        let mut zero = Zero1::new(pg, model.params(), &full_mask, cfg.adamw())?;
        zero.set_compression(cfg.compression());
        // A checkpoint of any kind and world size: this rank reads its own
        // shard of it, and the ranks' shards make the model again.
        let config = model.config().clone();
        let real = zero.shard.real();
        let piece = Piece {
            start: real.start,
            end: real.end,
            at: 0,
        };
        let mut target = ShardTarget::new(&config, vec![piece], zero.shard.len);
        let state = match resume_shard(cfg, pg, &mut target, &mut header)? {
            Some(state) => {
                zero.restore(pg, &target, model.params_mut())?;
                state
            }
            None => TrainState::default(),
        };
        let shard = zero.shard;
        header.push(format!(
            "model: {} layers, {} heads, d_model {}, d_ff {}, vocab {}, seq {}: {} parameters; \
             ZeRO-1: {} shards of {} ({} padding)",
            cfg.n_layers,
            cfg.n_heads,
            cfg.d_model,
            cfg.d_ff,
            data.vocab_size(),
            t,
            n,
            world,
            shard.len,
            shard.padded() - n,
        ));
        header.push(memory_line(cfg, &model, t, Sharding::Zero1 { world }));
        header.push(global_batch_line(cfg, world, t));
        let batches = TrainBatches::new(data.clone(), cfg, world, rank, state.epoch, state.offset)?;
        let val = val_batches(&data, cfg, world, rank, cfg.eval_batches)?;
        Ok(ZeroOne {
            cfg,
            pg,
            model,
            zero,
            batches,
            val,
            start: Start {
                step: state.step,
                header,
                loss_floor: data.loss_floor(),
            },
            data,
        })
    }
}

/// What a sharded strategy starts from on each rank, before it shards
/// anything: the run's data, the whole model with rank 0's parameters, and
/// the startup lines so far.
pub(crate) struct ReplicatedStart {
    pub data: Arc<dyn Dataset>,
    pub model: GPT,
    pub header: Vec<String>,
}

/// Builds the data and the model (checked to fit in memory under
/// `sharding`, in the run's precision, with activation checkpointing as
/// asked), makes sure every rank built the same size, and broadcasts rank
/// 0's parameters. Collective.
pub(crate) fn replicated_start(
    cfg: &TrainConfig,
    pg: &ProcessGroup,
    sharding: Sharding,
) -> Result<ReplicatedStart, TrainError> {
    let data: Arc<dyn Dataset> = crate::file_data::build(cfg, pg)?.into();
    let t = data.seq_len();
    let mut header = step_loop::data_lines(&*data);
    let model_cfg = model_config(cfg, data.vocab_size())?;
    model_cfg.validate()?;
    check_memory(cfg, &model_cfg, t, pg.local_world_size(), sharding)?;
    let (mut model, init_line) = crate::train::new_model(cfg, model_cfg, pg.rank() == 0)?;
    header.extend(init_line);
    header.extend(apply_precision(cfg, |d| model.set_precision(d))?);
    header.extend(apply_checkpointing(cfg, &mut model, t));
    agree_on_size(pg, model.num_params())?;
    // Rank 0's parameters (as drawn) are every rank's.
    pg.broadcast(model.params_mut(), 0)
        .map_err(TrainError::comm("initial parameters broadcast"))?;
    Ok(ReplicatedStart {
        data,
        model,
        header,
    })
}

/// Fails unless every rank built a model of `n` parameters: the shards cut
/// one flat buffer that all ranks must agree on. Collective.
pub(crate) fn agree_on_size(pg: &ProcessGroup, n: usize) -> Result<(), TrainError> {
    let mut range = [n as i64, -(n as i64)];
    pg.all_reduce(&mut range, ReduceOp::Max)
        .map_err(TrainError::comm("parameter count all_reduce"))?;
    let (max, min) = (range[0] as usize, (-range[1]) as usize);
    if min != max {
        return Err(TrainError::ModelMismatch { min, max });
    }
    Ok(())
}

/// The norm of a gradient sharded over `pg`'s ranks, given this rank's
/// shard's norm `local`: the square root of the shards' summed squares.
/// Collective.
pub(crate) fn norm_over_shards(pg: &ProcessGroup, local: f32) -> Result<f32, TrainError> {
    let mut squares = [f64::from(local) * f64::from(local)];
    pg.all_reduce(&mut squares, ReduceOp::Sum)
        .map_err(TrainError::comm("gradient norm all_reduce"))?;
    Ok(squares[0].sqrt() as f32)
}

impl Strategy for ZeroOne<'_> {
    fn group(&self) -> &ProcessGroup {
        self.pg
    }

    fn start(&self) -> Start {
        self.start.clone()
    }

    fn gradients(&mut self, step: u64, phases: &mut Phases) -> Result<StepGradients, TrainError> {
        // Every micro-batch's gradient sums locally, the last one's too; the
        // sum is reduce-scattered once, after it.
        let (loss_sum, tokens) = step_loop::accumulate(
            &mut self.model,
            &mut self.batches,
            self.cfg,
            self.pg.rank(),
            step,
            phases,
            &mut |model, phases| {
                phases.time(Phase::Backward, || {
                    model.backward(cohort_gpt::Backward::new())
                })?;
                Ok(())
            },
        )?;
        let t = Instant::now();
        self.zero.reduce_scatter(self.pg, self.model.grads())?;
        phases.add(Phase::Comm, t.elapsed());
        Ok(StepGradients::data_parallel(
            loss_sum,
            tokens,
            self.cfg.grad_accum,
            self.pg.size(),
        ))
    }

    /// This rank's shard of the mean gradient (its padding is zero, and
    /// counts for nothing in the norm).
    fn grads_mut(&mut self) -> &mut [f32] {
        self.zero.shard_grads_mut()
    }

    /// The whole gradient's norm: the square root of the shards' summed
    /// squares.
    fn global_norm(&mut self, local: f32) -> Result<f32, TrainError> {
        norm_over_shards(self.pg, local)
    }

    fn apply(&mut self, _step: u64, lr: Option<f64>) -> Result<(), TrainError> {
        // A skipped step changes no shard: nothing to gather.
        if let Some(lr) = lr {
            self.zero.update(lr)?;
            self.zero.all_gather(self.pg, self.model.params_mut())?;
        }
        self.model.zero_grad();
        Ok(())
    }

    fn evaluate(&mut self) -> Result<f32, TrainError> {
        let mine = step_loop::batch_losses(&self.val.mine, &mut self.model)?;
        step_loop::mean_val_loss(Some(self.pg), self.val.total, &mine)
    }

    /// Each rank writes its own shard: its slice of the parameters and its moments.
    fn save(&mut self, out: &Path, step: u64) -> Result<SaveReport, TrainError> {
        let (n, world) = (self.zero.shard.n, self.zero.shard.world);
        let pieces_of = |rank: usize| {
            let real = Shard::new(n, world, rank).real();
            vec![Piece {
                start: real.start,
                end: real.end,
                at: 0,
            }]
        };
        let shard = OwnedShard {
            pieces_of: &pieces_of,
            params: &self.zero.params,
            optimizer: self.zero.opt.state(),
            strategy: "zero1",
        };
        save_shard(
            out,
            self.cfg,
            self.pg,
            &self.model,
            &shard,
            &self.batches,
            &*self.data,
            step,
        )
    }

    fn final_params(&mut self) -> Result<Vec<f32>, TrainError> {
        Ok(self.model.params().to_vec())
    }

    fn who(&self) -> String {
        format!("{} rank(s), ZeRO-1", self.pg.size())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_buffer_once_and_pad_only_at_the_end() {
        for (n, world) in [(10, 3), (9, 3), (1, 4), (7, 1), (19037, 2)] {
            let shards: Vec<Shard> = (0..world).map(|r| Shard::new(n, world, r)).collect();
            let real: usize = shards.iter().map(|s| s.real().len()).sum();
            assert_eq!(real, n, "n {n}, world {world}");
            for w in shards.windows(2) {
                assert_eq!(w[0].range().end, w[1].range().start);
                assert_eq!(w[0].real().end, w[1].real().start);
            }
            assert!(shards[0].padded() - n < world, "n {n}, world {world}");
        }
    }

    #[test]
    fn shard_masks_are_the_full_mask_cut_with_padding_exempt() {
        // Exempt 4..7 and 9..10, decayed the rest; 10 elements in 3 shards of 4.
        let full = DecayMask::with_exempt(10, [4..7, 9..10]).unwrap();
        let decayed = |m: &DecayMask| -> Vec<bool> {
            m.segments()
                .iter()
                .flat_map(|(r, d)| std::iter::repeat_n(*d, r.len()))
                .collect()
        };
        let mut joined = Vec::new();
        for rank in 0..3 {
            let s = Shard::new(10, 3, rank);
            let m = shard_mask(&full, s.range());
            assert_eq!(m.len(), 4);
            joined.extend(decayed(&m));
        }
        let mut want = decayed(&full);
        want.extend([false, false]);
        assert_eq!(joined, want);
    }
}

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
use std::time::{Duration, Instant};

use cohort_comm::ProcessGroup;
use cohort_ddp::{Compression, CompressionScratch};
use cohort_engine::optim::{AdamW, AdamWConfig, DecayMask, Optimizer};
use cohort_gpt::checkpoint::Piece;

use crate::checkpoint::{OwnedShard, ShardTarget};
use crate::error::TrainError;
use crate::replica::agree_on_size;

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

/// The model (not padding) elements of `shard`, at the start of its buffers.
fn pieces(shard: Shard) -> Vec<Piece> {
    let real = shard.real();
    vec![Piece {
        start: real.start,
        end: real.end,
        at: 0,
    }]
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
/// scheme. The data-parallel strategy ([`GradSync::Zero1`](super::GradSync))
/// runs it; callers with their own loop may drive it directly.
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

    /// Where this rank's shard lies in the model's buffer (what a resume
    /// reads into).
    pub(crate) fn pieces(&self) -> Vec<Piece> {
        pieces(self.shard)
    }

    /// Hands `save` this rank's share of a sharded checkpoint: its slice of
    /// the parameters and its moments.
    pub(crate) fn with_owned_shard<R>(&self, save: impl FnOnce(&OwnedShard<'_>) -> R) -> R {
        let Shard { n, world, .. } = self.shard;
        let pieces_of = |rank: usize| pieces(Shard::new(n, world, rank));
        save(&OwnedShard {
            pieces_of: &pieces_of,
            params: &self.params,
            optimizer: self.opt.state(),
            strategy: "zero1",
        })
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

//! ZeRO stages 2 and 3 (DeepSpeed ZeRO-2 and ZeRO-3; stage 3 is PyTorch
//! FSDP's `fully_shard` applied to every block): data parallelism whose
//! gradients (stage 2), and parameters too (stage 3), are sharded over the
//! ranks as well as the optimizer state that ZeRO-1 shards.
//!
//! Sharding by part. The model runs in parts (embeddings, each block, the
//! head), each a contiguous range of the flat parameter buffer. Each part is
//! split over the N ranks on its own, as ZeRO-1 splits the whole buffer: a
//! part of n_p parameters is padded to N x s_p, s_p = ceil(n_p / N), and rank
//! r owns its elements `r*s_p .. (r+1)*s_p` (padding is zero, and exempt from
//! weight decay). A rank's shards of all the parts, one after the other,
//! are its *flat shard* (about n / N elements): AdamW's moments, the mean
//! gradient and the parameters it updates live there. Splitting each part
//! rather than the whole buffer makes every part's collective an even split
//! that can run while the model works on another part: a reduce-scatter as
//! soon as a part's gradient is final, an all-gather just before it runs.
//!
//! Each step:
//!
//! 1. forward: stage 3 all-gathers each part's parameters into the model's
//!    buffer just before the part runs and releases them (see `pages`)
//!    right after, but the head's, whose backward comes next and uses them
//!    (FSDP does not reshard the last module either); stage 2 holds the
//!    whole model, as DDP;
//! 2. backward: stage 3 gathers and releases each part again around its
//!    backward (but the embeddings, whose backward reads no parameter); as
//!    each part's gradient becomes final, it is
//!    reduce-scattered (averaged over ranks), this rank's shard is added to
//!    the flat shard's gradient and the part's range of the model's
//!    gradient buffer is released. Every micro-batch does this (DeepSpeed's
//!    way: the shard accumulates the micro-batches), so that no more than a
//!    part of the whole gradient is ever resident, accumulation or not;
//! 3. the training loop scales, checks and clips the flat shard's gradient
//!    (the norm over all shards, as ZeRO-1);
//! 4. AdamW steps the flat shard's parameters;
//! 5. stage 2 all-gathers every part's updated shard into the model; stage
//!    3 does nothing: the next forward gathers what it needs.
//!
//! Overlap (`--overlap`, DDP's rule: on when a core is free for the
//! communication thread or the job spans nodes): stage 3 prefetches the
//! next part's all-gather while a part computes (the order of the parts is
//! the previous pass's, forward or backward), and both stages leave a
//! part's reduce-scatter running through the backward of the part before
//! it. The collectives and their order are the same either way, so the
//! results are bitwise the same.
//!
//! Checkpoints are sharded, as ZeRO-1's: at a save each rank writes its
//! flat shard (parameters and moments, with the parts' ranges it holds) and
//! rank 0 the index that commits them; nothing is gathered. A resume reads
//! any checkpoint, sharded (at any world size, by any strategy) or DDP's,
//! whole, keeps this rank's shards and frees the rest.
//!
//! This module must never keep a part's gradient beyond this rank's shard
//! once the part was reduce-scattered, never (stage 3) keep a part's
//! gathered parameters outside the part's forward or backward (but the
//! head's, from its forward to its backward, which follows it), and never
//! let one rank's parameters differ from another's after a step.

use std::collections::VecDeque;
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cohort_comm::{ProcessGroup, ReduceOp, Work};
use cohort_data::{Batch, Dataset};
use cohort_ddp::{Compression, CompressionScratch};
use cohort_engine::optim::{AdamW, AdamWConfig, DecayMask, Optimizer};
use cohort_gpt::checkpoint::Piece;
use cohort_gpt::optim_groups::decay_mask;
use cohort_gpt::{Backward, Forward, Labels, Part, PartHooks, GPT};

use crate::batches::{val_batches, TrainBatches, ValBatches};
use crate::checkpoint::{OwnedShard, SaveReport, ShardTarget, TrainState};
use crate::config::TrainConfig;
use crate::memory::Sharding;
use crate::pages::{prefer_huge_pages, release, SparePages, SPARE_PAGES_MIN_BUFFER};
use crate::phases::{Phase, Phases};
use crate::step_loop::{self, MicroBatches, Start, StepGradients, Strategy};
use crate::train::{global_batch_line, memory_line, resume_shard, save_shard};
use crate::zero::{
    agree_on_size, norm_over_shards, replicated_start, shard_mask, ReplicatedStart, Shard,
};
use crate::TrainError;

/// Which of the sharded ZeRO stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroStage {
    /// Optimizer state and gradients sharded; every rank holds the model.
    Two,
    /// Optimizer state, gradients and parameters sharded; each part's
    /// parameters are gathered only while the part runs.
    Three,
}

/// One part's place in the flat buffer and this rank's shard of it.
#[derive(Debug, Clone)]
struct PartShard {
    /// The part's range of the model's flat buffers.
    range: Range<usize>,
    /// This rank's shard of the part (`n` is the part's length).
    shard: Shard,
    /// Where the shard starts in the flat shard.
    offset: usize,
}

impl PartShard {
    /// This rank's shard of the part, in the flat shard.
    fn own(&self) -> Range<usize> {
        self.offset..self.offset + self.shard.len
    }

    /// The model (not padding) elements of this rank's shard, in the
    /// model's buffer.
    fn real_in_model(&self) -> Range<usize> {
        let r = self.shard.real();
        self.range.start + r.start..self.range.start + r.end
    }

    /// Whether the part does not divide into the ranks, so that its
    /// collectives go through a padded staging buffer.
    fn padded(&self) -> bool {
        self.shard.padded() != self.shard.n
    }
}

/// How the parts of a flat buffer are split over the ranks.
#[derive(Debug, Clone)]
struct PartShards {
    parts: Vec<PartShard>,
    /// Elements of the flat shard: the sum of the parts' shard lengths.
    len: usize,
    /// Elements of the whole buffer.
    n: usize,
}

impl PartShards {
    /// The parts `ranges` (which partition `0..n` in order) split over
    /// `world` ranks, as rank `rank` holds them.
    fn new(ranges: &[Range<usize>], world: usize, rank: usize) -> PartShards {
        let mut offset = 0;
        let parts = ranges
            .iter()
            .map(|range| {
                let shard = Shard::new(range.len(), world, rank);
                let part = PartShard {
                    range: range.clone(),
                    shard,
                    offset,
                };
                offset += shard.len;
                part
            })
            .collect();
        PartShards {
            parts,
            len: offset,
            n: ranges.last().map_or(0, |r| r.end),
        }
    }

    /// The part whose range holds `range`.
    fn find(&self, range: &Range<usize>) -> Result<&PartShard, TrainError> {
        self.parts
            .iter()
            .find(|p| p.range.start <= range.start && range.end <= p.range.end)
            .ok_or(TrainError::UnknownPart {
                start: range.start,
                end: range.end,
            })
    }

    /// This rank's flat shard of the whole buffer `full` (padding zero).
    fn take(&self, full: &[f32]) -> Vec<f32> {
        let mut flat = vec![0f32; self.len];
        for p in &self.parts {
            let real = p.real_in_model();
            flat[p.offset..p.offset + real.len()].copy_from_slice(&full[real]);
        }
        flat
    }

    /// The weight-decay mask of the flat shard, given the whole buffer's.
    fn mask(&self, full: &DecayMask) -> Result<DecayMask, TrainError> {
        let mut exempt = Vec::new();
        for p in &self.parts {
            let real = p.real_in_model();
            let m = shard_mask(full, real.clone());
            exempt.extend(
                m.segments()
                    .iter()
                    .filter(|(_, decayed)| !decayed)
                    .map(|(r, _)| p.offset + r.start..p.offset + r.end),
            );
            exempt.push(p.offset + real.len()..p.offset + p.shard.len);
        }
        exempt.retain(|r| r.start < r.end);
        Ok(DecayMask::with_exempt(self.len, exempt)?)
    }

    /// Where this rank's shards of the parts lie: each part's model elements in the
    /// model's buffer, at their place in the flat shard.
    fn pieces(&self) -> Vec<Piece> {
        (self.parts.iter())
            .map(|p| {
                let real = p.real_in_model();
                Piece {
                    start: real.start,
                    end: real.end,
                    at: p.offset,
                }
            })
            .collect()
    }

    /// The elements of the second-largest part (the largest being the
    /// embeddings, which run once a pass): a block, on a GPT.
    fn second_largest(&self) -> usize {
        let mut lens: Vec<_> = self.parts.iter().map(|p| p.range.len()).collect();
        lens.sort_unstable();
        lens.iter().rev().nth(1).copied().unwrap_or(0)
    }

    /// The largest padded part: what the staging buffer may have to hold.
    fn largest_padded(&self) -> usize {
        self.parts
            .iter()
            .map(|p| p.shard.padded())
            .max()
            .unwrap_or(0)
    }
}

/// The first `len` elements of `buf`, grown to that length if shorter.
fn staged(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}

/// What the part hooks work on: everything the model's forward and
/// backward hand to the sharded step while they run.
struct Shards {
    parts: PartShards,
    /// This rank's flat shard of the parameters, which AdamW steps.
    params: Vec<f32>,
    /// This rank's flat shard of the job's mean gradient, summed over the
    /// step's micro-batches (padding stays zero).
    grads: Vec<f32>,
    /// A padded part, for the collectives of a part that does not divide
    /// into the ranks (and a tied head's read of wte, a slice of a part);
    /// empty until one needs it.
    staging: Vec<f32>,
    /// One part's shard of a reduce-scatter, before it is added to `grads`.
    scratch: Vec<f32>,
    /// How gradients travel in the reduce-scatters (`--bf16-compress`).
    compression: Compression,
    compression_scratch: CompressionScratch,
    /// The first error inside a hook (hooks cannot return one); the
    /// collectives after it are not started.
    error: Option<TrainError>,
    /// Time spent in the collectives (with overlap: waiting for them).
    comm: Duration,
    /// The collectives in flight while the model computes (boxed: it is
    /// large and rarely touched).
    flight: Box<InFlight>,
    /// Ranges of the model's parameter buffer still holding what the last
    /// forward gathered for the head: its backward runs first, right after,
    /// and uses them instead of gathering again (FSDP's
    /// `reshard_after_forward=False` for the last module). Released before
    /// any other forward.
    kept: Vec<Range<usize>>,
    /// Whether the flat shard's gradient is all zero (cleared, and no
    /// backward has added to it since): a part's reduce-scatter then lands
    /// in it directly instead of in `scratch` and being added.
    grads_zero: bool,
    /// Pages given back by a part's parameters or gradient, or by the
    /// gradient shard at the step's end, kept resident for the next range
    /// to be filled (see [`SparePages`]): every range released and filled
    /// again each step would otherwise cost the kernel's page faults and
    /// zero-filling, on a VM several percent of a GPT-2 small step. The pool
    /// is given back before the step's peaks (the embeddings' backward and
    /// the optimizer), so the peak stays what it was.
    spare: SparePages,
    /// Whether the gradient shard is large enough for the pool.
    shard_spare: bool,
}

/// Blocks' worth of pages [`Shards::spare`] keeps besides the largest
/// part's: a block's parameters and its gradient, released just before the
/// next block's are filled. Under stage 3 it also holds the largest part's
/// (the embeddings): the gradient shard's pages, given back at the step's
/// end, hold the embeddings' parameters next, theirs the tied head's wte,
/// and wte's after the head's backward the gradient shard's parts again.
const SPARE_PARTS: usize = 2;

/// A collective in flight: (this rank's shard or a padded part in, the
/// padded part or this rank's shard out).
type PartWork = Work<(Vec<f32>, Vec<f32>)>;

/// Overlap of the collectives with the model's computation (as DDP's
/// overlap, and under the same `auto` rule): while a part computes, the
/// next part's all-gather runs (prefetch), and the reduce-scatter of the
/// part whose backward just finished runs while the part before it
/// computes its backward. The collectives are the same as without overlap,
/// issued in the same order on every rank, so the results are bitwise the
/// same; only the waiting moves.
#[derive(Default)]
struct InFlight {
    /// Whether to overlap at all.
    on: bool,
    /// The pass being run (0: forward, 1: backward), if any.
    pass: Option<usize>,
    /// The ranges each kind of pass gathered last time, in order: every
    /// pass of a kind gathers the same ones, so the range after the one
    /// just gathered is the one to prefetch.
    trace: [Vec<Range<usize>>; 2],
    /// The ranges the current pass gathered so far.
    recording: Vec<Range<usize>>,
    /// The prefetched all-gather: the part's range and its work.
    gather: Option<(Range<usize>, PartWork)>,
    /// Reduce-scatters not yet added to the flat shard's gradient: the
    /// part's shard in the flat shard, and its work.
    reduces: VecDeque<(Range<usize>, PartWork)>,
    /// Buffers that finished works handed back, for the next ones.
    spare: Vec<Vec<f32>>,
}

/// Reduce-scatters left in flight when the next one starts: one, so that
/// each overlaps the backward of the part before it, and at most two parts'
/// gradients are held besides the shard's.
const REDUCES_IN_FLIGHT: usize = 1;

/// Spare buffers kept for the works (each at most a padded part).
const SPARES: usize = 2;

/// A part whose shard is at least this many elements (the embeddings of a
/// GPT-2-sized vocabulary) is reduce-scattered [`REDUCE_PIECE`] elements of
/// each rank's slot at a time, each piece of its gradient released as soon
/// as it is sent: its gradient and its new shard are then never resident
/// whole together, which is the step's memory peak (the end of backward).
const PIECEWISE_SLOT: usize = 4 * REDUCE_PIECE;

/// Elements of each rank's slot one piece of a piecewise reduce-scatter
/// carries (8 MB): large enough that the collective runs at full speed,
/// small enough that the staging copy costs no memory to speak of.
const REDUCE_PIECE: usize = 2 << 20;

impl InFlight {
    /// A buffer of `len` elements (contents unspecified), reusing a spare.
    fn buffer(&mut self, len: usize) -> Vec<f32> {
        let mut buf = self.spare.pop().unwrap_or_default();
        buf.resize(len, 0.0);
        buf
    }

    /// Keeps `buf` for a later work, unless enough are kept.
    fn recycle(&mut self, buf: Vec<f32>) {
        if self.spare.len() < SPARES {
            self.spare.push(buf);
        }
    }
}

impl Shards {
    /// Every rank's shard of the part holding `range` into `dest`, exactly
    /// `range` of the model's buffer (from the prefetched all-gather when it
    /// fetched that part); within a pass, the next range is prefetched.
    /// Collective.
    fn gather(&mut self, pg: &ProcessGroup, range: Range<usize>, dest: &mut [f32]) {
        if self.error.is_some() {
            return;
        }
        let t = Instant::now();
        let result = self.gather_now(pg, &range, dest);
        self.comm += t.elapsed();
        if let Err(e) = result {
            self.error = Some(e);
            return;
        }
        if let Some(pass) = self.flight.pass {
            self.flight.recording.push(range);
            let next = self.flight.trace[pass]
                .get(self.flight.recording.len())
                .cloned();
            if let Some(next) = next.filter(|_| self.flight.on) {
                self.prefetch(pg, &next);
            }
        }
    }

    /// Starts the all-gather of the part holding `range`.
    fn prefetch(&mut self, pg: &ProcessGroup, range: &Range<usize>) {
        let Ok(p) = self.parts.find(range).cloned() else {
            return;
        };
        let mut own = self.flight.buffer(p.shard.len);
        own.copy_from_slice(&self.params[p.own()]);
        let whole = self.flight.buffer(p.shard.padded());
        self.flight.gather = Some((p.range.clone(), pg.all_gather_async(own, whole)));
    }

    /// [`Shards::gather`]'s collective: the prefetched one if it fetched the
    /// part holding `range`, else one now (after waiting out a prefetch that
    /// fetched another part: the ranks all run the same passes, so they all
    /// mispredict alike).
    fn gather_now(
        &mut self,
        pg: &ProcessGroup,
        range: &Range<usize>,
        dest: &mut [f32],
    ) -> Result<(), TrainError> {
        let comm = TrainError::comm("parameter all_gather");
        let p = self.parts.find(range)?.clone();
        if let Some((fetched, work)) = self.flight.gather.take() {
            let (own, whole) = work.wait().map_err(&comm)?;
            self.flight.recycle(own);
            if fetched == p.range {
                let at = range.start - p.range.start;
                dest.copy_from_slice(&whole[at..at + range.len()]);
                self.flight.recycle(whole);
                return Ok(());
            }
            self.flight.recycle(whole);
        }
        {
            let own = &self.params[p.own()];
            let comm = TrainError::comm("parameter all_gather");
            if *range == p.range && !p.padded() {
                return pg.all_gather(own, dest).map_err(comm);
            }
            if *range != p.range {
                return self.gather_slice(pg, &p, range, dest);
            }
            let whole = staged(&mut self.staging, p.shard.padded());
            pg.all_gather(own, whole).map_err(comm)?;
            dest.copy_from_slice(&whole[..range.len()]);
            Ok(())
        }
    }

    /// `range`, a slice of part `p` (a tied head's read of wte, in the
    /// embeddings part), into `dest`: each rank's share of the slice
    /// broadcast by it straight into place, rather than the whole part (the
    /// largest of all) gathered into staging and copied. Collective.
    fn gather_slice(
        &self,
        pg: &ProcessGroup,
        p: &PartShard,
        range: &Range<usize>,
        dest: &mut [f32],
    ) -> Result<(), TrainError> {
        let len = p.shard.len;
        for root in 0..p.shard.world {
            let owned =
                p.range.start + root * len..(p.range.start + (root + 1) * len).min(p.range.end);
            let (lo, hi) = (owned.start.max(range.start), owned.end.min(range.end));
            if lo >= hi {
                continue;
            }
            let piece = &mut dest[lo - range.start..hi - range.start];
            if root == p.shard.rank {
                let at = p.offset + (lo - owned.start);
                piece.copy_from_slice(&self.params[at..at + piece.len()]);
            }
            pg.broadcast(piece, root)
                .map_err(TrainError::comm("parameter broadcast"))?;
        }
        Ok(())
    }

    /// Starts a pass of the model (0: forward, 1: backward) whose gathers
    /// are traced, the first one prefetched when the last pass of the kind
    /// says what it is.
    fn begin_pass(&mut self, pg: &ProcessGroup, pass: usize) {
        self.flight.pass = Some(pass);
        self.flight.recording.clear();
        let first = self.flight.trace[pass].first().cloned();
        if let Some(first) = first.filter(|_| self.flight.on && self.error.is_none()) {
            self.prefetch(pg, &first);
        }
    }

    /// Ends the pass: waits for what is still in flight (its reduce-scatters
    /// added to the shard's gradient) and keeps the pass's trace.
    fn end_pass(&mut self) {
        let t = Instant::now();
        self.finish_reduces(0);
        if let Some((_, work)) = self.flight.gather.take() {
            match work.wait() {
                Ok((own, whole)) => {
                    self.flight.recycle(own);
                    self.flight.recycle(whole);
                }
                Err(e) => self.fail(TrainError::comm("parameter all_gather")(e)),
            }
        }
        self.comm += t.elapsed();
        // The staging copies are as large as the largest part (the
        // embeddings): needed again only in the next pass, so not held
        // through the other pass's peak.
        release(&mut self.staging);
        release(&mut self.scratch);
        if let Some(pass) = self.flight.pass.take() {
            self.flight.trace[pass] = std::mem::take(&mut self.flight.recording);
        }
    }

    /// Waits for the reduce-scatters in flight beyond the newest `keep`,
    /// oldest first, adding each to the flat shard's gradient.
    fn finish_reduces(&mut self, keep: usize) {
        while self.flight.reduces.len() > keep {
            let Some((own, work)) = self.flight.reduces.pop_front() else {
                break;
            };
            match work.wait() {
                Ok((whole, out)) => {
                    if self.error.is_none() {
                        for (g, x) in self.grads[own].iter_mut().zip(out.iter()) {
                            *g += x;
                        }
                    }
                    self.flight.recycle(whole);
                    self.flight.recycle(out);
                }
                Err(e) => self.fail(TrainError::comm("gradient reduce_scatter")(e)),
            }
        }
    }

    /// Keeps the first error.
    fn fail(&mut self, e: TrainError) {
        self.error.get_or_insert(e);
    }

    /// The part `range`'s gradient `grads` (this rank's, final for this
    /// backward) averaged over ranks; this rank's shard of it is added to
    /// the flat shard's gradient, and `grads` released. Collective.
    fn reduce(&mut self, pg: &ProcessGroup, range: Range<usize>, grads: &mut [f32]) {
        let mut released = false;
        if self.error.is_none() {
            let t = Instant::now();
            let result = self.reduce_now(pg, range, grads);
            self.comm += t.elapsed();
            match result {
                Ok(done) => released = done,
                Err(e) => self.fail(e),
            }
        }
        // Zero for the next backward, which accumulates into it.
        if !released {
            self.spare.release(grads);
        }
    }

    /// [`Shards::reduce`]'s collective: started and left in flight with
    /// overlap, else run now and added to the flat shard's gradient.
    /// Returns whether `grads` was released on the way.
    fn reduce_now(
        &mut self,
        pg: &ProcessGroup,
        range: Range<usize>,
        grads: &mut [f32],
    ) -> Result<bool, TrainError> {
        let p = self.parts.find(&range)?.clone();
        if range != p.range {
            return Err(TrainError::UnknownPart {
                start: range.start,
                end: range.end,
            });
        }
        let comm = TrainError::comm("gradient reduce_scatter");
        if self.flight.on {
            // The work owns a copy, so that `grads` is released now.
            let mut whole = self.flight.buffer(p.shard.padded());
            whole[..grads.len()].copy_from_slice(grads);
            whole[grads.len()..].fill(0.0);
            let out = self.flight.buffer(p.shard.len);
            let work = pg.reduce_scatter_async(whole, out, ReduceOp::Avg);
            self.flight.reduces.push_back((p.own(), work));
            self.finish_reduces(REDUCES_IN_FLIGHT);
            return Ok(false);
        }
        let into_shard = self.grads_zero;
        let out = if into_shard {
            let out = &mut self.grads[p.own()];
            if self.shard_spare {
                // Released at the step's end, and overwritten whole now.
                self.spare.refill(out, false);
            }
            out
        } else {
            staged(&mut self.scratch, p.shard.len)
        };
        let (how, scratch) = (self.compression, &mut self.compression_scratch);
        let in_pieces = p.shard.len >= PIECEWISE_SLOT;
        if in_pieces {
            let (slot, world, len) = (p.shard.len, p.shard.world, grads.len());
            for start in (0..slot).step_by(REDUCE_PIECE) {
                let k = REDUCE_PIECE.min(slot - start);
                // Slot s's piece, for each rank s, clipped to the part
                // (the last slot may end in padding).
                let piece = |s: usize| (s * slot + start).min(len)..(s * slot + start + k).min(len);
                let whole = staged(&mut self.staging, world * k);
                for (s, dst) in whole.chunks_mut(k).enumerate() {
                    let src = &grads[piece(s)];
                    dst[..src.len()].copy_from_slice(src);
                    dst[src.len()..].fill(0.0);
                }
                how.reduce_scatter_mean(pg, whole, &mut out[start..start + k], scratch)
                    .map_err(&comm)?;
                for s in 0..world {
                    release(&mut grads[piece(s)]);
                }
            }
        } else if p.padded() {
            let whole = staged(&mut self.staging, p.shard.padded());
            whole[..grads.len()].copy_from_slice(grads);
            whole[grads.len()..].fill(0.0);
            how.reduce_scatter_mean(pg, whole, out, scratch)
                .map_err(comm)?;
        } else {
            how.reduce_scatter_mean(pg, grads, out, scratch)
                .map_err(comm)?;
        }
        if !into_shard {
            for (g, x) in self.grads[p.own()].iter_mut().zip(self.scratch.iter()) {
                *g += x;
            }
        }
        Ok(in_pieces)
    }

    /// The first error a hook met, clearing it.
    fn check(&mut self) -> Result<(), TrainError> {
        self.error.take().map_or(Ok(()), Err)
    }
}

/// Locks the hooks' state (a panic elsewhere cannot leave it half-written
/// in a way that matters: the run fails with the panic).
fn lock(st: &Mutex<Shards>) -> MutexGuard<'_, Shards> {
    st.lock().unwrap_or_else(|e| e.into_inner())
}

/// Releases the parameters the last forward kept for the head's backward.
fn release_kept(st: &mut Shards, model: &mut GPT) {
    for range in st.kept.drain(..) {
        st.spare.release(&mut model.params_mut()[range]);
    }
}

/// The part hooks: a part's gradient made resident again (from the spare
/// pages) just before its backward writes it; under stage 3 also each part's
/// parameters gathered before it runs and released after (the head's after
/// its backward: its forward is last and its backward first, so what its
/// forward gathered serves both).
struct PartMemory<'s> {
    pg: &'s ProcessGroup,
    st: &'s Mutex<Shards>,
    /// Stage 3: the parameters are sharded too.
    gather: bool,
}

impl PartHooks for PartMemory<'_> {
    fn before(&mut self, _: Part, range: Range<usize>, params: &mut [f32]) {
        if !self.gather {
            return;
        }
        let mut st = lock(self.st);
        if let Some(i) = st.kept.iter().position(|k| *k == range) {
            // The head's parameters, kept from its forward.
            st.kept.swap_remove(i);
            return;
        }
        // The gather overwrites every element, so the spare pages' old
        // contents need no zeroing.
        st.spare.refill(params, false);
        st.gather(self.pg, range, params);
    }

    fn after(&mut self, part: Part, range: Range<usize>, params: &mut [f32]) {
        if !self.gather {
            return;
        }
        let mut st = lock(self.st);
        if part == Part::Head && st.flight.pass == Some(0) {
            st.kept.push(range);
            return;
        }
        st.spare.release(params);
    }

    fn before_grads(&mut self, part: Part, _: Range<usize>, grads: &mut [f32]) {
        // Released after the last reduce-scatter, so all zeros, as the
        // backward needs them: zero again what the spare pages bring.
        let mut st = lock(self.st);
        st.spare.refill(grads, true);
        if part == Part::Embeddings {
            // The backward's last part: nothing is refilled after it this
            // step, and the step's peak (the whole gradient shard written,
            // wte's gradient held) lies here.
            st.spare.give_back();
        }
    }
}

/// ZeRO-2 or ZeRO-3 over a [`GPT`]: this rank's flat shard of the
/// parameters, the mean gradient and AdamW's moments, and the passes that
/// gather and reduce-scatter around the model's parts. The training
/// strategy below runs it inside the training loop; `cohort bench ddp
/// --strategy zero2|zero3` drives it directly.
pub struct ShardedDp {
    stage: ZeroStage,
    st: Mutex<Shards>,
    /// AdamW over the flat shard.
    opt: AdamW,
}

impl ShardedDp {
    /// ZeRO `stage` over `model`, whose parameters must be the same on
    /// every rank (broadcast them first), with AdamW configured by `adamw`.
    /// Stage 3 releases the model's parameter buffer: from now on only
    /// [`ShardedDp::forward`] and [`ShardedDp::backward`] fill it, part by
    /// part. Collective: fails on every rank unless every rank built the
    /// same model.
    pub fn new(
        pg: &ProcessGroup,
        model: &mut GPT,
        stage: ZeroStage,
        adamw: AdamWConfig,
    ) -> Result<ShardedDp, TrainError> {
        agree_on_size(pg, model.num_params())?;
        let ranges: Vec<_> = model.parts().iter().map(|&p| model.part_range(p)).collect();
        let parts = PartShards::new(&ranges, pg.size(), pg.rank());
        let opt = AdamW::new(adamw, parts.mask(&decay_mask(model.param_views()))?)?;
        let params = parts.take(model.params());
        let f32s = std::mem::size_of::<f32>();
        let mut spare = SPARE_PARTS * parts.second_largest() * f32s;
        if stage == ZeroStage::Three {
            spare += parts.largest_padded() * f32s;
        }
        let big_enough = |floats: usize| floats * f32s >= SPARE_PAGES_MIN_BUFFER;
        let spare = SparePages::new(if big_enough(parts.n) { spare } else { 0 });
        let shard_spare = big_enough(parts.len);
        if stage == ZeroStage::Three {
            release(model.params_mut());
        }
        // Nothing of the gradient buffer is kept: each part's is released
        // once reduce-scattered.
        release(model.grads_mut());
        prefer_huge_pages(model.grads_mut());
        if stage == ZeroStage::Three {
            prefer_huge_pages(model.params_mut());
        }
        Ok(ShardedDp {
            stage,
            st: Mutex::new(Shards {
                grads: {
                    let mut g = vec![0f32; parts.len];
                    prefer_huge_pages(&mut g);
                    g
                },
                parts,
                params,
                staging: Vec::new(),
                scratch: Vec::new(),
                compression: Compression::None,
                compression_scratch: CompressionScratch::default(),
                error: None,
                comm: Duration::ZERO,
                flight: Box::default(),
                kept: Vec::new(),
                grads_zero: true,
                spare,
                shard_spare,
            }),
            opt,
        })
    }

    /// Overlaps the collectives with the model's computation (off at
    /// first): each part's all-gather prefetched while the part before it
    /// computes, each part's reduce-scatter left running while the part
    /// before it computes its backward. The results are bitwise those
    /// without overlap. Decide as DDP does ([`crate::Overlap::enabled`]):
    /// the communication thread needs a core of its own.
    pub fn set_overlap(&mut self, on: bool) {
        let st = self.shards_mut();
        st.flight.on = on && st.compression == Compression::None;
    }

    /// Sends the gradients as bf16 (PyTorch's `bf16_compress_hook`: half
    /// the bytes, about three significant digits) or as f32 (the default).
    /// Compression turns overlap off: compressed reduce-scatters run in
    /// place, between the model's parts.
    pub fn set_compression(&mut self, compression: Compression) {
        let st = self.shards_mut();
        st.compression = compression;
        if compression != Compression::None {
            st.flight.on = false;
        }
    }

    /// Which stage this is.
    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// Elements of this rank's flat shard, padding included: AdamW keeps
    /// two moments of this many floats, and the mean gradient one.
    pub fn shard_len(&self) -> usize {
        self.shards().parts.len
    }

    /// Elements of the largest part, padded: the most a part's collective
    /// stages besides the model's buffers.
    pub fn largest_part(&self) -> usize {
        self.shards().parts.largest_padded()
    }

    fn shards(&self) -> MutexGuard<'_, Shards> {
        lock(&self.st)
    }

    fn shards_mut(&mut self) -> &mut Shards {
        self.st.get_mut().unwrap_or_else(|e| e.into_inner())
    }

    /// The model's forward (as [`GPT::forward_labels`]), stage 3 gathering
    /// each part's parameters around it. Collective under stage 3.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        pg: &ProcessGroup,
        model: &mut GPT,
        input_ids: &[u32],
        attention_mask: Option<&[u8]>,
        labels: Option<Labels<'_>>,
        b: usize,
        t: usize,
    ) -> Result<Option<f32>, TrainError> {
        if self.stage == ZeroStage::Two {
            return Ok(model.forward(
                Forward::new(input_ids, b, t)
                    .attention_mask(attention_mask)
                    .labels(labels),
            )?);
        }
        let shards = self.shards_mut();
        release_kept(shards, model);
        shards.begin_pass(pg, 0);
        let hooks = &mut PartMemory {
            pg,
            st: &self.st,
            gather: true,
        };
        let pass = Forward::new(input_ids, b, t)
            .attention_mask(attention_mask)
            .labels(labels)
            .parts(hooks);
        let loss = model.forward(pass);
        let shards = self.shards_mut();
        shards.end_pass();
        shards.check()?;
        Ok(loss?)
    }

    /// The backward of the last forward: each part's gradient, as soon as it
    /// is final, reduce-scattered and added to this rank's flat shard of the
    /// gradient, the rest released (stage 3 gathering each part's
    /// parameters around its backward). Returns the time spent in the
    /// collectives. Collective.
    pub fn backward(&mut self, pg: &ProcessGroup, model: &mut GPT) -> Result<Duration, TrainError> {
        let shards = self.shards_mut();
        shards.comm = Duration::ZERO;
        shards.begin_pass(pg, 1);
        let st = &self.st;
        let ready = |range: Range<usize>, grads: &mut [f32]| lock(st).reduce(pg, range, grads);
        let gather = self.stage == ZeroStage::Three;
        let hooks = &mut PartMemory { pg, st, gather };
        let done = model.backward(Backward::new().parts(hooks).on_ready(ready));
        let shards = self.shards_mut();
        shards.end_pass();
        // Nothing more is filled before the optimizer, which runs at the
        // step's peak; the gradient shard's pages are parked after it.
        shards.spare.give_back();
        shards.grads_zero = false;
        // Used by the head's backward; anything else kept is stale.
        release_kept(shards, model);
        shards.check()?;
        done?;
        Ok(shards.comm)
    }

    /// This rank's flat shard of the mean gradient, summed over the
    /// backwards since [`ShardedDp::clear_grads`] (padding zero): for the
    /// loop to scale, check and clip.
    pub fn shard_grads_mut(&mut self) -> &mut [f32] {
        let st = self.shards_mut();
        st.grads_zero = false;
        &mut st.grads
    }

    /// Zeroes the flat shard's gradient, for the next step's backwards. Its
    /// pages go back to the system rather than being written with zeros: a
    /// part's shard is resident again only once backward adds to it, so the
    /// head's backward, the peak of a tied model (wte and its gradient held
    /// whole), does not also hold the gradient shards of parts not reached yet.
    /// (Some are kept for the next forward's first gathers: see
    /// [`Shards::spare`].)
    pub fn clear_grads(&mut self) {
        let st = self.shards_mut();
        if st.shard_spare {
            st.spare.release(&mut st.grads);
        } else {
            release(&mut st.grads);
        }
        st.grads_zero = true;
    }

    /// This rank's flat shard of the parameters and optimizer state from a
    /// checkpoint (`target`, restored); stage 2 then all-gathers every part
    /// into `model`. Collective under stage 2.
    pub(crate) fn restore(
        &mut self,
        pg: &ProcessGroup,
        model: &mut GPT,
        target: &ShardTarget<'_>,
    ) -> Result<(), TrainError> {
        if let Some(state) = target.optimizer_state() {
            self.opt.load_state(&state)?;
        }
        self.shards_mut().params.copy_from_slice(&target.params);
        if self.stage == ZeroStage::Two {
            self.gather_model(pg, model)?;
        }
        Ok(())
    }

    /// Every part's shards into `model`'s parameters (stage 2 holds the
    /// whole model). Returns the time spent in the collectives. Collective.
    fn gather_model(&mut self, pg: &ProcessGroup, model: &mut GPT) -> Result<Duration, TrainError> {
        let st = self.shards_mut();
        st.comm = Duration::ZERO;
        let ranges: Vec<_> = st.parts.parts.iter().map(|p| p.range.clone()).collect();
        let params = model.params_mut();
        for range in ranges {
            st.gather(pg, range.clone(), &mut params[range]);
        }
        st.check()?;
        Ok(st.comm)
    }

    /// AdamW on the flat shard at `lr`; stage 2 then all-gathers every
    /// part's updated shard into `model`. Returns the time spent in the
    /// collectives. Collective under stage 2.
    pub fn update(
        &mut self,
        pg: &ProcessGroup,
        model: &mut GPT,
        lr: f64,
    ) -> Result<Duration, TrainError> {
        let Shards { params, grads, .. } = self.st.get_mut().unwrap_or_else(|e| e.into_inner());
        self.opt.step(params, grads, lr)?;
        if self.stage == ZeroStage::Three {
            return Ok(Duration::ZERO);
        }
        self.gather_model(pg, model)
    }

    /// The whole model's parameters, on every rank. Collective.
    pub fn gather_params(&mut self, pg: &ProcessGroup) -> Result<Vec<f32>, TrainError> {
        let st = self.shards_mut();
        let mut whole = vec![0f32; st.parts.n];
        let ranges: Vec<_> = st.parts.parts.iter().map(|p| p.range.clone()).collect();
        for range in ranges {
            st.gather(pg, range.clone(), &mut whole[range]);
        }
        st.check()?;
        Ok(whole)
    }
}

/// ZeRO-2 or ZeRO-3 as a strategy of the training loop (see the module docs).
pub(crate) struct ZeroSharded<'a> {
    cfg: &'a TrainConfig,
    pg: &'a ProcessGroup,
    data: Arc<dyn Dataset>,
    model: GPT,
    zero: ShardedDp,
    batches: TrainBatches,
    /// This rank's share of the job's validation batches.
    val: ValBatches,
    start: Start,
}

/// The memory accounting's name for `stage` over `world` ranks.
fn sharding(stage: ZeroStage, world: usize) -> Sharding {
    match stage {
        ZeroStage::Two => Sharding::Zero2 { world },
        ZeroStage::Three => Sharding::Zero3 { world },
    }
}

impl<'a> ZeroSharded<'a> {
    pub(crate) fn new(
        cfg: &'a TrainConfig,
        pg: &'a ProcessGroup,
        stage: ZeroStage,
    ) -> Result<Self, TrainError> {
        let (rank, world) = (pg.rank(), pg.size());
        let sharding = sharding(stage, world);
        let ReplicatedStart {
            data,
            mut model,
            mut header,
        } = replicated_start(cfg, pg, sharding)?;
        let (t, n) = (data.seq_len(), model.num_params());
        let mut zero = ShardedDp::new(pg, &mut model, stage, cfg.adamw())?;
        zero.set_compression(cfg.compression());
        let threads = model.backend().num_threads();
        // Compressed reduce-scatters run in place (see `set_compression`).
        let overlap =
            cfg.overlap.enabled(world, pg.local_world_size(), threads) && !cfg.bf16_compress;
        zero.set_overlap(overlap);
        // A checkpoint of any kind and world size: this rank reads its own
        // shards of it.
        let config = model.config().clone();
        let pieces = zero.shards().parts.pieces();
        let mut target = ShardTarget::new(&config, pieces, zero.shard_len());
        let state = match resume_shard(cfg, pg, &mut target, &mut header)? {
            Some(state) => {
                zero.restore(pg, &mut model, &target)?;
                state
            }
            None => TrainState::default(),
        };
        let (name, what) = match stage {
            ZeroStage::Two => ("ZeRO-2", "optimizer state and gradients"),
            ZeroStage::Three => ("ZeRO-3", "parameters, gradients and optimizer state"),
        };
        header.push(format!(
            "model: {} layers, {} heads, d_model {}, d_ff {}, vocab {}, seq {}: {} parameters; \
             {name}: {what} in {} shards by part, {} elements per rank ({} padding); \
             overlap {}",
            cfg.n_layers,
            cfg.n_heads,
            cfg.d_model,
            cfg.d_ff,
            data.vocab_size(),
            t,
            n,
            world,
            zero.shard_len(),
            zero.shard_len() * world - n,
            if overlap { "on" } else { "off" },
        ));
        header.push(memory_line(cfg, &model, t, sharding));
        header.push(global_batch_line(cfg, world, t));
        let batches = TrainBatches::new(data.clone(), cfg, world, rank, state.epoch, state.offset)?;
        let val = val_batches(&data, cfg, world, rank, cfg.eval_batches)?;
        Ok(ZeroSharded {
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

/// The loop's micro-batches through a [`ShardedDp`]: every backward
/// reduce-scatters (the shard accumulates the micro-batches).
struct Passes<'z> {
    pg: &'z ProcessGroup,
    zero: &'z mut ShardedDp,
}

impl MicroBatches for Passes<'_> {
    fn forward(&mut self, model: &mut GPT, batch: &Batch) -> Result<Option<f32>, TrainError> {
        forward_batch(self.zero, self.pg, model, batch)
    }

    fn backward(
        &mut self,
        model: &mut GPT,
        _: bool,
        phases: &mut Phases,
    ) -> Result<(), TrainError> {
        let t = Instant::now();
        let comm = self.zero.backward(self.pg, model)?;
        phases.add(Phase::Backward, t.elapsed().saturating_sub(comm));
        phases.add(Phase::Comm, comm);
        Ok(())
    }
}

/// `batch`'s forward with next-token targets through `zero`.
fn forward_batch(
    zero: &mut ShardedDp,
    pg: &ProcessGroup,
    model: &mut GPT,
    batch: &Batch,
) -> Result<Option<f32>, TrainError> {
    zero.forward(
        pg,
        model,
        &batch.input_ids,
        step_loop::padding_mask(batch),
        Some(Labels::Next(&batch.targets)),
        batch.batch,
        batch.seq,
    )
}

impl Strategy for ZeroSharded<'_> {
    fn group(&self) -> &ProcessGroup {
        self.pg
    }

    fn start(&self) -> Start {
        self.start.clone()
    }

    fn gradients(&mut self, step: u64, phases: &mut Phases) -> Result<StepGradients, TrainError> {
        let passes = &mut Passes {
            pg: self.pg,
            zero: &mut self.zero,
        };
        let (loss_sum, tokens) = step_loop::accumulate_with(
            &mut self.model,
            &mut self.batches,
            self.cfg,
            self.pg.rank(),
            step,
            phases,
            passes,
        )?;
        Ok(StepGradients::data_parallel(
            loss_sum,
            tokens,
            self.cfg.grad_accum,
            self.pg.size(),
        ))
    }

    /// This rank's flat shard of the mean gradient (its padding is zero,
    /// and counts for nothing in the norm).
    fn grads_mut(&mut self) -> &mut [f32] {
        self.zero.shard_grads_mut()
    }

    fn global_norm(&mut self, local: f32) -> Result<f32, TrainError> {
        norm_over_shards(self.pg, local)
    }

    fn apply(&mut self, _step: u64, lr: Option<f64>) -> Result<(), TrainError> {
        // A skipped step changes no shard: nothing to gather.
        if let Some(lr) = lr {
            self.zero.update(self.pg, &mut self.model, lr)?;
        }
        // The model's gradient buffer is already zero (released part by
        // part); zeroing it here would only bring its pages back.
        self.zero.clear_grads();
        Ok(())
    }

    fn evaluate(&mut self) -> Result<f32, TrainError> {
        let (zero, pg) = (&mut self.zero, self.pg);
        // Stage 3's forward is collective, but the job's validation batches
        // need not share out evenly: a rank with fewer runs forwards whose
        // results it drops, until every rank has run as many as the busiest.
        let mut most = [self.val.mine.len() as i64];
        if zero.stage() == ZeroStage::Three {
            pg.all_reduce(&mut most, ReduceOp::Max)
                .map_err(TrainError::comm("val batch count all_reduce"))?;
        }
        let mine = step_loop::batch_losses_with(&self.val.mine, &mut self.model, &mut |m, b| {
            forward_batch(zero, pg, m, b)
        })?;
        self.model.set_training(false);
        for _ in self.val.mine.len() as i64..most[0] {
            let ran = match self.val.mine.first() {
                Some((_, batch)) => forward_batch(zero, pg, &mut self.model, batch),
                None => zero.forward(pg, &mut self.model, &[0], None, None, 1, 1),
            };
            ran?;
        }
        self.model.set_training(true);
        step_loop::mean_val_loss(Some(self.pg), self.val.total, &mine)
    }

    /// Each rank writes its own flat shard: parameters and moments.
    fn save(&mut self, out: &Path, step: u64) -> Result<SaveReport, TrainError> {
        let (stage, world) = (self.zero.stage(), self.pg.size());
        let st = lock(&self.zero.st);
        let ranges: Vec<_> = st.parts.parts.iter().map(|p| p.range.clone()).collect();
        let pieces_of = |rank: usize| PartShards::new(&ranges, world, rank).pieces();
        let shard = OwnedShard {
            pieces_of: &pieces_of,
            params: &st.params,
            optimizer: self.zero.opt.state(),
            strategy: match stage {
                ZeroStage::Two => "zero2",
                ZeroStage::Three => "zero3",
            },
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
        match self.zero.stage() {
            ZeroStage::Two => Ok(self.model.params().to_vec()),
            ZeroStage::Three => self.zero.gather_params(self.pg),
        }
    }

    fn who(&self) -> String {
        let stage = match self.zero.stage() {
            ZeroStage::Two => 2,
            ZeroStage::Three => 3,
        };
        format!("{} rank(s), ZeRO-{stage}", self.pg.size())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_shards_take_and_pieces_are_inverse_with_padding_per_part() {
        // Parts of 5, 7 and 4 elements over 3 ranks: shards of 2, 3 and 2.
        let ranges = [0..5, 5..12, 12..16];
        let full: Vec<f32> = (0..16).map(|i| i as f32 + 1.0).collect();
        let world = 3;
        let shards: Vec<_> = (0..world)
            .map(|r| PartShards::new(&ranges, world, r))
            .collect();
        assert_eq!(shards[0].len, 7);
        let gathered: Vec<f32> = shards.iter().flat_map(|s| s.take(&full)).collect();
        assert_eq!(&gathered[..7], &[1.0, 2.0, 6.0, 7.0, 8.0, 13.0, 14.0]);
        // The last rank's shards end in padding.
        assert_eq!(&gathered[14..], &[5.0, 0.0, 12.0, 0.0, 0.0, 0.0, 0.0]);
        // Every rank's pieces put back where they belong make the whole buffer.
        let mut back = vec![0f32; 16];
        for (rank, shard) in shards.iter().enumerate() {
            let flat = &gathered[rank * 7..(rank + 1) * 7];
            for p in shard.pieces() {
                back[p.start..p.end].copy_from_slice(&flat[p.at..p.at + p.end - p.start]);
            }
        }
        assert_eq!(back, full);
    }

    #[test]
    fn the_flat_shards_mask_is_each_parts_cut_with_padding_exempt() {
        let ranges = [0..5, 5..12];
        let full = DecayMask::with_exempt(12, std::iter::once(3..6)).unwrap();
        let decayed = |m: &DecayMask| -> Vec<bool> {
            m.segments()
                .iter()
                .flat_map(|(r, d)| std::iter::repeat_n(*d, r.len()))
                .collect()
        };
        let want = [
            // rank 0: 0,1 | 5,6,7 ; rank 1: 2,3 | 8,9,10 ; rank 2: 4,pad | 11,pad,pad
            vec![true, true, false, true, true],
            vec![true, false, true, true, true],
            vec![false, false, true, false, false],
        ];
        for (rank, want) in want.iter().enumerate() {
            let m = PartShards::new(&ranges, 3, rank).mask(&full).unwrap();
            assert_eq!(&decayed(&m), want, "rank {rank}");
        }
    }
}

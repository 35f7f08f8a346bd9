//! The state the sharded passes work on while the model runs (the flat
//! shard's parameters and gradient, staging buffers, the collectives in
//! flight), and the two collectives: a part's parameters all-gathered
//! (prefetched with overlap) and a unit's gradient reduce-scattered into
//! the flat shard (left in flight with overlap, piece by piece for the
//! largest unit). It never decides when a part runs: the model's part hooks do.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cohort_comm::{ProcessGroup, ReduceOp, Work};
use cohort_ddp::{bf16_shares, Compression, CompressionScratch};
use cohort_gpt::GPT;
use half::bf16;

use super::parts::{staged, PartShard, PartShards, UnitShard};
use crate::error::TrainError;
use crate::pages::{release, SparePages};

/// What the part hooks work on: everything the model's forward and
/// backward hand to the sharded step while they run.
pub(super) struct Shards {
    pub(super) parts: PartShards,
    /// This rank's flat shard of the parameters, which AdamW steps.
    pub(super) params: Vec<f32>,
    /// This rank's flat shard of the job's mean gradient, summed over the
    /// step's micro-batches (padding stays zero).
    pub(super) grads: Vec<f32>,
    /// A padded part, for the collectives of a part that does not divide
    /// into the ranks (and a tied head's read of wte, a slice of a part);
    /// empty until one needs it.
    pub(super) staging: Vec<f32>,
    /// One part's shard of a reduce-scatter, before it is added to `grads`.
    pub(super) scratch: Vec<f32>,
    /// How gradients travel in the reduce-scatters (`--bf16-compress`).
    pub(super) compression: Compression,
    pub(super) compression_scratch: CompressionScratch,
    /// A range's bf16 shares, for its reduce to the rank that owns it.
    pub(super) bf16_scratch: Vec<bf16>,
    /// The first error inside a hook (hooks cannot return one); the
    /// collectives after it are not started.
    pub(super) error: Option<TrainError>,
    /// Time spent in the collectives (with overlap: waiting for them).
    pub(super) comm: Duration,
    /// The collectives in flight while the model computes (boxed: it is
    /// large and rarely touched).
    pub(super) flight: Box<InFlight>,
    /// Ranges of the model's parameter buffer still holding what the last
    /// forward gathered for the head: its backward runs first, right after,
    /// and uses them instead of gathering again (FSDP's
    /// `reshard_after_forward=False` for the last module). Released before
    /// any other forward.
    pub(super) kept: Vec<Range<usize>>,
    /// Whether the flat shard's gradient is all zero (cleared, and no
    /// backward has added to it since): a part's reduce-scatter then lands
    /// in it directly instead of in `scratch` and being added.
    pub(super) grads_zero: bool,
    /// Pages given back by a part's parameters or gradient, or by the
    /// gradient shard at the step's end, kept resident for the next range
    /// to be filled (see [`SparePages`]): every range released and filled
    /// again each step would otherwise cost the kernel's page faults and
    /// zero-filling, on a VM several percent of a GPT-2 small step. The pool
    /// is given back before the step's peaks (the embeddings' backward and
    /// the optimizer), so the peak stays what it was.
    pub(super) spare: SparePages,
    /// Whether the gradient shard is large enough for the pool.
    pub(super) shard_spare: bool,
    /// Elements of the model's gradient buffer the backward has made
    /// resident (announced, not yet reduced) now, and the most at once
    /// since the last backward began.
    pub(super) grads_live: usize,
    pub(super) grads_peak: usize,
}

/// Blocks' worth of pages [`Shards::spare`] keeps besides the largest
/// part's: a block's parameters and its gradient, released just before the
/// next block's are filled. Under stage 3 it also holds the largest part's
/// (the embeddings): the gradient shard's pages, given back at the step's
/// end, hold the embeddings' parameters next, theirs the tied head's wte,
/// and wte's after the head's backward the gradient shard's parts again.
pub(super) const SPARE_PARTS: usize = 2;

/// A collective in flight: (this rank's shard or a padded part in, the
/// padded part or this rank's shard out).
pub(super) type PartWork = Work<(Vec<f32>, Vec<f32>)>;

/// A unit's reduce-scatter in flight, as its gradients travel: f32
/// averaged by the collective, or (`--bf16-compress`) each rank's share
/// divided by the world size, cast to bf16 and summed in bf16, as
/// [`Compression::reduce_scatter_mean`] does in place.
pub(super) enum ReduceWork {
    F32(PartWork),
    Bf16(Work<(Vec<bf16>, Vec<bf16>)>),
    /// A range inside a unit (a block of a tied wte's rows, or wpe),
    /// reduced to the rank that owns it, which adds it to its flat shard's
    /// gradient: as [`ReduceWork::F32`] and [`ReduceWork::Bf16`].
    Root(Work<Vec<f32>>),
    RootBf16(Work<Vec<bf16>>),
}

/// Overlap of the collectives with the model's computation (as DDP's
/// overlap, and under the same `auto` rule): while a part computes, the
/// next part's all-gather runs (prefetch), and the reduce-scatter of the
/// part whose backward just finished runs while the part before it
/// computes its backward. The collectives are the same as without overlap,
/// issued in the same order on every rank, so the results are bitwise the
/// same; only the waiting moves.
#[derive(Default)]
pub(super) struct InFlight {
    /// Whether to overlap at all.
    pub(super) on: bool,
    /// The pass being run (0: forward, 1: backward), if any.
    pub(super) pass: Option<usize>,
    /// The ranges each kind of pass gathered last time, in order: every
    /// pass of a kind gathers the same ones, so the range after the one
    /// just gathered is the one to prefetch.
    pub(super) trace: [Vec<Range<usize>>; 2],
    /// The ranges the current pass gathered so far.
    pub(super) recording: Vec<Range<usize>>,
    /// The prefetched all-gather: the part's range and its work.
    pub(super) gather: Option<(Range<usize>, PartWork)>,
    /// Reduce-scatters not yet added to the flat shard's gradient: the
    /// part's shard in the flat shard, and its work.
    pub(super) reduces: VecDeque<(Range<usize>, ReduceWork)>,
    /// Buffers that finished works handed back, for the next ones.
    pub(super) spare: Vec<Vec<f32>>,
    /// The same for bf16 reduce-scatters (`--bf16-compress`).
    pub(super) spare_bf16: Vec<Vec<bf16>>,
    /// The largest buffer kept in `spare` (elements): a block's padded
    /// part. The embeddings' buffers (on GPT-2 small 154 MB gathered, 77 MB
    /// a shard) are freed after use instead: kept, two of them stayed
    /// resident through the whole step, the peaks included.
    pub(super) keep_max: usize,
}

/// Reduce-scatters left in flight when the next one starts: one, so that
/// each overlaps the backward of the part before it, and at most two parts'
/// gradients are held besides the shard's.
pub(super) const REDUCES_IN_FLIGHT: usize = 1;

/// Spare buffers kept for the works (each at most a padded part).
pub(super) const SPARES: usize = 2;

/// A part whose shard is at least this many elements (the embeddings of a
/// GPT-2-sized vocabulary) is reduce-scattered [`REDUCE_PIECE`] elements of
/// each rank's slot at a time, each piece of its gradient released as soon
/// as it is sent: its gradient and its new shard are then never resident
/// whole together, which is the step's memory peak (the end of backward).
pub(super) const PIECEWISE_SLOT: usize = 4 * REDUCE_PIECE;

/// Elements of each rank's slot one piece of a piecewise reduce-scatter
/// carries (8 MB): large enough that the collective runs at full speed,
/// small enough that the staging copy costs no memory to speak of.
pub(super) const REDUCE_PIECE: usize = 2 << 20;

impl InFlight {
    /// A buffer of `len` elements (contents unspecified), reusing a spare.
    pub(super) fn buffer(&mut self, len: usize) -> Vec<f32> {
        take_spare(&mut self.spare, len)
    }

    /// Keeps `buf` for a later work, unless enough are kept or it is larger
    /// than any but the largest part needs.
    pub(super) fn recycle(&mut self, buf: Vec<f32>) {
        keep_spare(&mut self.spare, buf, self.keep_max);
    }

    /// [`InFlight::buffer`] for bf16.
    pub(super) fn buffer_bf16(&mut self, len: usize) -> Vec<bf16> {
        take_spare(&mut self.spare_bf16, len)
    }

    /// [`InFlight::recycle`] for bf16.
    pub(super) fn recycle_bf16(&mut self, buf: Vec<bf16>) {
        keep_spare(&mut self.spare_bf16, buf, self.keep_max);
    }
}

fn take_spare<T: Copy + Default>(spare: &mut Vec<Vec<T>>, len: usize) -> Vec<T> {
    let mut buf = spare.pop().unwrap_or_default();
    buf.resize(len, T::default());
    buf
}

fn keep_spare<T>(spare: &mut Vec<Vec<T>>, buf: Vec<T>, keep_max: usize) {
    if spare.len() < SPARES && buf.capacity() <= keep_max {
        spare.push(buf);
    }
}

impl Shards {
    /// Every rank's shard of the part holding `range` into `dest`, exactly
    /// `range` of the model's buffer (from the prefetched all-gather when it
    /// fetched that part); within a pass, the next range is prefetched.
    /// Collective.
    pub(super) fn gather(&mut self, pg: &ProcessGroup, range: Range<usize>, dest: &mut [f32]) {
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

    /// Starts the all-gather of the part holding `range`, unless it is the
    /// largest part (the embeddings), which is gathered when needed: in
    /// flight it would hold its own copy and the whole gathered part
    /// (231 MB on GPT-2 small) beside what the model holds, through the
    /// head's backward, the step's peak; the tied head needs only a slice
    /// of it (broadcast into place), and the embeddings run first in
    /// forward and last in backward, with little to overlap.
    pub(super) fn prefetch(&mut self, pg: &ProcessGroup, range: &Range<usize>) {
        let Ok(p) = self.parts.find(range).cloned() else {
            return;
        };
        if p.padded() > self.flight.keep_max {
            return;
        }
        let mut own = self.flight.buffer(p.len);
        own.copy_from_slice(&self.params[p.own()]);
        let whole = self.flight.buffer(p.padded());
        self.flight.gather = Some((p.range.clone(), pg.all_gather_async(own, whole)));
    }

    /// [`Shards::gather`]'s collective: the prefetched one if it fetched the
    /// part holding `range`, else one now (after waiting out a prefetch that
    /// fetched another part: the ranks all run the same passes, so they all
    /// mispredict alike).
    pub(super) fn gather_now(
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
                self.parts.unpack(&p, &whole, range, dest);
                self.flight.recycle(whole);
                return Ok(());
            }
            self.flight.recycle(whole);
        }
        {
            let own = &self.params[p.own()];
            let comm = TrainError::comm("parameter all_gather");
            if *range == p.range && self.parts.direct(&p) {
                // Unit by unit, each rank's shards straight into place: no
                // staging copy of a whole block held through the pass.
                for u in self.parts.units_of(&p) {
                    let at = u.range.start - p.range.start..u.range.end - p.range.start;
                    pg.all_gather(&self.params[u.own()], &mut dest[at])
                        .map_err(&comm)?;
                }
                return Ok(());
            }
            if *range != p.range {
                return self.gather_slice(pg, &p, range, dest);
            }
            let whole = staged(&mut self.staging, p.padded());
            pg.all_gather(own, whole).map_err(comm)?;
            self.parts.unpack(&p, whole, range, dest);
            Ok(())
        }
    }

    /// `range`, a slice of part `p` (a tied head's read of wte, in the
    /// embeddings part), into `dest`: each rank's share of the slice, unit
    /// by unit, broadcast by it straight into place, rather than the whole
    /// part (the largest of all) gathered into staging and copied.
    /// Collective.
    pub(super) fn gather_slice(
        &self,
        pg: &ProcessGroup,
        p: &PartShard,
        range: &Range<usize>,
        dest: &mut [f32],
    ) -> Result<(), TrainError> {
        for u in self.parts.units_of(p) {
            for (root, part, own) in u.owners(range) {
                let piece = &mut dest[part.start - range.start..part.end - range.start];
                if root == u.shard.rank {
                    piece.copy_from_slice(&self.params[own]);
                }
                pg.broadcast(piece, root)
                    .map_err(TrainError::comm("parameter broadcast"))?;
            }
        }
        Ok(())
    }

    /// Starts a pass of the model (0: forward, 1: backward) whose gathers
    /// are traced, the first one prefetched when the last pass of the kind
    /// says what it is.
    pub(super) fn begin_pass(&mut self, pg: &ProcessGroup, pass: usize) {
        self.flight.pass = Some(pass);
        self.flight.recording.clear();
        let first = self.flight.trace[pass].first().cloned();
        if let Some(first) = first.filter(|_| self.flight.on && self.error.is_none()) {
            self.prefetch(pg, &first);
        }
    }

    /// Ends the pass: waits for what is still in flight (its reduce-scatters
    /// added to the shard's gradient) and keeps the pass's trace.
    pub(super) fn end_pass(&mut self) {
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
    pub(super) fn finish_reduces(&mut self, keep: usize) {
        while self.flight.reduces.len() > keep {
            let Some((own, work)) = self.flight.reduces.pop_front() else {
                break;
            };
            let comm = TrainError::comm("gradient reduce_scatter");
            match work {
                ReduceWork::F32(work) => match work.wait() {
                    Ok((whole, out)) => {
                        self.land(own, out.iter().copied());
                        self.flight.recycle(whole);
                        self.flight.recycle(out);
                    }
                    Err(e) => self.fail(comm(e)),
                },
                ReduceWork::Bf16(work) => match work.wait() {
                    Ok((whole, out)) => {
                        // Cast back as `Compression::reduce_scatter_mean`
                        // does: the same f32s as without overlap.
                        self.land(own, out.iter().map(|c| c.to_f32()));
                        self.flight.recycle_bf16(whole);
                        self.flight.recycle_bf16(out);
                    }
                    Err(e) => self.fail(comm(e)),
                },
                ReduceWork::Root(work) => match work.wait() {
                    Ok(buf) => {
                        self.add_to_shard(own, buf.iter().copied());
                        self.flight.recycle(buf);
                    }
                    Err(e) => self.fail(comm(e)),
                },
                ReduceWork::RootBf16(work) => match work.wait() {
                    Ok(buf) => {
                        self.add_to_shard(own, buf.iter().map(|c| c.to_f32()));
                        self.flight.recycle_bf16(buf);
                    }
                    Err(e) => self.fail(comm(e)),
                },
            }
        }
    }

    /// A finished reduce-scatter's shard `out` into the flat shard's
    /// gradient at `own`: written if it is still all zero, else added.
    fn land(&mut self, own: Range<usize>, out: impl Iterator<Item = f32>) {
        if self.error.is_some() {
            return;
        }
        let g = &mut self.grads[own];
        if self.grads_zero {
            // As without overlap: the shard's range takes the parked pages
            // (else they stay resident beside fresh ones until backward
            // ends, the pool's whole capacity above the step's peak) and
            // the result is written, not added to zeros.
            if self.shard_spare {
                self.spare.refill(g, false);
            }
            for (g, x) in g.iter_mut().zip(out) {
                *g = x;
            }
        } else {
            for (g, x) in g.iter_mut().zip(out) {
                *g += x;
            }
        }
    }

    /// `out` added to the flat shard's gradient at `own` (a range inside a
    /// unit, which other ranges of the unit share: never written over).
    /// While the shard is cleared, its range reads zero; the parked pages
    /// it takes are zeroed first (the ranges the backward hands over are
    /// disjoint, so no chunk inside `own` holds another range's sum yet).
    fn add_to_shard(&mut self, own: Range<usize>, out: impl Iterator<Item = f32>) {
        if self.error.is_some() || own.is_empty() {
            return;
        }
        let g = &mut self.grads[own];
        if self.grads_zero && self.shard_spare {
            self.spare.refill(g, true);
        }
        for (g, x) in g.iter_mut().zip(out) {
            *g += x;
        }
    }

    /// Keeps the first error.
    pub(super) fn fail(&mut self, e: TrainError) {
        self.error.get_or_insert(e);
    }

    /// The unit `range`'s gradient `grads` (this rank's, final for this
    /// backward) averaged over ranks; this rank's shard of it is added to
    /// the flat shard's gradient, and `grads` released. Collective.
    pub(super) fn reduce(&mut self, pg: &ProcessGroup, range: Range<usize>, grads: &mut [f32]) {
        self.grads_live = self.grads_live.saturating_sub(range.len());
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
    pub(super) fn reduce_now(
        &mut self,
        pg: &ProcessGroup,
        range: Range<usize>,
        grads: &mut [f32],
    ) -> Result<bool, TrainError> {
        let u = self.parts.holding(&range)?.clone();
        if u.range != range {
            return self.reduce_inside(pg, &u, &range, grads);
        }
        let comm = TrainError::comm("gradient reduce_scatter");
        let in_pieces = u.shard.len >= PIECEWISE_SLOT;
        // The largest part (the embeddings) is reduced piece by piece even
        // with overlap, after the works in flight: in flight it would need
        // a copy of its whole gradient besides the gradient itself at the
        // step's peak, and, the last part of backward, it has nothing left
        // to overlap with. (Not while a gather is in flight, which a sync
        // collective must not overtake; the embeddings are gathered last.)
        let in_pieces = in_pieces && (!self.flight.on || self.flight.gather.is_none());
        if self.flight.on && in_pieces {
            self.finish_reduces(0);
            if self.error.is_some() {
                return Ok(false);
            }
        }
        if self.flight.on && !in_pieces {
            // The work owns a copy, so that `grads` is released now.
            let work = match self.compression {
                Compression::None => {
                    let mut whole = self.flight.buffer(u.shard.padded());
                    whole[..grads.len()].copy_from_slice(grads);
                    whole[grads.len()..].fill(0.0);
                    let out = self.flight.buffer(u.shard.len);
                    ReduceWork::F32(pg.reduce_scatter_async(whole, out, ReduceOp::Avg))
                }
                Compression::Bf16 => {
                    // `Compression::reduce_scatter_mean`'s wire, summed in
                    // bf16 (padding zero, as its staging's).
                    let mut whole = self.flight.buffer_bf16(u.shard.padded());
                    for (w, s) in whole.iter_mut().zip(bf16_shares(grads, pg.size())) {
                        *w = s;
                    }
                    whole[grads.len()..].fill(bf16::ZERO);
                    let out = self.flight.buffer_bf16(u.shard.len);
                    ReduceWork::Bf16(pg.reduce_scatter_async(whole, out, ReduceOp::Sum))
                }
            };
            self.flight.reduces.push_back((u.own(), work));
            self.finish_reduces(REDUCES_IN_FLIGHT);
            return Ok(false);
        }
        let into_shard = self.grads_zero;
        let out = if into_shard {
            let out = &mut self.grads[u.own()];
            if self.shard_spare {
                // Released at the step's end, and overwritten whole now.
                self.spare.refill(out, false);
            }
            out
        } else {
            staged(&mut self.scratch, u.shard.len)
        };
        let (how, scratch) = (self.compression, &mut self.compression_scratch);
        if in_pieces {
            let (slot, world, len) = (u.shard.len, u.shard.world, grads.len());
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
        } else if u.padded() {
            let whole = staged(&mut self.staging, u.shard.padded());
            whole[..grads.len()].copy_from_slice(grads);
            whole[grads.len()..].fill(0.0);
            how.reduce_scatter_mean(pg, whole, out, scratch)
                .map_err(comm)?;
        } else {
            how.reduce_scatter_mean(pg, grads, out, scratch)
                .map_err(comm)?;
        }
        if !into_shard {
            for (g, x) in self.grads[u.own()].iter_mut().zip(self.scratch.iter()) {
                *g += x;
            }
        }
        Ok(in_pieces)
    }

    /// `range`'s gradient `grads`, a range inside unit `u` (a block of a
    /// tied wte's rows as the head's backward writes it, or wpe: see
    /// `Backward::sparse_embeddings`), averaged over the ranks into the rank
    /// that owns each part of it (a reduce to it, as the unit's
    /// reduce-scatter would have sent it there), which adds it to its flat
    /// shard's gradient; in flight with overlap. Collective. Returns false:
    /// the caller releases `grads`.
    fn reduce_inside(
        &mut self,
        pg: &ProcessGroup,
        u: &UnitShard,
        range: &Range<usize>,
        grads: &mut [f32],
    ) -> Result<bool, TrainError> {
        let comm = TrainError::comm("gradient reduce");
        for (root, part, own) in u.owners(range) {
            let src = &mut grads[part.start - range.start..part.end - range.start];
            if self.flight.on {
                let work = match self.compression {
                    Compression::None => {
                        let mut buf = self.flight.buffer(src.len());
                        buf.copy_from_slice(src);
                        ReduceWork::Root(pg.reduce_async(buf, ReduceOp::Avg, root))
                    }
                    Compression::Bf16 => {
                        let mut buf = self.flight.buffer_bf16(src.len());
                        for (b, s) in buf.iter_mut().zip(bf16_shares(src, pg.size())) {
                            *b = s;
                        }
                        ReduceWork::RootBf16(pg.reduce_async(buf, ReduceOp::Sum, root))
                    }
                };
                self.flight.reduces.push_back((own, work));
                self.finish_reduces(REDUCES_IN_FLIGHT);
                continue;
            }
            match self.compression {
                Compression::None => {
                    pg.reduce(src, ReduceOp::Avg, root).map_err(&comm)?;
                    self.add_to_shard(own, src.iter().copied());
                }
                Compression::Bf16 => {
                    // `Compression::reduce_scatter_mean`'s wire, to one rank.
                    let buf = &mut self.bf16_scratch;
                    buf.clear();
                    buf.extend(bf16_shares(src, pg.size()));
                    pg.reduce(&mut buf[..], ReduceOp::Sum, root)
                        .map_err(&comm)?;
                    let buf = std::mem::take(&mut self.bf16_scratch);
                    self.add_to_shard(own, buf.iter().map(|c| c.to_f32()));
                    self.bf16_scratch = buf;
                }
            }
        }
        Ok(false)
    }

    /// The embeddings' share of a tied wte's gradient on every rank, as
    /// rows (`ids`, distinct and ascending, and a row of C for each: see
    /// `PartHooks::embedding_rows`), averaged over the ranks into the flat
    /// shard's gradient, rather than added into a whole (V, C) gradient and
    /// reduce-scattered: every rank's rows are all-gathered (a few MB) and
    /// each rank adds those that fall in its shard, rank after rank and
    /// row after row, the same order every run. Sent as f32 whatever the
    /// compression: small, and exact. Collective.
    pub(super) fn add_rows(
        &mut self,
        pg: &ProcessGroup,
        wte: Range<usize>,
        ids: &[u32],
        rows: &[f32],
    ) {
        if self.error.is_some() {
            return;
        }
        let t = Instant::now();
        if let Err(e) = self.add_rows_now(pg, wte, ids, rows) {
            self.fail(e);
        }
        self.comm += t.elapsed();
    }

    fn add_rows_now(
        &mut self,
        pg: &ProcessGroup,
        wte: Range<usize>,
        ids: &[u32],
        rows: &[f32],
    ) -> Result<(), TrainError> {
        let comm = TrainError::comm("embedding rows all_gather");
        // Blocking collectives: nothing may be in flight before them (the
        // embeddings' backward gathers nothing, so no prefetch either).
        self.finish_reduces(0);
        if let Some((_, work)) = self.flight.gather.take() {
            let (own, whole) = work.wait().map_err(&comm)?;
            self.flight.recycle(own);
            self.flight.recycle(whole);
        }
        if self.error.is_some() {
            return Ok(());
        }
        let u = self.parts.holding(&wte)?.clone();
        let (world, c) = (pg.size(), rows.len() / ids.len().max(1));
        // Ranks hold different numbers of distinct tokens: the counts first,
        // then every rank's ids and rows padded to the most.
        let mut counts = vec![0i64; world];
        pg.all_gather(&[ids.len() as i64], &mut counts)
            .map_err(&comm)?;
        let most = counts.iter().copied().max().unwrap_or(0) as usize;
        let mut mine = vec![0i64; most];
        for (m, &id) in mine.iter_mut().zip(ids) {
            *m = i64::from(id);
        }
        let mut all_ids = vec![0i64; world * most];
        pg.all_gather(&mine, &mut all_ids).map_err(&comm)?;
        let mut mine = vec![0f32; most * c];
        mine[..rows.len()].copy_from_slice(rows);
        let mut all_rows = vec![0f32; world * most * c];
        pg.all_gather(&mine, &mut all_rows).map_err(&comm)?;
        let inv = 1.0 / world as f32;
        for (q, &count) in counts.iter().enumerate() {
            for k in q * most..q * most + count as usize {
                let start = wte.start + all_ids[k] as usize * c;
                let row = &all_rows[k * c..(k + 1) * c];
                for (_, part, own) in u.owners(&(start..start + c)) {
                    let src = &row[part.start - start..part.end - start];
                    if !own.is_empty() {
                        for (g, x) in self.grads[own].iter_mut().zip(src) {
                            *g += x * inv;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The first error a hook met, clearing it.
    pub(super) fn check(&mut self) -> Result<(), TrainError> {
        self.error.take().map_or(Ok(()), Err)
    }
}

/// Locks the hooks' state (a panic elsewhere cannot leave it half-written
/// in a way that matters: the run fails with the panic).
pub(super) fn lock(st: &Mutex<Shards>) -> MutexGuard<'_, Shards> {
    st.lock().unwrap_or_else(|e| e.into_inner())
}

/// Releases the parameters the last forward kept for the head's backward.
pub(super) fn release_kept(st: &mut Shards, model: &mut GPT) {
    for range in st.kept.drain(..) {
        st.spare.release(&mut model.params_mut()[range]);
    }
}

//! [`ShardedDp`]: ZeRO-2 or ZeRO-3 over a GPT (see the folder's docs for
//! the scheme): its construction over the model's parts, the forward and
//! backward passes with their part hooks, and the optimizer step on the
//! flat shard. It never keeps a unit's gradient beyond this rank's shard
//! once reduce-scattered.

use std::ops::Range;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use cohort_comm::ProcessGroup;
use cohort_ddp::{Compression, CompressionScratch};
use cohort_engine::optim::{AdamW, AdamWConfig, Optimizer};
use cohort_engine::ViewMut;
use cohort_gpt::checkpoint::Piece;
use cohort_gpt::optim_groups::decay_mask;
use cohort_gpt::{Backward, Forward, Labels, GPT};

use super::hooks::PartMemory;
use super::parts::PartShards;
use super::shards::{lock, release_kept, InFlight, Shards, SPARE_PARTS};
use crate::checkpoint::{OwnedShard, ShardTarget};
use crate::error::TrainError;
use crate::pages::{prefer_huge_pages, release, SparePages, SPARE_PAGES_MIN_BUFFER};
use crate::replica::agree_on_size;

/// Which of the sharded ZeRO stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroStage {
    /// Optimizer state and gradients sharded; every rank holds the model.
    Two,
    /// Optimizer state, gradients and parameters sharded; each part's
    /// parameters are gathered only while the part runs.
    Three,
}

/// ZeRO-2 or ZeRO-3 over a [`GPT`]: this rank's flat shard of the
/// parameters, the mean gradient and AdamW's moments, and the passes that
/// gather and reduce-scatter around the model's parts. The
/// data-parallel strategy ([`GradSync::Sharded`](super::super::GradSync)) runs it; `cohort bench ddp
/// --strategy zero2|zero3` drives it directly.
pub struct ShardedDp {
    stage: ZeroStage,
    st: Mutex<Shards>,
    /// AdamW over the flat shard.
    opt: AdamW,
    /// Stage 2 with overlap: the last update left the model's parameters
    /// stale, for the next forward to gather part by part (prefetched) or
    /// [`ShardedDp::complete_params`] at once.
    stale: bool,
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
        let cuts = model.split_ready_ranges();
        let parts = PartShards::new(&ranges, &cuts, pg.size(), pg.rank());
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
        let keep_max = parts.second_largest_padded();
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
                bf16_scratch: Vec::new(),
                error: None,
                comm: Duration::ZERO,
                flight: Box::new(InFlight {
                    keep_max,
                    ..InFlight::default()
                }),
                kept: Vec::new(),
                grads_zero: true,
                spare,
                shard_spare,
                grads_live: 0,
                grads_peak: 0,
            }),
            opt,
            stale: false,
        })
    }

    /// Overlaps the collectives with the model's computation (off at
    /// first): each part's all-gather prefetched while the part before it
    /// computes, each part's reduce-scatter left running while the part
    /// before it computes its backward; under stage 2, the update's
    /// all-gathers deferred to the next forward, each part's just before
    /// it runs (the next part's prefetched), rather than all of them at
    /// once after the optimizer. The results are bitwise those without
    /// overlap. Decide as DDP does ([`crate::Overlap::enabled`]):
    /// the communication thread needs a core of its own.
    pub fn set_overlap(&mut self, on: bool) {
        self.shards_mut().flight.on = on;
    }

    /// Sends the gradients as bf16 (PyTorch's `bf16_compress_hook`: half
    /// the bytes, about three significant digits) or as f32 (the default).
    /// With overlap, a unit's compressed reduce-scatter runs in flight as
    /// an f32 one does, on its own bf16 copy: the results are bitwise those
    /// without overlap either way.
    pub fn set_compression(&mut self, compression: Compression) {
        self.shards_mut().compression = compression;
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

    /// The ranges reduce-scattered one by one (the units: the embeddings,
    /// each block's attention and MLP, the head), in the order backward
    /// launches them: the head first, then each block's MLP before its
    /// attention from the last block down, the embeddings last.
    pub fn reduce_units(&self) -> Vec<Range<usize>> {
        let st = self.shards();
        st.parts
            .units
            .iter()
            .rev()
            .map(|u| u.range.clone())
            .collect()
    }

    /// Where this rank's shards of the parts lie: each part's model
    /// elements in the model's buffer, at their place in the flat shard
    /// (what a resume reads into).
    pub(crate) fn pieces(&self) -> Vec<Piece> {
        self.shards().parts.pieces()
    }

    /// Hands `save` this rank's share of a sharded checkpoint over `world`
    /// ranks: its flat shard of the parameters and AdamW's moments.
    pub(crate) fn with_owned_shard<R>(
        &self,
        world: usize,
        save: impl FnOnce(&OwnedShard<'_>) -> R,
    ) -> R {
        let st = self.shards();
        let ranges: Vec<Range<usize>> = st.parts.parts.iter().map(|p| p.range.clone()).collect();
        let cuts: Vec<Range<usize>> = st.parts.units.iter().map(|u| u.range.clone()).collect();
        let pieces_of = |rank: usize| PartShards::new(&ranges, &cuts, world, rank).pieces();
        let shard = OwnedShard {
            pieces_of: &pieces_of,
            params: &st.params,
            optimizer: self.opt.state(),
            strategy: match self.stage {
                ZeroStage::Two => "zero2",
                ZeroStage::Three => "zero3",
            },
        };
        save(&shard)
    }

    fn shards(&self) -> MutexGuard<'_, Shards> {
        lock(&self.st)
    }

    fn shards_mut(&mut self) -> &mut Shards {
        self.st.get_mut().unwrap_or_else(|e| e.into_inner())
    }

    /// The model's forward (as [`GPT::forward`] with labels), stage 3 gathering
    /// each part's parameters around it, stage 2 before it where the last
    /// update deferred its gathers (and keeping them). Collective under
    /// stage 3, and under stage 2 after such an update.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        pg: &ProcessGroup,
        model: &mut GPT,
        input_ids: &[u32],
        attention_mask: Option<&[u8]>,
        segments: Option<&[u32]>,
        labels: Option<Labels<'_>>,
        b: usize,
        t: usize,
    ) -> Result<Option<f32>, TrainError> {
        if self.stage == ZeroStage::Two && !self.stale {
            let pass = Forward::new(input_ids, b, t)
                .attention_mask(attention_mask)
                .segments(segments);
            return Ok(model.forward(pass.labels(labels))?);
        }
        let shards = self.shards_mut();
        release_kept(shards, model);
        shards.begin_pass(pg, 0);
        let three = self.stage == ZeroStage::Three;
        let hooks = &mut PartMemory {
            pg,
            st: &self.st,
            gather: true,
            release: three,
        };
        let pass = Forward::new(input_ids, b, t)
            .attention_mask(attention_mask)
            .segments(segments)
            .labels(labels)
            .parts(hooks);
        let loss = model.forward(pass);
        let shards = self.shards_mut();
        shards.end_pass();
        shards.check()?;
        if !three {
            // Every part the forward did not run (none, today) gathered
            // too: the model is whole from here on.
            let gathered = shards.flight.trace[0].clone();
            self.gather_model(pg, model, &gathered)?;
            self.stale = false;
        }
        Ok(loss?)
    }

    /// The backward of the last forward: each unit's gradient (a block's
    /// MLP, then its attention), as soon as it is final, reduce-scattered and added to this rank's flat shard of the
    /// gradient, the rest released (stage 3 gathering each part's
    /// parameters around its backward). Returns the time spent in the
    /// collectives. Collective.
    pub fn backward(&mut self, pg: &ProcessGroup, model: &mut GPT) -> Result<Duration, TrainError> {
        let shards = self.shards_mut();
        shards.comm = Duration::ZERO;
        (shards.grads_live, shards.grads_peak) = (0, 0);
        shards.begin_pass(pg, 1);
        let st = &self.st;
        let ready =
            |range: Range<usize>, grads: ViewMut<'_, f32>| lock(st).reduce(pg, range, grads.host());
        let gather = self.stage == ZeroStage::Three;
        let hooks = &mut PartMemory {
            pg,
            st,
            gather,
            release: gather,
        };
        // A tied wte's gradient block by block and as rows: never whole.
        let pass = Backward::new()
            .parts(hooks)
            .on_ready(ready)
            .sparse_embeddings();
        let done = model.backward(pass.split_blocks());
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

    /// The most elements of the model's gradient buffer the last backward
    /// held at once (written, not yet reduce-scattered and released): a
    /// block's, or a tied head's block of wte rows, rather than the whole
    /// of wte's beside a block's (see `Backward::sparse_embeddings`).
    pub fn peak_gradient_floats(&self) -> usize {
        self.shards().grads_peak
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
    /// head's backward (a tied model's wte held whole, for its product) does
    /// not also hold the gradient shards of parts not reached yet.
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
            self.gather_model(pg, model, &[])?;
            self.stale = false;
        }
        Ok(())
    }

    /// Every part's shards (but those of the parts at `skip`) into
    /// `model`'s parameters (stage 2 holds the whole model). Returns the
    /// time spent in the collectives. Collective.
    fn gather_model(
        &mut self,
        pg: &ProcessGroup,
        model: &mut GPT,
        skip: &[Range<usize>],
    ) -> Result<Duration, TrainError> {
        let st = self.shards_mut();
        st.comm = Duration::ZERO;
        let ranges: Vec<_> = (st.parts.parts.iter())
            .map(|p| p.range.clone())
            .filter(|r| !skip.contains(r))
            .collect();
        let params = model.params_mut();
        for range in ranges {
            st.gather(pg, range.clone(), &mut params[range]);
        }
        // A block's units come rank by rank through staging: not held
        // through the next backward, the step's peak; its pages serve the
        // first gradients that backward writes.
        st.spare.release(&mut st.staging);
        st.check()?;
        Ok(st.comm)
    }

    /// AdamW on the flat shard at `lr`; stage 2 then all-gathers every
    /// part's updated shard into `model`, or with overlap leaves that to
    /// the next forward (see [`ShardedDp::complete_params`] for anything
    /// else that reads the model before it). Returns the time spent in the
    /// collectives. Collective under stage 2 without overlap.
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
        if self.shards_mut().flight.on {
            // The next forward gathers each part as it needs it, the next
            // one prefetched while a part computes: hidden behind the
            // forward rather than all exposed here.
            self.stale = true;
            return Ok(Duration::ZERO);
        }
        self.gather_model(pg, model, &[])
    }

    /// Makes `model`'s parameters whole and current now, where an update
    /// left them to the next forward (stage 2 with overlap; else nothing to
    /// do): for whatever reads them other than the next training forward
    /// (an evaluation, the end of training, a caller's own use). Returns
    /// the time spent in the collectives. Collective: every rank calls it
    /// at the same point (they all updated alike).
    pub fn complete_params(
        &mut self,
        pg: &ProcessGroup,
        model: &mut GPT,
    ) -> Result<Duration, TrainError> {
        if !self.stale {
            return Ok(Duration::ZERO);
        }
        let comm = self.gather_model(pg, model, &[])?;
        self.stale = false;
        Ok(comm)
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

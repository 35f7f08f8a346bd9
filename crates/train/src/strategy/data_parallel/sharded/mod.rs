//! ZeRO stages 2 and 3 (DeepSpeed ZeRO-2 and ZeRO-3; stage 3 is PyTorch
//! FSDP's `fully_shard` applied to every block): data parallelism whose
//! gradients (stage 2), and parameters too (stage 3), are sharded over the
//! ranks as well as the optimizer state that ZeRO-1 shards.
//!
//! Sharding by unit. The model runs in parts (embeddings, each block, the
//! head), each a contiguous range of the flat parameter buffer; its
//! backward hands the gradient over in *units*, finer where it can: each
//! block's MLP (from `ln_2` up) as soon as `ln_2`'s backward has finished
//! it, then the block's attention (`Backward::split_blocks`, as DDP's
//! buckets follow). Each unit is split over the N ranks on its own, as
//! ZeRO-1 splits the whole buffer: a unit of n_u parameters is padded to
//! N x s_u, s_u = ceil(n_u / N), and rank r owns its elements
//! `r*s_u .. (r+1)*s_u` (padding is zero, and exempt from weight decay). A
//! rank's shards of all the units, one after the other, are its *flat
//! shard* (about n / N elements): AdamW's moments, the mean gradient and
//! the parameters it updates live there. Splitting each unit rather than
//! the whole buffer makes every unit's reduce-scatter an even split that
//! can run as soon as the unit's gradient is final, while backward goes on:
//! of the first block, whose gradient is final last, only the attention's
//! third is left with the embeddings when backward ends. A part's units
//! lie one after the other in the flat shard too, so a part is gathered by
//! one all-gather (each rank sends its shards of the part's units, and the
//! gathered buffer, rank after rank, is copied to its places in the model:
//! `PartShards::unpack`; a part whose units all divide into the ranks is
//! gathered unit by unit, each landing in place), just before it runs.
//! Where the ranks span nodes that hold several each, cohort-comm runs
//! these reduce-scatters and all-gathers hierarchically by itself (inside
//! each node, then one rank per node and local index across the link; the
//! header says so).
//!
//! Each step:
//!
//! 1. forward: stage 3 all-gathers each part's parameters into the model's
//!    buffer just before the part runs and releases them (see `pages`)
//!    right after, but the head's, whose backward comes next and uses them
//!    (FSDP does not reshard the last module either); stage 2 holds the
//!    whole model, as DDP (after a deferred update, see 5, its first
//!    forward gathers each part just before it runs, and keeps it);
//! 2. backward: stage 3 gathers and releases each part again around its
//!    backward (but the embeddings, whose backward reads no parameter); as
//!    each unit's gradient becomes final, it is reduce-scattered (averaged
//!    over ranks), this rank's shard is added to the flat shard's gradient
//!    and the unit's range of the model's gradient buffer is released. A
//!    tied wte's gradient, the largest tensor, which the head writes first
//!    and the embeddings finish last, is never written whole
//!    (`Backward::sparse_embeddings`): each block of its rows the head's
//!    backward writes is reduced at once to the ranks that own it, and the
//!    embeddings' share comes as rows of the batch's tokens, all-gathered
//!    (a few MB) and added by each rank to its shard, rank by rank in a
//!    fixed order; wpe goes alone, as the head's blocks do.
//!    Every micro-batch does this (DeepSpeed's way: the shard accumulates
//!    the micro-batches), so that no more than a part of the whole gradient
//!    is ever resident, accumulation or not;
//! 3. the training loop scales, checks and clips the flat shard's gradient
//!    (the norm over all shards, as ZeRO-1);
//! 4. AdamW steps the flat shard's parameters;
//! 5. stage 2 all-gathers every part's updated shard into the model, or,
//!    with overlap, leaves that to the next forward (the model's
//!    parameters are stale until then: whatever else reads them first, an
//!    evaluation or the end of training, calls
//!    [`ShardedDp::complete_params`]; a checkpoint writes the flat shards);
//!    stage 3 does nothing: the next forward gathers what it needs.
//!
//! Overlap (`--overlap`, DDP's rule: on when a core is free for the
//! communication thread or the job spans nodes): stage 3, and stage 2 in
//! the forward after an update, prefetch the next part's all-gather while
//! a part computes (the order of the parts is the previous pass's, forward
//! or backward), and both stages leave a unit's reduce-scatter running
//! through the backward of the unit before it (a block's MLP's through the
//! block's attention), in bf16 too (`--bf16-compress`: the unit's share
//! cast into a bf16 buffer of its own, summed in bf16 and cast back as the
//! in-place path does). The collectives and their order are the same
//! either way, so the results are bitwise the same.
//!
//! Checkpoints are sharded, as ZeRO-1's: at a save each rank writes its
//! flat shard (parameters and moments, with the units' ranges it holds) and
//! rank 0 the index that commits them; nothing is gathered. A resume reads
//! any checkpoint, sharded (at any world size, by any strategy, under any
//! cut of the units: the index says which model range each piece holds) or
//! DDP's, whole, keeps this rank's shards and frees the rest.
//!
//! This module must never keep a unit's gradient beyond this rank's shard
//! once the unit was reduce-scattered, never (stage 3) keep a part's
//! gathered parameters outside the part's forward or backward (but the
//! head's, from its forward to its backward, which follows it), never
//! (stage 2) let anything but the next forward read parameters an update
//! left stale, and never let one rank's parameters differ from another's
//! after a step.

mod hooks;
mod parts;
mod sharded_dp;
mod shards;

pub(crate) use parts::split_sizes;
pub use sharded_dp::{ShardedDp, ZeroStage};

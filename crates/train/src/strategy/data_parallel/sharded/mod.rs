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

mod hooks;
mod parts;
mod sharded_dp;
mod shards;

pub use sharded_dp::{ShardedDp, ZeroStage};

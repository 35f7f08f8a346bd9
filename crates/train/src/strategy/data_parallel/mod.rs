//! Data parallelism, one strategy: every rank trains a replica of the model
//! on its own shard of the data, and the gradients are synchronised as the
//! [`GradSync`] value says: PyTorch's DDP (all-reduce in buckets during the
//! last micro-batch's backward), ZeRO-1 (`ZeroRedundancyOptimizer`: the
//! optimizer state sharded, see `zero1`) or ZeRO-2/3 (gradients, and under
//! stage 3 parameters, sharded by part too, see `sharded`), or none but
//! DiLoCo's outer step every H steps (local SGD its special case, see
//! `diloco`).
//!
//! - `step`: [`DataParallel`], a rank's replica and its sync, with the
//!   pieces of a step (forward, backward with the sync, update), used by
//!   the training loop and by `cohort bench ddp` alike;
//! - `training`: the strategy of the training loop built from a config
//!   (data, resume, batches, saves);
//! - `zero1`, `sharded`: the ZeRO machinery on flat buffers and over the
//!   model's parts; `diloco`: the outer optimizer and its checkpoint state;
//! - `staged`: DDP and ZeRO-1 of a model in a device's memory, its gradients staged through
//!   the host as backward finishes them;
//! - `device_buckets`: DDP's buckets of a model in a device's memory averaged by the device
//!   collectives (NCCL) while backward goes on;
//! - `link`: whether gradients travel in bf16 when not told (by the link).
//!
//! This module never lets one rank's parameters differ from another's
//! after a step (DiLoCo: after a sync), and never keeps sharded state beyond a rank's own shard
//! between steps.

mod device_buckets;
mod diloco;
mod link;
mod sharded;
mod staged;
mod step;
mod training;
mod zero1;

pub use diloco::{Outer, OuterConfig};
pub(crate) use sharded::split_sizes;
pub use sharded::{ShardedDp, ZeroStage};
pub use step::{DataParallel, GradSync, SyncTimes};
pub(crate) use training::{train, SyncKind};
pub use zero1::{Zero1, Zero1Times};

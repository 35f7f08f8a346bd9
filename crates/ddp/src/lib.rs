//! Distributed data parallel over flat f32 buffers: what PyTorch's
//! `DistributedDataParallel` is, for any model whose parameters and
//! gradients live in one contiguous buffer each. (Which indices each rank
//! reads, torch's `DistributedSampler`, is cohort-data's.)
//!
//! - [`Ddp`] wraps one replica: at construction it checks that every rank
//!   built the same model (names, shapes, offsets of [`ParamSpec`]s) and
//!   broadcasts rank 0's parameters; [`Ddp::backward`] runs the model's
//!   backward, handing it a [`ReadyHook`] to call as gradients become final,
//!   and averages the gradients across ranks, bucket by bucket
//!   ([`GradientBucket`]), each bucket's
//!   all-reduce starting on a communication thread as soon as backward has
//!   finished its gradients, while backward goes on with the layers below.
//!   After the first backward the buckets are re-cut along the ranges the
//!   model reported, so that no bucket waits for a range finished later
//!   (or before it, with [`Ddp::plan_along`]), and the last bucket, ready
//!   only when backward ends, is cut small: its all-reduce is all exposed.
//!   [`PendingSync::finish`], given the gradient buffer, reduces the rest.
//!   Gradient accumulation (`no_sync`) is the model's own backward.
//!
//! Gradients flow one way: the model's backward calls the hook, the hook
//! hands ranges to the reducer. DDP never calls into a model type (there is
//! no model trait to implement), so any flat-buffer model plugs in with a
//! closure.
//!
//! This crate knows flat buffers, parameter names and process groups, never
//! what a model computes, and it never touches parameters after the initial
//! broadcast (the optimizer, identical on every rank, does).
//!
//! ```
//! use cohort_comm::spawn;
//! use cohort_ddp::{Ddp, DdpOptions, ParamSpec, ReadyHook};
//!
//! /// y = w * x with loss (y - 1)^2 / 2: one parameter, one gradient.
//! struct Scalar { w: Vec<f32>, g: Vec<f32>, x: f32 }
//! impl Scalar {
//!     fn backward<'g>(&'g mut self, ready: &mut ReadyHook<'_, 'g>) -> Result<(), std::io::Error> {
//!         self.g[0] += (self.w[0] * self.x - 1.0) * self.x;
//!         ready(0..1, &mut self.g);
//!         Ok(())
//!     }
//! }
//!
//! let grads = spawn::threads(2, |pg| {
//!     let mut m = Scalar { w: vec![pg.rank() as f32], g: vec![0.0], x: 1.0 + pg.rank() as f32 };
//!     let spec = vec![ParamSpec { name: "w".into(), shape: vec![1], range: 0..1 }];
//!     let mut ddp = Ddp::new(pg, spec, &mut m.w, DdpOptions::default())?;
//!     assert_eq!(m.w[0], 0.0); // rank 0's value everywhere
//!     ddp.backward(|ready| m.backward(ready))?.finish(&mut m.g)?;
//!     Ok::<_, cohort_ddp::DdpError>(m.g[0])
//! })
//! .unwrap();
//! // rank 0: (0*1 - 1)*1 = -1; rank 1: (0*2 - 1)*2 = -2; average -1.5
//! assert_eq!(grads, vec![-1.5, -1.5]);
//! ```
#![deny(missing_docs)]

mod bucket;
mod ddp;
mod error;
mod reducer;

pub use bucket::{
    assign_buckets, assign_buckets_aligned, describe_bytes, describe_sizes, split_last_bucket,
    GradientBucket, ParamSpec,
};
pub use ddp::{
    bf16_shares, Compression, CompressionScratch, Ddp, DdpOptions, PendingSync, ReadyHook,
    ReducedHook, SyncStats, DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_MB, DEFAULT_LAST_BUCKET_MB,
};
pub use error::DdpError;

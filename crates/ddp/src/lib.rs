//! Distributed data parallel over flat f32 buffers: what PyTorch's
//! `DistributedDataParallel` is, for any model whose parameters and
//! gradients live in one contiguous buffer each. (Which indices each rank
//! reads, torch's `DistributedSampler`, is cohort-data's.)
//!
//! - [`Ddp`] wraps one replica: at construction it checks that every rank
//!   built the same model (names, shapes, offsets of [`ParamSpec`]s) and
//!   broadcasts rank 0's parameters; [`Ddp::backward`] runs the model's
//!   backward (through the [`Replica`] trait) and averages the gradients
//!   across ranks, bucket by bucket ([`GradientBucket`]), each bucket's
//!   all-reduce starting on a communication thread as soon as backward has
//!   finished its gradients, while backward goes on with the layers below.
//!   After the first backward the buckets are re-cut along the ranges the
//!   model reported, so that no bucket waits for a range finished later.
//!   [`Ddp::backward_no_sync`] is `no_sync` for gradient accumulation.
//!
//! This crate knows flat buffers, parameter names and process groups, never
//! what a model computes, and it never touches parameters after the initial
//! broadcast (the optimizer, identical on every rank, does).
//!
//! ```
//! use cohort_comm::spawn;
//! use cohort_ddp::{Ddp, DdpOptions, ParamSpec, Replica};
//! use std::ops::Range;
//!
//! /// y = w * x with loss (y - 1)^2 / 2: one parameter, one gradient.
//! struct Scalar { w: Vec<f32>, g: Vec<f32>, x: f32 }
//! impl Replica for Scalar {
//!     fn backward<'g>(
//!         &'g mut self,
//!         hook: &mut (dyn FnMut(Range<usize>, &'g mut [f32]) + Send),
//!     ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//!         self.g[0] += (self.w[0] * self.x - 1.0) * self.x;
//!         hook(0..1, &mut self.g);
//!         Ok(())
//!     }
//!     fn grads_mut(&mut self) -> &mut [f32] { &mut self.g }
//! }
//!
//! let grads = spawn::threads(2, |pg| {
//!     let mut m = Scalar { w: vec![pg.rank() as f32], g: vec![0.0], x: 1.0 + pg.rank() as f32 };
//!     let spec = vec![ParamSpec { name: "w".into(), shape: vec![1], range: 0..1 }];
//!     let mut ddp = Ddp::new(pg, spec, &mut m.w, DdpOptions::default())?;
//!     assert_eq!(m.w[0], 0.0); // rank 0's value everywhere
//!     ddp.backward(&mut m)?;
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

pub use bucket::{assign_buckets, assign_buckets_aligned, GradientBucket, ParamSpec};
pub use ddp::{
    Compression, Ddp, DdpOptions, Replica, SyncStats, DEFAULT_BUCKET_CAP_MB,
    DEFAULT_FIRST_BUCKET_MB,
};
pub use error::DdpError;

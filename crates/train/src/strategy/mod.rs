//! The ways of spreading training over ranks, one folder each, every one a
//! [`ParallelStrategy`](crate::step_loop::ParallelStrategy) of the one
//! training loop:
//!
//! - `data_parallel`: a replica per rank, gradients synchronised by DDP or
//!   a ZeRO stage (one strategy, the sync a value);
//! - `pipeline`: the model's blocks in stages on consecutive ranks;
//! - `parameter_server`: rank 0 holds the model, the others push gradients
//!   over RPC.
//!
//! A strategy builds on `replica` (shared setup, resume, save), `input`
//! and `checkpoint`; strategies never use each other, and never run the
//! loop's policies (skips, clipping, intervals) themselves.

pub(crate) mod data_parallel;
pub(crate) mod parameter_server;
pub(crate) mod pipeline;

//! The benchmarks behind `cohort bench`, one module per layer: each times a
//! library from outside, through its public API, and reports a table or JSON
//! lines whose keys scripts and the README depend on.
//!
//! - [`collectives`]: `cohort bench collectives`, nccl-tests style.
//! - [`rpc`]: `cohort bench rpc`, round trips and calls per second.
//! - [`serve`]: `cohort bench serve`, the serving load test.
//! - [`train_step`]: `cohort bench train`, one process's training step.
//! - [`ddp`]: `cohort bench ddp`, DDP's step time and scaling efficiency.
//!
//! This crate never parses a command line (the binary does, except for the
//! flags structs it shares with clap) and never changes what it times.

pub mod collectives;
pub mod ddp;
pub mod rpc;
pub mod serve;
pub mod train_step;

//! The benchmarks behind `cohort bench`, one module per layer: each times a
//! library from outside, through its public API, and reports a table or JSON
//! lines whose keys scripts and docs/PERFORMANCE.md depend on.
//!
//! - [`collectives`]: `cohort bench collectives`, nccl-tests style.
//! - [`rpc`]: `cohort bench rpc`, round trips and calls per second.
//! - [`serve`]: `cohort bench serve`, the serving load test.
//! - [`serve_model`]: `cohort bench serve --repository`, any model of a repository.
//! - [`serve_chat`]: `cohort bench serve --chat`, streamed `/v1/chat/completions`.
//! - [`train_step`]: `cohort bench train`, one process's training step.
//! - [`ddp`]: `cohort bench ddp`, DDP's step time and scaling efficiency.
//! - [`pipeline`]: `cohort bench pipeline`, the pipeline's step time and bubble.
//! - [`ps`]: `cohort bench ps`, parameter-server training's update time.
//!
//! This crate never parses a command line (the binary does, except for the
//! flags structs it shares with clap) and never changes what it times.

pub mod collectives;
pub mod ddp;
pub mod pipeline;
pub mod ps;
pub mod rpc;
pub mod serve;
pub mod serve_chat;
pub mod serve_model;
pub mod train_step;

/// Fills `out` with token ids uniform in `0..vocab`, a fixed function of
/// `stream` (which a benchmark derives from rank, step and micro-batch).
pub(crate) fn random_tokens(vocab: usize, out: &mut [u32], stream: u64) {
    let mut rng = cohort_rng::SplitMix64::new(stream);
    out.iter_mut().for_each(|x| *x = rng.below(vocab) as u32);
}

//! What the training tests share: a tiny model on a tiny corpus, group
//! options that wait long enough on a busy machine, DDP ranks as threads
//! with real loopback sockets, and the distance between two parameter
//! buffers.

#![allow(dead_code)]

use cohort_comm::{spawn, GroupOptions, ProcessGroup};
use cohort_train::{train, Outcome, TrainConfig};
use std::time::Duration;

/// A tiny model on a tiny corpus: each run takes well under a second.
pub fn tiny() -> TrainConfig {
    TrainConfig {
        markov_vocab: 16,
        markov_order: 2,
        markov_branching: 3,
        // Divisible by every (ranks x batch) the tests use, so no rank pads the epoch.
        train_sequences: 96,
        val_sequences: 24,
        seq_len: 16,
        n_layers: 2,
        n_heads: 2,
        d_model: 32,
        d_ff: 64,
        dropout: 0.0,
        batch_size: 2,
        steps: 4,
        warmup_steps: 1,
        log_interval: 1,
        eval_interval: 0,
        eval_batches: 1,
        ..TrainConfig::default()
    }
}

/// The environment's group options with a 60 s timeout.
pub fn opts() -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_secs(60),
        ..GroupOptions::from_env().unwrap()
    }
}

/// `cfg` trained with DDP by `world` ranks (threads); every rank's outcome.
pub fn run_world(world: usize, cfg: &TrainConfig) -> Vec<Outcome> {
    spawn::threads_with(world, opts(), |pg: &ProcessGroup| {
        train(cfg, pg, &mut std::io::sink())
    })
    .unwrap()
}

/// The largest elementwise difference of two equally long buffers.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

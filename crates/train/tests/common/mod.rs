//! What the training tests share: a tiny model on a tiny corpus, group
//! options that wait long enough on a busy machine, DDP ranks as threads
//! with real loopback sockets, and the distance between two parameter
//! buffers.

#![allow(dead_code)]

use cohort_comm::{spawn, GroupOptions, ProcessGroup};
use cohort_train::{elastic, train, Outcome, Strategy, TrainConfig};
use std::path::Path;
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

/// [`tiny`] with vocab 17 and d_model 33 (3 heads): 19037 parameters, which
/// neither 2 nor 3 divides (so sharded strategies pad their shards).
pub fn odd() -> TrainConfig {
    TrainConfig {
        markov_vocab: 17,
        d_model: 33,
        n_heads: 3,
        ..tiny()
    }
}

/// `cfg` under `strategy`.
pub fn with(strategy: Strategy, cfg: &TrainConfig) -> TrainConfig {
    TrainConfig {
        strategy,
        ..cfg.clone()
    }
}

/// The gradient norms before clipping that rank 0 logged to
/// `dir/metrics.jsonl`, one per step.
pub fn grad_norms(dir: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(dir.join(cohort_train::METRICS_FILE)).unwrap();
    text.lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v.get("grad_norm").and_then(|g| g.as_f64())
        })
        .collect()
}

/// Runs `cfg` (6 steps, grad_accum 3) for 3 steps on 2 ranks under `first`
/// with a checkpoint, resumes it under `then` on `world` ranks (the
/// launcher's elastic rescale: grad_accum 3 -> 3 x 2 / world), and checks
/// that every rank ends within `tol` of `straight`, the unbroken run.
pub fn assert_stopped_run_resumes_like(
    straight: &Outcome,
    cfg: &TrainConfig,
    (first, then): (Strategy, Strategy),
    world: usize,
    tol: f32,
) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    run_world(
        2,
        &TrainConfig {
            steps: 3,
            out: Some(out.clone()),
            strategy: first,
            ..cfg.clone()
        },
    );
    // The ZeRO stages write one shard per rank, which the resume reshards.
    let index = cohort_gpt::checkpoint::read_index(&out.join("step-000003")).unwrap();
    assert_eq!(
        index.map(|i| i.world_size),
        (first != Strategy::Ddp).then_some(2),
        "{first:?}'s checkpoint"
    );
    let (resume, notes) = elastic::prepare_resume(
        &TrainConfig {
            resume: Some(out.clone()),
            strategy: then,
            ..cfg.clone()
        },
        world,
        0,
    );
    assert!(
        notes.iter().any(|n| n.contains("grad_accum 3 ->")),
        "{notes:?}"
    );
    let resumed = run_world(world, &resume);
    assert_eq!(resumed[0].steps_run, 3);
    let d = max_abs_diff(&resumed[0].params, &straight.params);
    eprintln!("{first:?} x2 -> {then:?} x{world}: max |diff| {d:e}");
    assert!(d < tol, "{first:?} x2 -> {then:?} x{world}: {d}");
    for r in 1..world {
        assert!(resumed[r].params == resumed[0].params, "rank {r} diverged");
    }
}

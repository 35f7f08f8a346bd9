//! The training loop end to end on a tiny GPT: data-parallel ranks (threads
//! with real loopback sockets, through comm's spawn) against one process,
//! overlap and bucket sizes, resuming, and learning the Markov corpus.

mod common;

use cohort_comm::{spawn, ProcessGroup};
use cohort_train::{train, Outcome, Overlap, TrainConfig};
use common::{max_abs_diff, opts, run_world, tiny};

fn run_one(cfg: &TrainConfig) -> Outcome {
    run_world(1, cfg).swap_remove(0)
}

/// Tolerance for runs that see the same samples per step but add the
/// per-sample gradient terms in a different order (other batch shapes):
/// gradients agree to ~1e-7 relative; AdamW moves each parameter by about
/// lr = 1e-3 per step, normalised by the gradient's own magnitude, which
/// amplifies rounding only for gradients near zero. Over 4 steps the
/// parameters stay within 1e-6 of each other in practice; 2e-5 (2% of one
/// step's move) leaves room while still catching any wrong averaging,
/// which would be off by the size of a whole step.
const REORDERED_TOL: f32 = 2e-5;

#[test]
fn n_ranks_match_one_process_with_n_times_the_batch_and_with_accumulation() {
    for n in [2, 3] {
        let cfg = tiny();
        let ddp = run_world(n, &cfg);
        for r in 1..n {
            assert_eq!(ddp[r].params, ddp[0].params, "ranks {r} and 0 diverged");
        }
        // One process, batch N*B: the sampler of a world of one hands out the
        // same permutation, so each step sees the union of the ranks' samples.
        let big = run_one(&TrainConfig {
            batch_size: n * cfg.batch_size,
            ..cfg.clone()
        });
        let d = max_abs_diff(&ddp[0].params, &big.params);
        eprintln!(
            "world {n} vs one process with batch {}: max |diff| {d:e}",
            n * cfg.batch_size
        );
        assert!(
            d < REORDERED_TOL,
            "world {n} vs batch {}: {d}",
            n * cfg.batch_size
        );
        // One process accumulating N micro-batches of B (no_sync for all but
        // the last): again the same samples per step.
        let accum = run_one(&TrainConfig {
            grad_accum: n,
            ..cfg.clone()
        });
        let d = max_abs_diff(&ddp[0].params, &accum.params);
        eprintln!("world {n} vs one process accumulating {n} micro-batches: max |diff| {d:e}");
        assert!(d < REORDERED_TOL, "world {n} vs {n} micro-batches: {d}");
        // The logged loss is the mean over ranks: the same quantity.
        let (l_ddp, l_big) = (ddp[0].train_losses[0].1, big.train_losses[0].1);
        assert!((l_ddp - l_big).abs() < 1e-5, "{l_ddp} vs {l_big}");
        // And the parameters did move.
        assert!(max_abs_diff(&ddp[0].params, &run_zero_steps(&cfg)) > 1e-4);
    }
}

/// The same model reports the same validation loss on any number of ranks: the ranks share
/// out one list of validation batches rather than each evaluating its own, so a world of one,
/// two or three (and an elastic regroup between them) see the same sequences. At lr 0 every
/// world ends on the initial parameters, bitwise, so only the sequences could differ; five
/// batches do not split evenly over two or three ranks.
#[test]
fn the_same_model_has_the_same_validation_loss_on_any_number_of_ranks() {
    let cfg = TrainConfig {
        lr: 0.0,
        min_lr: 0.0,
        eval_batches: 5,
        eval_interval: 1,
        steps: 2,
        ..tiny()
    };
    let one = run_one(&cfg);
    assert_eq!(one.val_losses.len(), 2);
    for n in [2, 3] {
        let ddp = run_world(n, &cfg);
        assert!(ddp[0].params == one.params, "world {n}: another model");
        for (rank, o) in ddp.iter().enumerate() {
            for ((s1, a), (s2, b)) in o.val_losses.iter().zip(&one.val_losses) {
                assert_eq!(s1, s2);
                eprintln!("world {n} rank {rank} step {s1}: val loss {a} vs {b} on one rank");
                assert!((a - b).abs() < 1e-5, "world {n} rank {rank}: {a} vs {b}");
            }
        }
    }
}

fn run_zero_steps(cfg: &TrainConfig) -> Vec<f32> {
    run_one(&TrainConfig {
        steps: 0,
        ..cfg.clone()
    })
    .params
}

#[test]
fn overlap_and_bucket_size_do_not_change_the_result() {
    // Two ranks: every element is a + b whatever the bucketing and timing,
    // so everything must agree bitwise.
    let base = TrainConfig {
        overlap: Overlap::Off,
        ..tiny()
    };
    let base = run_world(2, &base).swap_remove(0).params;
    for (cap, overlap) in [
        (0.0, Overlap::On),
        (0.001, Overlap::On),
        (0.01, Overlap::Off),
        (0.5, Overlap::On),
        (25.0, Overlap::Off),
        (1e6, Overlap::On),
    ] {
        let cfg = TrainConfig {
            bucket_cap_mb: cap,
            overlap,
            ..tiny()
        };
        let got = run_world(2, &cfg).swap_remove(0).params;
        assert!(
            got == base,
            "bucket_cap_mb {cap}, overlap {overlap:?}: differs by {}",
            max_abs_diff(&got, &base)
        );
    }
}

#[test]
fn resuming_from_a_checkpoint_continues_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    // Small epochs (16 sequences, 4 per step) so the run crosses an epoch
    // after the checkpoint, which falls mid-epoch;
    // the schedule's end is explicit so the stopped run has the same one.
    let cfg = TrainConfig {
        steps: 6,
        lr_decay_steps: 6,
        train_sequences: 16,
        ..tiny()
    };
    let straight = run_world(2, &cfg).swap_remove(0);
    let first = TrainConfig {
        steps: 3,
        out: Some(out.clone()),
        ..cfg.clone()
    };
    run_world(2, &first);
    assert!(out.join("step-000003").join("model.safetensors").is_file());
    let resumed = run_world(
        2,
        &TrainConfig {
            resume: Some(out.clone()),
            ..cfg.clone()
        },
    );
    assert_eq!(resumed[0].steps_run, 3);
    assert!(resumed[0].params == straight.params, "resumed run differs");
    assert_eq!(resumed[0].train_losses, straight.train_losses[3..].to_vec());
    // Another per-rank batch cannot resume it (another world size can: the
    // elastic restart re-splits the data, tested in elastic.rs).
    let err = spawn::threads_with(2, opts(), |pg: &ProcessGroup| {
        train(
            &TrainConfig {
                resume: Some(out.clone()),
                batch_size: cfg.batch_size + 1,
                ..cfg.clone()
            },
            pg,
            &mut std::io::sink(),
        )
        .map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("batch_size"), "{err}");
}

#[test]
fn different_models_on_different_ranks_fail_fast_naming_the_parameter() {
    let err = spawn::threads_with(2, opts(), |pg: &ProcessGroup| {
        let d_ff = if pg.rank() == 1 { 96 } else { 64 };
        train(&TrainConfig { d_ff, ..tiny() }, pg, &mut std::io::sink()).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("h.0.mlp.c_fc.weight"), "{err}");
    assert!(err.contains("rank 1"), "{err}");
}

/// A corpus the tiny model learns to near its floor in 150 steps.
fn markov_cfg() -> TrainConfig {
    TrainConfig {
        markov_vocab: 16,
        markov_order: 1,
        markov_branching: 2,
        train_sequences: 4096,
        val_sequences: 64,
        seq_len: 32,
        batch_size: 16,
        steps: 150,
        lr: 3e-3,
        warmup_steps: 10,
        log_interval: 50,
        eval_batches: 4,
        ..tiny()
    }
}

#[test]
fn the_model_learns_the_markov_corpus_towards_its_floor() {
    let out = run_one(&markov_cfg());
    let floor = out.loss_floor.unwrap() as f32;
    let val = out.val_losses.last().unwrap().1;
    let start = (16f32).ln();
    assert!(
        floor < 0.5 * start,
        "the corpus should be learnable: floor {floor}"
    );
    // Most of the way from ln(vocab) to the floor.
    assert!(
        val < floor + 0.2 * (start - floor),
        "val {val}, floor {floor}, start {start}"
    );
    assert!(
        val > floor - 0.05,
        "below the floor? val {val}, floor {floor}"
    );
}

/// bf16 matrix products (fp32 master weights) learn the corpus as fp32 does, over two DDP
/// ranks: the same validation loss within 0.02, and really other arithmetic (the weights
/// differ), so the bf16 path cannot be silently skipped.
#[test]
fn bf16_products_reach_the_floor_like_fp32() {
    if !cohort_engine::cpu::bf16_supported() {
        eprintln!("skipped: this CPU has neither AMX nor AVX512_BF16");
        return;
    }
    let fp32 = run_world(2, &markov_cfg()).swap_remove(0);
    let bf16 = run_world(
        2,
        &TrainConfig {
            precision: cohort_train::Precision::Bf16,
            ..markov_cfg()
        },
    )
    .swap_remove(0);
    let (v32, v16) = (
        fp32.val_losses.last().unwrap().1,
        bf16.val_losses.last().unwrap().1,
    );
    eprintln!("val loss fp32 {v32:.4}, bf16 {v16:.4}");
    assert!((v32 - v16).abs() < 0.02, "fp32 {v32}, bf16 {v16}");
    let moved = max_abs_diff(&fp32.params, &bf16.params);
    assert!(
        moved > 1e-4,
        "bf16 weights equal fp32's ({moved}): bf16 not in use?"
    );
}

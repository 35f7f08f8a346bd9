//! Pipeline parallelism against one process, with real processes: the test binary re-executes
//! itself through cohort-comm's spawn helper (`env://`, a hosted store, Unix sockets), each
//! child running one rank of `train_pipeline`, rank 0 writing the whole model's parameters
//! after a few steps. The parent trains one process on the same samples with the same
//! micro-batches (gradient accumulation) and compares every parameter.

use std::path::Path;
use std::time::Duration;

mod common;

use cohort_comm::spawn::{self, ProcessOptions};
use cohort_train::{
    process_group_from_env, train_pipeline, NanInjection, PipelineSchedule, Strategy, TrainConfig,
};
use common::{max_abs_diff, run_world};

/// Set in a child: where rank 0 writes the final parameters (raw little-endian f32).
const CHILD_OUT: &str = "COHORT_PIPELINE_TEST_OUT";
/// Set in a child: which scenario's config to run.
const CHILD_CASE: &str = "COHORT_PIPELINE_TEST_CASE";

/// A 4-block model small enough that a run takes well under a second.
fn tiny() -> TrainConfig {
    TrainConfig {
        n_layers: 4,
        eval_batches: 2,
        strategy: Strategy::Pipeline,
        micro_batches: 3,
        ..common::tiny()
    }
}

/// [`tiny`] at lr 0, evaluating five batches (not a multiple of two replicas).
fn unmoved() -> TrainConfig {
    TrainConfig {
        lr: 0.0,
        min_lr: 0.0,
        eval_batches: 5,
        ..tiny()
    }
}

/// The pipeline runs of the scenarios, by name.
fn case(name: &str) -> TrainConfig {
    match name {
        // Dropout on: every stage keys its masks by the global layer and the micro-batch.
        "2x1_1f1b" => TrainConfig {
            stages: 2,
            dropout: 0.1,
            ..tiny()
        },
        "2x1_gpipe" => TrainConfig {
            stages: 2,
            pipeline_schedule: PipelineSchedule::Gpipe,
            ..tiny()
        },
        "2x2" => TrainConfig {
            stages: 2,
            ..tiny()
        },
        // The last stage's gradient poisoned at step index 1, and clipping by value: the one
        // training loop skips that update on both stages and clamps as it does for DDP.
        "2x1_nan" => TrainConfig {
            stages: 2,
            inject_nan: Some(NanInjection::parse("1@1").unwrap()),
            clip_value: 0.01,
            ..tiny()
        },
        // At lr 0 the model stays the initial one; two replicas of one stage, or one
        // pipeline of two stages, evaluate the job's validation batches.
        "1x2_lr0" => TrainConfig {
            stages: 1,
            ..unmoved()
        },
        "2x1_lr0" => TrainConfig {
            stages: 2,
            ..unmoved()
        },
        other => panic!("unknown case {other}"),
    }
}

/// Runs `case` on `world` processes and returns rank 0's final parameters.
fn run_processes(case_name: &str, world: usize, dir: &Path) -> Vec<f32> {
    run_processes_with_val(case_name, world, dir).0
}

/// [`run_processes`], with rank 0's last validation loss.
fn run_processes_with_val(case_name: &str, world: usize, dir: &Path) -> (Vec<f32>, f32) {
    let out = dir.join(format!("{case_name}.f32"));
    let mut opts =
        ProcessOptions::current_exe(["--exact", "child_rank", "--nocapture", "--test-threads=1"])
            .unwrap();
    opts.env.push((CHILD_OUT.into(), out.clone().into()));
    opts.env.push((CHILD_CASE.into(), case_name.into()));
    opts.env.push(("COHORT_TIMEOUT".into(), "60s".into()));
    opts.env.push(("COHORT_NUM_THREADS".into(), "1".into()));
    opts.timeout = Duration::from_secs(120);
    spawn::processes(world, &opts).unwrap();
    let mut floats: Vec<f32> = std::fs::read(&out)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let val = floats.pop().unwrap();
    (floats, val)
}

/// Not a test of its own: the body of each child process (a no-op when run directly).
#[test]
fn child_rank() {
    let (Ok(out), Ok(name)) = (std::env::var(CHILD_OUT), std::env::var(CHILD_CASE)) else {
        return;
    };
    let pg = process_group_from_env().unwrap();
    let outcome = train_pipeline(&case(&name), &pg, &mut std::io::sink()).unwrap();
    assert_eq!(outcome.final_step, case(&name).steps);
    if case(&name).inject_nan.is_none() {
        assert!(outcome.train_losses.iter().all(|(_, l)| l.is_finite()));
    }
    if pg.rank() == 0 {
        // The parameters, then the last validation loss.
        let val = outcome.val_losses.last().map_or(f32::NAN, |v| v.1);
        let bytes: Vec<u8> = outcome
            .params
            .iter()
            .chain([&val])
            .flat_map(|x| x.to_le_bytes())
            .collect();
        std::fs::write(out, bytes).unwrap();
    }
}

/// One process with the same data order: batch `batch_size` per micro-batch, accumulated.
fn one_process(cfg: &TrainConfig) -> Vec<f32> {
    run_world(1, cfg).swap_remove(0).params
}

/// The pipeline's gradients are the one process's up to the order of two float additions:
/// every block, ln_f and wpe gradient is the same sum in the same order (each stage runs its
/// micro-batches' backwards in order, as accumulation does), and only the tied wte gradient
/// adds the last stage's head part to the first stage's embedding part at the end instead of
/// micro-batch by micro-batch, and the clipping norm is summed over stages in another order:
/// differences of ~1e-7 relative. AdamW moves parameters by ~lr = 2e-3 per step normalised
/// by the gradient's own size, so over 4 steps they stay within ~1e-6; 2e-5 (1% of one
/// step's move) still catches any wrong scaling, a missing tied sum or a mis-ordered
/// micro-batch, each of which is off by a whole step's move.
const TOL: f32 = 2e-5;

#[test]
fn two_stages_match_one_process_with_dropout_1f1b_and_gpipe() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["2x1_1f1b", "2x1_gpipe"] {
        let cfg = case(name);
        let piped = run_processes(name, 2, dir.path());
        let one = one_process(&TrainConfig {
            strategy: Strategy::Ddp,
            grad_accum: cfg.micro_batches,
            ..cfg.clone()
        });
        let diff = max_abs_diff(&piped, &one);
        eprintln!("{name}: max |pipeline - one process| = {diff:e}");
        assert!(diff <= TOL, "{name}: max |pipeline - one process| = {diff}");
        // Training moved the parameters by far more than the tolerance.
        let init = one_process(&TrainConfig {
            strategy: Strategy::Ddp,
            steps: 0,
            ..cfg.clone()
        });
        assert!(
            max_abs_diff(&one, &init) > 100.0 * TOL,
            "{name}: nothing trained"
        );
    }
}

/// Two pipelines of two stages (4 processes): each step sees both replicas' samples, as one
/// process with twice the micro-batch does (the sampler of a world of one hands out the same
/// permutation the two replicas split).
#[test]
fn two_stages_by_two_replicas_match_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = case("2x2");
    let piped = run_processes("2x2", 4, dir.path());
    let one = one_process(&TrainConfig {
        strategy: Strategy::Ddp,
        batch_size: 2 * cfg.batch_size,
        grad_accum: cfg.micro_batches,
        ..cfg.clone()
    });
    let diff = max_abs_diff(&piped, &one);
    eprintln!("2x2: max |pipeline - one process| = {diff:e}");
    assert!(diff <= TOL, "max |pipeline - one process| = {diff}");
}

/// The same model reports the same validation loss whether one process, two replicas or two
/// stages evaluate it: the replicas share out the job's list of validation batches instead of
/// each evaluating its own.
#[test]
fn the_same_model_has_the_same_validation_loss_however_it_is_pipelined() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = unmoved();
    let one = run_world(
        1,
        &TrainConfig {
            strategy: Strategy::Ddp,
            grad_accum: cfg.micro_batches,
            ..cfg.clone()
        },
    )
    .swap_remove(0);
    let want = one.val_losses.last().unwrap().1;
    for name in ["1x2_lr0", "2x1_lr0"] {
        let (params, val) = run_processes_with_val(name, 2, dir.path());
        assert!(params == one.params, "{name}: another model");
        eprintln!("{name}: val loss {val} vs {want} on one process");
        assert!((val - want).abs() < 1e-5, "{name}: {val} vs {want}");
    }
}

/// A NaN on one stage skips that step's update on every stage, as DDP's ranks do, and value
/// clipping clamps every stage's gradients: the pipeline ends where one process ends that
/// skips the same step with the same clamping, and not where a clean run ends.
#[test]
fn a_nan_on_one_stage_skips_the_update_on_every_stage() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = case("2x1_nan");
    let piped = run_processes("2x1_nan", 2, dir.path());
    assert!(piped.iter().all(|p| p.is_finite()));
    let same = TrainConfig {
        strategy: Strategy::Ddp,
        grad_accum: cfg.micro_batches,
        inject_nan: Some(NanInjection::parse("1").unwrap()),
        ..cfg.clone()
    };
    let diff = max_abs_diff(&piped, &one_process(&same));
    assert!(diff <= TOL, "max |pipeline - one process| = {diff}");
    let clean = one_process(&TrainConfig {
        inject_nan: None,
        ..same
    });
    assert!(
        max_abs_diff(&piped, &clean) > 100.0 * TOL,
        "the poisoned step was applied"
    );
}

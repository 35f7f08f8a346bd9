//! ZeRO-1 (`--strategy zero1`) against DDP, ranks as threads over real
//! loopback sockets: the same model from the same seed and data, on a
//! parameter count that no world size here divides (so the last shard is
//! padded), with clipping, accumulation and a NaN in one rank's shard; its
//! header's memory accounting; and its checkpoints, which resume on
//! another world size and under DDP.

mod common;

use cohort_comm::{spawn, ProcessGroup};
use cohort_engine::optim::{AdamW, AdamWConfig, DecayMask, Optimizer};
use cohort_train::{train, NanInjection, Outcome, Strategy, TrainConfig, TrainError, Zero1};
use common::{
    assert_stopped_run_resumes_like, grad_norms, max_abs_diff, odd, opts, run_world, with,
};

/// Sharding and the reduce-scatter change only the order of the gradient's
/// sums (one rank's shard summed over ranks rather than the whole buffer),
/// so ZeRO-1 and DDP agree to rounding; a wrong shard update or average is
/// off by a whole step (lr = 1e-3).
const TOL: f32 = 1e-5;

fn zero1(cfg: &TrainConfig) -> TrainConfig {
    with(Strategy::Zero1, cfg)
}

/// `cfg` on `world` ranks under DDP and under ZeRO-1, logging to temporary
/// directories: (DDP's rank 0, ZeRO-1's ranks, DDP's grad norms, ZeRO-1's).
fn both(world: usize, cfg: &TrainConfig) -> (Outcome, Vec<Outcome>, Vec<f64>, Vec<f64>) {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let ddp = run_world(
        world,
        &TrainConfig {
            log_dir: Some(a.path().into()),
            ..cfg.clone()
        },
    )
    .swap_remove(0);
    let zero = run_world(
        world,
        &TrainConfig {
            log_dir: Some(b.path().into()),
            ..zero1(cfg)
        },
    );
    (ddp, zero, grad_norms(a.path()), grad_norms(b.path()))
}

/// ZeRO-1's ranks agree bitwise, its parameters are DDP's within [`TOL`] and
/// so are its logged gradient norms (relatively): the norm is where a wrong
/// average (a sum, say) would show even though AdamW's update barely feels
/// a gradient's scale.
fn assert_matches_ddp(what: &str, world: usize, cfg: &TrainConfig) -> Vec<f32> {
    let (ddp, zero, ddp_norms, zero_norms) = both(world, cfg);
    let n = zero[0].params.len();
    assert_ne!(n % world, 0, "{what}: {n} parameters divide into {world}");
    for (r, o) in zero.iter().enumerate().skip(1) {
        assert!(o.params == zero[0].params, "{what}: rank {r} diverged");
    }
    let d = max_abs_diff(&zero[0].params, &ddp.params);
    eprintln!("{what}, world {world}: ZeRO-1 vs DDP max |diff| {d:e}");
    assert!(d < TOL, "{what}, world {world}: ZeRO-1 vs DDP {d}");
    assert_eq!(zero_norms.len(), cfg.steps as usize, "{what}");
    for (step, (z, d)) in zero_norms.iter().zip(&ddp_norms).enumerate() {
        assert!(
            (z - d).abs() <= 1e-5 * d,
            "{what}, world {world}, step {step}: grad norm {z} vs DDP's {d}"
        );
    }
    for ((s1, a), (s2, b)) in zero[0].train_losses.iter().zip(&ddp.train_losses) {
        assert_eq!(s1, s2);
        assert!((a - b).abs() < TOL, "{what}: loss {a} vs {b} at step {s1}");
    }
    zero_norms.iter().map(|&x| x as f32).collect()
}

#[test]
fn zero1_matches_ddp_on_2_and_3_ranks_with_a_padded_last_shard() {
    let start = run_world(1, &TrainConfig { steps: 0, ..odd() })
        .swap_remove(0)
        .params;
    for world in [2, 3] {
        assert_matches_ddp("plain", world, &odd());
        // The parameters did move, by far more than the tolerance.
        let zero = run_world(world, &zero1(&odd())).swap_remove(0);
        assert!(max_abs_diff(&zero.params, &start) > 1e-3);
    }
}

#[test]
fn zero1_clips_by_the_norm_over_all_shards_like_ddp() {
    let unclipped = run_world(2, &zero1(&odd())).swap_remove(0).params;
    for world in [2, 3] {
        // Below every step's norm, so every step is clipped, by a factor that
        // changes from step to step.
        let clip = 0.05;
        let cfg = TrainConfig {
            grad_clip: clip,
            ..odd()
        };
        let norms = assert_matches_ddp("grad_clip", world, &cfg);
        assert!(
            norms.iter().all(|&n| n > 2.0 * clip),
            "clipping should be active: norms {norms:?}"
        );
        if world == 2 {
            let clipped = run_world(2, &zero1(&cfg)).swap_remove(0).params;
            let d = max_abs_diff(&clipped, &unclipped);
            eprintln!("clipped vs unclipped: max |diff| {d:e}");
            assert!(d > 10.0 * TOL, "clipping changed nothing: {d}");
        }
    }
}

#[test]
fn zero1_accumulates_micro_batches_like_ddp() {
    for world in [2, 3] {
        let cfg = TrainConfig {
            grad_accum: 2,
            ..odd()
        };
        assert_matches_ddp("grad_accum 2", world, &cfg);
    }
}

/// A NaN in rank 1's shard only (no other rank sees it) skips the update on
/// every rank, as DDP skips it.
#[test]
fn a_nan_in_one_shard_skips_the_update_on_every_rank() {
    let cfg = TrainConfig {
        inject_nan: Some(NanInjection {
            first_step: 1,
            last_step: 1,
            rank: Some(1),
        }),
        ..odd()
    };
    let ddp = run_world(3, &cfg).swap_remove(0);
    let zero = run_world(3, &zero1(&cfg));
    for (r, o) in zero.iter().enumerate() {
        let d = max_abs_diff(&o.params, &ddp.params);
        assert!(d < TOL, "rank {r}: ZeRO-1 vs DDP after a skip: {d}");
    }
    let clean = run_world(3, &zero1(&odd())).swap_remove(0);
    assert!(
        max_abs_diff(&zero[0].params, &clean.params) > 1e-4,
        "the poisoned step was not skipped"
    );
}

/// Rank 0's header line `memory per rank: ...` of a one-step run of `cfg`
/// on `world` ranks.
fn memory_line(world: usize, cfg: &TrainConfig) -> String {
    let logs = spawn::threads_with(world, opts(), |pg: &ProcessGroup| {
        let mut log = Vec::new();
        let cfg = TrainConfig {
            steps: 1,
            ..cfg.clone()
        };
        train(&cfg, pg, &mut log).map(|_| String::from_utf8(log).unwrap())
    })
    .unwrap();
    assert!(
        logs[0].contains(&format!("ZeRO-1: {world} shards of"))
            == (cfg.strategy == Strategy::Zero1),
        "{}",
        logs[0]
    );
    logs[0]
        .lines()
        .find(|l| l.contains("memory per rank: "))
        .unwrap_or_else(|| panic!("no memory line in:\n{}", logs[0]))
        .to_string()
}

/// The `k` in `AdamW, 2 x k floats` of a memory line.
fn moment_floats(line: &str) -> usize {
    let rest = line.split("AdamW, 2 x ").nth(1).unwrap();
    rest.split(' ').next().unwrap().parse().unwrap()
}

/// The accounting at start: ZeRO-1's optimizer state is exactly 1/N of the
/// padded buffer's (DDP's, rounded up to N shards); parameters, gradients
/// and activations are DDP's.
#[test]
fn the_memory_line_shows_one_nth_of_ddps_optimizer_state() {
    let n = 19037usize;
    let ddp = memory_line(2, &odd());
    assert_eq!(moment_floats(&ddp), n, "{ddp}");
    for world in [2, 3] {
        let zero = memory_line(world, &zero1(&odd()));
        assert_eq!(moment_floats(&zero), n.div_ceil(world), "{zero}");
        assert!(moment_floats(&zero) * world - n < world);
        let ddp_mb = ddp.split("optimizer state ").nth(1).unwrap();
        let ddp_mb = ddp_mb.split(" (").next().unwrap();
        assert!(
            zero.contains(&format!("floats: 1/{world} of DDP's {ddp_mb})")),
            "{zero}\nvs {ddp}"
        );
        let before = |l: &str| l.split(", optimizer state").next().unwrap().to_string();
        assert_eq!(before(&zero), before(&ddp), "parameters and gradients");
        let acts = |l: &str| {
            let rest = l.split(", activations ").nth(1).unwrap();
            rest.split(',').next().unwrap().to_string()
        };
        assert_eq!(acts(&zero), acts(&ddp), "activations");
    }
}

/// A run stopped after 3 of 6 steps on 2 ranks resumes on 3 (the launcher's
/// elastic rescale keeps the global batch: grad_accum 3 -> 2) and ends where
/// the unbroken 2-rank run does, from a ZeRO-1 checkpoint and from a DDP one;
/// and a ZeRO-1 checkpoint resumes under DDP.
#[test]
fn zero1_checkpoints_resume_on_another_world_size_and_across_strategies() {
    let cfg = TrainConfig {
        steps: 6,
        lr_decay_steps: 6,
        grad_accum: 3,
        ..odd()
    };
    let straight = run_world(2, &zero1(&cfg)).swap_remove(0);
    for first in [Strategy::Zero1, Strategy::Ddp] {
        for (then, world) in [(Strategy::Zero1, 3), (Strategy::Ddp, 1)] {
            if first == Strategy::Ddp && then == Strategy::Ddp {
                continue;
            }
            assert_stopped_run_resumes_like(&straight, &cfg, (first, then), world, TOL);
        }
    }
}

/// The public step on plain buffers (what `cohort bench ddp --strategy
/// zero1` drives): 7 parameters over 2 and 3 ranks, each rank with its own
/// gradient, end where AdamW over the whole buffer with the ranks' mean
/// gradient does, on every rank; a buffer of the wrong length is refused by
/// name.
#[test]
fn the_zero1_step_on_flat_buffers_is_adamw_on_the_mean_gradient() {
    let n = 7;
    let grad = |rank: usize, step: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 3 + rank * 5 + step) % 11) as f32 / 7.0 - 0.6)
            .collect()
    };
    let mask = DecayMask::with_exempt(n, [2..4, 6..7]).unwrap();
    let init: Vec<f32> = (0..n).map(|i| i as f32 / 10.0).collect();
    for world in [2, 3] {
        let mut want = init.clone();
        let mut opt = AdamW::new(AdamWConfig::default(), mask.clone()).unwrap();
        for step in 0..3 {
            let mean: Vec<f32> = (0..n)
                .map(|i| (0..world).map(|r| grad(r, step)[i]).sum::<f32>() / world as f32)
                .collect();
            opt.step(&mut want, &mean, 1e-2).unwrap();
        }
        let got = spawn::threads_with(world, opts(), |pg: &ProcessGroup| {
            let mut params = init.clone();
            let mut zero = Zero1::new(pg, &params, &mask, AdamWConfig::default())?;
            assert_eq!(zero.shard_len(), n.div_ceil(world));
            for step in 0..3 {
                zero.step(pg, &grad(pg.rank(), step), &mut params, 1e-2)?;
            }
            let short = zero.reduce_scatter(pg, &params[1..]).unwrap_err();
            assert!(
                matches!(
                    short,
                    TrainError::BufferLength {
                        len: 6,
                        expected: 7,
                        ..
                    }
                ),
                "{short}"
            );
            Ok::<_, TrainError>(params)
        })
        .unwrap();
        for params in &got {
            assert!(
                max_abs_diff(params, &want) < 1e-6,
                "world {world}: {params:?} vs {want:?}"
            );
        }
    }
}

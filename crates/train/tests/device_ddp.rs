//! Data parallelism of a model in a device's memory, its gradients staged through the host, on
//! the emulated device (device buffers in host memory that the host may not read between
//! kernels, computed by the CPU's kernels): two ranks (threads with real loopback sockets).
//! The device's gradients are the CPU's bits and its buckets are the CPU DDP's, so every run
//! here must give the CPU DDP's bits: overlap, accumulation, clipping, the NaN skip on every
//! rank, bf16 compression, checkpoints and resume, and an elastic regroup; ZeRO-1 on the
//! device matches device DDP.

mod common;

use cohort_comm::{spawn, ProcessGroup};
use cohort_train::{train, DeviceChoice, NanInjection, Outcome, Overlap, Strategy, TrainConfig};
use common::{assert_stopped_run_resumes_like, max_abs_diff, odd, run_world, tiny};

/// See `train.rs`: runs that see the same samples in other batch shapes agree to this.
const REORDERED_TOL: f32 = 2e-5;

/// `cfg` on the emulated device, its communication overlapped with backward.
fn on_device(cfg: &TrainConfig) -> TrainConfig {
    TrainConfig {
        device: DeviceChoice::Emulated,
        overlap: Overlap::On,
        ..cfg.clone()
    }
}

/// `cfg` on the CPU with the same overlap.
fn on_cpu(cfg: &TrainConfig) -> TrainConfig {
    TrainConfig {
        device: DeviceChoice::Cpu,
        overlap: Overlap::On,
        ..cfg.clone()
    }
}

/// `world` ranks of `cfg`: every rank's outcome and rank 0's log.
fn run_logged(world: usize, cfg: &TrainConfig) -> (Vec<Outcome>, String) {
    let runs = spawn::threads_with(world, common::opts(), |pg: &ProcessGroup| {
        let mut log = Vec::new();
        let outcome = train(cfg, pg, &mut log)?;
        Ok::<_, cohort_train::TrainError>((outcome, String::from_utf8(log).unwrap()))
    })
    .unwrap();
    let log = runs[0].1.clone();
    (runs.into_iter().map(|(o, _)| o).collect(), log)
}

/// Both ranks end on the same parameters, which are the CPU DDP's bits.
fn assert_cpu_bits(what: &str, dev: &[Outcome], cpu: &[Outcome]) {
    assert!(dev[0].params == dev[1].params, "{what}: the ranks diverged");
    let d = max_abs_diff(&dev[0].params, &cpu[0].params);
    assert!(
        dev[0].params == cpu[0].params,
        "{what}: differs from the CPU's by {d:e}"
    );
    assert_eq!(dev[0].train_losses, cpu[0].train_losses, "{what}");
}

#[test]
fn two_device_ranks_are_cpu_ddps_bits_and_one_rank_with_the_doubled_batch() {
    // Accumulation (no_sync for the first micro-batch) and a clip that bites.
    let cfg = TrainConfig {
        grad_accum: 2,
        grad_clip: 0.05,
        ..tiny()
    };
    // Buckets of 10 KB: several all-reduces start while backward goes on.
    let small_buckets = TrainConfig {
        bucket_cap_mb: 0.01,
        ..cfg.clone()
    };
    let (dev, log) = run_logged(2, &on_device(&small_buckets));
    assert!(
        log.contains("gradients: host-staged: each range copied"),
        "{log}"
    );
    let buckets = log
        .split("DDP buckets: ")
        .nth(1)
        .and_then(|s| s.split(' ').next());
    let buckets: usize = buckets.and_then(|n| n.parse().ok()).unwrap_or(0);
    assert!(buckets > 2, "{log}");
    let cpu = run_world(2, &on_cpu(&cfg));
    assert_cpu_bits("accumulated and clipped", &dev, &cpu);
    let one = run_world(
        1,
        &on_device(&TrainConfig {
            batch_size: 2 * cfg.batch_size,
            ..cfg.clone()
        }),
    );
    let d = max_abs_diff(&dev[0].params, &one[0].params);
    eprintln!("2 device ranks vs 1 with the doubled batch: max |diff| {d:e}");
    assert!(d < REORDERED_TOL, "{d}");
    // Small buckets, overlap off: the same sums, bit for bit.
    let small = TrainConfig {
        bucket_cap_mb: 0.001,
        overlap: Overlap::Off,
        device: DeviceChoice::Emulated,
        ..cfg.clone()
    };
    let (off, log) = run_logged(2, &small);
    assert!(log.contains("after backward (overlap off)"), "{log}");
    assert_cpu_bits("overlap off", &off, &cpu);
}

#[test]
fn a_nan_on_one_device_rank_skips_the_update_on_every_rank() {
    let cfg = TrainConfig {
        inject_nan: Some(NanInjection::parse("1@1").unwrap()),
        ..tiny()
    };
    let (dev, log) = run_logged(2, &on_device(&cfg));
    assert!(
        log.contains("non-finite gradient on 1 rank(s): update skipped on every rank"),
        "{log}"
    );
    let cpu = run_world(2, &on_cpu(&cfg));
    // (the skipped step logs NaN on both, which == would call different)
    let text = |o: &Outcome| format!("{:?}", o.train_losses);
    assert_eq!(text(&dev[0]), text(&cpu[0]));
    assert!(dev[0].params == cpu[0].params && dev[1].params == cpu[0].params);
    assert!(dev[0].params.iter().all(|p| p.is_finite()));
}

#[test]
fn bf16_compression_on_the_device_is_the_cpus() {
    let cfg = TrainConfig {
        bf16_compress: Some(true),
        ..tiny()
    };
    let (dev, log) = run_logged(2, &on_device(&cfg));
    assert!(log.contains("all-reduced in bf16"), "{log}");
    let cpu = run_world(2, &on_cpu(&cfg));
    assert_cpu_bits("bf16 compression", &dev, &cpu);
    let f32s = run_world(2, &on_device(&tiny()));
    let d = max_abs_diff(&dev[0].params, &f32s[0].params);
    assert!(d > 0.0 && d < 1e-2, "bf16 against f32 gradients: {d}");
}

#[test]
fn two_device_ranks_save_and_resume_bitwise_and_regroup_elastically() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    // The schedule of the whole run, whichever part of it runs.
    let cfg = on_device(&TrainConfig {
        steps: 6,
        lr_decay_steps: 6,
        ..tiny()
    });
    let straight = run_world(2, &cfg);
    run_world(
        2,
        &TrainConfig {
            steps: 3,
            out: Some(out.clone()),
            ..cfg.clone()
        },
    );
    let resumed = run_world(
        2,
        &TrainConfig {
            resume: Some(out.join("step-000003")),
            ..cfg.clone()
        },
    );
    assert_eq!(resumed[0].steps_run, 3);
    assert_eq!(resumed[0].train_losses, straight[0].train_losses[3..]);
    assert!(
        resumed[0].params == straight[0].params,
        "resumed differently"
    );
    assert!(resumed[1].params == straight[0].params, "rank 1 diverged");

    // The launcher's elastic regroup, 2 ranks -> 1 (grad_accum 3 -> 6): the same samples.
    let accum = TrainConfig {
        grad_accum: 3,
        ..cfg.clone()
    };
    let straight = run_world(2, &accum).swap_remove(0);
    let pair = (Strategy::Ddp, Strategy::Ddp);
    assert_stopped_run_resumes_like(&straight, &accum, pair, 1, REORDERED_TOL);
}

#[test]
fn zero1_on_the_device_matches_device_ddp() {
    // 19037 parameters: two shards, the last padded; a clip that bites and accumulation.
    let cfg = on_device(&TrainConfig {
        grad_accum: 2,
        grad_clip: 0.05,
        ..odd()
    });
    let ddp = run_world(2, &cfg);
    let zero = TrainConfig {
        strategy: Strategy::Zero1,
        ..cfg.clone()
    };
    let (z, log) = run_logged(2, &zero);
    assert!(log.contains("ZeRO-1: 2 shards of"), "{log}");
    assert!(log.contains("reduce-scattered in f32"), "{log}");
    assert!(z[0].params == z[1].params, "the ranks diverged");
    let d = max_abs_diff(&z[0].params, &ddp[0].params);
    eprintln!("device ZeRO-1 vs device DDP: max |diff| {d:e}");
    assert!(d < 1e-5, "{d}");
    // The shard's guard and AdamW run on the host as the CPU's ZeRO-1 does: its bits, with
    // bf16 compression too.
    for bf16 in [false, true] {
        let zero = TrainConfig {
            bf16_compress: Some(bf16),
            ..zero.clone()
        };
        let dev = run_world(2, &zero);
        let cpu = run_world(2, &on_cpu(&zero));
        assert_cpu_bits(&format!("ZeRO-1, bf16 {bf16}"), &dev, &cpu);
    }

    // Its sharded checkpoint resumes bitwise.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    run_world(
        2,
        &TrainConfig {
            steps: 2,
            out: Some(out.clone()),
            ..zero.clone()
        },
    );
    let resumed = run_world(
        2,
        &TrainConfig {
            resume: Some(out.join("step-000002")),
            ..zero.clone()
        },
    );
    assert!(
        resumed[0].params == z[0].params,
        "ZeRO-1 resumed differently"
    );
}

#[test]
fn zero2_and_zero3_on_a_device_are_a_one_line_refusal() {
    for strategy in [Strategy::Zero2, Strategy::Zero3] {
        let cfg = TrainConfig {
            strategy,
            ..on_device(&tiny())
        };
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.starts_with("--device emulated: --strategy zero"), "{e}");
        assert!(e.contains("not on a device yet"), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }
}

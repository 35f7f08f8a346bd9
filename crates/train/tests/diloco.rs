//! DiLoCo and local SGD (`--strategy diloco`, `local-sgd`), ranks as threads
//! over real loopback sockets: local SGD on one rank is plain training; the
//! ranks hold one model after every sync; a stopped run resumes bitwise on
//! as many ranks, regroups on another number, and DDP resumes its
//! checkpoint. The outer step itself is checked against a hand computation
//! in the module's unit tests.

mod common;

use cohort_train::{elastic, Precision, Strategy, TrainConfig};
use common::{max_abs_diff, run_world, tiny, with};

fn diloco(sync_every: u64, cfg: &TrainConfig) -> TrainConfig {
    TrainConfig {
        sync_every,
        ..with(Strategy::Diloco, cfg)
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// On one rank the pseudo-gradient is θ − θ_r and local SGD's outer step
/// gives back θ − (θ − θ_r): θ_r to the rounding of the two subtractions,
/// a few ulps of the parameters (an outer step that averaged wrongly or
/// stepped twice would be off by a whole update, ~1e-3).
#[test]
fn local_sgd_on_one_rank_is_plain_training() {
    let cfg = TrainConfig { steps: 6, ..tiny() };
    let plain = run_world(1, &cfg).swap_remove(0);
    for h in [1, 4] {
        let local = TrainConfig {
            sync_every: h,
            ..with(Strategy::LocalSgd, &cfg)
        };
        let got = run_world(1, &local).swap_remove(0);
        let d = max_abs_diff(&got.params, &plain.params);
        assert!(d < 1e-5, "H = {h}: max |diff| {d}");
    }
}

/// After every sync the ranks hold bitwise the same parameters (the run's
/// last step always syncs, also off the H grid), and between syncs they
/// train apart; in bf16 too.
#[test]
fn the_ranks_leave_every_sync_with_one_model() {
    for (h, steps, dtype) in [
        (2, 4, Precision::Fp32),
        (3, 5, Precision::Fp32),
        (2, 4, Precision::Bf16),
    ] {
        let cfg = TrainConfig {
            steps,
            pseudo_grad_dtype: dtype,
            ..diloco(h, &tiny())
        };
        let ranks = run_world(2, &cfg);
        assert!(
            ranks[0].params == ranks[1].params,
            "H {h}, {steps} steps, {dtype:?}: ranks differ after the last sync"
        );
        let loss = ranks[0].train_losses.last().unwrap().1;
        assert!(loss.is_finite(), "{loss}");
    }
    // One step short of a sync, with no last-step sync either (the run is
    // longer): the ranks differ. Seen by stopping after 1 of 3 steps' H = 2.
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainConfig {
        steps: 3,
        save_interval: 1,
        out: Some(dir.path().join("ckpt")),
        ..diloco(2, &tiny())
    };
    run_world(2, &cfg);
    let step1 = dir.path().join("ckpt/step-000001");
    let file = cohort_gpt::checkpoint::read_tensor_file(&step1, "optimizer.safetensors")
        .unwrap()
        .unwrap();
    let own = |r: usize| {
        let name = format!("diloco.rank{r}.params");
        file.tensors
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap()
            .1
            .clone()
    };
    assert!(own(0) != own(1), "ranks train apart between syncs");
}

/// A run saved at step 4 of 8 (H = 3: between syncs, the ranks apart)
/// resumes from that checkpoint on as many ranks to bitwise the parameters
/// and losses of the run that went on.
#[test]
fn a_saved_run_resumes_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainConfig {
        steps: 8,
        ..diloco(3, &tiny())
    };
    let straight = run_world(
        2,
        &TrainConfig {
            save_interval: 4,
            out: Some(dir.path().join("straight")),
            ..cfg.clone()
        },
    );
    let resumed = run_world(
        2,
        &TrainConfig {
            resume: Some(dir.path().join("straight/step-000004")),
            out: Some(dir.path().join("resumed")),
            ..cfg.clone()
        },
    );
    assert_eq!(resumed[0].steps_run, 4);
    for r in 0..2 {
        assert_eq!(
            bits(&resumed[r].params),
            bits(&straight[r].params),
            "rank {r}"
        );
    }
    let tail = |o: &cohort_train::Outcome| -> Vec<(u64, u32)> {
        (o.train_losses.iter())
            .filter(|(s, _)| *s > 4)
            .map(|(s, l)| (*s, l.to_bits()))
            .collect()
    };
    assert_eq!(tail(&resumed[0]), tail(&straight[0]));
}

/// A DiLoCo checkpoint of 2 ranks taken between syncs resumes on 3
/// (regrouped at the last sync: every rank from the global parameters) and under DDP on 1; both train on
/// with one model.
#[test]
fn a_checkpoint_regroups_on_another_world_and_resumes_under_ddp() {
    let cfg = TrainConfig {
        train_sequences: 96,
        steps: 6,
        grad_accum: 3,
        ..diloco(2, &tiny())
    };
    let dir = tempfile::tempdir().unwrap();
    run_world(
        2,
        &TrainConfig {
            save_interval: 3,
            out: Some(dir.path().join("first")),
            ..cfg.clone()
        },
    );
    // Step 3 is no sync (H = 2): the ranks stand apart in it.
    let out = dir.path().join("first/step-000003");
    for (then, world) in [(Strategy::Diloco, 3), (Strategy::Ddp, 1)] {
        let (resume, _) = elastic::prepare_resume(
            &TrainConfig {
                resume: Some(out.clone()),
                out: Some(dir.path().join(format!("{then:?}"))),
                strategy: then,
                ..cfg.clone()
            },
            world,
            0,
        );
        let ranks = run_world(world, &resume);
        assert_eq!(ranks[0].steps_run, 3, "{then:?} x{world}");
        for r in 1..world {
            assert!(ranks[r].params == ranks[0].params, "{then:?}: rank {r}");
        }
        let loss = ranks[0].train_losses.last().unwrap().1;
        assert!(loss.is_finite() && loss < 3.0, "{then:?}: {loss}");
    }
}

fn overlapped(sync_every: u64, cfg: &TrainConfig) -> TrainConfig {
    TrainConfig {
        outer_overlap: true,
        ..diloco(sync_every, cfg)
    }
}

/// Overlapped local SGD on one rank is plain training too, τ steps or a
/// round late: the outer step gives θ the sync's parameters, and θ − (s −
/// x) the rank's own again (to the rounding of the subtractions).
#[test]
fn overlapped_local_sgd_on_one_rank_is_plain_training() {
    let cfg = TrainConfig { steps: 7, ..tiny() };
    let plain = run_world(1, &cfg).swap_remove(0);
    for delay in [1, 3] {
        let local = TrainConfig {
            strategy: Strategy::LocalSgd,
            outer_overlap_steps: delay,
            ..overlapped(3, &cfg)
        };
        let got = run_world(1, &local).swap_remove(0);
        let d = max_abs_diff(&got.params, &plain.params);
        assert!(d < 1e-5, "τ {delay}: max |diff| {d}");
    }
}

/// Overlapped DiLoCo on 2 ranks ends with one model, in fp32 and bf16; a
/// run saved just after a sync (its all-reduce in flight) and one saved
/// mid-round (the average arrived, not yet applied) resume on as many
/// ranks to bitwise the run that went on, and the checkpoint resumes
/// synchronously and on 3 ranks too.
#[test]
fn overlapped_diloco_ends_as_one_model_and_resumes_bitwise() {
    for dtype in [Precision::Fp32, Precision::Bf16] {
        let cfg = TrainConfig {
            steps: 5,
            pseudo_grad_dtype: dtype,
            ..overlapped(2, &tiny())
        };
        let ranks = run_world(2, &cfg);
        assert!(ranks[0].params == ranks[1].params, "{dtype:?}");
        let loss = ranks[0].train_losses.last().unwrap().1;
        assert!(loss.is_finite() && loss < 3.0, "{dtype:?}: {loss}");
    }
    let dir = tempfile::tempdir().unwrap();
    // Syncs after steps 3, 6 and 8. One round late (τ = H = 3), the outer
    // step started at 3 is taken at 6; with τ = 1 it is taken after step 4
    // and the one of 6 after 7. Saved at 3 (in flight), at 4 (arrived, or
    // just taken) and at 5 (τ = 1: nothing pending).
    for (delay, save_at) in [(3, 3), (3, 4), (1, 3), (1, 5)] {
        let cfg = TrainConfig {
            steps: 8,
            outer_overlap_steps: delay,
            ..overlapped(3, &tiny())
        };
        let straight = run_world(
            2,
            &TrainConfig {
                save_interval: save_at,
                out: Some(dir.path().join(format!("straight{delay}-{save_at}"))),
                ..cfg.clone()
            },
        );
        let ckpt = (dir.path()).join(format!("straight{delay}-{save_at}/step-{save_at:06}"));
        let file = cohort_gpt::checkpoint::read_tensor_file(&ckpt, "optimizer.safetensors")
            .unwrap()
            .unwrap();
        let has = |name: &str| file.tensors.iter().any(|(n, _)| n == name);
        assert!(has("diloco.rank1.start"));
        assert_eq!(
            has("diloco.pending"),
            save_at < 3 + delay,
            "τ {delay}, {save_at}"
        );
        let resumed = run_world(
            2,
            &TrainConfig {
                resume: Some(ckpt.clone()),
                out: Some(dir.path().join(format!("resumed{delay}-{save_at}"))),
                ..cfg.clone()
            },
        );
        assert_eq!(resumed[0].steps_run, 8 - save_at);
        for r in 0..2 {
            assert_eq!(
                bits(&resumed[r].params),
                bits(&straight[r].params),
                "τ {delay}, saved at {save_at}: rank {r}"
            );
        }
        if (delay, save_at) != (3, 4) {
            continue;
        }
        for (overlap, world) in [(false, 2), (true, 3)] {
            let (resume, _) = elastic::prepare_resume(
                &TrainConfig {
                    resume: Some(ckpt.clone()),
                    out: Some(dir.path().join(format!("other{overlap}{world}"))),
                    outer_overlap_steps: delay,
                    outer_overlap: overlap,
                    ..cfg.clone()
                },
                world,
                0,
            );
            let ranks = run_world(world, &resume);
            for r in 1..world {
                assert!(ranks[r].params == ranks[0].params, "{overlap} x{world}");
            }
        }
    }
}

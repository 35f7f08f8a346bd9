//! Training a model in a device's memory (`--device`), on the emulated device: device buffers
//! in host memory that the host may not read between kernels, computed by the CPU's kernels.
//! So the whole device path (upload, forward and backward, the gradient norm, clipping and
//! AdamW as kernels, the loss read back, checkpoints through host copies, resume by upload)
//! runs without a GPU, and must give the CPU's bits.

mod common;

use cohort_train::{DeviceChoice, NanInjection, Strategy, TrainConfig};
use common::{max_abs_diff, run_world, tiny};

/// Twenty steps with dropout, a clip that bites and an evaluation, on `device`.
fn twenty(device: DeviceChoice) -> TrainConfig {
    TrainConfig {
        steps: 20,
        lr_decay_steps: 20,
        dropout: 0.1,
        grad_clip: 0.5,
        eval_interval: 10,
        device,
        ..tiny()
    }
}

#[test]
fn twenty_steps_on_the_emulated_device_are_the_cpus_bits() {
    let cpu = run_world(1, &twenty(DeviceChoice::Cpu)).swap_remove(0);
    let dev = run_world(1, &twenty(DeviceChoice::Emulated)).swap_remove(0);
    assert_eq!(cpu.train_losses.len(), 20);
    assert_eq!(dev.train_losses, cpu.train_losses);
    assert_eq!(dev.val_losses, cpu.val_losses);
    assert!(dev.params == cpu.params, "parameters differ");
}

#[test]
fn a_nan_in_a_device_gradient_skips_the_step_as_on_the_cpu() {
    let cfg = |device| TrainConfig {
        steps: 6,
        inject_nan: Some(NanInjection::parse("2-3").unwrap()),
        device,
        ..tiny()
    };
    let cpu = run_world(1, &cfg(DeviceChoice::Cpu)).swap_remove(0);
    let dev = run_world(1, &cfg(DeviceChoice::Emulated)).swap_remove(0);
    // (the skipped steps log NaN on both, which == would call different)
    let text = |o: &cohort_train::Outcome| format!("{:?}", o.train_losses);
    assert_eq!(text(&dev), text(&cpu));
    assert!(dev.params == cpu.params, "parameters differ");
    assert!(dev.params.iter().all(|p| p.is_finite()));
}

#[test]
fn a_device_run_saves_and_resumes_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ckpt");
    let cfg = twenty(DeviceChoice::Emulated);
    let straight = run_world(1, &cfg).swap_remove(0);
    let first = TrainConfig {
        steps: 10,
        out: Some(out.clone()),
        ..cfg.clone()
    };
    run_world(1, &first);
    assert!(out.join("step-000010").join("model.safetensors").is_file());
    // Resumed on the device, and on the CPU from the device's checkpoint: the same bits.
    for device in [DeviceChoice::Emulated, DeviceChoice::Cpu] {
        let resumed = TrainConfig {
            resume: Some(out.join("step-000010")),
            out: None,
            device,
            ..cfg.clone()
        };
        let resumed = run_world(1, &resumed).swap_remove(0);
        assert_eq!(resumed.steps_run, 10, "{device}");
        assert_eq!(
            resumed.train_losses,
            straight.train_losses[10..],
            "{device}"
        );
        assert!(
            resumed.params == straight.params,
            "{device}: parameters differ"
        );
    }
}

#[test]
fn two_ranks_stage_a_device_models_gradients_through_the_host() {
    let cfg = |device| TrainConfig {
        steps: 6,
        device,
        ..tiny()
    };
    let cpu = run_world(2, &cfg(DeviceChoice::Cpu));
    let dev = run_world(2, &cfg(DeviceChoice::Emulated));
    // The same buckets reduced on the host: the CPU's bits (see device_ddp.rs for the rest).
    let d = max_abs_diff(&dev[0].params, &cpu[0].params);
    assert!(dev[0].params == cpu[0].params, "differs by {d:e}");
    assert!(dev[0].params == dev[1].params, "the ranks diverged");
}

/// The default for a model on a device: NCCL where every rank has a GPU and NCCL, else host
/// staging; the header says which and why (this test program registers no NCCL), and
/// `--backend nccl` off a CUDA GPU is refused before anything starts.
#[test]
fn the_header_says_why_gradients_are_staged_and_nccl_needs_cuda() {
    let cfg = TrainConfig {
        steps: 1,
        device: DeviceChoice::Emulated,
        ..tiny()
    };
    let logs = cohort_comm::spawn::threads_with(2, common::opts(), |pg| {
        let mut log = Vec::new();
        cohort_train::train(&cfg, pg, &mut log).map(|_| String::from_utf8(log).unwrap())
    })
    .unwrap();
    let line = logs[0]
        .lines()
        .find(|l| l.starts_with("gradients: host-staged"))
        .unwrap();
    assert!(
        line.ends_with(
            "(host staging: this program was built without NCCL (the cohort binary has it))"
        ),
        "{line}"
    );
    for device in [DeviceChoice::Emulated, DeviceChoice::Cpu] {
        let nccl = TrainConfig {
            backend: "nccl".into(),
            device,
            ..tiny()
        };
        let e = nccl.validate().unwrap_err().to_string();
        assert!(
            e.starts_with("invalid setting backend = nccl: NCCL moves GPU memory"),
            "{e}"
        );
    }
}

#[test]
fn what_a_device_cannot_do_yet_is_a_one_line_error() {
    let refused = [
        with_strategy(Strategy::Zero3),
        TrainConfig {
            clip_value: 0.5,
            device: DeviceChoice::Emulated,
            ..tiny()
        },
    ];
    for cfg in refused {
        let e = cfg.validate().unwrap_err().to_string();
        assert!(e.starts_with("--device emulated: "), "{e}");
        assert!(e.contains("not on a device yet"), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }
}

fn with_strategy(strategy: Strategy) -> TrainConfig {
    TrainConfig {
        strategy,
        device: DeviceChoice::Emulated,
        ..tiny()
    }
}

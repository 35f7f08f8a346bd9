//! `cohort gpu info`, `check` and `nccl` on a machine without a GPU: one line naming the
//! library and the places looked, exit status 1, no panic. Where a driver is found this test has
//! nothing to check (the GPU script runs the real thing) and says so.

use std::process::Command;

#[test]
fn gpu_subcommands_without_a_driver_fail_in_one_line() {
    for sub in ["info", "check", "nccl"] {
        let out = Command::new(env!("CARGO_BIN_EXE_cohort"))
            .args(["gpu", sub])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !stderr.contains("no GPU/driver") {
            eprintln!(
                "skipped: cohort gpu {sub} found a driver here (status {})",
                out.status
            );
            return;
        }
        assert_eq!(out.status.code(), Some(1), "cohort gpu {sub}: {stderr}");
        assert!(!stderr.contains("panicked"), "cohort gpu {sub}: {stderr}");
        let line = stderr.lines().find(|l| l.starts_with("Error:")).unwrap();
        assert!(
            line.contains(&format!(
                "cohort gpu {sub}: no GPU/driver: looked for libcuda.so.1"
            )) && line.contains("the ldconfig cache"),
            "{line}"
        );
        assert_eq!(
            stderr.lines().filter(|l| l.starts_with("Error:")).count(),
            1,
            "{stderr}"
        );
    }
}

/// `--device cuda` where there is no driver: one line naming the flag and what was looked for,
/// and for `cohort train` the exit code that tells `cohort run` not to restart the worker.
#[test]
fn device_cuda_without_a_driver_fails_in_one_line() {
    let runs: [(&[&str], i32); 3] = [
        (
            &["train", "--steps", "1", "--device", "cuda:0"],
            cohort_launcher::EXIT_NOT_RETRYABLE,
        ),
        (
            &[
                "bench", "train", "--config", "A", "--steps", "1", "--device", "cuda",
            ],
            1,
        ),
        (
            &[
                "sample",
                "--checkpoint",
                ".",
                "--prompt",
                "1",
                "--device",
                "cuda",
            ],
            1,
        ),
    ];
    for (args, code) in runs {
        let out = Command::new(env!("CARGO_BIN_EXE_cohort"))
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        if args[0] != "sample" && !stderr.contains("no GPU/driver") {
            eprintln!(
                "skipped: {args:?} found a driver here (status {})",
                out.status
            );
            continue;
        }
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("Error:")).collect();
        assert_eq!(errors.len(), 1, "{args:?}: {stderr}");
        assert!(
            errors[0].contains("--device cuda"),
            "{args:?}: {}",
            errors[0]
        );
        assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
    }
}

/// `cohort bench train` on the emulated device (the device path on the host): it runs and says
/// where.
#[test]
fn bench_train_runs_on_the_emulated_device() {
    let out = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(["bench", "train", "--config", "A", "--threads", "1"])
        .args([
            "--steps", "2", "--warmup", "1", "--seq", "32", "--batch", "2",
        ])
        .args(["--device", "emulated", "--json"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(v["device"], "emulated", "{v}");
    assert_eq!(
        (v["seq"].as_u64(), v["batch"].as_u64()),
        (Some(32), Some(2))
    );
    assert!(v["final_loss"].as_f64().unwrap().is_finite(), "{v}");
}

//! `cohort gpu info` and `cohort gpu check` on a machine without a GPU: one line naming the
//! library and the places looked, exit status 1, no panic. Where a driver is found this test has
//! nothing to check (the GPU script runs the real thing) and says so.

use std::process::Command;

#[test]
fn gpu_subcommands_without_a_driver_fail_in_one_line() {
    for sub in ["info", "check"] {
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

//! Host-staged DDP of a model in a device's memory through the real launcher: two worker
//! processes on the emulated device (device buffers in host memory, the CPU's kernels), their
//! gradients copied to the host as backward finishes them and all-reduced there while it goes
//! on. They must end on the CPU DDP's parameters, bit for bit, and a killed worker must
//! restart the group, which resumes to the same parameters.

mod support;

use std::path::Path;
use std::time::Duration;

use support::{cohort, kill, params, wait_for_checkpoint, worker_pid, Proc, TINY};

/// `train` on `device` with a checkpoint every 5 steps, buckets of 10 KB overlapped with
/// backward.
fn train_args(out: &Path, device: &str, steps: &str) -> Vec<String> {
    let mut args: Vec<String> = [
        "train",
        "--steps",
        steps,
        "--batch-size",
        "2",
        "--save-interval",
        "5",
        "--log-interval",
        "5",
        "--warmup-steps",
        "2",
        "--bucket-cap-mb",
        "0.01",
        "--overlap",
        "on",
        "--device",
        device,
        "--out",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.push(out.display().to_string());
    args.extend(TINY.iter().map(|s| s.to_string()));
    args
}

/// `cohort run --standalone -n 2 [launcher flags] train ...`, to the end.
fn run(out: &Path, device: &str, steps: &str) -> String {
    let mut cmd = cohort();
    cmd.args(["run", "--standalone", "-n", "2"])
        .args(train_args(out, device, steps));
    let (status, log) = Proc::spawn(cmd).finish(Duration::from_secs(120));
    assert!(status.success(), "{log}");
    log
}

#[test]
fn two_device_processes_end_on_cpu_ddps_parameters_and_restart_after_a_kill() {
    let (cpu, dev) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    run(cpu.path(), "cpu", "20");
    let log = run(dev.path(), "emulated", "20");
    assert!(
        log.contains("gradients: host-staged: each range copied"),
        "{log}"
    );
    let want = params(cpu.path());
    assert!(
        params(dev.path()) == want,
        "device DDP differs from CPU DDP"
    );

    // A killed worker: the launcher restarts the group, which resumes from the last
    // checkpoint on the device to the same parameters (200 steps leave time to kill).
    let (base, tmp) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    run(base.path(), "emulated", "200");
    let mut cmd = cohort();
    cmd.args(["run", "--standalone", "-n", "2", "--max-restarts", "1"])
        .args(["--grace-period", "1"])
        .args(train_args(tmp.path(), "emulated", "200"));
    let proc = Proc::spawn(cmd);
    wait_for_checkpoint(tmp.path(), &proc);
    kill(worker_pid(proc.pid, 1), libc::SIGKILL);
    let (status, log) = proc.finish(Duration::from_secs(120));
    assert!(status.success(), "{log}");
    assert!(
        log.contains("[rank0]: restart 1 of this job: resuming from"),
        "{log}"
    );
    assert!(
        params(tmp.path()) == params(base.path()),
        "the restarted device run differs from the uninterrupted one"
    );
}

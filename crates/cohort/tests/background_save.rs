//! Saves off the training thread end to end: a background save writes the
//! bytes a synchronous one writes, training goes on while it is written, and
//! a job killed with SIGKILL in the middle of one keeps the last good
//! checkpoint, from which it resumes to the uninterrupted run's parameters.

mod support;

use std::path::Path;
use std::time::Duration;

use support::{checkpoint_files, checkpoint_step, cohort, kill, params, worker_pid, Proc, TINY};

/// `cohort run --standalone -n 2 train` for 20 steps, a checkpoint every 5, into `out`.
fn train(out: &Path, extra: &[&str]) -> Proc {
    train_with(out, extra, None)
}

/// [`train`] with the save delay test hook (`STEP:SECS`).
fn train_with(out: &Path, extra: &[&str], save_delay: Option<&str>) -> Proc {
    let mut cmd = cohort();
    if let Some(delay) = save_delay {
        cmd.env("COHORT_TEST_SAVE_DELAY", delay);
    }
    cmd.args(["run", "--standalone", "-n", "2", "train", "--steps", "20"])
        .args([
            "--save-interval",
            "5",
            "--log-interval",
            "5",
            "--warmup-steps",
            "2",
        ])
        .args(["--keep-checkpoints", "0", "--out", out.to_str().unwrap()])
        .args(TINY)
        .args(extra);
    Proc::spawn(cmd)
}

fn finished(proc: Proc) -> String {
    let (status, out) = proc.finish(Duration::from_secs(120));
    assert!(status.success(), "{out}");
    out
}

fn same_files(a: &Path, b: &Path) {
    let (fa, fb) = (checkpoint_files(a), checkpoint_files(b));
    let names = |f: &[(String, Vec<u8>)]| f.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&fa), names(&fb), "{} vs {}", a.display(), b.display());
    for ((name, x), (_, y)) in fa.iter().zip(&fb) {
        assert!(x == y, "{name} differs: {} vs {}", a.display(), b.display());
    }
}

#[test]
fn a_background_save_writes_the_bytes_a_synchronous_one_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let (sync, background) = (tmp.path().join("sync"), tmp.path().join("background"));
    finished(train(&sync, &["--save-mode", "sync"]));
    finished(train(&background, &[]));
    for step in ["step-000005", "step-000010", "step-000015", "step-000020"] {
        same_files(&sync.join(step), &background.join(step));
    }
    // Resumed from a background save, the run ends where the synchronous one did.
    let resumed = tmp.path().join("resumed");
    let mid = background.join("step-000010");
    let out = finished(train(&resumed, &["--resume", mid.to_str().unwrap()]));
    assert!(out.contains("at step 10"), "{out}");
    same_files(&sync.join("step-000020"), &resumed.join("step-000020"));
}

#[test]
fn a_job_killed_during_a_background_save_resumes_from_the_last_good_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let (whole, killed) = (tmp.path().join("whole"), tmp.path().join("killed"));
    finished(train(&whole, &[]));
    // The writer of step 10's checkpoint sleeps a minute before it writes: training goes
    // on to step 15 (whose save then waits for it), where rank 0 is killed mid-save.
    let run = train_with(&killed, &[], Some("10:60"));
    run.wait_for("[step 15 / 20] loss = ", Duration::from_secs(60));
    assert_eq!(checkpoint_step(&killed), Some(5), "{}", run.output());
    kill(worker_pid(run.pid, 0), libc::SIGKILL);
    let (status, out) = run.finish(Duration::from_secs(60));
    assert!(!status.success(), "{out}");
    assert!(out.contains("signal 9 (SIGKILL)"), "{out}");
    assert_eq!(checkpoint_step(&killed), Some(5), "{out}");
    assert!(!killed.join("step-000010").exists(), "{out}");
    // The previous checkpoint is intact and resumes to the unbroken run's parameters.
    let out = finished(train(&killed, &["--resume", killed.to_str().unwrap()]));
    assert!(out.contains("at step 5"), "{out}");
    assert!(
        params(&killed.join("step-000020")) == params(&whole.join("step-000020")),
        "the resumed run's parameters differ from the unbroken run's"
    );
}

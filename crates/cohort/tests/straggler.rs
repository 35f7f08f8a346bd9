//! Straggler naming end to end: in a 3-rank job where rank 1 is slowed by a
//! test hook, the log lines, the run log (TensorBoard's `straggler/*` and
//! metrics.jsonl) and the summary name rank 1; an even job names nobody.

mod support;

use std::time::Duration;

use support::{cohort, Proc, TINY};

/// The job's output and its metrics.jsonl.
fn job(slow: Option<&str>) -> (String, String) {
    let tmp = tempfile::tempdir().unwrap();
    let mut cmd = cohort();
    cmd.args(["run", "--standalone", "-n", "3", "train", "--steps", "20"])
        .args(["--log-interval", "10", "--warmup-steps", "2"])
        .args(["--out", tmp.path().to_str().unwrap()])
        .args(TINY);
    if let Some(hook) = slow {
        cmd.env("COHORT_TEST_SLOW_RANK", hook);
    }
    let (status, out) = Proc::spawn(cmd).finish(Duration::from_secs(120));
    assert!(status.success(), "{out}");
    let metrics = std::fs::read_to_string(tmp.path().join("logs/metrics.jsonl")).unwrap();
    (out, metrics)
}

#[test]
fn a_slowed_rank_is_named_the_straggler_and_an_even_run_names_none() {
    let (out, metrics) = job(Some("1:60"));
    let named: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("[rank0]: [step") && l.contains("straggler: rank 1 computes"))
        .collect();
    assert_eq!(named.len(), 2, "both log lines name rank 1:\n{out}");
    // The second line's verdict covers both windows.
    assert!(named[1].contains("over the last 20 steps"), "{out}");
    let summary = out
        .lines()
        .find(|l| l.starts_with("[rank0]: straggler: rank 1 computes"));
    assert!(summary.is_some(), "the summary names rank 1:\n{out}");
    assert!(metrics.contains("\"straggler\":{\"rank\":1"), "{metrics}");
    let (even, metrics) = job(None);
    assert!(!even.contains("straggler"), "{even}");
    assert!(!metrics.contains("\"straggler\""), "{metrics}");
}

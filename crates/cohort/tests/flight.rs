//! A hang explained end to end: a 3-rank training job where rank 1 skips
//! one all-reduce (a test hook) fails within the collective timeout, and
//! one line of the job's output names rank 1, the op and its sequence
//! number; every rank's ring is written as JSON beside the checkpoints.

mod support;

use std::time::{Duration, Instant};

use support::{cohort, Proc, TINY};

#[test]
fn a_rank_that_skips_an_all_reduce_is_named_by_the_flight_recorder() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cmd = cohort();
    cmd.args(["run", "--standalone", "-n", "3", "train", "--steps", "20"])
        .args(["--out", tmp.path().to_str().unwrap()])
        .args(TINY)
        .env("COHORT_TEST_SKIP_ALL_REDUCE", "1:6")
        .env("COHORT_TIMEOUT", "10");
    let t = Instant::now();
    let (status, out) = Proc::spawn(cmd).finish(Duration::from_secs(120));
    assert!(!status.success(), "{out}");
    assert!(
        t.elapsed() < Duration::from_secs(10 + 10),
        "took {:?}",
        t.elapsed()
    );
    let verdicts: Vec<&str> = out
        .lines()
        // As forwarded live (the launcher repeats the failed rank's last lines).
        .filter(|l| l.starts_with("[rank") && l.contains("flight recorder (group"))
        .collect();
    assert_eq!(verdicts.len(), 1, "one verdict:\n{out}");
    let line = verdicts[0];
    // Rank 1 skipped an all-reduce, so its next one met the others' skipped one.
    assert!(line.contains("rank 1 issued all_reduce #"), "{line}");
    assert!(
        line.contains("where the others issued all_reduce #"),
        "{line}"
    );
    assert!(line.contains("ranks 0, 2 waited in all_reduce #"), "{line}");
    let rings = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("flight-"))
        .count();
    assert_eq!(rings, 3, "{out}");
}

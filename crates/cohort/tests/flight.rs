//! A hang explained end to end: a 3-rank training job where rank 1 skips
//! one all-reduce (a test hook) fails within the collective timeout, and
//! one line of the job's output names rank 1, the op and its sequence
//! number; every rank's ring is written as JSON beside the checkpoints.
//! `cohort debug dump` reads a live job's rings from its store and lists
//! every rank without stopping it.

mod support;

use std::time::{Duration, Instant};

use support::{cohort, free_port, Proc, SECRET, TINY};

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

#[test]
fn debug_dump_lists_every_rank_of_a_live_job() {
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let mut cmd = cohort();
    cmd.args([
        "run",
        "-n",
        "2",
        "--master-port",
        &port,
        "train",
        "--steps",
        "100000",
    ])
    .args(["--log-interval", "10", "--warmup-steps", "2"])
    .args(["--out", tmp.path().to_str().unwrap()])
    .args(TINY)
    .env("COHORT_SECRET", SECRET);
    let job = Proc::spawn(cmd);
    job.wait_for("[step 10 / 100000]", Duration::from_secs(60));
    let store = format!("127.0.0.1:{port}");
    // The ranks publish every 2 s from their first collective.
    let deadline = Instant::now() + Duration::from_secs(20);
    let listed = loop {
        let out = cohort()
            .args(["debug", "dump", "--store", &store])
            .env("COHORT_SECRET", SECRET)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() && text.contains("rank 0: ") && text.contains("rank 1: ") {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "no dump of both ranks: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    for rank in ["rank 0: ", "rank 1: "] {
        let line = listed.lines().find(|l| l.starts_with(rank)).unwrap();
        // Each names a collective with the phase and step it came from.
        assert!(line.contains(" #") && line.contains("at step "), "{listed}");
    }
    // Without the secret the store refuses the dump, saying so in one line.
    let refused = cohort()
        .args(["debug", "dump", "--store", &store, "--timeout", "2"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    // The job was never stopped: it still trains.
    let logged = || job.output().matches("loss = ").count();
    let (before, deadline) = (logged(), Instant::now() + Duration::from_secs(60));
    while logged() < before + 2 {
        assert!(Instant::now() < deadline, "{}", job.output());
        std::thread::sleep(Duration::from_millis(50));
    }
    job.signal(libc::SIGTERM);
    let _ = job.finish(Duration::from_secs(60));
}

//! `cohort run -n 3 train --strategy parameter-server` end to end: the real
//! binary as a server and two workers under the launcher (which hosts the
//! store and sets the job secret), in sync and async mode; and the clear
//! error when there is no worker.

use std::process::{Command, Output};

fn cohort(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cohort"))
        .env_remove("RANK")
        .env_remove("COHORT_NUM_THREADS")
        .args(args)
        .output()
        .expect("cohort runs")
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A tiny model and corpus: a second or two per run.
const TINY: &[&str] = &[
    "--steps",
    "12",
    "--warmup-steps",
    "1",
    "--log-interval",
    "4",
    "--eval-interval",
    "0",
    "--eval-batches",
    "1",
    "--seq-len",
    "16",
    "--n-layers",
    "2",
    "--n-heads",
    "2",
    "--d-model",
    "32",
    "--d-ff",
    "64",
    "--markov-vocab",
    "16",
    "--train-sequences",
    "96",
    "--val-sequences",
    "16",
];

#[test]
fn a_server_and_two_workers_train_in_both_modes() {
    for mode in ["sync", "async"] {
        let mut args = vec![
            "run",
            "--standalone",
            "-n",
            "3",
            "train",
            "--strategy",
            "parameter-server",
            "--ps-mode",
            mode,
        ];
        args.extend_from_slice(TINY);
        let out = stdout(&cohort(&args));
        assert!(
            out.contains(&format!("2 worker(s), {mode} mode")),
            "{mode}: {out}"
        );
        assert!(out.contains("[step 12 / 12] loss = "), "{mode}: {out}");
        assert!(out.contains("done: 12 steps"), "{mode}: {out}");
        if mode == "async" {
            assert!(out.contains("staleness: mean "), "{out}");
        }
    }
}

#[test]
fn a_server_without_workers_is_a_clear_error() {
    let mut args = vec!["train", "--strategy", "parameter-server"];
    args.extend_from_slice(TINY);
    let out = cohort(&args);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cohort run -n K"), "{err}");
}

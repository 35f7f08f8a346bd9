//! `cohort run -n 3 train --strategy parameter-server` end to end: the real
//! binary as a server and two workers under the launcher (which hosts the
//! store and sets the job secret), in sync and async mode; and the clear
//! error when there is no worker.

mod support;

use support::{run, succeeded, TINY};

/// Steps and logging of the runs: a second or two each.
const STEPS: &[&str] = &[
    "--steps",
    "12",
    "--warmup-steps",
    "1",
    "--log-interval",
    "4",
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
        args.extend_from_slice(STEPS);
        args.extend_from_slice(TINY);
        let out = succeeded(&run(&args));
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
    args.extend_from_slice(STEPS);
    args.extend_from_slice(TINY);
    let out = run(&args);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cohort run -n K"), "{err}");
}

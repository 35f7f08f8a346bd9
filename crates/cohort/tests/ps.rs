//! `cohort run -n 3 train --strategy parameter-server` end to end: the real
//! binary as a server and two workers under the launcher (which hosts the
//! store and sets the job secret), in sync and async mode; a sync run
//! resumed from its checkpoint; and the clear errors when there is no
//! worker or an async run is asked for checkpoints.

mod support;

use support::{assert_resume_is_seamless, run, strategy_args, succeeded, SHORT_RUN, TINY};

#[test]
fn a_server_and_two_workers_train_in_both_modes() {
    for mode in ["sync", "async"] {
        let args = ps_args(&["--ps-mode", mode]);
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
    args.extend_from_slice(SHORT_RUN);
    args.extend_from_slice(TINY);
    let out = run(&args);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cohort run -n K"), "{err}");
}

/// `cohort run -n 3 train --strategy parameter-server`, with `extra`.
fn ps_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    strategy_args("3", "parameter-server", extra)
}

#[test]
fn a_sync_run_resumed_from_its_checkpoint_ends_as_an_unbroken_one() {
    assert_resume_is_seamless(|extra| succeeded(&run(&ps_args(extra))));
}

#[test]
fn an_async_run_refuses_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let never = tmp.path().join("never-written");
    let out = run(&ps_args(&[
        "--ps-mode",
        "async",
        "--out",
        never.to_str().unwrap(),
    ]));
    assert!(!out.status.success());
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(all.contains("--ps-mode sync"), "{all}");
    assert!(!never.exists());
}

/// A sync run resumed with another number of workers keeps its global batch and says so, as
/// DDP does over another number of ranks.
#[test]
fn a_resume_with_fewer_workers_keeps_the_global_batch_and_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ps");
    let o = out.to_str().unwrap();
    succeeded(&run(&ps_args(&["--out", o, "--save-interval", "6"])));
    let half = format!("{o}/step-000006");
    let resumed = succeeded(&run(&strategy_args(
        "2",
        "parameter-server",
        &["--resume", &half],
    )));
    assert!(
        resumed.contains("world size 2 -> 1: grad_accum 1 -> 2 keeps the global batch"),
        "{resumed}"
    );
    assert!(
        resumed.contains("resumed from") && resumed.contains("at step 6"),
        "{resumed}"
    );
    assert!(resumed.contains("done: 12 steps"), "{resumed}");
}

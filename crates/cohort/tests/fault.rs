//! What `cohort run -n 2 train` survives, through the real binary: a NaN in
//! one worker's gradient (the `COHORT_INJECT_NAN` test hook) skips that
//! update in both, and a damaged latest checkpoint is passed over on resume.

use std::process::Output;

mod support;

use support::TINY;

/// Warmup and logging of every run (each test sets its steps).
const STEPS: &[&str] = &["--warmup-steps", "1", "--log-interval", "1"];

fn cohort_run(nan: Option<&str>, extra: &[&str]) -> Output {
    let mut cmd = support::cohort();
    cmd.args(["run", "--standalone", "-n", "2", "train"])
        .args(STEPS)
        .args(TINY)
        .args(extra);
    if let Some(spec) = nan {
        cmd.env("COHORT_INJECT_NAN", spec);
    }
    cmd.output().expect("cohort runs")
}

fn text(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn a_nan_in_one_worker_skips_the_update_in_both() {
    let out = cohort_run(Some("2@1"), &["--steps", "4"]);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(
        all.contains("[step 3 / 4] non-finite loss on 0 rank(s), non-finite gradient on 1 rank(s)"),
        "{all}"
    );
    assert!(all.contains("skipped 1 update(s)"), "{all}");

    let out = cohort_run(
        Some("0-3"),
        &["--steps", "4", "--max-consecutive-skips", "2"],
    );
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(all.contains("diverged: 2 updates in a row"), "{all}");

    let out = cohort_run(Some("soon"), &["--steps", "4"]);
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(
        all.contains("COHORT_INJECT_NAN=\"soon\": expected STEP"),
        "{all}"
    );
}

#[test]
fn resume_passes_over_a_damaged_latest_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("ckpt");
    let out = out_dir.to_str().unwrap();
    let first = cohort_run(
        None,
        &["--steps", "4", "--out", out, "--save-interval", "2"],
    );
    assert!(first.status.success(), "{}", text(&first));
    let model = out_dir.join("step-000004").join("model.safetensors");
    let mut bytes = std::fs::read(&model).unwrap();
    bytes.truncate(bytes.len() / 2);
    std::fs::write(&model, bytes).unwrap();
    let resumed = cohort_run(None, &["--resume", out, "--steps", "6"]);
    let all = text(&resumed);
    assert!(resumed.status.success(), "{all}");
    assert!(all.contains("step-000004 is unusable"), "{all}");
    assert!(all.contains("model.safetensors: corrupt"), "{all}");
    assert!(all.contains("step-000002 at step 2"), "{all}");
}

/// Settings that cannot work fail once, with one line naming them, and the launcher does not
/// spend its restarts on them: too big for the host's memory (known before any allocation,
/// where it would abort), or out of range.
#[test]
fn impossible_settings_fail_with_one_line_and_are_not_restarted() {
    for (extra, said) in [
        (
            &["--batch-size", "1000000"][..],
            "batch_size 1000000 x seq_len",
        ),
        (&["--lr=-1"][..], "lr"),
        (&["--no-such-flag"][..], "unexpected argument"),
    ] {
        let out = support::cohort()
            .args([
                "run",
                "--standalone",
                "--max-restarts",
                "2",
                "-n",
                "2",
                "train",
            ])
            .args(TINY)
            .args(extra)
            .env("RUST_BACKTRACE", "1")
            .output()
            .unwrap();
        let all = text(&out);
        assert!(!out.status.success(), "{all}");
        // Both ranks fail alike; the first to exit is reported, and the other may be
        // stopped before it prints.
        let error = all
            .lines()
            .filter_map(|l| l.split_once("]: ").map(|(_, rest)| rest))
            .find(|l| l.starts_with("Error: train") || l.starts_with("error:"))
            .unwrap_or_else(|| panic!("no error line: {all}"));
        assert!(error.contains(said), "{error}");
        if said.starts_with("batch_size") {
            assert!(error.contains("GiB is available"), "{error}");
        }
        assert!(all.contains("failed with exit code 78"), "{all}");
        assert!(all.contains("not restarting"), "{all}");
        assert!(!all.contains("restarting the workers"), "{all}");
        assert!(!all.contains("backtrace"), "{all}");
    }
}

/// An error is one line, each cause once, with no backtrace even under RUST_BACKTRACE=1.
#[test]
fn an_error_is_one_line_with_each_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    let out = support::cohort()
        .args(["train", "--resume", missing.to_str().unwrap()])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("Error: train: checkpoint: "), "{stderr}");
    assert_eq!(stderr.matches("not a checkpoint").count(), 1, "{stderr}");
}

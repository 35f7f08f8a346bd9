//! The run log end to end: a 2-rank `cohort train` writes TensorBoard event files and
//! `metrics.jsonl` that agree with its log lines, as TensorBoard's own reader sees them; a
//! resumed run's logs hold each step once.

mod support;

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use support::{run, succeeded};

/// `(step, value)` of every `[step N / M] loss = X` (or `val loss = X`) line of rank 0.
fn logged(out: &str, what: &str) -> Vec<(u64, f64)> {
    let marker = format!("] {what} = ");
    out.lines()
        .filter_map(|l| {
            let l = l.strip_prefix("[rank0]: ").unwrap_or(l);
            let step = l.strip_prefix("[step ")?.split(' ').next()?.parse().ok()?;
            let value = l.split(&marker).nth(1)?.split(' ').next()?.parse().ok()?;
            Some((step, value))
        })
        .collect()
}

fn metrics(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// `(step, value)` of `key` in the metrics lines that have it.
fn column(lines: &[Value], key: &str) -> Vec<(u64, f64)> {
    lines
        .iter()
        .filter_map(|l| Some((l["step"].as_u64()?, l[key].as_f64()?)))
        .collect()
}

/// The scalars TensorBoard's EventAccumulator reads from `dir`, or None (with a note) when
/// Python's tensorboard is not installed here; CI installs it, so there it must be.
fn tensorboard(dir: &Path) -> Option<BTreeMap<String, Vec<(u64, f64)>>> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/read_tensorboard.py");
    let out = Command::new("python3").arg(script).arg(dir).output();
    match out {
        Ok(o) if o.status.success() => {
            let v: BTreeMap<String, Vec<(u64, f64)>> = serde_json::from_slice(&o.stdout).unwrap();
            Some(v)
        }
        other => {
            let why = match other {
                Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
                Err(e) => e.to_string(),
            };
            assert!(
                std::env::var_os("CI").is_none(),
                "CI installs tensorboard, yet its reader failed: {why}"
            );
            eprintln!("skipping the TensorBoard reader checks (pip install tensorboard): {why}");
            None
        }
    }
}

fn close(a: &[(u64, f64)], b: &[(u64, f64)], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.0, y.0, "{what}: steps {a:?} vs {b:?}");
        assert!(
            (x.1 - y.1).abs() <= tol,
            "{what} at step {}: {} vs {}",
            x.0,
            x.1,
            y.1
        );
    }
}

/// `cohort run -n 2 train` for `steps` steps, logging every 5, evaluating every 10.
fn train(steps: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "run",
        "--standalone",
        "-n",
        "2",
        "train",
        "--steps",
        steps,
        "--log-interval",
        "5",
        "--eval-interval",
        "10",
    ];
    args.extend_from_slice(extra);
    succeeded(&run(&args))
}

#[test]
fn tensorboard_and_metrics_agree_with_the_log_lines() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("logs");
    let out = train("20", &["--log-dir", dir.to_str().unwrap()]);
    let (loss, val) = (logged(&out, "loss"), logged(&out, "val loss"));
    assert_eq!(
        loss.iter().map(|x| x.0).collect::<Vec<_>>(),
        [5, 10, 15, 20]
    );
    assert_eq!(val.iter().map(|x| x.0).collect::<Vec<_>>(), [10, 20]);

    let lines = metrics(&dir);
    close(
        &column(&lines, "train_loss"),
        &loss,
        5e-5,
        "metrics train_loss",
    );
    close(&column(&lines, "val_loss"), &val, 5e-5, "metrics val_loss");
    for line in lines.iter().filter(|l| l.get("train_loss").is_some()) {
        for key in ["lr", "grad_norm", "tokens_per_s"] {
            let x = line[key].as_f64().unwrap_or(-1.0);
            assert!(x > 0.0 && x.is_finite(), "{key} in {line}");
        }
        assert_eq!(line["skipped"], 0, "{line}");
        let ranks = line["rank_ms_per_step"].as_array().unwrap();
        assert_eq!(ranks.len(), 2, "{line}");
        for r in ranks {
            assert!(r["forward"].as_f64().unwrap() > 0.0, "{line}");
            assert!(r["backward"].as_f64().unwrap() > 0.0, "{line}");
        }
    }
    // The Markov corpus's floor rides along with each validation loss.
    assert!(lines.iter().any(|l| l["floor"].as_f64().is_some()));

    // `cohort plot` draws the run at the size asked for (IHDR: width, height at bytes 16..24).
    let png = tmp.path().join("curves.png");
    let args = ["plot", dir.to_str().unwrap(), "-o", png.to_str().unwrap()];
    let said = succeeded(&run(
        &[&args[..], &["--width", "800", "--height", "400"]].concat()
    ));
    assert!(said.contains("1 run(s)"), "{said}");
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[1..4], b"PNG");
    let be = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
    assert_eq!((be(16), be(20)), (800, 400));
    let missing = run(&["plot", tmp.path().join("nope").to_str().unwrap()]);
    assert!(!missing.status.success());
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(err.contains("no metrics.jsonl"), "{err}");

    let Some(tb) = tensorboard(&dir) else { return };
    close(
        &tb["train/loss"],
        &column(&lines, "train_loss"),
        1e-6,
        "tb train/loss",
    );
    close(
        &tb["val/loss"],
        &column(&lines, "val_loss"),
        1e-6,
        "tb val/loss",
    );
    close(&tb["train/lr"], &column(&lines, "lr"), 1e-9, "tb train/lr");
    close(
        &tb["train/grad_norm"],
        &column(&lines, "grad_norm"),
        1e-5,
        "tb grad_norm",
    );
    for tag in [
        "train/tokens_per_s",
        "train/skipped_updates",
        "time_ms/data",
        "time_ms/forward",
        "time_ms/backward",
        "time_ms/comm_wait",
        "time_ms/optimizer",
        "rank0/time_ms/forward",
        "rank1/time_ms/forward",
        "rank1/time_ms/backward",
    ] {
        let steps: Vec<u64> = tb[tag].iter().map(|x| x.0).collect();
        assert_eq!(steps, [5, 10, 15, 20], "{tag}");
    }
    assert_eq!(tb["val/loss_floor"].len(), 2);
}

#[test]
fn a_resumed_run_logs_each_step_once() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ckpt");
    let o = out.to_str().unwrap();
    train("15", &["--out", o, "--save-interval", "10"]);
    // Steps 11..15 were logged, then the run resumes from step 10 and trains them again.
    let resumed = train("20", &["--out", o, "--resume", &format!("{o}/step-000010")]);
    let logs = out.join("logs");
    assert!(
        resumed.contains(&format!("logs: {}", logs.display())),
        "{resumed}"
    );
    let lines = metrics(&logs);
    let steps: Vec<u64> = lines.iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [5, 10, 15, 20], "{lines:?}");
    // The resumed run's losses are the ones its log lines print.
    close(
        &column(&lines, "train_loss")[2..],
        &logged(&resumed, "loss"),
        5e-5,
        "resumed train_loss",
    );
    let elapsed: Vec<f64> = lines
        .iter()
        .map(|l| l["elapsed_s"].as_f64().unwrap())
        .collect();
    assert!(elapsed.windows(2).all(|w| w[0] <= w[1]), "{elapsed:?}");

    let Some(tb) = tensorboard(&logs) else { return };
    let steps: Vec<u64> = tb["train/loss"].iter().map(|x| x.0).collect();
    assert_eq!(steps, [5, 10, 15, 20]);
    close(
        &tb["train/loss"],
        &column(&lines, "train_loss"),
        1e-6,
        "tb after resume",
    );
    let val: Vec<u64> = tb["val/loss"].iter().map(|x| x.0).collect();
    assert_eq!(val, [10, 20]);
}

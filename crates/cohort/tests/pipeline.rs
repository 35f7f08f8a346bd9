//! `cohort run -n 2 train --strategy pipeline` end to end: the real binary
//! as two stages under the launcher, writing whole-model checkpoints, and a
//! run resumed from one of them.

mod support;

use support::{params, run, succeeded, TINY};

/// Steps and logging of the runs: a second or two each.
const STEPS: &[&str] = &[
    "--steps",
    "12",
    "--warmup-steps",
    "1",
    "--log-interval",
    "4",
    "--micro-batches",
    "2",
];

/// `cohort run -n 2 train --strategy pipeline` plus `extra`.
fn pipeline(extra: &[&str]) -> String {
    let mut args = vec![
        "run",
        "--standalone",
        "-n",
        "2",
        "train",
        "--strategy",
        "pipeline",
    ];
    args.extend_from_slice(STEPS);
    args.extend_from_slice(TINY);
    args.extend_from_slice(extra);
    succeeded(&run(&args))
}

#[test]
fn a_pipeline_resumed_from_its_checkpoint_ends_as_an_unbroken_one() {
    let tmp = tempfile::tempdir().unwrap();
    let (whole, resumed) = (tmp.path().join("whole"), tmp.path().join("resumed"));
    pipeline(&["--out", whole.to_str().unwrap(), "--save-interval", "6"]);
    let half = whole.join("step-000006");
    let out = pipeline(&[
        "--resume",
        half.to_str().unwrap(),
        "--out",
        resumed.to_str().unwrap(),
    ]);
    assert!(out.contains("at step 6"), "{out}");
    assert!(out.contains("done: 12 steps"), "{out}");
    // Both stages' parameters and AdamW state, the learning rate, the
    // dropout keys and the data position carry over: bitwise the same model.
    let (a, b) = (
        params(&whole.join("step-000012")),
        params(&resumed.join("step-000012")),
    );
    assert!(a == b, "the resumed run's parameters differ");
    assert_ne!(params(&half), a, "training after step 6 changed nothing");
}

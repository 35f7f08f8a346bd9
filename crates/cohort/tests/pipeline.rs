//! `cohort run -n 2 train --strategy pipeline` end to end: the real binary
//! as two stages under the launcher, writing whole-model checkpoints, and a
//! run resumed from one of them.

mod support;

use support::{assert_resume_is_seamless, run, succeeded, TINY};

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
    assert_resume_is_seamless(pipeline);
}

//! `cohort run -n 2 train --strategy pipeline` end to end: the real binary
//! as two stages under the launcher, writing whole-model checkpoints, and a
//! run resumed from one of them.

mod support;

use support::{assert_resume_is_seamless, run, strategy_args, succeeded};

/// `cohort run -n 2 train --strategy pipeline` plus `extra`.
fn pipeline(extra: &[&str]) -> String {
    let mut extra = extra.to_vec();
    extra.extend_from_slice(&["--micro-batches", "2"]);
    succeeded(&run(&strategy_args("2", "pipeline", &extra)))
}

#[test]
fn a_pipeline_resumed_from_its_checkpoint_ends_as_an_unbroken_one() {
    assert_resume_is_seamless(pipeline);
}

//! DiLoCo and local SGD through the launcher: `cohort run -n 2 train
//! --strategy diloco|local-sgd`, two processes over real sockets. A run
//! saved between syncs resumes to bitwise the parameters of the run that
//! went on, overlapped too; local SGD averages its pseudo-gradients in bf16
//! when asked.

mod support;

use support::{assert_resume_is_seamless, run, strategy_args, succeeded};

#[test]
fn diloco_through_the_launcher_resumes_bitwise_between_syncs() {
    assert_resume_is_seamless(|extra| {
        // Syncs after steps 4, 8 and 12: the checkpoint of step 6 holds two
        // ranks apart.
        let mut more = vec!["--sync-every", "4"];
        more.extend_from_slice(extra);
        let out = succeeded(&run(&strategy_args("2", "diloco", &more)));
        assert!(
            out.contains("DiLoCo: inner AdamW on each rank, every 4 steps outer SGD lr 0.7"),
            "{out}"
        );
        assert!(out.contains("outer syncs (rank 0): "), "{out}");
        out
    });
}

#[test]
fn local_sgd_averages_bf16_pseudo_gradients() {
    let args = strategy_args(
        "2",
        "local-sgd",
        &["--sync-every", "3", "--pseudo-grad-dtype", "bf16"],
    );
    let out = succeeded(&run(&args));
    assert!(
        out.contains(
            "local SGD: inner AdamW on each rank, every 3 steps parameters averaged over the bf16"
        ),
        "{out}"
    );
    assert!(out.contains("done: 12 steps"), "{out}");
    assert!(out.contains("outer syncs (rank 0): 4,"), "{out}");
}

#[test]
fn overlapped_diloco_through_the_launcher_resumes_bitwise_mid_round() {
    assert_resume_is_seamless(|extra| {
        // Syncs after steps 4, 8 and 12: the checkpoint of step 6 holds the
        // average started at step 4, not yet applied.
        let mut more = vec!["--sync-every", "4", "--outer-overlap"];
        more.extend_from_slice(extra);
        let out = succeeded(&run(&strategy_args("2", "diloco", &more)));
        assert!(
            out.contains("pseudo-gradient (all-reduce overlapped with the next round"),
            "{out}"
        );
        assert!(out.contains("outer syncs (rank 0): "), "{out}");
        out
    });
}

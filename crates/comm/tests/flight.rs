//! The flight recorder end to end: ranks whose host code diverged fail,
//! and the first rank to fail names, from every rank's ring, the rank that
//! skipped a collective (with the op and its sequence number) or the ranks
//! whose sizes differ, well within the group's timeout.

mod common;

use std::time::{Duration, Instant};

use cohort_comm::{flight, spawn, ReduceOp};
use common::opts;

/// One test at a time: the dump directory and the rings' file names
/// (`flight-default-rank0.json`) are the process's, and a verdict of one test
/// would overwrite the files another test is reading.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `f` on `world` thread ranks (group timeout 10 s) and returns the one
/// verdict the ranks made, with the time it took.
fn verdict_of(world: usize, f: impl Fn(&cohort_comm::ProcessGroup) + Sync) -> (String, Duration) {
    let t = Instant::now();
    let verdicts = spawn::threads_with(world, opts(10), |pg| {
        f(pg);
        Ok::<_, String>(pg.flight_verdict())
    })
    .unwrap();
    let mut made: Vec<String> = verdicts.into_iter().flatten().collect();
    assert_eq!(made.len(), 1, "exactly one rank explains: {made:?}");
    (made.remove(0), t.elapsed())
}

#[test]
fn a_rank_that_skipped_an_all_reduce_is_named_with_the_op_and_number() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (line, took) = verdict_of(3, |pg| {
        let mut x = [1.0f32; 4];
        for i in 0..4 {
            // The context is the process's and these ranks are threads of one: only the rank
            // whose record is checked sets it, or another thread's step could land in it.
            if pg.rank() == 1 {
                flight::set_context("forward", i);
            }
            // Rank 1 skips all_reduce #2 and goes on to the barrier.
            if pg.rank() == 1 && i == 2 {
                continue;
            }
            let _ = pg.all_reduce(&mut x, ReduceOp::Sum);
        }
        let _ = pg.barrier();
    });
    // Rank 1's all_reduce #2 was the others' #3: its barrier is #3.
    assert!(
        line.starts_with(
            "rank 1 issued barrier #3 where the others issued all_reduce #3 of 16 B F32 (a \
             skipped, extra or reordered collective; its previous: all_reduce #2, in forward at \
             step 3); ranks 0, 2 waited in all_reduce #3"
        ),
        "{line}"
    );
    assert!(took < Duration::from_secs(10), "took {took:?}");
}

#[test]
fn ranks_with_different_sizes_are_named_with_both_sizes() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("cohort-flight-{}", std::process::id()));
    flight::set_dump_dir(&dir);
    let (line, _) = verdict_of(2, |pg| {
        let mut a = [0i32; 2];
        let _ = pg.all_reduce(&mut a, ReduceOp::Sum);
        let mut x = vec![1.0f32; 10 + pg.rank()];
        let _ = pg.all_reduce(&mut x, ReduceOp::Sum);
    });
    // The rings are also written as JSON.
    for rank in 0..2 {
        let json = std::fs::read_to_string(dir.join(format!("flight-default-rank{rank}.json")))
            .unwrap_or_else(|e| panic!("rank {rank}'s ring: {e}"));
        assert!(json.starts_with(&format!("{{\"rank\":{rank},")), "{json}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        line.starts_with(
            "ranks disagree on collective #1 of group default: rank 0 all_reduce #1 of 40 B F32, \
             rank 1 all_reduce #1 of 44 B F32"
        ),
        "{line}"
    );
}

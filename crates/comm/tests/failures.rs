//! Failures never hang and never corrupt: mismatched calls, silent and dead
//! peers, bad arguments, and the aborted state after an error.

mod common;

use std::time::{Duration, Instant};

use cohort_comm::{spawn, CommError, DebugLevel, GroupOptions, OpKind, ReduceOp};
use common::opts;

#[test]
fn mismatched_lengths_are_reported_naming_both_sides() {
    let errs = spawn::threads_with(2, opts(30), |pg| {
        let mut x = vec![1.0f32; 10 + pg.rank()];
        let e = pg.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
        // The group is now aborted: later calls say so, with the reason.
        let later = pg.barrier().unwrap_err();
        Ok::<_, CommError>((e, later))
    })
    .unwrap();
    for (rank, (e, later)) in errs.iter().enumerate() {
        match e {
            CommError::Mismatch {
                rank: r,
                peer,
                ours,
                theirs,
                ..
            } => {
                assert_eq!((*r, *peer), (rank, 1 - rank));
                let (mine, other) = if rank == 0 {
                    ("10", "11")
                } else {
                    ("11", "10")
                };
                assert_eq!(ours, &format!("all_reduce #0 of {mine} x float32 (sum)"));
                assert_eq!(theirs, &format!("all_reduce #0 of {other} x float32 (sum)"));
            }
            other => panic!("rank {rank}: expected a mismatch, got {other}"),
        }
        assert!(
            matches!(
                later,
                CommError::Aborted {
                    op: OpKind::Barrier,
                    ..
                }
            ),
            "{later}"
        );
        assert!(
            later.to_string().contains("mismatched collectives"),
            "{later}"
        );
    }
}

#[test]
fn different_ops_at_the_same_sequence_number_are_a_mismatch() {
    let errs = spawn::threads_with(2, opts(30), |pg| {
        let mut x = vec![1i64; 5];
        let r = if pg.rank() == 1 {
            pg.broadcast(&mut x, 1)
        } else {
            pg.all_reduce(&mut x, ReduceOp::Max)
        };
        Ok::<_, CommError>(r.err())
    })
    .unwrap();
    // Rank 1 (the root) only sends; rank 0 reads its frame and sees the difference.
    let e = errs[0].as_ref().expect("rank 0 must fail");
    let t = e.to_string();
    assert!(
        t.contains("rank 0 (this process) called all_reduce #0 of 5 x int64 (max), but rank 1 called broadcast #0 of 5 x int64 with root 1"),
        "{t}"
    );
}

#[test]
fn detail_mode_catches_what_the_frame_check_cannot() {
    // With different roots each rank thinks it is the root and only sends;
    // only the COHORT_DEBUG=detail digest round sees the disagreement.
    let o = GroupOptions {
        debug: DebugLevel::Detail,
        ..opts(30)
    };
    let errs = spawn::threads_with(2, o, |pg| {
        let mut x = vec![0u8; 7];
        Ok::<_, CommError>(pg.broadcast(&mut x, pg.rank()).unwrap_err())
    })
    .unwrap();
    for e in errs {
        assert!(matches!(e, CommError::Mismatch { .. }), "{e}");
        let t = e.to_string();
        assert!(
            t.contains("with root 0") && t.contains("with root 1") && t.contains("digest"),
            "{t}"
        );
    }
}

#[test]
fn after_a_timeout_the_group_refuses_at_once() {
    let o = GroupOptions {
        timeout: Duration::from_millis(500),
        ..opts(30)
    };
    let got = spawn::threads_with(2, o, |pg| {
        if pg.rank() == 1 {
            // Alive but never calls: only the timeout can end rank 0's wait.
            std::thread::sleep(Duration::from_millis(1500));
            return Ok(None);
        }
        pg.barrier().ok();
        let t0 = Instant::now();
        let e = pg.all_reduce(&mut [1.0f64; 3], ReduceOp::Sum).unwrap_err();
        Ok::<_, CommError>(Some((e, t0.elapsed())))
    });
    // Rank 1 skipped the barrier too, so rank 0 timed out on the barrier
    // (#0) and its all_reduce found the group aborted.
    let (e, took) = got.unwrap().remove(0).unwrap();
    assert!(
        took < Duration::from_millis(200),
        "an aborted group must refuse at once, took {took:?}"
    );
    let t = e.to_string();
    assert!(
        t.contains("barrier #0")
            && t.contains("\"default\"")
            && t.contains("rank 1")
            && t.contains("500ms"),
        "{t}"
    );
}

#[test]
fn timeout_error_fields() {
    let o = GroupOptions {
        timeout: Duration::from_millis(300),
        ..opts(30)
    };
    let got = spawn::threads_with(2, o, |pg| {
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1000));
            return Ok(None);
        }
        let t0 = Instant::now();
        let e = pg.all_reduce(&mut [1.0f32; 3], ReduceOp::Sum).unwrap_err();
        Ok::<_, CommError>(Some((e, t0.elapsed())))
    })
    .unwrap();
    let (e, took) = got[0].as_ref().unwrap();
    match e {
        CommError::Timeout {
            op,
            seq,
            group,
            rank,
            peer,
            timeout,
        } => {
            assert_eq!(
                (*op, *seq, group.as_str(), *rank, *peer),
                (OpKind::AllReduce, 0, "default", 0, 1)
            );
            assert_eq!(*timeout, Duration::from_millis(300));
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert!(
        *took >= Duration::from_millis(300) && *took < Duration::from_secs(3),
        "{took:?}"
    );
}

#[test]
fn a_departed_peer_fails_pending_collectives_fast() {
    let got = spawn::threads_with(3, opts(120), |pg| {
        pg.barrier()?;
        if pg.rank() == 1 {
            // Leaves: its sockets close, as if the process had died.
            return Ok(None);
        }
        let t0 = Instant::now();
        let mut x = vec![1.0f32; 1 << 20];
        let e = pg.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
        Ok::<_, CommError>(Some((e, t0.elapsed())))
    })
    .unwrap();
    for (rank, r) in got.into_iter().enumerate() {
        let Some((e, took)) = r else { continue };
        assert!(
            took < Duration::from_secs(5),
            "rank {rank} took {took:?} (timeout is 120 s)"
        );
        assert!(
            matches!(
                e,
                CommError::PeerLost {
                    op: OpKind::AllReduce,
                    ..
                }
            ),
            "rank {rank}: {e}"
        );
        // Rank 1 is named as the lost peer, or, when a survivor saw the
        // other survivor's abort first, among the ranks that hung up.
        let msg = e.to_string();
        let hung_up = msg
            .split("closed their connections to this one: ")
            .nth(1)
            .is_some_and(|list| list.split(", ").any(|r| r.trim() == "1"));
        assert!(msg.contains("rank 1") || hung_up, "rank {rank}: {e}");
    }
}

#[test]
fn bad_arguments_are_errors_that_leave_the_group_usable() {
    spawn::threads_with(2, opts(30), |pg| {
        let mut out = vec![0.0f32; 3];
        let e = pg.all_gather(&[1.0f32; 2], &mut out).unwrap_err();
        assert!(
            matches!(
                e,
                CommError::InvalidArgument {
                    op: OpKind::AllGather,
                    ..
                }
            ),
            "{e}"
        );
        assert!(
            e.to_string().contains("output has 3 elements, expected 4"),
            "{e}"
        );
        let e = pg.send(&[1u8], pg.rank(), 0).unwrap_err();
        assert!(e.to_string().contains("is this rank itself"), "{e}");
        let e = pg.broadcast(&mut [0i32; 2], 5).unwrap_err();
        assert!(
            e.to_string().contains("root 5 is not in a group of size 2"),
            "{e}"
        );
        let e = pg.all_to_all(&[0u8; 3], &mut [0u8; 3]).unwrap_err();
        assert!(e.to_string().contains("do not split into 2"), "{e}");
        let e = pg.gather(&[0u8; 1], None, 2).unwrap_err();
        assert!(
            e.to_string().contains("root 2 is not in a group of size 2"),
            "{e}"
        );
        let e = pg.all_reduce(&mut [1u8; 2], ReduceOp::Avg).unwrap_err();
        assert!(matches!(e, CommError::Unsupported { .. }), "{e}");
        // None of that reached the wire or took a sequence number.
        let mut x = [pg.rank() as i32 + 1; 4];
        pg.all_reduce(&mut x, ReduceOp::Sum)?;
        assert_eq!(x, [3; 4]);
        Ok::<_, CommError>(())
    })
    .unwrap();
}

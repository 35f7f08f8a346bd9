//! Point-to-point messages, async work handles, use from several threads,
//! and sub-groups.

mod common;

use std::time::Duration;

use cohort_comm::{spawn, CommError, ReduceOp};
use common::opts;

#[test]
fn tags_match_out_of_order_and_same_tags_keep_order() {
    spawn::threads_with(2, opts(30), |pg| {
        if pg.rank() == 0 {
            pg.send(&[1.0f32, 2.0], 1, 7)?;
            pg.send(&[3i64], 1, 9)?;
            pg.send(&[4i64], 1, 9)?;
        } else {
            let mut b = [0i64];
            pg.recv(&mut b, 0, 9)?;
            assert_eq!(b, [3]);
            pg.recv(&mut b, 0, 9)?;
            assert_eq!(b, [4]);
            let mut a = [0.0f32; 2];
            pg.recv(&mut a, 0, 7)?;
            assert_eq!(a, [1.0, 2.0]);
        }
        Ok::<_, CommError>(())
    })
    .unwrap();
}

#[test]
fn a_ring_of_large_async_sends_does_not_deadlock() {
    // Every rank sends 8 MB to the next while receiving from the previous:
    // blocking sends alone would fill both socket buffers and wait forever.
    spawn::threads_with(4, opts(60), |pg| {
        let (r, n) = (pg.rank(), pg.size());
        let out: Vec<u8> = (0..8 << 20).map(|i| (i * 7 + r) as u8).collect();
        let sent = pg.isend(out, (r + 1) % n, 3);
        let got = pg.irecv(vec![0u8; 8 << 20], (r + n - 1) % n, 3).wait()?;
        let prev = (r + n - 1) % n;
        assert!(got
            .iter()
            .enumerate()
            .all(|(i, &b)| b == (i * 7 + prev) as u8));
        assert_eq!(sent.wait()?.len(), 8 << 20);
        Ok::<_, CommError>(())
    })
    .unwrap();
}

#[test]
fn recv_of_the_wrong_length_is_a_mismatch() {
    let r = spawn::threads_with(2, opts(30), |pg| {
        if pg.rank() == 0 {
            pg.send(&[0.5f64; 10], 1, 0)?;
            Ok(String::new())
        } else {
            let e = pg.recv(&mut [0.0f64; 11], 0, 0).unwrap_err();
            Ok::<_, CommError>(e.to_string())
        }
    })
    .unwrap();
    assert!(
        r[1].contains("recv with tag 0 of 11 x float64")
            && r[1].contains("send with tag 0 of 10 x float64"),
        "{}",
        r[1]
    );
}

#[test]
fn async_collectives_run_in_issue_order_and_hand_buffers_back() {
    spawn::threads_with(3, opts(30), |pg| {
        let r = pg.rank() as f32;
        let a = pg.all_reduce_async(vec![r; 1000], ReduceOp::Sum);
        let b = pg.broadcast_async(vec![r; 5], 2);
        let c = pg.all_gather_async(vec![r; 2], vec![0.0; 6]);
        let d = pg.barrier_async();
        // Waiting out of order is fine: they ran in issue order.
        d.wait()?;
        let (_, gathered) = c.wait()?;
        assert_eq!(gathered, [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]);
        assert_eq!(b.wait()?, vec![2.0; 5]);
        assert!(a.is_completed());
        assert_eq!(a.wait()?, vec![3.0; 1000]);
        // A blocking call after async ones takes its turn after them.
        let w = pg.reduce_scatter_async(vec![1i32; 6], vec![0; 2], ReduceOp::Sum);
        let mut x = [1u8; 3];
        pg.all_reduce(&mut x, ReduceOp::Max)?;
        assert_eq!(w.wait()?.1, vec![3, 3]);
        let (_, out) = pg
            .gather_async(
                vec![pg.rank() as i64],
                (pg.rank() == 0).then(|| vec![0; 3]),
                0,
            )
            .wait()?;
        if pg.rank() == 0 {
            assert_eq!(out.unwrap(), vec![0, 1, 2]);
        }
        let (_, out) = pg
            .scatter_async((pg.rank() == 1).then(|| vec![5i64, 6, 7]), vec![0], 1)
            .wait()?;
        assert_eq!(out, vec![5 + pg.rank() as i64]);
        let (_, out) = pg
            .all_to_all_async(vec![pg.rank() as u8; 3], vec![0; 3])
            .wait()?;
        assert_eq!(out, vec![0, 1, 2]);
        assert_eq!(
            pg.reduce_async(vec![1.0f64; 2], ReduceOp::Avg, 0).wait()?,
            vec![1.0; 2]
        );
        Ok::<_, CommError>(())
    })
    .unwrap();
}

#[test]
fn a_group_is_shared_with_a_communication_thread() {
    // DDP's pattern: all_reduce slices of one buffer on a scoped thread while
    // the main thread keeps computing.
    spawn::threads_with(2, opts(30), |pg| {
        let mut grads = vec![pg.rank() as f32 + 1.0; 100_000];
        let (a, b) = grads.split_at_mut(40_000);
        std::thread::scope(|s| {
            let comm = s.spawn(|| -> Result<(), CommError> {
                pg.all_reduce(a, ReduceOp::Sum)?;
                pg.all_reduce(b, ReduceOp::Avg)
            });
            std::thread::sleep(Duration::from_millis(5));
            comm.join().unwrap()
        })?;
        assert!(grads[..40_000].iter().all(|&g| g == 3.0));
        assert!(grads[40_000..].iter().all(|&g| g == 1.5));
        Ok::<_, CommError>(())
    })
    .unwrap();
}

#[test]
fn sub_groups_have_their_own_ranks_and_connections() {
    spawn::threads_with(4, opts(30), |pg| {
        let odd = pg.new_group(&[3, 1])?;
        let all = pg.new_group(&[0, 1, 2, 3])?.expect("everyone is a member");
        match &odd {
            Some(g) => {
                assert_eq!((g.rank(), g.size()), (pg.rank() / 2, 2));
                let mut x = [pg.rank() as i32];
                g.all_reduce(&mut x, ReduceOp::Sum)?;
                assert_eq!(x, [4]);
            }
            None => assert!(pg.rank() % 2 == 0),
        }
        let mut y = [1u8];
        all.all_reduce(&mut y, ReduceOp::Sum)?;
        pg.all_reduce(&mut y, ReduceOp::Sum)?;
        assert_eq!(y, [16]);
        let e = pg.new_group(&[0, 0]).unwrap_err();
        assert!(e.to_string().contains("listed twice"), "{e}");
        Ok::<_, CommError>(())
    })
    .unwrap();
}

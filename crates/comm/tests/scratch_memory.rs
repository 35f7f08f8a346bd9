//! A collective's scratch costs resident memory only where the algorithm writes it. A two-rank
//! ring reduce_scatter lays out scratch as large as its input but writes only one receive
//! segment; sharded training reduce-scatters parts of hundreds of MB, and a scratch that was
//! zero-filled whole would stay resident for the life of the group (it is reused across ops).
//!
//! Its own test binary: resident memory is per process, and other tests running beside it
//! would move the figure.

mod common;

use cohort_comm::{spawn, CommError, ReduceOp};
use common::*;

/// This process's resident memory in bytes, if the system says.
fn resident_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[test]
fn a_large_two_rank_reduce_scatter_keeps_little_scratch_resident() {
    if resident_bytes().is_none() {
        eprintln!("skipped: /proc/self/status has no VmRSS on this system");
        return;
    }
    // 64 MB of input per rank, 32 MB of output.
    let len = 16 << 20;
    let grown = spawn::threads_with(2, opts(60), |pg| {
        let r = pg.rank();
        let x = input::<f32>(r, len, 5, ReduceOp::Sum);
        let mut out = vec![1f32; len / 2];
        // A small op first, so the group's own set-up is not counted.
        let mut warm = vec![0f32; 1024];
        pg.all_reduce(&mut warm, ReduceOp::Sum)?;
        pg.barrier()?;
        let before = resident_bytes().unwrap_or(0);
        pg.barrier()?;
        pg.reduce_scatter(&x, &mut out, ReduceOp::Sum)?;
        pg.barrier()?;
        let after = resident_bytes().unwrap_or(0);
        expect_eq("reduce_scatter", &out, |i| {
            reduced::<f32>(2, r * len / 2 + i, 5, ReduceOp::Sum)
        })?;
        Ok::<_, CommError>(after.saturating_sub(before))
    })
    .unwrap();
    // Both ranks live in this process: a scratch filled whole would add 64 MB each.
    let mb = grown[0] as f64 / (1 << 20) as f64;
    assert!(
        mb < 24.0,
        "the process grew by {mb:.1} MB during a 64 MB reduce_scatter on 2 ranks"
    );
}

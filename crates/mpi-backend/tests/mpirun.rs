//! The MPI backend under a real `mpirun`: the test binary starts itself as
//! the ranks of each scenario (`COHORT_MPI_TEST` selects the ranks' part).
//!
//! - Every collective, every element type and reduce operator, at lengths
//!   from 0 to past MPI's segment sizes, with 2 and 3 ranks, gives the same
//!   bits on the MPI group as on a cohort TCP group formed beside it in the
//!   same processes (the TCP backend is the reference: its own tests check
//!   it against naive arithmetic). Send/recv, async collectives running
//!   while the main thread sends, and local ranks are checked too.
//! - A rank that never joins a collective makes the others end the job
//!   within the timeout, naming the call; a dead rank ends the job at once;
//!   a receive of the wrong length ends it naming both sides.
//!
//! Skipped, with a message, where `mpirun` is not installed.

use std::fmt::Debug;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_comm::{bf16, Element, GroupOptions, ProcessGroup, ReduceOp};
use cohort_store::TcpStore;

const ROLE: &str = "COHORT_MPI_TEST";

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// A scenario, given the path of mpirun.
type Test = fn(&Path);

fn main() {
    if let Ok(role) = std::env::var(ROLE) {
        if let Err(e) = rank_main(&role) {
            eprintln!("rank failed: {e}");
            std::process::exit(3);
        }
        return;
    }
    let Some(mpirun) = find_mpirun() else {
        println!(
            "skipped: mpirun not found on PATH; install Open MPI (Debian: openmpi-bin \
             libopenmpi-dev) to run the MPI backend's tests"
        );
        return;
    };
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let tests: [(&str, Test); 5] = [
        ("every_collective_matches_cohort_on_2_ranks", |m| {
            every_collective_matches_cohort(m, 2)
        }),
        ("every_collective_matches_cohort_on_3_ranks", |m| {
            every_collective_matches_cohort(m, 3)
        }),
        (
            "a_rank_that_never_joins_ends_the_job_within_the_timeout",
            a_rank_that_never_joins_ends_the_job_within_the_timeout,
        ),
        (
            "a_dead_rank_ends_the_job_at_once",
            a_dead_rank_ends_the_job_at_once,
        ),
        (
            "a_receive_of_the_wrong_length_ends_the_job_naming_both_sides",
            a_receive_of_the_wrong_length_ends_the_job_naming_both_sides,
        ),
    ];
    for (name, t) in tests {
        if !filter.is_empty() && !filter.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        let t0 = Instant::now();
        t(&mpirun);
        println!("test {name} ... ok ({:.1} s)", t0.elapsed().as_secs_f64());
    }
}

// ------------------------------------------------------------------ parent

fn find_mpirun() -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join("mpirun"))
        .find(|p| p.is_file())
}

struct JobOutput {
    success: bool,
    code: Option<i32>,
    text: String,
    elapsed: Duration,
}

/// Runs this binary as `np` ranks of `role` under mpirun, with `env` added,
/// and collects everything it printed. mpirun's own `--timeout` ends a
/// stuck job; the kill below is a last resort that should never fire.
fn mpirun_self(mpirun: &Path, np: usize, role: &str, env: &[(&str, &str)]) -> JobOutput {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = Command::new(mpirun);
    cmd.args([
        "-np",
        &np.to_string(),
        "--oversubscribe",
        "--bind-to",
        "none",
    ])
    .args(["--timeout", "120"])
    .arg(exe)
    // Open MPI refuses root without these; CI runs as root.
    .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
    .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    .env(ROLE, role)
    .env("COHORT_NUM_THREADS", "1")
    // MPI spins while it waits; on a busy machine a spinning rank can
    // burn its peer's time slice, and one small call then costs
    // milliseconds. Yielding keeps the test quick anywhere.
    .env("OMPI_MCA_mpi_yield_when_idle", "1")
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let t0 = Instant::now();
    let mut child = cmd.spawn().expect("starting mpirun");
    let readers: Vec<_> = [
        Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>,
        Box::new(child.stderr.take().unwrap()),
    ]
    .into_iter()
    .map(|mut r| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    })
    .collect();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for mpirun") {
            break status;
        }
        if t0.elapsed() > Duration::from_secs(150) {
            let _ = child.kill();
            panic!("mpirun -np {np} ({role}) outlived its own --timeout; killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text: String = readers.into_iter().map(|r| r.join().unwrap()).collect();
    JobOutput {
        success: status.success(),
        code: status.code(),
        text,
        elapsed: t0.elapsed(),
    }
}

fn every_collective_matches_cohort(mpirun: &Path, np: usize) {
    let out = mpirun_self(mpirun, np, "compare", &[]);
    assert!(out.success, "mpirun -np {np} failed:\n{}", out.text);
    for rank in 0..np {
        assert!(
            out.text
                .contains(&format!("rank {rank} of {np}: all collectives match")),
            "rank {rank} did not finish:\n{}",
            out.text
        );
    }
}

fn a_rank_that_never_joins_ends_the_job_within_the_timeout(mpirun: &Path) {
    let out = mpirun_self(mpirun, 2, "skip", &[("COHORT_TIMEOUT", "1s")]);
    assert!(!out.success, "the job should have failed:\n{}", out.text);
    assert!(
        out.text.contains(
            "rank 0: all_reduce #1 on group \"default\" did not complete within 1s (COHORT_TIMEOUT)"
        ),
        "{}",
        out.text
    );
    assert!(
        out.elapsed < Duration::from_secs(15),
        "took {:?}: rank 1 sleeps 60 s, so only the watchdog can end it this early",
        out.elapsed
    );
}

fn a_dead_rank_ends_the_job_at_once(mpirun: &Path) {
    let out = mpirun_self(mpirun, 3, "die", &[("COHORT_TIMEOUT", "100s")]);
    assert!(!out.success, "the job should have failed:\n{}", out.text);
    assert!(
        out.elapsed < Duration::from_secs(30),
        "took {:?}; the watchdog (100 s) must not be what ended it:\n{}",
        out.elapsed,
        out.text
    );
    assert!(
        !out.text.contains("did not complete within"),
        "{}",
        out.text
    );
}

fn a_receive_of_the_wrong_length_ends_the_job_naming_both_sides(mpirun: &Path) {
    let out = mpirun_self(mpirun, 2, "mismatch", &[("COHORT_TIMEOUT", "100s")]);
    assert!(!out.success, "the job should have failed:\n{}", out.text);
    assert_ne!(out.code, Some(0));
    assert!(
        out.text.contains("rank 1: the group failed: mismatched collectives on group \"default\": rank 1 (this process) called recv #0 of 8 x float32 (32 bytes, tag 5), but rank 0 called send of 16 bytes with tag 5"),
        "{}",
        out.text
    );
    assert!(
        out.elapsed < Duration::from_secs(30),
        "took {:?}",
        out.elapsed
    );
}

// ------------------------------------------------------------------- ranks

fn rank_main(role: &str) -> Res<()> {
    let opts = GroupOptions::from_env()?;
    let pg = cohort_mpi::init(GroupOptions {
        timeout: if std::env::var_os("COHORT_TIMEOUT").is_some() {
            opts.timeout
        } else {
            Duration::from_secs(60)
        },
        ..opts
    })?;
    match role {
        "compare" => compare(&pg),
        "skip" => {
            pg.barrier()?;
            if pg.rank() == 1 {
                std::thread::sleep(Duration::from_secs(60));
                return Ok(());
            }
            let mut x = vec![1.0f32; 4];
            pg.all_reduce(&mut x, ReduceOp::Sum)?;
            Err("the all_reduce without rank 1 returned".into())
        }
        "die" => {
            pg.barrier()?;
            if pg.rank() == 1 {
                // No MPI_Finalize: the launcher sees a rank vanish.
                std::process::exit(7);
            }
            let mut x = vec![1.0f32; 4];
            pg.all_reduce(&mut x, ReduceOp::Sum)?;
            Err("the all_reduce with a dead rank returned".into())
        }
        "mismatch" => {
            if pg.rank() == 0 {
                pg.send(&[1.0f32; 4], 1, 5)?;
            } else {
                let mut x = [0.0f32; 8];
                pg.recv(&mut x, 0, 5)?;
            }
            pg.barrier()?;
            Err("a receive of the wrong length went through".into())
        }
        _ => Err(format!("unknown role {role:?}").into()),
    }
}

/// A cohort TCP group of the same processes; rank 0 hosts its store on a
/// port the OS picks and tells the others over MPI.
fn tcp_group(mpi: &ProcessGroup) -> Res<ProcessGroup> {
    let timeout = Duration::from_secs(60);
    let (rank, size) = (mpi.rank(), mpi.size());
    let (store, mut port) = if rank == 0 {
        let s = TcpStore::new_master_or_client("127.0.0.1:0", true, timeout)?;
        let port = s.server_addr().port() as i64;
        (Some(s), [port])
    } else {
        (None, [0i64])
    };
    mpi.broadcast(&mut port, 0)?;
    let store = match store {
        Some(s) => s,
        None => TcpStore::connect(format!("127.0.0.1:{}", port[0]), timeout)?,
    };
    let opts = GroupOptions {
        timeout,
        ..GroupOptions::default()
    };
    Ok(ProcessGroup::new(Arc::new(store), rank, size, opts)?)
}

/// Element types on small integer values, where every backend's answer is
/// exact; floats also carry a NaN.
trait Val: Element + Default + Debug + PartialEq {
    fn from_small(v: i64) -> Self;
    fn nan() -> Option<Self>;
    fn same(a: &Self, b: &Self) -> bool {
        a == b || (format!("{a:?}") == "NaN" && format!("{b:?}") == "NaN")
    }
}

macro_rules! val {
    ($t:ty, $nan:expr, $conv:expr) => {
        impl Val for $t {
            fn from_small(v: i64) -> Self {
                $conv(v)
            }
            fn nan() -> Option<Self> {
                $nan
            }
        }
    };
}
val!(f32, Some(f32::NAN), |v| v as f32);
val!(f64, Some(f64::NAN), |v| v as f64);
val!(i32, None, |v| v as i32);
val!(i64, None, |v| v);
val!(u8, None, |v| v as u8);
val!(bf16, Some(bf16::NAN), |v| bf16::from_f32(v as f32));

const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Product,
    ReduceOp::Min,
    ReduceOp::Max,
];

/// Rank `rank`'s input of `n` elements (salt tells buffers apart): values
/// 1..=5, never 0 (products stay informative); a NaN at index 3 of rank 1.
fn input<T: Val>(rank: usize, n: usize, salt: usize) -> Vec<T> {
    (0..n)
        .map(|i| match T::nan() {
            Some(nan) if rank == 1 && i == 3 => nan,
            _ => T::from_small(((rank * 7 + i * 3 + salt) % 5 + 1) as i64),
        })
        .collect()
}

fn assert_same<T: Val>(what: &str, mpi: &[T], tcp: &[T]) -> Res<()> {
    if mpi.len() != tcp.len() {
        return Err(format!(
            "{what}: {} elements over MPI, {} over TCP",
            mpi.len(),
            tcp.len()
        )
        .into());
    }
    if let Some(i) = (0..mpi.len()).find(|&i| !T::same(&mpi[i], &tcp[i])) {
        return Err(format!(
            "{what}: element {i} is {:?} over MPI, {:?} over TCP",
            mpi[i], tcp[i]
        )
        .into());
    }
    Ok(())
}

/// Runs `f` on both groups with the same inputs and compares what it returns.
fn both<T: Val>(
    what: &str,
    mpi: &ProcessGroup,
    tcp: &ProcessGroup,
    f: impl Fn(&ProcessGroup) -> Res<Vec<T>>,
) -> Res<()> {
    let a = f(mpi).map_err(|e| format!("{what} over MPI: {e}"))?;
    let b = f(tcp).map_err(|e| format!("{what} over TCP: {e}"))?;
    assert_same(what, &a, &b)
}

fn collectives_of<T: Val>(mpi: &ProcessGroup, tcp: &ProcessGroup, n: usize) -> Res<()> {
    let (rank, size) = (mpi.rank(), mpi.size());
    let dt = T::DTYPE;
    for root in [0, size - 1] {
        both(
            &format!("broadcast {n} x {dt} from {root}"),
            mpi,
            tcp,
            |pg| {
                let mut x = input::<T>(rank, n, root);
                pg.broadcast(&mut x, root)?;
                Ok(x)
            },
        )?;
        both(&format!("gather {n} x {dt} to {root}"), mpi, tcp, |pg| {
            let x = input::<T>(rank, n, 1);
            let mut out = vec![T::default(); n * size];
            pg.gather(&x, (rank == root).then_some(&mut out[..]), root)?;
            Ok(out)
        })?;
        both(&format!("scatter {n} x {dt} from {root}"), mpi, tcp, |pg| {
            let x = input::<T>(rank, n * size, 2);
            let mut out = vec![T::default(); n];
            pg.scatter((rank == root).then_some(&x[..]), &mut out, root)?;
            Ok(out)
        })?;
    }
    both(&format!("all_gather {n} x {dt}"), mpi, tcp, |pg| {
        let mut out = vec![T::default(); n * size];
        pg.all_gather(&input::<T>(rank, n, 3), &mut out)?;
        Ok(out)
    })?;
    both(&format!("all_to_all {n} x {dt}"), mpi, tcp, |pg| {
        let mut out = vec![T::default(); n * size];
        pg.all_to_all(&input::<T>(rank, n * size, 4), &mut out)?;
        Ok(out)
    })?;
    for op in OPS {
        if !op.supports(dt) {
            continue;
        }
        both(&format!("all_reduce {n} x {dt} {op}"), mpi, tcp, |pg| {
            let mut x = input::<T>(rank, n, 5);
            pg.all_reduce(&mut x, op)?;
            Ok(x)
        })?;
        for root in [0, size - 1] {
            both(
                &format!("reduce {n} x {dt} {op} to {root}"),
                mpi,
                tcp,
                |pg| {
                    let mut x = input::<T>(rank, n, 6);
                    pg.reduce(&mut x, op, root)?;
                    Ok(x)
                },
            )?;
        }
        both(&format!("reduce_scatter {n} x {dt} {op}"), mpi, tcp, |pg| {
            let mut out = vec![T::default(); n];
            pg.reduce_scatter(&input::<T>(rank, n * size, 7), &mut out, op)?;
            Ok(out)
        })?;
    }
    Ok(())
}

fn compare(mpi: &ProcessGroup) -> Res<()> {
    let (rank, size) = (mpi.rank(), mpi.size());
    if mpi.backend_name() != "mpi" || mpi.local_world_size() != size || mpi.local_rank() != rank {
        return Err(format!(
            "group {mpi:?}: local rank {} of {} on one host",
            mpi.local_rank(),
            mpi.local_world_size()
        )
        .into());
    }
    let tcp = tcp_group(mpi)?;
    // 70001 elements: past the segment sizes of MPI's pipelined algorithms,
    // and not a multiple of anything.
    for n in [0, 1, 5, 70_001] {
        collectives_of::<f32>(mpi, &tcp, n)?;
        collectives_of::<f64>(mpi, &tcp, n)?;
        collectives_of::<i32>(mpi, &tcp, n)?;
        collectives_of::<i64>(mpi, &tcp, n)?;
        collectives_of::<u8>(mpi, &tcp, n)?;
        collectives_of::<bf16>(mpi, &tcp, n)?;
    }
    // A 16 MB all_reduce and a 2 MB bf16 one (MPI's large-message paths,
    // the user-defined operator on segments).
    both("all_reduce 4M x float32 sum", mpi, &tcp, |pg| {
        let mut x = input::<f32>(rank, 4 << 20, 8);
        pg.all_reduce(&mut x, ReduceOp::Sum)?;
        Ok(x)
    })?;
    both("all_reduce 1M x bfloat16 avg", mpi, &tcp, |pg| {
        let mut x = input::<bf16>(rank, 1 << 20, 9);
        pg.all_reduce(&mut x, ReduceOp::Avg)?;
        Ok(x)
    })?;
    mpi.barrier()?;

    // Point to point around the ring, blocking and async, while an async
    // all_reduce runs on the group's worker thread (MPI_THREAD_MULTIPLE).
    let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
    let pending = mpi.all_reduce_async(input::<f32>(rank, 100_000, 10), ReduceOp::Max);
    let sent = mpi.isend(input::<i64>(rank, 1000, 11), next, 42);
    let mut got = vec![0i64; 1000];
    mpi.recv(&mut got, prev, 42)?;
    sent.wait()?;
    assert_same("ring send/recv", &got, &input::<i64>(prev, 1000, 11))?;
    let recvd = mpi.irecv(vec![0u8; 300], next, 7);
    mpi.send(&input::<u8>(rank, 300, 12), prev, 7)?;
    assert_same("ring irecv", &recvd.wait()?, &input::<u8>(next, 300, 12))?;
    let max = pending.wait()?;
    let mut reference = input::<f32>(rank, 100_000, 10);
    tcp.all_reduce(&mut reference, ReduceOp::Max)?;
    assert_same("async all_reduce beside send/recv", &max, &reference)?;

    // A sub-group of the first and last ranks is an MPI_Comm_split: its
    // members reduce among themselves, as the TCP group's sub-group does,
    // and a sub-group of it splits again.
    let ends = [0, size - 1];
    let (mpi_sub, tcp_sub) = (mpi.new_group(&ends)?, tcp.new_group(&ends)?);
    match (mpi_sub, tcp_sub) {
        (Some(m), Some(t)) => {
            if m.backend_name() != "mpi" || m.size() != 2 || m.rank() != usize::from(rank != 0) {
                return Err(format!("sub-group {m:?} of rank {rank}").into());
            }
            both("sub-group all_reduce 70001 x float32 sum", &m, &t, |pg| {
                let mut x = input::<f32>(rank, 70_001, 13);
                pg.all_reduce(&mut x, ReduceOp::Sum)?;
                Ok(x)
            })?;
            match m.new_group(&[1])? {
                Some(last) if rank == size - 1 => {
                    let mut x = vec![3.0f32; 5];
                    last.all_reduce(&mut x, ReduceOp::Avg)?;
                    assert_same("group of one", &x, &[3.0f32; 5])?;
                }
                None if rank == 0 => {}
                other => return Err(format!("sub-sub-group on rank {rank}: {other:?}").into()),
            }
        }
        (None, None) if rank != 0 && rank != size - 1 => {}
        other => return Err(format!("new_group on rank {rank} gave {other:?}").into()),
    }
    mpi.barrier()?;
    println!("rank {rank} of {size}: all collectives match");
    Ok(())
}

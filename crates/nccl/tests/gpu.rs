//! NCCL on a GPU, where there is one (skipped with a one-line message otherwise): every
//! collective at world 1 against its expected values, and two ranks (two processes: this test
//! binary started again) sharing GPU 0, which NCCL 2.30+ runs with
//! `NCCL_MULTI_RANK_GPU_ENABLE=1` and cohort refuses, naming the fix, without it. The GPU
//! script runs the same checks through the release binary (`cohort gpu nccl`, under `cohort
//! run -n 2` for two ranks), which needs no toolchain.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use cohort_comm::{GroupOptions, ProcessGroup};
use cohort_cuda::libraries::Search;
use cohort_cuda::CudaBackend;
use cohort_engine::DType;
use cohort_nccl::{check, join, Binding, Joined, NcclError, Policy, MULTI_RANK_GPU_ENV};
use cohort_store::{Store, TcpStore};

const CHILD_RANK: &str = "COHORT_NCCL_TEST_RANK";
const CHILD_STORE: &str = "COHORT_NCCL_TEST_STORE";

/// The GPU 0 backend and NCCL, or `None` after saying why the test is skipped.
fn gpu_or_skip(test: &str) -> Option<CudaBackend> {
    let search = Search::from_env();
    if let Err(e) = cohort_nccl::load(&search) {
        eprintln!("skipped {test}: {e}");
        return None;
    }
    match CudaBackend::open(0, DType::F32, &search) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("skipped {test}: {e}");
            None
        }
    }
}

fn group(store: Arc<dyn Store>, rank: usize, world: usize) -> ProcessGroup {
    let opts = GroupOptions {
        name: "nccl-gpu-test".into(),
        timeout: Duration::from_secs(60),
        ..GroupOptions::default()
    };
    ProcessGroup::new(store, rank, world, opts).unwrap()
}

#[test]
fn every_collective_at_world_1() {
    let Some(backend) = gpu_or_skip("every_collective_at_world_1") else {
        return;
    };
    let pg = group(Arc::new(cohort_store::HashStore::new()), 0, 1);
    let binding = Binding::of(&backend).expect("a CUDA backend has a stream");
    let comm = match join(&pg, &Search::from_env(), binding, "w1", Policy::Required).unwrap() {
        Joined::Nccl(c) => c,
        Joined::Staged(why) => panic!("NCCL required, staged: {why}"),
    };
    let rows = check::run(&comm, &backend, (1 << 20) + 3).unwrap();
    eprint!("{}", check::table(&rows));
    assert!(rows.iter().all(|r| r.ok), "{}", check::table(&rows));
    // Arguments that do not fit are one-line errors, and leave the communicator usable.
    let mut buf = cohort_engine::Backend::alloc(&backend, 8).unwrap();
    let e = comm.broadcast(buf.view_mut(), 1).unwrap_err().to_string();
    assert!(
        e.contains("broadcast on rank 0") && e.contains("root 1"),
        "{e}"
    );
    let mut host = [0f32; 4];
    let e = comm
        .all_reduce(
            cohort_engine::ViewMut::from(&mut host[..]),
            cohort_nccl::Reduce::Sum,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("a buffer on cpu"), "{e}");
    comm.all_reduce(buf.view_mut(), cohort_nccl::Reduce::Avg)
        .unwrap();
}

/// One rank of the two-process test (run only as the child the test below starts).
#[test]
fn child_rank() {
    let Ok(rank) = std::env::var(CHILD_RANK) else {
        return;
    };
    let rank: usize = rank.parse().unwrap();
    let addr = std::env::var(CHILD_STORE).unwrap();
    let backend = CudaBackend::open(0, DType::F32, &Search::from_env()).unwrap();
    let store: Arc<dyn Store> = Arc::new(TcpStore::connect(addr, Duration::from_secs(60)).unwrap());
    let pg = group(store, rank, 2);
    let binding = Binding::of(&backend).unwrap();
    match join(&pg, &Search::from_env(), binding, "two", Policy::Required) {
        Ok(Joined::Nccl(comm)) => {
            let rows = check::run(&comm, &backend, (1 << 18) + 1).unwrap();
            eprint!("{}", check::table(&rows));
            assert!(rows.iter().all(|r| r.ok), "{}", check::table(&rows));
            println!("RESULT nccl ok");
        }
        Ok(Joined::Staged(why)) => panic!("NCCL required, staged: {why}"),
        Err(e @ NcclError::SharedGpu { .. }) => println!("RESULT refused {e}"),
        Err(e) => panic!("{e}"),
    }
}

/// Starts both ranks as processes; returns each one's RESULT line.
fn two_ranks(multi_rank_env: bool) -> Vec<String> {
    let master =
        TcpStore::new_master_or_client("127.0.0.1:0", true, Duration::from_secs(60)).unwrap();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            let mut c = Command::new(&exe);
            c.args(["--exact", "child_rank", "--nocapture", "--test-threads=1"])
                .env(CHILD_RANK, rank.to_string())
                .env(CHILD_STORE, master.server_addr().to_string())
                .env_remove(MULTI_RANK_GPU_ENV)
                .stdout(Stdio::piped());
            if multi_rank_env {
                c.env(MULTI_RANK_GPU_ENV, "1");
            }
            c.spawn().unwrap()
        })
        .collect();
    children
        .into_iter()
        .enumerate()
        .map(|(rank, child)| {
            let out = child.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            assert!(out.status.success(), "rank {rank}: {}\n{text}", out.status);
            text.lines()
                .find(|l| l.starts_with("RESULT"))
                .unwrap_or_else(|| panic!("rank {rank} printed no RESULT: {text}"))
                .to_string()
        })
        .collect()
}

#[test]
fn two_ranks_share_gpu_0() {
    let Some(backend) = gpu_or_skip("two_ranks_share_gpu_0") else {
        return;
    };
    drop(backend);
    let version = cohort_nccl::load(&Search::from_env()).unwrap().version();
    // Without the variable every NCCL is refused, naming the fix.
    for line in two_ranks(false) {
        assert!(line.starts_with("RESULT refused"), "{line}");
        assert!(
            line.contains("share one GPU") && line.contains("--backend cohort"),
            "{line}"
        );
    }
    for line in two_ranks(true) {
        if version.at_least(2, 30) {
            assert_eq!(line, "RESULT nccl ok");
        } else {
            assert!(
                line.starts_with("RESULT refused") && line.contains("2.30"),
                "{line}"
            );
        }
    }
}

//! The communicator's watchdog on the CUDA CPU emulator's NCCL (`crates/cuda/emu/README.md`),
//! two ranks as two threads of this process on the one emulated device: a collective whose
//! peer never comes fails at the collective timeout naming the rank and the operation, and
//! aborts the communicator; the peer that comes late fails instead of hanging (the abort
//! reaches it as NCCL's remote error); later calls on either say the communicator was
//! aborted. A GPU can show this only with a rank made to stall, which the GPU script cannot
//! afford; here it runs in CI. Needs g++: without one it skips with a message, and fails under
//! CI (`CI` set), whose machine has it.

use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use cohort_comm::{GroupOptions, ProcessGroup};
use cohort_cuda::libraries::Search;
use cohort_cuda::CudaBackend;
use cohort_engine::{Backend, DType};
use cohort_nccl::{join, Binding, Joined, NcclError, Policy, Reduce, MULTI_RANK_GPU_ENV};
use cohort_store::{HashStore, Store};

/// The emulator's libraries, or None (skip) without g++.
fn emulator() -> Option<Search> {
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cuda-emu");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../cuda/emu/build.sh");
    let built = std::process::Command::new("bash")
        .arg(&script)
        .arg(&out)
        .output()
        .map_err(|e| e.to_string())
        .and_then(|o| match o.status.success() {
            true => Ok(()),
            false => Err(String::from_utf8_lossy(&o.stderr).trim().to_string()),
        });
    match built {
        Ok(()) => Some(Search::in_dirs([out.join("lib")])),
        Err(e) if std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false") => {
            panic!("the CUDA CPU emulator did not build: {e}")
        }
        Err(e) => {
            eprintln!("skipped: the CUDA CPU emulator did not build: {e}");
            None
        }
    }
}

#[test]
fn a_collective_whose_peer_never_comes_times_out_and_the_late_peer_fails_too() {
    let Some(search) = emulator() else { return };
    // Both ranks share the one emulated device, which NCCL 2.30 runs with this set. This test
    // binary has one test, so no other thread reads the environment meanwhile.
    std::env::set_var(MULTI_RANK_GPU_ENV, "1");
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let timeout = Duration::from_secs(2);
    // Rank 0 says when it has given up; rank 1 comes to the collective only then.
    let (gave_up, wait_for_rank0) = mpsc::channel::<()>();
    let (mut gave_up, mut wait_for_rank0) = (Some(gave_up), Some(wait_for_rank0));
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let (store, search) = (store.clone(), search.clone());
            let (gave_up, wait_for_rank0) = match rank {
                0 => (gave_up.take(), None),
                _ => (None, wait_for_rank0.take()),
            };
            std::thread::spawn(move || {
                let opts = GroupOptions {
                    name: "nccl-watchdog".into(),
                    timeout,
                    ..GroupOptions::default()
                };
                let pg = ProcessGroup::new(store, rank, 2, opts).unwrap();
                let backend = CudaBackend::open(0, DType::F32, &search).unwrap();
                let binding = Binding::of(&backend).unwrap();
                let comm = match join(&pg, &search, binding, "watchdog", Policy::Required) {
                    Ok(Joined::Nccl(c)) => c,
                    Ok(Joined::Staged(why)) => panic!("rank {rank}: staged: {why}"),
                    Err(e) => panic!("rank {rank}: {e}"),
                };
                let mut buf = backend.alloc(1000).unwrap();
                // One collective both come to.
                comm.all_reduce(buf.view_mut(), Reduce::Sum).unwrap();
                if let Some(rx) = wait_for_rank0 {
                    rx.recv().unwrap();
                }
                let start = Instant::now();
                let e = comm.all_reduce(buf.view_mut(), Reduce::Sum).unwrap_err();
                let took = start.elapsed();
                if let Some(tx) = gave_up {
                    tx.send(()).unwrap();
                }
                let again = comm.all_reduce(buf.view_mut(), Reduce::Sum).unwrap_err();
                (e, took, again)
            })
        })
        .collect();
    let mut results = ranks.into_iter().map(|r| r.join().unwrap());
    let (e0, took0, again0) = results.next().unwrap();
    let (e1, took1, again1) = results.next().unwrap();
    // rank 0: the watchdog, at the timeout
    assert!(matches!(e0, NcclError::Timeout { rank: 0, .. }), "{e0}");
    assert!(e0.to_string().contains("all_reduce on rank 0"), "{e0}");
    assert!(
        took0 >= timeout && took0 < timeout + Duration::from_secs(3),
        "{took0:?}"
    );
    // rank 1: the abort reaches it at once, not at its own timeout
    let t1 = e1.to_string();
    assert!(
        t1.contains("all_reduce on rank 1") && t1.contains("rank 0 aborted"),
        "{t1}"
    );
    assert!(took1 < timeout, "{took1:?}");
    // afterwards, each communicator refuses work, naming the first failure
    for (again, first) in [(again0, e0), (again1, e1)] {
        assert!(matches!(again, NcclError::Aborted { .. }), "{again}");
        assert!(again.to_string().contains(&first.to_string()), "{again}");
    }
}

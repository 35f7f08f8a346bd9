//! The communication stream on the CUDA CPU emulator's NCCL (`crates/cuda/emu/README.md`),
//! two ranks as two threads of this process on the one emulated device: an all-reduce queued
//! after an event of the backend's stream, from a thread other than the one that launched the
//! kernels (as DDP's reducer does), averages the buffer; the kernels' stream is ordered after
//! it, so a copy on the kernels' stream reads the averages; a buffer cut into two buckets
//! reduced one after the other is the whole buffer's average; an event of another backend is
//! a one-line error. The emulator's driver runs every call to completion, so this checks the
//! calls and the results, never the streams' order (the GPU's question). Needs g++: without
//! one it skips with a message, and fails under CI (`CI` set), whose machine has it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cohort_comm::{GroupOptions, ProcessGroup};
use cohort_cuda::libraries::Search;
use cohort_cuda::CudaBackend;
use cohort_engine::{Backend, DType, Event};
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
fn buckets_reduced_on_the_communication_stream_after_an_event_average_the_buffer() {
    let Some(search) = emulator() else { return };
    // Both ranks share the one emulated device, which NCCL 2.30 runs with this set. This test
    // binary has one test, so no other thread reads the environment meanwhile.
    std::env::set_var(MULTI_RANK_GPU_ENV, "1");
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let n = 1001;
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let (store, search) = (store.clone(), search.clone());
            std::thread::spawn(move || {
                let opts = GroupOptions {
                    name: "nccl-side-stream".into(),
                    timeout: Duration::from_secs(30),
                    ..GroupOptions::default()
                };
                let pg = ProcessGroup::new(store, rank, 2, opts).unwrap();
                let cuda = CudaBackend::open(0, DType::F32, &search).unwrap();
                let backend: &dyn Backend = &cuda;
                let binding = Binding::of(backend).unwrap();
                let comm = match join(&pg, &search, binding, "side", Policy::Required) {
                    Ok(Joined::Nccl(c)) => c,
                    Ok(Joined::Staged(why)) => panic!("rank {rank}: staged: {why}"),
                    Err(e) => panic!("rank {rank}: {e}"),
                };
                // Nothing queued on the communication stream yet: nothing to order.
                comm.order_kernels_after().unwrap();
                let mine: Vec<f32> = (0..n).map(|i| (i * (rank + 1)) as f32).collect();
                let mut buf = backend.alloc(n).unwrap();
                backend.upload(buf.view_mut(), &mine).unwrap();
                let after = backend.record_event();
                assert!(
                    after.device().is_some(),
                    "the CUDA backend records real events"
                );
                // Two buckets, top first, from a thread other than the launching one.
                let (lo, hi) = buf.view_mut().split_at_mut(600);
                std::thread::scope(|s| {
                    s.spawn(|| {
                        comm.all_reduce_after(hi, Reduce::Avg, &after).unwrap();
                        comm.all_reduce_after(lo, Reduce::Avg, &Event::done())
                            .unwrap();
                    });
                });
                comm.order_kernels_after().unwrap();
                let mut out = vec![0f32; n];
                backend.download(&mut out, buf.view()).unwrap();
                // An event that is not CUDA's: refused before anything is queued.
                let foreign = Event::on_device(Box::new(7u32));
                let e = comm
                    .all_reduce_after(buf.view_mut(), Reduce::Avg, &foreign)
                    .unwrap_err();
                (out, e)
            })
        })
        .collect();
    for (rank, r) in ranks.into_iter().enumerate() {
        let (out, e) = r.join().unwrap();
        let want: Vec<f32> = (0..n).map(|i| i as f32 * 1.5).collect();
        assert!(out == want, "rank {rank}: {:?}", &out[..4]);
        assert!(matches!(e, NcclError::Argument { .. }), "{e}");
        assert!(e.to_string().contains("another backend"), "{e}");
    }
}

//! What can be checked of NCCL without a GPU (CI): the library found where the wheel puts it
//! and its version read; a missing one named with every place looked; the unique id handed
//! from rank 0 to rank 1 through a real TCP store; a communicator or a set-up without a GPU
//! failing in one line, and two ranks agreeing to stage through the host. Skipped, with a
//! line saying why, where the NCCL wheel is not installed.

use std::sync::Arc;
use std::time::Duration;

use cohort_comm::{GroupOptions, ProcessGroup};
use cohort_cuda::libraries::Search;
use cohort_nccl::{exchange_id, join, Binding, Joined, Nccl, NcclError, Policy, UNIQUE_ID_BYTES};
use cohort_store::{HashStore, Store, TcpStore};

/// The NCCL this machine has, or `None` after saying why the test is skipped.
fn nccl_or_skip(test: &str) -> Option<&'static Nccl> {
    match cohort_nccl::load(&Search::from_env()) {
        Ok(n) => Some(n),
        Err(e) => {
            eprintln!("skipped {test}: {e} (pip install nvidia-nccl-cu13 brings it)");
            None
        }
    }
}

#[test]
fn the_library_is_found_and_reports_its_version() {
    let Some(nccl) = nccl_or_skip("the_library_is_found_and_reports_its_version") else {
        return;
    };
    let (major, minor, _) = nccl.version().parts();
    assert_eq!(major, 2, "NCCL {}", nccl.version());
    assert!(minor >= 14, "NCCL {}", nccl.version());
    let file = nccl
        .path()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(file.starts_with("libnccl.so"), "{}", nccl.path().display());
    eprintln!("NCCL {} at {}", nccl.version(), nccl.path().display());
}

#[test]
fn a_missing_library_is_one_line_naming_what_and_where() {
    let dir = std::env::temp_dir().join(format!("cohort-nccl-none-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let e = Nccl::open(&Search::in_dirs([dir.clone()]))
        .unwrap_err()
        .to_string();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(e.starts_with("no NCCL: looked for libnccl.so.2"), "{e}");
    assert!(e.contains(&dir.display().to_string()), "{e}");
    assert!(!e.contains('\n'), "{e}");
}

#[test]
fn the_unique_id_goes_from_rank_0_to_rank_1_through_a_tcp_store() {
    let Some(nccl) = nccl_or_skip("the_unique_id_goes_from_rank_0_to_rank_1_through_a_tcp_store")
    else {
        return;
    };
    let timeout = Duration::from_secs(20);
    let master = TcpStore::new_master_or_client("127.0.0.1:0", true, timeout).unwrap();
    let addr = master.server_addr();
    let other = std::thread::spawn(move || {
        let store = TcpStore::connect(addr, timeout).unwrap();
        exchange_id(nccl, &store, "test/id", 1, timeout).unwrap()
    });
    // Rank 1 is already waiting when rank 0 sets the key, as in a real start.
    std::thread::sleep(Duration::from_millis(50));
    let id0 = exchange_id(nccl, &master, "test/id", 0, timeout).unwrap();
    let id1 = other.join().unwrap();
    assert_eq!(id0, id1);
    assert_eq!(id0.as_bytes().len(), UNIQUE_ID_BYTES);
    assert!(id0.as_bytes().iter().any(|&b| b != 0));
    // A second id is a new one: each communicator gets its own.
    assert_ne!(nccl.unique_id(0).unwrap(), id0);
}

#[test]
fn a_bad_or_missing_id_is_a_one_line_error_naming_the_key() {
    let Some(nccl) = nccl_or_skip("a_bad_or_missing_id_is_a_one_line_error_naming_the_key") else {
        return;
    };
    let store = HashStore::new();
    store.set("bad/id", b"short").unwrap();
    let e = exchange_id(nccl, &store, "bad/id", 1, Duration::from_secs(1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 1") && e.contains("\"bad/id\""), "{e}");
    assert!(e.contains("holds 5 bytes"), "{e}");
    let e = exchange_id(nccl, &store, "never/set", 1, Duration::from_millis(100))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("\"never/set\"") && e.contains("rank 0 never set it"),
        "{e}"
    );
    assert!(!e.contains('\n'), "{e}");
}

/// Whether this machine has a GPU (then the no-GPU tests below do not apply).
fn has_gpu() -> bool {
    cohort_cuda::device_count(&Search::from_env()).is_ok_and(|n| n > 0)
}

#[test]
fn a_communicator_without_a_gpu_is_a_one_line_error() {
    let Some(nccl) = nccl_or_skip("a_communicator_without_a_gpu_is_a_one_line_error") else {
        return;
    };
    if has_gpu() {
        eprintln!("skipped a_communicator_without_a_gpu_is_a_one_line_error: a GPU is here");
        return;
    }
    let id = nccl.unique_id(0).unwrap();
    let binding = Binding {
        ordinal: 0,
        stream: 0,
    };
    let e = cohort_nccl::Communicator::new(
        nccl,
        &Search::from_env(),
        &id,
        (0, 1),
        binding,
        Duration::from_secs(5),
    )
    .unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("no GPU/driver: looked for libcuda.so.1"),
        "{text}"
    );
    assert!(!text.contains('\n'), "{text}");
}

#[test]
fn ranks_without_a_gpu_agree_to_stage_or_refuse_together() {
    if has_gpu() {
        eprintln!("skipped ranks_without_a_gpu_agree_to_stage_or_refuse_together: a GPU is here");
        return;
    }
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let opts = GroupOptions {
                    name: "nccl-join".into(),
                    timeout: Duration::from_secs(20),
                    ..GroupOptions::default()
                };
                let pg = ProcessGroup::new(store, rank, 2, opts).unwrap();
                let binding = Binding {
                    ordinal: 0,
                    stream: 0,
                };
                let search = Search::from_env();
                let preferred = join(&pg, &search, binding, "t/1", Policy::Preferred).unwrap();
                let required = join(&pg, &search, binding, "t/2", Policy::Required).unwrap_err();
                (preferred, required)
            })
        })
        .collect();
    for (rank, t) in ranks.into_iter().enumerate() {
        let (preferred, required) = t.join().unwrap();
        match preferred {
            Joined::Staged(why) => assert_eq!(why, "NCCL is not available on rank(s) 0, 1"),
            Joined::Nccl(_) => panic!("rank {rank}: NCCL without a GPU"),
        }
        assert!(
            matches!(required, NcclError::Unavailable { .. }),
            "{required}"
        );
        let text = required.to_string();
        assert!(
            text.starts_with(&format!(
                "NCCL on rank {rank}: not available on rank(s) 0, 1: "
            )),
            "{text}"
        );
        assert!(!text.contains('\n'), "{text}");
    }
}

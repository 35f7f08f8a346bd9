//! `env://` under Slurm, without Slurm: SLURM_PROCID, SLURM_NTASKS and
//! SLURM_LOCALID stand in for RANK, WORLD_SIZE and LOCAL_RANK when those are
//! unset, and lose to them when set. One test in its own binary (its own
//! process), because it sets environment variables.

use std::sync::Arc;
use std::time::Duration;

use cohort_comm::{init_process_group, GroupOptions, InitOptions, ProcessGroup, ReduceOp};
use cohort_store::TcpStore;

fn set(vars: &[(&str, Option<&str>)]) {
    for (k, v) in vars {
        match v {
            Some(v) => std::env::set_var(k, v),
            None => std::env::remove_var(k),
        }
    }
}

#[test]
fn slurm_variables_stand_in_for_the_env_init_ones() {
    let timeout = Duration::from_secs(30);
    let group = GroupOptions {
        timeout,
        ..GroupOptions::default()
    };
    let init = || {
        init_process_group(
            "tcp",
            "env://",
            InitOptions {
                group: Some(group.clone()),
                ..InitOptions::default()
            },
        )
    };
    // Rank 0 is a thread of this test that hosts the store; this process's
    // env:// call is rank 1 of 2, as srun's second task would be.
    let store = TcpStore::new_master_or_client("127.0.0.1:0", true, timeout).unwrap();
    let port = store.server_addr().port().to_string();
    set(&[
        ("MASTER_ADDR", Some("127.0.0.1")),
        ("MASTER_PORT", Some(&port)),
        ("COHORT_STORE_HOSTED", Some("1")),
        ("RANK", None),
        ("WORLD_SIZE", None),
        ("LOCAL_RANK", None),
        ("LOCAL_WORLD_SIZE", None),
        ("COHORT_RESTART_COUNT", None),
        ("SLURM_PROCID", None),
        ("SLURM_NTASKS", Some("2")),
        ("SLURM_LOCALID", Some("1")),
    ]);

    // Neither RANK nor SLURM_PROCID: the error names both.
    let e = init().unwrap_err().to_string();
    assert!(e.contains("RANK") && e.contains("SLURM_PROCID"), "{e}");
    // RANK wins over SLURM_PROCID, so its bad value is the one reported.
    set(&[("SLURM_PROCID", Some("1")), ("RANK", Some("one"))]);
    let e = init().unwrap_err().to_string();
    assert!(
        e.contains("RANK: \"one\" is not a non-negative integer"),
        "{e}"
    );
    set(&[("RANK", None), ("SLURM_NTASKS", Some("x2"))]);
    let e = init().unwrap_err().to_string();
    assert!(e.contains("SLURM_NTASKS: \"x2\""), "{e}");
    set(&[("SLURM_NTASKS", Some("2"))]);

    let store = Arc::new(store);
    let opts = group.clone();
    let rank0 = std::thread::spawn(move || {
        let pg = ProcessGroup::new(store, 0, 2, opts).unwrap();
        let mut x = [10.0f32, 20.0];
        pg.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        x
    });
    let pg = init().unwrap();
    assert_eq!((pg.rank(), pg.size()), (1, 2));
    assert_eq!(pg.local_rank(), 1, "from SLURM_LOCALID");
    let mut x = [1.0f32, 2.0];
    pg.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    assert_eq!(x, [11.0, 22.0]);
    assert_eq!(rank0.join().unwrap(), [11.0, 22.0]);
}

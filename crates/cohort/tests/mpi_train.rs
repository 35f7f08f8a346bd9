//! `cohort train --backend mpi` under `mpirun -np 2` (rank and world from
//! MPI, no launcher of ours) trains to the same parameters and losses as
//! `cohort run -n 2 train` with the same seed: bit for bit, because with two
//! ranks every reduced element is the same single sum a + b on both backends.
//! Also: `--backend mpi` under `cohort run` is refused rather than run as
//! two separate one-rank jobs. Built with `--features mpi` only; skipped
//! with a message where mpirun is not installed.
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

mod support;

use support::{params, succeeded, TINY};

/// Steps, logging and batch of both runs.
const STEPS: &[&str] = &[
    "--steps",
    "6",
    "--warmup-steps",
    "1",
    "--log-interval",
    "1",
    "--batch-size",
    "2",
];

fn find_mpirun() -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join("mpirun"))
        .find(|p| p.is_file())
}

fn run(cmd: &mut Command) -> Output {
    cmd.env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env("COHORT_NUM_THREADS", "1")
        .env("COHORT_TIMEOUT", "60s")
        .stdin(Stdio::null())
        .output()
        .expect("the command starts")
}

fn mpirun(mpirun: &Path, np: usize) -> Command {
    let mut cmd = Command::new(mpirun);
    cmd.args([
        "-np",
        &np.to_string(),
        "--oversubscribe",
        "--bind-to",
        "none",
    ])
    .args(["--timeout", "120"])
    .arg(env!("CARGO_BIN_EXE_cohort"))
    // Open MPI refuses root without these; CI runs as root.
    .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
    .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    // Spinning waits would steal the compute thread's core.
    .env("OMPI_MCA_mpi_yield_when_idle", "1");
    cmd
}

/// The `[step k / n] loss = x` lines, without any prefix.
fn losses(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|l| l.find("[step ").map(|i| &l[i..]))
        .filter(|l| l.contains("] loss = "))
        .map(|l| l.split(" | ").next().unwrap().to_string())
        .collect()
}

#[test]
fn mpirun_training_matches_cohort_run_bit_for_bit() {
    let Some(mpirun_path) = find_mpirun() else {
        println!("skipped: mpirun not found on PATH; install Open MPI (Debian: openmpi-bin libopenmpi-dev)");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (d_mpi, d_ours) = (tmp.path().join("mpi"), tmp.path().join("ours"));

    let mut cmd = mpirun(&mpirun_path, 2);
    cmd.args(["train", "--backend", "mpi", "--out"])
        .arg(&d_mpi)
        .args(STEPS)
        .args(TINY);
    let mpi = succeeded(&run(&mut cmd));
    assert!(
        mpi.contains("global batch: 4 sequences = 2 per rank x 2 ranks x 1 accumulation"),
        "{mpi}"
    );

    let mut cmd = support::cohort();
    cmd.args(["run", "--standalone", "-n", "2", "train", "--out"])
        .arg(&d_ours)
        .args(STEPS)
        .args(TINY);
    let ours = succeeded(&run(&mut cmd));

    let (l_mpi, l_ours) = (losses(&mpi), losses(&ours));
    assert_eq!(l_mpi.len(), 6, "{mpi}");
    assert_eq!(l_mpi, l_ours, "losses differ\nmpi:\n{mpi}\nours:\n{ours}");
    let (a, b) = (params(&d_mpi), params(&d_ours));
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert_eq!(a.len(), b.len());
    assert!(
        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
        "parameters differ: max |diff| {diff}"
    );
}

#[test]
fn the_mpi_backend_under_cohort_run_is_refused() {
    if find_mpirun().is_none() {
        println!("skipped: mpirun not found on PATH");
        return;
    }
    let mut cmd = support::cohort();
    cmd.args([
        "run",
        "--standalone",
        "-n",
        "2",
        "train",
        "--backend",
        "mpi",
    ])
    .args(STEPS)
    .args(TINY);
    let out = run(&mut cmd);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("WORLD_SIZE=2 but MPI sees 1 process(es)"),
        "{text}"
    );
}

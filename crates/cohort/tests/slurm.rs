//! cohort under Slurm without Slurm: the variables `srun` sets, set by hand.
//! Two `cohort train` tasks of one "step" find each other from Slurm's
//! variables alone (no MASTER_ADDR, RANK, ...); SIGUSR1 to one of them saves
//! a checkpoint at the next step on both and ends them with exit code 75,
//! and the requeued job (SLURM_RESTART_COUNT=1) resumes to exactly the
//! checkpoint an uninterrupted run writes; `cohort run` forwards SIGUSR1;
//! two `cohort run` launchers, one per "node" (network namespaces where the
//! machine allows), take node count, node rank and master from Slurm.

mod support;

use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use support::{checkpoint_files, checkpoint_step, cohort, Nodes, Proc, SECRET, TINY};

const STEPS: &str = "1000";
const EXIT_SAVED_AND_STOPPED: i32 = 75;

/// `train` with a log line every 5 steps and a final checkpoint.
fn train_args(out: &Path) -> Vec<String> {
    train_steps(out, STEPS)
}

/// [`train_args`] for `steps` steps.
fn train_steps(out: &Path, steps: &str) -> Vec<String> {
    let mut args: Vec<String> = [
        "train",
        "--steps",
        steps,
        "--batch-size",
        "2",
        "--log-interval",
        "5",
        "--warmup-steps",
        "2",
        "--out",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.push(out.display().to_string());
    args.extend(TINY.iter().map(|s| s.to_string()));
    args
}

/// A Slurm job id whose derived port (15000 + id mod 10000) is free now.
fn job_id() -> (u64, u16) {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let start = (std::process::id() as u64 * 7 + NEXT.fetch_add(977, Ordering::Relaxed)) % 10000;
    for i in 0..10000 {
        let offset = (start + i * 13) % 10000;
        let port = 15000 + offset as u16;
        if TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return (7_000_000 + offset, port);
        }
    }
    panic!("no free port in 15000..25000");
}

/// Sets what `srun` sets for task `rank` of `ntasks` on node `node` of
/// `nnodes` (`local` its rank there) in job `job`.
fn srun_env(
    cmd: &mut Command,
    job: u64,
    rank: usize,
    ntasks: usize,
    node: usize,
    nnodes: usize,
    nodelist: &str,
) {
    let per_node = ntasks / nnodes;
    cmd.env("SLURM_JOB_ID", job.to_string())
        .env("SLURM_STEP_ID", "0")
        .env("SLURM_PROCID", rank.to_string())
        .env("SLURM_NTASKS", ntasks.to_string())
        .env("SLURM_LOCALID", (rank % per_node).to_string())
        .env("SLURM_NNODES", nnodes.to_string())
        .env("SLURM_NODEID", node.to_string())
        .env("SLURM_TASKS_PER_NODE", format!("{per_node}(x{nnodes})"))
        .env("SLURM_JOB_NODELIST", nodelist)
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .env_remove("LOCAL_RANK");
}

/// Two `cohort train` tasks of one srun step on this machine, started.
fn two_tasks(job: u64, args: &[String], extra_env: &[(&str, &str)]) -> [Proc; 2] {
    [0, 1].map(|rank| {
        let mut cmd = cohort();
        srun_env(&mut cmd, job, rank, 2, 0, 1, "127.0.0.1");
        cmd.args(args).envs(extra_env.iter().copied());
        Proc::spawn(cmd)
    })
}

fn finish_both(tasks: [Proc; 2]) -> [(i32, String); 2] {
    tasks.map(|task| {
        let (status, out) = task.finish(Duration::from_secs(120));
        (status.code().unwrap_or(-1), out)
    })
}

#[test]
fn srun_tasks_train_save_on_sigusr1_and_a_requeue_resumes_byte_equal() {
    let tmp = tempfile::tempdir().unwrap();
    let (whole, cut) = (tmp.path().join("whole"), tmp.path().join("cut"));

    // Uninterrupted, with nothing but Slurm's variables to find each other.
    let (job, port) = job_id();
    let [(code0, out0), (code1, out1)] = finish_both(two_tasks(job, &train_args(&whole), &[]));
    assert_eq!((code0, code1), (0, 0), "{out0}\n---\n{out1}");
    let said = format!(
        "from Slurm: rank 0, world size 2, local rank 0, master address 127.0.0.1 (first host \
         of SLURM_JOB_NODELIST), port {port} (from job {job})"
    );
    assert!(out0.contains(&said), "{out0}");

    // SIGUSR1 to rank 1 only: both ranks stop after the same step, saved.
    let (job, _) = job_id();
    let tasks = two_tasks(job, &train_args(&cut), &[]);
    tasks[0].wait_for("[step 10 / 1000]", Duration::from_secs(60));
    tasks[1].signal(libc::SIGUSR1);
    let [(code0, out0), (code1, out1)] = finish_both(tasks);
    assert_eq!(
        (code0, code1),
        (EXIT_SAVED_AND_STOPPED, EXIT_SAVED_AND_STOPPED),
        "{out0}\n---\n{out1}"
    );
    let step = checkpoint_step(&cut).expect("a checkpoint at the stop");
    assert!((10..1000).contains(&step), "stopped at {step}");
    assert!(
        out0.contains(&format!(
            "[step {step} / 1000] stopped by a signal to another rank"
        )),
        "{out0}"
    );
    assert!(
        out1.contains(&format!("stopped by SIGUSR1 after step {step}")),
        "{out1}"
    );

    // Slurm runs the requeued job again: the same command resumes from --out.
    let (job, _) = job_id();
    let tasks = two_tasks(job, &train_args(&cut), &[("SLURM_RESTART_COUNT", "1")]);
    let [(code0, out0), (code1, out1)] = finish_both(tasks);
    assert_eq!((code0, code1), (0, 0), "{out0}\n---\n{out1}");
    assert!(out0.contains(&format!("at step {step}")), "{out0}");
    let last = format!("step-{STEPS:0>6}");
    let (a, b) = (
        checkpoint_files(&whole.join(&last)),
        checkpoint_files(&cut.join(&last)),
    );
    assert_eq!(
        a.iter().map(|f| &f.0).collect::<Vec<_>>(),
        b.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(x == y, "{name} differs after the stop and requeue");
    }
}

#[test]
fn the_launcher_forwards_sigusr1_and_exits_75_without_restarting() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cmd = cohort();
    cmd.args(["run", "--standalone", "-n", "2", "--max-restarts", "2"])
        .args(train_args(tmp.path()));
    let launcher = Proc::spawn(cmd);
    launcher.wait_for("[step 10 / 1000]", Duration::from_secs(60));
    launcher.signal(libc::SIGUSR1);
    let (status, out) = launcher.finish(Duration::from_secs(120));
    assert_eq!(status.code(), Some(EXIT_SAVED_AND_STOPPED), "{out}");
    assert!(
        out.contains("received SIGUSR1, forwarded to the workers"),
        "{out}"
    );
    assert!(
        out.contains("saved a checkpoint and stopped on request"),
        "{out}"
    );
    assert!(!out.contains("restarting the workers"), "{out}");
    let step = checkpoint_step(tmp.path()).expect("a checkpoint at the stop");
    assert!((10..1000).contains(&step), "stopped at {step}");
}

#[test]
fn srun_launchers_on_two_nodes_take_the_job_from_slurm() {
    let nodes = Nodes::new("srun_launchers_on_two_nodes_take_the_job_from_slurm");
    let tmp = tempfile::tempdir().unwrap();
    let (job, port) = job_id();
    let master = nodes.master_addr();
    let other = match &nodes {
        Nodes::Namespaces(netns) => netns.ips[1].clone(),
        Nodes::Loopback => master.clone(),
    };
    // One launcher per node (srun --ntasks-per-node 1), one worker each.
    let nodelist = format!("{master},{other}");
    let launchers = [0, 1].map(|node| {
        let mut cmd = nodes.cohort(node);
        srun_env(&mut cmd, job, node, 2, node, 2, &nodelist);
        cmd.args(["run", "-n", "1", "--join-timeout", "30"])
            .args(train_steps(&tmp.path().join(format!("node{node}")), "12"))
            .env("COHORT_SECRET", SECRET);
        Proc::spawn(cmd)
    });
    for (node, launcher) in launchers.into_iter().enumerate() {
        let (status, out) = launcher.finish(Duration::from_secs(120));
        assert!(status.success(), "node {node}: {out}");
        let said = format!(
            "cohort run: from Slurm: 2 node(s), node rank {node}, master address {master} (first \
             host of SLURM_JOB_NODELIST), port {port} (from job {job})"
        );
        assert!(out.contains(&said), "node {node}: {out}");
    }
}

//! `cohort run` end to end: the real binary launching real worker processes
//! (`sh -c ...` scripts and `cohort demo`) on loopback. Each test uses
//! `--standalone` or a port of its own, so the tests can run in parallel.

use std::fs;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

fn cohort() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cohort"));
    cmd.env_remove("COHORT_NUM_THREADS")
        .env_remove("OMP_NUM_THREADS");
    cmd
}

fn run(args: &[&str]) -> Output {
    cohort().args(args).output().expect("cohort runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A port nobody listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether `pid` is a live process (a zombie that init has not reaped yet
/// counts as dead).
fn alive(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => !matches!(
            stat.rsplit(')')
                .next()
                .and_then(|s| s.trim().chars().next()),
            Some('Z' | 'X')
        ),
        Err(_) => false,
    }
}

/// Waits until `dir` holds `n` pid files and returns the pids.
fn pids_in(dir: &Path, n: usize) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let pids: Vec<u32> = fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| fs::read_to_string(e.unwrap().path()).ok())
            .filter_map(|s| s.trim().parse().ok())
            .collect();
        if pids.len() == n {
            return pids;
        }
        assert!(
            Instant::now() < deadline,
            "workers never wrote {n} pid files"
        );
        thread::sleep(Duration::from_millis(10));
    }
}

/// Waits (bounded) until none of `pids` is alive.
fn assert_all_dead(pids: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|&p| alive(p)) {
        assert!(
            Instant::now() < deadline,
            "orphaned workers still alive: {:?}",
            pids.iter().filter(|&&p| alive(p)).collect::<Vec<_>>()
        );
        thread::sleep(Duration::from_millis(10));
    }
}

fn signal(child: &Child, signal: i32) {
    // SAFETY: kill only sends a signal, to a child we have not reaped.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, signal) }, 0);
}

/// Lines of `output` that worker `rank` printed, without the prefix.
fn lines_of(output: &str, rank: usize) -> Vec<String> {
    let prefix = format!("[rank{rank}]: ");
    output
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix).map(str::to_string))
        .collect()
}

#[test]
fn every_worker_gets_torchruns_variables() {
    let out = cohort()
        .args([
            "run",
            "--standalone",
            "-n",
            "3",
            "--max-restarts",
            "1",
            "--",
        ])
        .args([
            "sh",
            "-c",
            "echo $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK \
                $ROLE_RANK $MASTER_ADDR $MASTER_PORT $COHORT_RESTART_COUNT $COHORT_MAX_RESTARTS \
                $COHORT_STORE_HOSTED $COHORT_NUM_THREADS $OMP_NUM_THREADS \
                $COHORT_STORE_ADDR $COHORT_STORE_PORT $TORCHELASTIC_RUN_ID \
                $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS \
                $TORCHELASTIC_USE_AGENT_STORE ${TORCHELASTIC_ERROR_FILE:+error-file-set}",
        ])
        .env("OMP_NUM_THREADS", "7")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let cores = thread::available_parallelism().unwrap().get();
    let threads = (cores / 3).max(1);
    let mut ports = Vec::new();
    let mut run_ids = Vec::new();
    for rank in 0..3 {
        let lines = lines_of(&stdout, rank);
        assert_eq!(lines.len(), 1, "{stdout}");
        let v: Vec<&str> = lines[0].split(' ').collect();
        assert_eq!(
            [v[0], v[1], v[2], v[3], v[4], v[5], v[6]],
            [
                &*rank.to_string(),
                &*rank.to_string(),
                "3",
                "3",
                "0",
                &*rank.to_string(),
                "127.0.0.1"
            ]
        );
        let (master_port, store_port) =
            (v[7].parse::<u16>().unwrap(), v[14].parse::<u16>().unwrap());
        // A torch rank 0 binds MASTER_PORT itself: it must not be the launcher's store.
        assert_ne!(master_port, store_port, "{stdout}");
        ports.push((master_port, store_port));
        // Restart count, max restarts, store hosted, then the threads: ours, and the user's OMP.
        assert_eq!(&v[8..13], ["0", "1", "1", &*threads.to_string(), "7"]);
        assert_eq!(v[13], "127.0.0.1");
        run_ids.push(v[15].to_string());
        // torch's names: restarts after failures, the budget, rank 0 hosts its own store.
        assert_eq!(&v[16..], ["0", "1", "False", "error-file-set"], "{stdout}");
    }
    assert!(
        ports.iter().all(|&p| p == ports[0] && p.0 != 0),
        "{ports:?}"
    );
    assert!(run_ids.iter().all(|id| id == &run_ids[0] && !id.is_empty()));
    assert!(
        text(&out.stderr).contains("COHORT_NUM_THREADS"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn demo_workers_meet_in_the_store_the_launcher_hosts() {
    let out = run(&["run", "--standalone", "-n", "2", "demo", "--timeout", "20"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for rank in 0..2 {
        let lines = lines_of(&stdout, rank);
        assert_eq!(lines.len(), 1, "{stdout}");
        assert!(
            lines[0].starts_with(&format!("rank {rank}/2 (local {rank}/2, node 0)")),
            "{stdout}"
        );
        assert!(lines[0].contains("reached the store"), "{stdout}");
    }
}

#[test]
fn two_nodes_on_one_machine_form_one_job() {
    let port = free_port().to_string();
    let node = |rank: &str| {
        cohort()
            .args([
                "run",
                "--nnodes",
                "2",
                "--node-rank",
                rank,
                "--master-port",
                &port,
            ])
            .args(["-n", "2", "--join-timeout", "30", "demo", "--timeout", "20"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Node 1 first: it must wait for node 0's store rather than fail.
    let node1 = node("1");
    thread::sleep(Duration::from_millis(100));
    let node0 = node("0");
    let (out0, out1) = (
        node0.wait_with_output().unwrap(),
        node1.wait_with_output().unwrap(),
    );
    assert!(out0.status.success(), "node 0: {}", text(&out0.stderr));
    assert!(out1.status.success(), "node 1: {}", text(&out1.stderr));
    let (stdout0, stdout1) = (text(&out0.stdout), text(&out1.stdout));
    for (rank, stdout, local, node) in [
        (0, &stdout0, 0, 0),
        (1, &stdout0, 1, 0),
        (2, &stdout1, 0, 1),
        (3, &stdout1, 1, 1),
    ] {
        let lines = lines_of(stdout, rank);
        assert_eq!(lines.len(), 1, "rank {rank}: {stdout}");
        assert!(
            lines[0].starts_with(&format!("rank {rank}/4 (local {local}/2, node {node})")),
            "{}",
            lines[0]
        );
    }
}

#[test]
fn a_failure_on_one_node_stops_the_other() {
    let port = free_port().to_string();
    let node = |rank: &str| {
        cohort()
            .args([
                "run",
                "--nnodes",
                "2",
                "--node-rank",
                rank,
                "--master-port",
                &port,
                "-n",
                "2",
            ])
            .args(["--join-timeout", "30", "--"])
            .args([
                "sh",
                "-c",
                "if [ $RANK = 3 ]; then echo rank three gives up; exit 7; fi; exec sleep 30",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let started = Instant::now();
    let (node0, node1) = (node("0"), node("1"));
    let (out0, out1) = (
        node0.wait_with_output().unwrap(),
        node1.wait_with_output().unwrap(),
    );
    assert!(started.elapsed() < Duration::from_secs(20));
    let (err0, err1) = (text(&out0.stderr), text(&out1.stderr));
    assert_eq!(out1.status.code(), Some(1), "{err1}");
    assert!(
        err1.contains("rank 3") && err1.contains("exit code 7"),
        "{err1}"
    );
    assert!(err1.contains("[rank3]: rank three gives up"), "{err1}");
    assert_eq!(out0.status.code(), Some(1), "{err0}");
    // Node 0 either saw the failure while its workers ran, or (when rank 3
    // failed before node 0's round began) learns that the job already ended.
    assert!(
        (err0.contains("another node") && err0.contains("rank 3"))
            || err0.contains("the job ended before this node got to run"),
        "{err0}"
    );
}

#[test]
fn two_nodes_restart_together() {
    let port = free_port().to_string();
    let node = |rank: &str| {
        cohort()
            .args([
                "run",
                "--nnodes",
                "2",
                "--node-rank",
                rank,
                "--master-port",
                &port,
                "-n",
                "1",
            ])
            .args(["--max-restarts", "1", "--join-timeout", "30", "--"])
            .args([
                "sh",
                "-c",
                "echo attempt $COHORT_RESTART_COUNT; \
                    if [ $RANK = 1 ] && [ $COHORT_RESTART_COUNT = 0 ]; then exit 9; fi; \
                    if [ $RANK = 0 ] && [ $COHORT_RESTART_COUNT = 0 ]; then exec sleep 30; fi",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (node0, node1) = (node("0"), node("1"));
    let (out0, out1) = (
        node0.wait_with_output().unwrap(),
        node1.wait_with_output().unwrap(),
    );
    let (err0, err1) = (text(&out0.stderr), text(&out1.stderr));
    assert!(out0.status.success(), "node 0: {err0}");
    assert!(out1.status.success(), "node 1: {err1}");
    // Node 0's worker was healthy, yet it was stopped and rerun with node 1's.
    assert!(
        err0.contains("another node") && err0.contains("restart 1 of 1"),
        "{err0}"
    );
    assert_eq!(lines_of(&text(&out0.stdout), 0), ["attempt 0", "attempt 1"]);
    assert_eq!(lines_of(&text(&out1.stdout), 1), ["attempt 0", "attempt 1"]);
}

#[test]
fn a_failing_worker_stops_the_group_and_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let script = format!(
        "echo $$ > {d}/$RANK; \
         if [ $RANK = 1 ]; then \
           while [ $(ls {d} | wc -l) -lt 3 ]; do sleep 0.01; done; \
           echo rank one about to fail; exit 3; \
         fi; exec sleep 30",
        d = dir.path().display()
    );
    let started = Instant::now();
    let out = run(&["run", "--standalone", "-n", "3", "--", "sh", "-c", &script]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        stderr.contains("rank 1 (local rank 1 on node 0"),
        "{stderr}"
    );
    assert!(stderr.contains("exit code 3"), "{stderr}");
    assert!(
        stderr.contains("[rank1]: rank one about to fail"),
        "{stderr}"
    );
    assert_all_dead(&pids_in(dir.path(), 3));
}

#[test]
fn a_killed_worker_is_reported_by_signal() {
    let out = run(&[
        "run",
        "--standalone",
        "-n",
        "2",
        "--",
        "sh",
        "-c",
        "if [ $RANK = 0 ]; then kill -9 $$; fi; exec sleep 30",
    ]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("rank 0") && stderr.contains("signal 9 (SIGKILL)"),
        "{stderr}"
    );
}

#[test]
fn max_restarts_reruns_the_group_with_the_restart_count() {
    let script = "echo attempt $COHORT_RESTART_COUNT; [ $COHORT_RESTART_COUNT -ge 1 ] || exit 4";
    let out = run(&[
        "run",
        "--standalone",
        "-n",
        "2",
        "--max-restarts",
        "2",
        "--",
        "sh",
        "-c",
        script,
    ]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("restarting the workers (restart 1 of 2)"),
        "{stderr}"
    );
    let stdout = text(&out.stdout);
    assert!(
        lines_of(&stdout, 0).contains(&"attempt 1".to_string()),
        "{stdout}"
    );
    assert!(
        lines_of(&stdout, 1).contains(&"attempt 1".to_string()),
        "{stdout}"
    );
    assert!(!stdout.contains("attempt 2"), "{stdout}");

    // A worker that always fails uses up the restarts, then the launcher gives up.
    let out = run(&[
        "run",
        "--standalone",
        "-n",
        "1",
        "--max-restarts",
        "1",
        "--",
        "sh",
        "-c",
        "exit 4",
    ]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("giving up after 1 restarts"), "{stderr}");
}

#[test]
fn sigterm_to_the_launcher_stops_every_worker() {
    let dir = tempfile::tempdir().unwrap();
    // Rank 1 ignores SIGTERM (the disposition survives exec), so it takes the SIGKILL.
    let script = format!(
        "if [ $RANK = 1 ]; then trap '' TERM; fi; echo $$ > {}/$RANK; exec sleep 60",
        dir.path().display()
    );
    let launcher = cohort()
        .args([
            "run",
            "--standalone",
            "-n",
            "2",
            "--grace-period",
            "0.5",
            "--",
            "sh",
            "-c",
            &script,
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pids = pids_in(dir.path(), 2);
    signal(&launcher, libc::SIGTERM);
    let started = Instant::now();
    let out = launcher.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + libc::SIGTERM), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(stderr.contains("received SIGTERM"), "{stderr}");
    assert_all_dead(&pids);
}

#[test]
fn sigkill_of_the_launcher_leaves_no_orphan() {
    let dir = tempfile::tempdir().unwrap();
    let script = format!("echo $$ > {}/$RANK; exec sleep 60", dir.path().display());
    let mut launcher = cohort()
        .args(["run", "--standalone", "-n", "2", "--", "sh", "-c", &script])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pids = pids_in(dir.path(), 2);
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    assert_all_dead(&pids);
}

#[test]
fn a_port_in_use_is_an_error_naming_it() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let out = run(&["run", "--master-port", &port, "-n", "1", "--", "true"]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!("port {port}")) && stderr.contains("already in use"),
        "{stderr}"
    );
}

#[test]
fn a_bare_word_must_be_a_cohort_subcommand() {
    let out = run(&["run", "-n", "2", "python3", "train.py"]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("-- python3"), "{stderr}");
}

#[test]
fn lines_of_different_workers_never_mix() {
    // Each worker writes 500 lines of 3000 copies of its rank digit, as fast as it can.
    let script = "awk -v r=$RANK 'BEGIN { s = sprintf(\"%3000s\", \"\"); gsub(/ /, r, s); \
                  for (i = 0; i < 500; i++) print s }'";
    let out = run(&["run", "--standalone", "-n", "3", "--", "sh", "-c", script]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let mut counts = [0; 3];
    for line in stdout.lines() {
        let rank = (0..3)
            .find(|&r| line.starts_with(&format!("[rank{r}]: ")))
            .unwrap_or_else(|| panic!("line without a rank prefix: {:.80}", line));
        let body = &line[9..];
        assert_eq!(body.len(), 3000);
        assert!(
            body.bytes().all(|b| b == b'0' + rank as u8),
            "mixed line: {:.80}",
            line
        );
        counts[rank] += 1;
    }
    assert_eq!(counts, [500; 3]);
}

/// A worker that writes its cause to stderr and exits at once still has that line in the
/// launcher's failure summary: the summary waits for the worker's output to be drained.
#[test]
fn the_failure_summary_keeps_a_last_line_written_just_before_exit() {
    for attempt in 0..5 {
        let out = run(&[
            "run",
            "--standalone",
            "-n",
            "2",
            "--",
            "sh",
            "-c",
            "echo \"the cause, rank $RANK\" >&2; exit 3",
        ]);
        assert!(!out.status.success());
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains("failed with exit code 3")
                && stderr
                    .lines()
                    .any(|l| l.starts_with("cohort run:   [rank") && l.contains("the cause, rank")),
            "attempt {attempt}: {stderr}"
        );
    }
}

/// r43: a multi-node torchrun command line runs unchanged: c10d rendezvous at
/// `--rdzv-endpoint` with no `--node-rank` (the node that hosts the endpoint is node 0, the
/// other numbers itself), and torchrun's flags that do not apply are taken with a note.
#[test]
fn a_torchrun_command_line_with_c10d_rendezvous_runs_unchanged() {
    let endpoint = format!("127.0.0.1:{}", free_port());
    let node = || {
        cohort()
            .args(["run", "--nnodes", "2", "--nproc-per-node", "2"])
            .args(["--rdzv-id", "456", "--rdzv-backend", "c10d"])
            .args(["--rdzv-endpoint", &endpoint])
            .args(["--no-python", "--log-dir", "logs", "--redirects", "3"])
            .args(["--tee", "3", "--local-addr", "127.0.0.1"])
            .args(["--monitor-interval", "0.1", "--role", "trainer"])
            .args(["--join-timeout", "30", "demo", "--timeout", "20"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let first = node();
    thread::sleep(Duration::from_millis(300));
    let second = node();
    let (out0, out1) = (
        first.wait_with_output().unwrap(),
        second.wait_with_output().unwrap(),
    );
    let (err0, err1) = (text(&out0.stderr), text(&out1.stderr));
    assert!(out0.status.success(), "first: {err0}");
    assert!(out1.status.success(), "second: {err1}");
    assert!(err0.contains("this is node 0"), "{err0}");
    assert!(err1.contains("this is node 1"), "{err1}");
    for note in [
        "--rdzv-id 456",
        "--no-python",
        "--log-dir",
        "--role trainer",
    ] {
        assert!(err0.contains(note), "{note:?} in {err0}");
    }
    let stdout = text(&out0.stdout) + &text(&out1.stdout);
    for rank in 0..4 {
        assert_eq!(lines_of(&stdout, rank).len(), 1, "rank {rank}: {stdout}");
    }

    let bad = run(&["run", "--rdzv-backend", "etcd", "demo"]);
    assert!(!bad.status.success());
    assert!(
        text(&bad.stderr).contains("--rdzv-backend etcd"),
        "{}",
        text(&bad.stderr)
    );
}

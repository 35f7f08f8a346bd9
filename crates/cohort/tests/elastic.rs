//! The elastic launcher end to end: real launchers, real workers
//! killed, stopped and lost, real checkpoints, and a flood of strangers at
//! the store's port while it all happens. Training runs use a tiny model, so
//! each takes a second or two; nodes are network namespaces where the
//! machine allows (root, `ip`), loopback otherwise.

mod support;

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use support::{
    checkpoint_files, checkpoint_step, cohort, free_port, kill, params, wait_for_checkpoint,
    worker_pid, Nodes, Proc, SECRET, TINY,
};

const STEPS: &str = "200";

/// `train` with checkpoints every 5 steps and a log line at each, so the
/// loss windows of a resumed run line up with an uninterrupted one's.
fn train_args(out: &Path) -> Vec<String> {
    let mut args: Vec<String> = [
        "train",
        "--steps",
        STEPS,
        "--batch-size",
        "2",
        "--save-interval",
        "5",
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

/// The last `[step N / N] loss = X` that rank 0 logged.
fn final_loss(output: &str) -> String {
    let done = format!("[step {STEPS} / {STEPS}] loss = ");
    output
        .lines()
        .find_map(|l| {
            l.split_once(&done)
                .map(|(_, rest)| rest.split(' ').next().unwrap())
        })
        .unwrap_or_else(|| panic!("no final loss in:\n{output}"))
        .to_string()
}

/// The uninterrupted 2-rank run the interrupted ones must reproduce.
struct Baseline {
    /// The final logged loss.
    loss: String,
    /// The final parameters.
    params: Vec<f32>,
    /// The final checkpoint's files, by name, with their bytes.
    files: Vec<(String, Vec<u8>)>,
}

fn baseline() -> &'static Baseline {
    static BASELINE: OnceLock<Baseline> = OnceLock::new();
    BASELINE.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let mut cmd = cohort();
        cmd.args(["run", "--standalone", "-n", "2"])
            .args(train_args(tmp.path()));
        let (status, out) = Proc::spawn(cmd).finish(Duration::from_secs(120));
        assert!(status.success(), "{out}");
        Baseline {
            loss: final_loss(&out),
            params: params(tmp.path()),
            files: checkpoint_files(&tmp.path().join(format!("step-000{STEPS}"))),
        }
    })
}

/// `cohort run --standalone -n 2 --max-restarts 1 train ...`, started.
fn restartable_run(out: &Path, timeout: Option<&str>) -> Proc {
    restartable_run_with(out, timeout, &[])
}

/// [`restartable_run`] with more launcher flags.
fn restartable_run_with(out: &Path, timeout: Option<&str>, launcher: &[&str]) -> Proc {
    let mut cmd = cohort();
    cmd.args(["run", "--standalone", "-n", "2", "--max-restarts", "1"])
        .args(["--grace-period", "1"])
        .args(launcher)
        .args(train_args(out));
    if let Some(t) = timeout {
        cmd.env("COHORT_TIMEOUT", t);
    }
    Proc::spawn(cmd)
}

fn assert_resumed_like_the_baseline(out: &str, dir: &Path) {
    assert!(
        out.contains("[rank0]: restart 1 of this job: resuming from"),
        "{out}"
    );
    let resumed_at: u64 = out
        .lines()
        .find_map(|l| {
            l.split_once(" at step ")
                .filter(|_| l.contains("resumed from"))
        })
        .and_then(|(_, step)| step.trim().parse().ok())
        .unwrap_or_else(|| panic!("no resume line in:\n{out}"));
    assert!(
        resumed_at > 0 && resumed_at < 200 && resumed_at.is_multiple_of(5),
        "{out}"
    );
    let Baseline {
        loss,
        params: final_params,
        ..
    } = baseline();
    assert_eq!(&final_loss(out), loss, "final loss vs uninterrupted run");
    assert!(
        params(dir) == *final_params,
        "the resumed run's parameters differ from the uninterrupted run's"
    );
    assert_eq!(checkpoint_step(dir), Some(200));
    // The run log shows the restart as a marker at the step it resumed from, and every
    // logged step once although the steps after that checkpoint were trained twice.
    let metrics = std::fs::read_to_string(dir.join("logs/metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let marker = lines.iter().find(|l| l["restart"] == 1);
    assert_eq!(
        marker.map(|l| l["step"].clone()),
        Some(resumed_at.into()),
        "{metrics}"
    );
    let trained: Vec<u64> = lines
        .iter()
        .filter(|l| l.get("train_loss").is_some())
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert!(trained.windows(2).all(|w| w[0] < w[1]), "{trained:?}");
    assert_eq!(trained.last(), Some(&200), "{trained:?}");
}

#[test]
fn a_killed_worker_restarts_the_group_which_resumes_to_the_same_loss() {
    baseline();
    let tmp = tempfile::tempdir().unwrap();
    let run = restartable_run(tmp.path(), None);
    wait_for_checkpoint(tmp.path(), &run);
    kill(worker_pid(run.pid, 1), libc::SIGKILL);
    let (status, out) = run.finish(Duration::from_secs(120));
    assert!(status.success(), "{out}");
    assert!(
        out.contains("rank 1 (local rank 1 on node 0") && out.contains("signal 9 (SIGKILL)"),
        "{out}"
    );
    assert!(
        out.contains("restarting the workers (restart 1 of 1)"),
        "{out}"
    );
    assert_resumed_like_the_baseline(&out, tmp.path());
}

#[test]
fn a_stopped_worker_times_out_by_name_and_the_group_restarts() {
    baseline();
    let tmp = tempfile::tempdir().unwrap();
    let run = restartable_run(tmp.path(), Some("3s"));
    let (out, _) = stop_rank_1_and_finish(run, tmp.path());
    // Rank 0 gave up on rank 1 by name; the launcher stopped the group (the
    // stopped rank 1 included) and restarted it.
    assert!(out.contains("no progress with rank 1 within 3s"), "{out}");
    assert!(out.contains("rank 0 (local rank 0 on node 0"), "{out}");
}

/// Stops rank 1 with SIGSTOP after the first checkpoint and waits for the run: it must
/// succeed, having restarted the group once, killed the stopped worker and resumed like the
/// baseline. Returns the output and the stopped worker's pid.
fn stop_rank_1_and_finish(run: Proc, dir: &Path) -> (String, u32) {
    wait_for_checkpoint(dir, &run);
    let stopped = worker_pid(run.pid, 1);
    kill(stopped, libc::SIGSTOP);
    let (status, out) = run.finish(Duration::from_secs(120));
    assert!(status.success(), "{out}");
    assert!(
        out.contains("restarting the workers (restart 1 of 1)"),
        "{out}"
    );
    assert!(
        !Path::new(&format!("/proc/{stopped}")).exists(),
        "the stopped worker outlived its group"
    );
    assert_resumed_like_the_baseline(&out, dir);
    (out, stopped)
}

/// With the collectives' default timeout (minutes), a frozen worker is found by its missing
/// heartbeat within --worker-timeout, named with its pid, and the group restarts and resumes.
#[test]
fn a_stopped_worker_is_found_by_its_missing_heartbeat_and_the_group_restarts() {
    baseline();
    let tmp = tempfile::tempdir().unwrap();
    let run = restartable_run_with(tmp.path(), None, &["--worker-timeout", "3"]);
    let (out, stopped) = stop_rank_1_and_finish(run, tmp.path());
    assert!(
        out.contains(&format!(
            "rank 1 (local rank 1 on node 0, pid {stopped}) failed with no heartbeat for 3 s"
        )),
        "{out}"
    );
    assert!(!out.contains("no progress with rank"), "{out}");
    // Before stopping the group, the launcher read the rings the ranks last published.
    assert!(
        out.contains("cohort run: flight recorder (group default): "),
        "{out}"
    );
}

/// Raises this process's soft limit on open files to `want` (or its hard
/// limit, if lower); returns the soft limit now in force.
fn raise_open_files(want: u64) -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit, which `limit` is.
    let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    assert_eq!(got, 0, "getrlimit");
    if limit.rlim_cur < want {
        limit.rlim_cur = want.min(limit.rlim_max);
        // SAFETY: setrlimit reads one rlimit, which `limit` is; a soft limit
        // at most the hard one is always allowed.
        let set = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
        assert_eq!(set, 0, "setrlimit");
    }
    limit.rlim_cur
}

/// Whether the other end of `s` has hung up on it (without waiting).
fn hung_up_now(s: &TcpStream) -> bool {
    let mut fd = libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: `fd` is one valid pollfd, exclusively borrowed for the call.
    let n = unsafe { libc::poll(&mut fd, 1, 0) };
    n > 0 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// Sends a crowd of strangers to `addr` until `stop`: `size` of them as fast
/// as the server takes them, then a hundred more every 300 ms. Each says
/// nothing, or (one in four) trickles the opening of a handshake a byte
/// every 300 ms, until the server hangs up on it. Counts in `opened` those
/// that connected.
fn crowd(addr: SocketAddr, size: usize, opened: &AtomicUsize, stop: &AtomicBool) {
    let mut strangers: Vec<TcpStream> = Vec::new();
    let mut tick = 0usize;
    while !stop.load(Ordering::SeqCst) {
        let more = if opened.load(Ordering::SeqCst) < size {
            size
        } else {
            100
        };
        for _ in 0..more {
            match TcpStream::connect_timeout(&addr, Duration::from_millis(100)) {
                Ok(s) => {
                    strangers.push(s);
                    opened.fetch_add(1, Ordering::SeqCst);
                }
                // Not up yet: try again next round.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => break,
                // Its backlog is full (the SYN was dropped): the next may get in.
                Err(_) => {}
            }
            if stop.load(Ordering::SeqCst) {
                return;
            }
        }
        let byte = b"COHAUTH1".get(tick).copied().unwrap_or(0);
        for s in strangers.iter_mut().step_by(4) {
            let _ = s.write(&[byte]);
        }
        tick += 1;
        strangers.retain(|s| !hung_up_now(s));
        thread::sleep(Duration::from_millis(300));
    }
}

/// A thousand slow or idle strangers crowd the store's port of a launcher
/// that may open only 1,024 files, before, during and after a worker is
/// killed mid-run: the job restarts, finishes, and its final checkpoint is
/// byte for byte an undisturbed run's. Without the store's cap on
/// strangers, the crowd alone would hold more descriptors than the launcher
/// may open, and its restarted workers could not get in; without the rate
/// limit, each stranger would be a line of log.
#[test]
fn a_crowd_at_the_door_and_a_killed_worker_leave_the_result_unchanged() {
    baseline();
    // The crowd's own sockets, and this test's pipes and files.
    let limit = raise_open_files(4096);
    let size = 1000.min(limit.saturating_sub(200) as usize);
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    // The launcher, and the workers it starts, may open 1,024 files.
    let mut cmd = std::process::Command::new("sh");
    support::clean(&mut cmd);
    cmd.args(["-c", "ulimit -n 1024 && exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_cohort"))
        .args(["run", "-n", "2", "--master-port", &port.to_string()])
        .args(["--max-restarts", "1", "--grace-period", "1"])
        .args(train_args(tmp.path()))
        .env("COHORT_SECRET", SECRET);
    let started = Instant::now();
    let run = Proc::spawn(cmd);
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicUsize::new(0));
    let crowd = {
        let (stop, opened) = (stop.clone(), opened.clone());
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        thread::spawn(move || crowd(addr, size, &opened, &stop))
    };
    // Rank 1 is held (and with it the job) until the whole crowd has come,
    // however long that takes on this machine, then killed.
    wait_for_checkpoint(tmp.path(), &run);
    let rank1 = worker_pid(run.pid, 1);
    kill(rank1, libc::SIGSTOP);
    let waited = Instant::now();
    while opened.load(Ordering::SeqCst) < size {
        assert!(
            waited.elapsed() < Duration::from_secs(60),
            "only {} strangers got in within 60 s",
            opened.load(Ordering::SeqCst)
        );
        thread::sleep(Duration::from_millis(5));
    }
    kill(rank1, libc::SIGKILL);
    let (status, out) = run.finish(Duration::from_secs(120));
    stop.store(true, Ordering::SeqCst);
    crowd.join().unwrap();
    let opened = opened.load(Ordering::SeqCst);
    assert!(status.success(), "{out}");
    assert!(
        out.contains("restarting the workers (restart 1 of 1)"),
        "{out}"
    );
    let Baseline { loss, files, .. } = baseline();
    assert_eq!(&final_loss(&out), loss, "final loss vs undisturbed run");
    let ours = checkpoint_files(&tmp.path().join(format!("step-000{STEPS}")));
    assert_eq!(
        ours.iter().map(|(name, _)| name).collect::<Vec<_>>(),
        files.iter().map(|(name, _)| name).collect::<Vec<_>>()
    );
    let differ: Vec<&String> = ours
        .iter()
        .zip(files)
        .filter(|((_, ours), (_, theirs))| ours != theirs)
        .map(|((name, _), _)| name)
        .collect();
    assert!(
        differ.is_empty(),
        "{differ:?} differ from the undisturbed run's"
    );
    // The refusals were summed up (the first at once, then one line per
    // 10 s, and the rest at the end), not logged one by one.
    let lines = out.matches("cohort-store server").count();
    let bound = 2 + started.elapsed().as_secs() / 10;
    assert!(
        (1..=bound as usize).contains(&lines),
        "{lines} lines from the store for {opened} strangers in {:?}:\n{out}",
        started.elapsed()
    );
    eprintln!(
        "{opened} strangers in {:.1} s, {lines} line(s) of refusals",
        started.elapsed().as_secs_f64()
    );
}

/// `cohort run --nnodes 1:2` on node `i` (an elastic agent with short
/// timeouts), training into `out`.
fn elastic_node(nodes: &Nodes, i: usize, port: u16, out: &Path) -> Proc {
    let mut cmd = nodes.cohort(i);
    cmd.args(["run", "--nnodes", "1:2", "--node-rank", &i.to_string()])
        .args(["--master-addr", &nodes.master_addr()])
        .args(["--master-port", &port.to_string()])
        .args(["--max-restarts", "2", "--grace-period", "1"])
        .args(["--heartbeat-timeout", "2", "--last-call-timeout", "2"])
        .args(["--join-timeout", "30", "-n", "1"])
        .args(train_args(out))
        .env("COHORT_SECRET", SECRET);
    Proc::spawn(cmd)
}

#[test]
fn a_killed_node_leaves_the_other_to_train_on_a_smaller_world() {
    let nodes = Nodes::new("a_killed_node_leaves_the_other_to_train_on_a_smaller_world");
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let node1 = elastic_node(&nodes, 1, port, tmp.path());
    let node0 = elastic_node(&nodes, 0, port, tmp.path());
    node0.wait_for("world size 2", Duration::from_secs(30));
    wait_for_checkpoint(tmp.path(), &node0);
    node1.signal(libc::SIGKILL);
    let (status, out) = node0.finish(Duration::from_secs(120));
    drop(node1);
    assert!(status.success(), "{out}");
    // Node 1's worker died with its launcher; node 0's lost its peer, and
    // the job went on alone with the global batch kept (2 x 1 rank x 2).
    assert!(
        out.contains("restarting the workers (restart 1 of 2)"),
        "{out}"
    );
    assert!(
        out.contains("round 1: 1 node(s) (node ranks [0]), world size 1"),
        "{out}"
    );
    assert!(
        out.contains(
            "[rank0]: world size 2 -> 1: grad_accum 1 -> 2 keeps the global batch of 4 sequences"
        ),
        "{out}"
    );
    assert!(
        out.contains("[rank0]: global batch: 4 sequences = 2 per rank x 1 ranks x 2 accumulation"),
        "{out}"
    );
    assert_eq!(checkpoint_step(tmp.path()), Some(200));
}

/// A worker that runs until the group has 2 nodes, printing its view.
const UNTIL_TWO_NODES: &str =
    "echo round $COHORT_RESTART_COUNT world $WORLD_SIZE group $GROUP_RANK; \
     if [ $WORLD_SIZE = 2 ]; then exit 0; fi; exec sleep 60";

fn sh_node(i: usize, port: u16, extra: &[&str], script: &str) -> Proc {
    let mut cmd = cohort();
    cmd.args(["run", "--nnodes", "1:2", "--node-rank", &i.to_string()])
        .args(["--master-port", &port.to_string()])
        .args(["--max-restarts", "1", "--grace-period", "1"])
        .args(["--join-timeout", "30"])
        .args(extra)
        .args(["--", "sh", "-c", script]);
    Proc::spawn(cmd)
}

#[test]
fn a_late_node_joins_at_a_regroup_and_the_agent_serves_its_health() {
    let port = free_port();
    let extra = [
        "--last-call-timeout",
        "0.3",
        "--heartbeat-timeout",
        "5",
        "--health-check-port",
        "0",
    ];
    let node0 = sh_node(0, port, &extra, UNTIL_TWO_NODES);
    node0.wait_for("[rank0]: round 0 world 1 group 0", Duration::from_secs(30));
    let health = node0
        .output()
        .lines()
        .find_map(|l| l.split_once("health check: http://0.0.0.0:"))
        .and_then(|(_, rest)| rest.split('/').next()?.parse::<u16>().ok())
        .expect("the health-check port");
    let answer = http_get(health, "/health");
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    assert!(
        answer.contains(
            "\"state\":\"running\",\"round\":0,\"restarts\":0,\"nodes\":1,\"world_size\":1"
        ),
        "{answer}"
    );

    let node1 = sh_node(1, port, &extra[..4], UNTIL_TWO_NODES);
    let (s0, out0) = node0.finish(Duration::from_secs(30));
    let (s1, out1) = node1.finish(Duration::from_secs(30));
    assert!(s0.success() && s1.success(), "{out0}\n{out1}");
    assert!(out0.contains("a node is waiting to join"), "{out0}");
    assert!(out0.contains("[rank0]: round 1 world 2 group 0"), "{out0}");
    assert!(out1.contains("round 0 runs without this node"), "{out1}");
    assert!(out1.contains("[rank1]: round 1 world 2 group 1"), "{out1}");
    // Regrouping is not a failure: no restart was used up.
    assert!(!out0.contains("restarting the workers (restart"), "{out0}");
}

fn http_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    answer
}

#[test]
fn a_silent_node_is_lost_after_the_heartbeat_timeout_and_the_job_goes_on() {
    let port = free_port();
    let extra = ["--last-call-timeout", "0.5", "--heartbeat-timeout", "1.5"];
    // Round 0 needs both nodes' workers; later rounds end at once.
    let script = "echo round $COHORT_RESTART_COUNT world $WORLD_SIZE; \
                  [ $COHORT_RESTART_COUNT -gt 0 ] || exec sleep 60";
    let node1 = sh_node(1, port, &extra, script);
    let node0 = sh_node(0, port, &extra, script);
    node0.wait_for("[rank0]: round 0 world 2", Duration::from_secs(30));
    node1.wait_for("[rank1]: round 0 world 2", Duration::from_secs(30));
    // A frozen agent: its worker lives on, but its heartbeat stops.
    node1.signal(libc::SIGSTOP);
    let stopped_at = std::time::Instant::now();
    node0.wait_for("node 1 lost: no heartbeat for", Duration::from_secs(20));
    let detected = stopped_at.elapsed();
    let (status, out) = node0.finish(Duration::from_secs(30));
    drop(node1);
    assert!(status.success(), "{out}");
    assert!(
        detected >= Duration::from_millis(1500) && detected < Duration::from_secs(6),
        "lost after {detected:?} with a 1.5 s timeout"
    );
    assert!(out.contains("[rank0]: round 1 world 1"), "{out}");
}

/// The ZeRO stages under a crash: rank 1 killed with SIGKILL after the first checkpoint (a
/// sharded one: each rank wrote its own shard, rank 0 the index), the launcher restarts the
/// group, each rank reads its shard of the checkpoint again, and the run ends where an unbroken
/// one does.
#[test]
fn a_killed_rank_of_a_sharded_run_resumes_to_the_unbroken_runs_parameters() {
    for strategy in ["zero1", "zero2", "zero3"] {
        let run = |dir: &Path, restartable: bool| {
            let mut cmd = cohort();
            cmd.args(["run", "--standalone", "-n", "2"]);
            if restartable {
                cmd.args(["--max-restarts", "1", "--grace-period", "1"]);
            }
            cmd.args(train_args(dir)).args(["--strategy", strategy]);
            Proc::spawn(cmd)
        };
        let (unbroken, crashed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (status, out) = run(unbroken.path(), false).finish(Duration::from_secs(120));
        assert!(status.success(), "{strategy}: {out}");

        let proc = run(crashed.path(), true);
        wait_for_checkpoint(crashed.path(), &proc);
        kill(worker_pid(proc.pid, 1), libc::SIGKILL);
        let (status, out) = proc.finish(Duration::from_secs(120));
        assert!(status.success(), "{strategy}: {out}");
        assert!(
            out.contains("signal 9 (SIGKILL)") && out.contains("restarting the workers"),
            "{strategy}: {out}"
        );
        let resumed_at: u64 = out
            .lines()
            .find_map(|l| l.split_once("[rank0]: resumed from "))
            .and_then(|(_, rest)| rest.rsplit_once(" at step "))
            .and_then(|(_, step)| step.trim().parse().ok())
            .unwrap_or_else(|| panic!("{strategy}: no resume line in:\n{out}"));
        assert!(resumed_at < 200, "{strategy}: resumed at {resumed_at}");
        let (a, b) = (params(unbroken.path()), params(crashed.path()));
        let max_diff = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(
            max_diff <= 1e-5,
            "{strategy}: parameters differ by {max_diff}"
        );
        assert_eq!(checkpoint_step(crashed.path()), Some(200));
        let latest = crashed.path().join("step-000200");
        let index = cohort_gpt::checkpoint::read_index(&latest).unwrap();
        assert_eq!(index.map(|i| i.world_size), Some(2), "{strategy}: sharded");
    }
}

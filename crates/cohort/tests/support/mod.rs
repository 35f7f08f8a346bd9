//! What the end-to-end tests of the `cohort` binary share: a clean command,
//! a tiny model, runs whose stdout must succeed, and for the multi-process
//! tests of the elastic launcher: launchers run as child processes whose output is collected while they run (so a
//! test can wait for a line), their workers found by rank, and "nodes" as
//! Linux network namespaces joined by a veth pair, each with its own IP.
//! Everything started here is killed and everything created is deleted when
//! its guard drops, also when a test fails.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// The `cohort` binary, without the variables a test's own environment may
/// carry from a launcher.
pub fn cohort() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cohort"));
    clean(&mut cmd);
    cmd
}

/// Removes from `cmd`'s environment what a launcher may have set in this test's.
pub fn clean(cmd: &mut Command) {
    for var in [
        "RANK",
        "WORLD_SIZE",
        "COHORT_NUM_THREADS",
        "OMP_NUM_THREADS",
        "COHORT_RESTART_COUNT",
        "COHORT_TIMEOUT",
        "COHORT_SECRET",
        "COHORT_INJECT_NAN",
        "COHORT_NODE_ID",
        "COHORT_LINK_GBITS",
        "COHORT_REDUCER_NICE",
        "TORCHELASTIC_HEALTH_CHECK_PORT",
    ] {
        cmd.env_remove(var);
    }
    // A test run under srun must not make every `cohort` it starts a task of
    // that Slurm step.
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("SLURM_") {
            cmd.env_remove(name);
        }
    }
}

/// The job secret the nodes of a multi-node test share (a multi-node job on
/// a network address needs one).
pub const SECRET: &str = "5ec12e75ec12e75ec12e75ec12e75ec12e75ec12e75ec12e75ec12e75ec12e7a";

/// Runs `cohort ARGS` to the end.
pub fn run(args: &[&str]) -> Output {
    cohort().args(args).output().expect("cohort runs")
}

/// The stdout of a run that must have succeeded (else both streams are shown).
pub fn succeeded(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A tiny model and corpus: a step takes a few milliseconds. Steps, warmup
/// and logging are each test's own.
pub const TINY: &[&str] = &[
    "--eval-interval",
    "0",
    "--eval-batches",
    "1",
    "--seq-len",
    "16",
    "--n-layers",
    "2",
    "--n-heads",
    "2",
    "--d-model",
    "32",
    "--d-ff",
    "64",
    "--markov-vocab",
    "16",
    "--train-sequences",
    "96",
    "--val-sequences",
    "16",
];

/// Steps and logging of a short run of a training strategy: a second or two.
pub const SHORT_RUN: &[&str] = &[
    "--steps",
    "12",
    "--warmup-steps",
    "1",
    "--log-interval",
    "4",
];

/// `cohort run --standalone -n N train --strategy STRATEGY`, a short run
/// of the tiny model, plus `extra`.
pub fn strategy_args<'a>(n: &'a str, strategy: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "run",
        "--standalone",
        "-n",
        n,
        "train",
        "--strategy",
        strategy,
    ];
    args.extend_from_slice(SHORT_RUN);
    args.extend_from_slice(TINY);
    args.extend_from_slice(extra);
    args
}

/// The final parameters of the run whose checkpoints are in `dir`.
pub fn params(dir: &Path) -> Vec<f32> {
    let (model, _) = cohort_gpt::checkpoint::load_model(dir).expect("a checkpoint");
    model.params().to_vec()
}

/// Runs `train` (a 12-step run, given extra flags) with a checkpoint at
/// step 6, then again resumed from that checkpoint, and checks that both
/// end with the same parameters, bitwise: the parameters, the optimizer
/// state, the learning rate, the dropout keys and the data position must
/// all carry over.
pub fn assert_resume_is_seamless(train: impl Fn(&[&str]) -> String) {
    let tmp = tempfile::tempdir().unwrap();
    let (whole, resumed) = (tmp.path().join("whole"), tmp.path().join("resumed"));
    train(&["--out", whole.to_str().unwrap(), "--save-interval", "6"]);
    let half = whole.join("step-000006");
    let out = train(&[
        "--resume",
        half.to_str().unwrap(),
        "--out",
        resumed.to_str().unwrap(),
    ]);
    assert!(out.contains("at step 6"), "{out}");
    assert!(out.contains("done: 12 steps"), "{out}");
    let (a, b) = (
        params(&whole.join("step-000012")),
        params(&resumed.join("step-000012")),
    );
    assert!(a == b, "the resumed run's parameters differ");
    assert_ne!(params(&half), a, "training after step 6 changed nothing");
}

/// Every file of checkpoint directory `dir`, by name, with its bytes.
pub fn checkpoint_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&path).unwrap())
        })
        .collect();
    files.sort();
    files
}

/// The step of the newest checkpoint in `dir`, if any.
pub fn checkpoint_step(dir: &Path) -> Option<u64> {
    let latest = std::fs::read_to_string(dir.join("latest")).ok()?;
    latest.trim().strip_prefix("step-")?.parse().ok()
}

/// Waits (bounded) until `dir` has a checkpoint.
pub fn wait_for_checkpoint(dir: &Path, proc: &Proc) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while checkpoint_step(dir).is_none() {
        assert!(
            Instant::now() < deadline,
            "no checkpoint in {} after 60 s; output:\n{}",
            dir.display(),
            proc.output()
        );
        thread::sleep(Duration::from_millis(2));
    }
}

/// A launcher (or any process) started by a test: killed with SIGKILL and
/// reaped when dropped unless it ended; its stdout and stderr are collected,
/// interleaved line by line, while it runs.
pub struct Proc {
    child: Option<Child>,
    pub pid: u32,
    out: Arc<Mutex<String>>,
    readers: Vec<thread::JoinHandle<()>>,
}

impl Proc {
    pub fn spawn(mut cmd: Command) -> Proc {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the process starts");
        let out = Arc::new(Mutex::new(String::new()));
        let readers = [
            Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ]
        .into_iter()
        .map(|pipe| {
            let out = out.clone();
            thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let mut out = out.lock().unwrap();
                    out.push_str(&line);
                    out.push('\n');
                }
            })
        })
        .collect();
        Proc {
            pid: child.id(),
            child: Some(child),
            out,
            readers,
        }
    }

    /// Everything it printed so far.
    pub fn output(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    /// Waits (bounded) until its output contains `text`.
    pub fn wait_for(&self, text: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.output().contains(text) {
            assert!(
                Instant::now() < deadline,
                "no {text:?} within {timeout:?}; output:\n{}",
                self.output()
            );
            thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn signal(&self, signal: i32) {
        // SAFETY: kill only sends a signal, to a child not yet reaped.
        unsafe {
            libc::kill(self.pid as libc::pid_t, signal);
        }
    }

    /// Waits (bounded) for it to exit; returns its status and all it printed.
    pub fn finish(mut self, timeout: Duration) -> (ExitStatus, String) {
        let mut child = self.child.take().unwrap();
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "pid {} still running after {timeout:?}; output:\n{}",
                    self.pid,
                    self.output()
                );
            }
            thread::sleep(Duration::from_millis(10));
        };
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
        (status, self.output())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The pid of the worker of `launcher` whose `RANK` is `rank`, waiting
/// (bounded) for it to exist.
pub fn worker_pid(launcher: u32, rank: usize) -> u32 {
    let want = format!("RANK={rank}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let parent = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit(')')
                        .next()?
                        .split_whitespace()
                        .nth(1)?
                        .parse()
                        .ok()
                });
            if parent != Some(launcher) {
                continue;
            }
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            if environ.split(|&b| b == 0).any(|v| v == want.as_bytes()) {
                return pid;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no worker of rank {rank} under pid {launcher}"
        );
        thread::sleep(Duration::from_millis(5));
    }
}

pub fn kill(pid: u32, signal: i32) {
    // SAFETY: kill only sends a signal.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, signal) }, 0);
}

/// Two network namespaces joined by a veth pair: node `i` lives in
/// `names[i]` with address `ips[i]`. Dropping it deletes both namespaces
/// (which deletes the veth pair with them); processes still inside must be
/// killed first (declare the `Netns` before the `Proc`s run in it).
pub struct Netns {
    names: Vec<String>,
    pub ips: [String; 2],
    /// Each node's end of the veth pair (its network interface).
    pub veths: [String; 2],
}

static NETNS_COUNT: AtomicUsize = AtomicUsize::new(0);

impl Netns {
    /// Makes the pair, or says why it cannot (not root, no `ip`, no
    /// permission to create namespaces in this container).
    pub fn pair() -> Result<Netns, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root".into());
        }
        let n = NETNS_COUNT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let tag = format!("{}x{n}", pid % 100_000);
        let names = [format!("cohort-{tag}-0"), format!("cohort-{tag}-1")];
        let veth = [format!("cv{tag}a"), format!("cv{tag}b")];
        // A subnet per pair, so that pairs of parallel tests never meet.
        let subnet = format!("10.{}.{}", 200 + n % 50, pid % 250);
        let mut netns = Netns {
            names: Vec::new(),
            ips: [format!("{subnet}.1"), format!("{subnet}.2")],
            veths: veth.clone(),
        };
        for name in &names {
            ip(&["netns", "add", name])?;
            netns.names.push(name.clone());
        }
        ip(&[
            "link", "add", &veth[0], "type", "veth", "peer", "name", &veth[1],
        ])?;
        for i in 0..2 {
            if let Err(e) = ip(&["link", "set", &veth[i], "netns", &names[i]]) {
                let _ = ip(&["link", "del", &veth[i]]);
                return Err(e);
            }
        }
        for i in 0..2 {
            let addr = format!("{}/24", netns.ips[i]);
            ip(&["-n", &names[i], "addr", "add", &addr, "dev", &veth[i]])?;
            ip(&["-n", &names[i], "link", "set", &veth[i], "up"])?;
            ip(&["-n", &names[i], "link", "set", "lo", "up"])?;
        }
        Ok(netns)
    }

    /// `cohort ARGS` to run in node `i`'s namespace.
    pub fn cohort(&self, i: usize) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args([
            "netns",
            "exec",
            &self.names[i],
            env!("CARGO_BIN_EXE_cohort"),
        ]);
        clean(&mut cmd);
        cmd
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip` ({e})"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Two "nodes": namespaces where they can be made, else loopback, printing
/// which (a test that needs namespaces skips on `Err`).
pub enum Nodes {
    Namespaces(Netns),
    Loopback,
}

impl Nodes {
    pub fn new(test: &str) -> Nodes {
        match Netns::pair() {
            Ok(netns) => {
                eprintln!(
                    "{test}: nodes in network namespaces at {} and {}",
                    netns.ips[0], netns.ips[1]
                );
                Nodes::Namespaces(netns)
            }
            Err(why) => {
                eprintln!("{test}: network namespaces unavailable ({why}); both nodes on loopback");
                Nodes::Loopback
            }
        }
    }

    /// `cohort` on node `i`.
    pub fn cohort(&self, i: usize) -> Command {
        match self {
            Nodes::Namespaces(netns) => netns.cohort(i),
            Nodes::Loopback => cohort(),
        }
    }

    /// The address of node 0, as the other node reaches it.
    pub fn master_addr(&self) -> String {
        match self {
            Nodes::Namespaces(netns) => netns.ips[0].clone(),
            Nodes::Loopback => "127.0.0.1".into(),
        }
    }
}

/// Whether `python3` can import every module of `modules`; when not, says so for `test` with
/// the pip command that would make it run (the test then skips its Python part).
pub fn python_imports(test: &str, modules: &[&str], pip: &str) -> bool {
    let ok = Command::new("python3")
        .args(["-c", &format!("import {}", modules.join(", "))])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!(
            "{test}: skipping what needs {}: python3 cannot import it ({pip})",
            modules.join(" and ")
        );
    }
    ok
}

/// An HTTP/1.1 POST of JSON `body` to `addr` (one connection, closed after): the status and the
/// JSON answer.
pub fn post_json(addr: &str, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    use std::io::{Read, Write};
    let body = body.to_string();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: \
         application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_str(body).unwrap())
}

/// A `cohort serve` of a model repository on free loopback ports, killed when dropped.
pub struct Server {
    pub child: Child,
    /// Its HTTP address, `127.0.0.1:PORT`.
    pub http: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `cohort serve --model-repository repo` on free ports, one engine thread an instance,
/// and returns once it has printed where it listens.
pub fn serve(repo: &Path) -> Server {
    let mut child = cohort()
        .args(["serve", "--model-repository", repo.to_str().unwrap()])
        .args([
            "--address",
            "127.0.0.1",
            "--http-port",
            "0",
            "--grpc-port",
            "0",
        ])
        .args(["--metrics-port", "0", "--instance-threads", "1"])
        .env("COHORT_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    // "cohort serve: HTTP on 127.0.0.1:P, gRPC on ..."
    let http = line
        .split_whitespace()
        .find(|w| w.starts_with("127.0.0.1:"))
        .map(|w| w.trim_end_matches(',').to_string())
        .unwrap_or_else(|| panic!("unexpected first line of cohort serve: {line:?}"));
    Server { child, http }
}

//! The README's offline commands, run as written and in order, in a scratch directory: what a
//! newcomer types after `cargo build --release`. The lines are read from README.md itself (the
//! fenced block after the `readme-test` marker), so a README line that stops working, or one that
//! names a file no line before it makes, fails here. The scratch directory sees the checkout's
//! `docs/` and `configs/` as the checkout's root does; `cohort` is this build's binary on PATH.
//!
//! A line that needs what a fresh machine may lack is skipped with a message: `python3` with
//! torch, curl, or the server's ports 8000-8002 being taken. `CMD &` starts a background
//! server (the test waits for it to be ready) and `kill %1` stops it, as in a shell.

mod support;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::{clean, python_imports};

const MARKER: &str = "<!-- readme-test: offline, in order -->";

/// How long one line may run (a debug-profile binary on a loaded 2-core CI machine).
const LINE_LIMIT: Duration = Duration::from_secs(600);

fn checkout() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The commands of the marked block, each without its trailing `  # comment`.
fn readme_commands() -> Vec<String> {
    let readme = std::fs::read_to_string(checkout().join("README.md")).unwrap();
    let after = readme
        .split_once(MARKER)
        .unwrap_or_else(|| panic!("README.md has no {MARKER:?} line"))
        .1;
    let block = after
        .split_once("```sh\n")
        .expect("a ```sh block after the marker")
        .1;
    let block = block.split_once("```").expect("the block ends").0;
    block
        .lines()
        .map(|line| match line.find("  # ") {
            Some(at) => line[..at].trim_end(),
            None => line.trim_end(),
        })
        .filter(|line| !line.is_empty())
        .map(str::to_owned)
        .collect()
}

/// A scratch directory with the checkout's `docs` and `configs`, removed when dropped, and the
/// background server, killed when dropped (also when the test fails).
struct Scratch {
    dir: PathBuf,
    server: Option<Child>,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(mut server) = self.server.take() {
            let _ = server.kill();
            let _ = server.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Scratch {
    fn new() -> Scratch {
        let dir = std::env::temp_dir().join(format!("cohort-readme-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for shared in ["docs", "configs"] {
            std::os::unix::fs::symlink(checkout().join(shared), dir.join(shared)).unwrap();
        }
        Scratch { dir, server: None }
    }

    /// `bash -c LINE` in the scratch directory with this build's `cohort` first on PATH.
    fn shell(&self, line: &str) -> Command {
        let bin = Path::new(env!("CARGO_BIN_EXE_cohort")).parent().unwrap();
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut cmd = Command::new("bash");
        cmd.args(["-c", line])
            .current_dir(&self.dir)
            .env("PATH", path);
        clean(&mut cmd);
        cmd
    }

    /// Runs `line` to the end; panics naming it, with both streams, unless it exits 0.
    fn run(&self, line: &str) -> String {
        let out_path = self.dir.join(".line-output");
        let out = std::fs::File::create(&out_path).unwrap();
        let mut child = self
            .shell(line)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        let started = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > LINE_LIMIT {
                let _ = child.kill();
                panic!("README line ran over {LINE_LIMIT:?}: {line}");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let output = std::fs::read_to_string(&out_path).unwrap_or_default();
        eprintln!("readme: {:>5.1} s  {line}", started.elapsed().as_secs_f64());
        assert!(
            status.success(),
            "README line failed ({status}): {line}\n{output}"
        );
        output
    }

    /// Starts `line` (without its `&`) and waits until it answers Triton's readiness probe.
    fn start_server(&mut self, line: &str) {
        let log = std::fs::File::create(self.dir.join(".server-output")).unwrap();
        let child = self
            .shell(&format!("exec {line}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.server = Some(child);
        let started = Instant::now();
        while !ready("127.0.0.1:8000") {
            let exited = self.server.as_mut().unwrap().try_wait().unwrap();
            if exited.is_some() || started.elapsed() > Duration::from_secs(60) {
                panic!(
                    "README line did not bring up a ready server ({exited:?}): {line}\n{}",
                    std::fs::read_to_string(self.dir.join(".server-output")).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!(
            "readme: {:>5.1} s  {line} (ready)",
            started.elapsed().as_secs_f64()
        );
    }

    /// `kill %1`: SIGTERM to the server, which must finish and exit 0.
    fn stop_server(&mut self) {
        let mut server = self
            .server
            .take()
            .expect("`kill %1` with no server started");
        support::kill(server.id(), libc::SIGTERM);
        let started = Instant::now();
        let status = loop {
            if let Some(status) = server.try_wait().unwrap() {
                break status;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the server did not exit 30 s after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(
            status.success(),
            "the server exited {status} on SIGTERM:\n{}",
            std::fs::read_to_string(self.dir.join(".server-output")).unwrap_or_default()
        );
    }
}

/// Whether `GET /v2/health/ready` at `addr` answers 200.
fn ready(addr: &str) -> bool {
    let Ok(mut stream) = TcpStream::connect(addr) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let request =
        format!("GET /v2/health/ready HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.starts_with("HTTP/1.1 200")
}

fn ports_free(ports: &[u16]) -> bool {
    ports
        .iter()
        .all(|port| TcpListener::bind(("0.0.0.0", *port)).is_ok())
}

/// What a line's output must show, beyond its exit status, keyed by a piece of the line.
const EXPECT: [(&str, &str); 5] = [
    ("--resume ckpt --steps 600", "[step 600 / 600]"),
    ("cohort plot", "curves.png"),
    ("cohort sample", "1 2 3 "),
    ("curl", "\"choices\""),
    ("bench ddp", "\"efficiency\""),
];

#[test]
fn the_readmes_offline_commands_run_as_written_in_order() {
    let test = "the_readmes_offline_commands_run_as_written_in_order";
    let commands = readme_commands();
    assert!(commands.len() >= 10, "the README's block: {commands:?}");
    let torch = python_imports(test, &["torch"], "pip install torch");
    let curl = Command::new("curl").arg("--version").output().is_ok();
    let ports = ports_free(&[8000, 8001, 8002]);
    if !ports {
        eprintln!("{test}: skipping the server's lines: a port of 8000-8002 is taken");
    }
    let mut scratch = Scratch::new();
    for line in &commands {
        let skip = if line.contains("python3") && !torch {
            Some("python3 cannot import torch")
        } else if !ports && (line.ends_with('&') || line == "kill %1" || line.starts_with("curl")) {
            Some("the server's ports are taken")
        } else if line.starts_with("curl") && !curl {
            Some("curl is not installed")
        } else {
            None
        };
        if let Some(why) = skip {
            eprintln!("{test}: skipping `{line}`: {why}");
            continue;
        }
        if let Some(server) = line.strip_suffix('&') {
            scratch.start_server(server.trim_end());
            continue;
        }
        if line == "kill %1" {
            scratch.stop_server();
            continue;
        }
        let output = scratch.run(line);
        for (piece, expected) in EXPECT {
            if line.contains(piece) {
                assert!(
                    output.contains(expected),
                    "README line `{line}` printed no {expected:?}:\n{output}"
                );
            }
        }
    }
    assert!(scratch.dir.join("curves.png").is_file(), "no curves.png");
    assert!(
        scratch.server.is_none(),
        "the README leaves its server running"
    );
}

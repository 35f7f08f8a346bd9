//! torch.distributed programs under `cohort run`, unchanged: a real PyTorch
//! script (env:// with gloo, a DistributedSampler, all_reduce, DDP) must print
//! the same lines under `cohort run` (fixed port, `--standalone`, two nodes)
//! as under torchrun, and a worker's uncaught exception, recorded by torch's
//! `@record` in `TORCHELASTIC_ERROR_FILE`, must be what the launcher reports.
//! Skipped with a message where `torch` cannot be imported (CI installs it).

mod support;

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

use support::{cohort, free_port, Nodes, Proc, SECRET};

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/examples/torch_ddp.py")
}

/// Whether torch is importable; says why not when it is not.
fn have_torch(test: &str) -> bool {
    support::python_imports(test, &["torch.distributed"], "pip install torch")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The script's own lines ("rank R/W: ..."), without a launcher's
/// "[rankN]: " prefix, sorted: ranks print concurrently.
fn script_lines(stdout: &str) -> Vec<String> {
    let mut lines: Vec<String> = stdout
        .lines()
        .map(|line| match line.strip_prefix("[rank") {
            Some(rest) => rest.split_once("]: ").map_or(line, |(_, l)| l),
            None => line,
        })
        .filter(|line| line.starts_with("rank "))
        .map(str::to_string)
        .collect();
    lines.sort();
    lines
}

fn succeeded(what: &str, out: &Output) -> Vec<String> {
    assert!(
        out.status.success(),
        "{what}: exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    script_lines(&text(&out.stdout))
}

fn torchrun() -> Vec<String> {
    let out = Command::new("python3")
        .args([
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
        ])
        .arg(script())
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    let lines = succeeded("torchrun", &out);
    assert_eq!(lines.len(), 8, "two ranks, four lines each: {lines:#?}");
    lines
}

#[test]
fn a_torch_ddp_script_prints_under_cohort_run_what_it_prints_under_torchrun() {
    if !have_torch("a_torch_ddp_script_prints_under_cohort_run_what_it_prints_under_torchrun") {
        return;
    }
    let expected = torchrun();
    let port = free_port().to_string();
    for mode in [vec!["--master-port", port.as_str()], vec!["--standalone"]] {
        let out = cohort()
            .arg("run")
            .args(&mode)
            .args(["-n", "2", "--", "python3"])
            .arg(script())
            .output()
            .unwrap();
        assert_eq!(
            succeeded(&format!("cohort run {mode:?}"), &out),
            expected,
            "cohort run {mode:?}"
        );
    }
}

#[test]
fn a_torch_script_on_two_nodes_meets_at_the_first_nodes_master_port() {
    let test = "a_torch_script_on_two_nodes_meets_at_the_first_nodes_master_port";
    if !have_torch(test) {
        return;
    }
    let nodes = Nodes::new(test);
    let port = free_port().to_string();
    let node = |i: usize| {
        let mut cmd = nodes.cohort(i);
        cmd.args(["run", "--nnodes", "2", "--node-rank", &i.to_string()])
            .args([
                "--master-addr",
                &nodes.master_addr(),
                "--master-port",
                &port,
            ])
            .args(["--join-timeout", "30", "-n", "1", "--", "python3"])
            .arg(script())
            .env("COHORT_SECRET", SECRET);
        if let Nodes::Namespaces(netns) = &nodes {
            // Gloo advertises the address its hostname resolves to, loopback
            // in a namespace; a torchrun user sets this variable the same way.
            cmd.env("GLOO_SOCKET_IFNAME", &netns.veths[i]);
        }
        Proc::spawn(cmd)
    };
    let (node1, node0) = (node(1), node(0));
    let (s0, out0) = node0.finish(Duration::from_secs(120));
    let (s1, out1) = node1.finish(Duration::from_secs(120));
    assert!(s0.success(), "node 0:\n{out0}");
    assert!(s1.success(), "node 1:\n{out1}");
    let mut lines = script_lines(&out0);
    lines.extend(script_lines(&out1));
    lines.sort();
    // One rank per node is the same job as two ranks on one node, but for
    // the local rank and local world size torch reports.
    let expected: Vec<String> = torchrun()
        .into_iter()
        .map(|l| l.replace("local rank 1 of 2", "local rank 0 of 1"))
        .map(|l| l.replace("local rank 0 of 2", "local rank 0 of 1"))
        .collect();
    assert_eq!(lines, expected);
}

#[test]
fn a_torch_workers_recorded_exception_is_what_the_launcher_reports() {
    if !have_torch("a_torch_workers_recorded_exception_is_what_the_launcher_reports") {
        return;
    }
    let out = cohort()
        .args(["run", "--standalone", "-n", "2", "--", "python3"])
        .arg(script())
        .env("FAIL_ON_RANK", "1")
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("failed with exit code 1: ValueError: rank 1 was told to fail;"),
        "{stderr}"
    );
}

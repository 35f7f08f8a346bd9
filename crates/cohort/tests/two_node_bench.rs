//! `scripts/two-node-bench.sh --quick`: two network namespaces joined by an
//! HTB-shaped veth pair, cohort DDP, ZeRO-2 and DiLoCo (synchronous and
//! overlapped) one rank per namespace, and the table; then `--only zero2`,
//! its row alone. Skips with one line where namespaces cannot be made (not
//! root, no `ip` or `tc`, a container without the permission).

mod support;

use std::process::Command;

#[test]
fn the_two_node_bench_prints_its_table() {
    if let Err(why) = support::Netns::pair() {
        eprintln!("two-node bench skipped: network namespaces unavailable ({why})");
        return;
    }
    if Command::new("tc").arg("-V").output().is_err() {
        eprintln!("two-node bench skipped: no tc (iproute2)");
        return;
    }
    let Some((stdout, stderr)) = quick(&[]) else {
        return;
    };
    assert!(
        stdout.contains("| link | system | tokens/s | efficiency | against independent ranks | exposed comm per step |"),
        "{stdout}"
    );
    for row in [
        // The tiny model's gradients take well under 50 ms at 1 Gbit/s.
        "| 1gbit | cohort DDP, overlap on, fp32 gradients (auto) |",
        "| 1gbit | cohort ZeRO-2, overlap on, fp32 gradients (auto) |",
        "| 1gbit | cohort DiLoCo, H = 1 |",
        "| 1gbit | cohort DiLoCo, H = 1, overlapped |",
    ] {
        assert!(stdout.contains(row), "no row {row:?}:\n{stdout}\n{stderr}");
    }
    // The script deletes its namespaces on the way out.
    let names: Vec<&str> = (stderr.lines())
        .find_map(|l| l.strip_prefix("nodes: "))
        .and_then(|l| l.split(" at ").next())
        .map(|l| l.split_whitespace().collect())
        .unwrap_or_default();
    assert_eq!(names.len(), 2, "{stderr}");
    let left = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let listed = String::from_utf8_lossy(&left.stdout);
    for name in names {
        assert!(!listed.contains(name), "{name} left behind:\n{listed}");
    }
    // `--only` runs the systems named (and the baselines), no others.
    let Some((stdout, stderr)) = quick(&["--only", "zero2"]) else {
        return;
    };
    assert!(stderr.contains("two independent ranks at once"), "{stderr}");
    assert!(
        stdout.contains("| 1gbit | cohort ZeRO-2, overlap on, fp32 gradients (auto) |"),
        "{stdout}\n{stderr}"
    );
    for other in ["DDP", "DiLoCo"] {
        assert!(!stdout.contains(other), "{other} ran:\n{stdout}");
    }
}

/// `scripts/two-node-bench.sh --quick --no-torch` with `args`: its stdout
/// and stderr, or `None` (said why) where it skipped.
fn quick(args: &[&str]) -> Option<(String, String)> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/two-node-bench.sh"
    );
    let mut cmd = Command::new("bash");
    // PyTorch's rows are left to the full script: torchrun's start alone
    // is longer than this whole run.
    cmd.args([script, "--quick", "--no-torch"])
        .args(args)
        .args(["--cohort", env!("CARGO_BIN_EXE_cohort")]);
    support::clean(&mut cmd);
    let out = cmd.output().expect("bash runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    if out.status.code() == Some(2) {
        // The script says why in one line (a kernel without HTB, say).
        eprintln!(
            "two-node bench skipped: {}",
            stderr.trim().lines().last().unwrap_or("")
        );
        return None;
    }
    assert!(out.status.success(), "{stdout}\n{stderr}");
    Some((stdout, stderr))
}

//! Two nodes on one machine: each "node" a network namespace with
//! its own IP, joined to the other by a veth pair, each running `cohort run
//! --nnodes 2 --node-rank R --master-addr <node 0's IP>`. The job must train
//! to exactly the parameters of one node running the same total ranks. Where
//! namespaces cannot be made (not root, no `ip`, a container without the
//! permission) the nodes run on loopback instead, and the test says so.

mod support;

use std::time::Duration;

use support::{cohort, free_port, params, Nodes, Proc, SECRET, TINY};

fn train(out: &std::path::Path) -> Vec<String> {
    let mut args: Vec<String> = [
        "train",
        "--steps",
        "12",
        "--warmup-steps",
        "2",
        "--batch-size",
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

#[test]
fn two_nodes_in_network_namespaces_train_like_one_node() {
    let nodes = Nodes::new("two_nodes_in_network_namespaces_train_like_one_node");
    let tmp = tempfile::tempdir().unwrap();
    let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));

    let mut cmd = cohort();
    cmd.args(["run", "--standalone", "-n", "2"])
        .args(train(&one));
    let (status, out) = Proc::spawn(cmd).finish(Duration::from_secs(120));
    assert!(status.success(), "{out}");

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
            .args(["--join-timeout", "30", "-n", "1"])
            .args(train(&two))
            .env("COHORT_SECRET", SECRET);
        Proc::spawn(cmd)
    };
    let (node1, node0) = (node(1), node(0));
    let (s0, out0) = node0.finish(Duration::from_secs(120));
    let (s1, out1) = node1.finish(Duration::from_secs(120));
    assert!(s0.success(), "node 0:\n{out0}");
    assert!(s1.success(), "node 1:\n{out1}");
    assert!(
        out0.contains("[rank0]: global batch: 4 sequences = 2 per rank x 2 ranks"),
        "{out0}"
    );
    if let Nodes::Namespaces(netns) = &nodes {
        // Node 1's worker reached node 0 over the veth pair, from its own IP.
        assert_ne!(netns.ips[0], netns.ips[1]);
    }
    let (a, b) = (params(&one), params(&two));
    let max_diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(
        a == b,
        "two nodes vs one node with the same 2 ranks: max |diff| {max_diff}"
    );
}

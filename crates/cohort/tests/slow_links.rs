//! Issue 41's DDP changes through the launcher, real processes over real
//! sockets. The header states the gradient buckets, the last one (ready
//! only when backward ends) at most 1 MB where it can be cut. Gradients go
//! in bf16 by themselves when the ranks span "nodes" (two launchers on
//! loopback) and the link is slow (`COHORT_LINK_GBITS` stands in for the
//! timed all-reduce), in fp32 when it is fast or when every rank is on one
//! node, and an explicit flag wins. Two launchers of two ranks each reduce
//! hierarchically by themselves, and train as four ranks on one node do;
//! so do ZeRO-2's and ZeRO-3's reduce-scatters and all-gathers.
//! Where the engine takes every core, DDP's reducer thread runs a few nice
//! steps below it (`COHORT_REDUCER_NICE` overrides).

mod support;

use std::time::Duration;

use support::{cohort, free_port, params, run, succeeded, Proc, SECRET};

/// `train` of a model of 4 blocks of width 128 (0.79 MB of gradients per
/// block, 0.04 MB of embeddings), 4 steps, plus `extra`.
fn train(extra: &[&str]) -> Vec<String> {
    let args = [
        "train",
        "--steps",
        "4",
        "--warmup-steps",
        "1",
        "--log-interval",
        "2",
        "--eval-interval",
        "0",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--n-layers",
        "4",
        "--n-heads",
        "4",
        "--d-model",
        "128",
        "--d-ff",
        "512",
        "--markov-vocab",
        "16",
        "--train-sequences",
        "96",
        "--val-sequences",
        "16",
    ];
    args.iter().chain(extra).map(|s| s.to_string()).collect()
}

/// Two launchers of `n` ranks each on loopback, `env` in both; node 0's
/// output.
fn two_launchers(n: &str, env: &[(&str, &str)], extra: &[&str]) -> String {
    let port = free_port().to_string();
    let node = |i: usize| {
        let mut cmd = cohort();
        cmd.args(["run", "--nnodes", "2", "--node-rank", &i.to_string()])
            .args(["--master-addr", "127.0.0.1", "--master-port", &port])
            .args(["--join-timeout", "60", "-n", n])
            .args(train(extra))
            .env("COHORT_SECRET", SECRET)
            .envs(env.iter().copied());
        Proc::spawn(cmd)
    };
    let (node1, node0) = (node(1), node(0));
    let (s0, out0) = node0.finish(Duration::from_secs(180));
    let (s1, out1) = node1.finish(Duration::from_secs(180));
    assert!(s0.success(), "node 0:\n{out0}");
    assert!(s1.success(), "node 1:\n{out1}");
    out0
}

/// The header's line that starts with `what`, from rank 0.
fn line<'a>(out: &'a str, what: &str) -> &'a str {
    out.lines()
        .find(|l| l.contains(&format!("[rank0]: {what}")) || l.starts_with(what))
        .unwrap_or_else(|| panic!("no {what:?} line:\n{out}"))
}

#[test]
fn the_header_states_the_buckets_and_the_last_is_small() {
    let mut args = vec!["run", "--standalone", "-n", "2"];
    let t = train(&["--bucket-cap-mb", "25"]);
    args.extend(t.iter().map(String::as_str));
    let out = succeeded(&run(&args));
    // PyTorch's caps (1 MB first, then 25 MB), along the ranges backward
    // reports (each block's MLP half, 0.50 MB, then its attention half,
    // 0.25 MB): the head, block 3 and block 2's MLP close the first bucket
    // at 1.26 MB; the rest would be one 1.78 MB bucket, ready only when
    // backward ends, so it is cut at the highest boundary that leaves the
    // last under 1 MB: block 0 and the embeddings (0.77 MB).
    let model = line(&out, "model:");
    assert!(
        model.contains("DDP buckets: 3 in launch order of 1.26 + 1.01 + 0.77 MB (cap 25 MB"),
        "{model}"
    );
    // One node: fp32, and said why.
    let grads = line(&out, "gradients:");
    assert!(
        grads.contains("fp32 (auto: every rank on one node"),
        "{grads}"
    );
}

#[test]
fn gradients_go_in_bf16_by_themselves_across_a_slow_link_only() {
    // 3.2 MB of gradients: ~25 ms at 1 Gbit/s, ~2.5 s at 0.01.
    let slow = two_launchers("1", &[("COHORT_LINK_GBITS", "0.01")], &[]);
    let grads = line(&slow, "gradients:");
    assert!(
        grads.contains("gradients: bf16 (auto: the ranks span 2 nodes; COHORT_LINK_GBITS=0.01"),
        "{grads}"
    );
    let fast = two_launchers("1", &[("COHORT_LINK_GBITS", "100")], &[]);
    let grads = line(&fast, "gradients:");
    assert!(
        grads.contains("gradients: fp32 (auto: the ranks span 2 nodes"),
        "{grads}"
    );
    assert!(grads.contains("within 50 ms"), "{grads}");
    // The flag wins over the link.
    let forced = two_launchers(
        "1",
        &[("COHORT_LINK_GBITS", "0.01")],
        &["--bf16-compress", "false"],
    );
    let grads = line(&forced, "gradients:");
    assert!(
        grads.contains("gradients: fp32 (--bf16-compress false)"),
        "{grads}"
    );
    // Timed: a line either way, with what the probe measured.
    let timed = two_launchers("1", &[], &[]);
    let grads = line(&timed, "gradients:");
    assert!(grads.contains("a 4 MiB all-reduce took"), "{grads}");
}

/// Trains with `extra` (fp32 gradients) as four ranks of one launcher, then
/// as two launchers of two; checks that the first says nothing of
/// `hierarchical` and that both end with the same parameters to rounding
/// (the same gradients, summed in another order). Node 0's output of the
/// second.
fn one_node_and_two(extra: &[&str]) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
    let fp32 = ["--bf16-compress", "false", "--out"];
    let mut args = vec!["run", "--standalone", "-n", "4"];
    let mut flags = fp32.to_vec();
    flags.push(one.to_str().unwrap());
    flags.extend(extra);
    let t = train(&flags);
    args.extend(t.iter().map(String::as_str));
    let flat = succeeded(&run(&args));
    assert!(!flat.contains(": hierarchical"), "{flat}");

    let mut flags = fp32.to_vec();
    flags.push(two.to_str().unwrap());
    flags.extend(extra);
    let out = two_launchers("2", &[], &flags);
    let (a, b) = (params(&one), params(&two));
    let d = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(d < 1e-5, "{extra:?}: max |diff| {d}");
    out
}

#[test]
fn two_launchers_of_two_reduce_hierarchically_by_themselves() {
    let out = one_node_and_two(&[]);
    let hier = line(&out, "all-reduce:");
    assert!(
        hier.contains("all-reduce: hierarchical over 2 nodes of 2 + 2 ranks"),
        "{hier}"
    );
}

/// ZeRO-2's and ZeRO-3's reduce-scatters (each block's MLP apart from its
/// attention) and all-gathers go hierarchical by themselves across two
/// launchers of two, and the header says both.
#[test]
fn zero_on_two_launchers_of_two_reduce_scatters_hierarchically() {
    for (strategy, name) in [("zero2", "ZeRO-2: "), ("zero3", "ZeRO-3: ")] {
        let out = one_node_and_two(&["--strategy", strategy]);
        let hier = line(&out, "reduce-scatter and all-gather:");
        assert!(
            hier.contains("hierarchical over 2 nodes of 2 + 2 ranks"),
            "{hier}"
        );
        let model = line(&out, "model:");
        assert!(
            model.contains(name) && model.contains("10 reduce-scatters in launch order of"),
            "{model}"
        );
    }
}

#[test]
fn the_reducer_yields_where_the_engine_takes_every_core() {
    // The launcher gives each of n ranks cores / n threads: every core.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let n = cores.clamp(2, 4).to_string();
    let mut args = vec!["run", "--standalone", "-n", &n];
    let t = train(&["--overlap", "on"]);
    args.extend(t.iter().map(String::as_str));
    let out = succeeded(&run(&args));
    let model = line(&out, "model:");
    assert!(
        model.contains("overlap on, its thread 5 nice steps below backward's (no core free"),
        "{model}"
    );
    // COHORT_REDUCER_NICE overrides the budget.
    let out = cohort()
        .args(&args)
        .env("COHORT_REDUCER_NICE", "0")
        .output();
    let out = succeeded(&out.expect("cohort runs"));
    let model = line(&out, "model:");
    assert!(model.contains("overlap on)"), "{model}");
}

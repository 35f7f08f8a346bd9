//! Hierarchical reduce_scatter and all_gather against the flat ring, over
//! real processes: the test binary re-executes itself as the ranks
//! (`COHORT_TEST_ROLE`), each told its simulated node by `COHORT_NODE_ID`.
//! Placements: 2 nodes of 2 ranks; 3 nodes of 2 + 1 + 2 whose ranks are
//! not contiguous (a: 0, 2; b: 1; c: 3, 4); 2 nodes of 3 + 1 (the lone
//! rank stands for three peer groups). In each, every length (0 and uneven
//! ones), sum and avg, f32 and bf16: with integer inputs the sums are exact
//! in any order, so hierarchical equals flat bit for bit; with fractional
//! f32 inputs they agree to rounding. all_gather moves bytes only: equal.

use std::process::{Command, Stdio};

use cohort_comm::{
    bf16, init_process_group, Algorithm, CommError, Element, InitOptions, ProcessGroup, ReduceOp,
};

const ROLE: &str = "COHORT_TEST_ROLE";

fn main() {
    if let Ok(role) = std::env::var(ROLE) {
        let code = match child(&role) {
            Ok(()) => 0,
            Err(e) => {
                println!("ERROR: {e}");
                3
            }
        };
        std::process::exit(code);
    }
    let placements: [(&str, &[&str]); 3] = [
        ("two_nodes_of_two", &["a", "a", "b", "b"]),
        (
            "three_uneven_non_contiguous_nodes",
            &["a", "b", "a", "c", "c"],
        ),
        ("a_node_of_three_and_a_lone_rank", &["a", "a", "b", "a"]),
    ];
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    for (name, nodes) in placements {
        let name = format!("hierarchical_reduce_scatter_and_all_gather_equal_flat_on_{name}");
        if !filter.is_empty() && !filter.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        run(nodes);
        println!("test {name} ... ok");
    }
}

/// Runs the check on one process per entry of `nodes` (its node's name).
fn run(nodes: &[&str]) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let world = nodes.len();
    let children: Vec<_> = (nodes.iter().enumerate())
        .map(|(r, node)| {
            let local: Vec<usize> = (0..world).filter(|&q| nodes[q] == *node).collect();
            Command::new(std::env::current_exe().unwrap())
                .env(ROLE, "check")
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env(
                    "LOCAL_RANK",
                    local.iter().position(|&q| q == r).unwrap().to_string(),
                )
                .env("LOCAL_WORLD_SIZE", local.len().to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("COHORT_TIMEOUT", "60")
                .env("COHORT_NODE_ID", node)
                .env("COHORT_TEST_NODES", nodes.join(","))
                .env_remove("COHORT_STORE_HOSTED")
                .env_remove("COHORT_ALGO")
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (rank, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{nodes:?}, rank {rank}: {} {text}",
            out.status
        );
    }
}

fn child(role: &str) -> Result<(), Box<dyn std::error::Error>> {
    if role != "check" {
        return Err(format!("unknown role {role}").into());
    }
    let pg = init_process_group("tcp", "env://", InitOptions::default())?;
    // The node sizes, nodes ordered by their lowest rank.
    let names: Vec<String> = std::env::var("COHORT_TEST_NODES")?
        .split(',')
        .map(str::to_string)
        .collect();
    let mut order: Vec<&String> = Vec::new();
    for n in &names {
        if !order.contains(&n) {
            order.push(n);
        }
    }
    let sizes: Vec<usize> = (order.iter())
        .map(|o| names.iter().filter(|n| n == o).count())
        .collect();
    if pg.hierarchy() != Some(sizes.clone()) {
        return Err(format!("hierarchy {:?}, not {sizes:?}", pg.hierarchy()).into());
    }
    let (r, world) = (pg.rank(), pg.size());
    for chunk in [0usize, 1, 7, 1021, 65_537] {
        // Small integers: exact sums in f32 and bf16 whatever the order.
        let int = |i: usize| ((i * 7 + r * 13) % 9) as f32 - 4.0;
        let frac = |i: usize| ((i * 31 + r * 17) % 1000) as f32 * 1e-3 + 0.1;
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let what = format!("chunk {chunk} {op}");
            let ints: Vec<f32> = (0..chunk * world).map(int).collect();
            let (h, f) = both(&pg, &ints, |pg, x, out| pg.reduce_scatter(x, out, op))?;
            exact(&h, &f, &format!("{what} f32"))?;
            let ints: Vec<bf16> = ints.iter().map(|&v| bf16::from_f32(v)).collect();
            let (h, f) = both(&pg, &ints, |pg, x, out| pg.reduce_scatter(x, out, op))?;
            exact(&h, &f, &format!("{what} bf16"))?;
            let fracs: Vec<f32> = (0..chunk * world).map(frac).collect();
            let (h, f) = both(&pg, &fracs, |pg, x, out| pg.reduce_scatter(x, out, op))?;
            for (i, (a, b)) in h.iter().zip(&f).enumerate() {
                if (a - b).abs() > 1e-5 * b.abs().max(1.0) {
                    return Err(format!("{what} f32 at {i}: hierarchical {a} vs flat {b}").into());
                }
            }
        }
        let mine: Vec<f32> = (0..chunk).map(|i| (r * 1000 + i) as f32).collect();
        let (h, f) = gather_both(&pg, &mine, chunk * world)?;
        exact(&h, &f, &format!("all_gather chunk {chunk} f32"))?;
        let mine: Vec<bf16> = mine.iter().map(|&v| bf16::from_f32(v)).collect();
        let (h, f) = gather_both(&pg, &mine, chunk * world)?;
        exact(&h, &f, &format!("all_gather chunk {chunk} bf16"))?;
    }
    // Auto picks the hierarchical form: the closed form of a sum of ranks.
    pg.set_algorithm(Algorithm::Auto);
    let x = vec![r as i64 + 1; 3 * world];
    let mut out = vec![0i64; 3];
    pg.reduce_scatter(&x, &mut out, ReduceOp::Sum)?;
    let want = (world * (world + 1) / 2) as i64;
    if out.iter().any(|&v| v != want) {
        return Err(format!("auto reduce_scatter of int64: {out:?}, not {want}").into());
    }
    Ok(())
}

/// `x` reduce-scattered hierarchically, then flat (the ring).
fn both<T: Element + Default + Copy>(
    pg: &ProcessGroup,
    x: &[T],
    f: impl Fn(&ProcessGroup, &[T], &mut [T]) -> Result<(), CommError>,
) -> Result<(Vec<T>, Vec<T>), Box<dyn std::error::Error>> {
    let n = x.len() / pg.size();
    let (mut h, mut flat) = (vec![T::default(); n], vec![T::default(); n]);
    pg.set_algorithm(Algorithm::Hierarchical);
    f(pg, x, &mut h)?;
    pg.set_algorithm(Algorithm::Ring);
    f(pg, x, &mut flat)?;
    Ok((h, flat))
}

/// `mine` all-gathered into `len` elements hierarchically, then flat.
fn gather_both<T: Element + Default + Copy>(
    pg: &ProcessGroup,
    mine: &[T],
    len: usize,
) -> Result<(Vec<T>, Vec<T>), Box<dyn std::error::Error>> {
    let (mut h, mut flat) = (vec![T::default(); len], vec![T::default(); len]);
    pg.set_algorithm(Algorithm::Hierarchical);
    pg.all_gather(mine, &mut h)?;
    pg.set_algorithm(Algorithm::Ring);
    pg.all_gather(mine, &mut flat)?;
    Ok((h, flat))
}

fn exact<T: PartialEq + std::fmt::Debug>(h: &[T], f: &[T], what: &str) -> Result<(), String> {
    match h.iter().zip(f).position(|(a, b)| a != b) {
        None if h.len() == f.len() => Ok(()),
        Some(i) => Err(format!(
            "{what} at {i}: hierarchical {:?} vs flat {:?}",
            h[i], f[i]
        )),
        None => Err(format!("{what}: lengths {} vs {}", h.len(), f.len())),
    }
}

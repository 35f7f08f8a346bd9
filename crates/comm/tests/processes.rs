//! Real processes: the test binary re-executes itself as the ranks of a
//! scenario (`COHORT_TEST_ROLE` selects the child's part). A rank killed with
//! SIGKILL mid-collective makes every survivor fail fast naming it; groups
//! form through `env://` (store hosted by rank 0, or by the parent as a
//! launcher would), through `tcp://` and through `file://`; a missing
//! variable is named. Ranks on one host talk over shared memory by default,
//! over Unix sockets with `COHORT_TRANSPORT=unix` and over TCP with
//! `COHORT_TRANSPORT=tcp`: collectives and the killed-rank check run over
//! all three. Shared memory is an anonymous memfd, so nothing appears in
//! /dev/shm, during the run or after a SIGKILL. Two simulated nodes
//! (`COHORT_NODE_ID`) of two ranks each run the hierarchical all_reduce.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cohort_comm::spawn::{self, ProcessOptions};
use cohort_comm::{init_process_group, Algorithm, InitOptions, ReduceOp};

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
    let tests: [(&str, fn()); 13] = [
        ("killed_rank_fails_every_survivor_fast_over_shm", || {
            killed_rank_fails_every_survivor_fast("auto")
        }),
        ("killed_rank_fails_every_survivor_fast_over_unix", || {
            killed_rank_fails_every_survivor_fast("unix")
        }),
        ("killed_rank_fails_every_survivor_fast_over_tcp", || {
            killed_rank_fails_every_survivor_fast("tcp")
        }),
        ("collectives_over_shm", || collectives_over("shm")),
        ("collectives_over_unix_sockets", || collectives_over("unix")),
        ("collectives_over_forced_tcp", || collectives_over("tcp")),
        (
            "shm_is_memfd_and_leaves_nothing_after_exit_and_sigkill",
            shm_is_memfd_and_leaves_nothing_after_exit_and_sigkill,
        ),
        (
            "hierarchical_all_reduce_with_two_nodes_equals_flat",
            hierarchical_all_reduce_with_two_nodes_equals_flat,
        ),
        (
            "hierarchical_mismatch_inside_a_node_is_named",
            hierarchical_mismatch_inside_a_node_is_named,
        ),
        (
            "env_init_with_a_launcher_hosted_store",
            env_init_with_a_launcher_hosted_store,
        ),
        ("file_init", file_init),
        ("tcp_init", tcp_init),
        ("missing_env_var_is_named", missing_env_var_is_named),
    ];
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    for (name, t) in tests {
        if !filter.is_empty() && !filter.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        let t0 = Instant::now();
        t();
        println!("test {name} ... ok ({:.1} s)", t0.elapsed().as_secs_f64());
    }
}

// ------------------------------------------------------------------ children

fn env_usize(name: &str) -> usize {
    std::env::var(name).unwrap().parse().unwrap()
}

fn child(role: &str) -> Result<(), Box<dyn std::error::Error>> {
    match role {
        // Loops on 16 MB all_reduces until the group breaks.
        "allreduce_forever" => {
            let pg = init_process_group("tcp", "env://", InitOptions::default())?;
            let mut x = vec![1.0f32; 4 << 20];
            let mut i = 0u64;
            loop {
                pg.all_reduce(&mut x, ReduceOp::Avg)?;
                if i == 0 {
                    println!("ready {}", pg.backend_name());
                }
                i += 1;
            }
        }
        // Prints which shared memory it maps, then waits for the group to end.
        "shm_maps" => {
            let pg = init_process_group("tcp", "env://", InitOptions::default())?;
            pg.barrier()?;
            let maps = std::fs::read_to_string("/proc/self/maps")?;
            let memfds = maps
                .lines()
                .filter(|l| l.contains("memfd:cohort-shm"))
                .count();
            println!("memfds {memfds} backend {}", pg.backend_name());
            // The parent kills one rank; the others fail here.
            let mut x = vec![0u8; 1 << 20];
            loop {
                pg.all_reduce(&mut x, ReduceOp::Max)?;
            }
        }
        // Every op and several lengths with hierarchical and flat
        // all_reduce: identical results (COHORT_NODE_ID splits the ranks).
        "hierarchical_check" => {
            let pg = init_process_group("tcp", "env://", InitOptions::default())?;
            let (r, n) = (pg.rank(), pg.size());
            for len in [0usize, 1, 1021, 65_537, 1 << 20] {
                for op in [
                    ReduceOp::Sum,
                    ReduceOp::Avg,
                    ReduceOp::Max,
                    ReduceOp::Product,
                ] {
                    let x: Vec<f32> = (0..len)
                        .map(|i| [-1.0, 1.0, 2.0, 0.5][(r + i) % 4] * ((i % 5) as f32 + 1.0))
                        .collect();
                    let mut hier = x.clone();
                    pg.set_algorithm(Algorithm::Hierarchical);
                    pg.all_reduce(&mut hier, op)?;
                    let mut flat = x.clone();
                    pg.set_algorithm(Algorithm::Ring);
                    pg.all_reduce(&mut flat, op)?;
                    if hier != flat {
                        return Err(format!("len {len} {op}: hierarchical != flat").into());
                    }
                }
            }
            let mut x = vec![r as i64 + 1; 999];
            pg.set_algorithm(Algorithm::Auto);
            if pg.hierarchy() != Some(vec![2, 2]) {
                return Err(format!("hierarchy {:?}, not 2 nodes of 2", pg.hierarchy()).into());
            }
            pg.all_reduce(&mut x, ReduceOp::Sum)?;
            let want = (n * (n + 1) / 2) as i64;
            if x.iter().any(|&v| v != want) {
                return Err("auto all_reduce of int64 is wrong".into());
            }
            Ok(())
        }
        // Rank 3 calls with another length: its node's reduce names the mismatch.
        "hierarchical_mismatch" => {
            let pg = init_process_group("tcp", "env://", InitOptions::default())?;
            let mut x = vec![1.0f32; 100 + usize::from(pg.rank() == 3)];
            pg.all_reduce(&mut x, ReduceOp::Sum)?;
            Ok(())
        }
        "env_check" => {
            let pg = init_process_group("tcp", "env://", InitOptions::default())?;
            assert_eq!(
                (pg.rank(), pg.size()),
                (env_usize("RANK"), env_usize("WORLD_SIZE"))
            );
            assert_eq!(pg.local_rank(), env_usize("LOCAL_RANK"));
            let mut x = vec![pg.rank() as i64; 1000];
            pg.all_reduce(&mut x, ReduceOp::Sum)?;
            let n = pg.size() as i64;
            assert!(x.iter().all(|&v| v == n * (n - 1) / 2));
            pg.barrier()?;
            Ok(())
        }
        "tcp_check" => {
            let url = format!(
                "tcp://127.0.0.1:{}?world_size={}",
                std::env::var("MASTER_PORT")?,
                env_usize("WORLD_SIZE")
            );
            let opts = InitOptions {
                rank: Some(env_usize("RANK")),
                ..InitOptions::default()
            };
            let pg = init_process_group("gloo", &url, opts)?;
            let mut x = vec![pg.rank() as u8; 3];
            pg.broadcast(&mut x, 1)?;
            assert_eq!(x, [1, 1, 1]);
            Ok(())
        }
        "file_check" => {
            let path = std::env::var("COHORT_TEST_FILE")?;
            let opts = InitOptions {
                rank: Some(env_usize("RANK")),
                world_size: Some(env_usize("WORLD_SIZE")),
                ..InitOptions::default()
            };
            let pg = init_process_group("tcp", &format!("file://{path}"), opts)?;
            let mut x = vec![1.5f64; 77];
            pg.all_reduce(&mut x, ReduceOp::Sum)?;
            assert!(x.iter().all(|&v| v == 1.5 * pg.size() as f64));
            pg.barrier()?;
            Ok(())
        }
        // Every all_reduce algorithm at sizes around its segments, then
        // the other collectives, checked against closed forms.
        "collectives_check" => {
            let pg = init_process_group("tcp", "env://", InitOptions::default())?;
            let (r, n) = (pg.rank() as f32, pg.size() as f32);
            for len in [0usize, 1, 1021, 65_537, 300_007, 1 << 20] {
                let mut x: Vec<f32> = (0..len).map(|i| r + (i % 7) as f32).collect();
                pg.all_reduce(&mut x, ReduceOp::Sum)?;
                let sum_r = n * (n - 1.0) / 2.0;
                for (i, v) in x.iter().enumerate() {
                    assert_eq!(*v, sum_r + n * (i % 7) as f32, "len {len} at {i}");
                }
            }
            let mut b = vec![r; 100_003];
            pg.broadcast(&mut b, 1)?;
            assert!(b.iter().all(|&v| v == 1.0));
            let mut all = vec![0.0f32; 3 * pg.size()];
            pg.all_gather(&[r; 3], &mut all)?;
            for (i, v) in all.iter().enumerate() {
                assert_eq!(*v, (i / 3) as f32);
            }
            pg.barrier()?;
            Ok(())
        }
        "env_missing" => {
            init_process_group("tcp", "env://", InitOptions::default())?;
            Ok(())
        }
        other => Err(format!("unknown role {other}").into()),
    }
}

// ------------------------------------------------------------------- parents

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start(role: &str, rank: usize, world: usize, env: &[(&str, String)]) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .env(ROLE, role)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env_remove("COHORT_STORE_HOSTED")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Forwards each child's stdout lines, tagged with its rank.
fn watch(children: &mut [Child]) -> mpsc::Receiver<(usize, String)> {
    let (tx, rx) = mpsc::channel();
    for (rank, c) in children.iter_mut().enumerate() {
        let out = c.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send((rank, line));
            }
        });
    }
    rx
}

fn killed_rank_fails_every_survivor_fast(transport: &str) {
    let world = 3;
    let victim = 1;
    // A group timeout far longer than the test allows: only fail-fast passes.
    let env = [
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", free_port().to_string()),
        ("COHORT_TIMEOUT", "300".to_string()),
        ("COHORT_TRANSPORT", transport.to_string()),
    ];
    let mut children: Vec<Child> = (0..world)
        .map(|r| start("allreduce_forever", r, world, &env))
        .collect();
    let lines = watch(&mut children);
    let mut ready = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    let backend = if transport == "auto" { "shm" } else { "tcp" };
    while ready < world {
        let (rank, line) = lines
            .recv_timeout(deadline - Instant::now())
            .expect("ranks never got ready");
        assert_eq!(line, format!("ready {backend}"), "rank {rank}");
        ready += 1;
    }
    // Mid-collective: they loop back-to-back, so a 16 MB all_reduce is in flight.
    std::thread::sleep(Duration::from_millis(50));
    children[victim].kill().unwrap();
    let killed = Instant::now();
    children[victim].wait().unwrap();
    let mut errors = vec![String::new(); world];
    for (rank, c) in children
        .iter_mut()
        .enumerate()
        .filter(|(r, _)| *r != victim)
    {
        let status = loop {
            if let Some(s) = c.try_wait().unwrap() {
                break s;
            }
            assert!(
                killed.elapsed() < Duration::from_secs(20),
                "rank {rank} still running 20 s after rank {victim} died"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(status.code(), Some(3), "rank {rank}");
    }
    let took = killed.elapsed();
    while let Ok((rank, line)) = lines.recv_timeout(Duration::from_secs(2)) {
        if let Some(e) = line.strip_prefix("ERROR: ") {
            errors[rank] = e.to_string();
        }
    }
    for rank in (0..world).filter(|&r| r != victim) {
        let e = &errors[rank];
        assert!(e.contains("all_reduce #"), "rank {rank}: {e:?}");
        assert!(
            e.contains(&format!("rank {rank} (this process)")),
            "rank {rank}: {e:?}"
        );
        // Either its direct link to the victim broke, or a neighbour that
        // aborted closed on it and the victim is listed among the gone.
        let names_victim = e.contains(&format!("and rank {victim} lost"))
            || e.contains(&format!("closed their connections to this one: {victim}"));
        assert!(
            names_victim,
            "rank {rank} does not name rank {victim}: {e:?}"
        );
    }
    assert!(took < Duration::from_secs(10), "survivors took {took:?}");
}

fn env_init_with_a_launcher_hosted_store() {
    let opts = ProcessOptions {
        env: vec![(ROLE.into(), "env_check".into())],
        timeout: Duration::from_secs(60),
        ..ProcessOptions::current_exe(Vec::<String>::new()).unwrap()
    };
    spawn::processes(3, &opts).unwrap();
}

/// Starts `world` ranks of `role` and expects all of them to succeed.
fn all_succeed(role: &str, world: usize, env: &[(&str, String)]) {
    let mut children: Vec<Child> = (0..world).map(|r| start(role, r, world, env)).collect();
    for (rank, c) in children.iter_mut().enumerate() {
        let out = c.stdout.take().unwrap();
        let status = c.wait().unwrap();
        let text = std::io::read_to_string(out).unwrap();
        assert!(status.success(), "{role} rank {rank}: {status} {text}");
    }
}

fn collectives_over(transport: &str) {
    for world in [2, 3] {
        all_succeed(
            "collectives_check",
            world,
            &[
                ("MASTER_ADDR", "127.0.0.1".to_string()),
                ("MASTER_PORT", free_port().to_string()),
                ("COHORT_TRANSPORT", transport.to_string()),
            ],
        );
    }
}

fn file_init() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    all_succeed(
        "file_check",
        2,
        &[("COHORT_TEST_FILE", path.display().to_string())],
    );
}

fn tcp_init() {
    all_succeed("tcp_check", 3, &[("MASTER_PORT", free_port().to_string())]);
}

fn missing_env_var_is_named() {
    let mut c = start("env_missing", 0, 1, &[]);
    let out = c.stdout.take().unwrap();
    let status = c.wait().unwrap();
    let text = std::io::read_to_string(out).unwrap();
    assert_eq!(status.code(), Some(3));
    assert!(text.contains("MASTER_ADDR: not set"), "{text}");
}

/// Entries of /dev/shm (empty where it does not exist).
fn dev_shm() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn shm_is_memfd_and_leaves_nothing_after_exit_and_sigkill() {
    let before = dev_shm();
    let world = 3;
    let env = [
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", free_port().to_string()),
        ("COHORT_TIMEOUT", "300".to_string()),
    ];
    let mut children: Vec<Child> = (0..world)
        .map(|r| start("shm_maps", r, world, &env))
        .collect();
    let lines = watch(&mut children);
    for _ in 0..world {
        let (rank, line) = lines
            .recv_timeout(Duration::from_secs(60))
            .expect("ranks never reported their mappings");
        // Its own region and one per peer, all anonymous.
        assert_eq!(line, format!("memfds {world} backend shm"), "rank {rank}");
    }
    let created: Vec<String> = dev_shm()
        .into_iter()
        .filter(|e| !before.contains(e))
        .collect();
    assert!(created.is_empty(), "/dev/shm entries appeared: {created:?}");
    children[0].kill().unwrap();
    for c in &mut children {
        c.wait().unwrap();
    }
    let left: Vec<String> = dev_shm()
        .into_iter()
        .filter(|e| !before.contains(e))
        .collect();
    assert!(left.is_empty(), "/dev/shm entries left behind: {left:?}");
}

/// Ranks 0, 1 on node "a" and 2, 3 on node "b".
fn two_nodes_of_two(role: &str) -> Vec<Child> {
    let port = free_port().to_string();
    (0..4)
        .map(|r| {
            let node = if r < 2 { "a" } else { "b" };
            let env = [
                ("MASTER_ADDR", "127.0.0.1".to_string()),
                ("MASTER_PORT", port.clone()),
                ("COHORT_TIMEOUT", "60".to_string()),
                ("COHORT_NODE_ID", node.to_string()),
                ("LOCAL_RANK", (r % 2).to_string()),
                ("LOCAL_WORLD_SIZE", "2".to_string()),
            ];
            start(role, r, 4, &env)
        })
        .collect()
}

fn hierarchical_all_reduce_with_two_nodes_equals_flat() {
    for (rank, mut c) in two_nodes_of_two("hierarchical_check")
        .into_iter()
        .enumerate()
    {
        let out = c.stdout.take().unwrap();
        let status = c.wait().unwrap();
        let text = std::io::read_to_string(out).unwrap();
        assert!(status.success(), "rank {rank}: {status} {text}");
    }
}

fn hierarchical_mismatch_inside_a_node_is_named() {
    let mut children = two_nodes_of_two("hierarchical_mismatch");
    let mut errors = Vec::new();
    for c in &mut children {
        let out = c.stdout.take().unwrap();
        let status = c.wait().unwrap();
        assert_eq!(status.code(), Some(3));
        errors.push(std::io::read_to_string(out).unwrap());
    }
    // Node b's reduce (on its node mesh) is where the lengths meet.
    let named = errors.iter().any(|e| {
        e.contains("mismatched collectives on group \"default/node\"")
            && e.contains("reduce #0 of 100 x float32 (sum) with root 0")
            && e.contains("reduce #0 of 101 x float32 (sum) with root 0")
    });
    assert!(named, "{errors:#?}");
}

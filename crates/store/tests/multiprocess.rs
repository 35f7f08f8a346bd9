//! Stores shared by real processes: each test re-runs this test binary as
//! its ranks (`current_exe() --exact <test>` with the rank in the
//! environment), so the ranks are separate processes with their own
//! sockets, file descriptors and locks, as in a real job.
//!
//! Every rank adds to a shared counter, publishes a key, waits for every
//! other rank's key and races for a `compare_set` leadership; the totals
//! show whether any update was lost or applied twice across processes.

use std::fs::File;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use cohort_store::{FileStore, Store, TcpStore};

const WORLD: usize = 4;
/// `add`s per rank, enough for the ranks' updates to interleave.
const ADDS: usize = 200;
/// Generous: the machine running the suite may be busy compiling.
const TIMEOUT: Duration = Duration::from_secs(60);

/// Which test a child runs, its rank, and where its store is.
const ENV_TEST: &str = "COHORT_STORE_TEST";
const ENV_RANK: &str = "COHORT_STORE_TEST_RANK";
const ENV_WHERE: &str = "COHORT_STORE_TEST_WHERE";

/// The rank this process plays in `test`, if it is a child running it.
fn child_rank(test: &str) -> Option<usize> {
    if std::env::var(ENV_TEST).ok()? != test {
        return None;
    }
    Some(std::env::var(ENV_RANK).unwrap().parse().unwrap())
}

fn child_where() -> String {
    std::env::var(ENV_WHERE).unwrap()
}

/// Starts `WORLD` copies of this binary running `test` as ranks 0..WORLD,
/// their output going to files in `logs`.
fn spawn_ranks(test: &str, store_at: &str, logs: &Path) -> Vec<Child> {
    let exe = std::env::current_exe().unwrap();
    (0..WORLD)
        .map(|rank| {
            let log = File::create(logs.join(format!("{test}.{rank}.log"))).unwrap();
            Command::new(&exe)
                .args(["--exact", test, "--nocapture", "--test-threads=1"])
                .env(ENV_TEST, test)
                .env(ENV_RANK, rank.to_string())
                .env(ENV_WHERE, store_at)
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap()
        })
        .collect()
}

/// Waits for every rank (killing any still running after `TIMEOUT`) and
/// fails with the output of each rank that failed.
fn join_ranks(test: &str, mut children: Vec<Child>, logs: &Path) {
    let deadline = Instant::now() + TIMEOUT;
    let mut failures = Vec::new();
    for (rank, child) in children.iter_mut().enumerate() {
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status.to_string();
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                break format!("still running after {TIMEOUT:?}, killed");
            }
            thread::sleep(Duration::from_millis(10));
        };
        if status != "exit status: 0" {
            let log = std::fs::read_to_string(logs.join(format!("{test}.{rank}.log")));
            failures.push(format!(
                "rank {rank}: {status}\n{}",
                log.unwrap_or_default()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// What every rank does, whatever the store.
fn rank_body(store: &dyn Store, rank: usize) {
    for _ in 0..ADDS {
        store.add("counter", 1).unwrap();
    }
    let mine = format!("rank/{rank}");
    store
        .set(&mine, format!("hello from {rank}").as_bytes())
        .unwrap();
    let keys: Vec<String> = (0..WORLD).map(|r| format!("rank/{r}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    store.wait(&keys, TIMEOUT).unwrap();
    for (r, key) in keys.iter().enumerate() {
        assert_eq!(
            store.get(key).unwrap(),
            format!("hello from {r}").as_bytes()
        );
    }
    let claim = rank.to_string();
    let leader = store.compare_set("leader", b"", claim.as_bytes()).unwrap();
    let won = leader == claim.as_bytes();
    store.add("winners", i64::from(won)).unwrap();
    store.add("finished", 1).unwrap();
}

/// Checks, once every rank has finished, that no update was lost.
fn check_totals(store: &dyn Store) {
    assert_eq!(
        store.get("counter").unwrap(),
        (WORLD * ADDS).to_string().as_bytes()
    );
    assert_eq!(store.get("winners").unwrap(), b"1");
    let leader: usize = String::from_utf8(store.get("leader").unwrap())
        .unwrap()
        .parse()
        .unwrap();
    assert!(leader < WORLD);
    // counter, winners, leader and one key per rank.
    assert_eq!(store.num_keys().unwrap(), 3 + WORLD);
}

/// Rank 0 hosts the server in-process, as with `env://` initialisation, and
/// starts it late on purpose so the other ranks must retry their connection.
#[test]
fn tcp_store_across_processes() {
    const TEST: &str = "tcp_store_across_processes";
    if let Some(rank) = child_rank(TEST) {
        let addr = child_where();
        if rank == 0 {
            thread::sleep(Duration::from_millis(200));
        }
        let store = TcpStore::new_master_or_client(addr.as_str(), rank == 0, TIMEOUT).unwrap();
        rank_body(&store, rank);
        if rank == 0 {
            // The server lives in this process: keep it until every rank is
            // done, then check the totals on the others' behalf.
            let done: Vec<String> = (1..WORLD).map(|r| format!("done/{r}")).collect();
            let done: Vec<&str> = done.iter().map(String::as_str).collect();
            store.wait(&done, TIMEOUT).unwrap();
            assert_eq!(store.get("finished").unwrap(), WORLD.to_string().as_bytes());
            store.delete("finished").unwrap();
            for key in &done {
                store.delete(key).unwrap();
            }
            check_totals(&store);
        } else {
            store.set(&format!("done/{rank}"), b"").unwrap();
        }
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let logs = tempfile::tempdir().unwrap();
    let children = spawn_ranks(TEST, &format!("127.0.0.1:{port}"), logs.path());
    join_ranks(TEST, children, logs.path());
}

/// The parent keeps the file open throughout, checks the totals after the
/// ranks have exited, and sees the file removed with its last user.
#[test]
fn file_store_across_processes() {
    const TEST: &str = "file_store_across_processes";
    if let Some(rank) = child_rank(TEST) {
        let store = FileStore::new(child_where(), TIMEOUT).unwrap();
        rank_body(&store, rank);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let store = FileStore::new(&path, TIMEOUT).unwrap();
    let children = spawn_ranks(TEST, path.to_str().unwrap(), dir.path());
    join_ranks(TEST, children, dir.path());
    assert_eq!(store.get("finished").unwrap(), WORLD.to_string().as_bytes());
    store.delete("finished").unwrap();
    check_totals(&store);
    drop(store);
    assert!(
        !path.exists(),
        "the last user did not remove the store file"
    );
}

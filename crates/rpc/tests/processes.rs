//! RPC between real processes: the test binary re-executes itself as the
//! workers of each scenario (`COHORT_TEST_ROLE` selects the child's part),
//! with the store hosted here, as `cohort run` hosts it.
//!
//! - `calls_refs_and_errors`: three workers call each other at once (1000
//!   calls in flight from each), sync, async and as futures, nested calls,
//!   handler errors and panics, unknown functions, workers and types,
//!   timeouts; remote references passed between workers and freed on their
//!   owner (count back to zero) once every user has dropped them.
//! - `killed_worker_fails_pending_calls`: SIGKILL a worker while 50 calls to
//!   it are pending with a 60 s timeout: they all fail within seconds naming
//!   it, and the survivors' shutdown fails fast instead of hanging.
//! - `secret_keeps_strangers_out`: with COHORT_SECRET set, a stranger that
//!   connects without it or with another secret is refused (and logged)
//!   while the workers connect and work.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::task::{Context, Poll, Wake};
use std::time::{Duration, Instant};

use cohort_rpc::{init_rpc, CallContext, RRef, RRefId, Registry, Rpc, RpcError};
use cohort_store::auth::{authenticate_client, Secret};
use cohort_store::{Store, TcpStore, TcpStoreServer};

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
    let tests: [(&str, fn()); 3] = [
        ("calls_refs_and_errors", calls_refs_and_errors),
        (
            "killed_worker_fails_pending_calls",
            killed_worker_fails_pending_calls,
        ),
        ("secret_keeps_strangers_out", secret_keeps_strangers_out),
    ];
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let mut passed = 0;
    for (name, t) in tests {
        if !filter.is_empty() && !filter.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        let t0 = Instant::now();
        t();
        passed += 1;
        println!("test {name} ... ok ({:.1} s)", t0.elapsed().as_secs_f64());
    }
    println!("{passed} passed, 0 failed");
}

// ------------------------------------------------------------------ children

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn env_usize(name: &str) -> usize {
    std::env::var(name).unwrap().parse().unwrap()
}

/// Set on worker2 by rank 0 when it is done calling it (victim scenario).
static FINISHED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// References a worker was handed and keeps until told to drop them.
static HELD: Mutex<Vec<RRef<Vec<u32>>>> = Mutex::new(Vec::new());

fn registry() -> Registry {
    let mut r = Registry::new();
    r.register("add", |_, (a, b): (i64, i64)| Ok::<_, String>(a + b))
        .register("fail", |_, msg: String| Err::<(), _>(msg))
        .register("panic", |_, ()| -> Result<(), String> {
            panic!("deliberately")
        })
        .register("sleep_ms", |_, ms: u64| {
            std::thread::sleep(Duration::from_millis(ms));
            Ok::<_, String>(ms)
        })
        .register("whoami", |ctx: &CallContext, ()| {
            Ok::<_, String>(ctx.rpc().me().name.clone())
        })
        .register("caller", |ctx: &CallContext, ()| {
            Ok::<_, String>(ctx.caller().name.clone())
        })
        .register(
            "relay",
            |ctx: &CallContext, (to, a, b): (String, i64, i64)| {
                ctx.rpc().rpc_sync::<_, i64>(to, "add", (a, b))
            },
        )
        .register("make_vec", |_, n: u32| {
            Ok::<_, String>((0..n).collect::<Vec<u32>>())
        })
        .register("hold", |_, r: RRef<Vec<u32>>| {
            let len = r.to_here()?.len();
            HELD.lock().unwrap().push(r);
            Ok::<_, RpcError>(len)
        })
        .register("drop_held", |_, ()| {
            let n = HELD.lock().unwrap().drain(..).count();
            Ok::<_, String>(n)
        })
        .register("sum_rref", |_, r: RRef<Vec<u32>>| {
            Ok::<_, RpcError>(r.to_here()?.iter().map(|&x| x as u64).sum::<u64>())
        })
        .register("users", |ctx: &CallContext, id: RRefId| {
            Ok::<_, String>(ctx.rpc().rref_users(id))
        })
        .register("owned", |ctx: &CallContext, ()| {
            Ok::<_, String>(ctx.rpc().owned_rrefs())
        })
        .register("finish", |_, ()| {
            FINISHED.store(true, std::sync::atomic::Ordering::Release);
            Ok::<_, String>(())
        });
    r
}

fn join() -> Res<Rpc> {
    let rank = env_usize("RANK");
    Ok(init_rpc(
        &format!("worker{rank}"),
        rank,
        env_usize("WORLD_SIZE"),
        registry(),
    )?)
}

fn child(role: &str) -> Res<()> {
    match role {
        "basics" => basics(),
        "victim" => victim(),
        "pair" => {
            let rpc = join()?;
            let other = 1 - rpc.me().rank;
            let s: i64 = rpc.rpc_sync(other, "add", (40i64, 2i64))?;
            assert_eq!(s, 42);
            rpc.shutdown()?;
            Ok(())
        }
        other => Err(format!("unknown role {other}").into()),
    }
}

/// Polls `f` until it returns true or 10 s pass.
fn eventually(what: &str, mut f: impl FnMut() -> Res<bool>) -> Res<()> {
    let t0 = Instant::now();
    while !f()? {
        if t0.elapsed() > Duration::from_secs(10) {
            return Err(format!("{what}: not true after 10 s").into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// A minimal executor: polls a future on this thread, parking in between.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Arc::new(Unpark(std::thread::current())).into();
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(r) = f.as_mut().poll(&mut cx) {
            return r;
        }
        std::thread::park();
    }
}

fn basics() -> Res<()> {
    let rpc = join()?;
    let (me, n) = (rpc.me().rank, rpc.workers().len());

    // Every worker floods every worker (itself included) at once.
    let futs: Vec<_> = (0..1000i64)
        .map(|i| {
            (
                i,
                rpc.rpc_async::<_, i64>((i as usize) % n, "add", (i, me as i64)),
            )
        })
        .collect();
    for (i, f) in futs {
        assert_eq!(f.wait()?, i + me as i64);
    }
    let next = (me + 1) % n;
    let who: String = rpc.rpc_sync(next, "whoami", ())?;
    assert_eq!(who, format!("worker{next}"));
    let caller: String = rpc.rpc_sync(next, "caller", ())?;
    assert_eq!(caller, format!("worker{me}"));
    let viaf: i64 = block_on(rpc.rpc_async(next, "add", (5i64, 6i64)))?;
    assert_eq!(viaf, 11);

    if me == 0 {
        errors(&rpc)?;
        references(&rpc)?;
    }
    rpc.shutdown()?;
    Ok(())
}

fn errors(rpc: &Rpc) -> Res<()> {
    let e = rpc
        .rpc_sync::<_, ()>("worker1", "fail", "disk on fire".to_string())
        .unwrap_err();
    assert!(
        matches!(&e, RpcError::Handler { worker, func, message }
            if worker == "worker1" && func == "fail" && message == "disk on fire"),
        "{e}"
    );
    let e = rpc.rpc_sync::<_, ()>("worker2", "panic", ()).unwrap_err();
    assert!(e.to_string().contains("panicked: deliberately"), "{e}");
    let e = rpc.rpc_sync::<_, ()>("worker2", "nope", ()).unwrap_err();
    assert!(
        matches!(&e, RpcError::UnknownFunction { worker, registered, .. }
            if worker == "worker2" && registered.contains("add")),
        "{e}"
    );
    let e = rpc
        .rpc_sync::<_, String>("worker1", "add", (1i64, 2i64))
        .unwrap_err();
    assert!(matches!(e, RpcError::TypeMismatch { .. }), "{e}");
    assert!(e.to_string().contains("(i64, i64) -> i64"), "{e}");
    let e = rpc
        .rpc_sync::<_, i64>("worker9", "add", (1i64, 2i64))
        .unwrap_err();
    assert!(matches!(e, RpcError::UnknownWorker { .. }), "{e}");

    let t0 = Instant::now();
    let e = rpc
        .rpc_async_timeout::<_, u64>("worker1", "sleep_ms", 3000u64, Duration::from_millis(200))
        .wait()
        .unwrap_err();
    assert!(matches!(e, RpcError::Timeout { .. }), "{e}");
    assert!(
        t0.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t0.elapsed()
    );

    let relayed: i64 = rpc.rpc_sync("worker1", "relay", ("worker2".to_string(), 7i64, 8i64))?;
    assert_eq!(relayed, 15);
    Ok(())
}

fn references(rpc: &Rpc) -> Res<()> {
    let users = |id: RRefId| -> Res<Option<u64>> { Ok(rpc.rpc_sync("worker1", "users", id)?) };
    let owned_on = |w: &str| -> Res<usize> { Ok(rpc.rpc_sync(w, "owned", ())?) };

    // Owned by worker1, used here and by worker2.
    let rref = rpc.remote::<_, Vec<u32>>("worker1", "make_vec", 10u32)?;
    assert_eq!(rref.to_here()?, (0..10).collect::<Vec<u32>>());
    assert!(!rref.is_owner());
    assert_eq!(users(rref.id())?, Some(1));
    let len: usize = rpc.rpc_sync("worker2", "hold", rref.clone())?;
    assert_eq!(len, 10);
    assert_eq!(
        users(rref.id())?,
        Some(2),
        "this worker's fork and worker2's"
    );
    let id = rref.id();
    drop(rref);
    eventually("worker1 counts one user after this worker dropped", || {
        Ok(users(id)? == Some(1))
    })?;
    let dropped: usize = rpc.rpc_sync("worker2", "drop_held", ())?;
    assert_eq!(dropped, 1);
    eventually("worker1 frees the value", || Ok(users(id)?.is_none()))?;
    assert_eq!(owned_on("worker1")?, 0);

    // A failed creation shows in to_here, and frees nothing twice.
    let bad = rpc.remote::<_, ()>("worker1", "fail", "no value".to_string())?;
    let e = bad.to_here().unwrap_err();
    assert!(e.to_string().contains("no value"), "{e}");
    drop(bad);

    // Owned here, fetched by worker1 from here.
    let mine = rpc.remote::<_, Vec<u32>>(0usize, "make_vec", 5u32)?;
    let sum: u64 = rpc.rpc_sync("worker1", "sum_rref", mine.clone())?;
    assert_eq!(sum, 10);
    assert_eq!(*mine.local_value()?, vec![0, 1, 2, 3, 4]);
    drop(mine);
    eventually("this worker frees its own value", || {
        Ok(rpc.owned_rrefs() == 0)
    })?;
    eventually("worker1's failed value is freed", || {
        Ok(owned_on("worker1")? == 0)
    })?;
    Ok(())
}

/// Rank 0 keeps calls pending on worker1 until the parent kills it.
fn victim() -> Res<()> {
    let rpc = join()?;
    match rpc.me().rank {
        0 => {
            let _: u64 = rpc.rpc_sync("worker1", "sleep_ms", 1u64)?;
            let pending: Vec<_> = (0..50)
                .map(|_| rpc.rpc_async::<_, u64>("worker1", "sleep_ms", 60_000u64))
                .collect();
            println!("ready");
            std::io::stdout().flush()?;
            let t0 = Instant::now();
            for f in pending {
                let e = f.wait().unwrap_err();
                assert!(
                    matches!(&e, RpcError::WorkerGone { worker, .. } if worker == "worker1"),
                    "{e}"
                );
            }
            println!("failed after {} ms", t0.elapsed().as_millis());
            let e = rpc
                .rpc_sync::<_, u64>("worker1", "sleep_ms", 1u64)
                .unwrap_err();
            assert!(matches!(e, RpcError::WorkerGone { .. }), "{e}");
            let e = rpc.check_workers().unwrap_err();
            assert!(e.to_string().contains("worker1"), "{e}");
            let s: i64 = rpc.rpc_sync("worker2", "add", (1i64, 1i64))?;
            assert_eq!(s, 2, "the survivors still talk");
            rpc.rpc_sync::<_, ()>("worker2", "finish", ())?;
            shutdown_names_worker1(&rpc)
        }
        1 => {
            std::thread::sleep(Duration::from_secs(120));
            Err("worker1 was never killed".into())
        }
        _ => {
            eventually("rank 0 finishes with worker2", || {
                Ok(FINISHED.load(std::sync::atomic::Ordering::Acquire))
            })?;
            shutdown_names_worker1(&rpc)
        }
    }
}

fn shutdown_names_worker1(rpc: &Rpc) -> Res<()> {
    let e = rpc.shutdown().unwrap_err();
    assert!(
        matches!(&e, RpcError::WorkerGone { worker, .. } if worker == "worker1"),
        "{e}"
    );
    Ok(())
}

// ------------------------------------------------------------------- parents

/// Children killed when dropped, so a failing test leaves no orphans.
struct Workers(Vec<Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn start(role: &str, rank: usize, world: usize, port: u16, env: &[(&str, String)]) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .env(ROLE, role)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("COHORT_STORE_HOSTED", "1")
        .env_remove("COHORT_SECRET")
        .env_remove("COHORT_RESTART_COUNT")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for every child to exit, at most `limit`; returns each one's
/// exit code and output.
fn finish(workers: &mut Workers, limit: Duration) -> Vec<(Option<i32>, String)> {
    let t0 = Instant::now();
    let mut out = Vec::new();
    for (rank, c) in workers.0.iter_mut().enumerate() {
        let status = loop {
            if let Some(s) = c.try_wait().unwrap() {
                break s;
            }
            assert!(
                t0.elapsed() < limit,
                "rank {rank} still running after {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut text = String::new();
        if let Some(mut o) = c.stdout.take() {
            o.read_to_string(&mut text).unwrap();
        }
        if let Some(mut e) = c.stderr.take() {
            e.read_to_string(&mut text).unwrap();
        }
        out.push((status.code(), text));
    }
    out
}

fn calls_refs_and_errors() {
    let server = TcpStoreServer::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().port();
    let mut w = Workers((0..3).map(|r| start("basics", r, 3, port, &[])).collect());
    for (rank, (code, text)) in finish(&mut w, Duration::from_secs(60))
        .into_iter()
        .enumerate()
    {
        assert_eq!(code, Some(0), "rank {rank}: {text}");
    }
}

fn killed_worker_fails_pending_calls() {
    let server = TcpStoreServer::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().port();
    let mut w = Workers((0..3).map(|r| start("victim", r, 3, port, &[])).collect());
    let (tx, rx) = mpsc::channel();
    let out = w.0[0].stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let line = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("rank 0 never got ready");
    assert_eq!(line, "ready");
    w.0[1].kill().unwrap();
    let killed = Instant::now();
    let failed = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("rank 0's pending calls did not fail");
    assert!(failed.starts_with("failed after"), "{failed}");
    let results = finish(&mut w, Duration::from_secs(20));
    for rank in [0, 2] {
        let (code, text) = &results[rank];
        assert_eq!(
            *code,
            Some(0),
            "rank {rank}: {text} {:?}",
            rx.try_iter().collect::<Vec<_>>()
        );
    }
    assert!(
        killed.elapsed() < Duration::from_secs(15),
        "survivors took {:?} (timeout was 60 s)",
        killed.elapsed()
    );
}

fn secret_keeps_strangers_out() {
    let secret = Secret::generate().unwrap();
    let server = TcpStoreServer::bind_with_secret("127.0.0.1:0", Some(secret.clone())).unwrap();
    let port = server.local_addr().port();
    let env = [("COHORT_SECRET", secret.to_hex())];
    let mut w = Workers(vec![start("pair", 0, 2, port, &env)]);

    // Rank 0 is listening and waits for rank 1; strangers knock first.
    let store = TcpStore::connect_with_secret(
        format!("127.0.0.1:{port}"),
        Duration::from_secs(30),
        Some(secret),
    )
    .unwrap();
    let entry = store.get("rpc/worker/0").unwrap();
    let addr = String::from_utf8(entry).unwrap();
    let addr = addr.split_once('\n').unwrap().1.to_string();
    let refused = |mut s: TcpStream| {
        s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        let mut buf = [0u8; 64];
        // Closed without a byte of acceptance (or reset).
        assert!(matches!(s.read(&mut buf), Ok(0) | Err(_)));
    };
    let mut plain = TcpStream::connect(&addr).unwrap();
    plain
        .write_all(b"CRPC\x00\x01\x00\x00\x05\x00\x00\x00hello")
        .unwrap();
    refused(plain);
    let mut wrong = TcpStream::connect(&addr).unwrap();
    wrong
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    let other = Secret::generate().unwrap();
    assert!(authenticate_client(&mut wrong, &other, b"cohort-rpc").is_err());
    drop(wrong);

    w.0.push(start("pair", 1, 2, port, &env));
    let results = finish(&mut w, Duration::from_secs(30));
    for (rank, (code, text)) in results.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {rank}: {text}");
    }
    // Refusals are summed up (the first at once, the rest when the listener is done).
    let log = &results[0].1;
    let refused: u64 = log
        .lines()
        .filter_map(|l| l.split_once(": refused ")?.1.split_once(" connection(s)"))
        .map(|(n, _)| n.parse::<u64>().unwrap())
        .sum();
    assert_eq!(refused, 2, "rank 0 logs both strangers: {log}");
    assert!(
        !log.contains(&env[0].1),
        "the secret never appears in a log"
    );
}

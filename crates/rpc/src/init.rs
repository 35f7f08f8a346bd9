//! Joining the RPC group: rendezvous through a store, one connection per
//! pair of workers.
//!
//! Each worker listens on a port the OS picks and publishes
//! `worker/<rank>` = `<name>\n<ip:port>` in the store (under the `rpc/`
//! prefix). Once every worker has, each connects to every worker of lower
//! rank and accepts one connection from every worker of higher rank; as
//! lower ranks never wait on higher ones while connecting, this cannot
//! deadlock. A connection opens with the job-secret handshake of
//! `cohort_store::auth` (when the job has a secret), then the connecting
//! side's [`Hello`] (rank, world size, name), checked against what it
//! published, then a one-byte acceptance. A stranger, a peer of another
//! job or a peer that lies about its rank is refused and logged on stderr
//! while the real workers keep arriving.
//!
//! What strangers may cost the listener is bounded by the rules of
//! `cohort_store::door`, as at the store and the collective mesh: one
//! deadline for a connection's whole handshake (a stranger trickling a byte
//! now and then is dropped on time), at most [`MAX_PENDING`] connections (or
//! as many as this worker's own peers, if more) handshaking at once with the
//! oldest hung up on when a newer one comes, and refusals summed up in one
//! stderr line per interval. A flood thus holds a bounded number of
//! descriptors and threads and never keeps the group's own workers out.
//!
//! `init_rpc` reads the `env://` variables as `cohort-comm`'s
//! `init_process_group` does. This module must never log the secret.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use cohort_store::auth::{authenticate_client, authenticate_server, Secret, SECRET_ENV};
use cohort_store::door::{Deadline, RefusalLog, WaitingRoom, MAX_PENDING, REFUSAL_LOG_EVERY};
use cohort_store::{PrefixStore, Store, TcpStore};

use crate::agent::{Inner, Peer, Rpc, RpcOptions};
use crate::error::RpcError;
use crate::registry::{Registry, WorkerInfo};
use crate::wire::{read_hello, write_hello, Hello};

/// Label of the secret handshake, so that a proof made for another service
/// of the job (the store, the collectives) is worthless here.
const SERVICE: &[u8] = b"cohort-rpc";

/// Time a new connection has to finish its handshake, all of it. Real
/// workers take microseconds; this bounds what a silent or trickling
/// stranger costs (a parked thread). Shorter in unit tests.
#[cfg(not(test))]
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
#[cfg(test)]
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);

fn init_err(what: impl Into<String>, detail: impl Into<String>) -> RpcError {
    RpcError::Init {
        what: what.into(),
        detail: detail.into(),
    }
}

fn env(name: &str) -> Result<Option<String>, RpcError> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(init_err(name, "not valid UTF-8")),
    }
}

fn required(name: &str) -> Result<String, RpcError> {
    env(name)?.ok_or_else(|| init_err(name, "not set (run under `cohort run`, or set it by hand)"))
}

impl RpcOptions {
    /// The defaults, with the job secret from `COHORT_SECRET` and the
    /// listening address from `COHORT_SOCKET_ADDR` when set.
    pub fn from_env() -> Result<RpcOptions, RpcError> {
        let secret = Secret::from_env().map_err(|e| init_err(SECRET_ENV, e.to_string()))?;
        let bind_ip = match env("COHORT_SOCKET_ADDR")? {
            Some(v) => Some(v.parse().map_err(|_| {
                init_err("COHORT_SOCKET_ADDR", format!("{v:?} is not an IP address"))
            })?),
            None => None,
        };
        Ok(RpcOptions {
            secret,
            bind_ip,
            ..RpcOptions::default()
        })
    }
}

/// Joins the job's RPC group as worker `name` of rank `rank` (PyTorch's
/// `rpc.init_rpc(name, rank, world_size)`), serving the functions in
/// `registry`; blocks until all `world_size` workers have joined.
///
/// The store is the job's `env://` store: MASTER_ADDR and MASTER_PORT (rank
/// 0 hosts it unless `COHORT_STORE_HOSTED=1` says a launcher does, then at
/// COHORT_STORE_ADDR and COHORT_STORE_PORT when set), under
/// the launcher's restart prefix; the secret comes from `COHORT_SECRET`. A
/// job that also has a process group must either run under `cohort run`
/// (which hosts the store for both) or use [`init_rpc_with_store`].
pub fn init_rpc(
    name: &str,
    rank: usize,
    world_size: usize,
    registry: Registry,
) -> Result<Rpc, RpcError> {
    init_rpc_with_options(name, rank, world_size, registry, RpcOptions::from_env()?)
}

/// [`init_rpc`] with given options (start from [`RpcOptions::from_env`] to
/// keep the job secret).
pub fn init_rpc_with_options(
    name: &str,
    rank: usize,
    world_size: usize,
    registry: Registry,
    mut opts: RpcOptions,
) -> Result<Rpc, RpcError> {
    let (addr_var, port_var) = cohort_store::endpoint::store_vars(|name| std::env::var(name).ok());
    let addr = required(addr_var)?;
    let port_s = required(port_var)?;
    let port: u16 = port_s
        .parse()
        .map_err(|_| init_err(port_var, format!("{port_s:?} is not a port number")))?;
    check_rank(rank, world_size)?;
    if opts.bind_ip.is_none() {
        opts.bind_ip = Some(local_ip_towards(&addr, port).ok_or_else(|| {
            init_err(
                addr_var,
                format!("cannot resolve {addr:?} or find a local address that reaches it"),
            )
        })?);
    }
    let hosted = env("COHORT_STORE_HOSTED")?.is_some_and(|v| v == "1");
    let timeout = opts.init_timeout;
    let secret = opts.secret.clone();
    let store = if rank == 0 && !hosted {
        TcpStore::new_master_or_client_with_secret(format!("0.0.0.0:{port}"), true, timeout, secret)
    } else {
        let hostport = if addr.contains(':') {
            format!("[{addr}]:{port}")
        } else {
            format!("{addr}:{port}")
        };
        TcpStore::connect_with_secret(hostport, timeout, secret)
    }?;
    // A launcher keeps its store across restarts: each incarnation of the
    // workers meets under its own prefix, as cohort-comm's groups do.
    let store: Arc<dyn Store> = match env("COHORT_RESTART_COUNT")? {
        Some(n) => Arc::new(PrefixStore::new(format!("restart{n}"), Arc::new(store))),
        None => Arc::new(store),
    };
    init_rpc_with_store(store, name, rank, world_size, registry, opts)
}

fn check_rank(rank: usize, world: usize) -> Result<(), RpcError> {
    if world == 0 {
        return Err(init_err("world_size", "must be at least 1"));
    }
    if rank >= world {
        return Err(init_err(
            "rank",
            format!("{rank} is not below world_size {world}"),
        ));
    }
    Ok(())
}

/// [`init_rpc`] through a given store (one that every worker reaches, used
/// by one RPC group: its keys go under `rpc/`) and options.
pub fn init_rpc_with_store(
    store: Arc<dyn Store>,
    name: &str,
    rank: usize,
    world_size: usize,
    registry: Registry,
    opts: RpcOptions,
) -> Result<Rpc, RpcError> {
    check_rank(rank, world_size)?;
    if name.is_empty() || name.contains('\n') || name.len() > 256 {
        return Err(init_err(
            "name",
            format!("{name:?} must be 1 to 256 characters without newlines"),
        ));
    }
    let store: Arc<dyn Store> = Arc::new(PrefixStore::new("rpc", store));
    let deadline = Instant::now() + opts.init_timeout;
    let bind_ip = opts.bind_ip.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let listener = TcpListener::bind((bind_ip, 0))
        .map_err(|e| init_err("listening", format!("on {bind_ip}: {e}")))?;
    let addr = listener
        .local_addr()
        .map_err(|e| init_err("listening", e.to_string()))?;
    // The highest rank accepts no one: its listener closes at once.
    let acceptor = if rank + 1 < world_size {
        Some(start_acceptor(
            listener,
            name.to_string(),
            opts.secret.clone(),
            world_size - 1 - rank,
        )?)
    } else {
        None
    };
    store.set(
        &format!("worker/{rank}"),
        format!("{name}\n{addr}").as_bytes(),
    )?;

    let keys: Vec<String> = (0..world_size).map(|r| format!("worker/{r}")).collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    store
        .wait(&key_refs, opts.init_timeout)
        .map_err(|e| init_err("waiting for the other workers", e.to_string()))?;
    let mut workers = Vec::with_capacity(world_size);
    let mut addrs = Vec::with_capacity(world_size);
    for (r, key) in keys.iter().enumerate() {
        let v = store.get(key)?;
        let text = String::from_utf8_lossy(&v).into_owned();
        let (n, a) = text
            .split_once('\n')
            .ok_or_else(|| init_err(key.clone(), "malformed entry in the store"))?;
        let a: SocketAddr = a
            .parse()
            .map_err(|_| init_err(key.clone(), format!("bad address {a:?}")))?;
        if let Some(w) = workers.iter().find(|w: &&WorkerInfo| w.name == n) {
            return Err(init_err(
                "name",
                format!("ranks {} and {r} both call themselves {n:?}", w.rank),
            ));
        }
        workers.push(WorkerInfo {
            name: n.to_string(),
            rank: r,
        });
        addrs.push(a);
    }

    let mut streams: Vec<Option<TcpStream>> = (0..world_size).map(|_| None).collect();
    for (r, slot) in streams.iter_mut().enumerate().take(rank) {
        *slot = Some(connect(&workers, &addrs, rank, r, &opts, deadline)?);
    }
    if let Some(acceptor) = acceptor {
        for (r, s) in accept(acceptor, &workers, rank, &opts, deadline)? {
            streams[r] = Some(s);
        }
    }
    let mut peers = Vec::with_capacity(world_size);
    for (r, s) in streams.into_iter().enumerate() {
        peers.push(match s {
            None => None,
            Some(s) => {
                let setup = s
                    .set_read_timeout(None)
                    .and_then(|_| s.set_write_timeout(None))
                    .and_then(|_| s.set_nodelay(true))
                    .and_then(|_| Peer::new(s));
                Some(setup.map_err(|e| {
                    init_err(format!("connection to {}", workers[r].name), e.to_string())
                })?)
            }
        });
    }
    let inner = Arc::new(Inner::new(rank, workers, peers, registry, opts, store));
    inner.start()?;
    Ok(Rpc { inner })
}

/// Connects to the lower rank `to` and introduces this worker.
fn connect(
    workers: &[WorkerInfo],
    addrs: &[SocketAddr],
    me: usize,
    to: usize,
    opts: &RpcOptions,
    deadline: Instant,
) -> Result<TcpStream, RpcError> {
    let what = || format!("connecting to {} ({})", workers[to].name, addrs[to]);
    let mut s = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(
            &addrs[to],
            left.clamp(Duration::from_millis(1), Duration::from_secs(5)),
        ) {
            Ok(s) => break s,
            Err(e) if left.is_zero() => return Err(init_err(what(), e.to_string())),
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    let io = |e: std::io::Error| init_err(what(), e.to_string());
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(io)?;
    s.set_write_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(io)?;
    if let Some(secret) = &opts.secret {
        authenticate_client(&mut s, secret, SERVICE)
            .map_err(|e| init_err(what(), e.to_string()))?;
    }
    write_hello(
        &mut s,
        &Hello {
            rank: me as u32,
            world: workers.len() as u32,
            name: workers[me].name.clone(),
        },
    )
    .map_err(io)?;
    let mut ack = [0u8; 1];
    match s.read_exact(&mut ack) {
        Ok(()) if ack[0] == 1 => Ok(s),
        _ => Err(init_err(
            what(),
            "it refused this worker (another job, another world size, or a different job secret)",
        )),
    }
}

/// Connections that passed the secret handshake and sent a hello, from a
/// thread that accepts from the moment the port is bound (so that a
/// stranger is refused at once, not left waiting in the backlog while this
/// worker waits for the others in the store).
struct Acceptor {
    rx: mpsc::Receiver<(Hello, TcpStream, SocketAddr)>,
    stop: Arc<AtomicBool>,
    /// Refusals, summed up (its last line is printed when the last thread
    /// that holds it is done).
    log: Arc<RefusalLog>,
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// Accepts on `listener` until the returned [`Acceptor`] is dropped, for
/// `peers` higher ranks. Each connection shakes hands on its own thread,
/// seated in a waiting room meanwhile, so a stranger that connects and
/// stays silent delays no one, and a crowd of them holds a bounded number
/// of threads and descriptors.
fn start_acceptor(
    listener: TcpListener,
    name: String,
    secret: Option<Secret>,
    peers: usize,
) -> Result<Acceptor, RpcError> {
    listener
        .set_nonblocking(true)
        .map_err(|e| init_err("listening", e.to_string()))?;
    let (tx, rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    let log = Arc::new(RefusalLog::new(
        format!("rpc {name}"),
        "connection(s) that are not workers of this group",
        REFUSAL_LOG_EVERY,
    ));
    // Room for every higher rank at once: a crowd of strangers can push out
    // only strangers, and peers that are slow.
    let room = WaitingRoom::new(MAX_PENDING.max(peers));
    let refusals = log.clone();
    let accepting = move || {
        while !stopped.load(Ordering::Acquire) {
            match listener.accept() {
                Ok((s, from)) => {
                    let Ok(hang_up) = s.try_clone() else {
                        refusals.refused(&from.to_string(), &"cannot clone its socket");
                        continue;
                    };
                    // Full of strangers: the oldest is hung up on (its
                    // thread's read ends).
                    let seat = room.enter(move || {
                        let _ = hang_up.shutdown(std::net::Shutdown::Both);
                    });
                    let (tx, secret, log) = (tx.clone(), secret.clone(), refusals.clone());
                    let shake = move || {
                        let verdict = handshake(s, secret.as_ref());
                        let evicted = seat.evicted();
                        drop(seat);
                        match verdict {
                            Ok((hello, s)) => {
                                let _ = tx.send((hello, s, from));
                            }
                            Err(_) if evicted => log.refused(
                                &from.to_string(),
                                &"dropped to make room for newer connections",
                            ),
                            Err(why) => log.refused(&from.to_string(), &why),
                        }
                    };
                    let spawned = std::thread::Builder::new()
                        .name("cohort-rpc-admit".into())
                        .stack_size(64 << 10)
                        .spawn(shake);
                    if let Err(e) = spawned {
                        refusals.refused(
                            &from.to_string(),
                            &format!("cannot start its handshake: {e}"),
                        );
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => {
                    eprintln!("rpc {name}: accepting connections failed: {e}");
                    return;
                }
            }
        }
    };
    std::thread::Builder::new()
        .name("cohort-rpc-accept".into())
        .spawn(accepting)
        .map_err(|e| {
            init_err(
                "listening",
                format!("cannot start the accepting thread: {e}"),
            )
        })?;
    Ok(Acceptor { rx, stop, log })
}

/// Takes one connection from every higher rank off `acceptor`, checking
/// that each hello matches what that rank published.
fn accept(
    acceptor: Acceptor,
    workers: &[WorkerInfo],
    me: usize,
    opts: &RpcOptions,
    deadline: Instant,
) -> Result<Vec<(usize, TcpStream)>, RpcError> {
    let expected = workers.len() - 1 - me;
    let mut got: Vec<(usize, TcpStream)> = Vec::with_capacity(expected);
    while got.len() < expected {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok((hello, mut s, from)) = acceptor.rx.recv_timeout(left) else {
            let missing: Vec<&str> = workers[me + 1..]
                .iter()
                .filter(|w| !got.iter().any(|(g, _)| *g == w.rank))
                .map(|w| w.name.as_str())
                .collect();
            return Err(init_err(
                "waiting for connections",
                format!(
                    "{} never connected within {:?}",
                    missing.join(", "),
                    opts.init_timeout
                ),
            ));
        };
        let r = hello.rank as usize;
        let refuse = if hello.world as usize != workers.len() {
            Some(format!(
                "it belongs to a world of {}, this one has {}",
                hello.world,
                workers.len()
            ))
        } else if r <= me || r >= workers.len() || workers[r].name != hello.name {
            Some(format!(
                "it claims to be rank {r} named {:?}, not a higher rank of this group",
                hello.name
            ))
        } else if got.iter().any(|(g, _)| *g == r) {
            Some(format!("{} is already connected", workers[r].name))
        } else {
            None
        };
        match refuse {
            Some(why) => acceptor.log.refused(&from.to_string(), &why),
            None => match s.write_all(&[1]) {
                Ok(()) => got.push((r, s)),
                Err(e) => eprintln!(
                    "rpc {}: lost the connection from {} during its handshake: {e}",
                    workers[me].name, workers[r].name
                ),
            },
        }
    }
    Ok(got)
}

/// The accepting side's first steps, all within [`HANDSHAKE_TIMEOUT`]: the
/// secret, then the hello.
fn handshake(s: TcpStream, secret: Option<&Secret>) -> Result<(Hello, TcpStream), String> {
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    let mut within = Deadline::new(&s, HANDSHAKE_TIMEOUT);
    if let Some(secret) = secret {
        authenticate_server(&mut within, secret, SERVICE).map_err(|e| e.to_string())?;
    }
    let hello = read_hello(&mut within).map_err(|e| match e {
        crate::wire::ReadError::Io(e) => e.to_string(),
        crate::wire::ReadError::Malformed(m) => m,
    })?;
    Ok((hello, s))
}

/// The local address this host uses to reach `host` (loopback for a
/// loopback master), found by "connecting" a UDP socket: no packet is sent.
fn local_ip_towards(host: &str, port: u16) -> Option<IpAddr> {
    let target = (host, port).to_socket_addrs().ok()?.next()?;
    if target.ip().is_loopback() {
        return Some(Ipv4Addr::LOCALHOST.into());
    }
    let any: IpAddr = if target.is_ipv4() {
        Ipv4Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    };
    let sock = UdpSocket::bind((any, 0)).ok()?;
    sock.connect(target).ok()?;
    Some(sock.local_addr().ok()?.ip())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::thread;

    /// Whether the other end of `s` has hung up on it (without waiting).
    fn hung_up_now(s: &TcpStream) -> bool {
        let mut fd = libc::pollfd {
            fd: s.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: `fd` is one valid pollfd, exclusively borrowed for the call.
        let n = unsafe { libc::poll(&mut fd, 1, 0) };
        n > 0 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }

    /// Waits until the listener hangs up on `s`, which connected at `at`; fails once it
    /// could have for the handshake's deadline (which starts at its accept, after `at`):
    /// a hang-up seen before then can only be the waiting room's doing.
    fn evicted(s: &TcpStream, at: Instant, what: &str) {
        while !hung_up_now(s) {
            assert!(
                at.elapsed() < HANDSHAKE_TIMEOUT,
                "{what} is still held after {:?}",
                at.elapsed()
            );
            thread::sleep(Duration::from_millis(1));
        }
    }

    /// A flood of four waiting rooms' worth of idle strangers at worker 0's listener, then a
    /// few trickling a well-formed handshake one byte every 300 ms: each stranger is hung up
    /// on as soon as a room's worth of newer ones came (long before any handshake deadline,
    /// so a missing or larger cap fails here), each trickler is dropped at the deadline of
    /// its whole handshake, worker 1 joins at once and calls worker 0, and worker 0 ends up
    /// holding none of the strangers.
    #[test]
    fn a_flood_of_strangers_is_bounded_and_the_workers_still_join() {
        let store: Arc<dyn Store> = Arc::new(cohort_store::HashStore::new());
        let secret = Secret::generate().unwrap();
        let opts = || RpcOptions {
            secret: Some(secret.clone()),
            init_timeout: Duration::from_secs(20),
            ..RpcOptions::default()
        };
        let mut reg = Registry::new();
        reg.register("add", |_, (a, b): (i64, i64)| Ok::<_, String>(a + b));
        let worker0 = {
            let (store, opts) = (store.clone(), opts());
            thread::spawn(move || init_rpc_with_store(store, "a", 0, 2, reg, opts))
        };
        store
            .wait(&["rpc/worker/0"], Duration::from_secs(10))
            .unwrap();
        let entry = String::from_utf8(store.get("rpc/worker/0").unwrap()).unwrap();
        let addr: SocketAddr = entry.split_once('\n').unwrap().1.parse().unwrap();

        // One at a time, each once the one a room before it is out: a burst would overflow
        // the listen backlog, and the kernel would then queue connections out of order.
        let mut flood: Vec<(TcpStream, Instant)> = Vec::new();
        for i in 0..4 * MAX_PENDING {
            flood.push((TcpStream::connect(addr).unwrap(), Instant::now()));
            if let Some(old) = i.checked_sub(MAX_PENDING) {
                let what = format!("stranger {old}, {MAX_PENDING} strangers later,");
                evicted(&flood[old].0, flood[old].1, &what);
            }
        }
        let tricklers: Vec<_> = (0..3)
            .map(|_| {
                thread::spawn(move || {
                    let mut s = TcpStream::connect(addr).unwrap();
                    let since = Instant::now();
                    let mut bytes = b"COHAUTH1".iter().chain(std::iter::repeat(&0u8));
                    while since.elapsed() < HANDSHAKE_TIMEOUT * 3 {
                        if s.write_all(&[*bytes.next().unwrap()]).is_err() || hung_up_now(&s) {
                            return Some(since.elapsed());
                        }
                        thread::sleep(Duration::from_millis(300));
                    }
                    None
                })
            })
            .collect();
        for (old, (s, at)) in flood.iter().enumerate().skip(3 * MAX_PENDING).take(3) {
            evicted(s, *at, &format!("stranger {old}, with the tricklers in,"));
        }
        assert_eq!(
            flood.iter().filter(|(s, _)| !hung_up_now(s)).count(),
            MAX_PENDING - 3
        );

        // Worker 1 joins at once, not after some stranger's deadline.
        let joined = Instant::now();
        let worker1 = init_rpc_with_store(store, "b", 1, 2, Registry::new(), opts()).unwrap();
        let worker0 = worker0.join().unwrap().unwrap();
        assert!(
            joined.elapsed() < HANDSHAKE_TIMEOUT / 2,
            "{:?}",
            joined.elapsed()
        );
        let sum: i64 = worker1.rpc_sync("a", "add", (2i64, 3i64)).unwrap();
        assert_eq!(sum, 5);

        for t in tricklers {
            let dropped = t.join().unwrap();
            assert!(
                dropped.is_some_and(|d| d >= HANDSHAKE_TIMEOUT / 2 && d < HANDSHAKE_TIMEOUT * 2),
                "a trickler was dropped after {dropped:?}, the deadline is {HANDSHAKE_TIMEOUT:?}"
            );
        }
        let started = Instant::now();
        while let Some(held) = flood.iter().position(|(s, _)| !hung_up_now(s)) {
            assert!(
                started.elapsed() < HANDSHAKE_TIMEOUT * 2,
                "stranger {held} is still held after the handshake deadline"
            );
            thread::sleep(Duration::from_millis(20));
        }
        let closing = thread::spawn(move || worker0.shutdown());
        worker1.shutdown().unwrap();
        closing.join().unwrap().unwrap();
    }

    #[test]
    fn bad_settings_are_named() {
        let store: Arc<dyn Store> = Arc::new(cohort_store::HashStore::new());
        let e = init_rpc_with_store(
            store.clone(),
            "a",
            2,
            2,
            Registry::new(),
            RpcOptions::default(),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("rank: 2 is not below world_size 2"),
            "{e}"
        );
        let e = init_rpc_with_store(store, "a\nb", 0, 1, Registry::new(), RpcOptions::default())
            .unwrap_err();
        assert!(e.to_string().contains("name"), "{e}");
    }

    #[test]
    fn a_world_of_one_calls_itself() {
        let store: Arc<dyn Store> = Arc::new(cohort_store::HashStore::new());
        let mut reg = Registry::new();
        reg.register("add", |_, (a, b): (i64, i64)| Ok::<_, String>(a + b));
        let rpc = init_rpc_with_store(store, "solo", 0, 1, reg, RpcOptions::default()).unwrap();
        let r: i64 = rpc.rpc_sync("solo", "add", (2i64, 3i64)).unwrap();
        assert_eq!(r, 5);
        let rref = rpc.remote::<_, i64>(0usize, "add", (4i64, 5i64)).unwrap();
        assert_eq!(rref.to_here().unwrap(), 9);
        assert_eq!(*rref.local_value().unwrap(), 9);
        assert_eq!(rpc.rref_users(rref.id()), Some(1));
        // The reference leads back to its agent.
        assert_eq!(rref.rpc().rref_users(rref.id()), Some(1));
        assert_eq!(rref.rpc().me().name, "solo");
        drop(rref);
        assert_eq!(rpc.owned_rrefs(), 0);
        rpc.shutdown().unwrap();
        let e = rpc
            .rpc_sync::<_, i64>("solo", "add", (1i64, 1i64))
            .unwrap_err();
        assert!(matches!(e, RpcError::ShutDown { .. }), "{e}");
    }
}

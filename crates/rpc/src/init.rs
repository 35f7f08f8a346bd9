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
//! `init_rpc` reads the `env://` variables as `cohort-comm`'s
//! `init_process_group` does. This module must never log the secret.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use cohort_store::auth::{authenticate_client, authenticate_server, Secret, SECRET_ENV};
use cohort_store::{PrefixStore, Store, TcpStore};

use crate::agent::{Inner, Peer, Rpc, RpcOptions};
use crate::error::RpcError;
use crate::registry::{Registry, WorkerInfo};
use crate::wire::{read_hello, write_hello, Hello};

/// Label of the secret handshake, so that a proof made for another service
/// of the job (the store, the collectives) is worthless here.
const SERVICE: &[u8] = b"cohort-rpc";

/// Time a new connection has to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

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
/// 0 hosts it unless `COHORT_STORE_HOSTED=1` says a launcher does), under
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
    let addr = required("MASTER_ADDR")?;
    let port_s = required("MASTER_PORT")?;
    let port: u16 = port_s
        .parse()
        .map_err(|_| init_err("MASTER_PORT", format!("{port_s:?} is not a port number")))?;
    check_rank(rank, world_size)?;
    if opts.bind_ip.is_none() {
        opts.bind_ip = Some(local_ip_towards(&addr, port).ok_or_else(|| {
            init_err(
                "MASTER_ADDR",
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
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// Accepts on `listener` until the returned [`Acceptor`] is dropped. Each
/// connection shakes hands on its own thread, so a stranger that connects
/// and stays silent delays no one.
fn start_acceptor(
    listener: TcpListener,
    name: String,
    secret: Option<Secret>,
) -> Result<Acceptor, RpcError> {
    listener
        .set_nonblocking(true)
        .map_err(|e| init_err("listening", e.to_string()))?;
    let (tx, rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    std::thread::spawn(move || {
        while !stopped.load(Ordering::Acquire) {
            match listener.accept() {
                Ok((s, from)) => {
                    let (tx, secret, name) = (tx.clone(), secret.clone(), name.clone());
                    std::thread::spawn(move || match handshake(s, secret.as_ref()) {
                        Ok((hello, s)) => {
                            let _ = tx.send((hello, s, from));
                        }
                        Err(why) => {
                            eprintln!("rpc {name}: refused a connection from {from}: {why}")
                        }
                    });
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
    });
    Ok(Acceptor { rx, stop })
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
            Some(why) => eprintln!(
                "rpc {}: refused a connection from {from}: {why}",
                workers[me].name
            ),
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

/// The accepting side's first steps: the secret, then the hello.
fn handshake(mut s: TcpStream, secret: Option<&Secret>) -> Result<(Hello, TcpStream), String> {
    s.set_nonblocking(false).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .map_err(|e| e.to_string())?;
    s.set_write_timeout(Some(HANDSHAKE_TIMEOUT))
        .map_err(|e| e.to_string())?;
    if let Some(secret) = secret {
        authenticate_server(&mut s, secret, SERVICE).map_err(|e| e.to_string())?;
    }
    let hello = read_hello(&mut s).map_err(|e| match e {
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

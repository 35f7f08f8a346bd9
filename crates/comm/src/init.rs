//! `init_process_group`: build the default group from an init method, as
//! `torch.distributed.init_process_group` does.
//!
//! - `env://` reads MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (and
//!   LOCAL_RANK, LOCAL_WORLD_SIZE, defaulting to RANK and WORLD_SIZE). Rank
//!   0 hosts the TCP store server on MASTER_PORT unless
//!   `COHORT_STORE_HOSTED=1` says a launcher already hosts it (at
//!   `COHORT_STORE_ADDR:COHORT_STORE_PORT` when those are set). Under
//!   a launcher that restarts workers, `COHORT_RESTART_COUNT` keeps each
//!   incarnation's keys apart. Under Slurm (`srun`), SLURM_PROCID,
//!   SLURM_NTASKS and SLURM_LOCALID stand in for RANK, WORLD_SIZE and
//!   LOCAL_RANK where those are unset, and inside an `srun` step the first
//!   host of the step's node list and a port from the job id stand in for
//!   MASTER_ADDR and MASTER_PORT (`cohort_store::slurm`); set variables
//!   always win.
//! - `tcp://host:port` with rank and world size from [`InitOptions`] or the
//!   query (`?rank=0&world_size=2`); rank 0 hosts the store server.
//! - `file:///path` with rank and world size likewise; the file must be
//!   new or empty and on a filesystem every rank sees.
//!
//! With `COHORT_SECRET` set (the launcher sets it), the TCP store is served
//! and reached only with the job-secret handshake, as are the group's
//! sockets.
//!
//! Every missing or malformed value is a [`CommError::Init`] naming the
//! variable or URL part (never showing the secret). This module must never guess a rank or world size.

use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs, UdpSocket};
use std::sync::Arc;

use cohort_store::auth::{Secret, SECRET_ENV};
use cohort_store::endpoint::store_vars;
use cohort_store::slurm::SlurmTask;
use cohort_store::{FileStore, PrefixStore, Store, TcpStore};

use crate::config::{bad, var, GroupOptions, InitOptions};
use crate::error::CommError;
use crate::group::ProcessGroup;
use crate::registry::Registered;

/// Set to `1` by a launcher that hosts the TCP store server on
/// MASTER_ADDR:MASTER_PORT itself, so that rank 0 connects as a client.
pub const STORE_HOSTED_VAR: &str = "COHORT_STORE_HOSTED";

/// Set by the launcher to the number of times it restarted the workers.
const RESTART_COUNT_VAR: &str = "COHORT_RESTART_COUNT";

fn init_err(name: &str, detail: impl Into<String>) -> CommError {
    CommError::Init {
        name: name.to_string(),
        detail: detail.into(),
    }
}

fn not_set(name: &str) -> CommError {
    init_err(
        name,
        "not set (run under `cohort run` or srun, or set it by hand)",
    )
}

/// `name` from the environment, else Slurm's variable for it (`srun` sets
/// SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID for every task); `None` when
/// neither is set.
fn var_or_slurm(name: &str, slurm: &str) -> Result<Option<usize>, CommError> {
    match var(name)? {
        Some(v) => parse_num(name, &v).map(Some),
        None => var(slurm)?.map(|v| parse_num(slurm, &v)).transpose(),
    }
}

fn required_or_slurm(name: &str, slurm: &str) -> Result<usize, CommError> {
    var_or_slurm(name, slurm)?.ok_or_else(|| {
        init_err(
            name,
            format!(
                "not set (run under `cohort run` or srun, which sets {slurm}, or set it by hand)"
            ),
        )
    })
}

/// This task of an `srun` step, if it is one; a malformed Slurm variable
/// is an error about `name`, the value it was to stand in for.
fn slurm_task(name: &str) -> Result<Option<SlurmTask>, CommError> {
    SlurmTask::from_process_env().map_err(|e| init_err(name, format!("from Slurm: {e}")))
}

fn parse_num<T: std::str::FromStr>(name: &str, v: &str) -> Result<T, CommError> {
    v.parse()
        .map_err(|_| bad(name, v, "a non-negative integer"))
}

/// Creates the default process group of this process (PyTorch's
/// `init_process_group(backend, init_method)`); blocks until all
/// `world_size` ranks have joined or the group timeout passes.
///
/// `backend` is a name of the [registry](crate::registered_backends):
/// `cohort` (aliases `tcp`, `gloo`), or one a program registered with
/// [`register_backend`](crate::register_backend).
pub fn init_process_group(
    backend: &str,
    init_method: &str,
    opts: InitOptions,
) -> Result<ProcessGroup, CommError> {
    match crate::registry::lookup(backend)? {
        Registered::BuiltIn => init_sockets(init_method, opts),
        Registered::Init(init) => init(init_method, opts),
    }
}

/// The built-in backend: a store from the init method, then sockets or
/// shared memory between the ranks.
fn init_sockets(init_method: &str, opts: InitOptions) -> Result<ProcessGroup, CommError> {
    let mut group = match opts.group.clone() {
        Some(g) => g,
        None => GroupOptions::from_env()?,
    };
    let explicit_bind = var("COHORT_SOCKET_ADDR")?.is_some();
    let timeout = group.timeout;
    let secret = Secret::from_env().map_err(|e| init_err(SECRET_ENV, e.to_string()))?;

    let (store, rank, world): (Arc<dyn Store>, usize, usize) = if init_method == "env://" {
        let (addr_var, port_var) = store_vars(|name| std::env::var(name).ok());
        let addr = match var(addr_var)? {
            Some(addr) => addr,
            None => slurm_task(addr_var)?
                .and_then(|t| t.first_host)
                .map(|(host, _)| host)
                .ok_or_else(|| not_set(addr_var))?,
        };
        let port_s = match var(port_var)? {
            Some(port) => port,
            None => slurm_task(port_var)?
                .and_then(|t| t.master_port())
                .map(|p| p.to_string())
                .ok_or_else(|| not_set(port_var))?,
        };
        let port: u16 = port_s
            .parse()
            .map_err(|_| bad(port_var, &port_s, "a port number (0-65535)"))?;
        let rank = match opts.rank {
            Some(r) => r,
            None => required_or_slurm("RANK", "SLURM_PROCID")?,
        };
        let world = match opts.world_size {
            Some(w) => w,
            None => required_or_slurm("WORLD_SIZE", "SLURM_NTASKS")?,
        };
        check_world("RANK", rank, "WORLD_SIZE", world)?;
        if !explicit_bind {
            group.bind_ip = local_ip_towards(&addr, port).ok_or_else(|| {
                init_err(
                    addr_var,
                    format!("cannot resolve {addr:?} or find a local address that reaches it"),
                )
            })?;
        }
        let hosted = var(STORE_HOSTED_VAR)?.is_some_and(|v| v == "1");
        let store = if rank == 0 && !hosted {
            TcpStore::new_master_or_client_with_secret(
                format!("0.0.0.0:{port}"),
                true,
                timeout,
                secret,
            )
        } else {
            // An IPv6 literal needs brackets before the port.
            let hostport = if addr.contains(':') {
                format!("[{addr}]:{port}")
            } else {
                format!("{addr}:{port}")
            };
            TcpStore::connect_with_secret(hostport, timeout, secret)
        }
        .map_err(|source| CommError::Store {
            group: group.name.clone(),
            source,
        })?;
        // A launcher keeps its store across restarts of the workers: each
        // incarnation meets under its own prefix, never at stale addresses.
        let store: Arc<dyn Store> = match var(RESTART_COUNT_VAR)? {
            Some(n) => Arc::new(PrefixStore::new(format!("restart{n}"), Arc::new(store))),
            None => Arc::new(store),
        };
        (store, rank, world)
    } else if let Some(rest) = init_method.strip_prefix("tcp://") {
        let (hostport, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (host, port_s) = hostport.rsplit_once(':').ok_or_else(|| {
            init_err(
                "init_method",
                format!("{init_method:?} has no port (tcp://host:port)"),
            )
        })?;
        let port: u16 = port_s
            .parse()
            .map_err(|_| bad("init_method port", port_s, "a port number"))?;
        let (rank, world) = rank_world(&opts, query)?;
        if !explicit_bind {
            group.bind_ip = local_ip_towards(host, port)
                .ok_or_else(|| init_err("init_method", format!("cannot resolve host {host:?}")))?;
        }
        let store = if rank == 0 {
            TcpStore::new_master_or_client_with_secret(
                format!("0.0.0.0:{port}"),
                true,
                timeout,
                secret,
            )
        } else {
            TcpStore::connect_with_secret(hostport.to_string(), timeout, secret)
        }
        .map_err(|source| CommError::Store {
            group: group.name.clone(),
            source,
        })?;
        (Arc::new(store), rank, world)
    } else if let Some(rest) = init_method.strip_prefix("file://") {
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        if path.is_empty() {
            return Err(init_err(
                "init_method",
                "file:// needs a path (file:///tmp/store)",
            ));
        }
        let (rank, world) = rank_world(&opts, query)?;
        let store = FileStore::new(path, timeout).map_err(|source| CommError::Store {
            group: group.name.clone(),
            source,
        })?;
        (Arc::new(store), rank, world)
    } else {
        return Err(init_err(
            "init_method",
            format!("{init_method:?} is not env://, tcp://host:port or file:///path"),
        ));
    };

    let local_rank = var_or_slurm("LOCAL_RANK", "SLURM_LOCALID")?.unwrap_or(rank);
    let local_world = match var("LOCAL_WORLD_SIZE")? {
        Some(v) => parse_num("LOCAL_WORLD_SIZE", &v)?,
        None if var("RANK")?.is_none() => slurm_task("LOCAL_WORLD_SIZE")?
            .and_then(|t| t.local_world_size)
            .unwrap_or(world),
        None => world,
    };
    check_world("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world)?;
    Ok(ProcessGroup::new(store, rank, world, group)?.with_local(local_rank, local_world))
}

fn check_world(
    rank_name: &str,
    rank: usize,
    world_name: &str,
    world: usize,
) -> Result<(), CommError> {
    if world == 0 {
        return Err(init_err(world_name, "must be at least 1"));
    }
    if rank >= world {
        return Err(init_err(
            rank_name,
            format!("{rank} is not below {world_name}={world}"),
        ));
    }
    Ok(())
}

/// Rank and world size from the options, else the URL query.
fn rank_world(opts: &InitOptions, query: &str) -> Result<(usize, usize), CommError> {
    let q = |key: &str| {
        query
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.to_string())
    };
    let rank = match (opts.rank, q("rank")) {
        (Some(r), _) => r,
        (None, Some(v)) => parse_num("rank", &v)?,
        (None, None) => {
            return Err(init_err(
                "rank",
                "required with tcp:// and file:// (InitOptions::rank or ?rank=)",
            ))
        }
    };
    let world = match (opts.world_size, q("world_size")) {
        (Some(w), _) => w,
        (None, Some(v)) => parse_num("world_size", &v)?,
        (None, None) => {
            return Err(init_err(
                "world_size",
                "required with tcp:// and file:// (InitOptions::world_size or ?world_size=)",
            ))
        }
    };
    check_world("rank", rank, "world_size", world)?;
    Ok((rank, world))
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
    fn bad_init_methods_name_the_part() {
        let e =
            init_process_group("tcp", "carrier-pigeon://x", InitOptions::default()).unwrap_err();
        assert!(e.to_string().contains("init_method"), "{e}");
        let e = init_process_group("nccl", "env://", InitOptions::default()).unwrap_err();
        assert!(e.to_string().contains("backend"), "{e}");
        let e = init_process_group(
            "tcp",
            "tcp://127.0.0.1:1?world_size=2",
            InitOptions::default(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("rank"), "{e}");
        let e = init_process_group(
            "tcp",
            "file:///tmp/x?rank=2&world_size=2",
            InitOptions::default(),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("rank: 2 is not below world_size=2"),
            "{e}"
        );
    }

    #[test]
    fn loopback_master_means_loopback_sockets() {
        assert_eq!(
            local_ip_towards("127.0.0.1", 1),
            Some(Ipv4Addr::LOCALHOST.into())
        );
        assert_eq!(
            local_ip_towards("localhost", 1),
            Some(Ipv4Addr::LOCALHOST.into())
        );
    }
}

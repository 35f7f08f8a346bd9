//! `launch`: one node agent from start to exit. Node 0 hosts the store; every
//! agent joins each restart round through it, starts its workers, watches
//! them, the store and its own signals, and stops, restarts or finishes the
//! round as the whole job does. Only the thread that calls `launch` spawns
//! workers (their parent-death signal is tied to it); it never returns while
//! a worker it started is alive.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cohort_store::auth::SECRET_ENV;
use cohort_store::{Secret, Store, StoreError, TcpStore, TcpStoreServer};

use crate::env::{self, JobShape};
use crate::events::{Event, Events};
use crate::group::{WorkerFailure, WorkerGroup, REAP_INTERVAL};
use crate::process::signal_name;
use crate::rendezvous::{NodeInfo, Rendezvous, RoundResult, Wait, PEER_POLL};
use crate::{LaunchConfig, LaunchError};

/// Extra time node 0 keeps the store up for the other agents to read how the
/// job ended, beyond the time they may need to stop their workers.
const LEAVE_MARGIN: Duration = Duration::from_secs(10);

/// How the job ended, as far as this node can tell.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum LaunchOutcome {
    /// Every worker of every node exited 0.
    Succeeded {
        /// Restarts it took.
        restarts: u32,
    },
    /// A worker of this node failed in the last round and no restart was left.
    WorkerFailed {
        /// The first worker that failed.
        failure: WorkerFailure,
        /// Restarts before the last round.
        restarts: u32,
    },
    /// A worker of another node failed (or another node was interrupted) in
    /// the last round, and no restart was left.
    NodeFailed {
        /// What that node reported.
        detail: String,
        /// Restarts before the last round.
        restarts: u32,
    },
    /// The launcher was asked to stop by a signal and stopped its workers.
    Interrupted {
        /// The signal.
        signal: i32,
    },
}

impl LaunchOutcome {
    /// The launcher's exit code: 0, 1 for a failed job (as torchrun), or
    /// 128 + the signal that stopped it (as a shell reports it).
    pub fn exit_code(&self) -> i32 {
        match self {
            LaunchOutcome::Succeeded { .. } => 0,
            LaunchOutcome::WorkerFailed { .. } | LaunchOutcome::NodeFailed { .. } => 1,
            LaunchOutcome::Interrupted { signal } => 128 + signal,
        }
    }
}

/// How one round ended on this node.
enum RoundEnd {
    Succeeded,
    WorkerFailed(WorkerFailure),
    NodeFailed(String),
    Stopped(i32),
}

/// Why a round failed, as this node saw it.
enum Failed {
    Worker(WorkerFailure),
    Node(String),
}

/// Runs this node's share of the job described by `config` until it succeeds,
/// fails for good, or the launcher is signalled.
///
/// From the first call on, SIGINT, SIGTERM, SIGHUP and SIGQUIT no longer end
/// the process: they stop the workers and make `launch` return
/// [`LaunchOutcome::Interrupted`]. Call it from a thread that lives until it
/// returns (the main thread of a launcher): the workers' parent-death signal
/// is tied to that thread. Worker output is forwarded to this process's
/// stdout and stderr, and the launcher's notes go to stderr.
pub fn launch(config: &LaunchConfig) -> Result<LaunchOutcome, LaunchError> {
    let launch_time = SystemTime::now();
    config.validate()?;
    let secret = crate::secret::job_secret(config)?;
    let events = Events::install().map_err(LaunchError::Signals)?;

    // Binding before anything is spawned turns a taken port into one clear error.
    let server = if config.node_rank == 0 {
        Some(host_store(config, &secret)?)
    } else {
        None
    };
    let port = match &server {
        Some(server) => server.local_addr().port(),
        None => config.master_port,
    };
    let addr = match &server {
        // Node 0 reaches its own server wherever it listens, even when
        // `master_addr` is a name only the other nodes resolve.
        Some(server) => {
            let mut local = server.local_addr();
            if local.ip().is_unspecified() {
                local.set_ip(IpAddr::V4(Ipv4Addr::LOCALHOST));
            }
            local.to_string()
        }
        None => host_port(&config.master_addr, port),
    };
    let store = match connect_store(&addr, config, port, &secret, &events)? {
        Wait::Done(store) => store,
        Wait::Stopped(signal) => return Ok(interrupted(signal)),
    };
    let rdzv = Rendezvous::new(
        store,
        &config.master_addr,
        port,
        config.node_rank,
        config.nnodes,
        NodeInfo {
            nproc_per_node: config.nproc_per_node,
            max_restarts: config.max_restarts,
            host: hostname(),
            pid: std::process::id(),
        },
    );
    let proposal = format!(
        "{:x}-{:x}",
        launch_time
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros(),
        std::process::id()
    );
    let run_id = match rdzv.run_id(&proposal, config.join_timeout, &events)? {
        Wait::Done(id) => id,
        Wait::Stopped(signal) => return Ok(interrupted(signal)),
    };
    let job = JobShape {
        nproc_per_node: config.nproc_per_node,
        nnodes: config.nnodes,
        node_rank: config.node_rank,
        master_addr: config.master_addr.clone(),
        master_port: port,
        max_restarts: config.max_restarts,
        run_id,
        launch_time,
    };
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let mut thread_vars = env::thread_vars(cores, config.nproc_per_node, |k| std::env::var(k).ok());
    if config.nproc_per_node > 1 {
        if let Some((_, threads)) = thread_vars.first() {
            let names: Vec<&str> = thread_vars.iter().map(|(k, _)| *k).collect();
            note(&format!(
                "setting {} to {threads} per worker ({cores} cores / {} workers); set them to override",
                names.join(" and "),
                config.nproc_per_node
            ));
        }
    }
    // Through the environment only: a command line is readable by every user.
    if let Some(secret) = &secret {
        thread_vars.push((SECRET_ENV, secret.to_hex()));
    }

    let outcome = run_rounds(config, &job, &thread_vars, &rdzv, &events);
    if outcome.is_ok() {
        // Leaving is courtesy to the other agents; a store that is gone by
        // now does not change how this node's job ended.
        let _ = rdzv.leave(config.stop_grace + LEAVE_MARGIN, &events);
    }
    drop(server);
    outcome
}

fn run_rounds(
    config: &LaunchConfig,
    job: &JobShape,
    thread_vars: &[(&'static str, String)],
    rdzv: &Rendezvous,
    events: &Events,
) -> Result<LaunchOutcome, LaunchError> {
    let mut restart = 0;
    loop {
        if let Wait::Stopped(signal) = rdzv.join(restart, config.join_timeout, events)? {
            return stop_job(rdzv, restart, config.node_rank, signal);
        }
        let mut group = match WorkerGroup::start(config, job, thread_vars, restart, events) {
            Ok(group) => group,
            Err(e) => {
                // The other nodes must not wait for workers that never came.
                let _ = rdzv.close();
                let _ = rdzv.report_failure(restart, &format!("node {}: {e}", config.node_rank));
                return Err(e);
            }
        };
        let end = watch(&mut group, config, rdzv, restart, events)?;
        let failure = match end {
            RoundEnd::Succeeded => match rdzv.finish(restart, events)? {
                Wait::Done(RoundResult::AllSucceeded) => {
                    return Ok(LaunchOutcome::Succeeded { restarts: restart })
                }
                Wait::Done(RoundResult::Failed(detail)) => {
                    note(&format!("the job failed on another node: {detail}"));
                    Failed::Node(detail)
                }
                Wait::Stopped(signal) => return stop_job(rdzv, restart, config.node_rank, signal),
            },
            RoundEnd::WorkerFailed(failure) => {
                rdzv.report_failure(
                    restart,
                    &format!("node {}: {}", config.node_rank, failure.summary()),
                )?;
                Failed::Worker(failure)
            }
            RoundEnd::NodeFailed(detail) => {
                note(&format!(
                    "stopped this node's workers: the job failed on another node: {detail}"
                ));
                Failed::Node(detail)
            }
            RoundEnd::Stopped(signal) => return stop_job(rdzv, restart, config.node_rank, signal),
        };
        if restart < config.max_restarts && !rdzv.is_closed()? {
            restart += 1;
            note(&format!(
                "restarting the workers (restart {restart} of {})",
                config.max_restarts
            ));
            continue;
        }
        rdzv.close()?;
        if config.max_restarts > 0 {
            note(&format!("giving up after {restart} restarts"));
        }
        return Ok(match failure {
            Failed::Worker(failure) => LaunchOutcome::WorkerFailed {
                failure,
                restarts: restart,
            },
            Failed::Node(detail) => LaunchOutcome::NodeFailed {
                detail,
                restarts: restart,
            },
        });
    }
}

/// Watches one round until every worker exited, one failed, another node
/// reported a failure, or the launcher was signalled; in every case but the
/// first, this node's workers are stopped before it returns.
fn watch(
    group: &mut WorkerGroup,
    config: &LaunchConfig,
    rdzv: &Rendezvous,
    restart: u32,
    events: &Events,
) -> Result<RoundEnd, LaunchError> {
    let tick = if config.nnodes > 1 {
        PEER_POLL
    } else {
        REAP_INTERVAL
    };
    loop {
        if let Some(Event::Stop(signal)) = events.next(tick) {
            note(&format!(
                "received {}, stopping the workers",
                signal_name(signal)
            ));
            group.stop(signal, config.stop_grace, events);
            return Ok(RoundEnd::Stopped(signal));
        }
        let exited = group.reap();
        if let Some(&first) = exited.iter().find(|&&i| !group.exit_of(i).success()) {
            let interrupted = group.stop(libc::SIGTERM, config.stop_grace, events);
            let failure = group.failure(first);
            report(&failure);
            // A signal while stopping means the user wants out, not a restart.
            return Ok(match interrupted {
                Some(signal) => RoundEnd::Stopped(signal),
                None => RoundEnd::WorkerFailed(failure),
            });
        }
        if group.all_exited() {
            group.drain_output();
            return Ok(RoundEnd::Succeeded);
        }
        if config.nnodes > 1 {
            match rdzv.failure(restart) {
                Ok(None) => {}
                Ok(Some(detail)) => {
                    return Ok(match group.stop(libc::SIGTERM, config.stop_grace, events) {
                        Some(signal) => RoundEnd::Stopped(signal),
                        None => RoundEnd::NodeFailed(detail),
                    });
                }
                Err(e) => {
                    note("lost the rendezvous store, stopping the workers");
                    group.stop(libc::SIGTERM, config.stop_grace, events);
                    return Err(e);
                }
            }
        }
    }
}

/// Ends the job after a stop signal: no node restarts, every node stops.
fn stop_job(
    rdzv: &Rendezvous,
    restart: u32,
    node_rank: usize,
    signal: i32,
) -> Result<LaunchOutcome, LaunchError> {
    // Closing first: a node that sees the failure must also see it is final.
    let _ = rdzv.close();
    let _ = rdzv.report_failure(
        restart,
        &format!(
            "node {node_rank}'s launcher received {}",
            signal_name(signal)
        ),
    );
    Ok(interrupted(signal))
}

fn interrupted(signal: i32) -> LaunchOutcome {
    LaunchOutcome::Interrupted { signal }
}

/// Prints which worker failed, how, and its last lines.
fn report(failure: &WorkerFailure) {
    let mut text = format!("{}; stopped the other workers", failure.summary());
    if failure.last_lines.is_empty() {
        text.push_str("; it printed nothing");
    } else {
        text.push_str("; its last lines:");
        for line in &failure.last_lines {
            text.push_str(&format!("\ncohort run:   [rank{}]: {line}", failure.rank));
        }
    }
    note(&text);
}

/// The launcher's own messages, on stderr.
pub(crate) fn note(message: &str) {
    let _ = writeln!(std::io::stderr().lock(), "cohort run: {message}");
}

/// Binds the store on node 0: on `master_addr` itself when it is a loopback
/// address (a single-node job stays off the network), else on every interface.
fn host_store(
    config: &LaunchConfig,
    secret: &Option<Secret>,
) -> Result<TcpStoreServer, LaunchError> {
    let ip = match config.master_addr.parse::<IpAddr>() {
        Ok(ip) if ip.is_loopback() => ip,
        _ if config.master_addr == "localhost" => IpAddr::V4(Ipv4Addr::LOCALHOST),
        _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    };
    let port = if config.standalone {
        0
    } else {
        config.master_port
    };
    let addr = SocketAddr::new(ip, port);
    TcpStoreServer::bind_with_secret(addr, secret.clone()).map_err(|source| match source {
        StoreError::Bind { ref source, .. } if source.kind() == std::io::ErrorKind::AddrInUse => {
            LaunchError::PortInUse {
                addr: ip.to_string(),
                port,
            }
        }
        source => LaunchError::Host {
            addr: ip.to_string(),
            port,
            source,
        },
    })
}

/// Connects to the store at `addr`, retrying until it is up (other nodes may
/// start before node 0) or the join timeout passed; a stop signal meanwhile
/// ends the wait.
fn connect_store(
    addr: &str,
    config: &LaunchConfig,
    port: u16,
    secret: &Option<Secret>,
    events: &Events,
) -> Result<Wait<Arc<dyn Store>>, LaunchError> {
    let fail = |source| LaunchError::Store {
        addr: config.master_addr.clone(),
        port,
        op: "connect".to_string(),
        source,
    };
    let deadline = Instant::now() + config.join_timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        // Short attempts, so that a signal is noticed while node 0 is awaited.
        match TcpStore::connect_with_secret(addr, left.min(PEER_POLL * 4), secret.clone()) {
            Ok(_) => break,
            Err(StoreError::Connect { .. }) if Instant::now() < deadline => {}
            Err(StoreError::Connect { addr, source, .. }) => {
                return Err(fail(StoreError::Connect {
                    addr,
                    timeout: config.join_timeout,
                    source,
                }))
            }
            Err(e) => return Err(fail(e)),
        }
        if let Some(signal) = events.pending_stop() {
            return Ok(Wait::Stopped(signal));
        }
    }
    // The server is up: this connection gets the long timeout for its calls.
    let store =
        TcpStore::connect_with_secret(addr, config.join_timeout, secret.clone()).map_err(fail)?;
    Ok(Wait::Done(Arc::new(store)))
}

/// `host:port`, with brackets around an IPv6 address.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    if ok {
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "unknown".to_string()
    }
}

//! `launch`: one node agent from start to exit. Node 0 hosts the store; every
//! agent joins each restart round through it, starts its workers, watches
//! them, the store and its own signals, and stops, restarts or finishes the
//! round as the whole job does. Only the thread that calls `launch` spawns
//! workers (their parent-death signal is tied to it); it never returns while
//! a worker it started is alive.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cohort_store::auth::SECRET_ENV;
use cohort_store::{Secret, Store, StoreError, TcpStore, TcpStoreServer};

use crate::env::{self, JobShape};
use crate::events::{Event, Events};
use crate::group::{WorkerFailure, WorkerGroup, REAP_INTERVAL};
use crate::health::{AgentStatus, HealthServer, Phase};
use crate::heartbeat::{beat_interval, Heartbeat, Liveness};
use crate::output::note;
use crate::process::{signal_name, ExitReason, EXIT_NOT_RETRYABLE, EXIT_SAVED_AND_STOPPED};
use crate::rendezvous::{
    lost_detail, Interruption, JobEnd, Joined, Membership, NodeInfo, Rendezvous, RoundResult, Wait,
    PEER_POLL,
};
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
    /// The workers saved a checkpoint and stopped because a signal asked
    /// them to (exit code [`EXIT_SAVED_AND_STOPPED`]); not restarted.
    SavedAndStopped {
        /// Restarts before the last round.
        restarts: u32,
    },
}

impl LaunchOutcome {
    /// The launcher's exit code: 0, 1 for a failed job (as torchrun),
    /// [`EXIT_SAVED_AND_STOPPED`] when the workers saved and stopped on a
    /// signal, or 128 + the signal that stopped it (as a shell reports it).
    pub fn exit_code(&self) -> i32 {
        match self {
            LaunchOutcome::Succeeded { .. } => 0,
            LaunchOutcome::WorkerFailed { .. } | LaunchOutcome::NodeFailed { .. } => 1,
            LaunchOutcome::Interrupted { signal } => 128 + signal,
            LaunchOutcome::SavedAndStopped { .. } => EXIT_SAVED_AND_STOPPED,
        }
    }
}

/// How one round ended on this node.
enum RoundEnd {
    Succeeded,
    WorkerFailed(WorkerFailure),
    NodeFailed(String),
    /// A node waits to join and the round has room for it.
    Regroup,
    Stopped(i32),
    /// The workers saved and stopped on a signal (exit code
    /// [`EXIT_SAVED_AND_STOPPED`]).
    SavedAndStopped,
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
    let status = Arc::new(AgentStatus::new(config.heartbeat_timeout));
    // Up before the rendezvous, so that a probe sees an agent that waits.
    let _health = match config.health_check_port {
        Some(port) => {
            let server =
                HealthServer::start(port, status.clone()).map_err(|source| LaunchError::Agent {
                    what: format!("health-check endpoint on port {port}"),
                    source,
                })?;
            note(&format!(
                "health check: http://{}/health",
                server.local_addr()
            ));
            Some(server)
        }
        None => None,
    };

    // Binding before anything is spawned turns a taken port into one clear error.
    let server = if config.node_rank_from_store {
        host_store_if_here(config, &secret)?
    } else if config.node_rank == 0 {
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
    let found;
    let config = if config.node_rank_from_store {
        found = with_node_rank_from_store(config, &*store, server.is_some())?;
        &found
    } else {
        config
    };
    let rdzv = Rendezvous::new(
        store,
        &config.master_addr,
        port,
        NodeInfo {
            node_rank: config.node_rank,
            nproc_per_node: config.nproc_per_node,
            max_restarts: config.max_restarts,
            min_nodes: config.min_nodes(),
            max_nodes: config.nnodes,
            host: hostname(),
            pid: std::process::id(),
        },
        config.last_call,
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
    let heartbeat = Heartbeat::start(
        rdzv.store(),
        config.node_rank,
        beat_interval(config.heartbeat_timeout),
        status.clone(),
    )
    .map_err(|source| LaunchError::Agent {
        what: "heartbeat thread".into(),
        source,
    })?;
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

    let agent = Agent {
        config,
        rdzv: &rdzv,
        events: &events,
        status: &status,
        thread_vars,
        run_id,
        launch_time,
        port,
    };
    let outcome = agent.run_rounds();
    status.set_phase(Phase::Finished);
    if let Ok((_, Some(last))) = &outcome {
        // Leaving is courtesy to the other agents; a store that is gone by
        // now does not change how this node's job ended.
        let _ = rdzv.leave(
            last.round,
            last.nodes.len(),
            config.stop_grace + LEAVE_MARGIN,
            &events,
        );
    }
    drop(heartbeat);
    drop(server);
    outcome.map(|(outcome, _)| outcome)
}

/// One node agent between joining the job and leaving it.
struct Agent<'a> {
    config: &'a LaunchConfig,
    rdzv: &'a Rendezvous,
    events: &'a Events,
    status: &'a AgentStatus,
    thread_vars: Vec<(&'static str, String)>,
    run_id: String,
    launch_time: SystemTime,
    /// The store's port, as the workers reach it.
    port: u16,
}

impl Agent<'_> {
    /// Runs rounds until the job ends; returns how, with the last round
    /// this node ran in.
    fn run_rounds(&self) -> Result<(LaunchOutcome, Option<Membership>), LaunchError> {
        let (config, rdzv, events) = (self.config, self.rdzv, self.events);
        let node_rank = config.node_rank;
        let mut liveness = Liveness::new(config.heartbeat_timeout);
        let mut round = rdzv.current_round()?;
        loop {
            self.status.set_phase(Phase::Rendezvous);
            let members = match rdzv.join(round, config.join_timeout, events)? {
                Wait::Done(Joined::Member(members)) => members,
                Wait::Done(Joined::Late) => {
                    note(&format!(
                        "round {round} runs without this node; waiting to join the next"
                    ));
                    round += 1;
                    continue;
                }
                Wait::Done(Joined::Closed(end)) => {
                    note("the job ended before this node got to run");
                    return Ok((closed_outcome(end), None));
                }
                Wait::Stopped(signal) => return self.stop_job(round, signal),
            };
            let master = rdzv.worker_master(
                &members,
                || self.pick_worker_master(),
                config.join_timeout,
                events,
            )?;
            let (master_addr, master_port) = match master {
                Wait::Done(master) => master,
                Wait::Stopped(signal) => return self.stop_job(round, signal),
            };
            let job = self.job_shape(&members, master_addr, master_port);
            let world = job.nnodes * job.nproc_per_node;
            if config.is_elastic() {
                note(&format!(
                    "round {round}: {} node(s) (node ranks {:?}), world size {world}",
                    members.nodes.len(),
                    members.nodes
                ));
            }
            self.status
                .set_round(round, members.restarts, members.nodes.len(), world);
            liveness.watch(&members.others(node_rank));
            let mut group = match WorkerGroup::start(config, &job, &self.thread_vars, round, events)
            {
                Ok(group) => group,
                Err(e) => {
                    // The other nodes must not wait for workers that never came.
                    let _ = rdzv.close(&JobEnd::Stopped(format!("node {node_rank}: {e}")));
                    let _ = rdzv.report_failure(round, &format!("node {node_rank}: {e}"));
                    return Err(e);
                }
            };
            self.status.set_phase(Phase::Running);
            let end = watch(&mut group, config, rdzv, &members, &mut liveness, events)?;
            self.status.set_phase(Phase::Stopping);
            let failure = match end {
                RoundEnd::Succeeded => match rdzv.finish(&members, &mut liveness, events)? {
                    Wait::Done(RoundResult::AllSucceeded) => {
                        rdzv.close(&JobEnd::Succeeded)?;
                        let outcome = LaunchOutcome::Succeeded {
                            restarts: members.restarts,
                        };
                        return Ok((outcome, Some(members)));
                    }
                    Wait::Done(RoundResult::Failed(detail)) => {
                        note(&format!("the job failed on another node: {detail}"));
                        Failed::Node(detail)
                    }
                    Wait::Stopped(signal) => return self.stop_job(round, signal),
                },
                RoundEnd::WorkerFailed(failure) => {
                    rdzv.report_failure(
                        round,
                        &format!("node {node_rank}: {}", failure.summary()),
                    )?;
                    Failed::Worker(failure)
                }
                RoundEnd::NodeFailed(detail) => {
                    note(&format!(
                        "stopped this node's workers: the job failed on another node: {detail}"
                    ));
                    Failed::Node(detail)
                }
                RoundEnd::Regroup => {
                    note("a node is waiting to join: restarting the workers with it (not counted against --max-restarts)");
                    round += 1;
                    continue;
                }
                RoundEnd::Stopped(signal) => return self.stop_job(round, signal),
                RoundEnd::SavedAndStopped => {
                    // The store stays open: the other nodes' workers are
                    // stopping after the same step and must not be hurried.
                    note(&format!(
                        "the workers saved a checkpoint and stopped on request (exit code \
                         {EXIT_SAVED_AND_STOPPED}); not restarting: the same command resumes"
                    ));
                    let outcome = LaunchOutcome::SavedAndStopped {
                        restarts: members.restarts,
                    };
                    return Ok((outcome, None));
                }
            };
            let permanent = matches!(&failure,
                Failed::Worker(f) if f.reason == ExitReason::Code(EXIT_NOT_RETRYABLE));
            if permanent && members.restarts < config.max_restarts {
                note(&format!(
                    "not restarting: the worker failed with an error a restart cannot fix \
                     (exit code {EXIT_NOT_RETRYABLE}: bad settings or input)"
                ));
            }
            if !permanent && members.restarts < config.max_restarts && rdzv.closed()?.is_none() {
                note(&format!(
                    "restarting the workers (restart {} of {})",
                    members.restarts + 1,
                    config.max_restarts
                ));
                round += 1;
                continue;
            }
            let why = match &failure {
                Failed::Worker(f) => format!("node {node_rank}: {}", f.summary()),
                Failed::Node(detail) => detail.clone(),
            };
            rdzv.close(&JobEnd::Stopped(why))?;
            if config.max_restarts > 0 {
                note(&format!("giving up after {} restarts", members.restarts));
            }
            let restarts = members.restarts;
            let outcome = match failure {
                Failed::Worker(failure) => LaunchOutcome::WorkerFailed { failure, restarts },
                Failed::Node(detail) => LaunchOutcome::NodeFailed { detail, restarts },
            };
            return Ok((outcome, Some(members)));
        }
    }

    /// What this node's workers are told about round `members`.
    fn job_shape(&self, members: &Membership, master_addr: String, master_port: u16) -> JobShape {
        JobShape {
            nproc_per_node: self.config.nproc_per_node,
            nnodes: members.nodes.len(),
            group_rank: members.group_rank(self.config.node_rank),
            store_addr: self.config.master_addr.clone(),
            store_port: self.port,
            master_addr,
            master_port,
            restarts: members.restarts,
            max_restarts: self.config.max_restarts,
            run_id: self.run_id.clone(),
            launch_time: self.launch_time,
        }
    }

    /// This node's address as the other nodes reach it, and a port free on
    /// every interface now, for a torch.distributed rank 0 to bind.
    fn pick_worker_master(&self) -> std::io::Result<(String, u16)> {
        let port = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0))?
            .local_addr()?
            .port();
        if self.config.node_rank == 0 {
            // The name the other nodes already use to reach this one.
            return Ok((self.config.master_addr.clone(), port));
        }
        // Another node leads the round only when node 0 sits it out; its
        // address is the one its packets to the store leave from.
        let probe = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
        probe.connect((self.config.master_addr.as_str(), self.port))?;
        Ok((probe.local_addr()?.ip().to_string(), port))
    }

    /// Ends the job after a stop signal: no node restarts, every node stops.
    fn stop_job(
        &self,
        round: u32,
        signal: i32,
    ) -> Result<(LaunchOutcome, Option<Membership>), LaunchError> {
        let why = format!(
            "node {}'s launcher received {}",
            self.config.node_rank,
            signal_name(signal)
        );
        // Closing first: a node that sees the failure must also see it is final.
        let _ = self.rdzv.close(&JobEnd::Stopped(why.clone()));
        let _ = self.rdzv.report_failure(round, &why);
        Ok((interrupted(signal), None))
    }
}

/// What a node that never ran in the job's last round reports.
fn closed_outcome(end: JobEnd) -> LaunchOutcome {
    match end {
        JobEnd::Succeeded => LaunchOutcome::Succeeded { restarts: 0 },
        JobEnd::Stopped(detail) => LaunchOutcome::NodeFailed {
            detail,
            restarts: 0,
        },
    }
}

/// Watches one round until every worker exited, one failed, another node
/// reported a failure or was lost, a waiting node asks to join, or the
/// launcher was signalled; in every case but the first, this node's
/// workers are stopped before it returns.
fn watch(
    group: &mut WorkerGroup,
    config: &LaunchConfig,
    rdzv: &Rendezvous,
    members: &Membership,
    liveness: &mut Liveness,
    events: &Events,
) -> Result<RoundEnd, LaunchError> {
    let multi_node = config.nnodes > 1;
    let tick = if multi_node { PEER_POLL } else { REAP_INTERVAL };
    loop {
        match events.next(tick) {
            Some(Event::Stop(signal)) => {
                note(&format!(
                    "received {}, stopping the workers",
                    signal_name(signal)
                ));
                group.stop(signal, config.stop_grace, events);
                return Ok(RoundEnd::Stopped(signal));
            }
            Some(Event::Forward(signal)) => {
                note(&format!(
                    "received {}, forwarded to the workers (cohort's save at their next step \
                     and stop)",
                    signal_name(signal)
                ));
                group.signal(signal);
            }
            Some(Event::ChildExited) | None => {}
        }
        let exited = group.reap();
        let exits: Vec<(usize, ExitReason)> =
            exited.into_iter().map(|i| (i, group.exit_of(i))).collect();
        if exits
            .iter()
            .any(|(_, e)| *e == ExitReason::Code(EXIT_SAVED_AND_STOPPED))
        {
            return Ok(saved_and_stopped(group, config, events));
        }
        if let Some(first) = reported_failure(&exits) {
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
        if let Some((index, silent)) = group.silent_worker(config.worker_timeout) {
            // Before the group is stopped: the others' rings still say where they wait.
            if let Some(line) = config.explain_silence.and_then(|f| f(rdzv.root_store())) {
                note(&line);
            }
            let interrupted = group.stop(libc::SIGTERM, config.stop_grace, events);
            let failure = group.silent_failure(index, silent);
            report(&failure);
            return Ok(match interrupted {
                Some(signal) => RoundEnd::Stopped(signal),
                None => RoundEnd::WorkerFailed(failure),
            });
        }
        if !multi_node {
            continue;
        }
        let end = match peers(rdzv, members, liveness) {
            Ok(None) => continue,
            Ok(Some(Interruption::Failed(detail))) => RoundEnd::NodeFailed(detail),
            Ok(Some(Interruption::Regroup)) => RoundEnd::Regroup,
            Err(e) => {
                note("lost the rendezvous store, stopping the workers");
                group.stop(libc::SIGTERM, config.stop_grace, events);
                return Err(e);
            }
        };
        return Ok(match group.stop(libc::SIGTERM, config.stop_grace, events) {
            Some(signal) => RoundEnd::Stopped(signal),
            None => end,
        });
    }
}

/// How long the other workers get to finish their save and exit once one
/// worker exited with [`EXIT_SAVED_AND_STOPPED`], before they are stopped.
const SAVE_WAIT: Duration = Duration::from_secs(120);

/// A worker saved and stopped on a signal: the others stop after the same
/// step (the ranks agree on it), so they are left to finish their save and
/// exit on their own, up to [`SAVE_WAIT`], not hurried with SIGTERM.
fn saved_and_stopped(group: &mut WorkerGroup, config: &LaunchConfig, events: &Events) -> RoundEnd {
    let deadline = std::time::Instant::now() + SAVE_WAIT;
    while !group.all_exited() && std::time::Instant::now() < deadline {
        if let Some(Event::Stop(signal)) = events.next(REAP_INTERVAL) {
            group.stop(signal, config.stop_grace, events);
            return RoundEnd::Stopped(signal);
        }
        group.reap();
    }
    if !group.all_exited() {
        note("a worker did not exit after the others saved and stopped; stopping it");
        if let Some(signal) = group.stop(libc::SIGTERM, config.stop_grace, events) {
            return RoundEnd::Stopped(signal);
        }
    }
    group.drain_output();
    RoundEnd::SavedAndStopped
}

/// Which of the workers reaped in one look to report as the round's failure: one killed by a
/// signal if any, else the first that failed. When a worker is killed, its peers fail too, as
/// soon as their connections to it close; a loaded host can let several exits pile up before
/// the launcher looks, and naming a peer would hide the cause.
fn reported_failure(exits: &[(usize, ExitReason)]) -> Option<usize> {
    let failed = || exits.iter().filter(|(_, e)| !e.success());
    failed()
        .find(|(_, e)| matches!(e, ExitReason::Signal(_)))
        .or_else(|| failed().next())
        .map(|&(i, _)| i)
}

/// Whether the other nodes end the round early: a failure they reported, a
/// node that stopped beating (reported here for all), or a waiting node.
fn peers(
    rdzv: &Rendezvous,
    members: &Membership,
    liveness: &mut Liveness,
) -> Result<Option<Interruption>, LaunchError> {
    if let Some(interruption) = rdzv.interruption(members)? {
        if interruption == Interruption::Regroup {
            rdzv.report_regroup(members.round)?;
        }
        return Ok(Some(interruption));
    }
    if let Some(lost) = rdzv.lost_node(liveness)? {
        let detail = lost_detail(lost);
        note(&format!("{detail}, stopping the workers"));
        rdzv.report_failure(members.round, &detail)?;
        return Ok(Some(Interruption::Failed(detail)));
    }
    Ok(None)
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

/// c10d's rendezvous: hosts the store when `master_addr` is an address of this machine and no
/// other agent here hosts it already (its port is taken); otherwise `None`, and this agent
/// reaches the store as a client.
fn host_store_if_here(
    config: &LaunchConfig,
    secret: &Option<Secret>,
) -> Result<Option<TcpStoreServer>, LaunchError> {
    use std::net::ToSocketAddrs;
    let here = (config.master_addr.as_str(), 0)
        .to_socket_addrs()
        .map(|mut addrs| addrs.any(|a| TcpListener::bind(a).is_ok()))
        .unwrap_or(false);
    if !here {
        return Ok(None);
    }
    match host_store(config, secret) {
        Ok(server) => Ok(Some(server)),
        Err(LaunchError::PortInUse { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// `config` with the node rank c10d's rendezvous gives this agent: 0 for the one that hosts
/// the store, else the next of 1.. from a counter in the store.
fn with_node_rank_from_store(
    config: &LaunchConfig,
    store: &dyn Store,
    hosts: bool,
) -> Result<LaunchConfig, LaunchError> {
    let node_rank = if hosts {
        0
    } else {
        let key = "cohort_launcher/c10d_node_ranks";
        let n = store.add(key, 1).map_err(|source| LaunchError::Store {
            addr: config.master_addr.clone(),
            port: config.master_port,
            op: format!("add {key}"),
            source,
        })?;
        n as usize
    };
    let found = LaunchConfig {
        node_rank,
        ..config.clone()
    };
    found.validate()?;
    note(&format!(
        "c10d rendezvous at {}:{}: this is node {node_rank}",
        config.master_addr, config.master_port
    ));
    Ok(found)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_killed_worker_is_reported_before_the_peers_that_lost_it() {
        use ExitReason::{Code, Signal, Silent};
        // rank 0 exited because rank 1, killed, closed its connection: both reaped in one look
        assert_eq!(reported_failure(&[(0, Code(1)), (1, Signal(9))]), Some(1));
        assert_eq!(reported_failure(&[(0, Code(0)), (2, Code(3))]), Some(2));
        assert_eq!(reported_failure(&[(1, Code(3)), (2, Code(1))]), Some(1));
        assert_eq!(reported_failure(&[(0, Silent(5))]), Some(0));
        assert_eq!(reported_failure(&[(0, Code(0)), (1, Code(0))]), None);
        assert_eq!(reported_failure(&[]), None);
    }
}

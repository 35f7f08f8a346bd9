//! `spawn`: run one function per rank and join them (mp.spawn's role).
//!
//! [`threads`] runs `f(&group)` on N threads of this process, each with its
//! own [`ProcessGroup`] over one shared [`HashStore`] and real loopback
//! sockets: what tests and single-machine experiments need. [`processes`]
//! re-executes a program N times with the `env://` variables set, hosting
//! the store server itself, for code that needs real processes.
//!
//! Both return the *first* failure in time (the root cause; the other ranks
//! typically fail afterwards because the failed rank's connections closed),
//! and neither can hang: groups have timeouts, and `processes` kills the
//! survivors once one rank fails or its deadline passes.

use std::ffi::OsString;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cohort_store::auth::{Secret, SECRET_ENV};
use cohort_store::{HashStore, Store, TcpStoreServer};

use crate::config::GroupOptions;
use crate::error::CommError;
use crate::group::ProcessGroup;
use crate::init::STORE_HOSTED_VAR;

/// Why a spawned run failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpawnError {
    /// The ranks could not be set up (bad options, rendezvous failed).
    #[error("spawn: setting up the ranks failed: {0}")]
    Setup(#[from] CommError),
    /// A rank's function returned an error or panicked.
    #[error("spawn: rank {rank} failed: {message}")]
    Failed {
        /// The rank.
        rank: usize,
        /// Its error or panic message.
        message: String,
    },
    /// A rank's process exited unsuccessfully.
    #[error("spawn: rank {rank} (pid {pid}) exited with {status}")]
    Exited {
        /// The rank.
        rank: usize,
        /// Its process id.
        pid: u32,
        /// Exit code or signal.
        status: ExitStatus,
    },
    /// The processes did not finish within the deadline and were killed.
    #[error("spawn: ranks {ranks:?} still running after {timeout:?}; killed")]
    Timeout {
        /// The ranks that were still running.
        ranks: Vec<usize>,
        /// The deadline.
        timeout: Duration,
    },
    /// Starting a process or hosting the store failed.
    #[error("spawn: {context}: {detail}")]
    Start {
        /// What was being done.
        context: String,
        /// The error.
        detail: String,
    },
}

/// Runs `f(&group)` for ranks 0..`world` on threads, with group settings
/// from the environment ([`GroupOptions::from_env`]); returns the results
/// by rank, or the first failure.
pub fn threads<R, E, F>(world: usize, f: F) -> Result<Vec<R>, SpawnError>
where
    R: Send,
    E: std::fmt::Display,
    F: Fn(&ProcessGroup) -> Result<R, E> + Sync,
{
    threads_with(world, GroupOptions::from_env()?, f)
}

/// [`threads`] with explicit group settings (a short timeout in tests).
pub fn threads_with<R, E, F>(world: usize, opts: GroupOptions, f: F) -> Result<Vec<R>, SpawnError>
where
    R: Send,
    E: std::fmt::Display,
    F: Fn(&ProcessGroup) -> Result<R, E> + Sync,
{
    let store: Arc<dyn Store> = Arc::new(HashStore::with_timeout(opts.timeout));
    let first: Mutex<Option<SpawnError>> = Mutex::new(None);
    let fail = |e: SpawnError| {
        first
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(e);
    };
    let results: Vec<Option<R>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (store, opts, f, fail) = (store.clone(), opts.clone(), &f, &fail);
                s.spawn(move || {
                    let pg = match ProcessGroup::new(store, rank, world, opts) {
                        Ok(pg) => pg,
                        Err(e) => {
                            fail(SpawnError::Setup(e));
                            return None;
                        }
                    };
                    // The group lives until the failure is recorded, so that
                    // the root cause is recorded before peers see its
                    // connections close.
                    let r = match catch_unwind(AssertUnwindSafe(|| f(&pg))) {
                        Ok(Ok(r)) => Some(r),
                        Ok(Err(e)) => {
                            fail(SpawnError::Failed {
                                rank,
                                message: e.to_string(),
                            });
                            None
                        }
                        Err(p) => {
                            let message = p
                                .downcast_ref::<&str>()
                                .map(|s| format!("panicked: {s}"))
                                .or_else(|| {
                                    p.downcast_ref::<String>().map(|s| format!("panicked: {s}"))
                                })
                                .unwrap_or_else(|| "panicked".to_string());
                            fail(SpawnError::Failed { rank, message });
                            None
                        }
                    };
                    drop(pg);
                    r
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().ok().flatten())
            .collect()
    });
    if let Some(e) = first.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    Ok(results
        .into_iter()
        .map(|r| r.expect("every rank succeeded"))
        .collect())
}

/// How [`processes`] starts each rank.
#[derive(Clone, Debug)]
pub struct ProcessOptions {
    /// The program (default: this executable).
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Extra environment variables for every rank.
    pub env: Vec<(OsString, OsString)>,
    /// Kill everything and fail after this long.
    pub timeout: Duration,
}

impl ProcessOptions {
    /// This executable with `args`, a 30-minute deadline.
    pub fn current_exe<I: IntoIterator<Item = S>, S: Into<OsString>>(
        args: I,
    ) -> Result<ProcessOptions, SpawnError> {
        let program = std::env::current_exe().map_err(|e| SpawnError::Start {
            context: "finding this executable".to_string(),
            detail: e.to_string(),
        })?;
        Ok(ProcessOptions {
            program,
            args: args.into_iter().map(Into::into).collect(),
            env: Vec::new(),
            timeout: crate::config::DEFAULT_TIMEOUT,
        })
    }
}

/// Starts `world` copies of `opts.program` with MASTER_ADDR, MASTER_PORT,
/// RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and
/// `COHORT_STORE_HOSTED=1` set (this process hosts the store server on a
/// free loopback port), and a fresh job secret in `COHORT_SECRET` (the
/// store and the ranks' sockets admit only processes that know it; an
/// `opts.env` entry for it wins), so that each can call
/// [`init_process_group`](crate::init_process_group)`("tcp", "env://", ..)`.
/// Waits for all; when one fails, kills the others and returns that failure.
pub fn processes(world: usize, opts: &ProcessOptions) -> Result<(), SpawnError> {
    let start_err = |context: &str, e: &dyn std::fmt::Display| SpawnError::Start {
        context: context.to_string(),
        detail: e.to_string(),
    };
    let secret = match opts.env.iter().find(|(k, _)| k == SECRET_ENV) {
        Some((_, v)) if v.is_empty() => None,
        Some((_, v)) => Some(
            Secret::from_hex(&v.to_string_lossy(), SECRET_ENV)
                .map_err(|e| start_err("the job secret", &e))?,
        ),
        None => Some(Secret::generate().map_err(|e| start_err("making a job secret", &e))?),
    };
    let hex = secret.as_ref().map_or(String::new(), Secret::to_hex);
    let server = TcpStoreServer::bind_with_secret("127.0.0.1:0", secret)
        .map_err(|e| start_err("hosting the store", &e))?;
    let port = server.local_addr().port();
    let mut children: Vec<Option<Child>> = Vec::with_capacity(world);
    for rank in 0..world {
        let child = Command::new(&opts.program)
            .args(&opts.args)
            .env(SECRET_ENV, &hex)
            .envs(opts.env.iter().map(|(k, v)| (k, v)))
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", world.to_string())
            .env(STORE_HOSTED_VAR, "1")
            .spawn();
        match child {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                kill_all(&mut children);
                return Err(SpawnError::Start {
                    context: format!("starting rank {rank} ({})", opts.program.display()),
                    detail: e.to_string(),
                });
            }
        }
    }
    let deadline = Instant::now() + opts.timeout;
    loop {
        let mut running = Vec::new();
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            match child.try_wait() {
                Ok(Some(status)) if status.success() => *slot = None,
                Ok(Some(status)) => {
                    let pid = child.id();
                    *slot = None;
                    kill_all(&mut children);
                    return Err(SpawnError::Exited { rank, pid, status });
                }
                Ok(None) => running.push(rank),
                Err(e) => {
                    kill_all(&mut children);
                    return Err(SpawnError::Start {
                        context: format!("waiting for rank {rank}"),
                        detail: e.to_string(),
                    });
                }
            }
        }
        if running.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            kill_all(&mut children);
            return Err(SpawnError::Timeout {
                ranks: running,
                timeout: opts.timeout,
            });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn kill_all(children: &mut [Option<Child>]) {
    for c in children.iter_mut().flatten() {
        // Already exited is fine: the goal is that none survives.
        let _ = c.kill();
        let _ = c.wait();
    }
}

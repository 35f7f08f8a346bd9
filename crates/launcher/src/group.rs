//! `WorkerGroup`: the workers of one node in one restart round. It starts
//! them (all at once, nothing waits for one to be ready before the next),
//! reaps them as they exit and stops them (SIGTERM to each process group,
//! SIGKILL after the grace period). It is the only code that reaps workers.
//! It signals a reaped worker's group only once, at the end of a stop, to
//! kill what the worker left behind; a pid cannot be recycled while it still
//! names a process group with members.

use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::env::{JobShape, NODE_ID};
use crate::events::{Event, Events};
use crate::output::{self, Sink, Tail};
use crate::process::{self, ExitReason};
use crate::worker_beat::{self, BeatDir, HEARTBEAT_FILE_VAR};
use crate::worker_error;
use crate::{LaunchConfig, LaunchError};

/// How long to wait for a finished worker's last output before reporting.
const OUTPUT_DRAIN: Duration = Duration::from_millis(500);

/// Reaping falls back to polling at this interval in case a SIGCHLD is
/// coalesced with one that was already handled.
pub(crate) const REAP_INTERVAL: Duration = Duration::from_millis(200);

/// How a worker of a failed round ended.
#[derive(Debug, Clone)]
pub struct WorkerFailure {
    /// Global rank.
    pub rank: usize,
    /// Rank on its node.
    pub local_rank: usize,
    /// Its node.
    pub node_rank: usize,
    /// Its process id.
    pub pid: u32,
    /// Its exit code or signal.
    pub reason: ExitReason,
    /// The restart round it ran in.
    pub restart: u32,
    /// Its last output lines (stdout and stderr), oldest first.
    pub last_lines: Vec<String>,
    /// The error it recorded in `TORCHELASTIC_ERROR_FILE` (torch's `@record`), if any.
    pub error: Option<String>,
}

impl WorkerFailure {
    /// One line: which rank failed and how.
    pub fn summary(&self) -> String {
        let mut line = format!(
            "rank {} (local rank {} on node {}, pid {}) failed with {}",
            self.rank, self.local_rank, self.node_rank, self.pid, self.reason
        );
        if let Some(error) = &self.error {
            line.push_str(": ");
            line.push_str(error);
        }
        line
    }
}

struct Worker {
    rank: usize,
    local_rank: usize,
    pid: u32,
    /// `None` once reaped.
    child: Option<Child>,
    exit: Option<ExitReason>,
    tail: Arc<Tail>,
}

pub(crate) struct WorkerGroup {
    workers: Vec<Worker>,
    node_rank: usize,
    restart: u32,
    /// Where the workers beat (see `worker_beat`).
    beats: BeatDir,
}

impl WorkerGroup {
    /// Starts this node's workers for round `restart`. If one cannot be
    /// started, the ones already running are stopped before returning.
    pub fn start(
        config: &LaunchConfig,
        job: &JobShape,
        thread_vars: &[(&'static str, String)],
        restart: u32,
        events: &Events,
    ) -> Result<Self, LaunchError> {
        let beats = BeatDir::create(restart).map_err(|source| LaunchError::Spawn {
            rank: job.rank(0),
            program: "the workers' heartbeat directory".into(),
            source,
        })?;
        let mut group = WorkerGroup {
            workers: Vec::with_capacity(config.nproc_per_node),
            node_rank: config.node_rank,
            restart,
            beats,
        };
        for local_rank in 0..config.nproc_per_node {
            let rank = job.rank(local_rank);
            let error_file = group.beats.error_file(rank).to_string_lossy().into_owned();
            let mut vars = job.worker_vars(local_rank, restart, &error_file);
            vars.extend_from_slice(thread_vars);
            // A node the user named stays theirs.
            if std::env::var_os(NODE_ID).is_none() {
                vars.extend(job.node_id().map(|id| (NODE_ID, id)));
            }
            let beat = group.beats.file(rank).to_string_lossy().into_owned();
            vars.push((HEARTBEAT_FILE_VAR, beat));
            let spawned = process::spawn(&config.program, &config.args, &vars)
                .and_then(|child| group.adopt(child, rank, local_rank));
            if let Err(source) = spawned {
                group.stop(libc::SIGTERM, config.stop_grace, events);
                return Err(LaunchError::Spawn {
                    rank,
                    program: config.program.clone(),
                    source,
                });
            }
        }
        Ok(group)
    }

    fn adopt(&mut self, mut child: Child, rank: usize, local_rank: usize) -> std::io::Result<()> {
        let tail = Tail::new(2);
        let prefix = format!("[rank{rank}]: ");
        let pid = child.id();
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = child.stderr.take().expect("stderr is piped");
        self.workers.push(Worker {
            rank,
            local_rank,
            pid,
            child: Some(child),
            exit: None,
            tail: tail.clone(),
        });
        output::forward(stdout, prefix.clone(), Sink::Stdout, tail.clone())?;
        output::forward(stderr, prefix, Sink::Stderr, tail)
    }

    /// Reaps the workers that exited; returns the indices of those that
    /// exited since the last call.
    pub fn reap(&mut self) -> Vec<usize> {
        let mut exited = Vec::new();
        for (i, worker) in self.workers.iter_mut().enumerate() {
            let Some(child) = worker.child.as_mut() else {
                continue;
            };
            // An error here means the child was already reaped, which only
            // this group does; treat it as gone rather than loop on it.
            let status = match child.try_wait() {
                Ok(Some(status)) => ExitReason::from_status(status),
                Ok(None) => continue,
                Err(_) => ExitReason::Code(-1),
            };
            worker.exit = Some(status);
            worker.child = None;
            exited.push(i);
        }
        exited
    }

    /// Whether every worker has been reaped.
    pub fn all_exited(&self) -> bool {
        self.workers.iter().all(|w| w.child.is_none())
    }

    /// How worker `index` exited; it must have been reaped.
    pub fn exit_of(&self, index: usize) -> ExitReason {
        self.workers[index].exit.unwrap_or(ExitReason::Code(-1))
    }

    /// The failure of worker `index`, with its last output lines.
    pub fn failure(&self, index: usize) -> WorkerFailure {
        let w = &self.workers[index];
        w.tail.wait_closed(OUTPUT_DRAIN);
        WorkerFailure {
            rank: w.rank,
            local_rank: w.local_rank,
            node_rank: self.node_rank,
            pid: w.pid,
            reason: w.exit.unwrap_or(ExitReason::Code(-1)),
            restart: self.restart,
            last_lines: w.tail.lines(),
            error: worker_error::read(&self.beats.error_file(w.rank)),
        }
    }

    /// A running worker that has beaten but not for `timeout` (zero: none
    /// is watched), as its index and how long it has been silent.
    pub fn silent_worker(&self, timeout: Duration) -> Option<(usize, Duration)> {
        if timeout.is_zero() {
            return None;
        }
        self.workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.child.is_some())
            .find_map(|(i, w)| {
                let silent = worker_beat::silent_for(&self.beats.file(w.rank))?;
                (silent >= timeout).then_some((i, silent))
            })
    }

    /// The failure of worker `index`, found silent for `silent` and stopped.
    pub fn silent_failure(&self, index: usize, silent: Duration) -> WorkerFailure {
        WorkerFailure {
            reason: ExitReason::Silent(silent.as_secs()),
            ..self.failure(index)
        }
    }

    /// Sends `signal` to every worker that has not been reaped.
    pub fn signal(&self, signal: i32) {
        for worker in self.workers.iter().filter(|w| w.child.is_some()) {
            process::signal_group(worker.pid, signal);
        }
    }

    /// Stops every running worker: `first` (SIGTERM, or the signal the
    /// launcher received), then SIGKILL after `grace` or at once if another
    /// stop signal arrives meanwhile, and reaps them all. Returns the stop
    /// signal the launcher received meanwhile, if any.
    pub fn stop(&mut self, first: i32, grace: Duration, events: &Events) -> Option<i32> {
        let mut received = None;
        self.reap();
        if !self.all_exited() {
            self.signal(first);
            // A stopped worker (SIGSTOP, a debugger's halt) would hold the
            // signal pending until the grace period ran out.
            self.signal(libc::SIGCONT);
            let deadline = Instant::now() + grace;
            while !self.all_exited() {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                if let Some(Event::Stop(signal)) = events.next(left.min(REAP_INTERVAL)) {
                    received = Some(signal);
                    break;
                }
                self.reap();
            }
            self.signal(libc::SIGKILL);
        }
        for worker in &mut self.workers {
            if let Some(mut child) = worker.child.take() {
                // SIGKILL cannot be ignored, so this returns promptly.
                worker.exit = child.wait().ok().map(ExitReason::from_status);
            }
            // Processes the worker started may remain in its group.
            process::signal_group(worker.pid, libc::SIGKILL);
        }
        for worker in &self.workers {
            worker.tail.wait_closed(OUTPUT_DRAIN);
        }
        received
    }

    /// Waits for the output of every worker to be forwarded (after a round
    /// ended on its own).
    pub fn drain_output(&self) {
        for worker in &self.workers {
            worker.tail.wait_closed(OUTPUT_DRAIN);
        }
    }
}

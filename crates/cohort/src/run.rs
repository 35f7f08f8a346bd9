//! `cohort run`: torchrun's command line turned into a `LaunchConfig`, the
//! launch, and its outcome turned into an exit code. It only wires; the
//! launcher itself is `cohort-launcher`.

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::CommandFactory;
use cohort_launcher::{launch, LaunchConfig, LaunchError, DEFAULT_MASTER_PORT};
use cohort_store::Secret;

/// Start the workers of a job on this node, watch them, restart them (torchrun).
///
/// Each worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
/// GROUP_RANK, MASTER_ADDR, MASTER_PORT, COHORT_RESTART_COUNT and
/// COHORT_NUM_THREADS / OMP_NUM_THREADS (the cores divided among the local
/// workers, unless already set), and COHORT_SECRET, the job secret without
/// which nobody gets into the job's store or sockets. With --nnodes MIN:MAX
/// nodes may join late or leave: after a failure or a lost node (no
/// heartbeat for --heartbeat-timeout) the workers restart on the nodes still
/// alive with new ranks, and `cohort train --out DIR` resumes from DIR.
/// Examples:
///
///   cohort run -n 2 train --steps 100        (cohort's own subcommand)
///
///   cohort run --standalone -n 4 -- python3 train.py
///
///   cohort run --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 -n 2 train
///
///   cohort run --nnodes 1:4 --node-rank 3 --master-addr 10.0.0.1 --max-restarts 3 -n 2 train --out ckpt
#[derive(clap::Args, Debug)]
#[command(verbatim_doc_comment)]
pub struct RunArgs {
    /// Workers on this node.
    #[arg(short = 'n', long, alias = "nproc_per_node", default_value_t = 1)]
    nproc_per_node: usize,
    /// Nodes in the job, N or MIN:MAX (elastic: each round runs on the nodes
    /// that joined, at least MIN); run `cohort run` once per node.
    #[arg(long, value_name = "N|MIN:MAX", default_value = "1")]
    nnodes: String,
    /// This node's rank, 0..nnodes; node 0 hosts the rendezvous store.
    #[arg(long, alias = "node_rank", default_value_t = 0)]
    node_rank: usize,
    /// Address of node 0, as the other nodes and the workers reach it.
    #[arg(long, alias = "master_addr", default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the rendezvous store on node 0.
    #[arg(long, alias = "master_port", default_value_t = DEFAULT_MASTER_PORT)]
    master_port: u16,
    /// Single node on a free port (--master-port is ignored).
    #[arg(long)]
    standalone: bool,
    /// Restart the whole group up to this many times after a failure.
    #[arg(long, alias = "max_restarts", default_value_t = 0)]
    max_restarts: u32,
    /// Seconds between SIGTERM and SIGKILL when stopping workers.
    #[arg(long, value_name = "SECONDS", default_value_t = 5.0)]
    grace_period: f64,
    /// Seconds to wait for every node to join.
    #[arg(long, value_name = "SECONDS", default_value_t = 600.0)]
    join_timeout: f64,
    /// Elastic jobs: seconds a round waits for more nodes once MIN have joined.
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    last_call_timeout: f64,
    /// Seconds without a heartbeat after which a node counts as lost.
    #[arg(long, value_name = "SECONDS", default_value_t = 15.0)]
    heartbeat_timeout: f64,
    /// Seconds a worker that beats (every cohort subcommand does, from a thread of its own)
    /// may go without a heartbeat before it counts as frozen (SIGSTOP, hung): the workers
    /// are stopped and restarted, naming it; 0 disables the check.
    #[arg(long, value_name = "SECONDS", default_value_t = 60.0)]
    worker_timeout: f64,
    /// Serve this agent's health at http://HOST:PORT/health (0: a free port).
    #[arg(long, value_name = "PORT", env = "TORCHELASTIC_HEALTH_CHECK_PORT")]
    health_check_port: Option<u16>,
    /// The job secret, 64 hex characters, the same on every node: the store
    /// and the workers' sockets admit only processes that know it. Visible
    /// to other users in `ps`: prefer --secret-file or COHORT_SECRET. A
    /// single-node job without one makes its own.
    #[arg(long, value_name = "HEX", conflicts_with = "secret_file")]
    secret: Option<String>,
    /// Read the job secret (64 hex characters) from this file.
    #[arg(long, value_name = "PATH")]
    secret_file: Option<PathBuf>,
    /// The worker: a cohort subcommand and its arguments (`train --steps 3`),
    /// or `-- PROGRAM ARGS...` for any program.
    #[arg(trailing_var_arg = true, required = true, value_name = "COMMAND")]
    command: Vec<OsString>,
}

/// Runs the launch and exits with its outcome's code (0 on success, 1 when a
/// worker failed, 128+N after signal N).
pub fn main(args: RunArgs) -> anyhow::Result<()> {
    let after_dashes = command_follows_dashes(std::env::args_os(), args.command.len());
    let config = args.into_config(after_dashes)?;
    let outcome = match launch(&config) {
        Err(e @ LaunchError::Spawn { .. }) if after_dashes => {
            let name = config.program.to_string_lossy().into_owned();
            if subcommands().contains(&name) {
                return Err(anyhow::Error::new(e).context(format!(
                    "`{name}` is a cohort subcommand: drop the `--` to run it as the worker \
                     (cohort run -n 2 {name} ...)"
                )));
            }
            Err(e)
        }
        other => other,
    }?;
    let code = outcome.exit_code();
    if code != 0 {
        std::process::exit(code);
    }
    Ok(())
}

impl RunArgs {
    fn into_config(self, after_dashes: bool) -> anyhow::Result<LaunchConfig> {
        let mut command = self.command.into_iter();
        let first = command.next().context("no worker command given")?;
        let rest: Vec<OsString> = command.collect();
        let (program, args) = if after_dashes {
            (PathBuf::from(first), rest)
        } else {
            let exe = std::env::current_exe().context("cannot find the cohort executable")?;
            (
                exe,
                std::iter::once(check_subcommand(&first)?)
                    .chain(rest)
                    .collect(),
            )
        };
        let mut config = LaunchConfig::new(program, args);
        config.nproc_per_node = self.nproc_per_node;
        (config.min_nodes, config.nnodes) = node_range(&self.nnodes)?;
        config.node_rank = self.node_rank;
        config.master_addr = self.master_addr;
        config.master_port = self.master_port;
        config.standalone = self.standalone;
        config.max_restarts = self.max_restarts;
        config.stop_grace = seconds("--grace-period", self.grace_period)?;
        config.join_timeout = seconds("--join-timeout", self.join_timeout)?;
        config.last_call = seconds("--last-call-timeout", self.last_call_timeout)?;
        config.heartbeat_timeout = seconds("--heartbeat-timeout", self.heartbeat_timeout)?;
        config.worker_timeout = seconds("--worker-timeout", self.worker_timeout)?;
        config.health_check_port = self.health_check_port;
        config.secret = match (self.secret, self.secret_file) {
            (Some(hex), _) => Some(Secret::from_hex(&hex, "--secret")?),
            (None, Some(path)) => Some(Secret::from_file(&path)?),
            (None, None) => None,
        };
        Ok(config)
    }
}

/// Whether the worker command was written after `--`. clap drops the `--`,
/// but the command is always the tail of the command line, so the word
/// before that tail tells.
fn command_follows_dashes(argv: impl Iterator<Item = OsString>, command_len: usize) -> bool {
    let argv: Vec<OsString> = argv.collect();
    argv.len() > command_len && argv[argv.len() - command_len - 1] == "--"
}

/// cohort's own subcommands that can run as a worker.
fn subcommands() -> Vec<String> {
    crate::Cli::command()
        .get_subcommands()
        .map(|s| s.get_name().to_string())
        .filter(|s| s != "run")
        .collect()
}

/// `name` if it is one of cohort's own subcommands that can run as a worker.
fn check_subcommand(name: &OsStr) -> anyhow::Result<OsString> {
    let known = subcommands();
    let text = name.to_string_lossy();
    if text == "run" {
        bail!("`cohort run` cannot launch `run` as its worker");
    }
    if !known.iter().any(|k| *k == text) {
        bail!(
            "`{text}` is not a cohort subcommand ({}); to run another program, put it after `--`: \
             cohort run -n 2 -- {text} ...",
            known.join(", ")
        );
    }
    Ok(name.to_owned())
}

/// `--nnodes N` (a fixed job) or `MIN:MAX` (elastic) as (min, max).
fn node_range(text: &str) -> anyhow::Result<(Option<usize>, usize)> {
    let count = |s: &str| {
        s.trim()
            .parse::<usize>()
            .with_context(|| format!("--nnodes {text:?} is not N or MIN:MAX"))
    };
    Ok(match text.split_once(':') {
        Some((min, max)) => (Some(count(min)?), count(max)?),
        None => (None, count(text)?),
    })
}

fn seconds(flag: &str, value: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(value)
        .with_context(|| format!("{flag} {value} is not a number of seconds"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(words: &str) -> impl Iterator<Item = OsString> + '_ {
        words.split(' ').map(OsString::from)
    }

    #[test]
    fn dashes_are_detected_only_right_before_the_command() {
        assert!(command_follows_dashes(
            argv("cohort run -n 2 -- sh -c x"),
            3
        ));
        assert!(command_follows_dashes(argv("cohort run -- train"), 1));
        assert!(!command_follows_dashes(
            argv("cohort run -n 2 train -- x"),
            3
        ));
        assert!(!command_follows_dashes(argv("cohort run train"), 1));
    }

    #[test]
    fn nnodes_is_a_count_or_a_range() {
        assert_eq!(node_range("2").unwrap(), (None, 2));
        assert_eq!(node_range("1:4").unwrap(), (Some(1), 4));
        let err = node_range("1-4").unwrap_err().to_string();
        assert!(err.contains("\"1-4\""), "{err}");
        assert!(node_range("a:2").is_err());
    }

    #[test]
    fn only_cohort_subcommands_run_without_dashes() {
        let err = check_subcommand(OsStr::new("python3"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("-- python3"), "{err}");
        assert!(check_subcommand(OsStr::new("run")).is_err());
        assert!(check_subcommand(OsStr::new("demo")).is_ok());
    }
}

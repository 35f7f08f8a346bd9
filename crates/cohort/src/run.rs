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
    /// Workers on this node: a count, or torchrun's auto (one per GPU, else one per core),
    /// gpu (one per GPU) or cpu (one per core).
    #[arg(short = 'n', long, alias = "nproc_per_node", default_value = "1")]
    nproc_per_node: String,
    /// Nodes in the job, N or MIN:MAX (elastic: each round runs on the nodes
    /// that joined, at least MIN); run `cohort run` once per node.
    /// Default 1; under srun, Slurm's node count.
    #[arg(long, value_name = "N|MIN:MAX")]
    nnodes: Option<String>,
    /// This node's rank, 0..nnodes; node 0 hosts the rendezvous store. With
    /// --rdzv-backend c10d it may be left out: the node on --rdzv-endpoint's
    /// machine is node 0, the others number themselves as they join.
    /// Under srun (one `cohort run` per node), Slurm's node rank.
    #[arg(long, alias = "node_rank")]
    node_rank: Option<usize>,
    /// Address of node 0, as the other nodes and the workers reach it.
    /// Default 127.0.0.1; under srun, MASTER_ADDR if set, else the first host of Slurm's
    /// node list.
    #[arg(long, alias = "master_addr")]
    master_addr: Option<String>,
    /// Port of the rendezvous store on node 0.
    /// Default 29500; under srun, MASTER_PORT if set, else 15000 + the job id mod 10000.
    #[arg(long, alias = "master_port")]
    master_port: Option<u16>,
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
    /// torchrun's rendezvous endpoint HOST[:PORT] (port 29400 if left out): the
    /// store's address, as --master-addr and --master-port.
    #[arg(long, alias = "rdzv_endpoint", value_name = "HOST[:PORT]")]
    rdzv_endpoint: Option<String>,
    /// torchrun's rendezvous backend: c10d (node ranks found at the endpoint
    /// unless --node-rank is given) or static (--node-rank given).
    #[arg(long, alias = "rdzv_backend", value_name = "c10d|static")]
    rdzv_backend: Option<String>,
    /// torchrun's job id: accepted; the job is the store at the endpoint.
    #[arg(long, alias = "rdzv_id", value_name = "ID")]
    rdzv_id: Option<String>,
    /// torchrun's: accepted; cohort runs the program as given, never under python.
    #[arg(long, alias = "no_python")]
    no_python: bool,
    /// torchrun's: accepted with a note; cohort prints the workers' output
    /// with their rank here instead of writing files.
    #[arg(long, alias = "log_dir", value_name = "DIR")]
    log_dir: Option<PathBuf>,
    /// torchrun's (0-3, or per rank): accepted with a note, as --log-dir.
    #[arg(long, short = 'r', value_name = "MODE")]
    redirects: Option<String>,
    /// torchrun's (0-3, or per rank): accepted with a note, as --log-dir.
    #[arg(long, short = 't', value_name = "MODE")]
    tee: Option<String>,
    /// torchrun's address of this node: accepted with a note (the other
    /// nodes reach node 0's store; none reaches this one).
    #[arg(long, alias = "local_addr", value_name = "ADDR")]
    local_addr: Option<String>,
    /// torchrun's seconds between looks at the workers: accepted with a note
    /// (cohort's agent looks every 50 ms).
    #[arg(long, alias = "monitor_interval", value_name = "SECONDS")]
    monitor_interval: Option<f64>,
    /// torchrun's role of the workers: accepted with a note (every worker of
    /// a cohort job has the one role, "default").
    #[arg(long, value_name = "NAME")]
    role: Option<String>,
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
        for line in self.torchrun_notes() {
            eprintln!("cohort run: {line}");
        }
        let slurm = self.slurm_defaults()?;
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
        config.nproc_per_node = nproc(&self.nproc_per_node)?;
        let nnodes = self.nnodes.or(slurm.nnodes).unwrap_or_else(|| "1".into());
        (config.min_nodes, config.nnodes) = node_range(&nnodes)?;
        (config.master_addr, config.master_port) = match &self.rdzv_endpoint {
            Some(endpoint) => endpoint_of(endpoint)?,
            None => (
                self.master_addr
                    .or(slurm.master_addr)
                    .unwrap_or_else(|| "127.0.0.1".into()),
                self.master_port
                    .or(slurm.master_port)
                    .unwrap_or(DEFAULT_MASTER_PORT),
            ),
        };
        let node_rank = self.node_rank.or(slurm.node_rank);
        config.node_rank = node_rank.unwrap_or(0);
        config.node_rank_from_store = match self.rdzv_backend.as_deref() {
            None | Some("static") => false,
            Some("c10d") => node_rank.is_none(),
            Some(other) => bail!(
                "--rdzv-backend {other}: cohort's rendezvous is c10d (its own store at \
                 --rdzv-endpoint) or static (with --node-rank)"
            ),
        };
        config.standalone = self.standalone;
        config.max_restarts = self.max_restarts;
        config.stop_grace = seconds("--grace-period", self.grace_period)?;
        config.join_timeout = seconds("--join-timeout", self.join_timeout)?;
        config.last_call = seconds("--last-call-timeout", self.last_call_timeout)?;
        config.heartbeat_timeout = seconds("--heartbeat-timeout", self.heartbeat_timeout)?;
        config.worker_timeout = seconds("--worker-timeout", self.worker_timeout)?;
        config.health_check_port = self.health_check_port;
        config.explain_silence = Some(crate::debug::explain_silence);
        config.secret = match (self.secret, self.secret_file) {
            (Some(hex), _) => Some(Secret::from_hex(&hex, "--secret")?),
            (None, Some(path)) => Some(Secret::from_file(&path)?),
            (None, None) => None,
        };
        Ok(config)
    }
}

/// What `cohort run` takes from Slurm inside an `srun` step for the flags
/// not given (`None`: given, or not under srun).
#[derive(Default)]
struct FromSlurm {
    nnodes: Option<String>,
    node_rank: Option<usize>,
    master_addr: Option<String>,
    master_port: Option<u16>,
}

impl RunArgs {
    /// Inside an `srun` step (one `cohort run` per node), the node count, node rank, master
    /// address and port for the flags left out (MASTER_ADDR and MASTER_PORT, when set, before
    /// Slurm's), saying in one line what was taken.
    fn slurm_defaults(&self) -> anyhow::Result<FromSlurm> {
        use cohort_store::slurm::{SlurmTask, Taken};
        let Some(task) = SlurmTask::from_process_env()? else {
            return Ok(FromSlurm::default());
        };
        if let (Some(tasks), Some(nodes)) = (task.world_size, task.nnodes) {
            if tasks != nodes && self.nnodes.is_none() {
                bail!(
                    "under srun, `cohort run` is one launcher per node, but the step has {tasks}                      task(s) on {nodes} node(s): run it with srun --ntasks-per-node=1 (-n sets                      the workers per node)"
                );
            }
        }
        let endpoint = self.rdzv_endpoint.is_some();
        let env = |name| std::env::var(name).ok().filter(|v: &String| !v.is_empty());
        let taken = Taken {
            nnodes: self.nnodes.is_none(),
            node_rank: self.node_rank.is_none(),
            master_addr: !endpoint && self.master_addr.is_none() && env("MASTER_ADDR").is_none(),
            master_port: !endpoint && self.master_port.is_none() && env("MASTER_PORT").is_none(),
            ..Taken::default()
        };
        let from = FromSlurm {
            nnodes: task.nnodes.filter(|_| taken.nnodes).map(|n| n.to_string()),
            node_rank: task.node_rank.filter(|_| taken.node_rank),
            master_addr: match env("MASTER_ADDR") {
                Some(addr) if self.master_addr.is_none() => Some(addr),
                _ => task
                    .first_host
                    .clone()
                    .filter(|_| taken.master_addr)
                    .map(|h| h.0),
            },
            master_port: match env("MASTER_PORT") {
                Some(port) if self.master_port.is_none() => Some(
                    port.parse()
                        .with_context(|| format!("MASTER_PORT={port:?} is not a port"))?,
                ),
                _ => task.master_port().filter(|_| taken.master_port),
            },
        };
        if let Some(line) = task.note(taken) {
            eprintln!("cohort run: {line}");
        }
        Ok(from)
    }
}

impl RunArgs {
    /// One line for each torchrun flag given that cohort takes without acting on it.
    fn torchrun_notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        if let Some(id) = &self.rdzv_id {
            notes.push(format!(
                "--rdzv-id {id}: the job is the one whose store is at the endpoint; the id is \
                 not needed"
            ));
        }
        if self.no_python {
            notes.push("--no-python: cohort runs the program as given, never under python".into());
        }
        if self.log_dir.is_some() || self.redirects.is_some() || self.tee.is_some() {
            notes.push(
                "--log-dir/--redirects/--tee: each worker's output is printed here with its rank \
                 (no log files)"
                    .into(),
            );
        }
        if let Some(addr) = &self.local_addr {
            notes.push(format!(
                "--local-addr {addr}: not needed (the other nodes reach node 0's store only)"
            ));
        }
        if let Some(secs) = self.monitor_interval {
            notes.push(format!(
                "--monitor-interval {secs}: cohort's agent looks at the workers every 50 ms"
            ));
        }
        if let Some(role) = &self.role {
            notes.push(format!(
                "--role {role}: every worker has the one role \"default\""
            ));
        }
        notes
    }
}

/// torchrun's `--nproc-per-node`: a count, or auto (one worker per GPU, else one per core),
/// gpu (one per GPU, which there must be) or cpu (one per core).
fn nproc(text: &str) -> anyhow::Result<usize> {
    let cores = || std::thread::available_parallelism().map_or(1, usize::from);
    let gpus = gpu_count;
    match text {
        "cpu" => Ok(cores()),
        "auto" => Ok(match gpus() {
            0 => cores(),
            n => n,
        }),
        "gpu" => match gpus() {
            0 => bail!("--nproc-per-node gpu: this machine has no NVIDIA GPU (/dev/nvidia0)"),
            n => Ok(n),
        },
        n => n
            .parse()
            .with_context(|| format!("--nproc-per-node {n:?}: expected a count, auto, gpu or cpu")),
    }
}

/// The NVIDIA GPUs this machine shows (`/dev/nvidiaN`).
fn gpu_count() -> usize {
    std::fs::read_dir("/dev").map_or(0, |entries| {
        entries
            .flatten()
            .filter(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                name.strip_prefix("nvidia")
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            })
            .count()
    })
}

/// torchrun's `--rdzv-endpoint HOST[:PORT]` as (host, port); its default port is 29400.
fn endpoint_of(text: &str) -> anyhow::Result<(String, u16)> {
    const TORCHRUN_RDZV_PORT: u16 = 29400;
    // [v6]:port, host:port, or a host alone (an IPv6 address alone has several colons).
    let (host, port) = match text.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') || host.ends_with(']') => (host, Some(port)),
        _ => (text, None),
    };
    let port = match port {
        Some(p) => p
            .parse()
            .with_context(|| format!("--rdzv-endpoint {text:?}: expected HOST:PORT"))?,
        None => TORCHRUN_RDZV_PORT,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        bail!("--rdzv-endpoint {text:?}: expected HOST:PORT");
    }
    Ok((host.to_string(), port))
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
    fn torchruns_endpoint_and_nproc_read_as_torchrun_reads_them() {
        let ep = |t| endpoint_of(t).unwrap();
        assert_eq!(ep("10.0.0.1:29500"), ("10.0.0.1".into(), 29500));
        assert_eq!(ep("node0"), ("node0".into(), 29400));
        assert_eq!(ep("[::1]:1234"), ("::1".into(), 1234));
        assert!(endpoint_of("host:port").is_err());
        assert_eq!(nproc("3").unwrap(), 3);
        assert!(nproc("cpu").unwrap() >= 1);
        assert!(nproc("auto").unwrap() >= 1);
        let e = nproc("many").unwrap_err().to_string();
        assert!(e.contains("auto, gpu or cpu"), "{e}");
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

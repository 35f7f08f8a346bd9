//! `cohort debug`: looking into a live job from outside. `cohort debug dump --store HOST:PORT`
//! connects to the job's store (with the job's secret, from `--secret`, `--secret-file` or
//! `COHORT_SECRET`, as the job's own processes do), reads the flight recorder rings every rank
//! publishes there (`cohort_comm::flight::live`) and prints, one line a rank, the collective
//! each is in and the phase and step it was called from, then a verdict when some collective
//! waits. It only reads the store: the job is never stopped or slowed. The launcher's
//! explanation of a silent worker ([`explain_silence`]) is the same reading.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use cohort_comm::flight::{self, live};
use cohort_store::{Secret, Store, TcpStore};

/// `cohort debug`.
#[derive(Subcommand)]
pub enum DebugCmd {
    /// Print where every rank of a live job is (its current collective, phase and step)
    /// from the flight recorder rings its ranks publish in the job's store, without
    /// stopping it.
    Dump(DumpArgs),
}

#[derive(Args)]
pub struct DumpArgs {
    /// The job's store: the launcher's --master-addr and the port it printed
    /// (MASTER_ADDR:MASTER_PORT of its workers).
    #[arg(long, value_name = "HOST:PORT")]
    store: String,
    /// The job secret, as 64 hex digits [default: COHORT_SECRET].
    #[arg(long)]
    secret: Option<String>,
    /// A file holding the job secret.
    #[arg(long, value_name = "PATH")]
    secret_file: Option<PathBuf>,
    /// The process group to read [default: default, the job's world].
    #[arg(long, default_value = "default")]
    group: String,
    /// Seconds to wait for the store.
    #[arg(long, default_value_t = 10)]
    timeout: u64,
}

pub fn main(cmd: DebugCmd) -> anyhow::Result<()> {
    match cmd {
        DebugCmd::Dump(args) => dump(args),
    }
}

fn dump(args: DumpArgs) -> anyhow::Result<()> {
    let secret = match (&args.secret, &args.secret_file) {
        (Some(hex), _) => Some(Secret::from_hex(hex, "--secret")?),
        (None, Some(path)) => Some(Secret::from_file(path)?),
        (None, None) => Secret::from_env()?,
    };
    let timeout = Duration::from_secs(args.timeout);
    let store = TcpStore::connect_with_secret(args.store.as_str(), timeout, secret)
        .with_context(|| format!("cannot reach the job's store at {}", args.store))?;
    let Some(lines) = describe(Arc::new(store), &args.group) else {
        bail!(
            "no rank of group {:?} published a flight recorder ring in the store at {} (is the \
             job running, with COHORT_FLIGHT_RECORDER on?)",
            args.group,
            args.store
        );
    };
    lines.iter().for_each(|l| println!("{l}"));
    Ok(())
}

/// A line per rank that published in `root` (the job's store) for `group`, then one for
/// the ranks that did not and the verdict, if any; `None` when no rank published.
fn describe(root: Arc<dyn Store>, group: &str) -> Option<Vec<String>> {
    let store = live::find(root, group)?;
    let (world, dumps) = live::gather(&*store, group);
    let world = world.unwrap_or(dumps.len());
    let mut lines: Vec<String> = dumps.iter().map(live::summary).collect();
    let missing: Vec<String> = (0..world)
        .filter(|r| !dumps.iter().any(|d| d.rank == *r))
        .map(|r| r.to_string())
        .collect();
    if !missing.is_empty() {
        lines.push(format!("no ring from rank(s) {}", missing.join(", ")));
    }
    if let Some(verdict) = flight::verdict(group, world, &dumps) {
        lines.push(format!("flight recorder (group {group}): {verdict}"));
    }
    Some(lines)
}

/// The launcher's explanation of a silent worker: the verdict over the rings the job's
/// ranks last published in `root` (see `LaunchConfig::explain_silence`).
pub fn explain_silence(root: Arc<dyn Store>) -> Option<String> {
    let group = "default";
    let store = live::find(root, group)?;
    let (world, dumps) = live::gather(&*store, group);
    let verdict = flight::verdict(group, world.unwrap_or(dumps.len()), &dumps)?;
    Some(format!("flight recorder (group {group}): {verdict}"))
}

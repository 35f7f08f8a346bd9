//! `cohort demo`: a worker for showing and timing the launcher until
//! `cohort train` exists. Each worker reaches the job's store, checks in, waits
//! for the others and prints what the launcher told it and how long after the
//! launch it reached the store. It never binds the store: the launcher hosts it.

use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use cohort_launcher::WorkerEnv;
use cohort_store::{Secret, Store, TcpStore};

/// Hidden worker used by `cohort run -n 2 demo` (not meant to be run alone).
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Seconds to wait for the store and for the other workers.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
}

pub fn main(args: DemoArgs) -> anyhow::Result<()> {
    let env = WorkerEnv::from_env()?;
    let timeout = Duration::from_secs(args.timeout);
    let addr = if env.store_addr.contains(':') {
        format!("[{}]:{}", env.store_addr, env.store_port)
    } else {
        format!("{}:{}", env.store_addr, env.store_port)
    };
    let store = TcpStore::connect_with_secret(addr.as_str(), timeout, Secret::from_env()?)
        .with_context(|| format!("rank {}: connecting to the store at {addr}", env.rank))?;
    // The store persists across restarts, so each round checks in under its own keys.
    let round = format!("demo/{}", env.restart_count);
    store.set(&format!("{round}/rank/{}", env.rank), b"here")?;
    let reached = since_launch(&env);
    let keys: Vec<String> = (0..env.world_size)
        .map(|r| format!("{round}/rank/{r}"))
        .collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let waited = Instant::now();
    store
        .wait(&keys, timeout)
        .with_context(|| format!("rank {}: waiting for the other workers", env.rank))?;
    let met = reached.map(|d| d + waited.elapsed());
    let ms = |d: Option<Duration>| {
        d.map_or("?".to_string(), |d| format!("{:.1}", d.as_secs_f64() * 1e3))
    };
    println!(
        "rank {}/{} (local {}/{}, node {}), {} threads, restart {}: reached the store {} ms after launch, all {} met at {} ms",
        env.rank,
        env.world_size,
        env.local_rank,
        env.local_world_size,
        env.node_rank,
        env.num_threads.map_or("?".to_string(), |t| t.to_string()),
        env.restart_count,
        ms(reached),
        env.world_size,
        ms(met),
    );
    Ok(())
}

fn since_launch(env: &WorkerEnv) -> Option<Duration> {
    SystemTime::now().duration_since(env.launch_time?).ok()
}

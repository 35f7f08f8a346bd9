//! `cohort bench rpc`: round-trip latency and calls per second of small
//! calls between two workers, on whatever connects them (loopback under
//! `cohort run -n 2`).
//!
//! Every worker serves `bench.echo` (returns its bytes); rank 0 calls rank 1.
//! Latency: `iters` sequential `rpc_sync` calls per payload size, after a
//! warmup; median, p99 and minimum. Throughput: `calls` `rpc_async` calls
//! with at most `window` in flight; calls per second. It measures and
//! reports; it never changes the agent's settings.

use std::time::Instant;

use serde::Serialize;

use cohort_rpc::{Registry, Rpc, RpcError, RpcFuture};

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Payload sizes in bytes (argument and result each).
    pub sizes: Vec<usize>,
    /// Timed sequential calls per size.
    pub iters: usize,
    /// Untimed calls first.
    pub warmup: usize,
    /// Calls of the throughput run.
    pub calls: usize,
    /// Calls in flight at once in the throughput run.
    pub window: usize,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            sizes: vec![8, 1024],
            iters: 2000,
            warmup: 200,
            calls: 20_000,
            window: 64,
        }
    }
}

/// One payload size's figures.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    /// Always `rpc`.
    pub bench: &'static str,
    /// Payload bytes each way.
    pub bytes: usize,
    /// Median round trip of `rpc_sync`, microseconds.
    pub rtt_us_median: f64,
    /// 99th percentile round trip, microseconds.
    pub rtt_us_p99: f64,
    /// Fastest round trip, microseconds.
    pub rtt_us_min: f64,
    /// Calls per second with `window` in flight.
    pub calls_per_s: f64,
    /// Calls in flight in the throughput run.
    pub window: usize,
}

/// Adds the handler the benchmark calls.
pub fn register(registry: &mut Registry) {
    registry.register("bench.echo", |_, b: Vec<u8>| Ok::<_, String>(b));
}

/// Runs the benchmark from this worker against `to` (every worker must have
/// [`register`]ed).
pub fn run(rpc: &Rpc, to: usize, opts: &BenchOptions) -> Result<Vec<BenchRow>, RpcError> {
    let mut rows = Vec::new();
    for &bytes in &opts.sizes {
        let payload = vec![7u8; bytes];
        let echo = |p: &Vec<u8>| -> Result<(), RpcError> {
            let back: Vec<u8> = rpc.rpc_sync(to, "bench.echo", p.clone())?;
            debug_assert_eq!(back.len(), p.len());
            Ok(())
        };
        for _ in 0..opts.warmup {
            echo(&payload)?;
        }
        let mut times = Vec::with_capacity(opts.iters);
        for _ in 0..opts.iters.max(1) {
            let t0 = Instant::now();
            echo(&payload)?;
            times.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        times.sort_by(f64::total_cmp);
        let pick = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];

        let t0 = Instant::now();
        let mut in_flight: std::collections::VecDeque<RpcFuture<Vec<u8>>> =
            std::collections::VecDeque::with_capacity(opts.window);
        for _ in 0..opts.calls {
            if in_flight.len() >= opts.window.max(1) {
                in_flight.pop_front().expect("not empty").wait()?;
            }
            in_flight.push_back(rpc.rpc_async(to, "bench.echo", payload.clone()));
        }
        for f in in_flight {
            f.wait()?;
        }
        let secs = t0.elapsed().as_secs_f64();
        rows.push(BenchRow {
            bench: "rpc",
            bytes,
            rtt_us_median: pick(0.5),
            rtt_us_p99: pick(0.99),
            rtt_us_min: times[0],
            calls_per_s: opts.calls as f64 / secs,
            window: opts.window,
        });
    }
    Ok(rows)
}

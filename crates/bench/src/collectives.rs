//! `cohort bench collectives`: collective timings in the style of nccl-tests.
//!
//! For every op and size: `warmup` untimed calls, then `iters` times a
//! barrier followed by one timed call; a rank's time is the median of its
//! iterations and the reported time is the maximum over ranks (the method
//! of PyTorch's reference script `bench_collectives.py`, so figures compare
//! with PyTorch's). `bytes` is nccl-tests' size: the whole buffer of
//! all_reduce/broadcast/reduce, the gathered output of all_gather and gather,
//! the scattered input of reduce_scatter and scatter, the per-rank buffer of
//! all_to_all. algbw = bytes / time; busbw = algbw x nccl-tests' factor
//! (2(n-1)/n for all_reduce, (n-1)/n for the gathers, scatters and
//! all_to_all, 1 for broadcast and reduce), GB = 1e9 bytes. `cpu_us` is the
//! CPU time the call itself burned, which a busy machine barely changes:
//! on two shared cores it is the figure to compare between builds. This
//! module only measures; it must never print (the binary does).

use std::time::Instant;

use serde::Serialize;

use cohort_comm::{bf16, CommError, DType, Element, OpKind, ProcessGroup, ReduceOp};

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Operations, in order (barrier is timed once, without a size).
    pub ops: Vec<OpKind>,
    /// Smallest size in bytes.
    pub min_bytes: usize,
    /// Largest size in bytes.
    pub max_bytes: usize,
    /// Each size is the previous one times this (at least 2).
    pub factor: usize,
    /// Timed iterations per size; `None` picks by size (500 at 4 KB down to 5).
    pub iters: Option<usize>,
    /// Untimed iterations per size; `None` is a tenth of `iters`, at least 2.
    pub warmup: Option<usize>,
    /// Element type.
    pub dtype: DType,
    /// Reduce operator of the reducing ops.
    pub reduce: ReduceOp,
}

impl Default for BenchOptions {
    /// all_reduce, float32, sum, 4 B to 256 MB doubling.
    fn default() -> Self {
        BenchOptions {
            ops: vec![OpKind::AllReduce],
            min_bytes: 4,
            max_bytes: 256 << 20,
            factor: 2,
            iters: None,
            warmup: None,
            dtype: DType::F32,
            reduce: ReduceOp::Sum,
        }
    }
}

/// One measured (op, size).
#[derive(Clone, Debug, Serialize)]
pub struct BenchRow {
    /// Operation name.
    pub op: &'static str,
    /// World size.
    pub world: usize,
    /// nccl-tests' size in bytes (see the module docs).
    pub bytes: usize,
    /// Elements per rank buffer.
    pub count: usize,
    /// Element type name.
    pub dtype: &'static str,
    /// Timed iterations.
    pub iters: usize,
    /// Median time of one call, max over ranks, in microseconds.
    pub time_us: f64,
    /// Fastest single call on this rank, in microseconds.
    pub min_us: f64,
    /// CPU time (user + system) the calling thread spent per call, mean
    /// over iterations, max over ranks, in microseconds. Unlike the wall
    /// time it hardly moves when other processes compete for the cores.
    pub cpu_us: f64,
    /// bytes / time, GB/s.
    pub algbw_gbps: f64,
    /// algbw x the op's bus factor, GB/s.
    pub busbw_gbps: f64,
}

impl BenchRow {
    /// One JSON object, no newline.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a BenchRow always serialises")
    }
}

/// The text table's header lines.
pub fn text_header(world: usize, opts: &BenchOptions, backend: &str) -> String {
    format!(
        "# cohort bench collectives: world {world}, backend {backend}, dtype {}, reduce {}\n\
         #\n\
         # {:>14} {:>12} {:>11} {:>6} {:>11} {:>11} {:>11} {:>10} {:>10}\n\
         # {:>14} {:>12} {:>11} {:>6} {:>11} {:>11} {:>11} {:>10} {:>10}",
        opts.dtype,
        opts.reduce,
        "op",
        "bytes",
        "count",
        "iters",
        "time",
        "min",
        "cpu",
        "algbw",
        "busbw",
        "",
        "(B)",
        "(elements)",
        "",
        "(us)",
        "(us)",
        "(us)",
        "(GB/s)",
        "(GB/s)"
    )
}

/// One row of the text table.
pub fn text_row(r: &BenchRow) -> String {
    format!(
        "  {:>14} {:>12} {:>11} {:>6} {:>11.2} {:>11.2} {:>11.2} {:>10.3} {:>10.3}",
        r.op, r.bytes, r.count, r.iters, r.time_us, r.min_us, r.cpu_us, r.algbw_gbps, r.busbw_gbps
    )
}

/// nccl-tests' bus bandwidth factor.
pub fn bus_factor(op: OpKind, world: usize) -> f64 {
    let n = world as f64;
    match op {
        OpKind::AllReduce => 2.0 * (n - 1.0) / n,
        OpKind::AllGather
        | OpKind::ReduceScatter
        | OpKind::Gather
        | OpKind::Scatter
        | OpKind::AllToAll => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// Runs the benchmark on `pg` (every rank must call it with the same
/// options), calling `on_row` as each row is ready (on every rank; print on
/// rank 0).
pub fn run(
    pg: &ProcessGroup,
    opts: &BenchOptions,
    mut on_row: impl FnMut(&BenchRow),
) -> Result<Vec<BenchRow>, CommError> {
    let mut rows = Vec::new();
    for &op in &opts.ops {
        let sizes: Vec<usize> = if op == OpKind::Barrier {
            vec![0]
        } else {
            let mut v = Vec::new();
            let mut b = opts.min_bytes.max(1);
            while b <= opts.max_bytes {
                v.push(b);
                b = b.saturating_mul(opts.factor.max(2));
            }
            v
        };
        for bytes in sizes {
            let row = match opts.dtype {
                DType::F32 => measure::<f32>(pg, opts, op, bytes)?,
                DType::F64 => measure::<f64>(pg, opts, op, bytes)?,
                DType::I32 => measure::<i32>(pg, opts, op, bytes)?,
                DType::I64 => measure::<i64>(pg, opts, op, bytes)?,
                DType::U8 => measure::<u8>(pg, opts, op, bytes)?,
                DType::BF16 => measure::<bf16>(pg, opts, op, bytes)?,
                other => {
                    return Err(CommError::InvalidArgument {
                        op,
                        group: pg.name().to_string(),
                        detail: format!("the benchmark has no element type {other:?}"),
                    })
                }
            };
            if let Some(row) = row {
                on_row(&row);
                rows.push(row);
            }
        }
    }
    Ok(rows)
}

/// CPU time consumed so far by the calling thread.
fn thread_cpu_seconds() -> f64 {
    // SAFETY: an all-zero timespec is valid and clock_gettime only writes it.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: CLOCK_THREAD_CPUTIME_ID is always available on Linux; `ts` is
    // a valid, exclusively borrowed timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// `x` to `digits` decimals, so that the JSON reads `6.57`, not `6.569999999999999`.
fn round(x: f64, digits: i32) -> f64 {
    let k = 10f64.powi(digits);
    (x * k).round() / k
}

fn default_iters(bytes: usize) -> usize {
    ((1usize << 30) / bytes.max(1 << 20)).clamp(5, 500)
}

/// Times one (op, size); `None` when the size holds no whole slot per rank.
fn measure<T: Element + Default>(
    pg: &ProcessGroup,
    opts: &BenchOptions,
    op: OpKind,
    bytes: usize,
) -> Result<Option<BenchRow>, CommError> {
    let n = pg.size();
    let es = std::mem::size_of::<T>();
    // Buffers in elements: `count` per rank-level buffer, `total` for the
    // gathered / scattered side.
    let total = match op {
        OpKind::AllGather
        | OpKind::Gather
        | OpKind::ReduceScatter
        | OpKind::Scatter
        | OpKind::AllToAll => bytes / es / n * n,
        _ => bytes / es,
    };
    let count = match op {
        OpKind::AllGather | OpKind::Gather | OpKind::ReduceScatter | OpKind::Scatter => total / n,
        _ => total,
    };
    if op != OpKind::Barrier && count == 0 {
        return Ok(None);
    }
    let root = 0;
    let is_root = pg.rank() == root;
    let mut a = vec![T::default(); count];
    let mut b = vec![T::default(); total];
    let reduce = opts.reduce;
    let call = |a: &mut [T], b: &mut [T]| -> Result<(), CommError> {
        match op {
            OpKind::AllReduce => pg.all_reduce(a, reduce),
            OpKind::Broadcast => pg.broadcast(a, root),
            OpKind::Reduce => pg.reduce(a, reduce, root),
            OpKind::AllGather => pg.all_gather(a, b),
            OpKind::ReduceScatter => pg.reduce_scatter(b, a, reduce),
            OpKind::Gather => pg.gather(a, is_root.then_some(b), root),
            OpKind::Scatter => pg.scatter(is_root.then_some(&*b), a, root),
            OpKind::AllToAll => {
                let out = &mut a[..];
                pg.all_to_all(b, out)
            }
            _ => pg.barrier(),
        }
    };
    let iters = opts.iters.unwrap_or_else(|| default_iters(bytes)).max(1);
    let warmup = opts.warmup.unwrap_or((iters / 10).max(2));
    for _ in 0..warmup {
        call(&mut a, &mut b)?;
    }
    let mut times = Vec::with_capacity(iters);
    let mut cpu = 0.0;
    for _ in 0..iters {
        pg.barrier()?;
        let c0 = thread_cpu_seconds();
        let t0 = Instant::now();
        call(&mut a, &mut b)?;
        times.push(t0.elapsed().as_secs_f64());
        cpu += thread_cpu_seconds() - c0;
    }
    times.sort_by(f64::total_cmp);
    let mut worst = [times[times.len() / 2], cpu / iters as f64];
    pg.all_reduce(&mut worst, ReduceOp::Max)?;
    let [time, cpu] = worst;
    let algbw = if time > 0.0 {
        bytes as f64 / time / 1e9
    } else {
        0.0
    };
    Ok(Some(BenchRow {
        op: op.name(),
        world: n,
        bytes: if op == OpKind::Barrier { 0 } else { bytes },
        count,
        dtype: T::DTYPE.name(),
        iters,
        time_us: round(time * 1e6, 2),
        min_us: round(times[0] * 1e6, 2),
        cpu_us: round(cpu * 1e6, 2),
        algbw_gbps: round(algbw, 4),
        busbw_gbps: round(algbw * bus_factor(op, n), 4),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_comm::{GroupOptions, ALL_COLLECTIVES};
    use std::time::Duration;

    #[test]
    fn every_collective_gets_a_row_per_size_with_nccl_tests_factors() {
        let opts = BenchOptions {
            ops: ALL_COLLECTIVES.to_vec(),
            min_bytes: 4,
            max_bytes: 64,
            factor: 4,
            iters: Some(3),
            warmup: Some(1),
            ..BenchOptions::default()
        };
        let g = GroupOptions {
            timeout: Duration::from_secs(30),
            ..GroupOptions::default()
        };
        let rows = cohort_comm::spawn::threads_with(3, g, |pg| run(pg, &opts, |_| {})).unwrap();
        let rows = &rows[0];
        // 4 B holds no whole float per rank for the scattering ops (skipped).
        assert_eq!(rows.iter().filter(|r| r.op == "all_reduce").count(), 3);
        assert_eq!(rows.iter().filter(|r| r.op == "all_gather").count(), 2);
        assert_eq!(rows.iter().filter(|r| r.op == "barrier").count(), 1);
        for r in rows {
            assert_eq!(r.world, 3);
            let f = bus_factor(OpKind::parse(r.op).unwrap(), 3);
            assert!((r.busbw_gbps - r.algbw_gbps * f).abs() < 1e-3, "{r:?}");
            assert!(r.time_us > 0.0 && r.min_us <= r.time_us + 0.01, "{r:?}");
        }
        assert!(rows[0]
            .to_json()
            .starts_with("{\"op\":\"all_reduce\",\"world\":3,\"bytes\":4,"));
    }
}

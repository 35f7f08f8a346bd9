//! What a data-parallel run's gradients travel in when `--bf16-compress` is
//! not given. On one node they stay fp32: shared memory moves them faster
//! than the CPU would convert them (PERFORMANCE_JOURNAL: bf16 made a
//! two-rank run on one host slower). Across nodes the link may be the
//! bottleneck: a timed all-reduce at the start (or `COHORT_LINK_GBITS`, a
//! link speed the operator knows, and the tests' hook) estimates how long a
//! step's fp32 gradients would be on the wire, and above [`BF16_ABOVE_MS`]
//! they go in bf16, half the bytes (PyTorch's `bf16_compress_hook`). The
//! ranks agree on the slowest estimate, so all of them choose alike.
//!
//! This module times one all-reduce and decides; it never changes how a
//! collective runs.

use std::time::Instant;

use cohort_comm::{ProcessGroup, ReduceOp};
use cohort_ddp::Compression;

use crate::error::TrainError;

/// The variable that gives the link speed in Gbit/s instead of timing it.
pub(crate) const LINK_VAR: &str = "COHORT_LINK_GBITS";

/// Above this estimated fp32 all-reduce time of a step's gradients (ms),
/// they travel in bf16. At about 0.5 ns per byte to convert both ways on
/// one core, bf16 pays where the wire takes longer than about 1 ns per
/// byte (links under ~4 Gbit/s), and it matters where the wire time is a
/// share of a step that backward cannot hide: config B's 42 MB of
/// gradients take ~350 ms at 1 Gbit/s (bf16) and ~35 ms at 10 (fp32).
pub(crate) const BF16_ABOVE_MS: f64 = 50.0;

/// The bytes of the timed all-reduce (after a small one that warms the
/// connections): large enough that the wire, not the latency, times it.
const PROBE_BYTES: usize = 4 << 20;

/// The gradients' wire format and the header line that says why (none for
/// one rank left to decide: nothing travels).
pub(crate) struct Choice {
    pub compression: Compression,
    pub line: Option<String>,
}

/// How `grad_floats` gradients per step travel over `pg`: as `explicit`
/// says when given, else decided by the link (see the module). Collective
/// when the ranks span nodes and nothing was given.
pub(crate) fn choose(
    explicit: Option<Compression>,
    pg: &ProcessGroup,
    grad_floats: usize,
) -> Result<Choice, TrainError> {
    let name = |c: Compression| match c {
        Compression::Bf16 => "bf16",
        Compression::None => "fp32",
    };
    if let Some(c) = explicit {
        let flag = matches!(c, Compression::Bf16);
        return Ok(Choice {
            compression: c,
            line: Some(format!("gradients: {} (--bf16-compress {flag})", name(c))),
        });
    }
    let fp32 = |why: &str| Choice {
        compression: Compression::None,
        line: Some(format!(
            "gradients: fp32 (auto: {why}; --bf16-compress sends bf16)"
        )),
    };
    let (world, local) = (pg.size(), pg.local_world_size().max(1));
    if world == 1 {
        return Ok(Choice {
            compression: Compression::None,
            line: None,
        });
    }
    if local >= world {
        return Ok(fp32("every rank on one node"));
    }
    // The link's share of a ring all-reduce: each node sends 2 (n - 1) / n
    // of the buffer over it.
    let nodes = world.div_ceil(local).max(2);
    let share = 2.0 * (nodes - 1) as f64 / nodes as f64;
    let step_bytes = (grad_floats * 4) as f64;
    let (mut est_ms, how) = match forced_gbits()? {
        Some(gbits) => {
            let ms = share * step_bytes * 8.0 / (gbits * 1e9) * 1e3;
            (ms, format!("{LINK_VAR}={gbits} Gbit/s"))
        }
        None => {
            let mut warm = vec![0f32; 16 << 10];
            pg.all_reduce(&mut warm, ReduceOp::Sum)
                .map_err(TrainError::comm("link probe all_reduce"))?;
            let mut probe = vec![0f32; PROBE_BYTES / 4];
            let t = Instant::now();
            pg.all_reduce(&mut probe, ReduceOp::Sum)
                .map_err(TrainError::comm("link probe all_reduce"))?;
            let probe_ms = t.elapsed().as_secs_f64() * 1e3;
            let gbits = share * PROBE_BYTES as f64 * 8.0 / (probe_ms * 1e-3) / 1e9;
            let how = format!("a 4 MiB all-reduce took {probe_ms:.1} ms, about {gbits:.1} Gbit/s");
            (probe_ms * step_bytes / PROBE_BYTES as f64, how)
        }
    };
    // The slowest rank's estimate on every rank: they must choose alike.
    let mut agreed = [est_ms];
    pg.all_reduce(&mut agreed, ReduceOp::Max)
        .map_err(TrainError::comm("link estimate all_reduce"))?;
    est_ms = agreed[0];
    let mb = step_bytes / (1024.0 * 1024.0);
    let over = est_ms > BF16_ABOVE_MS;
    let compression = if over {
        Compression::Bf16
    } else {
        Compression::None
    };
    let verdict = if over { "over" } else { "within" };
    let other = if over {
        "--bf16-compress false keeps fp32"
    } else {
        "--bf16-compress sends bf16"
    };
    Ok(Choice {
        compression,
        line: Some(format!(
            "gradients: {} (auto: the ranks span {nodes} nodes; {how}, so a step's {mb:.1} MB \
             of fp32 gradients would take about {est_ms:.0} ms on the link, {verdict} \
             {BF16_ABOVE_MS} ms; {other})",
            name(compression)
        )),
    })
}

/// The header line of a group whose collectives run hierarchically (the
/// ranks span nodes and share them: cohort-comm does it by itself under
/// the `auto` algorithm), or `None` when they run flat: its all-reduces
/// (DDP, DiLoCo), or with `sharded` its reduce-scatters and all-gathers
/// (ZeRO).
pub(crate) fn hierarchy_line(pg: &ProcessGroup, sharded: bool) -> Option<String> {
    let sizes = pg.hierarchy()?;
    let nodes: Vec<String> = sizes.iter().map(usize::to_string).collect();
    let (n, ranks) = (sizes.len(), nodes.join(" + "));
    Some(if sharded {
        format!(
            "reduce-scatter and all-gather: hierarchical over {n} nodes of {ranks} ranks: each \
             node reduces among its own ranks first, and one rank per node and local index \
             crosses the link with its share of the chunks (COHORT_ALGO=ring runs them flat)"
        )
    } else {
        format!(
            "all-reduce: hierarchical over {n} nodes of {ranks} ranks: each node reduces among \
             its own ranks first, and one rank per node crosses the link (COHORT_ALGO=ring runs \
             it flat)"
        )
    })
}

/// The variable that sets the reducer's nice steps (0 to 19) instead of the
/// core budget's choice, to measure either.
pub(crate) const REDUCER_NICE_VAR: &str = "COHORT_REDUCER_NICE";

/// The nice steps DDP's overlapped reduction thread runs below backward's
/// threads: a core budget. Where a core is free of compute threads
/// (`threads` per rank x `local_ranks` under the cores) the scheduler gives
/// the reducer that core: 0. Where the engine takes every core, each burst
/// of the reducer (a bucket's bf16 conversion, a chunk's sum, ~ms) at equal
/// priority preempts one engine worker and so stalls a whole fork-join
/// kernel on the others; giving it one core of the engine's instead would
/// cost backward 1/threads of its speed for good (half, on a 2-core host),
/// for a thread that on a slow link needs a few percent of a core. So it
/// runs [`REDUCER_NICE_BUSY`] steps lower: in the engine's gaps (every
/// kernel's join), and freely once backward ends. `COHORT_REDUCER_NICE`
/// overrides it.
pub(crate) fn reducer_nice(threads: usize, local_ranks: usize) -> Result<u8, TrainError> {
    if let Ok(value) = std::env::var(REDUCER_NICE_VAR) {
        return match value.trim().parse::<u8>() {
            Ok(n) if n <= 19 => Ok(n),
            _ => Err(TrainError::Hook {
                var: REDUCER_NICE_VAR,
                value,
                expected: "nice steps from 0 to 19",
            }),
        };
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Ok(if threads * local_ranks.max(1) >= cores {
        REDUCER_NICE_BUSY
    } else {
        0
    })
}

/// The reducer's nice steps where the engine takes every core: CFS then
/// gives it about a third of a busy core's share, when it asks.
pub(crate) const REDUCER_NICE_BUSY: u8 = 5;

/// `COHORT_LINK_GBITS`, when set: a link speed in Gbit/s above 0.
fn forced_gbits() -> Result<Option<f64>, TrainError> {
    let Ok(value) = std::env::var(LINK_VAR) else {
        return Ok(None);
    };
    match value.trim().parse::<f64>() {
        Ok(g) if g > 0.0 && g.is_finite() => Ok(Some(g)),
        _ => Err(TrainError::Hook {
            var: LINK_VAR,
            value,
            expected: "a link speed in Gbit/s above 0, such as 1 or 10",
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_comm::spawn;

    #[test]
    fn an_explicit_choice_wins_and_one_node_stays_fp32() {
        let got = spawn::threads(2, |pg| {
            let bf16 = choose(Some(Compression::Bf16), pg, 1 << 20)?;
            let auto = choose(None, pg, 1 << 20)?;
            Ok::<_, TrainError>((bf16.compression, bf16.line, auto.compression, auto.line))
        })
        .unwrap();
        let (c, line, auto, auto_line) = &got[0];
        assert_eq!(*c, Compression::Bf16);
        assert_eq!(
            line.as_deref(),
            Some("gradients: bf16 (--bf16-compress true)")
        );
        // Threads of one process: one node.
        assert_eq!(*auto, Compression::None);
        let auto_line = auto_line.as_deref().unwrap_or_default();
        assert!(auto_line.contains("every rank on one node"), "{auto_line}");
    }

    /// A core free of compute threads is the reducer's; with none, it runs
    /// below backward's threads (the variable's override is tested end to end).
    #[test]
    fn the_reducer_yields_only_where_the_engine_takes_every_core() {
        if std::env::var_os(REDUCER_NICE_VAR).is_some() {
            return;
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(reducer_nice(cores, 1).unwrap(), REDUCER_NICE_BUSY);
        assert_eq!(reducer_nice(1, cores).unwrap(), REDUCER_NICE_BUSY);
        if cores > 1 {
            assert_eq!(reducer_nice(1, 1).unwrap(), 0);
        }
    }
}

//! Naming the straggler: under data parallelism every rank's step takes the
//! slowest rank's time, so step times all look alike; what differs is the
//! compute (data, forward, backward, optimizer: everything but waiting in
//! the collectives and logging). From the per-rank phase times the log
//! window gathers, the rank whose compute exceeds the median by more than a
//! threshold is named in the log line. It only reads figures; it never
//! gathers them itself.

use crate::phases::{Phase, PHASES};

/// How much slower than the median a rank's compute must be to be named.
pub(super) const THRESHOLD: f64 = 0.5;
/// And by how many milliseconds per step at least, so that noise in tiny
/// steps is never called a straggler.
pub(super) const MIN_MS: f64 = 10.0;

/// `straggler: rank 1 computes 180% slower than the median (62.0 vs 22.1 ms
/// per step)` for the slowest rank of `rank_ms` (each rank's milliseconds per
/// step by phase, in the order of [`PHASES`]) when it is a straggler.
pub(super) fn straggler_note(rank_ms: &[[f64; PHASES.len()]]) -> Option<String> {
    if rank_ms.len() < 2 {
        return None;
    }
    let compute: Vec<f64> = rank_ms
        .iter()
        .map(|ms| {
            PHASES
                .iter()
                .zip(ms)
                .filter(|(p, _)| !matches!(p, Phase::Comm | Phase::Logging))
                .map(|(_, v)| v)
                .sum()
        })
        .collect();
    let mut sorted = compute.clone();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let median = if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    };
    let (rank, &slowest) = compute
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))?;
    let slower = slowest - median;
    if slower < MIN_MS || slowest < median * (1.0 + THRESHOLD) {
        return None;
    }
    Some(format!(
        "straggler: rank {rank} computes {:.0}% slower than the median ({slowest:.1} vs \
         {median:.1} ms per step)",
        100.0 * slower / median.max(1e-9)
    ))
}

/// A test hook: `COHORT_TEST_SLOW_RANK=R:MS` makes rank `R` spend `MS`
/// more milliseconds on each micro-batch's data, a straggler on demand.
pub(crate) fn test_delay(rank: usize) -> Option<std::time::Duration> {
    static HOOK: std::sync::OnceLock<Option<(usize, u64)>> = std::sync::OnceLock::new();
    let hook = HOOK.get_or_init(|| {
        let v = std::env::var("COHORT_TEST_SLOW_RANK").ok()?;
        let (r, ms) = v.split_once(':')?;
        Some((r.trim().parse().ok()?, ms.trim().parse().ok()?))
    });
    match hook {
        Some((r, ms)) if *r == rank => Some(std::time::Duration::from_millis(*ms)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(compute: f64, comm: f64) -> [f64; PHASES.len()] {
        // data, fwd, bwd, comm, optimizer, logging
        [0.0, compute / 2.0, compute / 2.0, comm, 0.0, 1.0]
    }

    #[test]
    fn the_slow_rank_is_named_and_an_even_run_names_none() {
        let ranks = [rank(20.0, 40.0), rank(60.0, 1.0), rank(21.0, 39.0)];
        let note = straggler_note(&ranks).unwrap();
        assert_eq!(
            note,
            "straggler: rank 1 computes 186% slower than the median (60.0 vs 21.0 ms per step)"
        );
        let even = [rank(20.0, 2.0), rank(24.0, 1.0), rank(21.0, 3.0)];
        assert_eq!(straggler_note(&even), None);
        // Tiny steps: 3x slower but by less than MIN_MS is noise.
        assert_eq!(straggler_note(&[rank(1.0, 0.0), rank(3.0, 0.0)]), None);
        assert_eq!(straggler_note(&[rank(1.0, 0.0)]), None);
    }
}

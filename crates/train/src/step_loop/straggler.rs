//! Naming the straggler: under data parallelism every rank's step takes the
//! slowest rank's time, so step times all look alike; what differs is the
//! compute (data, forward, backward, optimizer: everything but waiting in
//! the collectives and logging). From the per-rank phase times each log
//! window gathers, [`Stragglers`] keeps every rank's compute over the last
//! [`WINDOW_STEPS`] steps, and names the rank whose compute there exceeds
//! the median by more than a threshold: in the log line, in the run log
//! (TensorBoard's `straggler/*`) and in the summary. A rank slow for one
//! interval only is diluted by the others. It only reads figures; it never
//! gathers them itself.

use std::collections::VecDeque;
use std::fmt;

use crate::phases::{Phase, PHASES};

/// How much slower than the median a rank's compute must be to be named.
pub(super) const THRESHOLD: f64 = 0.5;
/// And by how many milliseconds per step at least, so that noise in tiny
/// steps is never called a straggler.
pub(super) const MIN_MS: f64 = 10.0;
/// The steps the verdict looks back over.
pub(super) const WINDOW_STEPS: u64 = 200;

/// A rank named the straggler.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Straggler {
    /// The rank, and its node when the job spans nodes.
    pub rank: usize,
    pub node: Option<usize>,
    /// Its compute and the median's, in milliseconds per step.
    pub ms: f64,
    pub median: f64,
    /// The steps the verdict covers.
    pub steps: u64,
}

impl Straggler {
    /// How much slower than the median, as a fraction (0.18: 18%).
    pub(crate) fn slower(&self) -> f64 {
        (self.ms - self.median) / self.median.max(1e-9)
    }
}

impl fmt::Display for Straggler {
    /// `rank 3 (node 1) computes 18% slower than the median over the last 200 steps`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}", self.rank)?;
        if let Some(node) = self.node {
            write!(f, " (node {node})")?;
        }
        write!(
            f,
            " computes {:.0}% slower than the median over the last {} steps",
            100.0 * self.slower(),
            self.steps
        )
    }
}

/// Every rank's compute over the last [`WINDOW_STEPS`] steps, by log window.
pub(super) struct Stragglers {
    /// (steps, each rank's compute milliseconds summed over them), oldest first.
    windows: VecDeque<(u64, Vec<f64>)>,
    /// Workers per node, when the job spans nodes (to name a rank's node).
    per_node: Option<usize>,
    /// The verdict at the last log window.
    last: Option<Straggler>,
}

impl Stragglers {
    /// For a group of `world` ranks, `local_world_size` of them on each node.
    pub(super) fn new(world: usize, local_world_size: usize) -> Stragglers {
        Stragglers {
            windows: VecDeque::new(),
            per_node: (local_world_size > 0 && local_world_size < world)
                .then_some(local_world_size),
            last: None,
        }
    }

    /// Adds a log window of `steps` steps whose per-rank phase times were `rank_ms` (each
    /// rank's milliseconds per step by phase, in the order of [`PHASES`]; empty when not
    /// gathered) and returns the verdict over the last [`WINDOW_STEPS`] steps.
    pub(super) fn add(
        &mut self,
        steps: u64,
        rank_ms: &[[f64; PHASES.len()]],
    ) -> Option<&Straggler> {
        if rank_ms.len() < 2 || steps == 0 {
            self.last = None;
            return None;
        }
        let compute = rank_ms
            .iter()
            .map(|ms| compute_ms(ms) * steps as f64)
            .collect();
        self.windows.push_back((steps, compute));
        while self.windows.len() > 1
            && self.windows.iter().skip(1).map(|(s, _)| s).sum::<u64>() >= WINDOW_STEPS
        {
            self.windows.pop_front();
        }
        self.last = self.verdict();
        self.last.as_ref()
    }

    /// The verdict at the last log window, for the summary.
    pub(super) fn last(&self) -> Option<&Straggler> {
        self.last.as_ref()
    }

    fn verdict(&self) -> Option<Straggler> {
        let steps: u64 = self.windows.iter().map(|(s, _)| s).sum();
        let ranks = self.windows.back()?.1.len();
        let mut mean = vec![0.0; ranks];
        for (_, compute) in self.windows.iter().filter(|(_, c)| c.len() == ranks) {
            mean.iter_mut().zip(compute).for_each(|(m, c)| *m += c);
        }
        mean.iter_mut().for_each(|m| *m /= steps.max(1) as f64);
        let mut sorted = mean.clone();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        let (rank, &ms) = mean.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1))?;
        if ms - median < MIN_MS || ms < median * (1.0 + THRESHOLD) {
            return None;
        }
        Some(Straggler {
            rank,
            node: self.per_node.map(|k| rank / k),
            ms,
            median,
            steps,
        })
    }
}

/// A rank's compute in one step: every phase but waiting in collectives and logging.
fn compute_ms(ms: &[f64; PHASES.len()]) -> f64 {
    PHASES
        .iter()
        .zip(ms)
        .filter(|(p, _)| !matches!(p, Phase::Comm | Phase::Logging))
        .map(|(_, v)| v)
        .sum()
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
    fn the_slow_rank_is_named_over_the_window_and_an_even_run_names_none() {
        let mut s = Stragglers::new(3, 3);
        let slow = [rank(20.0, 40.0), rank(60.0, 1.0), rank(21.0, 39.0)];
        let named = s.add(10, &slow).unwrap().to_string();
        assert_eq!(
            named,
            "rank 1 computes 186% slower than the median over the last 10 steps"
        );
        // One even interval after it does not clear a persistent straggler...
        let even = [rank(20.0, 2.0), rank(24.0, 1.0), rank(21.0, 3.0)];
        assert!(s.add(10, &even).is_some());
        // ...but 200 even steps do, and the summary then names nobody.
        for _ in 0..20 {
            s.add(10, &even);
        }
        assert_eq!(s.last(), None);
        let mut fresh = Stragglers::new(3, 3);
        assert_eq!(fresh.add(10, &even), None);
        // Tiny steps: 3x slower but by less than MIN_MS is noise; one rank has no median.
        assert_eq!(fresh.add(10, &[rank(1.0, 0.0), rank(3.0, 0.0)]), None);
        assert_eq!(fresh.add(10, &[rank(1.0, 0.0)]), None);
        // Across nodes the rank's node is named.
        let mut nodes = Stragglers::new(4, 2);
        let four = [
            rank(20.0, 0.0),
            rank(20.0, 0.0),
            rank(21.0, 0.0),
            rank(50.0, 0.0),
        ];
        let named = nodes.add(200, &four).unwrap();
        assert_eq!((named.rank, named.node), (3, Some(1)));
        assert!(named
            .to_string()
            .starts_with("rank 3 (node 1) computes 144% slower"));
    }
}

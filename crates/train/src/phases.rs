//! Where a training step's time goes: data wait, forward, backward,
//! communication wait, optimizer, logging; and what the process as a whole
//! used (CPU time, peak memory), for the benchmarks. Timings only; this
//! module never decides anything about training.

use std::fmt;
use std::time::{Duration, Instant};

/// The phases of a step, in the order they happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Building the batch from the data set.
    Data,
    /// The model's forward (and loss).
    Forward,
    /// The model's backward, including communication it overlapped.
    Backward,
    /// Waiting for gradient all-reduces that backward did not hide, plus
    /// the loss all-reduce.
    Comm,
    /// Clipping, the learning rate, the optimizer step, zeroing gradients.
    Optimizer,
    /// Log lines, validation, checkpoints.
    Logging,
}

/// Every phase, in the order they happen.
pub const PHASES: [Phase; 6] = [
    Phase::Data,
    Phase::Forward,
    Phase::Backward,
    Phase::Comm,
    Phase::Optimizer,
    Phase::Logging,
];

impl Phase {
    /// Short name for log lines.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Data => "data",
            Phase::Forward => "fwd",
            Phase::Backward => "bwd",
            Phase::Comm => "comm",
            Phase::Optimizer => "opt",
            Phase::Logging => "log",
        }
    }

    /// Name for metrics files and TensorBoard tags.
    pub fn long_name(self) -> &'static str {
        match self {
            Phase::Data => "data",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Comm => "comm_wait",
            Phase::Optimizer => "optimizer",
            Phase::Logging => "logging",
        }
    }
}

/// Accumulated time per phase.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Phases {
    times: [Duration; PHASES.len()],
}

impl Phases {
    /// Adds `d` to `phase`.
    pub fn add(&mut self, phase: Phase, d: Duration) {
        self.times[phase as usize] += d;
    }

    /// Runs `f`, charging its time to `phase`.
    pub fn time<T>(&mut self, phase: Phase, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        self.add(phase, t.elapsed());
        out
    }

    /// Time charged to `phase`.
    pub fn get(&self, phase: Phase) -> Duration {
        self.times[phase as usize]
    }

    /// Time charged to all phases.
    pub fn total(&self) -> Duration {
        self.times.iter().sum()
    }

    /// Adds every phase of `other`.
    pub fn merge(&mut self, other: &Phases) {
        for (a, b) in self.times.iter_mut().zip(other.times) {
            *a += b;
        }
    }

    /// Per-step milliseconds over `steps` steps, e.g.
    /// `data 0.1 fwd 5.0 bwd 9.2 comm 0.4 opt 1.1 log 0.0 ms`.
    pub fn per_step(&self, steps: u64) -> PerStep<'_> {
        PerStep {
            phases: self,
            steps: steps.max(1),
        }
    }

    /// Milliseconds per step over `steps` steps, in the order of [`PHASES`].
    pub fn ms_per_step(&self, steps: u64) -> [f64; PHASES.len()] {
        self.times
            .map(|t| t.as_secs_f64() * 1e3 / steps.max(1) as f64)
    }

    /// Shares of the total, e.g. `data 1% fwd 33% ...`.
    pub fn shares(&self) -> String {
        let total = self.total().as_secs_f64().max(1e-12);
        PHASES
            .iter()
            .map(|&p| {
                format!(
                    "{} {:.0}%",
                    p.name(),
                    100.0 * self.get(p).as_secs_f64() / total
                )
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Display helper of [`Phases::per_step`].
pub struct PerStep<'a> {
    phases: &'a Phases,
    steps: u64,
}

impl fmt::Display for PerStep<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, &p) in PHASES.iter().enumerate() {
            let ms = self.phases.get(p).as_secs_f64() * 1e3 / self.steps as f64;
            write!(f, "{}{} {:.1}", if i > 0 { " " } else { "" }, p.name(), ms)?;
        }
        f.write_str(" ms")
    }
}

/// Peak resident set size of this process in MB, from /proc/self/status (0 where unavailable).
pub fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// User + system CPU time of this process in ms, from /proc/self/stat (0 where unavailable).
pub fn process_cpu_ms() -> f64 {
    let ticks = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
            let rest = &s[s.rfind(')')? + 2..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?)
        });
    // Linux reports these in USER_HZ, which is 100 on every mainstream configuration.
    ticks.map_or(0.0, |t| t * 10.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_step_and_shares() {
        let mut p = Phases::default();
        p.add(Phase::Forward, Duration::from_millis(30));
        p.add(Phase::Backward, Duration::from_millis(60));
        p.add(Phase::Optimizer, Duration::from_millis(10));
        assert_eq!(
            p.per_step(10).to_string(),
            "data 0.0 fwd 3.0 bwd 6.0 comm 0.0 opt 1.0 log 0.0 ms"
        );
        assert_eq!(p.shares(), "data 0% fwd 30% bwd 60% comm 0% opt 10% log 0%");
        let mut q = Phases::default();
        q.merge(&p);
        q.merge(&p);
        assert_eq!(q.total(), Duration::from_millis(200));
    }
}

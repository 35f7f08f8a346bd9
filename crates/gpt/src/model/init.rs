//! GPT-2's parameter initialisation, drawn from one seeded stream so that any subset of the
//! model (a pipeline stage) gets exactly the values the whole model would.
//!
//! It draws on every core, chunk by chunk, the generator skipping ahead over the other chunks'
//! draws, so the values never depend on the number of threads.

use super::*;

/// Deterministic N(0, 1) draws: cohort's SplitMix64 feeding Box-Muller.
#[derive(Clone)]
pub(super) struct Normal(SplitMix64);

impl Normal {
    pub(super) fn new(seed: u64) -> Self {
        Normal(SplitMix64::new(seed))
    }
    /// Consumes the draws `fill` would make for `len` values, without computing them.
    pub(super) fn skip(&mut self, len: usize) {
        self.0.skip(2 * len.div_ceil(2) as u64);
    }
    pub(super) fn fill(&mut self, x: &mut [f32], std: f64) {
        for pair in x.chunks_mut(2) {
            let (u1, u2) = (self.0.next_f64_open(), self.0.next_f64_open());
            let r = (-2.0 * u1.ln()).sqrt() * std;
            let th = 2.0 * std::f64::consts::PI * u2;
            pair[0] = (r * th.cos()) as f32;
            if pair.len() > 1 {
                pair[1] = (r * th.sin()) as f32;
            }
        }
    }
}

/// GPT-2's init of every tensor of `views` (the whole model's, in layout order), drawn from one
/// stream: `place(view)` says where in `params` the tensor goes, or `None` to skip it. A skipped
/// tensor still consumes its draws, so any subset of the model (a pipeline stage) gets exactly
/// the values the whole model would.
pub(crate) fn init_tensors(
    views: &[ParamView],
    n_layers: usize,
    seed: u64,
    params: &mut [f32],
    place: impl Fn(&ParamView) -> Option<Range<usize>>,
) {
    let mut rng = Normal::new(seed);
    let resid_std = 0.02 / (2.0 * n_layers as f64).sqrt();
    // The draws go to every core: the generator is a counter, so each chunk
    // starts where the sequential order would be and the values do not
    // depend on the thread count. On config B this is most of the time
    // from launch to the first step.
    let mut draws: Vec<(Range<usize>, Normal, f64)> = Vec::new();
    for v in views {
        let drawn = !(v.name.ends_with(".bias") || v.name.contains("ln_"));
        let Some(r) = place(v) else {
            if drawn {
                rng.skip(v.range.len());
            }
            continue;
        };
        if v.name.ends_with(".bias") {
            params[r].fill(0.0);
        } else if v.name.contains("ln_") {
            params[r].fill(1.0);
        } else {
            let std = if v.name.ends_with("c_proj.weight") {
                resid_std
            } else {
                0.02
            };
            for start in (r.start..r.end).step_by(INIT_CHUNK) {
                let end = (start + INIT_CHUNK).min(r.end);
                draws.push((start..end, rng.clone(), std));
                rng.skip(end - start);
            }
        }
    }
    draws.sort_by_key(|(r, _, _)| r.start);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut chunks: Vec<(&mut [f32], Normal, f64)> = Vec::with_capacity(draws.len());
    let mut rest = params;
    let mut at = 0;
    for (r, rng, std) in draws {
        let (_, tail) = rest.split_at_mut(r.start - at);
        let (chunk, tail) = tail.split_at_mut(r.len());
        chunks.push((chunk, rng, std));
        rest = tail;
        at = r.end;
    }
    let per_thread = chunks.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for group in chunks.chunks_mut(per_thread) {
            s.spawn(move || {
                for (chunk, rng, std) in group {
                    rng.fill(chunk, *std);
                }
            });
        }
    });
}

/// Values per parallel initialisation chunk; even, so that no Box-Muller
/// pair straddles two chunks.
pub(super) const INIT_CHUNK: usize = 1 << 16;

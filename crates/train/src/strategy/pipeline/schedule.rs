//! The order of one stage's forwards and backwards in a step: GPipe (all forwards, then all
//! backwards) or 1F1B (warm-up forwards, then one forward and one backward in turn). A pure
//! function of the stage and counts: it never communicates or computes.

use crate::config::PipelineSchedule;

/// One unit of a stage's work in a step: the forward or backward of a micro-batch, in an
/// activation slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Op {
    Forward { micro: usize, slot: usize },
    Backward { micro: usize, slot: usize },
}

/// The order in which `stage` of `stages` runs `micro` micro-batches.
pub(super) fn schedule(
    kind: PipelineSchedule,
    stage: usize,
    stages: usize,
    micro: usize,
) -> Vec<Op> {
    let mut ops = Vec::with_capacity(2 * micro);
    match kind {
        PipelineSchedule::Gpipe => {
            ops.extend((0..micro).map(|m| Op::Forward { micro: m, slot: m }));
            ops.extend((0..micro).map(|m| Op::Backward { micro: m, slot: m }));
        }
        PipelineSchedule::OneFOneB => {
            // Micro-batch m's backward comes after forward m + warmup, so at most warmup + 1
            // are in flight and slots can be reused modulo that.
            let warmup = (stages - 1 - stage).min(micro);
            let slots = warmup + 1;
            let fwd = |m: usize| Op::Forward {
                micro: m,
                slot: m % slots,
            };
            let bwd = |m: usize| Op::Backward {
                micro: m,
                slot: m % slots,
            };
            ops.extend((0..warmup).map(fwd));
            for m in warmup..micro {
                ops.push(fwd(m));
                ops.push(bwd(m - warmup));
            }
            ops.extend((micro - warmup..micro).map(bwd));
        }
    }
    ops
}

//! The part hooks of a sharded pass: what happens to a part's memory
//! around its forward and backward (parameters gathered and released under
//! stage 3, gathered and kept in the forward after a deferred ZeRO-2
//! update, gradients made resident again from the spare pages). The hooks
//! never decide the order of the parts (the model calls them) and cannot
//! fail: their first error waits in the shared state.

use std::ops::Range;
use std::sync::Mutex;

use cohort_comm::ProcessGroup;
use cohort_gpt::{Part, PartHooks};

use super::shards::{lock, Shards};

/// The part hooks: a part's gradient made resident again (from the spare
/// pages) just before its backward writes it; under stage 3 also each part's
/// parameters gathered before it runs and released after (the head's after
/// its backward: its forward is last and its backward first, so what its
/// forward gathered serves both). Under stage 2, the first forward after an
/// update whose gathers were deferred gathers each part and keeps it.
pub(super) struct PartMemory<'s> {
    pub(super) pg: &'s ProcessGroup,
    pub(super) st: &'s Mutex<Shards>,
    /// Each part's parameters are gathered before it runs: stage 3, or
    /// stage 2's deferred gathers.
    pub(super) gather: bool,
    /// And released after it (stage 3; stage 2 holds the whole model).
    pub(super) release: bool,
}

impl PartHooks for PartMemory<'_> {
    fn before(&mut self, _: Part, range: Range<usize>, params: &mut [f32]) {
        if !self.gather {
            return;
        }
        let mut st = lock(self.st);
        if !self.release {
            // Stage 2: the model's buffer stays resident; a tied head's
            // wte came with the embeddings, gathered first.
            let held = |r: &Range<usize>| r.start <= range.start && range.end <= r.end;
            if !st.flight.recording.iter().any(held) {
                st.gather(self.pg, range, params);
            }
            return;
        }
        if let Some(i) = st.kept.iter().position(|k| *k == range) {
            // The head's parameters, kept from its forward.
            st.kept.swap_remove(i);
            return;
        }
        // The gather overwrites every element, so the spare pages' old
        // contents need no zeroing.
        st.spare.refill(params, false);
        st.gather(self.pg, range, params);
    }

    fn after(&mut self, part: Part, range: Range<usize>, params: &mut [f32]) {
        if !self.release {
            return;
        }
        let mut st = lock(self.st);
        if part == Part::Head && st.flight.pass == Some(0) {
            st.kept.push(range);
            return;
        }
        st.spare.release(params);
    }

    fn embedding_rows(&mut self, wte: Range<usize>, ids: &[u32], rows: &[f32]) {
        lock(self.st).add_rows(self.pg, wte, ids, rows);
    }

    fn before_grads(&mut self, part: Part, _: Range<usize>, grads: &mut [f32]) {
        // Released after the last reduce-scatter, so all zeros, as the
        // backward needs them: zero again what the spare pages bring.
        let mut st = lock(self.st);
        st.grads_live += grads.len();
        st.grads_peak = st.grads_peak.max(st.grads_live);
        st.spare.refill(grads, true);
        if part == Part::Embeddings {
            // The backward's last part: nothing is refilled after it this
            // step, and the step's peak (the whole gradient shard written)
            // lies here.
            st.spare.give_back();
        }
    }
}

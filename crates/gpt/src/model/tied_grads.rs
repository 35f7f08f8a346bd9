//! A tied wte's gradient handed over in pieces rather than written whole
//! ([`Backward::sparse_embeddings`](crate::Backward::sparse_embeddings)): what the head's
//! backward and the embeddings' backward need for it. It never decides the order of the parts
//! (the passes do) and adds nothing into a whole (V, C) buffer.

use std::ops::Range;

use cohort_engine::ViewMut;

use super::{embed_scatter, Acts, Pass};

/// A tied head's weight gradient handed over block by block of the vocabulary as each is
/// written ([`Backward::sparse_embeddings`](crate::Backward::sparse_embeddings)): `begin`
/// just before a block's rows are first written, `done` once they are final, each with the
/// rows' range of the flat buffer (the weight starting at `at`) and their gradient.
pub(crate) struct HeadBlocks<'h, 'g> {
    pub(crate) at: usize,
    /// The weight's gradient (wte's), which `grads.head` then leaves empty.
    pub(crate) rows: ViewMut<'g, f32>,
    pub(crate) begin: &'h mut dyn FnMut(Range<usize>, ViewMut<'_, f32>),
    pub(crate) done: &'h mut dyn FnMut(Range<usize>, ViewMut<'g, f32>),
}

/// [`embed_backward`](super::embed_backward) with wte's gradient as rows (host only,
/// [`Backward::sparse_embeddings`](crate::Backward::sparse_embeddings)): `rows` is handed the
/// batch's distinct token ids, ascending, and each one's gradient row (summed over its
/// positions in the same order as the whole-table backward), which nothing adds into a
/// (V, C) buffer; wpe's gradient goes into `dwpe` as ever.
pub(crate) fn embed_backward_rows(
    pass: &mut Pass,
    dwpe: ViewMut<f32>,
    a: &mut Acts,
    rows: &mut dyn FnMut(&[u32], &[f32]),
) {
    let (c, batch) = (pass.dims.c, pass.batch);
    let ids = batch.host_ids();
    let mut distinct = ids.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    // Each position's index among the distinct ids: the rows of a (distinct, C) table.
    let at: Vec<u32> = ids
        .iter()
        .map(|id| distinct.partition_point(|d| d < id) as u32)
        .collect();
    let mut grad = vec![0f32; distinct.len() * c];
    embed_scatter(pass, (&mut grad[..]).into(), dwpe, (&at[..]).into(), a);
    rows(&distinct, &grad);
}

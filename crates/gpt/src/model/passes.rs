//! The whole model's forward and backward as sequences of parts (embeddings, blocks, head),
//! with the per-part hooks around each part and the readiness hook after each finished range
//! of gradients.
//!
//! This module decides only the order of the parts and who is told what when; the math is in
//! the layer functions, and it never allocates beyond the hooks' range lists. The per-part
//! hooks take host slices: on a device they are not called (the model refuses them there); the
//! readiness hook takes views of the gradient buffer, on any device.

use super::*;

/// Calls `hooks.before` for each range `part` reads.
fn enter(lay: &Layout, hooks: &mut dyn PartHooks, part: Part, p: &mut ViewMut<f32>) {
    for range in lay.part_reads(part) {
        if let Some(p) = p.slice_mut(range.clone()).try_host() {
            hooks.before(part, range, p);
        }
    }
}

/// Calls `hooks.after` for each range `part` read.
fn leave(lay: &Layout, hooks: &mut dyn PartHooks, part: Part, p: &mut ViewMut<f32>) {
    for range in lay.part_reads(part) {
        if let Some(p) = p.slice_mut(range.clone()).try_host() {
            hooks.after(part, range, p);
        }
    }
}

/// Calls `hooks.before_grads` for `range` of the gradients, `g` (host memory only).
fn grads_hook(hooks: &mut dyn PartHooks, part: Part, range: Range<usize>, g: ViewMut<f32>) {
    if let Some(g) = g.try_host() {
        hooks.before_grads(part, range, g);
    }
}

/// The forward of every part in order; returns the mean loss when the batch has targets.
pub(super) fn forward_pass(
    pass: &mut Pass,
    lay: &Layout,
    mut p: ViewMut<f32>,
    a: &mut Acts,
    hooks: &mut dyn PartHooks,
) -> Option<f32> {
    let p = &mut p;
    enter(lay, hooks, Part::Embeddings, p);
    embed_forward(pass, lay, p.as_view(), a);
    leave(lay, hooks, Part::Embeddings, p);
    for (l, bl) in lay.blocks.iter().enumerate() {
        enter(lay, hooks, Part::Block(l), p);
        let at = BlockAt {
            local: l,
            global: l,
            layout: bl,
        };
        block_forward(pass, at, p.as_view(), a);
        leave(lay, hooks, Part::Block(l), p);
    }
    enter(lay, hooks, Part::Head, p);
    let loss = head_forward(pass, lay, p.as_view(), a);
    leave(lay, hooks, Part::Head, p);
    loss
}

/// The backward of every part in reverse order, handing each finished range of `grads` to
/// `ready` (each block in two with `split_blocks`; a tied wte's gradient as
/// [`Backward::sparse_embeddings`] says with `sparse`).
pub(super) fn backward_pass<'g>(
    pass: &mut Pass,
    lay: &Layout,
    mut p: ViewMut<f32>,
    grads: ViewMut<'g, f32>,
    a: &mut Acts,
    hooks: &mut dyn PartHooks,
    (mut ready, split_blocks, sparse): (impl FnMut(Range<usize>, ViewMut<'g, f32>), bool, bool),
) {
    let p = &mut p;
    let tied = lay.tied();
    let sparse = sparse && tied;
    // Head and ln_f. The head's weight gradient goes to wte when tied (lower part of the buffer,
    // handed out last, or block by block as it is written when sparse) or to lm_head (in the
    // top range, after ln_f).
    let head_start = lay.ln_f_w.start;
    let (mut rest, mut top) = grads.split_at_mut(head_start);
    // Where `rest` starts in the buffer: past wte when sparse, whose gradient is split off for
    // the head to hand over.
    let mut base = 0;
    let mut wte_g = ViewMut::default();
    if sparse {
        let (lower, upper) = std::mem::take(&mut rest).split_at_mut(lay.wte.end);
        (wte_g, rest, base) = (lower.into_slice(lay.wte.clone()), upper, lay.wte.end);
    }
    enter(lay, hooks, Part::Head, p);
    {
        if tied && !sparse {
            grads_hook(
                hooks,
                Part::Head,
                lay.wte.clone(),
                rest.slice_mut(lay.wte.clone()),
            );
        }
        grads_hook(hooks, Part::Head, head_start..lay.total, top.reborrow());
        let (lnf_g, lm_head_g) = top.reborrow().split_at_mut(lay.ln_f_b.end - head_start);
        let head = match (tied, sparse) {
            // Sparse: the head writes wte's rows through `HeadBlocks`.
            (true, true) => ViewMut::default(),
            (true, false) => rest.slice_mut(lay.wte.clone()),
            (false, _) => lm_head_g,
        };
        let mut lnf_g = lnf_g;
        let (ln_f_w, ln_f_b) = wb(&mut lnf_g, head_start, &lay.ln_f_w, &lay.ln_f_b);
        let grads = HeadGrads {
            head,
            ln_f_w,
            ln_f_b,
        };
        let begin: &mut dyn FnMut(Range<usize>, ViewMut<'_, f32>) =
            &mut |range, g| grads_hook(&mut *hooks, Part::Head, range, g);
        let blocks = sparse.then(|| HeadBlocks {
            at: lay.wte.start,
            rows: std::mem::take(&mut wte_g),
            begin,
            done: &mut ready,
        });
        head_backward(pass, lay, p.as_view(), grads, a, blocks);
    }
    leave(lay, hooks, Part::Head, p);
    ready(head_start..lay.total, top);

    for (l, bl) in lay.blocks.iter().enumerate().rev() {
        let (lower, mut g) = std::mem::take(&mut rest).split_at_mut(bl.all.start - base);
        rest = lower;
        enter(lay, hooks, Part::Block(l), p);
        grads_hook(hooks, Part::Block(l), bl.all.clone(), g.reborrow());
        let at = BlockAt {
            local: l,
            global: l,
            layout: bl,
        };
        if a.checkpoint {
            // The block's activations were not kept: recompute them from its input (the same
            // dropout masks, so the same values).
            block_forward(pass, at, p.as_view(), a);
        }
        if split_blocks {
            block_backward(pass, at, p.as_view(), g, a, Some(&mut ready));
            leave(lay, hooks, Part::Block(l), p);
        } else {
            block_backward(pass, at, p.as_view(), g.reborrow(), a, None);
            leave(lay, hooks, Part::Block(l), p);
            ready(bl.all.clone(), g);
        }
    }

    if sparse {
        // `rest` is wpe's: wte's rows go to the hooks, wpe's gradient is handed over alone.
        if !lay.wpe.is_empty() {
            grads_hook(hooks, Part::Embeddings, lay.wpe.clone(), rest.reborrow());
        }
        let wte = lay.wte.clone();
        let rows = &mut |ids: &[u32], g: &[f32]| hooks.embedding_rows(wte.clone(), ids, g);
        embed_backward_rows(pass, rest.reborrow(), a, rows);
        if !lay.wpe.is_empty() {
            ready(lay.wpe.clone(), rest);
        }
        return;
    }
    if !tied {
        let wte = rest.slice_mut(lay.wte.clone());
        grads_hook(hooks, Part::Embeddings, lay.wte.clone(), wte);
    }
    let (mut dwte, mut dwpe) = rest.reborrow().split_at_mut(lay.wpe.start);
    if !lay.wpe.is_empty() {
        grads_hook(hooks, Part::Embeddings, lay.wpe.clone(), dwpe.reborrow());
    }
    // The embeddings' backward adds each position's gradient into the rows of wte and wpe it
    // used and reads no parameter, so it has no parameter range to ask the hooks for: a sharded
    // strategy would gather the largest part of the model (wte) for nothing.
    embed_backward(pass, dwte.slice_mut(lay.wte.clone()), dwpe, a);
    ready(0..lay.wpe.end, rest);
}

//! What a caller can ask of one forward or backward pass: [`Forward`] (the batch, its padding
//! mask, segment ids and labels, per-part hooks) and [`Backward`] (the gradient-readiness hook, per-part
//! hooks), and the [`Part`]s those hooks are told about.
//!
//! This module only describes a pass; it never computes, and an option left out costs the pass
//! nothing (no allocation, the same kernels in the same order).

use cohort_engine::ViewMut;
use std::ops::Range;

use crate::Labels;

/// A part of the model that runs as one unit, in forward order: what a
/// [`PartHooks`] is told is about to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// wte and wpe.
    Embeddings,
    /// Transformer block `l`.
    Block(usize),
    /// ln_f, and lm_head when untied. A tied head also reads wte, which is
    /// in the embeddings' range.
    Head,
}

/// Hooks called around each [`Part`] of a pass ([`Forward::parts`], [`Backward::parts`]):
/// the seam for sharded parameters. A strategy that keeps only a shard of each part on this
/// rank gathers the part's parameters into `params` in [`PartHooks::before`] (and may prefetch
/// the next part's), and frees them again in [`PartHooks::after`]. They run on an engine
/// thread, hence `Send`.
///
/// A closure `FnMut(Part, Range<usize>, &mut [f32])` is a `PartHooks` that does nothing after
/// a part.
pub trait PartHooks: Send {
    /// Called just before `part` runs, once for each range of the flat parameter buffer the
    /// part reads, `params` being exactly that range: its own ([`GPT::part_range`]), and for
    /// a tied head first wte's, which it reads as its weight. The embeddings' backward reads
    /// no parameter and is not announced.
    ///
    /// [`GPT::part_range`]: crate::GPT::part_range
    fn before(&mut self, part: Part, range: Range<usize>, params: &mut [f32]);
    /// Called just after `part` ran (in backward: after its gradients are
    /// computed), once for each range it read, in the same order as
    /// [`PartHooks::before`]: the part will not read `params` again until the
    /// next `before`.
    fn after(&mut self, part: Part, range: Range<usize>, params: &mut [f32]) {
        let _ = (part, range, params);
    }
    /// Called in backward just before `part` first adds into `grads`, the
    /// range `range` of the flat gradient buffer, once for each range a
    /// backward writes: the head's own (and a tied head's wte, to which the
    /// embeddings' backward adds later), each block's, then the embeddings'
    /// wpe (and wte when untied). The backward then adds into what `grads`
    /// holds, so its values must stay as they are; a strategy that released
    /// the range's memory (all zeros) can make it resident again here, which
    /// is cheaper than the page faults of the backward's first writes.
    /// Does nothing unless implemented.
    fn before_grads(&mut self, part: Part, range: Range<usize>, grads: &mut [f32]) {
        let _ = (part, range, grads);
    }
    /// Under [`Backward::sparse_embeddings`] (a tied model), the embeddings' share of wte's
    /// gradient, which the backward does not add into the buffer: `ids`, the batch's distinct
    /// token ids in ascending order, and `rows` (one row of C per id, in the same order), each
    /// id's gradient summed over the positions it holds; wte is `wte` in the flat buffer (row
    /// `id` at `wte.start + id * C`). Never called otherwise; a strategy that asks for sparse
    /// embeddings must implement it, or loses that share.
    fn embedding_rows(&mut self, wte: Range<usize>, ids: &[u32], rows: &[f32]) {
        let _ = (wte, ids, rows);
    }
}

impl<F: FnMut(Part, Range<usize>, &mut [f32]) + Send> PartHooks for F {
    fn before(&mut self, part: Part, range: Range<usize>, params: &mut [f32]) {
        self(part, range, params)
    }
}

/// The hooks of a pass asked for none.
pub(crate) struct NoHooks;

impl PartHooks for NoHooks {
    fn before(&mut self, _: Part, _: Range<usize>, _: &mut [f32]) {}
}

/// One forward pass for [`GPT::forward`](crate::GPT::forward): the (B, T) batch of token ids and
/// what to do besides computing the logits.
///
/// ```
/// # use cohort_gpt::{Forward, GPTConfig, Labels, GPT};
/// # let cfg = GPTConfig { vocab_size: 11, max_position_embeddings: 8, n_layers: 1, n_heads: 2,
/// #     d_model: 8, d_ff: 16, dropout: 0.0, ..GPTConfig::default() };
/// # let mut model = GPT::new(cfg, 42).unwrap();
/// let (ids, mask) = ([1u32, 2, 3, 4, 5, 6], [1u8, 1, 1, 1, 0, 0]);
/// let loss = model.forward(
///     Forward::new(&ids, 2, 3).attention_mask(Some(&mask)).labels(Labels::Aligned(&[1, 2, 3, 4, 5, 6])),
/// )?;
/// assert!(loss.is_some());
/// # Ok::<_, cohort_gpt::GptError>(())
/// ```
pub struct Forward<'a> {
    pub(crate) input_ids: &'a [u32],
    pub(crate) batch: usize,
    pub(crate) seq: usize,
    pub(crate) attention_mask: Option<&'a [u8]>,
    pub(crate) segments: Option<&'a [u32]>,
    pub(crate) labels: Option<Labels<'a>>,
    pub(crate) parts: Option<&'a mut dyn PartHooks>,
}

impl<'a> Forward<'a> {
    /// A forward of `input_ids`, (`batch`, `seq`) row-major, without a mask, labels or hooks:
    /// it computes the logits only.
    pub fn new(input_ids: &'a [u32], batch: usize, seq: usize) -> Forward<'a> {
        Forward {
            input_ids,
            batch,
            seq,
            attention_mask: None,
            segments: None,
            labels: None,
            parts: None,
        }
    }

    /// The attention mask, (B, T): 1 for a token, 0 for padding, which no position attends to
    /// and the loss ignores. None: every position is a token.
    pub fn attention_mask(mut self, mask: Option<&'a [u8]>) -> Forward<'a> {
        self.attention_mask = mask;
        self
    }

    /// Segment ids (B, T) of rows that pack several sequences (packed short conversations):
    /// each run of equal ids in a row is one sequence, which attends only to itself (causally),
    /// whose positions (rotary or learned) restart at 0, and whose last position predicts
    /// nothing of the next one (`Labels::Aligned`; `Labels::Next` targets are the caller's).
    /// None: each row is one sequence.
    pub fn segments(mut self, segments: Option<&'a [u32]>) -> Forward<'a> {
        self.segments = segments;
        self
    }

    /// Labels (B, T) in either convention ([`Labels`]): the forward then also computes the mean
    /// loss over the positions they count, and a backward may follow.
    pub fn labels(mut self, labels: impl Into<Option<Labels<'a>>>) -> Forward<'a> {
        self.labels = labels.into();
        self
    }

    /// Calls `hooks` just before and just after each [`Part`] runs.
    pub fn parts(mut self, hooks: &'a mut dyn PartHooks) -> Forward<'a> {
        self.parts = Some(hooks);
        self
    }
}

/// The readiness hook of a [`Backward`] that asked for none.
pub type NoReadyHook = fn(Range<usize>, ViewMut<'_, f32>);

/// One backward pass for [`GPT::backward`](crate::GPT::backward): what it tells whom as it goes.
/// `Backward::new()` asks for nothing.
pub struct Backward<'h, F = NoReadyHook> {
    pub(crate) ready: F,
    pub(crate) parts: Option<&'h mut dyn PartHooks>,
    pub(crate) split_blocks: bool,
    pub(crate) sparse_embeddings: bool,
}

impl Backward<'static> {
    /// A backward without hooks.
    pub fn new() -> Backward<'static> {
        Backward {
            ready: |_, _| {},
            parts: None,
            split_blocks: false,
            sparse_embeddings: false,
        }
    }
}

impl Default for Backward<'static> {
    fn default() -> Self {
        Backward::new()
    }
}

impl<'h, F> Backward<'h, F> {
    /// As soon as a range of gradients is final, calls `ready(range, grads)` with exactly that
    /// part of the gradient buffer, which this backward will not touch again: what lets
    /// data-parallel training overlap communication with backward. Order: [ln_f (+ lm_head if
    /// untied)], block L-1, ..., block 0, then [wte, wpe] (wte also holds the tied head's
    /// gradient); the ranges partition the buffer. It runs on an engine thread, hence `Send`.
    /// On the CPU `grads.host()` is the slice; on a device "final" means that the kernels
    /// writing it have been launched: a reader orders itself after them with an event recorded
    /// in the hook (`Backend::record_event`, on [`GPT::backend_handle`](crate::GPT::backend_handle)).
    pub fn on_ready<G>(self, ready: G) -> Backward<'h, G> {
        Backward {
            ready,
            parts: self.parts,
            split_blocks: self.split_blocks,
            sparse_embeddings: self.sparse_embeddings,
        }
    }

    /// Calls `hooks` just before and just after each [`Part`]'s backward that reads parameters
    /// (head first, block 0 last; the embeddings' backward reads none), and before each
    /// gradient range is first written ([`PartHooks::before_grads`]); a part's `after` comes
    /// before its gradients are handed to the readiness hook.
    pub fn parts<'k>(self, hooks: &'k mut dyn PartHooks) -> Backward<'k, F> {
        Backward {
            ready: self.ready,
            parts: Some(hooks),
            split_blocks: self.split_blocks,
            sparse_embeddings: self.sparse_embeddings,
        }
    }

    /// Hands each block to the readiness hook in two ranges rather than one: its MLP's (from
    /// `ln_2` up, the top of its range) as soon as `ln_2`'s backward has finished it, while the
    /// attention's backward still runs, then the rest ([`GPT::split_ready_ranges`]
    /// (crate::GPT::split_ready_ranges) gives the order). For a reducer that takes any ranges
    /// (DDP): a reduction of the MLP's gradients overlaps the attention's backward, and of
    /// block 0 only the attention's third is left when backward ends. With it, a block's part
    /// hooks' `after` comes after its MLP half's hand-over.
    pub fn split_blocks(mut self) -> Self {
        self.split_blocks = true;
        self
    }

    /// A tied model's wte gradient is never written whole (for a sharded strategy, which
    /// would otherwise hold all of it, the largest tensor, through the whole backward): the
    /// head's part of it is handed to the readiness hook block by block of the vocabulary
    /// (ranges of wte, each just after the head's backward wrote it; a block's
    /// [`PartHooks::before_grads`] comes just before), and the embeddings' part to
    /// [`PartHooks::embedding_rows`] as rows of the batch's tokens, not added into the buffer;
    /// wpe (if any) is handed over alone. Order: wte's blocks, [ln_f], the blocks as ever,
    /// [wpe]; wte's range then holds only the head's part. Needs [`Backward::parts`] (on the
    /// host); no effect on an untied model.
    pub fn sparse_embeddings(mut self) -> Self {
        self.sparse_embeddings = true;
        self
    }
}

//! The GPT-2 model: flat parameters and gradients, the activation arena, forward and the
//! layer-wise backward with its readiness hook.
//!
//! Dims, named once: B batch, T sequence, C d_model, F d_ff, V vocab, L layers, NH heads,
//! N = B*T tokens. All compute goes through the engine's `Backend`; this file decides only what
//! is computed, in which order, and into which buffer. It never allocates after the first
//! forward for a given token count (a larger B*T reallocates the arena once).
//!
//! Memory: per layer the arena keeps the block input, the residual after attention, qkv, the MLP
//! pre-activation and the LayerNorm / softmax statistics. The LayerNorm, attention and GELU
//! outputs are kept too when they fit in `KEEP_MAX_BYTES` (small models, where recomputing them
//! costs a visible share of the step) and recomputed in backward otherwise; the (T, T) attention
//! probabilities are never stored, which is what keeps config B far below PyTorch's footprint.

use std::ops::Range;
use std::time::{Duration, Instant};

use cohort_engine::cpu::{AttnDims, Cpu};
use cohort_engine::{AlignedFloats, Backend, DType, Dropout};
use cohort_rng::SplitMix64;

use crate::layout::{BlockLayout, Layout};
use crate::{GPTConfig, GptError, Labels, ParamView};

mod arena;
mod init;
mod layers;
mod profile;
#[cfg(test)]
mod tests;

pub(crate) use arena::*;
pub(crate) use init::*;
pub(crate) use layers::*;
pub(crate) use profile::*;

/// A part of the model that runs as one unit, in forward order: what a
/// [`PartHook`] is told is about to run.
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

/// Called with `(part, range, params)` just before `part` runs in
/// [`GPT::forward_with`] or [`GPT::backward_with`], once for each range of
/// the flat parameter buffer the part reads, `params` being exactly that
/// range: its own ([`GPT::part_range`]), and for a tied head first wte's,
/// which it reads as its weight. The embeddings' backward reads no parameter
/// and is not announced. This is the seam for sharded
/// parameters: a strategy that keeps only a shard of each part on this rank
/// gathers the part's parameters into `params` here (and may prefetch the
/// next part's). It runs on an engine thread, hence `Send`.
pub type PartHook<'h> = dyn FnMut(Part, Range<usize>, &mut [f32]) + Send + 'h;

/// A [`PartHook`] with its counterpart after each part: what a strategy
/// that gathers a part's parameters before it runs needs in order to free
/// them again once it has run ([`GPT::forward_parts`],
/// [`GPT::backward_parts`]).
pub trait PartHooks: Send {
    /// As a [`PartHook`]: called just before `part` runs, once for each
    /// range it reads, `params` being exactly that range.
    fn before(&mut self, part: Part, range: Range<usize>, params: &mut [f32]);
    /// Called just after `part` ran (in backward: after its gradients are
    /// computed), once for each range it read, in the same order as
    /// [`PartHooks::before`]: the part will not read `params` again until the
    /// next `before`.
    fn after(&mut self, part: Part, range: Range<usize>, params: &mut [f32]);
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
}

/// A plain [`PartHook`] as [`PartHooks`] that does nothing after a part.
struct BeforeOnly<'a, 'h>(&'a mut PartHook<'h>);

impl PartHooks for BeforeOnly<'_, '_> {
    fn before(&mut self, part: Part, range: Range<usize>, params: &mut [f32]) {
        (self.0)(part, range, params)
    }
    fn after(&mut self, _: Part, _: Range<usize>, _: &mut [f32]) {}
}

/// The model: config, flat parameters and gradients, activation arena, backend.
pub struct GPT {
    config: GPTConfig,
    layout: Layout,
    params: AlignedFloats,
    grads: AlignedFloats,
    dev: Box<dyn Backend>,
    act_layout: Option<ActLayout>,
    arena: AlignedFloats,
    attn_scratch: AlignedFloats,
    batch: Batch,
    training: bool,
    dropout_seed: u64,
    rank: u64,
    step: u64,
    profile: Profile,
    /// `KEEP_MAX_BYTES`; tests lower it to cover the recomputing path.
    keep_max_bytes: usize,
    /// `LOGITS_MAX_BYTES`; tests lower it to cover the head in vocabulary blocks.
    logits_max_bytes: usize,
    /// Keep only each block's input and recompute the block's forward inside backward.
    activation_checkpointing: bool,
}

impl std::fmt::Debug for GPT {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GPT")
            .field("config", &self.config)
            .field("params", &self.params.len())
            .field("backend", &self.dev)
            .finish()
    }
}

/// The CPU backend sized by `COHORT_NUM_THREADS`.
pub(crate) fn cpu_from_env() -> Result<Box<dyn Backend>, GptError> {
    let cpu = Cpu::from_env().map_err(|e| GptError::Engine {
        op: "thread pool",
        reason: e.to_string(),
    })?;
    Ok(Box::new(cpu))
}

/// A CPU backend of `threads` threads computing its products in `dtype` (f32 where the CPU
/// lacks bf16).
pub(crate) fn cpu_in(threads: usize, dtype: DType) -> Result<Box<dyn Backend>, GptError> {
    let cpu = Cpu::with_dtype(threads, dtype).map_err(|e| GptError::Engine {
        op: "thread pool",
        reason: e.to_string(),
    })?;
    Ok(Box::new(cpu))
}

/// The bytes a model holds while training, known before anything is
/// allocated: what turns an impossible setting into an error naming it
/// instead of an aborted allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// The flat parameter buffer.
    pub parameters: u64,
    /// The flat gradient buffer.
    pub gradients: u64,
    /// The activation arena (logits included) and attention scratch for one
    /// forward of the given token count.
    pub activations: u64,
}

impl GPT {
    /// What a model of `config` holds training on `tokens` (batch x
    /// sequence) tokens per forward with `threads` engine threads, with or
    /// without activation checkpointing, its products in `precision` (bf16 keeps
    /// the MLP's GELU outputs in bf16). The config must be valid
    /// ([`GPTConfig::validate`]).
    pub fn memory_estimate(
        config: &GPTConfig,
        tokens: usize,
        threads: usize,
        activation_checkpointing: bool,
        precision: DType,
    ) -> MemoryEstimate {
        let params = Layout::new(config).total as u64 * 4;
        let cols = logit_cols(tokens, config.vocab_size, true, LOGITS_MAX_BYTES);
        let arena = ActLayout::new(
            config,
            tokens,
            KEEP_MAX_BYTES,
            cols,
            activation_checkpointing,
            precision == DType::Bf16 && cohort_engine::cpu::bf16_supported(),
        )
        .total as u64
            * 4;
        let scratch = cohort_engine::cpu::attention_scratch_len(
            config.max_position_embeddings,
            threads.max(1),
        ) as u64
            * 4;
        MemoryEstimate {
            parameters: params,
            gradients: params,
            activations: arena + scratch,
        }
    }

    /// A model with GPT-2's initialisation drawn from `seed`, on a CPU backend sized by
    /// `COHORT_NUM_THREADS`.
    pub fn new(config: GPTConfig, seed: u64) -> Result<GPT, GptError> {
        GPT::with_backend(config, seed, cpu_from_env()?)
    }

    /// A model whose parameters are all zero, on a CPU backend sized by
    /// `COHORT_NUM_THREADS`, for a replica that receives them from
    /// elsewhere (DDP's broadcast from rank 0, a checkpoint): config B's
    /// draws cost a quarter of a second that would be thrown away. `seed`
    /// still seeds dropout, as in [`GPT::new`].
    pub fn zeroed(config: GPTConfig, seed: u64) -> Result<GPT, GptError> {
        GPT::build(config, seed, cpu_from_env()?)
    }

    /// A model on the given backend.
    pub fn with_backend(
        config: GPTConfig,
        seed: u64,
        dev: Box<dyn Backend>,
    ) -> Result<GPT, GptError> {
        let mut model = GPT::build(config, seed, dev)?;
        model.init_weights(seed);
        Ok(model)
    }

    /// A model with zero parameters.
    fn build(config: GPTConfig, seed: u64, dev: Box<dyn Backend>) -> Result<GPT, GptError> {
        config.validate()?;
        let layout = Layout::new(&config);
        Ok(GPT {
            params: AlignedFloats::zeroed(layout.total),
            grads: AlignedFloats::zeroed(layout.total),
            layout,
            config,
            dev,
            act_layout: None,
            arena: AlignedFloats::default(),
            attn_scratch: AlignedFloats::default(),
            batch: Batch::default(),
            training: true,
            dropout_seed: seed,
            rank: 0,
            step: 0,
            profile: Profile::default(),
            keep_max_bytes: KEEP_MAX_BYTES,
            logits_max_bytes: LOGITS_MAX_BYTES,
            activation_checkpointing: false,
        })
    }

    /// GPT-2 / nanoGPT init: weights N(0, 0.02), the two residual projections
    /// N(0, 0.02 / sqrt(2 L)), LayerNorm weights 1, biases 0; drawn in layout order.
    pub fn init_weights(&mut self, seed: u64) {
        let n_layers = self.config.n_layers;
        init_tensors(&self.layout.views, n_layers, seed, &mut self.params, |v| {
            Some(v.range.clone())
        });
    }

    /// The configuration.
    pub fn config(&self) -> &GPTConfig {
        &self.config
    }
    /// Named views of the flat buffers, in buffer order.
    pub fn param_views(&self) -> &[ParamView] {
        &self.layout.views
    }
    /// Number of parameters (length of `params()` and `grads()`).
    pub fn num_params(&self) -> usize {
        self.layout.total
    }
    /// The flat parameter buffer.
    pub fn params(&self) -> &[f32] {
        &self.params
    }
    /// The flat parameter buffer, writable (optimizers, checkpoint loading).
    pub fn params_mut(&mut self) -> &mut [f32] {
        &mut self.params
    }
    /// The flat gradient buffer.
    pub fn grads(&self) -> &[f32] {
        &self.grads
    }
    /// The flat gradient buffer, writable (all-reduce, clipping).
    pub fn grads_mut(&mut self) -> &mut [f32] {
        &mut self.grads
    }
    /// Parameters and gradients at once (an optimizer step needs both).
    pub fn params_and_grads_mut(&mut self) -> (&mut [f32], &[f32]) {
        (&mut self.params, &self.grads)
    }
    /// The ranges the backward hook reports, in the order it reports them.
    pub fn ready_ranges(&self) -> Vec<Range<usize>> {
        self.layout.ready_order()
    }
    /// The compute backend.
    pub fn backend(&self) -> &dyn Backend {
        &*self.dev
    }
    /// Computes the matrix products in `dtype` from now on (on the same number of threads),
    /// as PyTorch's autocast does around a forward: parameters, gradients and activations stay
    /// f32. Returns the precision in effect, which is f32 where the CPU lacks the bf16 product.
    pub fn set_precision(&mut self, dtype: DType) -> Result<DType, GptError> {
        self.dev = cpu_in(self.dev.num_threads(), dtype)?;
        Ok(self.dev.dtype())
    }
    /// Logits (B, T, V) of the last forward; empty after a forward with labels whose logits
    /// were too large to keep whole (over 64 MB: the loss is computed block by block).
    pub fn logits(&self) -> &[f32] {
        let n = self.batch.b * self.batch.t;
        match &self.act_layout {
            Some(al) if al.logit_cols < self.config.vocab_size => &[],
            Some(al) => {
                &self.arena[al.ranges[12].start..al.ranges[12].start + n * self.config.vocab_size]
            }
            None => &[],
        }
    }

    /// Activation checkpointing (PyTorch's `torch.utils.checkpoint` around every block):
    /// forward keeps only each block's input, and backward recomputes the block's forward
    /// before its backward, for one more forward's compute per step. See
    /// [`GPT::memory_estimate`] for the bytes it saves.
    pub fn set_activation_checkpointing(&mut self, on: bool) {
        self.activation_checkpointing = on;
    }

    /// Training mode applies dropout (when the config's dropout is above 0); eval mode never.
    pub fn set_training(&mut self, training: bool) {
        self.training = training;
    }
    /// Keys the dropout masks: every mask is a function of (seed, rank, step, site, index).
    /// Call with the global step before each training forward.
    pub fn set_dropout_key(&mut self, seed: u64, rank: u64, step: u64) {
        self.dropout_seed = seed;
        self.rank = rank;
        self.step = step;
    }

    /// Wall time spent per kernel since the last reset, in a fixed order.
    pub fn kernel_times(&self) -> Vec<(&'static str, Duration)> {
        KERNELS.iter().copied().zip(self.profile.0).collect()
    }
    /// Clears the per-kernel times.
    pub fn reset_kernel_times(&mut self) {
        self.profile = Profile::default();
    }

    /// The parts of the model in forward order: embeddings, each block, head.
    pub fn parts(&self) -> Vec<Part> {
        let blocks = (0..self.config.n_layers).map(Part::Block);
        std::iter::once(Part::Embeddings)
            .chain(blocks)
            .chain([Part::Head])
            .collect()
    }

    /// The range of the flat parameter (and gradient) buffer that `part`'s
    /// own parameters occupy; the ranges of [`GPT::parts`] partition it.
    pub fn part_range(&self, part: Part) -> Range<usize> {
        self.layout.part_range(part)
    }

    /// The ranges [`GPT::part_range`] gives for a model of `config`, in the
    /// order of [`GPT::parts`], known before any model is built (what a
    /// memory estimate of a strategy sharded by part needs).
    pub fn part_ranges_of(config: &GPTConfig) -> Vec<Range<usize>> {
        let layout = Layout::new(config);
        let blocks = (0..config.n_layers).map(Part::Block);
        std::iter::once(Part::Embeddings)
            .chain(blocks)
            .chain([Part::Head])
            .map(|p| layout.part_range(p))
            .collect()
    }

    /// Sets every gradient to zero (backward accumulates).
    pub fn zero_grad(&mut self) {
        self.grads.fill(0.0);
    }

    /// Forward pass, as Hugging Face's `GPT2LMHeadModel`. `input_ids`, `attention_mask` (1 token,
    /// 0 padding) and `labels` are (B, T) row-major. Labels are aligned with the inputs: position
    /// t is scored on `labels[t + 1]`; -100 is ignored, and so is any position where the input
    /// or the target is padding. Returns the mean loss over counted positions when labels are
    /// given (0 when none is counted). Logits are readable afterwards with [`GPT::logits`].
    pub fn forward(
        &mut self,
        input_ids: &[u32],
        attention_mask: Option<&[u8]>,
        labels: Option<&[i32]>,
        b: usize,
        t: usize,
    ) -> Result<Option<f32>, GptError> {
        let labels = labels.map(Labels::Aligned);
        self.forward_with(input_ids, attention_mask, labels, b, t, &mut |_, _, _| {})
    }

    /// [`GPT::forward`] with the labels in either convention ([`Labels`]): what a training
    /// loop uses, with [`Labels::Next`] targets so that every position of a window is trained.
    pub fn forward_labels(
        &mut self,
        input_ids: &[u32],
        attention_mask: Option<&[u8]>,
        labels: Option<Labels<'_>>,
        b: usize,
        t: usize,
    ) -> Result<Option<f32>, GptError> {
        self.forward_with(input_ids, attention_mask, labels, b, t, &mut |_, _, _| {})
    }

    /// [`GPT::forward_labels`], calling `before` just before each [`Part`] runs.
    pub fn forward_with(
        &mut self,
        input_ids: &[u32],
        attention_mask: Option<&[u8]>,
        labels: Option<Labels<'_>>,
        b: usize,
        t: usize,
        before: &mut PartHook<'_>,
    ) -> Result<Option<f32>, GptError> {
        let hooks = &mut BeforeOnly(before);
        self.forward_parts(input_ids, attention_mask, labels, b, t, hooks)
    }

    /// [`GPT::forward_labels`], calling `hooks` just before and just after
    /// each [`Part`] runs.
    pub fn forward_parts(
        &mut self,
        input_ids: &[u32],
        attention_mask: Option<&[u8]>,
        labels: Option<Labels<'_>>,
        b: usize,
        t: usize,
        hooks: &mut dyn PartHooks,
    ) -> Result<Option<f32>, GptError> {
        validate_batch(&self.config, Some(input_ids), attention_mask, labels, b, t)?;
        let n = b * t;
        let cols = logit_cols(
            n,
            self.config.vocab_size,
            labels.is_some(),
            self.logits_max_bytes,
        );
        let bf16 = self.dev.dtype() == DType::Bf16;
        if self.act_layout.as_ref().is_none_or(|al| {
            al.n < n
                || al.logit_cols != cols
                || al.checkpoint != self.activation_checkpointing
                || al.bf16 != bf16
        }) {
            // Free the old arena first so peak memory is one arena, not two.
            self.arena = AlignedFloats::default();
            let al = ActLayout::new(
                &self.config,
                n,
                self.keep_max_bytes,
                cols,
                self.activation_checkpointing,
                bf16,
            );
            self.arena = AlignedFloats::zeroed(al.total);
            self.attn_scratch = AlignedFloats::zeroed(
                self.dev
                    .attention_scratch_len(self.config.max_position_embeddings),
            );
            self.act_layout = Some(al);
        }
        self.batch.set(input_ids, attention_mask, labels, b, t);

        let drop = self.drop_key();
        let GPT {
            config,
            layout,
            params,
            dev,
            act_layout,
            arena,
            attn_scratch,
            batch,
            profile,
            ..
        } = self;
        let al = act_layout.as_ref().expect("arena allocated above");
        let mut acts = al.carve(arena);
        let mut run = || {
            forward_pass(
                config,
                layout,
                params,
                &**dev,
                &mut acts,
                attn_scratch,
                batch,
                drop,
                profile,
                &mut *hooks,
            )
        };
        let mut loss = None;
        dev.install(&mut || loss = run());
        Ok(loss)
    }

    fn drop_key(&self) -> DropKey {
        DropKey {
            on: self.training && self.config.dropout > 0.0,
            p: self.config.dropout,
            seed: self.dropout_seed,
            rank: self.rank,
            step: self.step,
        }
    }

    /// Backward pass for the last forward (which must have had labels), accumulating into the
    /// gradient buffer. Runs from the top block down; as soon as a range of gradients is final
    /// it calls `hook(range, grads)` with exactly that part of the gradient buffer, which this
    /// backward will not touch again. Order: [ln_f (+ lm_head if untied)], block L-1, ...,
    /// block 0, then [wte, wpe] (wte also holds the tied head's gradient). The ranges
    /// partition the buffer. The hook runs on an engine thread, hence `Send`.
    pub fn backward<'g, F>(&'g mut self, hook: F) -> Result<(), GptError>
    where
        F: FnMut(Range<usize>, &'g mut [f32]) + Send,
    {
        self.backward_with(&mut |_, _, _| {}, hook)
    }

    /// [`GPT::backward`], calling `before` just before each [`Part`]'s
    /// backward runs that reads parameters (head first, block 0 last).
    pub fn backward_with<'g, F>(
        &'g mut self,
        before: &mut PartHook<'_>,
        hook: F,
    ) -> Result<(), GptError>
    where
        F: FnMut(Range<usize>, &'g mut [f32]) + Send,
    {
        self.backward_parts(&mut BeforeOnly(before), hook)
    }

    /// [`GPT::backward`], calling `hooks` just before and just after each
    /// [`Part`]'s backward that reads parameters (head first, block 0 last;
    /// the embeddings' backward reads none); a part's
    /// `after` comes before its gradients are handed to `hook`.
    pub fn backward_parts<'g, F>(
        &'g mut self,
        hooks: &mut dyn PartHooks,
        hook: F,
    ) -> Result<(), GptError>
    where
        F: FnMut(Range<usize>, &'g mut [f32]) + Send,
    {
        let counted = self.batch.counted.ok_or(GptError::NoLoss)?;
        let drop = self.drop_key();
        let GPT {
            config,
            layout,
            params,
            grads,
            dev,
            act_layout,
            arena,
            attn_scratch,
            batch,
            profile,
            ..
        } = self;
        let al = act_layout.as_ref().ok_or(GptError::NoLoss)?;
        let mut acts = al.carve(arena);
        let mut grads = Some(grads.as_mut_slice());
        let mut hook = Some(hook);
        let dev: &dyn Backend = &**dev;
        let mut run = || {
            let (grads, hook) = (
                grads.take().expect("runs once"),
                hook.take().expect("runs once"),
            );
            backward_pass(
                config,
                layout,
                params,
                grads,
                dev,
                &mut acts,
                attn_scratch,
                batch,
                counted,
                drop,
                profile,
                &mut *hooks,
                hook,
            )
        };
        dev.install(&mut run);
        Ok(())
    }
}

/// Checks a batch's shapes and token ids; `ids` is `None` for a stage fed activations.
pub(crate) fn validate_batch(
    cfg: &GPTConfig,
    ids: Option<&[u32]>,
    mask: Option<&[u8]>,
    labels: Option<Labels<'_>>,
    b: usize,
    t: usize,
) -> Result<(), GptError> {
    let labels = labels.map(Labels::ids);
    let shape = |what, found: usize| {
        if found != b * t {
            Err(GptError::InputShape {
                what,
                found,
                batch: b,
                seq: t,
            })
        } else {
            Ok(())
        }
    };
    if let Some(ids) = ids {
        shape("input_ids", ids.len())?;
    }
    if b * t == 0 {
        return Err(GptError::InputShape {
            what: "input_ids",
            found: 0,
            batch: b,
            seq: t,
        });
    }
    if let Some(m) = mask {
        shape("attention_mask", m.len())?;
    }
    if let Some(l) = labels {
        shape("labels", l.len())?;
    }
    if t > cfg.max_position_embeddings {
        return Err(GptError::SequenceTooLong {
            seq: t,
            max: cfg.max_position_embeddings,
        });
    }
    let vocab = cfg.vocab_size;
    let mut ids = ids.unwrap_or_default().iter().enumerate();
    if let Some((index, &id)) = ids.find(|(_, &id)| id as usize >= vocab) {
        return Err(GptError::TokenOutOfRange {
            what: "input_ids",
            index,
            value: id as i64,
            vocab,
        });
    }
    if let Some(l) = labels {
        if let Some((index, &y)) = l
            .iter()
            .enumerate()
            .find(|(_, &y)| y != -100 && (y < 0 || y as usize >= vocab))
        {
            return Err(GptError::TokenOutOfRange {
                what: "labels",
                index,
                value: y as i64,
                vocab,
            });
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn forward_pass(
    cfg: &GPTConfig,
    lay: &Layout,
    p: &mut [f32],
    dev: &dyn Backend,
    a: &mut Acts,
    scratch: &mut [f32],
    batch: &Batch,
    drop: DropKey,
    prof: &mut Profile,
    hooks: &mut dyn PartHooks,
) -> Option<f32> {
    let (b, t) = (batch.b, batch.t);
    let (c, f, nh) = (cfg.d_model, cfg.d_ff, cfg.n_heads);
    let mask = batch.has_mask.then_some(&batch.mask[..]);
    let dims = AttnDims { b, t, c, nh };
    let enter = |hooks: &mut dyn PartHooks, part: Part, p: &mut [f32]| {
        for range in lay.part_reads(part) {
            hooks.before(part, range.clone(), &mut p[range]);
        }
    };
    let leave = |hooks: &mut dyn PartHooks, part: Part, p: &mut [f32]| {
        for range in lay.part_reads(part) {
            hooks.after(part, range.clone(), &mut p[range]);
        }
    };
    enter(hooks, Part::Embeddings, p);
    embed_forward(p, &lay.wte, &lay.wpe, dev, a, batch, c, drop, prof);
    leave(hooks, Part::Embeddings, p);
    for (l, bl) in lay.blocks.iter().enumerate() {
        enter(hooks, Part::Block(l), p);
        block_forward(l, l, bl, p, dev, a, scratch, mask, dims, f, drop, prof);
        leave(hooks, Part::Block(l), p);
    }
    enter(hooks, Part::Head, p);
    let head = HeadLayout {
        ln_f_w: &lay.ln_f_w,
        ln_f_b: &lay.ln_f_b,
        lm_head: &lay.lm_head,
    };
    let loss = head_forward(
        cfg.n_layers,
        &head,
        p,
        dev,
        a,
        batch,
        c,
        cfg.vocab_size,
        prof,
    );
    leave(hooks, Part::Head, p);
    loss
}

#[allow(clippy::too_many_arguments)]
fn backward_pass<'g>(
    cfg: &GPTConfig,
    lay: &Layout,
    p: &mut [f32],
    grads: &'g mut [f32],
    dev: &dyn Backend,
    a: &mut Acts,
    scratch: &mut [f32],
    batch: &Batch,
    counted: usize,
    drop: DropKey,
    prof: &mut Profile,
    hooks: &mut dyn PartHooks,
    mut hook: impl FnMut(Range<usize>, &'g mut [f32]),
) {
    let enter = |hooks: &mut dyn PartHooks, part: Part, p: &mut [f32]| {
        for range in lay.part_reads(part) {
            hooks.before(part, range.clone(), &mut p[range]);
        }
    };
    let leave = |hooks: &mut dyn PartHooks, part: Part, p: &mut [f32]| {
        for range in lay.part_reads(part) {
            hooks.after(part, range.clone(), &mut p[range]);
        }
    };
    let (b, t) = (batch.b, batch.t);
    let (c, f, v, nh) = (cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_heads);
    let mask = batch.has_mask.then_some(&batch.mask[..]);
    let dims = AttnDims { b, t, c, nh };

    // Head and ln_f. The head's weight gradient goes to wte when tied (lower part of the buffer,
    // handed out last) or to lm_head (in the top range, after ln_f).
    let head_start = lay.ln_f_w.start;
    let (mut rest, top) = grads.split_at_mut(head_start);
    enter(hooks, Part::Head, p);
    {
        if cfg.tie_word_embeddings {
            hooks.before_grads(Part::Head, lay.wte.clone(), &mut rest[lay.wte.clone()]);
        }
        hooks.before_grads(Part::Head, head_start..lay.total, top);
        let (lnf_g, lm_head_g) = top.split_at_mut(lay.ln_f_b.end - head_start);
        let dw_head: &mut [f32] = if cfg.tie_word_embeddings {
            &mut rest[lay.wte.clone()]
        } else {
            lm_head_g
        };
        let (dw, db) = wb(lnf_g, head_start, &lay.ln_f_w, &lay.ln_f_b);
        let head = HeadLayout {
            ln_f_w: &lay.ln_f_w,
            ln_f_b: &lay.ln_f_b,
            lm_head: &lay.lm_head,
        };
        let dw_lnf = (dw, db);
        head_backward(
            cfg.n_layers,
            &head,
            p,
            dw_head,
            dw_lnf,
            dev,
            a,
            batch,
            counted,
            c,
            v,
            prof,
        );
    }
    leave(hooks, Part::Head, p);
    hook(head_start..lay.total, top);

    for (l, bl) in lay.blocks.iter().enumerate().rev() {
        let (lower, g) = std::mem::take(&mut rest).split_at_mut(bl.all.start);
        rest = lower;
        enter(hooks, Part::Block(l), p);
        hooks.before_grads(Part::Block(l), bl.all.clone(), g);
        if a.checkpoint {
            // The block's activations were not kept: recompute them from its input (the same
            // dropout masks, so the same values).
            block_forward(l, l, bl, p, dev, a, scratch, mask, dims, f, drop, prof);
        }
        block_backward(l, l, bl, p, g, dev, a, scratch, mask, dims, f, drop, prof);
        leave(hooks, Part::Block(l), p);
        hook(bl.all.clone(), g);
    }

    if !cfg.tie_word_embeddings {
        hooks.before_grads(
            Part::Embeddings,
            lay.wte.clone(),
            &mut rest[lay.wte.clone()],
        );
    }
    let (dwte, dwpe) = rest.split_at_mut(lay.wpe.start);
    hooks.before_grads(Part::Embeddings, lay.wpe.clone(), dwpe);
    // The embeddings' backward adds each position's gradient into the rows of wte and wpe it
    // used and reads no parameter, so it has no parameter range to ask the hooks for: a sharded
    // strategy would gather the largest part of the model (wte) for nothing.
    embed_backward(
        &mut dwte[lay.wte.clone()],
        dwpe,
        dev,
        a,
        batch,
        c,
        drop,
        prof,
    );
    hook(0..lay.wpe.end, rest);
}

//! The model (GPT-2, or another point of the decoder family: Llama, Qwen2): flat parameters
//! and gradients, the activation arena, and the one forward and one backward entry point
//! ([`GPT::forward`], [`GPT::backward`]) with their options.
//!
//! Dims, named once: B batch, T sequence, C d_model, F d_ff, V vocab, L layers, NH heads,
//! NKV key/value heads, HS head size, N = B*T tokens. All compute goes through the engine's `Backend`; this module decides only
//! what is computed, in which order (`passes`, `layers`, `block`), and into which buffer
//! (`arena`). It never allocates after the first
//! forward for a given token count (a larger B*T reallocates the arena once).
//!
//! Memory: per layer the arena keeps the block input, the residual after attention, qkv, the MLP
//! pre-activation and the LayerNorm / softmax statistics. The LayerNorm, attention and GELU
//! outputs are kept too when they fit in `KEEP_MAX_BYTES` (small models, where recomputing them
//! costs a visible share of the step) and recomputed in backward otherwise; the (T, T) attention
//! probabilities are never stored, which is what keeps config B far below PyTorch's footprint.
//! Under bf16 products, what only products (or attention) read and round to bf16 anyway is kept
//! in bf16 (the normalisations' and the MLP activation's outputs, and qkv without RoPE): the
//! same bits at half the bytes (see `arena`).

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_engine::cpu::{AttnDims, Cpu, RopeDims};
use cohort_engine::{Backend, Buffer, DType, Device, Dropout, View, ViewMut};
use cohort_rng::SplitMix64;

use crate::layout::{BlockLayout, Layout};
use crate::{GPTConfig, GptError, Labels, Mlp, Norm, ParamView};

mod arena;
mod block;
#[cfg(test)]
mod device_tests;
mod init;
mod layers;
#[cfg(test)]
mod lazy_zero_tests;
mod memory;
mod options;
mod passes;
mod profile;
#[cfg(test)]
mod qkv16_tests;
#[cfg(test)]
mod sparse_tests;
#[cfg(test)]
mod tests;
mod tied_grads;

pub(crate) use arena::*;
pub(crate) use block::*;
pub(crate) use init::*;
pub(crate) use layers::*;
pub(crate) use memory::*;
pub(crate) use options::NoHooks;
pub use options::{Backward, Forward, NoReadyHook, Part, PartHooks};
use passes::{backward_pass, forward_pass};
pub(crate) use profile::*;
pub(crate) use tied_grads::*;

/// The model: config, flat parameters and gradients, activation arena, backend. Every buffer
/// is allocated by the backend: host memory on the CPU, where the host API (`params()`,
/// `grads_mut()`, ...) borrows it in place; a device's memory elsewhere, reached through the
/// `copy_*_to_host` / `copy_*_from_host` calls.
pub struct GPT {
    config: GPTConfig,
    layout: Layout,
    params: Buffer,
    grads: Buffer,
    /// Set by [`GPT::zero_grad`]: the weight matrices' gradients
    /// ([`Layout::product_weights`]) are zero but not written, still holding what an earlier
    /// backward left. The next backward's products overwrite them instead of adding to them,
    /// and clear it; every other way to the gradients writes the zeros first
    /// ([`GPT::write_unwritten_zeros`]), so no caller ever sees the stale values.
    weight_grads_zero_unwritten: bool,
    /// Shared, so that work beside a pass that borrows the model can reach it
    /// ([`GPT::backend_handle`]).
    dev: Arc<dyn Backend>,
    act_layout: Option<ActLayout>,
    arena: Buffer,
    attn_scratch: Buffer,
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
    /// Keep the qkv rows in bf16 where the arena can (see [`ActLayout::qkv16`]); tests clear
    /// it, before a first forward, to hold the bf16 rows to the f32 ones.
    qkv16: bool,
    /// Keep only each block's input and recompute the block's forward inside backward.
    activation_checkpointing: bool,
    /// Rotary angle tables (None with learned positions).
    rope: Option<RopeTables>,
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

/// A CPU backend like `dev` (its threads) computing its products in `dtype`: what
/// `set_precision` switches to. Only a CPU model switches backends this way.
pub(crate) fn cpu_with_precision(
    dev: &dyn Backend,
    dtype: DType,
) -> Result<Box<dyn Backend>, GptError> {
    if dev.device() != Device::Cpu {
        return Err(GptError::Engine {
            op: "set_precision",
            reason: format!("a model on {} keeps its backend's precision", dev.device()),
        });
    }
    cpu_in(dev.num_threads(), dtype)
}

/// Positions the attention scratch covers at least (see [`GPT::forward`]).
const SCRATCH_POSITIONS: usize = 1024;

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
    /// The rows of the head's weight gradient one block of logits' columns
    /// writes: all of it, unless the logits go in blocks (what a tied wte's
    /// gradient holds at most under [`Backward::sparse_embeddings`]).
    pub head_block: u64,
}

impl GPT {
    /// What a model of `config` holds training on `tokens` (batch x
    /// sequence) tokens per forward with `threads` engine threads, with or
    /// without activation checkpointing, its products in `precision` (bf16 keeps
    /// the MLP's GELU outputs, and without RoPE the qkv rows, in bf16). The config must be valid
    /// ([`GPTConfig::validate`]).
    pub fn memory_estimate(
        config: &GPTConfig,
        tokens: usize,
        threads: usize,
        activation_checkpointing: bool,
        precision: DType,
    ) -> MemoryEstimate {
        let params = Layout::new(config).total as u64 * 4;
        let cols = logit_cols(
            tokens,
            config.vocab_size,
            true,
            LOGITS_MAX_BYTES,
            activation_checkpointing,
        );
        let arena = ActLayout::new(
            config,
            tokens,
            KEEP_MAX_BYTES,
            cols,
            activation_checkpointing,
            // (on the CPU, which has the kernels of a bf16 qkv)
            (
                precision == DType::Bf16 && cohort_engine::cpu::bf16_supported(),
                true,
            ),
        )
        .total as u64
            * 4;
        // Sized for the window up to SCRATCH_POSITIONS, and beyond for the sequences seen (see
        // `forward`): no sequence is longer than the tokens of a forward.
        let positions = config
            .max_position_embeddings
            .min(tokens.max(SCRATCH_POSITIONS));
        let scratch =
            cohort_engine::cpu::attention_scratch_len(positions, threads.max(1)) as u64 * 4;
        MemoryEstimate {
            parameters: params,
            gradients: params,
            activations: arena + scratch,
            head_block: (cols * config.d_model) as u64 * 4,
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

    /// A model that only holds parameters to be written: a checkpoint staged off the
    /// training thread, whose writer thread needs a `GPT` to save. It has no gradient buffer
    /// and a one-thread backend, so a staged copy costs the parameters' memory alone; never
    /// run it forward or backward. Its parameters are zero until written.
    pub fn staging(config: GPTConfig) -> Result<GPT, GptError> {
        let mut model = GPT::build(config, 0, cpu_in(1, DType::F32)?)?;
        model.grads = Buffer::default();
        Ok(model)
    }

    /// A model on the given backend.
    pub fn with_backend(
        config: GPTConfig,
        seed: u64,
        dev: Box<dyn Backend>,
    ) -> Result<GPT, GptError> {
        let mut model = GPT::build(config, seed, dev)?;
        model.init_weights(seed)?;
        Ok(model)
    }

    /// This model's parameters in a model on `dev` (its memory allocated there, the
    /// parameters copied over): how a model drawn or loaded on the host moves to a device.
    /// Dropout's seed and activation checkpointing go with it.
    pub fn to_backend(&self, dev: Box<dyn Backend>) -> Result<GPT, GptError> {
        let mut moved = GPT::build(self.config.clone(), self.dropout_seed, dev)?;
        moved.activation_checkpointing = self.activation_checkpointing;
        moved.copy_params_from_host(self.params())?;
        Ok(moved)
    }

    /// A model with zero parameters.
    fn build(config: GPTConfig, seed: u64, dev: Box<dyn Backend>) -> Result<GPT, GptError> {
        config.validate()?;
        check_kernels(&config, &*dev)?;
        let layout = Layout::new(&config);
        Ok(GPT {
            params: alloc(&*dev, layout.total, "allocate the parameters")?,
            grads: alloc(&*dev, layout.total, "allocate the gradients")?,
            weight_grads_zero_unwritten: false,
            rope: RopeTables::on(&config, &*dev)?,
            layout,
            config,
            dev: dev.into(),
            act_layout: None,
            arena: Buffer::default(),
            attn_scratch: Buffer::default(),
            batch: Batch::default(),
            training: true,
            dropout_seed: seed,
            rank: 0,
            step: 0,
            profile: Profile::default(),
            keep_max_bytes: KEEP_MAX_BYTES,
            logits_max_bytes: LOGITS_MAX_BYTES,
            qkv16: true,
            activation_checkpointing: false,
        })
    }

    /// GPT-2 / nanoGPT init: weights N(0, 0.02), the two residual projections
    /// N(0, 0.02 / sqrt(2 L)), LayerNorm weights 1, biases 0; drawn in layout order (on the
    /// host, then copied to a device's memory).
    pub fn init_weights(&mut self, seed: u64) -> Result<(), GptError> {
        let (n_layers, views) = (self.config.n_layers, &self.layout.views);
        write_on_host(&*self.dev, &mut self.params, |p| {
            init_tensors(views, n_layers, seed, p, |v| Some(v.range.clone()))
        })
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
    /// The flat parameter buffer. Panics for a model on a device (see
    /// [`GPT::copy_params_to_host`]), as do the other host borrows below.
    pub fn params(&self) -> &[f32] {
        host(&self.params, "params")
    }
    /// The flat parameter buffer, writable (optimizers, checkpoint loading).
    pub fn params_mut(&mut self) -> &mut [f32] {
        host_mut(&mut self.params, "params")
    }
    /// The flat gradient buffer (`&mut self`: after [`GPT::zero_grad`] it first writes the
    /// zeros that call left unwritten).
    pub fn grads(&mut self) -> &[f32] {
        self.write_unwritten_zeros();
        host(&self.grads, "grads")
    }
    /// The flat gradient buffer, writable (all-reduce, clipping).
    pub fn grads_mut(&mut self) -> &mut [f32] {
        self.write_unwritten_zeros();
        host_mut(&mut self.grads, "grads")
    }
    /// Parameters and gradients at once (an optimizer step needs both).
    pub fn params_and_grads_mut(&mut self) -> (&mut [f32], &[f32]) {
        self.write_unwritten_zeros();
        (
            host_mut(&mut self.params, "params"),
            host(&self.grads, "grads"),
        )
    }
    /// Runs `f` on the parameters and gradients (host slices, as
    /// [`GPT::params_and_grads_mut`]) on the backend's threads: an optimizer step, whose passes
    /// over memory split over them (AdamW on config G: 58 ms on one thread, ~51 on two).
    pub fn update_params<R: Send>(&mut self, f: impl FnOnce(&mut [f32], &[f32]) -> R + Send) -> R {
        let dev = self.dev.clone();
        let (params, grads) = self.params_and_grads_mut();
        dev.run(|| f(params, grads))
    }
    /// The parameter buffer as the backend's kernels take it (host or device).
    pub fn params_view(&mut self) -> ViewMut<'_, f32> {
        self.params.view_mut()
    }
    /// Parameters and gradients as the backend's kernels take them (an optimizer step on the
    /// backend, [`AdamW::step_on`](cohort_engine::optim::AdamW::step_on)), with the backend.
    pub fn params_and_grads_views(&mut self) -> (&dyn Backend, ViewMut<'_, f32>, View<'_, f32>) {
        self.write_unwritten_zeros();
        (&*self.dev, self.params.view_mut(), self.grads.view())
    }
    /// The gradients as the backend's kernels take them (scaled, checked and clipped where
    /// they live), with the backend.
    pub fn grads_view_mut(&mut self) -> (&dyn Backend, ViewMut<'_, f32>) {
        self.write_unwritten_zeros();
        (&*self.dev, self.grads.view_mut())
    }
    /// Copies the parameters into `out` (`num_params()` floats), wherever they live: what
    /// checkpoints and logs of a model on a device read.
    pub fn copy_params_to_host(&self, out: &mut [f32]) -> Result<(), GptError> {
        copy_out(
            &*self.dev,
            &self.params,
            out,
            "copy the parameters to the host",
        )
    }
    /// Sets the parameters from `src` (`num_params()` floats), wherever they live.
    pub fn copy_params_from_host(&mut self, src: &[f32]) -> Result<(), GptError> {
        copy_in(
            &*self.dev,
            &mut self.params,
            src,
            "copy the parameters from the host",
        )
    }
    /// Copies the gradients into `out` (`num_params()` floats): what a collective over a
    /// model on a device sends (`&mut self`, as [`GPT::grads`]).
    pub fn copy_grads_to_host(&mut self, out: &mut [f32]) -> Result<(), GptError> {
        self.write_unwritten_zeros();
        copy_out(
            &*self.dev,
            &self.grads,
            out,
            "copy the gradients to the host",
        )
    }
    /// Sets the gradients from `src` (`num_params()` floats): a collective's result.
    pub fn copy_grads_from_host(&mut self, src: &[f32]) -> Result<(), GptError> {
        copy_in(
            &*self.dev,
            &mut self.grads,
            src,
            "copy the gradients from the host",
        )?;
        // Every gradient written, the unwritten zeros included.
        self.weight_grads_zero_unwritten = false;
        Ok(())
    }
    /// The ranges the backward hook reports, in the order it reports them.
    pub fn ready_ranges(&self) -> Vec<Range<usize>> {
        self.layout.ready_order(false)
    }
    /// The ranges the backward hook reports with [`Backward::split_blocks`], in order.
    pub fn split_ready_ranges(&self) -> Vec<Range<usize>> {
        self.layout.ready_order(true)
    }
    /// The rotary angle tables (None with learned positions).
    pub(crate) fn rope_tables(&self) -> Option<&RopeTables> {
        self.rope.as_ref()
    }
    /// The compute backend.
    pub fn backend(&self) -> &dyn Backend {
        &*self.dev
    }
    /// The compute backend, shared: for work on another thread beside a pass that borrows the
    /// model (a host-staged collective copying finished gradients while backward runs).
    pub fn backend_handle(&self) -> Arc<dyn Backend> {
        self.dev.clone()
    }
    /// Computes the matrix products in `dtype` from now on (on the same number of threads),
    /// as PyTorch's autocast does around a forward: parameters, gradients and activations stay
    /// f32. Returns the precision in effect, which is f32 where the CPU lacks the bf16 product.
    pub fn set_precision(&mut self, dtype: DType) -> Result<DType, GptError> {
        self.dev = cpu_with_precision(&*self.dev, dtype)?.into();
        Ok(self.dev.dtype())
    }
    /// Logits (B, T, V) of the last forward; empty after a forward with labels whose logits
    /// were too large to keep whole (the loss is computed block by block: over 512 MB, or
    /// 64 MB under activation checkpointing). A backward turns them into their gradient.
    pub fn logits(&self) -> &[f32] {
        let n = self.batch.b * self.batch.t;
        match &self.act_layout {
            Some(al) if al.logit_cols < self.config.vocab_size => &[],
            Some(al) => {
                let logits = &host(&self.arena, "logits")[al.ranges[ACT_LOGITS].start..];
                &logits[..n * self.config.vocab_size]
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

    /// The ranges [`GPT::split_ready_ranges`] gives for a model of `config`,
    /// known before any model is built (what a memory estimate of a strategy
    /// sharded by those ranges needs).
    pub fn split_ready_ranges_of(config: &GPTConfig) -> Vec<Range<usize>> {
        Layout::new(config).ready_order(true)
    }

    /// Sets every gradient to zero (backward accumulates), on the backend's threads, lazily
    /// as PyTorch's `zero_grad(set_to_none=True)` saves the same work: only the gradients a
    /// backward merely adds into (biases, norms, embeddings) are written now; the weight
    /// matrices' are recorded as zero, and the next backward's products overwrite them (the
    /// same bits as adding into zeros) instead of reading zeros back: config G's fill of
    /// ~0.5 GB and its products' first read of C, ~1.5% of its bf16 step. Any access to the
    /// gradients before that backward writes the zeros first.
    pub fn zero_grad(&mut self) {
        // A staging model has no gradient buffer.
        if self.grads.is_empty() {
            return;
        }
        fill_grads(&*self.dev, &mut self.grads, self.layout.accumulated_only());
        self.weight_grads_zero_unwritten = true;
    }

    /// Writes the zeros [`GPT::zero_grad`] left unwritten, if it did: what every access to
    /// the gradients but a backward's products does first.
    fn write_unwritten_zeros(&mut self) {
        if std::mem::take(&mut self.weight_grads_zero_unwritten) {
            fill_grads(&*self.dev, &mut self.grads, self.layout.product_weights());
        }
    }

    /// Forward pass, as Hugging Face's `GPT2LMHeadModel`: the logits of every position of
    /// `pass`'s batch, and with labels the mean loss over the positions they count (0 when none
    /// is counted). Labels follow [`Labels`]; a position is also ignored where its input or its
    /// target is padding. Logits are readable afterwards with [`GPT::logits`]. See [`Forward`]
    /// for the options (mask, labels, per-part hooks).
    pub fn forward(&mut self, pass: Forward<'_>) -> Result<Option<f32>, GptError> {
        let Forward {
            input_ids,
            batch: b,
            seq: t,
            attention_mask,
            segments,
            labels,
            parts,
        } = pass;
        validate_batch(&self.config, Some(input_ids), attention_mask, labels, b, t)?;
        host_hooks(&*self.dev, parts.is_some())?;
        if segments.is_some_and(|s| s.len() != b * t) {
            return Err(GptError::InputShape {
                what: "segments",
                found: segments.map_or(0, <[u32]>::len),
                batch: b,
                seq: t,
            });
        }
        let n = b * t;
        let cols = logit_cols(
            n,
            self.config.vocab_size,
            labels.is_some(),
            self.logits_max_bytes,
            self.activation_checkpointing,
        );
        let bf16 = self.dev.dtype() == DType::Bf16;
        if self.act_layout.as_ref().is_none_or(|al| {
            al.n < n
                || al.logit_cols != cols
                || al.checkpoint != self.activation_checkpointing
                || al.bf16 != bf16
        }) {
            // Free the old arena first so peak memory is one arena, not two.
            self.arena = Buffer::default();
            let al = ActLayout::new(
                &self.config,
                n,
                self.keep_max_bytes,
                cols,
                self.activation_checkpointing,
                (bf16, self.qkv16 && has_kernels(&*self.dev, &QKV16_KERNELS)),
            );
            self.arena = alloc(&*self.dev, al.total, "allocate the activations")?;
            self.act_layout = Some(al);
        }
        // The attention scratch covers the model's window up to GPT-2's 1024 positions (what it
        // always did), and beyond that only the sequences actually seen: a Llama of 131072
        // positions fine-tuned on 512 would otherwise fill gigabytes it never reads.
        let window = self.config.max_position_embeddings.min(SCRATCH_POSITIONS);
        let scratch = self.dev.attention_scratch_len(t.max(window));
        if self.attn_scratch.len() < scratch {
            self.attn_scratch = Buffer::default();
            self.attn_scratch = alloc(&*self.dev, scratch, "allocate the attention scratch")?;
        }
        self.batch
            .set(input_ids, attention_mask, segments, labels, b, t);
        self.batch.upload(&*self.dev)?;

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
            rope,
            ..
        } = self;
        let al = act_layout.as_ref().expect("arena allocated above");
        let mut acts = al.carve(arena.view_mut());
        let mut no_hooks = NoHooks;
        let hooks: &mut dyn PartHooks = match parts {
            Some(hooks) => hooks,
            None => &mut no_hooks,
        };
        let (dev, dims): (&dyn Backend, _) = (&**dev, Dims::new(config, b, t));
        let mut run = || {
            let pass = &mut Pass {
                dev,
                rope: rope.as_ref(),
                dims,
                batch,
                drop,
                scratch: attn_scratch.view_mut(),
                prof: profile,
                accumulate_weight_grads: true,
            };
            let params = params.view_mut();
            forward_pass(pass, layout, params, &mut acts, &mut *hooks)
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
    /// gradient buffer, from the top block down (after [`GPT::zero_grad`], the weight
    /// matrices' products overwrite their unwritten zeros: the same bits). See [`Backward`]
    /// for the hooks it can call as it goes (gradient readiness, per-part).
    pub fn backward<'g, F>(&'g mut self, pass: Backward<'_, F>) -> Result<(), GptError>
    where
        F: FnMut(Range<usize>, ViewMut<'g, f32>) + Send,
    {
        let Backward {
            ready,
            parts,
            split_blocks,
            sparse_embeddings,
        } = pass;
        self.batch.counted.ok_or(GptError::NoLoss)?;
        host_hooks(&*self.dev, parts.is_some())?;
        if sparse_embeddings && parts.is_none() && self.layout.tied() {
            return Err(GptError::Engine {
                op: "sparse embeddings",
                reason: "wte's rows go to the part hooks, and none were given".into(),
            });
        }
        if parts.is_some() {
            // The per-part hooks are handed each range of gradients before the backward first
            // writes it (`PartHooks::before_grads`), and the backward adds to what they hold:
            // they must hold the zeros.
            self.write_unwritten_zeros();
        }
        let drop = self.drop_key();
        let GPT {
            config,
            layout,
            params,
            grads,
            weight_grads_zero_unwritten,
            dev,
            act_layout,
            arena,
            attn_scratch,
            batch,
            profile,
            rope,
            ..
        } = self;
        let al = act_layout.as_ref().ok_or(GptError::NoLoss)?;
        // Past the last error: this backward writes the weight gradients left unwritten.
        let accumulate_weight_grads = !std::mem::take(weight_grads_zero_unwritten);
        let mut acts = al.carve(arena.view_mut());
        let mut grads = Some(grads.view_mut());
        let mut ready = Some(ready);
        let mut no_hooks = NoHooks;
        let hooks: &mut dyn PartHooks = match parts {
            Some(hooks) => hooks,
            None => &mut no_hooks,
        };
        let (dev, dims): (&dyn Backend, _) = (&**dev, Dims::new(config, batch.b, batch.t));
        let mut run = || {
            let (grads, ready) = (
                grads.take().expect("runs once"),
                ready.take().expect("runs once"),
            );
            let pass = &mut Pass {
                dev,
                rope: rope.as_ref(),
                dims,
                batch,
                drop,
                scratch: attn_scratch.view_mut(),
                prof: profile,
                accumulate_weight_grads,
            };
            let (params, hooks) = (params.view_mut(), &mut *hooks);
            let ready = (ready, split_blocks, sparse_embeddings);
            backward_pass(pass, layout, params, grads, &mut acts, hooks, ready)
        };
        dev.install(&mut run);
        Ok(())
    }
}

/// Zeros `ranges` of the gradient buffer `grads`, on the backend's threads.
fn fill_grads(
    dev: &dyn Backend,
    grads: &mut Buffer,
    mut ranges: impl Iterator<Item = Range<usize>> + Send,
) {
    dev.install(&mut || {
        for r in ranges.by_ref() {
            dev.fill(grads.view_mut().slice_mut(r), 0.0);
        }
    });
}

/// Per-part hooks take host slices: an error for a model on a device.
fn host_hooks(dev: &dyn Backend, hooks: bool) -> Result<(), GptError> {
    if hooks && dev.device() != Device::Cpu {
        return Err(GptError::Engine {
            op: "per-part hooks",
            reason: format!(
                "they take host slices; not yet for a model on {}",
                dev.device()
            ),
        });
    }
    Ok(())
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

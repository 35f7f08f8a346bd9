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
use cohort_engine::{Backend, Dropout};
use cohort_rng::SplitMix64;

use crate::layout::{BlockLayout, Layout};
use crate::{GPTConfig, GptError, ParamView};

/// Kernels timed by the built-in profiler, in report order.
pub(crate) const KERNELS: [&str; 16] = [
    "encoder_fwd",
    "layernorm_fwd",
    "matmul_fwd",
    "attention_fwd",
    "gelu_fwd",
    "residual_fwd",
    "head_fwd",
    "crossentropy_fwd",
    "crossentropy_bwd",
    "head_bwd",
    "layernorm_bwd",
    "matmul_bwd",
    "attention_bwd",
    "gelu_bwd",
    "dropout_bwd",
    "encoder_bwd",
];

#[derive(Clone, Copy)]
enum K {
    EncoderFwd,
    LnFwd,
    MatmulFwd,
    AttnFwd,
    GeluFwd,
    ResidualFwd,
    HeadFwd,
    CeFwd,
    CeBwd,
    HeadBwd,
    LnBwd,
    MatmulBwd,
    AttnBwd,
    GeluBwd,
    DropoutBwd,
    EncoderBwd,
}

/// Accumulated wall time per kernel (always on: one `Instant` pair per kernel call).
#[derive(Default)]
pub(crate) struct Profile(pub(crate) [Duration; KERNELS.len()]);

impl Profile {
    #[inline]
    fn time<R>(&mut self, k: K, f: impl FnOnce() -> R) -> R {
        let t0 = Instant::now();
        let r = f();
        self.0[k as usize] += t0.elapsed();
        r
    }
}

/// Offsets of every activation inside the arena; all sized for `n` tokens.
pub(crate) struct ActLayout {
    pub(crate) n: usize,
    keep: bool,
    ranges: [Range<usize>; ACT_BUFFERS],
    pub(crate) total: usize,
}

/// Buffers of the arena, in carve order (see `ActLayout::new` for their shapes).
const ACT_BUFFERS: usize = 23;

/// The arena split into its buffers; per-layer buffers hold all L layers back to back.
pub(crate) struct Acts<'a> {
    pub(crate) res: &'a mut [f32], // (L+1, N, C) block inputs; res[L] feeds ln_f
    res_mid: &'a mut [f32],        // (L, N, C) residual after attention
    qkv: &'a mut [f32],            // (L, N, 3C)
    fch: &'a mut [f32],            // (L, N, F) MLP pre-activation
    ln1_mean: &'a mut [f32],       // (L, N)
    ln1_rstd: &'a mut [f32],       // (L, N)
    ln2_mean: &'a mut [f32],       // (L, N)
    ln2_rstd: &'a mut [f32],       // (L, N)
    att_lse: &'a mut [f32],        // (L, B, NH, T)
    lnf_out: &'a mut [f32],        // (N, C)
    lnf_mean: &'a mut [f32],       // (N)
    lnf_rstd: &'a mut [f32],       // (N)
    logits: &'a mut [f32],         // (N, V)
    losses: &'a mut [f32],         // (N)
    ce_lse: &'a mut [f32],         // (N)
    s_ln: &'a mut [f32],           // (2L, N, C) kept LayerNorm outputs, or (N, C) scratch
    s_atty: &'a mut [f32],         // (L, N, C) kept attention outputs, or (N, C) scratch
    s_big: &'a mut [f32],          // (N, max(F, 3C)) scratch: GELU output, dG, dqkv
    s_dl: &'a mut [f32],           // (N, C) scratch: gradient of a LayerNorm output / attention out
    s_drop: &'a mut [f32],         // (N, C) scratch: dropout backward (empty without dropout)
    pub(crate) dres: &'a mut [f32], // (N, C) gradient of the residual stream
    dlogits: &'a mut [f32],        // (N, V)
    gelu: &'a mut [f32],           // (L, N, F) kept GELU outputs (empty unless kept)
    /// Whether the LayerNorm, attention and GELU outputs are kept per layer.
    keep: bool,
}

/// Below this many bytes for the kept outputs, forward keeps the LayerNorm, attention and GELU
/// outputs of every layer and backward reads them instead of recomputing: config A needs 11 MB
/// and saves ~1.5 ms of its ~32 ms step; config B would need 132 MB, which its 400 MB budget
/// cannot spare.
pub(crate) const KEEP_MAX_BYTES: usize = 32 << 20;

impl Acts<'_> {
    /// Slot of the LayerNorm output (`which` 0 = ln_1, 1 = ln_2) of layer `l` in `s_ln`.
    fn ln_slot(&self, l: usize, which: usize) -> usize {
        if self.keep {
            2 * l + which
        } else {
            0
        }
    }
    /// Slot of layer `l`'s attention output in `s_atty`.
    fn atty_slot(&self, l: usize) -> usize {
        if self.keep {
            l
        } else {
            0
        }
    }
}

impl ActLayout {
    pub(crate) fn new(cfg: &GPTConfig, n: usize, keep_max_bytes: usize) -> ActLayout {
        let (l, c, f, v, nh) = (
            cfg.n_layers,
            cfg.d_model,
            cfg.d_ff,
            cfg.vocab_size,
            cfg.n_heads,
        );
        let drop = if cfg.dropout > 0.0 { n * c } else { 0 };
        let keep = l * n * (f + 3 * c) * 4 <= keep_max_bytes;
        let kept = |per_layer: usize| if keep { per_layer } else { 0 };
        let sizes = [
            (l + 1) * n * c,
            l * n * c,
            l * n * 3 * c,
            l * n * f,
            l * n,
            l * n,
            l * n,
            l * n,
            l * n * nh,
            n * c,
            n,
            n,
            n * v,
            n,
            n,
            if keep { 2 * l * n * c } else { n * c },
            if keep { l * n * c } else { n * c },
            n * f.max(3 * c),
            n * c,
            drop,
            n * c,
            n * v,
            kept(l * n * f),
        ];
        let mut next = 0;
        let ranges = sizes.map(|s| {
            let r = next..next + s;
            next += s;
            r
        });
        ActLayout {
            n,
            keep,
            ranges,
            total: next,
        }
    }

    pub(crate) fn carve<'a>(&self, arena: &'a mut [f32]) -> Acts<'a> {
        let mut rest = arena;
        let mut parts: [&'a mut [f32]; ACT_BUFFERS] = Default::default();
        for (p, r) in parts.iter_mut().zip(&self.ranges) {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(r.len());
            *p = head;
            rest = tail;
        }
        let [res, res_mid, qkv, fch, ln1_mean, ln1_rstd, ln2_mean, ln2_rstd, att_lse, lnf_out, lnf_mean, lnf_rstd, logits, losses, ce_lse, s_ln, s_atty, s_big, s_dl, s_drop, dres, dlogits, gelu] =
            parts;
        Acts {
            res,
            res_mid,
            qkv,
            fch,
            ln1_mean,
            ln1_rstd,
            ln2_mean,
            ln2_rstd,
            att_lse,
            lnf_out,
            lnf_mean,
            lnf_rstd,
            logits,
            losses,
            ce_lse,
            s_ln,
            s_atty,
            s_big,
            s_dl,
            s_drop,
            dres,
            dlogits,
            gelu,
            keep: self.keep,
        }
    }
}

/// What the last forward saw, kept for backward (buffers reused across steps).
#[derive(Default)]
pub(crate) struct Batch {
    pub(crate) b: usize,
    pub(crate) t: usize,
    pub(crate) ids: Vec<u32>,
    pub(crate) mask: Vec<u8>,
    pub(crate) has_mask: bool,
    /// Per position: the id it must predict, or -1 when not counted.
    pub(crate) targets: Vec<i32>,
    /// Counted positions; None when the forward had no labels.
    pub(crate) counted: Option<usize>,
}

impl Batch {
    /// Records a validated batch; the targets follow the label shift and masking rules of
    /// [`GPT::forward`]. `ids` may be empty (a pipeline stage fed activations).
    pub(crate) fn set(
        &mut self,
        ids: &[u32],
        attention_mask: Option<&[u8]>,
        labels: Option<&[i32]>,
        b: usize,
        t: usize,
    ) {
        let n = b * t;
        self.b = b;
        self.t = t;
        self.ids.clear();
        self.ids.extend_from_slice(ids);
        self.has_mask = attention_mask.is_some();
        self.mask.clear();
        if let Some(m) = attention_mask {
            self.mask.extend(m.iter().map(|&v| (v != 0) as u8));
        }
        self.targets.clear();
        self.counted = None;
        if let Some(labels) = labels {
            let mask = attention_mask;
            let real = |i: usize| mask.is_none_or(|m| m[i] != 0);
            self.targets.extend((0..n).map(|i| {
                let next = i + 1;
                if i % t + 1 < t && labels[next] != -100 && real(i) && real(next) {
                    labels[next]
                } else {
                    -1
                }
            }));
            self.counted = Some(self.targets.iter().filter(|&&y| y >= 0).count());
        }
    }
}

/// The model: config, flat parameters and gradients, activation arena, backend.
pub struct GPT {
    config: GPTConfig,
    layout: Layout,
    params: Vec<f32>,
    grads: Vec<f32>,
    dev: Box<dyn Backend>,
    act_layout: Option<ActLayout>,
    arena: Vec<f32>,
    attn_scratch: Vec<f32>,
    batch: Batch,
    training: bool,
    dropout_seed: u64,
    rank: u64,
    step: u64,
    profile: Profile,
    /// `KEEP_MAX_BYTES`; tests lower it to cover the recomputing path.
    keep_max_bytes: usize,
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

/// Deterministic N(0, 1) draws: cohort's SplitMix64 feeding Box-Muller.
#[derive(Clone)]
struct Normal(SplitMix64);

impl Normal {
    fn new(seed: u64) -> Self {
        Normal(SplitMix64::new(seed))
    }
    /// Consumes the draws `fill` would make for `len` values, without computing them.
    fn skip(&mut self, len: usize) {
        self.0.skip(2 * len.div_ceil(2) as u64);
    }
    fn fill(&mut self, x: &mut [f32], std: f64) {
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

/// `g[w]` and the bias right after it (empty range: None), as two disjoint slices.
pub(crate) fn wb<'a>(
    g: &'a mut [f32],
    off: usize,
    w: &Range<usize>,
    b: &Range<usize>,
) -> (&'a mut [f32], Option<&'a mut [f32]>) {
    let (wg, rest) = g[w.start - off..].split_at_mut(w.len());
    let bg = if b.is_empty() {
        None
    } else {
        Some(&mut rest[..b.len()])
    };
    (wg, bg)
}

fn opt<'a>(p: &'a [f32], r: &Range<usize>) -> Option<&'a [f32]> {
    if r.is_empty() {
        None
    } else {
        Some(&p[r.clone()])
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

/// The CPU backend sized by `COHORT_NUM_THREADS`.
pub(crate) fn cpu_from_env() -> Result<Box<dyn Backend>, GptError> {
    let cpu = Cpu::from_env().map_err(|e| GptError::Engine {
        op: "thread pool",
        reason: e.to_string(),
    })?;
    Ok(Box::new(cpu))
}

/// Values per parallel initialisation chunk; even, so that no Box-Muller
/// pair straddles two chunks.
const INIT_CHUNK: usize = 1 << 16;

impl GPT {
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
            params: vec![0.0; layout.total],
            grads: vec![0.0; layout.total],
            layout,
            config,
            dev,
            act_layout: None,
            arena: Vec::new(),
            attn_scratch: Vec::new(),
            batch: Batch::default(),
            training: true,
            dropout_seed: seed,
            rank: 0,
            step: 0,
            profile: Profile::default(),
            keep_max_bytes: KEEP_MAX_BYTES,
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
    /// Logits (B, T, V) of the last forward.
    pub fn logits(&self) -> &[f32] {
        let n = self.batch.b * self.batch.t;
        match &self.act_layout {
            Some(al) => {
                &self.arena[al.ranges[12].start..al.ranges[12].start + n * self.config.vocab_size]
            }
            None => &[],
        }
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
        validate_batch(&self.config, Some(input_ids), attention_mask, labels, b, t)?;
        let n = b * t;
        if self.act_layout.as_ref().is_none_or(|al| al.n < n) {
            // Free the old arena first so peak memory is one arena, not two.
            self.arena = Vec::new();
            let al = ActLayout::new(&self.config, n, self.keep_max_bytes);
            self.arena = vec![0.0; al.total];
            self.attn_scratch = vec![
                0.0;
                self.dev
                    .attention_scratch_len(self.config.max_position_embeddings)
            ];
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
    labels: Option<&[i32]>,
    b: usize,
    t: usize,
) -> Result<(), GptError> {
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

/// The dropout settings of one step; `site` hands out the key of each dropout location.
#[derive(Clone, Copy)]
pub(crate) struct DropKey {
    pub(crate) on: bool,
    pub(crate) p: f32,
    pub(crate) seed: u64,
    pub(crate) rank: u64,
    pub(crate) step: u64,
}

impl DropKey {
    /// Sites: 0 embeddings; per layer l: 1+3l attention probabilities, 2+3l attention
    /// output, 3+3l MLP output.
    fn site(&self, site: u64) -> Option<Dropout> {
        self.on.then(|| Dropout {
            p: self.p,
            key: Dropout::key(self.seed, self.rank, self.step, site),
        })
    }
}

/// Block `l`'s slice of a per-layer buffer whose layers are `len` long.
pub(crate) fn layer(buf: &[f32], l: usize, len: usize) -> &[f32] {
    &buf[l * len..(l + 1) * len]
}

fn layer_mut(buf: &mut [f32], l: usize, len: usize) -> &mut [f32] {
    &mut buf[l * len..(l + 1) * len]
}

/// (layer l, read-only) and (layer l + 1, writable) of a per-layer buffer.
fn layer_pair(buf: &mut [f32], l: usize, len: usize) -> (&[f32], &mut [f32]) {
    let (lo, hi) = buf.split_at_mut((l + 1) * len);
    (&lo[l * len..], &mut hi[..len])
}

#[allow(clippy::too_many_arguments)]
fn forward_pass(
    cfg: &GPTConfig,
    lay: &Layout,
    p: &[f32],
    dev: &dyn Backend,
    a: &mut Acts,
    scratch: &mut [f32],
    batch: &Batch,
    drop: DropKey,
    prof: &mut Profile,
) -> Option<f32> {
    let (b, t) = (batch.b, batch.t);
    let (c, f, nh) = (cfg.d_model, cfg.d_ff, cfg.n_heads);
    let mask = batch.has_mask.then_some(&batch.mask[..]);
    let dims = AttnDims { b, t, c, nh };
    embed_forward(p, &lay.wte, &lay.wpe, dev, a, batch, c, drop, prof);
    for (l, bl) in lay.blocks.iter().enumerate() {
        block_forward(l, l, bl, p, dev, a, scratch, mask, dims, f, drop, prof);
    }
    let head = HeadLayout {
        ln_f_w: &lay.ln_f_w,
        ln_f_b: &lay.ln_f_b,
        lm_head: &lay.lm_head,
    };
    head_forward(
        cfg.n_layers,
        &head,
        p,
        dev,
        a,
        batch,
        c,
        cfg.vocab_size,
        prof,
    )
}

/// Where the final LayerNorm and the head's weight live in a parameter buffer.
pub(crate) struct HeadLayout<'l> {
    pub(crate) ln_f_w: &'l Range<usize>,
    pub(crate) ln_f_b: &'l Range<usize>,
    pub(crate) lm_head: &'l Range<usize>,
}

/// Token + position embeddings (and their dropout) into `a.res[0]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn embed_forward(
    p: &[f32],
    wte: &Range<usize>,
    wpe: &Range<usize>,
    dev: &dyn Backend,
    a: &mut Acts,
    batch: &Batch,
    c: usize,
    drop: DropKey,
    prof: &mut Profile,
) {
    let (b, t) = (batch.b, batch.t);
    let x0 = &mut a.res[..b * t * c];
    prof.time(K::EncoderFwd, || {
        dev.encoder_forward(x0, &batch.ids, &p[wte.clone()], &p[wpe.clone()], b, t, c)
    });
    if let Some(d) = drop.site(0) {
        prof.time(K::ResidualFwd, || dev.dropout_forward(x0, d));
    }
}

/// One block's forward from `a.res[l]` into `a.res[l + 1]`; `l` indexes the arena's per-layer
/// buffers, `lg` is the block's index in the whole model (it keys the dropout sites).
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_forward(
    l: usize,
    lg: usize,
    bl: &BlockLayout,
    p: &[f32],
    dev: &dyn Backend,
    a: &mut Acts,
    scratch: &mut [f32],
    mask: Option<&[u8]>,
    dims: AttnDims,
    f: usize,
    drop: DropKey,
    prof: &mut Profile,
) {
    let AttnDims { b, t, c, nh } = dims;
    let n = b * t;
    let nc = n * c;
    let ld = 1 + 3 * lg as u64;
    let (ln1_slot, ln2_slot, atty_slot) = (a.ln_slot(l, 0), a.ln_slot(l, 1), a.atty_slot(l));
    let (x, x_next) = layer_pair(a.res, l, nc);
    let x_mid = layer_mut(a.res_mid, l, nc);
    let qkv = layer_mut(a.qkv, l, 3 * nc);
    let fch = layer_mut(a.fch, l, n * f);
    let s_atty = layer_mut(a.s_atty, atty_slot, nc);
    let s_big = if a.keep {
        layer_mut(a.gelu, l, n * f)
    } else {
        &mut a.s_big[..n * f]
    };
    let lse = layer_mut(a.att_lse, l, n * nh);
    let s_ln = layer_mut(a.s_ln, ln1_slot, nc);
    prof.time(K::LnFwd, || {
        dev.layernorm_forward(
            s_ln,
            layer_mut(a.ln1_mean, l, n),
            layer_mut(a.ln1_rstd, l, n),
            x,
            &p[bl.ln_1_w.clone()],
            opt(p, &bl.ln_1_b),
            n,
            c,
        )
    });
    prof.time(K::MatmulFwd, || {
        dev.matmul_forward(
            qkv,
            s_ln,
            &p[bl.attn_w.clone()],
            opt(p, &bl.attn_b),
            n,
            c,
            3 * c,
        )
    });
    prof.time(K::AttnFwd, || {
        dev.attention_forward(s_atty, lse, qkv, mask, dims, drop.site(ld), scratch)
    });
    prof.time(K::MatmulFwd, || {
        dev.matmul_forward(x_mid, s_atty, &p[bl.proj_w.clone()], None, n, c, c)
    });
    prof.time(K::ResidualFwd, || {
        dev.residual_forward(x_mid, x, opt(p, &bl.proj_b), c, drop.site(ld + 1))
    });
    let s_ln = layer_mut(a.s_ln, ln2_slot, nc);
    prof.time(K::LnFwd, || {
        dev.layernorm_forward(
            s_ln,
            layer_mut(a.ln2_mean, l, n),
            layer_mut(a.ln2_rstd, l, n),
            x_mid,
            &p[bl.ln_2_w.clone()],
            opt(p, &bl.ln_2_b),
            n,
            c,
        )
    });
    prof.time(K::MatmulFwd, || {
        dev.matmul_forward(fch, s_ln, &p[bl.fc_w.clone()], opt(p, &bl.fc_b), n, c, f)
    });
    prof.time(K::GeluFwd, || dev.gelu_forward(s_big, fch));
    prof.time(K::MatmulFwd, || {
        dev.matmul_forward(x_next, s_big, &p[bl.fcproj_w.clone()], None, n, f, c)
    });
    prof.time(K::ResidualFwd, || {
        dev.residual_forward(x_next, x_mid, opt(p, &bl.fcproj_b), c, drop.site(ld + 2))
    });
}

/// ln_f, the head and (with targets) the cross-entropy, from `a.res[l_out]`; returns the mean
/// loss over counted positions.
#[allow(clippy::too_many_arguments)]
pub(crate) fn head_forward(
    l_out: usize,
    lay: &HeadLayout,
    p: &[f32],
    dev: &dyn Backend,
    a: &mut Acts,
    batch: &Batch,
    c: usize,
    v: usize,
    prof: &mut Profile,
) -> Option<f32> {
    let n = batch.b * batch.t;
    let nc = n * c;
    let x_last = layer(a.res, l_out, nc);
    let lnf_out = &mut a.lnf_out[..nc];
    prof.time(K::LnFwd, || {
        dev.layernorm_forward(
            lnf_out,
            &mut a.lnf_mean[..n],
            &mut a.lnf_rstd[..n],
            x_last,
            &p[lay.ln_f_w.clone()],
            opt(p, lay.ln_f_b),
            n,
            c,
        )
    });
    let logits = &mut a.logits[..n * v];
    prof.time(K::HeadFwd, || {
        dev.head_forward(logits, lnf_out, &p[lay.lm_head.clone()], n, c, v)
    });
    let counted = batch.counted?;
    let losses = &mut a.losses[..n];
    prof.time(K::CeFwd, || {
        dev.crossentropy_forward(losses, &mut a.ce_lse[..n], logits, &batch.targets, n, v)
    });
    if counted == 0 {
        return Some(0.0);
    }
    // f64 and a fixed order: the loss is the same bits whatever the thread count.
    let total: f64 = losses.iter().map(|&x| x as f64).sum();
    Some((total / counted as f64) as f32)
}

#[allow(clippy::too_many_arguments)]
fn backward_pass<'g>(
    cfg: &GPTConfig,
    lay: &Layout,
    p: &[f32],
    grads: &'g mut [f32],
    dev: &dyn Backend,
    a: &mut Acts,
    scratch: &mut [f32],
    batch: &Batch,
    counted: usize,
    drop: DropKey,
    prof: &mut Profile,
    mut hook: impl FnMut(Range<usize>, &'g mut [f32]),
) {
    let (b, t) = (batch.b, batch.t);
    let (c, f, v, nh) = (cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_heads);
    let mask = batch.has_mask.then_some(&batch.mask[..]);
    let dims = AttnDims { b, t, c, nh };

    // Head and ln_f. The head's weight gradient goes to wte when tied (lower part of the buffer,
    // handed out last) or to lm_head (in the top range, after ln_f).
    let head_start = lay.ln_f_w.start;
    let (mut rest, top) = grads.split_at_mut(head_start);
    {
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
    hook(head_start..lay.total, top);

    for (l, bl) in lay.blocks.iter().enumerate().rev() {
        let (lower, g) = std::mem::take(&mut rest).split_at_mut(bl.all.start);
        rest = lower;
        block_backward(l, l, bl, p, g, dev, a, scratch, mask, dims, f, drop, prof);
        hook(bl.all.clone(), g);
    }

    let (dwte, dwpe) = rest.split_at_mut(lay.wpe.start);
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

/// Backward of the cross-entropy, the head and ln_f: `a.dres` is set to d(`a.res[l_out]`).
/// `dw_head` receives the head weight's gradient (wte's when tied), `dw_lnf` ln_f's.
#[allow(clippy::too_many_arguments)]
pub(crate) fn head_backward(
    l_out: usize,
    lay: &HeadLayout,
    p: &[f32],
    dw_head: &mut [f32],
    dw_lnf: (&mut [f32], Option<&mut [f32]>),
    dev: &dyn Backend,
    a: &mut Acts,
    batch: &Batch,
    counted: usize,
    c: usize,
    v: usize,
    prof: &mut Profile,
) {
    let n = batch.b * batch.t;
    let nc = n * c;
    let scale = if counted == 0 {
        0.0
    } else {
        1.0 / counted as f32
    };
    let dlogits = &mut a.dlogits[..n * v];
    let logits = &a.logits[..n * v];
    prof.time(K::CeBwd, || {
        dev.crossentropy_backward(dlogits, logits, &a.ce_lse[..n], &batch.targets, scale, n, v)
    });
    let lnf_out = &a.lnf_out[..nc];
    let dlnf = &mut a.s_dl[..nc];
    prof.time(K::HeadBwd, || {
        dev.head_backward(
            dlnf,
            dw_head,
            dlogits,
            lnf_out,
            &p[lay.lm_head.clone()],
            n,
            c,
            v,
        )
    });
    let dres = &mut a.dres[..nc];
    dres.fill(0.0);
    let (dw, db) = dw_lnf;
    let x_last = layer(a.res, l_out, nc);
    prof.time(K::LnBwd, || {
        dev.layernorm_backward(
            dres,
            dw,
            db,
            dlnf,
            x_last,
            &a.lnf_mean[..n],
            &a.lnf_rstd[..n],
            &p[lay.ln_f_w.clone()],
            n,
            c,
        )
    });
}

/// Backward of the embeddings (and their dropout) from d(`a.res[0]`) in `a.dres`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn embed_backward(
    dwte: &mut [f32],
    dwpe: &mut [f32],
    dev: &dyn Backend,
    a: &mut Acts,
    batch: &Batch,
    c: usize,
    drop: DropKey,
    prof: &mut Profile,
) {
    let (b, t) = (batch.b, batch.t);
    let nc = b * t * c;
    let dres = &a.dres[..nc];
    let demb: &[f32] = match drop.site(0) {
        Some(d) => {
            let s = &mut a.s_drop[..nc];
            prof.time(K::DropoutBwd, || dev.dropout_backward(s, dres, d));
            s
        }
        None => dres,
    };
    prof.time(K::EncoderBwd, || {
        dev.encoder_backward(dwte, dwpe, demb, &batch.ids, b, t, c)
    });
}

/// One block's backward: `a.dres` holds d(block output) on entry and d(block input) on exit;
/// `g` is the block's gradient range (offset `bl.all.start`). `l` indexes the arena's per-layer
/// buffers, `lg` is the block's index in the whole model (it keys the dropout sites).
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_backward(
    l: usize,
    lg: usize,
    bl: &BlockLayout,
    p: &[f32],
    g: &mut [f32],
    dev: &dyn Backend,
    a: &mut Acts,
    scratch: &mut [f32],
    mask: Option<&[u8]>,
    dims: AttnDims,
    f: usize,
    drop: DropKey,
    prof: &mut Profile,
) {
    let AttnDims { b, t, c, .. } = dims;
    let n = b * t;
    let nc = n * c;
    let nh = dims.nh;
    let off = bl.all.start;
    let ld = 1 + 3 * lg as u64;
    let x = layer(a.res, l, nc);
    let x_mid = layer(a.res_mid, l, nc);
    let qkv = layer(a.qkv, l, 3 * nc);
    let fch = layer(a.fch, l, n * f);
    let lse = layer(a.att_lse, l, n * nh);
    let (ln1_slot, ln2_slot, atty_slot) = (a.ln_slot(l, 0), a.ln_slot(l, 1), a.atty_slot(l));
    let keep = a.keep;
    let s_dl = &mut a.s_dl[..nc];

    // MLP: x_next = x_mid + drop(gelu(ln_2(x_mid) · W_fc + b_fc) · W_proj + b_proj)
    {
        let dres = &a.dres[..nc];
        let dproj: &[f32] = match drop.site(ld + 2) {
            Some(d) => {
                let s = &mut a.s_drop[..nc];
                prof.time(K::DropoutBwd, || dev.dropout_backward(s, dres, d));
                s
            }
            None => dres,
        };
        let s_big = &mut a.s_big[..n * f];
        let gelu_out: &[f32] = if keep {
            layer(a.gelu, l, n * f)
        } else {
            prof.time(K::GeluFwd, || dev.gelu_forward(s_big, fch));
            s_big
        };
        let (dw, db) = wb(g, off, &bl.fcproj_w, &bl.fcproj_b);
        prof.time(K::MatmulBwd, || {
            dev.matmul_backward(
                None,
                dw,
                db,
                dproj,
                gelu_out,
                &p[bl.fcproj_w.clone()],
                n,
                f,
                c,
            )
        });
        let s_big = &mut a.s_big[..n * f];
        prof.time(K::MatmulBwd, || {
            dev.matmul_backward_input(s_big, dproj, &p[bl.fcproj_w.clone()], n, f, c)
        });
        prof.time(K::GeluBwd, || dev.gelu_backward(s_big, fch));
        if !keep {
            let s_ln = layer_mut(a.s_ln, ln2_slot, nc);
            prof.time(K::LnFwd, || {
                dev.layernorm_forward(
                    s_ln,
                    layer_mut(a.ln2_mean, l, n),
                    layer_mut(a.ln2_rstd, l, n),
                    x_mid,
                    &p[bl.ln_2_w.clone()],
                    opt(p, &bl.ln_2_b),
                    n,
                    c,
                )
            });
        }
        let s_ln = layer(a.s_ln, ln2_slot, nc);
        let (dw, db) = wb(g, off, &bl.fc_w, &bl.fc_b);
        prof.time(K::MatmulBwd, || {
            dev.matmul_backward(
                Some(s_dl),
                dw,
                db,
                s_big,
                s_ln,
                &p[bl.fc_w.clone()],
                n,
                c,
                f,
            )
        });
    }
    {
        let (dw, db) = wb(g, off, &bl.ln_2_w, &bl.ln_2_b);
        let dres = &mut a.dres[..nc];
        prof.time(K::LnBwd, || {
            dev.layernorm_backward(
                dres,
                dw,
                db,
                s_dl,
                x_mid,
                layer(a.ln2_mean, l, n),
                layer(a.ln2_rstd, l, n),
                &p[bl.ln_2_w.clone()],
                n,
                c,
            )
        });
    }

    // Attention: x_mid = x + drop(attn(ln_1(x) · W_attn + b_attn) · W_proj + b_proj)
    {
        let dres = &a.dres[..nc];
        let dproj: &[f32] = match drop.site(ld + 1) {
            Some(d) => {
                let s = &mut a.s_drop[..nc];
                prof.time(K::DropoutBwd, || dev.dropout_backward(s, dres, d));
                s
            }
            None => dres,
        };
        prof.time(K::MatmulBwd, || {
            dev.matmul_backward_input(s_dl, dproj, &p[bl.proj_w.clone()], n, c, c)
        });
        let dqkv = &mut a.s_big[..3 * nc];
        // Without kept outputs, backward recomputes the attention output the projection's
        // weight gradient needs.
        let recompute = (!keep).then(|| layer_mut(a.s_atty, atty_slot, nc));
        prof.time(K::AttnBwd, || {
            dev.attention_backward(
                dqkv,
                recompute,
                s_dl,
                qkv,
                lse,
                mask,
                dims,
                drop.site(ld),
                scratch,
            )
        });
        let (dw, db) = wb(g, off, &bl.proj_w, &bl.proj_b);
        let s_atty = layer(a.s_atty, atty_slot, nc);
        prof.time(K::MatmulBwd, || {
            dev.matmul_backward(None, dw, db, dproj, s_atty, &p[bl.proj_w.clone()], n, c, c)
        });
        if !keep {
            let s_ln = layer_mut(a.s_ln, ln1_slot, nc);
            prof.time(K::LnFwd, || {
                dev.layernorm_forward(
                    s_ln,
                    layer_mut(a.ln1_mean, l, n),
                    layer_mut(a.ln1_rstd, l, n),
                    x,
                    &p[bl.ln_1_w.clone()],
                    opt(p, &bl.ln_1_b),
                    n,
                    c,
                )
            });
        }
        let s_ln = layer(a.s_ln, ln1_slot, nc);
        let (dw, db) = wb(g, off, &bl.attn_w, &bl.attn_b);
        prof.time(K::MatmulBwd, || {
            dev.matmul_backward(
                Some(s_dl),
                dw,
                db,
                dqkv,
                s_ln,
                &p[bl.attn_w.clone()],
                n,
                c,
                3 * c,
            )
        });
    }
    let (dw, db) = wb(g, off, &bl.ln_1_w, &bl.ln_1_b);
    let dres = &mut a.dres[..nc];
    prof.time(K::LnBwd, || {
        dev.layernorm_backward(
            dres,
            dw,
            db,
            s_dl,
            x,
            layer(a.ln1_mean, l, n),
            layer(a.ln1_rstd, l, n),
            &p[bl.ln_1_w.clone()],
            n,
            c,
        )
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(bias: bool, tied: bool, dropout: f32) -> GPTConfig {
        GPTConfig {
            vocab_size: 11,
            max_position_embeddings: 8,
            n_layers: 2,
            n_heads: 2,
            d_model: 8,
            d_ff: 12,
            dropout,
            bias,
            tie_word_embeddings: tied,
        }
    }

    fn model(cfg: GPTConfig, threads: usize, seed: u64) -> GPT {
        GPT::with_backend(cfg, seed, Box::new(Cpu::new(threads).unwrap())).unwrap()
    }

    /// B = 2, T = 7: row 0 has trailing padding, row 1 is left-padded; some labels are -100.
    fn batch() -> (Vec<u32>, Vec<u8>, Vec<i32>) {
        let ids: Vec<u32> = (0..14).map(|i| (i * 7 % 11) as u32).collect();
        let mask = vec![1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1];
        let mut labels: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
        labels[3] = -100;
        labels[12] = -100;
        (ids, mask, labels)
    }

    fn loss_at(m: &mut GPT, ids: &[u32], mask: &[u8], labels: &[i32]) -> f64 {
        m.forward(ids, Some(mask), Some(labels), 2, 7)
            .unwrap()
            .unwrap() as f64
    }

    /// Central differences in f32 on parameters scaled up to N(0, 0.3) (so gradients are O(0.1)
    /// and the loss differences stand well above f32 rounding): for every tensor, a sample of
    /// single coordinates, and the derivative along the tensor's own gradient (which catches any
    /// scale error tightly). Dropout masks are fixed per step, so the check holds with dropout.
    fn grad_check(cfg: GPTConfig) {
        for keep_max_bytes in [KEEP_MAX_BYTES, 0] {
            grad_check_keeping(cfg.clone(), keep_max_bytes);
        }
    }

    fn grad_check_keeping(cfg: GPTConfig, keep_max_bytes: usize) {
        let (ids, mask, labels) = batch();
        let mut m = model(cfg.clone(), 2, 5);
        m.keep_max_bytes = keep_max_bytes;
        let mut rng = Normal::new(77);
        let mut big = vec![0.0; m.num_params()];
        rng.fill(&mut big, 0.3);
        m.params_mut().copy_from_slice(&big);
        m.set_dropout_key(3, 1, 9);
        loss_at(&mut m, &ids, &mask, &labels);
        m.zero_grad();
        m.backward(|_, _| {}).unwrap();
        let g = m.grads().to_vec();
        assert!(g.iter().all(|x| x.is_finite()));
        let eps = 1e-2f32;
        let views = m.param_views().to_vec();
        for v in &views {
            let r = v.range.clone();
            let picks: Vec<usize> = (0..8).map(|k| r.start + (k * 7919) % r.len()).collect();
            for &i in &picks {
                let orig = m.params()[i];
                m.params_mut()[i] = orig + eps;
                let up = loss_at(&mut m, &ids, &mask, &labels);
                m.params_mut()[i] = orig - eps;
                let dn = loss_at(&mut m, &ids, &mask, &labels);
                m.params_mut()[i] = orig;
                let fd = (up - dn) / (2.0 * eps as f64);
                let err = (fd - g[i] as f64).abs();
                assert!(
                    err <= 1e-2 * fd.abs().max(g[i].abs() as f64) + 5e-5,
                    "{} [{}]: backward {}, finite difference {fd}",
                    v.name,
                    i - r.start,
                    g[i]
                );
            }
            let norm = g[r.clone()]
                .iter()
                .map(|&x| (x as f64).powi(2))
                .sum::<f64>()
                .sqrt();
            if norm < 1e-6 {
                continue;
            }
            // Along the gradient itself, then along a random direction (which an error
            // orthogonal to the gradient cannot hide from).
            let mut random = vec![0.0f32; r.len()];
            rng.fill(&mut random, 1.0);
            let rnorm = random
                .iter()
                .map(|&x| (x as f64).powi(2))
                .sum::<f64>()
                .sqrt();
            let along_g: Vec<f64> = g[r.clone()].iter().map(|&x| x as f64 / norm).collect();
            let along_r: Vec<f64> = random.iter().map(|&x| x as f64 / rnorm).collect();
            let base = m.params()[r.clone()].to_vec();
            for (what, dir) in [("gradient", along_g), ("random", along_r)] {
                let want: f64 = dir
                    .iter()
                    .zip(&g[r.clone()])
                    .map(|(d, &g)| d * g as f64)
                    .sum();
                let mut at = |s: f64| {
                    for (k, i) in r.clone().enumerate() {
                        m.params_mut()[i] = base[k] + (s * dir[k]) as f32;
                    }
                    loss_at(&mut m, &ids, &mask, &labels)
                };
                let fd = (at(eps as f64) - at(-eps as f64)) / (2.0 * eps as f64);
                m.params_mut()[r.clone()].copy_from_slice(&base);
                assert!((fd - want).abs() <= 3e-3 * norm + 2e-5, "{} along the {what} direction: backward {want}, finite difference {fd} (|grad| {norm})", v.name);
            }
        }
    }

    #[test]
    fn parallel_init_draws_what_one_sequential_pass_draws() {
        // wte (1001 x 130) spans three chunks, the last odd-sized.
        let cfg = GPTConfig {
            vocab_size: 1001,
            max_position_embeddings: 9,
            d_model: 130,
            d_ff: 70,
            ..tiny(true, false, 0.0)
        };
        let m = model(cfg.clone(), 1, 42);
        let mut want = vec![f32::NAN; m.num_params()];
        let mut rng = Normal::new(42);
        let resid_std = 0.02 / (2.0 * cfg.n_layers as f64).sqrt();
        for v in m.param_views() {
            let p = &mut want[v.range.clone()];
            if v.name.ends_with(".bias") {
                p.fill(0.0);
            } else if v.name.contains("ln_") {
                p.fill(1.0);
            } else if v.name.ends_with("c_proj.weight") {
                rng.fill(p, resid_std);
            } else {
                rng.fill(p, 0.02);
            }
        }
        assert!(m.params() == want.as_slice());
    }

    #[test]
    fn gradients_match_finite_differences_tied_with_bias() {
        grad_check(tiny(true, true, 0.0));
    }

    #[test]
    fn gradients_match_finite_differences_untied_without_bias() {
        grad_check(tiny(false, false, 0.0));
    }

    #[test]
    fn gradients_match_finite_differences_with_dropout() {
        grad_check(tiny(true, false, 0.2));
    }

    #[test]
    fn initial_loss_is_ln_vocab() {
        let cfg = GPTConfig::config_a();
        let mut m = model(cfg.clone(), 2, 1234);
        let (b, t) = (4, 64);
        let ids: Vec<u32> = (0..b * t)
            .map(|i| ((i * 2_654_435_761usize) >> 7) as u32 % 65)
            .collect();
        let labels: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
        let loss = m.forward(&ids, None, Some(&labels), b, t).unwrap().unwrap();
        assert!((loss - 65f32.ln()).abs() < 0.1, "initial loss {loss}");
        // The residual projections are drawn with the smaller std.
        let proj = m
            .param_views()
            .iter()
            .find(|v| v.name == "h.0.mlp.c_proj.weight")
            .unwrap();
        let p = &m.params()[proj.range.clone()];
        let std = (p.iter().map(|x| x * x).sum::<f32>() / p.len() as f32).sqrt();
        assert!((std - 0.02 / 8f32.sqrt()).abs() < 5e-4, "c_proj std {std}");
    }

    /// Losses and parameters after a few steps of plain SGD, dropout on.
    fn run(threads: usize) -> (Vec<f32>, Vec<f32>) {
        let cfg = GPTConfig {
            dropout: 0.1,
            ..GPTConfig::config_a()
        };
        let mut m = model(cfg, threads, 42);
        let (b, t) = (3, 64);
        let mut losses = vec![];
        for step in 0..3u64 {
            let ids: Vec<u32> = (0..b * t)
                .map(|i| ((i as u64 * 31 + step * 17) % 65) as u32)
                .collect();
            let labels: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
            let mut mask = vec![1u8; b * t];
            mask[t..t + 5].fill(0);
            m.set_dropout_key(42, 0, step);
            losses.push(
                m.forward(&ids, Some(&mask), Some(&labels), b, t)
                    .unwrap()
                    .unwrap(),
            );
            m.zero_grad();
            m.backward(|_, _| {}).unwrap();
            let (p, g) = m.params_and_grads_mut();
            p.iter_mut().zip(g).for_each(|(p, g)| *p -= 0.1 * g);
        }
        (losses, m.params().to_vec())
    }

    #[test]
    fn training_is_bitwise_reproducible_and_independent_of_thread_count() {
        let one = run(1);
        assert_eq!(one, run(1), "two runs with 1 thread differ");
        assert_eq!(one, run(2), "1 and 2 threads differ");
        assert!(one.0[2] < one.0[0], "loss did not go down: {:?}", one.0);
    }

    #[test]
    fn backward_hands_out_final_ranges_in_order_to_another_thread() {
        for tied in [true, false] {
            let mut m = model(tiny(true, tied, 0.0), 2, 9);
            let (ids, mask, labels) = batch();
            loss_at(&mut m, &ids, &mask, &labels);
            m.zero_grad();
            let expected = m.ready_ranges();
            let (got, sums) = std::thread::scope(|s| {
                let (tx, rx) = std::sync::mpsc::channel::<(Range<usize>, &mut [f32])>();
                let summer = s.spawn(move || {
                    let mut got = vec![];
                    let mut sums = vec![];
                    for (r, g) in rx {
                        assert_eq!(r.len(), g.len());
                        sums.push(g.iter().map(|&x| x as f64).sum::<f64>());
                        // The slice is ours now: scaling it must show up in the final buffer.
                        g.iter_mut().for_each(|x| *x *= 2.0);
                        got.push(r);
                    }
                    (got, sums)
                });
                m.backward(move |r, g| tx.send((r, g)).unwrap()).unwrap();
                summer.join().unwrap()
            });
            assert_eq!(got, expected);
            assert_eq!(got.first().unwrap().end, m.num_params());
            assert_eq!(got.last().unwrap().start, 0);
            for (r, s) in got.iter().zip(&sums) {
                let now: f64 = m.grads()[r.clone()].iter().map(|&x| x as f64).sum();
                assert!((now - 2.0 * s).abs() <= 1e-9 * (1.0 + s.abs()), "{r:?}");
            }
        }
    }

    #[test]
    fn arena_is_reused_for_same_or_smaller_batches_and_grows_once() {
        let mut m = model(tiny(true, true, 0.0), 1, 1);
        let ids = vec![1u32; 16];
        m.forward(&ids, None, None, 2, 8).unwrap();
        let ptr = m.arena.as_ptr();
        m.forward(&ids[..8], None, None, 1, 8).unwrap();
        m.forward(&ids, None, None, 2, 8).unwrap();
        assert_eq!(ptr, m.arena.as_ptr());
        assert_eq!(m.logits().len(), 16 * 11);
        let ids = vec![1u32; 24];
        m.forward(&ids, None, None, 3, 8).unwrap();
        assert_eq!(m.logits().len(), 24 * 11);
    }

    #[test]
    fn bad_inputs_are_clear_errors() {
        let mut m = model(tiny(true, true, 0.0), 1, 1);
        let err = |r: Result<Option<f32>, GptError>| r.unwrap_err().to_string();
        assert!(err(m.forward(&[1, 2, 3], None, None, 2, 2)).contains("input_ids has 3 elements"));
        assert!(
            err(m.forward(&[1; 9], None, None, 1, 9)).contains("exceeds max_position_embeddings 8")
        );
        assert!(err(m.forward(&[1, 11], None, None, 1, 2)).contains("input_ids[1] = 11"));
        assert!(err(m.forward(&[1, 2], None, Some(&[1, -5]), 1, 2)).contains("labels[1] = -5"));
        assert!(err(m.forward(&[1, 2], Some(&[1]), None, 1, 2)).contains("attention_mask"));
        m.forward(&[1, 2], None, None, 1, 2).unwrap();
        assert!(matches!(m.backward(|_, _| {}), Err(GptError::NoLoss)));
        // All labels ignored: loss 0 and zero gradients, not NaN.
        let loss = m
            .forward(&[1, 2], None, Some(&[-100, -100]), 1, 2)
            .unwrap()
            .unwrap();
        assert_eq!(loss, 0.0);
        m.zero_grad();
        m.backward(|_, _| {}).unwrap();
        assert!(m.grads().iter().all(|&g| g == 0.0));
    }
}

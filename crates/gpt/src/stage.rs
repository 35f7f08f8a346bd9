//! A pipeline stage of the GPT: a contiguous range of blocks, plus the embeddings on the first
//! stage and ln_f + the head on the last, with forward and backward on plain buffers.
//!
//! A stage owns only its own parameters, in one flat buffer laid out as the whole model's
//! (`docs/GPT_LAYOUT.md`) restricted to the tensors it holds, and runs the same kernels in the same order
//! as [`GPT`](crate::GPT): composing the stages' forwards and backwards gives the whole model's
//! loss and gradients bit for bit. Activations of several micro-batches can be in flight at once:
//! each lives in its own slot (an activation arena) from its forward to its backward, which is
//! what a GPipe or 1F1B schedule needs.
//!
//! With tied embeddings (GPT-2's default) the head's weight is wte, which lives on the first
//! stage. A last stage that is not also the first holds a copy of wte (Megatron's scheme): both
//! copies start equal, each stage accumulates its own use's gradient, and the caller sums the two
//! gradients ([`GptStage::tied_range`]) before the optimizer step, so they stay equal.
//!
//! This module never communicates: it takes and returns buffers; moving activations between
//! stages is the caller's job.

use std::ops::Range;
use std::time::Duration;

use cohort_engine::{Backend, Buffer, DType};

use crate::layout::{BlockLayout, Layout};
use crate::model::{
    alloc, block_backward, block_forward, cpu_from_env, cpu_with_precision, embed_backward,
    embed_forward, head_backward, head_forward, host, host_mut, init_tensors, logit_cols,
    validate_batch, wb, write_on_host, ActLayout, Batch, BlockAt, Dims, DropKey, HeadGrads, Pass,
    Profile, RopeTables, ACT_DRES, KEEP_MAX_BYTES, KERNELS, LOGITS_MAX_BYTES_CHECKPOINTED, NO_BF16,
};
use crate::{GPTConfig, GptError, Labels, ParamView};

/// Which part of the model a stage holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagePart {
    /// The transformer blocks, as indices into the whole model's `0..n_layers`.
    pub blocks: Range<usize>,
    /// Whether the stage holds wte and wpe (and so takes token ids).
    pub embeddings: bool,
    /// Whether the stage holds ln_f and the head (and so computes the loss).
    pub head: bool,
}

impl StagePart {
    /// `stages` contiguous parts of a model with `n_layers` blocks, as even as possible (earlier
    /// stages take the remainder), the embeddings with the first and the head with the last.
    pub fn split(n_layers: usize, stages: usize) -> Result<Vec<StagePart>, GptError> {
        if stages == 0 || stages > n_layers {
            return Err(GptError::Stage {
                blocks: 0..n_layers,
                reason: format!(
                    "cannot split {n_layers} blocks into {stages} stages (need 1 <= stages <= blocks)"
                ),
            });
        }
        let (base, extra) = (n_layers / stages, n_layers % stages);
        let mut start = 0;
        Ok((0..stages)
            .map(|s| {
                let len = base + usize::from(s < extra);
                let part = StagePart {
                    blocks: start..start + len,
                    embeddings: s == 0,
                    head: s + 1 == stages,
                };
                start += len;
                part
            })
            .collect())
    }
}

/// What a stage's forward takes: token ids on the first stage, the previous stage's output
/// activations (B, T, C) on the others.
#[derive(Clone, Copy, Debug)]
pub enum StageInput<'a> {
    /// Token ids (B, T).
    Tokens(&'a [u32]),
    /// Activations (B, T, C) from the previous stage.
    Activations(&'a [f32]),
}

/// What a stage's forward gives back.
#[derive(Debug)]
pub enum StageOutput<'a> {
    /// The output activations (B, T, C) for the next stage.
    Activations(&'a [f32]),
    /// The last stage's mean loss (None when no labels were given).
    Loss(Option<f32>),
}

/// One micro-batch in flight: its activations, what it saw and its dropout key.
struct Slot {
    act_layout: Option<ActLayout>,
    arena: Buffer,
    batch: Batch,
    drop: DropKey,
    /// A forward ran and its backward has not.
    pending: bool,
}

/// A contiguous part of the GPT with its own parameters, gradients and activation slots.
pub struct GptStage {
    config: GPTConfig,
    /// The config of this stage's arena: its own block count, no vocabulary without the head.
    arena_config: GPTConfig,
    part: StagePart,
    layout: Layout,
    global: Vec<ParamView>,
    whole_total: usize,
    tied: Option<Range<usize>>,
    params: Buffer,
    grads: Buffer,
    dev: Box<dyn Backend>,
    slots: Vec<Slot>,
    attn_scratch: Buffer,
    training: bool,
    drop: DropKey,
    profile: Profile,
    /// Rotary angle tables (None with learned positions).
    rope: Option<RopeTables>,
}

impl std::fmt::Debug for GptStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GptStage")
            .field("part", &self.part)
            .field("params", &self.params.len())
            .field("backend", &self.dev)
            .finish()
    }
}

fn shift(r: &Range<usize>, off: usize) -> Range<usize> {
    r.start - off..r.end - off
}

impl GptStage {
    /// The stage `part` of `GPT::new(config, seed)`, with the same initial values, on a CPU
    /// backend sized by `COHORT_NUM_THREADS`.
    pub fn new(config: GPTConfig, seed: u64, part: StagePart) -> Result<GptStage, GptError> {
        GptStage::with_backend(config, seed, part, cpu_from_env()?)
    }

    /// A stage on the given backend.
    pub fn with_backend(
        config: GPTConfig,
        seed: u64,
        part: StagePart,
        dev: Box<dyn Backend>,
    ) -> Result<GptStage, GptError> {
        config.validate()?;
        crate::model::check_kernels(&config, &*dev)?;
        let bad = |reason: String| GptError::Stage {
            blocks: part.blocks.clone(),
            reason,
        };
        if part.blocks.is_empty() || part.blocks.end > config.n_layers {
            return Err(bad(format!(
                "a stage needs a non-empty range of blocks within 0..{}",
                config.n_layers
            )));
        }
        let full = Layout::new(&config);
        let first = &full.blocks[part.blocks.start];
        let lo = if part.embeddings { 0 } else { first.all.start };
        let hi = if part.head {
            full.total
        } else {
            full.blocks[part.blocks.end - 1].all.end
        };
        let inside = |r: &Range<usize>| r.start >= lo && r.end <= hi && !r.is_empty();
        let mut views = Vec::new();
        let mut global = Vec::new();
        for v in full.views.iter().filter(|v| inside(&v.range)) {
            views.push(ParamView {
                range: shift(&v.range, lo),
                ..v.clone()
            });
            global.push(v.clone());
        }
        let mut total = hi - lo;
        // The tied head's copy of wte, after ln_f: where an untied lm_head would be.
        let copy = (part.head && !part.embeddings && config.tie_word_embeddings).then(|| {
            let r = total..total + full.wte.len();
            total = r.end;
            let wte = &full.views[0];
            views.push(ParamView {
                range: r.clone(),
                ..wte.clone()
            });
            global.push(wte.clone());
            r
        });
        let held = |r: &Range<usize>| {
            if inside(r) {
                shift(r, lo)
            } else {
                0..0
            }
        };
        let layout = Layout {
            views,
            wte: held(&full.wte),
            // (empty under rotary positions: then wte's end, as in the whole model)
            wpe: if part.embeddings {
                shift(&full.wpe, lo)
            } else {
                0..0
            },
            blocks: full.blocks[part.blocks.clone()]
                .iter()
                .map(|b| shift_block(b, lo))
                .collect(),
            ln_f_w: held(&full.ln_f_w),
            ln_f_b: if part.head {
                shift(&full.ln_f_b, lo)
            } else {
                0..0
            },
            lm_head: match &copy {
                Some(r) => r.clone(),
                None => held(&full.lm_head),
            },
            total,
        };
        let tied = match (&copy, config.tie_word_embeddings) {
            (Some(r), _) => Some(r.clone()),
            (None, true) if part.embeddings && !part.head => Some(layout.wte.clone()),
            _ => None,
        };
        let arena_config = GPTConfig {
            n_layers: part.blocks.len(),
            vocab_size: if part.head { config.vocab_size } else { 0 },
            ..config.clone()
        };
        let mut params = alloc(&*dev, total, "allocate the parameters")?;
        write_on_host(&*dev, &mut params, |p| {
            init_tensors(&full.views, config.n_layers, seed, p, |v| {
                if v.name == "wte.weight" {
                    if let Some(r) = &copy {
                        return Some(r.clone());
                    }
                }
                inside(&v.range).then(|| shift(&v.range, lo))
            })
        })?;
        let scratch = dev.attention_scratch_len(config.max_position_embeddings);
        Ok(GptStage {
            attn_scratch: alloc(&*dev, scratch, "allocate the attention scratch")?,
            drop: DropKey {
                on: false,
                p: config.dropout,
                seed,
                rank: 0,
                step: 0,
            },
            rope: RopeTables::on(&config, &*dev)?,
            config,
            arena_config,
            part,
            grads: alloc(&*dev, total, "allocate the gradients")?,
            params,
            layout,
            global,
            whole_total: full.total,
            tied,
            dev,
            slots: Vec::new(),
            training: true,
            profile: Profile::default(),
        })
    }

    /// The whole model's configuration.
    pub fn config(&self) -> &GPTConfig {
        &self.config
    }
    /// Computes this stage's matrix products in `dtype` from now on, as
    /// [`GPT::set_precision`](crate::GPT::set_precision) does; returns the precision in effect.
    pub fn set_precision(&mut self, dtype: DType) -> Result<DType, GptError> {
        self.dev = cpu_with_precision(&*self.dev, dtype)?;
        Ok(self.dev.dtype())
    }

    /// The part of the model this stage holds.
    pub fn part(&self) -> &StagePart {
        &self.part
    }
    /// Named views of this stage's buffers, in buffer order (Hugging Face names as in the whole
    /// model; the tied head's copy of wte is named `wte.weight`).
    pub fn param_views(&self) -> &[ParamView] {
        &self.layout.views
    }
    /// The same tensors as [`param_views`](Self::param_views), with the ranges they have in the
    /// whole model's flat buffer.
    pub fn global_views(&self) -> &[ParamView] {
        &self.global
    }
    /// Number of parameters this stage holds.
    pub fn num_params(&self) -> usize {
        self.layout.total
    }
    /// Number of parameters of the whole model (the length of its flat buffer).
    pub fn whole_num_params(&self) -> usize {
        self.whole_total
    }
    /// The range of this stage's buffer holding one of the two uses of a tied wte (the
    /// embedding on a first stage without the head, the head's copy on a last stage without the
    /// embeddings); None otherwise. Before each optimizer step the gradients of these two
    /// ranges must be summed across the two stages.
    pub fn tied_range(&self) -> Option<Range<usize>> {
        self.tied.clone()
    }
    /// Whether this stage's wte is the head's copy (so the first stage owns the original).
    pub fn holds_tied_copy(&self) -> bool {
        self.tied.is_some() && !self.part.embeddings
    }
    /// The flat parameter buffer (host memory only, as [`GPT::params`](crate::GPT::params)).
    pub fn params(&self) -> &[f32] {
        host(&self.params, "params")
    }
    /// The flat parameter buffer, writable.
    pub fn params_mut(&mut self) -> &mut [f32] {
        host_mut(&mut self.params, "params")
    }
    /// The flat gradient buffer.
    pub fn grads(&self) -> &[f32] {
        host(&self.grads, "grads")
    }
    /// The flat gradient buffer, writable (summing the tied gradient, clipping).
    pub fn grads_mut(&mut self) -> &mut [f32] {
        host_mut(&mut self.grads, "grads")
    }
    /// Parameters and gradients at once (an optimizer step needs both).
    pub fn params_and_grads_mut(&mut self) -> (&mut [f32], &[f32]) {
        (
            host_mut(&mut self.params, "params"),
            host(&self.grads, "grads"),
        )
    }
    /// Copies this stage's tensors out of a whole model's flat parameter buffer.
    pub fn load_from_full(&mut self, full: &[f32]) -> Result<(), GptError> {
        let total = self.whole_total;
        if full.len() != total {
            return Err(GptError::Stage {
                blocks: self.part.blocks.clone(),
                reason: format!(
                    "whole-model buffer has {} floats, expected {total}",
                    full.len()
                ),
            });
        }
        let (views, global) = (&self.layout.views, &self.global);
        write_on_host(&*self.dev, &mut self.params, |p| {
            for (local, global) in views.iter().zip(global) {
                p[local.range.clone()].copy_from_slice(&full[global.range.clone()]);
            }
        })
    }
    /// Sets every gradient to zero (backward accumulates).
    pub fn zero_grad(&mut self) {
        let (dev, grads) = (&*self.dev, &mut self.grads);
        dev.install(&mut || dev.fill(grads.view_mut(), 0.0));
    }
    /// Floats of one activation tensor (B, T, C) passed between stages.
    pub fn activation_len(&self, b: usize, t: usize) -> usize {
        b * t * self.config.d_model
    }
    /// Training mode applies dropout (when the config's dropout is above 0); eval mode never.
    pub fn set_training(&mut self, training: bool) {
        self.training = training;
    }
    /// Keys the dropout masks of the next forward, as [`GPT::set_dropout_key`](crate::GPT);
    /// each forward remembers its key for its own backward.
    pub fn set_dropout_key(&mut self, seed: u64, rank: u64, step: u64) {
        self.drop = DropKey {
            on: false,
            p: self.config.dropout,
            seed,
            rank,
            step,
        };
    }
    /// Wall time spent per kernel since the last reset, in a fixed order.
    pub fn kernel_times(&self) -> Vec<(&'static str, Duration)> {
        KERNELS.iter().copied().zip(self.profile.0).collect()
    }

    fn bad(&self, reason: String) -> GptError {
        GptError::Stage {
            blocks: self.part.blocks.clone(),
            reason,
        }
    }

    /// Forward of one micro-batch into activation slot `slot` (any index; a slot holds one
    /// micro-batch from its forward to its backward). `input` is token ids on the first stage
    /// and the previous stage's output on the others; `attention_mask` (every stage) and
    /// `labels` (last stage) follow [`Forward`](crate::Forward). Returns the output
    /// activations, or on the last stage the mean loss.
    pub fn forward(
        &mut self,
        slot: usize,
        input: StageInput<'_>,
        attention_mask: Option<&[u8]>,
        labels: Option<Labels<'_>>,
        b: usize,
        t: usize,
    ) -> Result<StageOutput<'_>, GptError> {
        let c = self.config.d_model;
        let n = b * t;
        let ids = match (input, self.part.embeddings) {
            (StageInput::Tokens(ids), true) => Some(ids),
            (StageInput::Activations(x), false) => {
                if x.len() != n * c {
                    return Err(self.bad(format!(
                        "input activations have {} floats, expected batch {b} x seq {t} x d_model {c} = {}",
                        x.len(),
                        n * c
                    )));
                }
                None
            }
            (StageInput::Tokens(_), false) => {
                return Err(self.bad("token ids given to a stage without the embeddings".into()))
            }
            (StageInput::Activations(_), true) => {
                return Err(
                    self.bad("activations given to the first stage (it takes token ids)".into())
                )
            }
        };
        if labels.is_some() && !self.part.head {
            return Err(self.bad("labels given to a stage without the head".into()));
        }
        validate_batch(&self.config, ids, attention_mask, labels, b, t)?;
        if self.slots.len() <= slot {
            let drop = self.drop;
            self.slots.resize_with(slot + 1, || Slot {
                act_layout: None,
                arena: Buffer::default(),
                batch: Batch::default(),
                drop,
                pending: false,
            });
        }
        let nb = self.part.blocks.len();
        let first = self.part.blocks.start;
        let s = &mut self.slots[slot];
        // A stage holds a slot per micro-batch in flight: its logits stay in blocks above the
        // smaller limit rather than whole in every slot.
        let cols = logit_cols(
            n,
            self.arena_config.vocab_size,
            labels.is_some(),
            LOGITS_MAX_BYTES_CHECKPOINTED,
            false,
        );
        if s.act_layout
            .as_ref()
            .is_none_or(|al| al.n < n || al.logit_cols != cols)
        {
            s.arena = Buffer::default();
            let al = ActLayout::new(&self.arena_config, n, KEEP_MAX_BYTES, cols, false, NO_BF16);
            s.arena = alloc(&*self.dev, al.total, "allocate the activations")?;
            s.act_layout = Some(al);
        }
        s.batch
            .set(ids.unwrap_or_default(), attention_mask, None, labels, b, t);
        s.batch.upload(&*self.dev)?;
        s.drop = DropKey {
            on: self.training && self.config.dropout > 0.0,
            ..self.drop
        };
        s.pending = labels.is_some() || !self.part.head;
        let al = s.act_layout.as_ref().expect("allocated above");
        let mut a = al.carve(s.arena.view_mut());
        let (lay, p, dev) = (&self.layout, self.params.view(), &*self.dev);
        if let StageInput::Activations(x) = input {
            upload(dev, a.res.slice_mut(..n * c), x)?;
        }
        let (batch, drop, part) = (&s.batch, s.drop, &self.part);
        let (mut scratch, prof) = (self.attn_scratch.view_mut(), &mut self.profile);
        let (dims, rope) = (Dims::new(&self.config, b, t), self.rope.as_ref());
        let mut loss = None;
        dev.install(&mut || {
            let pass = &mut Pass {
                dev,
                rope,
                dims,
                batch,
                drop,
                scratch: scratch.reborrow(),
                prof,
                accumulate_weight_grads: true,
            };
            if part.embeddings {
                embed_forward(pass, lay, p, &mut a);
            }
            for (l, bl) in lay.blocks.iter().enumerate() {
                let at = BlockAt {
                    local: l,
                    global: first + l,
                    layout: bl,
                };
                block_forward(pass, at, p, &mut a);
            }
            if part.head {
                loss = head_forward(pass, lay, p, &mut a);
            }
        });
        if self.part.head {
            return Ok(StageOutput::Loss(loss));
        }
        let res = host(&s.arena, "activations");
        Ok(StageOutput::Activations(&res[nb * n * c..(nb + 1) * n * c]))
    }

    /// Backward of the micro-batch in `slot`, accumulating into the gradient buffer.
    /// `grad_output` is d(this stage's output) from the next stage, or None on the last stage
    /// (whose forward must have had labels). Returns d(this stage's input) for the previous
    /// stage (empty on the first stage).
    pub fn backward(
        &mut self,
        slot: usize,
        grad_output: Option<&[f32]>,
    ) -> Result<&[f32], GptError> {
        let c = self.config.d_model;
        let pending = self.slots.get(slot).is_some_and(|s| s.pending);
        if !pending {
            return Err(if self.part.head {
                GptError::NoLoss
            } else {
                self.bad(format!(
                    "backward of slot {slot}, which has no forward pending"
                ))
            });
        }
        let (b, t) = (self.slots[slot].batch.b, self.slots[slot].batch.t);
        let nc = b * t * c;
        match (grad_output, self.part.head) {
            (Some(d), false) if d.len() != nc => {
                return Err(self.bad(format!(
                "output gradient has {} floats, expected batch {b} x seq {t} x d_model {c} = {nc}",
                d.len()
            )))
            }
            (Some(_), false) | (None, true) => {}
            (None, false) => {
                return Err(self.bad("backward needs the next stage's output gradient".into()))
            }
            (Some(_), true) => {
                return Err(self.bad(
                    "the last stage's backward starts from its loss, not an output gradient".into(),
                ))
            }
        }
        let first = self.part.blocks.start;
        let s = &mut self.slots[slot];
        s.pending = false;
        let al = s.act_layout.as_ref().expect("a forward allocated it");
        let mut a = al.carve(s.arena.view_mut());
        let (lay, p, dev) = (&self.layout, self.params.view(), &*self.dev);
        if let Some(d) = grad_output {
            upload(dev, a.dres.slice_mut(..nc), d)?;
        }
        let (batch, drop, part) = (&s.batch, s.drop, &self.part);
        let (mut scratch, prof) = (self.attn_scratch.view_mut(), &mut self.profile);
        let (dims, rope) = (Dims::new(&self.config, b, t), self.rope.as_ref());
        let mut grads = Some(self.grads.view_mut());
        dev.install(&mut || {
            let grads = grads.take().expect("runs once");
            let pass = &mut Pass {
                dev,
                rope,
                dims,
                batch,
                drop,
                scratch: scratch.reborrow(),
                prof,
                accumulate_weight_grads: true,
            };
            let (mut rest, top) = if part.head {
                grads.split_at_mut(lay.ln_f_w.start)
            } else {
                let len = grads.len();
                grads.split_at_mut(len)
            };
            if part.head {
                let (mut lnf_g, head_g) = top.split_at_mut(lay.ln_f_b.end - lay.ln_f_w.start);
                // Tied on a stage with the embeddings: the head's gradient is wte's.
                let head = if head_g.is_empty() {
                    rest.slice_mut(lay.wte.clone())
                } else {
                    head_g
                };
                let (ln_f_w, ln_f_b) = wb(&mut lnf_g, lay.ln_f_w.start, &lay.ln_f_w, &lay.ln_f_b);
                let grads = HeadGrads {
                    head,
                    ln_f_w,
                    ln_f_b,
                };
                head_backward(pass, lay, p, grads, &mut a, None);
            }
            for (l, bl) in lay.blocks.iter().enumerate().rev() {
                let at = BlockAt {
                    local: l,
                    global: first + l,
                    layout: bl,
                };
                let g = rest.slice_mut(bl.all.clone());
                block_backward(pass, at, p, g, &mut a, None);
            }
            if part.embeddings {
                let (dwte, dwpe) = rest.split_at_mut(lay.wpe.start);
                embed_backward(
                    pass,
                    dwte.into_slice(lay.wte.clone()),
                    dwpe.into_slice(..lay.wpe.len()),
                    &mut a,
                );
            }
        });
        if self.part.embeddings {
            return Ok(&[]);
        }
        let dres = al.ranges[ACT_DRES].start;
        Ok(&host(&s.arena, "activations")[dres..dres + nc])
    }
}

/// Copies a stage's input (activations or their gradient) into its arena.
fn upload(
    dev: &dyn Backend,
    dst: cohort_engine::ViewMut<f32>,
    src: &[f32],
) -> Result<(), GptError> {
    dev.upload(dst, src).map_err(|e| GptError::Engine {
        op: "copy a stage's input to its backend",
        reason: e.to_string(),
    })
}

fn shift_block(b: &BlockLayout, off: usize) -> BlockLayout {
    BlockLayout {
        ln_1_w: shift(&b.ln_1_w, off),
        ln_1_b: shift(&b.ln_1_b, off),
        attn_w: shift(&b.attn_w, off),
        attn_b: shift(&b.attn_b, off),
        proj_w: shift(&b.proj_w, off),
        proj_b: shift(&b.proj_b, off),
        ln_2_w: shift(&b.ln_2_w, off),
        ln_2_b: shift(&b.ln_2_b, off),
        fc_w: shift(&b.fc_w, off),
        fc_b: shift(&b.fc_b, off),
        fcproj_w: shift(&b.fcproj_w, off),
        fcproj_b: shift(&b.fcproj_b, off),
        all: shift(&b.all, off),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Backward, Forward, GPT};
    use cohort_engine::cpu::Cpu;

    fn tiny(bias: bool, tied: bool, dropout: f32) -> GPTConfig {
        GPTConfig {
            vocab_size: 11,
            max_position_embeddings: 8,
            n_layers: 3,
            n_heads: 2,
            d_model: 8,
            d_ff: 12,
            dropout,
            bias,
            tie_word_embeddings: tied,
            ..GPTConfig::default()
        }
    }

    fn cpu() -> Box<dyn Backend> {
        Box::new(Cpu::new(2).unwrap())
    }

    fn stages(cfg: &GPTConfig, n: usize) -> Vec<GptStage> {
        StagePart::split(cfg.n_layers, n)
            .unwrap()
            .into_iter()
            .map(|part| GptStage::with_backend(cfg.clone(), 7, part, cpu()).unwrap())
            .collect()
    }

    /// Micro-batch `k` (B = 2, T = 7): padding in both rows, some labels -100.
    fn micro_batch(k: u32) -> (Vec<u32>, Vec<u8>, Vec<i32>) {
        let ids: Vec<u32> = (0..14).map(|i| (i * 7 + 3 * k) % 11).collect();
        let mask = vec![1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1];
        let mut labels: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
        labels[3 + k as usize] = -100;
        (ids, mask, labels)
    }

    #[test]
    fn split_is_contiguous_and_balanced() {
        let parts = StagePart::split(6, 4).unwrap();
        let blocks: Vec<_> = parts.iter().map(|p| p.blocks.clone()).collect();
        assert_eq!(blocks, [0..2, 2..4, 4..5, 5..6]);
        assert!(parts[0].embeddings && !parts[0].head);
        assert!(parts[3].head && !parts[3].embeddings);
        assert!(!parts[1].embeddings && !parts[1].head);
        let one = StagePart::split(6, 1).unwrap();
        assert!(one[0].embeddings && one[0].head && one[0].blocks == (0..6));
        assert!(StagePart::split(6, 0).is_err());
        let err = StagePart::split(6, 7).unwrap_err().to_string();
        assert!(err.contains("6 blocks into 7 stages"), "{err}");
    }

    #[test]
    fn stages_start_with_the_whole_models_values() {
        for (bias, tied) in [(true, true), (false, false), (true, false)] {
            let cfg = tiny(bias, tied, 0.0);
            let full = GPT::with_backend(cfg.clone(), 7, cpu()).unwrap();
            let mut covered = vec![0usize; full.num_params()];
            for st in stages(&cfg, 3) {
                assert_eq!(st.param_views().len(), st.global_views().len());
                for (l, g) in st.param_views().iter().zip(st.global_views()) {
                    assert_eq!(l.name, g.name);
                    assert_eq!(st.params()[l.range.clone()], full.params()[g.range.clone()]);
                    covered[g.range.clone()].iter_mut().for_each(|c| *c += 1);
                }
                assert_eq!(
                    st.tied_range().is_some(),
                    tied && st.part().blocks != (1..2)
                );
            }
            // Every tensor lives on exactly one stage, except a tied wte, which the last
            // stage copies.
            let wte = full.param_views()[0].range.clone();
            for (i, &c) in covered.iter().enumerate() {
                let want = if tied && wte.contains(&i) { 2 } else { 1 };
                assert_eq!(c, want, "float {i}");
            }
        }
    }

    /// Two micro-batches through the stages GPipe-style (both forwards, then both backwards)
    /// against the whole model running them one after the other: the same losses and, except
    /// for the tied wte, the same gradient bits (every kernel runs on the same inputs in the same
    /// order). A tied wte's gradient is the sum of the first stage's embedding part and the last
    /// stage's head part, added in another order than the whole model's: equal to f32 rounding.
    fn composition_matches_whole_model(cfg: GPTConfig, n_stages: usize) {
        let mut full = GPT::with_backend(cfg.clone(), 7, cpu()).unwrap();
        let mut st = stages(&cfg, n_stages);
        full.zero_grad();
        let mut want_losses = vec![];
        for k in 0..2 {
            let (ids, mask, labels) = micro_batch(k);
            full.set_dropout_key(5, 0, k as u64);
            want_losses.push(
                full.forward(
                    Forward::new(&ids, 2, 7)
                        .attention_mask(Some(&mask))
                        .labels(Labels::Aligned(&labels)),
                )
                .unwrap(),
            );
            full.backward(Backward::new()).unwrap();
        }
        let mut losses = vec![];
        for k in 0..2 {
            let (ids, mask, labels) = micro_batch(k);
            let mut x: Vec<f32> = vec![];
            for s in st.iter_mut() {
                s.set_dropout_key(5, 0, k as u64);
                let input = if s.part().embeddings {
                    StageInput::Tokens(&ids)
                } else {
                    StageInput::Activations(&x)
                };
                let lab = s.part().head.then_some(Labels::Aligned(&labels[..]));
                match s
                    .forward(k as usize, input, Some(&mask), lab, 2, 7)
                    .unwrap()
                {
                    StageOutput::Activations(out) => x = out.to_vec(),
                    StageOutput::Loss(l) => losses.push(l),
                }
            }
        }
        assert_eq!(losses, want_losses);
        for k in 0..2 {
            let mut d: Option<Vec<f32>> = None;
            for s in st.iter_mut().rev() {
                d = Some(s.backward(k, d.as_deref()).unwrap().to_vec());
            }
            assert!(
                d.unwrap().is_empty(),
                "the first stage has no input gradient"
            );
        }
        let mut got = vec![0f32; full.num_params()];
        for s in &st {
            for (l, g) in s.param_views().iter().zip(s.global_views()) {
                let dst = &mut got[g.range.clone()];
                dst.iter_mut()
                    .zip(&s.grads()[l.range.clone()])
                    .for_each(|(d, &x)| *d += x);
            }
        }
        let want = full.grads().to_vec();
        for v in full.param_views() {
            let (a, b) = (&got[v.range.clone()], &want[v.range.clone()]);
            if cfg.tie_word_embeddings && n_stages > 1 && v.name == "wte.weight" {
                let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
                for (x, y) in a.iter().zip(b) {
                    assert!((x - y).abs() <= 1e-6 * scale, "wte: {x} vs {y}");
                }
            } else {
                assert_eq!(a, b, "{} differs", v.name);
            }
        }
        assert!(want.iter().any(|&g| g != 0.0));
    }

    #[test]
    fn stages_compose_to_the_whole_model_tied_with_bias_and_dropout() {
        for n in 1..=3 {
            composition_matches_whole_model(tiny(true, true, 0.2), n);
        }
    }

    #[test]
    fn stages_compose_to_the_whole_model_untied_without_bias() {
        for n in 1..=3 {
            composition_matches_whole_model(tiny(false, false, 0.0), n);
        }
    }

    #[test]
    fn stages_compose_to_the_whole_model_as_a_llama() {
        // RoPE, RMSNorm, SwiGLU, 2 heads over 1 key/value head, QKV bias; tied and untied
        for tied in [true, false] {
            let cfg = GPTConfig {
                qkv_bias: Some(true),
                ..GPTConfig::llama_like(tiny(false, tied, 0.0))
            };
            composition_matches_whole_model(cfg, 2);
        }
    }

    #[test]
    fn wrong_buffers_are_clear_errors() {
        let cfg = tiny(true, true, 0.0);
        let mut st = stages(&cfg, 2);
        let (ids, _, labels) = micro_batch(0);
        let err = |r: Result<StageOutput, GptError>| r.unwrap_err().to_string();
        let x = vec![0f32; 14 * 8];
        assert!(
            err(st[0].forward(0, StageInput::Activations(&x), None, None, 2, 7))
                .contains("takes token ids")
        );
        assert!(
            err(st[1].forward(0, StageInput::Tokens(&ids), None, None, 2, 7))
                .contains("without the embeddings")
        );
        assert!(
            err(st[1].forward(0, StageInput::Activations(&x[1..]), None, None, 2, 7))
                .contains("input activations have 111 floats")
        );
        assert!(err(st[0].forward(
            0,
            StageInput::Tokens(&ids),
            None,
            Some(Labels::Aligned(&labels)),
            2,
            7
        ))
        .contains("labels given to a stage without the head"));
        let e = st[0].backward(3, Some(&x)).unwrap_err().to_string();
        assert!(e.contains("no forward pending"), "{e}");
        st[0]
            .forward(0, StageInput::Tokens(&ids), None, None, 2, 7)
            .unwrap();
        let e = st[0].backward(0, Some(&x[..5])).unwrap_err().to_string();
        assert!(e.contains("output gradient has 5 floats"), "{e}");
        assert!(st[0].backward(0, None).is_err());
        st[0].backward(0, Some(&x)).unwrap();
        assert!(
            st[0].backward(0, Some(&x)).is_err(),
            "a slot's backward runs once"
        );
        // The last stage: no labels, no backward.
        st[1]
            .forward(0, StageInput::Activations(&x), None, None, 2, 7)
            .unwrap();
        assert!(matches!(st[1].backward(0, None), Err(GptError::NoLoss)));
    }
}

//! The activation arena: one buffer carved into every activation forward keeps for backward,
//! sized for N = B*T tokens, plus the batch forward saw.
//!
//! This module only computes offsets and hands out disjoint slices; it never computes.

use super::*;

/// Offsets of every activation inside the arena; all sized for `n` tokens.
pub(crate) struct ActLayout {
    pub(crate) n: usize,
    pub(super) keep: bool,
    /// Products in bf16: unless the GELU (SwiGLU) outputs are kept in f32 (`keep`), they are
    /// kept in bf16 (`gelu16`), the LayerNorms write bf16 (`ln16`), and so may the qkv
    /// product (`qkv16`).
    pub(crate) bf16: bool,
    /// The LayerNorm (RMSNorm) outputs in bf16, `s_ln` holding bf16 pairs: bf16 products and
    /// not `keep`, as `gelu16`.
    pub(crate) ln16: bool,
    /// The qkv rows in bf16, `qkv` holding bf16 pairs (half the floats): under `ln16`, where
    /// attention is their only reader and rounds them to bf16 anyway (no rotary embedding,
    /// which turns q and k in f32 in place), on a backend with the kernels (see
    /// [`QKV16_KERNELS`]). The qkv product sums into `s_big` (free in forward under `ln16`) and
    /// rounds each strip into `qkv`.
    pub(crate) qkv16: bool,
    /// Activation checkpointing: the per-layer buffers hold one layer, and backward recomputes
    /// each block's forward from its input (`res`, kept for every layer) before its backward.
    pub(crate) checkpoint: bool,
    /// Columns of logits (and of their gradient) held at once: V, or a block of the vocabulary
    /// when the forward has labels and the whole (N, V) matrix would be large (see
    /// [`logit_cols`]).
    pub(crate) logit_cols: usize,
    pub(crate) ranges: [Range<usize>; ACT_BUFFERS],
    pub(crate) total: usize,
}

/// Buffers of the arena, in carve order (see `ActLayout::new` for their shapes).
pub(super) const ACT_BUFFERS: usize = 23;
/// Where the logits are in the carve order (read after a forward).
pub(crate) const ACT_LOGITS: usize = 12;
/// Where qkv is in the carve order (its size tells its precision).
#[cfg(test)]
pub(crate) const ACT_QKV: usize = 2;
/// Where the LayerNorm outputs are in the carve order (their size tells their precision).
#[cfg(test)]
pub(crate) const ACT_S_LN: usize = 15;
/// Where d(residual) is in the carve order (a stage's input gradient, read after a backward).
pub(crate) const ACT_DRES: usize = 20;

/// The arena split into its buffers; per-layer buffers hold all L layers back to back.
pub(crate) struct Acts<'a> {
    pub(crate) res: ViewMut<'a, f32>, // (L+1, N, C) block inputs; res[L] feeds ln_f
    pub(super) res_mid: ViewMut<'a, f32>, // (L, N, C) residual after attention
    pub(super) qkv: ViewMut<'a, f32>, // (L, N, 3C), (L, N, (NH+2·NKV)·HS) with grouped key/value heads; q, k rotated under RoPE; (L, ⌈N·W/2⌉) floats of bf16 pairs under qkv16 (see [`qkv_out`])
    pub(super) fch: ViewMut<'a, f32>, // (L, N, F) MLP pre-activation ((L, N, 2F) under SwiGLU, interleaved); the activation's derivatives at it when gelu16 is kept
    pub(super) ln1_mean: ViewMut<'a, f32>, // (L, N)
    pub(super) ln1_rstd: ViewMut<'a, f32>, // (L, N)
    pub(super) ln2_mean: ViewMut<'a, f32>, // (L, N)
    pub(super) ln2_rstd: ViewMut<'a, f32>, // (L, N)
    pub(super) att_lse: ViewMut<'a, f32>, // (L, B, NH, T)
    pub(super) lnf_out: ViewMut<'a, f32>, // (N, C)
    pub(super) lnf_mean: ViewMut<'a, f32>, // (N)
    pub(super) lnf_rstd: ViewMut<'a, f32>, // (N)
    pub(super) logits: ViewMut<'a, f32>, // (N, V'), V' = logit_cols: V, or a block of it
    pub(super) losses: ViewMut<'a, f32>, // (N)
    pub(super) ce_lse: ViewMut<'a, f32>, // (N)
    pub(super) s_ln: ViewMut<'a, f32>, // (2L, N, C) kept LayerNorm outputs, or (N, C) scratch; ⌈N·C/2⌉ floats of bf16 pairs under ln16 (see [`ln_out`])
    pub(super) s_atty: ViewMut<'a, f32>, // (L, N, C) kept attention outputs, or (N, C) scratch
    pub(super) s_big: ViewMut<'a, f32>, // (N, max(F, 3C)) scratch: GELU output (or, under qkv16, the qkv product's f32 sums), dG, dqkv; (N, max(3F, 3C)) under SwiGLU (d(product) beside the SwiGLU output or its gradient)
    pub(super) s_dl: ViewMut<'a, f32>, // (N, C) scratch: gradient of a LayerNorm output / attention out
    pub(super) s_drop: ViewMut<'a, f32>, // (N, C) scratch: dropout backward (empty without dropout)
    pub(crate) dres: ViewMut<'a, f32>, // (N, C) gradient of the residual stream
    pub(super) gelu: ViewMut<'a, f32>, // (L, N, F) kept GELU (SwiGLU) outputs (empty unless kept)
    /// (L, ⌈N·F/2⌉) GELU (SwiGLU) outputs kept in bf16, two to a float (empty unless bf16 and
    /// not `keep`); see [`bf16_layer`].
    pub(super) gelu16: ViewMut<'a, f32>,
    /// Whether the LayerNorm, attention and GELU outputs are kept per layer.
    pub(super) keep: bool,
    /// Whether the LayerNorm outputs are in bf16 (see [`ActLayout::ln16`]).
    pub(super) ln16: bool,
    /// Whether the qkv rows are in bf16 (see [`ActLayout::qkv16`]).
    pub(super) qkv16: bool,
    /// Columns of `logits` (which backward turns into their gradient in place).
    pub(super) logit_cols: usize,
    /// Whether the per-layer buffers hold one layer (activation checkpointing).
    pub(crate) checkpoint: bool,
}

/// Above this many bytes of logits, a forward with labels works on the head in blocks of the
/// vocabulary: it computes each block's logits and folds them into each row's log-sum-exp
/// (and the target's logit), keeping nothing else; backward recomputes each block's logits
/// (one more head product) and takes its gradients at once. Below it the whole matrix is kept
/// and backward turns it into its gradient in place, computing nothing twice: config G's
/// 1024 x 50304 logits are 206 MB, against 16 MB in blocks, and the recomputed product was
/// 9% of its step (a product the FLOP count of MFU does not count). Blocks of columns rather
/// than of rows, so that each block of the head's weight is packed for the product once.
pub(crate) const LOGITS_MAX_BYTES: usize = 512 << 20;
/// The limit under activation checkpointing, which asks for memory before speed: config G's
/// logits stay in blocks there.
pub(crate) const LOGITS_MAX_BYTES_CHECKPOINTED: usize = 64 << 20;
/// Bytes of logits per block.
const LOGITS_BLOCK_BYTES: usize = 16 << 20;
/// Bytes of logits per block under activation checkpointing: config G's 1,024 rows give blocks
/// of 1,024 columns, still wide enough for the head's product to run at its full rate, and
/// 12 MB less of the rank's peak (ZeRO-3 with checkpointing holds 0.6x DDP's memory or less
/// only with them).
const LOGITS_BLOCK_BYTES_CHECKPOINTED: usize = 4 << 20;

/// Columns of logits a forward over `n` positions and `v` tokens holds: all of them, or a
/// block when it has labels (then nothing reads its logits but the loss) and they exceed
/// `max_bytes` (at most [`LOGITS_MAX_BYTES_CHECKPOINTED`] under activation checkpointing).
pub(crate) fn logit_cols(
    n: usize,
    v: usize,
    labels: bool,
    max_bytes: usize,
    checkpoint: bool,
) -> usize {
    let (max_bytes, block_bytes) = if checkpoint {
        (
            max_bytes.min(LOGITS_MAX_BYTES_CHECKPOINTED),
            LOGITS_BLOCK_BYTES_CHECKPOINTED,
        )
    } else {
        (max_bytes, LOGITS_BLOCK_BYTES)
    };
    if labels && n * v * 4 > max_bytes {
        (block_bytes.min(max_bytes / 2) / (4 * n.max(1))).clamp(1, v)
    } else {
        v
    }
}

/// Below this many bytes for the kept outputs, forward keeps the LayerNorm, attention and GELU
/// outputs of every layer and backward reads them instead of recomputing: config A needs 11 MB
/// and saves ~1.5 ms of its ~32 ms step; config B would need 132 MB, which its 400 MB budget
/// cannot spare.
pub(crate) const KEEP_MAX_BYTES: usize = 32 << 20;

impl Acts<'_> {
    /// Slot of layer `l` in the per-layer buffers (qkv, MLP pre-activation, residual after
    /// attention, LayerNorm statistics, attention log-sum-exp).
    pub(super) fn layer_slot(&self, l: usize) -> usize {
        if self.checkpoint {
            0
        } else {
            l
        }
    }
    /// Slot of the LayerNorm output (`which` 0 = ln_1, 1 = ln_2) of layer `l` in `s_ln`.
    pub(super) fn ln_slot(&self, l: usize, which: usize) -> usize {
        if self.keep {
            2 * l + which
        } else {
            0
        }
    }
    /// Slot of layer `l`'s attention output in `s_atty`.
    pub(super) fn atty_slot(&self, l: usize) -> usize {
        if self.keep {
            l
        } else {
            0
        }
    }
}

impl ActLayout {
    /// The layout for `n` positions; `logit_cols` from [`logit_cols`]; with `checkpoint` the
    /// per-layer buffers hold one layer (see [`ActLayout::checkpoint`]); `qkv16_kernels`: the
    /// backend has [`QKV16_KERNELS`] (see [`ActLayout::qkv16`]).
    pub(crate) fn new(
        cfg: &GPTConfig,
        n: usize,
        keep_max_bytes: usize,
        logit_cols: usize,
        checkpoint: bool,
        (bf16, qkv16_kernels): (bool, bool),
    ) -> ActLayout {
        let (layers, c, f, nh) = (cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.n_heads);
        let swiglu = cfg.mlp == crate::Mlp::SwiGlu;
        // The MLP's first product: (N, F), or gate and up (N, 2F); its backward scratch holds
        // d(output) and the recomputed SwiGLU output below it.
        let (fx, big_f) = if swiglu { (2 * f, 3 * f) } else { (f, f) };
        // Layers the per-layer buffers hold.
        let l = if checkpoint { 1 } else { layers };
        let drop = if cfg.dropout > 0.0 { n * c } else { 0 };
        let keep = !checkpoint && l * n * (f + 3 * c) * 4 <= keep_max_bytes;
        // Under bf16 products the LayerNorm outputs are read only by products (forward's and
        // the weight gradients'), which round them to bf16 as they pack them: written in bf16
        // they are the same bits at half the bytes, and half the scratch.
        let ln16 = bf16 && !keep;
        let qkv16 = ln16 && qkv16_kernels && cfg.positions == crate::Positions::Learned;
        let kept = |per_layer: usize| if keep { per_layer } else { 0 };
        let qkv = n * cfg.qkv_width();
        let sizes = [
            (layers + 1) * n * c,
            l * n * c,
            if qkv16 { l * qkv.div_ceil(2) } else { l * qkv },
            l * n * fx,
            l * n,
            l * n,
            l * n,
            l * n,
            l * n * nh,
            n * c,
            n,
            n,
            n * logit_cols,
            n,
            n,
            match (keep, ln16) {
                (true, _) => 2 * l * n * c,
                (false, true) => (n * c).div_ceil(2),
                (false, false) => n * c,
            },
            if keep { l * n * c } else { n * c },
            n * big_f.max(3 * c),
            n * c,
            drop,
            n * c,
            kept(l * n * f),
            // Under bf16 products, the MLP's GELU (SwiGLU) outputs are kept in bf16 rather
            // than recomputed in backward: the products that read them round them to bf16
            // anyway, so this costs half of what keeping them in f32 would, changes no bit of
            // the forward, and saves an activation pass and half the bytes of the next
            // product's reads.
            if ln16 { l * (n * f).div_ceil(2) } else { 0 },
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
            bf16,
            ln16,
            qkv16,
            checkpoint,
            logit_cols,
            ranges,
            total: next,
        }
    }

    pub(crate) fn carve<'a>(&self, arena: ViewMut<'a, f32>) -> Acts<'a> {
        let mut rest = arena;
        let parts: [ViewMut<'a, f32>; ACT_BUFFERS] = std::array::from_fn(|i| {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(self.ranges[i].len());
            rest = tail;
            head
        });
        let [res, res_mid, qkv, fch, ln1_mean, ln1_rstd, ln2_mean, ln2_rstd, att_lse, lnf_out, lnf_mean, lnf_rstd, logits, losses, ce_lse, s_ln, s_atty, s_big, s_dl, s_drop, dres, gelu, gelu16] =
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
            gelu,
            gelu16,
            keep: self.keep,
            ln16: self.ln16,
            qkv16: self.qkv16,
            logit_cols: self.logit_cols,
            checkpoint: self.checkpoint,
        }
    }
}

/// Layer slot `l` of a buffer of bf16 values (`gelu16`, `s_ln` under ln16; each slot
/// ⌈len/2⌉ floats) as `len` bf16 values (their bits).
pub(super) fn bf16_layer<'b>(
    buf: &'b mut ViewMut<'_, f32>,
    l: usize,
    len: usize,
) -> ViewMut<'b, u16> {
    let per = len.div_ceil(2);
    let slot = buf.slice_mut(l * per..(l + 1) * per);
    slot.cast::<u16>().into_slice(..len)
}

/// Slot `slot` of `s_ln` (see [`Acts::ln_slot`]) as a LayerNorm output of `len` values: bf16
/// under `ln16`, else f32.
pub(super) fn ln_out<'b>(
    s_ln: &'b mut ViewMut<'_, f32>,
    slot: usize,
    len: usize,
    ln16: bool,
) -> NormOut<'b> {
    if ln16 {
        NormOut::Bf16(bf16_layer(s_ln, slot, len))
    } else {
        NormOut::F32(layer_mut(s_ln, slot, len))
    }
}

/// `ActLayout::new`'s (bf16, qkv16 kernels) for f32 activations (a pipeline stage's).
pub(crate) const NO_BF16: (bool, bool) = (false, false);

/// The kernels a bf16 qkv buffer needs: optional (a backend without them keeps qkv in f32).
pub(crate) const QKV16_KERNELS: [&str; 3] = [
    "matmul_forward_bf16_out",
    "attention_forward_bf16_qkv",
    "attention_backward_bf16_qkv",
];

/// Slot `l` of `qkv` as the qkv product's output of `len` values: bf16 under `qkv16`, the
/// product summing into `sums` (`s_big`, which the forward leaves free then), else f32.
pub(super) fn qkv_out<'b>(
    qkv: &'b mut ViewMut<'_, f32>,
    sums: Option<ViewMut<'b, f32>>,
    l: usize,
    len: usize,
    qkv16: bool,
) -> QkvOut<'b> {
    if qkv16 {
        let sums = sums.expect("s_big is free in a forward that keeps qkv in bf16");
        QkvOut::Bf16 {
            qkv: bf16_layer(qkv, l, len),
            sums: sums.into_slice(..len),
        }
    } else {
        QkvOut::F32(layer_mut(qkv, l, len))
    }
}

/// Slot `l` of `qkv` as attention's backward reads its `len` values (see [`qkv_out`]).
pub(super) fn qkv_rows<'b>(
    qkv: &'b mut ViewMut<'_, f32>,
    l: usize,
    len: usize,
    qkv16: bool,
) -> QkvIn<'b> {
    if qkv16 {
        QkvIn::Bf16(bf16_layer(qkv, l, len).into())
    } else {
        QkvIn::F32(layer(qkv, l, len))
    }
}

/// What the last forward saw, kept for backward (buffers reused across steps).
#[derive(Default)]
pub(crate) struct Batch {
    pub(crate) b: usize,
    pub(crate) t: usize,
    pub(crate) ids: Vec<u32>,
    /// Each row's position in its sequence (row mod T, or from its segment's start), for
    /// rotary embeddings.
    pub(crate) pos: Vec<u32>,
    pub(crate) mask: Vec<u8>,
    pub(crate) has_mask: bool,
    /// Segment ids (B, T) of packed rows; empty when each row is one sequence.
    pub(crate) segments: Vec<u32>,
    /// Per position: the id it must predict, or -1 when not counted.
    pub(crate) targets: Vec<i32>,
    /// Counted positions; None when the forward had no labels.
    pub(crate) counted: Option<usize>,
    /// The vectors above in a device's memory, for a backend that cannot read the host's
    /// (None on the CPU, whose kernels read the vectors in place).
    device: Option<DeviceInputs>,
}

/// A batch's inputs in a device's memory: ids, positions, targets and segment ids (one float
/// each), then the mask (four bytes to a float); `at` says where each is, in floats.
struct DeviceInputs {
    buf: Buffer,
    at: [Range<usize>; 5],
}

impl Batch {
    /// Input `i` (0 ids, 1 positions, 2 targets, 3 segments, 4 mask) in the device's copy, if
    /// there is one.
    fn on_device(&self, i: usize) -> Option<View<'_, f32>> {
        self.device
            .as_ref()
            .map(|d| d.buf.view().slice(d.at[i].clone()))
    }
    /// The token ids (empty on a stage fed activations).
    pub(crate) fn ids(&self) -> View<'_, u32> {
        self.on_device(0)
            .map_or_else(|| View::from(&self.ids[..]), View::cast)
    }
    /// The token ids on the host.
    pub(crate) fn host_ids(&self) -> &[u32] {
        &self.ids
    }
    /// Each row's position in its sequence.
    pub(crate) fn pos(&self) -> View<'_, u32> {
        self.on_device(1)
            .map_or_else(|| View::from(&self.pos[..]), View::cast)
    }
    /// The targets (empty without labels).
    pub(crate) fn targets(&self) -> View<'_, i32> {
        self.on_device(2)
            .map_or_else(|| View::from(&self.targets[..]), View::cast)
    }
    /// The segment ids of packed rows, for the kernels (None when each row is one sequence).
    pub(crate) fn segments(&self) -> Option<View<'_, u32>> {
        (!self.segments.is_empty()).then(|| {
            self.on_device(3)
                .map_or_else(|| View::from(&self.segments[..]), View::cast)
        })
    }
    /// The segment ids of packed rows on the host (where the passes find each sequence's rows).
    pub(crate) fn segment_ids(&self) -> Option<&[u32]> {
        (!self.segments.is_empty()).then_some(&self.segments[..])
    }
    /// The padding mask (None when every position is a token).
    pub(crate) fn mask(&self) -> Option<View<'_, u8>> {
        let len = self.mask.len();
        self.has_mask.then(|| match self.on_device(4) {
            Some(m) => m.cast::<u8>().slice(..len),
            None => View::from(&self.mask[..]),
        })
    }

    /// Copies the batch [`Batch::set`] recorded into `dev`'s memory, where the backend's
    /// kernels read it; nothing on the CPU.
    pub(crate) fn upload(&mut self, dev: &dyn Backend) -> Result<(), GptError> {
        if dev.device() == Device::Cpu {
            self.device = None;
            return Ok(());
        }
        let lens = [
            self.ids.len(),
            self.pos.len(),
            self.targets.len(),
            self.segments.len(),
            self.mask.len().div_ceil(4),
        ];
        let mut next = 0;
        let at = lens.map(|len| {
            next += len;
            next - len..next
        });
        if self.device.as_ref().is_none_or(|d| d.buf.len() < next) {
            self.device = None;
            let buf = alloc(dev, next, "allocate the batch's inputs")?;
            self.device = Some(DeviceInputs {
                buf,
                at: at.clone(),
            });
        }
        let d = self.device.as_mut().expect("allocated above");
        d.at = at;
        let mut v = d.buf.view_mut();
        let err = |e: cohort_engine::EngineError| GptError::Engine {
            op: "copy the batch to the device",
            reason: e.to_string(),
        };
        dev.upload(v.slice_mut(d.at[0].clone()).cast(), &self.ids)
            .map_err(err)?;
        dev.upload(v.slice_mut(d.at[1].clone()).cast(), &self.pos)
            .map_err(err)?;
        dev.upload(v.slice_mut(d.at[2].clone()).cast(), &self.targets)
            .map_err(err)?;
        dev.upload(v.slice_mut(d.at[3].clone()).cast(), &self.segments)
            .map_err(err)?;
        let mask = v.slice_mut(d.at[4].clone()).cast::<u8>();
        dev.upload(mask.into_slice(..self.mask.len()), &self.mask)
            .map_err(err)
    }

    /// Records a validated batch; the targets follow the label shift and masking rules of
    /// [`Labels`]. `ids` may be empty (a pipeline stage fed activations).
    pub(crate) fn set(
        &mut self,
        ids: &[u32],
        attention_mask: Option<&[u8]>,
        segments: Option<&[u32]>,
        labels: Option<Labels<'_>>,
        b: usize,
        t: usize,
    ) {
        let n = b * t;
        self.b = b;
        self.t = t;
        self.ids.clear();
        self.ids.extend_from_slice(ids);
        self.pos.clear();
        self.segments.clear();
        // Whether position i starts a sequence (a row's start, or a new segment id).
        let starts = |i: usize| i.is_multiple_of(t) || segments.is_some_and(|s| s[i] != s[i - 1]);
        let mut p = 0;
        self.pos.extend((0..n).map(|i| {
            p = if starts(i) { 0 } else { p + 1 };
            p
        }));
        self.segments
            .extend_from_slice(segments.unwrap_or_default());
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
            self.targets.extend((0..n).map(|i| match labels {
                Labels::Aligned(labels) => {
                    let next = i + 1;
                    if i % t + 1 < t
                        && !starts(next)
                        && labels[next] != -100
                        && real(i)
                        && real(next)
                    {
                        labels[next]
                    } else {
                        -1
                    }
                }
                Labels::Next(targets) => {
                    if targets[i] != -100 && real(i) {
                        targets[i]
                    } else {
                        -1
                    }
                }
            }));
            self.counted = Some(self.targets.iter().filter(|&&y| y >= 0).count());
        }
    }
}

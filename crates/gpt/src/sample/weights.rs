//! The weights a decode reads, in the format it reads them in ([`WeightFormat`]): the model's
//! own f32 parameters, or a copy of its matrices in bf16 or 8-bit blocks ([`DecodeWeights`])
//! that a decode step's products read instead.
//!
//! A decode step reads every weight once per token for two flops each, so its speed is the
//! memory's: SmolLM2-135M's fp32 matrices are 540 MB a token, bf16 halves that and Q8 (int8
//! blocks of 32 with an f32 scale, llama.cpp's Q8_0) reads 1.125 bytes a weight. Only the
//! matrix products change: the token embedding, norms, rotary positions, attention and the
//! KV cache are the f32 path's. The copy is taken when made: it does not follow later changes
//! to the model's parameters.
//!
//! This module never changes the model; it allocates only when a copy is made.

use cohort_engine::cpu::{DecodeFormat, DecodeMatrix};

use crate::layout::Layout;
use crate::model::DecodeBlock;
use crate::{GPTConfig, GPT};

/// The weights a decode's matrix products read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WeightFormat {
    /// The model's f32 parameters (the default: the logits of the training forward).
    #[default]
    F32,
    /// A bf16 copy (rounded to nearest even); each input row is rounded to bf16 and the
    /// products summed in f32 (AVX512_BF16 where the CPU has it).
    Bf16,
    /// An 8-bit copy: blocks of 32 int8 with an f32 scale; input rows quantised the same way.
    Q8,
}

impl WeightFormat {
    /// The engine's format of the copy, or None for the model's own f32 weights.
    pub fn decode_format(self) -> Option<DecodeFormat> {
        match self {
            WeightFormat::F32 => None,
            WeightFormat::Bf16 => Some(DecodeFormat::Bf16),
            WeightFormat::Q8 => Some(DecodeFormat::Q8),
        }
    }
}

impl std::str::FromStr for WeightFormat {
    type Err = String;
    /// `fp32`, `bf16` or `q8` (also `f32`, `float32`, `bfloat16`, `q8_0`, `int8`).
    fn from_str(s: &str) -> Result<WeightFormat, String> {
        match s {
            "fp32" | "f32" | "float32" => Ok(WeightFormat::F32),
            "bf16" | "bfloat16" => Ok(WeightFormat::Bf16),
            "q8" | "q8_0" | "int8" => Ok(WeightFormat::Q8),
            _ => Err(format!(
                "unknown weight format {s:?} (expected fp32, bf16 or q8)"
            )),
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WeightFormat::F32 => "fp32",
            WeightFormat::Bf16 => "bf16",
            WeightFormat::Q8 => "q8",
        })
    }
}

/// A copy of a model's matrices (every block's four and the head) in bf16 or Q8, for the
/// decode steps of a [`Workspace`](super::Workspace) to read. One copy serves any number of
/// workspaces (share it in an `Arc`).
pub struct DecodeWeights {
    /// The config of the model it was made from (a workspace checks it).
    pub(super) config: GPTConfig,
    pub(super) blocks: Vec<DecodeBlock>,
    /// (V, C).
    pub(super) head: DecodeMatrix,
}

impl std::fmt::Debug for DecodeWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeWeights")
            .field("format", &self.format())
            .field("bytes", &self.bytes())
            .finish()
    }
}

impl DecodeWeights {
    /// A copy of `model`'s matrices in `format` (the model's parameters as they are now),
    /// converted on the model's threads.
    pub fn new(model: &GPT, format: DecodeFormat) -> DecodeWeights {
        let mut made = None;
        model
            .backend()
            .install(&mut || made = Some(DecodeWeights::convert(model, format)));
        made.expect("install runs its closure")
    }

    fn convert(model: &GPT, format: DecodeFormat) -> DecodeWeights {
        let cfg = model.config();
        let layout = Layout::new(cfg);
        let p = model.params();
        let (c, f) = (cfg.d_model, cfg.d_ff);
        let conv = |r: &std::ops::Range<usize>, rows: usize, cols: usize| {
            DecodeMatrix::from_input_major(&p[r.clone()], rows, cols, format)
        };
        let blocks = layout
            .blocks
            .iter()
            .map(|bl| DecodeBlock {
                attn: conv(&bl.attn_w, c, cfg.qkv_width()),
                proj: conv(&bl.proj_w, c, c),
                fc: conv(&bl.fc_w, c, cfg.fc_width()),
                fcproj: conv(&bl.fcproj_w, f, c),
            })
            .collect();
        let head =
            DecodeMatrix::from_output_major(&p[layout.lm_head.clone()], cfg.vocab_size, c, format);
        DecodeWeights {
            config: cfg.clone(),
            blocks,
            head,
        }
    }

    /// The format of the copy.
    pub fn format(&self) -> DecodeFormat {
        self.head.format()
    }

    /// Bytes the copy takes (what a decode step reads of the matrices per token).
    pub fn bytes(&self) -> usize {
        let blocks: usize = self
            .blocks
            .iter()
            .map(|b| b.attn.bytes() + b.proj.bytes() + b.fc.bytes() + b.fcproj.bytes())
            .sum();
        blocks + self.head.bytes()
    }
}

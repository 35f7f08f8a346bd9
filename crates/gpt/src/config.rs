//! `GPTConfig`: the model's hyper-parameters, with nanoGPT-style field names and defaults, and
//! the axes of the decoder family it describes (GPT-2, Llama, Qwen2, SmolLM2...).
//!
//! It only describes a model; it never allocates one. `validate` is the single place that decides
//! whether a configuration is usable, so every constructor reports the same clear errors.

use serde::{Deserialize, Serialize};

use crate::GptError;

/// Hyper-parameters of a decoder-only transformer (a nanoGPT-style `GPTConfig` plus `bias`,
/// tying, and the family's axes: normalisation, positions, MLP, key/value heads, QKV bias).
///
/// Missing fields in a serialized config take the defaults below, which are GPT-2's, so the
/// original seven-field config deserializes as is; the family's fields are written only where
/// they differ from GPT-2, so a GPT-2 config serializes as it always did.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GPTConfig {
    /// Number of token ids (V).
    pub vocab_size: usize,
    /// Longest sequence the position embedding covers (maxT).
    pub max_position_embeddings: usize,
    /// Number of transformer blocks (L).
    pub n_layers: usize,
    /// Attention heads per block (NH); must divide `d_model`.
    pub n_heads: usize,
    /// Width of the residual stream (C).
    pub d_model: usize,
    /// Hidden width of the MLP (F), 4 * d_model in GPT-2.
    pub d_ff: usize,
    /// Dropout probability at GPT-2's three sites (embeddings, attention probabilities,
    /// residual branch outputs); 0 disables dropout entirely.
    pub dropout: f32,
    /// Whether Linear layers and LayerNorms have biases (GPT-2: true).
    pub bias: bool,
    /// Whether the LM head shares the token embedding matrix (GPT-2: true).
    pub tie_word_embeddings: bool,
    /// The normalisation of each block's two inputs and of the final output.
    #[serde(skip_serializing_if = "is_default")]
    pub norm: Norm,
    /// How positions enter: learned embeddings added to the tokens', or rotary embeddings of q
    /// and k.
    #[serde(skip_serializing_if = "is_default")]
    pub positions: Positions,
    /// The MLP's activation: GELU (d_ff wide) or SwiGLU (gate and up, d_ff wide each).
    #[serde(skip_serializing_if = "is_default")]
    pub mlp: Mlp,
    /// Key/value heads (NKV; grouped-query attention when fewer than `n_heads`, which they
    /// must divide; 1 is multi-query). None: as many as query heads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n_kv_heads: Option<usize>,
    /// Whether the q, k, v projections have a bias; None: as `bias` (Qwen2: true with `bias`
    /// false).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qkv_bias: Option<bool>,
}

fn is_default<T: Default + PartialEq>(x: &T) -> bool {
    *x == T::default()
}

/// The normalisation layers of the model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type")]
pub enum Norm {
    /// LayerNorm (eps 1e-5), with a bias where `bias` is set (GPT-2).
    #[default]
    LayerNorm,
    /// RMSNorm (Llama), no bias.
    RmsNorm {
        /// Added to the mean square (Llama 1e-5 or 1e-6).
        eps: f32,
    },
}

/// How the model knows positions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type")]
pub enum Positions {
    /// A learned embedding per position, added to the token's (GPT-2's `wpe`).
    #[default]
    Learned,
    /// Rotary embeddings of q and k (Hugging Face's rotate_half convention).
    Rope {
        /// The base of the frequencies (Llama 10000, SmolLM2 1e5, Llama 3 5e5).
        theta: f32,
        /// Llama 3's frequency scaling (`rope_scaling` with `rope_type` "llama3"); None: plain.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        scaling: Option<RopeScaling>,
    },
}

/// Llama 3's rope scaling (`rope_type: "llama3"`): low frequencies divided by `factor`, high
/// ones kept, a smooth blend between.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeScaling {
    /// How much longer the context is than the one trained with.
    pub factor: f32,
    /// Wavelengths above original_max_position_embeddings / low_freq_factor are scaled.
    pub low_freq_factor: f32,
    /// Wavelengths below original_max_position_embeddings / high_freq_factor are kept.
    pub high_freq_factor: f32,
    /// The context the model was trained with.
    pub original_max_position_embeddings: usize,
}

/// The MLP's activation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mlp {
    /// gelu(x · W_fc) · W_proj, GELU's tanh form (GPT-2).
    #[default]
    Gelu,
    /// (silu(x · W_gate) · (x · W_up)) · W_down (Llama); W_gate and W_up are one (C, 2F)
    /// matrix, gate's columns first.
    #[serde(rename = "swiglu")]
    SwiGlu,
}

/// GPT-2's point on the family's axes.
const GPT2_AXES: GPTConfig = GPTConfig {
    vocab_size: 0,
    max_position_embeddings: 0,
    n_layers: 0,
    n_heads: 0,
    d_model: 0,
    d_ff: 0,
    dropout: 0.0,
    bias: true,
    tie_word_embeddings: true,
    norm: Norm::LayerNorm,
    positions: Positions::Learned,
    mlp: Mlp::Gelu,
    n_kv_heads: None,
    qkv_bias: None,
};

impl Default for GPTConfig {
    /// Seed 000's configuration (vocab 10000, 128 positions, 2 layers, 4 heads, 128 wide).
    fn default() -> Self {
        GPTConfig {
            vocab_size: 10000,
            max_position_embeddings: 128,
            n_layers: 2,
            n_heads: 4,
            d_model: 128,
            d_ff: 512,
            dropout: 0.1,
            bias: true,
            tie_word_embeddings: true,
            ..GPT2_AXES
        }
    }
}

impl GPTConfig {
    /// Benchmark config A (nanoGPT's Shakespeare-char CPU recipe), dropout 0; batch 12.
    pub fn config_a() -> Self {
        GPTConfig {
            vocab_size: 65,
            max_position_embeddings: 64,
            n_layers: 4,
            n_heads: 4,
            d_model: 128,
            d_ff: 512,
            dropout: 0.0,
            bias: true,
            tie_word_embeddings: true,
            ..GPT2_AXES
        }
    }

    /// Benchmark config B, dropout 0; batch 8.
    pub fn config_b() -> Self {
        GPTConfig {
            vocab_size: 65,
            max_position_embeddings: 256,
            n_layers: 6,
            n_heads: 6,
            d_model: 384,
            d_ff: 1536,
            dropout: 0.0,
            bias: true,
            tie_word_embeddings: true,
            ..GPT2_AXES
        }
    }

    /// Benchmark config G, GPT-2 small's shape with a short context (124M parameters), dropout
    /// 0; batch 4.
    pub fn config_g() -> Self {
        GPTConfig {
            vocab_size: 50304,
            max_position_embeddings: 256,
            n_layers: 12,
            n_heads: 12,
            d_model: 768,
            d_ff: 3072,
            dropout: 0.0,
            bias: true,
            tie_word_embeddings: true,
            ..GPT2_AXES
        }
    }

    /// Benchmark config S, SmolLM2-135M's shape (`LlamaForCausalLM`: 30 layers, d 576, 9 heads
    /// over 3 key/value heads, SwiGLU 1536, RoPE θ 1e5, RMSNorm 1e-5, tied, vocabulary 49152)
    /// with a context of 512, dropout 0; batch 4.
    pub fn config_s() -> Self {
        GPTConfig {
            vocab_size: 49152,
            max_position_embeddings: 512,
            n_layers: 30,
            n_heads: 9,
            d_model: 576,
            d_ff: 1536,
            dropout: 0.0,
            bias: false,
            tie_word_embeddings: true,
            norm: Norm::RmsNorm { eps: 1e-5 },
            positions: Positions::Rope {
                theta: 1e5,
                scaling: None,
            },
            mlp: Mlp::SwiGlu,
            n_kv_heads: Some(3),
            qkv_bias: None,
        }
    }

    /// `base`'s shape as a Llama: RMSNorm (eps 1e-5), RoPE (θ 10000), SwiGLU, no biases, half
    /// as many key/value heads where that divides (else as many).
    pub fn llama_like(base: GPTConfig) -> GPTConfig {
        let nkv = if base.n_heads.is_multiple_of(2) {
            base.n_heads / 2
        } else {
            base.n_heads
        };
        GPTConfig {
            bias: false,
            norm: Norm::RmsNorm { eps: 1e-5 },
            positions: Positions::Rope {
                theta: 10000.0,
                scaling: None,
            },
            mlp: Mlp::SwiGlu,
            n_kv_heads: Some(nkv),
            qkv_bias: None,
            ..base
        }
    }

    /// Width of one attention head (C / NH).
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads
    }

    /// Key/value heads (NKV): `n_kv_heads`, or NH.
    pub fn kv_heads(&self) -> usize {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }

    /// Width of a row of the q, k, v product: (NH + 2·NKV)·HS (3C with multi-head attention).
    pub fn qkv_width(&self) -> usize {
        (self.n_heads + 2 * self.kv_heads()) * self.head_dim()
    }

    /// Width of the MLP's first product: F for GELU, 2F (gate and up) for SwiGLU.
    pub fn fc_width(&self) -> usize {
        match self.mlp {
            Mlp::Gelu => self.d_ff,
            Mlp::SwiGlu => 2 * self.d_ff,
        }
    }

    /// Parameters that enter matrix products: each block's q/k/v, attention output, MLP up
    /// (gate and up for SwiGLU) and down weights, and the LM head (V x C, tied or not). Position
    /// and input embeddings (lookups), norms and biases (adds) are left out.
    pub fn product_params(&self) -> usize {
        let (c, f) = (self.d_model, self.d_ff);
        let block = c * self.qkv_width() + c * c + c * self.fc_width() + f * c;
        self.n_layers * block + self.vocab_size * c
    }

    /// Model FLOPs of one training token (forward and backward) in sequences of `t`: llm.c's
    /// `6·N + 6·L·C·T`. 6·N: every product weight takes 2 FLOPs per token forward and 4
    /// backward, with N = [`product_params`](Self::product_params) (llm.c counts all of its
    /// parameters, positions and norms included, ~0.7% more on config G; the weights of the
    /// products are what the step computes with, and they carry grouped-query attention's
    /// narrower q/k/v and SwiGLU's third matrix). 6·L·C·T: attention's two products (scores,
    /// weighted values), forward and backward, over the causal half of the T x T scores
    /// (the exact causal count is 6·L·C·(T+1)), the same for any number of key/value heads,
    /// since every query head attends. What is not a product (softmax, norms, activations,
    /// AdamW) counts zero, as in llm.c.
    pub fn train_flops_per_token(&self, t: usize) -> f64 {
        let attention = self.n_layers * self.n_heads * self.head_dim() * t;
        6.0 * self.product_params() as f64 + 6.0 * attention as f64
    }

    /// Whether the q, k, v projections have a bias.
    pub fn has_qkv_bias(&self) -> bool {
        self.qkv_bias.unwrap_or(self.bias)
    }

    /// Whether this is GPT-2's architecture (learned positions, LayerNorm, GELU, multi-head
    /// attention, biases everywhere or nowhere): the checkpoints' GPT-2 format applies.
    pub fn is_gpt2(&self) -> bool {
        self.norm == Norm::LayerNorm
            && self.positions == Positions::Learned
            && self.mlp == Mlp::Gelu
            && self.kv_heads() == self.n_heads
            && self.has_qkv_bias() == self.bias
    }

    /// RoPE's inverse frequencies (HS/2), as `transformers` computes them (f32), with Llama
    /// 3's scaling applied; None with learned positions.
    pub fn rope_inv_freq(&self) -> Option<Vec<f32>> {
        let Positions::Rope { theta, scaling } = self.positions else {
            return None;
        };
        let hs = self.head_dim();
        let mut inv: Vec<f32> = (0..hs / 2)
            .map(|i| (1.0 / (theta as f64).powf((2 * i) as f64 / hs as f64)) as f32)
            .collect();
        if let Some(s) = scaling {
            // transformers' _compute_llama3_parameters
            let old = s.original_max_position_embeddings as f32;
            let (low_wavelen, high_wavelen) = (old / s.low_freq_factor, old / s.high_freq_factor);
            for f in &mut inv {
                let wavelen = 2.0 * std::f32::consts::PI / *f;
                if wavelen > low_wavelen {
                    *f /= s.factor;
                } else if wavelen >= high_wavelen {
                    let smooth = (old / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    *f = (1.0 - smooth) * *f / s.factor + smooth * *f;
                }
            }
        }
        Some(inv)
    }

    /// Checks that the configuration describes a model that can be built.
    pub fn validate(&self) -> Result<(), GptError> {
        let bad = |field: &'static str, reason: String| Err(GptError::Config { field, reason });
        for (field, value) in [
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("d_model", self.d_model),
            ("d_ff", self.d_ff),
        ] {
            if value == 0 {
                return bad(field, "must be at least 1".into());
            }
        }
        if !self.d_model.is_multiple_of(self.n_heads) {
            return bad(
                "n_heads",
                format!(
                    "{} heads do not divide d_model {}",
                    self.n_heads, self.d_model
                ),
            );
        }
        // Token ids are u32 and label ids i32; keep both representable.
        if self.vocab_size > i32::MAX as usize {
            return bad(
                "vocab_size",
                format!("{} exceeds i32::MAX", self.vocab_size),
            );
        }
        let nkv = self.kv_heads();
        if nkv == 0 || !self.n_heads.is_multiple_of(nkv) {
            return bad(
                "n_kv_heads",
                format!(
                    "{nkv} key/value heads do not divide {} query heads",
                    self.n_heads
                ),
            );
        }
        if let Norm::RmsNorm { eps } = self.norm {
            if self.bias {
                return bad(
                    "bias",
                    "RMSNorm has no bias: set bias false (qkv_bias true for Qwen2-style)".into(),
                );
            }
            if !(eps > 0.0 && eps.is_finite()) {
                return bad("norm", format!("RMSNorm eps {eps} is not positive"));
            }
        }
        if let Positions::Rope { theta, scaling } = self.positions {
            if !self.head_dim().is_multiple_of(2) {
                return bad(
                    "positions",
                    format!(
                        "rotary embeddings need an even head size, not {}",
                        self.head_dim()
                    ),
                );
            }
            if !(theta > 1.0 && theta.is_finite()) {
                return bad("positions", format!("rope theta {theta} must be above 1"));
            }
            if let Some(s) = scaling {
                if !(s.factor >= 1.0
                    && s.low_freq_factor > 0.0
                    && s.high_freq_factor > s.low_freq_factor
                    && s.original_max_position_embeddings > 0)
                {
                    return bad(
                        "positions",
                        format!(
                            "rope scaling {s:?} needs factor >= 1, 0 < low_freq_factor < \
                             high_freq_factor and original_max_position_embeddings > 0"
                        ),
                    );
                }
            }
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(
                "dropout",
                format!("{} is not a probability in [0, 1)", self.dropout),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_config_deserializes_with_defaults() {
        let json = r#"{"vocab_size": 10000, "max_position_embeddings": 128, "n_layers": 2,
            "n_heads": 4, "d_model": 128, "d_ff": 512, "dropout": 0.1}"#;
        let cfg: GPTConfig = serde_json::from_str(json).unwrap();
        assert_eq!(cfg, GPTConfig::default());
        assert!(cfg.bias && cfg.tie_word_embeddings);
        let back: GPTConfig = serde_json::from_str(&serde_json::to_string(&cfg).unwrap()).unwrap();
        assert_eq!(back, cfg);
    }

    #[test]
    fn validate_names_the_bad_field() {
        let mut cfg = GPTConfig::config_a();
        cfg.validate().unwrap();
        cfg.n_heads = 3;
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("n_heads") && err.contains("128"), "{err}");
        let cfg = GPTConfig {
            dropout: 1.0,
            ..GPTConfig::config_a()
        };
        assert!(cfg.validate().unwrap_err().to_string().contains("dropout"));
        let cfg = GPTConfig {
            n_layers: 0,
            ..GPTConfig::config_a()
        };
        assert!(cfg.validate().unwrap_err().to_string().contains("n_layers"));
        let llama = GPTConfig {
            n_kv_heads: Some(3),
            ..GPTConfig::llama_like(GPTConfig::config_a())
        };
        assert!(llama
            .validate()
            .unwrap_err()
            .to_string()
            .contains("n_kv_heads"));
        let cfg = GPTConfig {
            bias: true,
            ..GPTConfig::llama_like(GPTConfig::config_a())
        };
        assert!(cfg.validate().unwrap_err().to_string().contains("RMSNorm"));
        GPTConfig::llama_like(GPTConfig::config_a())
            .validate()
            .unwrap();
    }

    #[test]
    fn gpt2_configs_serialize_as_before_and_llama_round_trips() {
        let json = serde_json::to_string(&GPTConfig::config_a()).unwrap();
        assert!(!json.contains("norm") && !json.contains("rope"), "{json}");
        let llama = GPTConfig {
            positions: Positions::Rope {
                theta: 1e5,
                scaling: Some(RopeScaling {
                    factor: 32.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 8192,
                }),
            },
            ..GPTConfig::llama_like(GPTConfig::config_a())
        };
        let back: GPTConfig =
            serde_json::from_str(&serde_json::to_string(&llama).unwrap()).unwrap();
        assert_eq!(back, llama);
        assert!(!llama.is_gpt2() && GPTConfig::config_a().is_gpt2());
        assert_eq!(llama.rope_inv_freq().unwrap().len(), 16);
        GPTConfig::config_s().validate().unwrap();
    }

    /// The FLOP count of configs A, B, G and S against a hand computation (per block: q/k/v,
    /// output, up, down weights; then the head; then 6·L·C·T).
    #[test]
    fn train_flops_per_token_by_hand() {
        // A: 4 x (128·384 + 128·128 + 128·512 + 512·128) + 65·128.
        let a = GPTConfig::config_a();
        assert_eq!(a.product_params(), 4 * 196_608 + 8_320);
        assert_eq!(
            a.train_flops_per_token(64),
            (6 * 794_752 + 6 * 4 * 128 * 64) as f64
        );
        // B: 6 x (384·1152 + 384·384 + 384·1536 + 1536·384) + 65·384.
        let b = GPTConfig::config_b();
        assert_eq!(b.product_params(), 6 * 1_769_472 + 24_960);
        assert_eq!(b.train_flops_per_token(256), 67_389_696.0);
        // ~138 GFLOP in a step of 8 x 256 tokens.
        assert_eq!(b.train_flops_per_token(256) * 2048.0, 138_014_097_408.0);
        // G: 12 x (768·2304 + 768·768 + 2 x 768·3072) + 50304·768.
        let g = GPTConfig::config_g();
        assert_eq!(g.product_params(), 12 * 7_077_888 + 38_633_472);
        assert_eq!(g.train_flops_per_token(256), 755_564_544.0);
        // S: q/k/v (9 + 2·3) x 64 = 960 wide, SwiGLU's gate and up 2 x 1536: 30 x (576·960 +
        // 576·576 + 576·3072 + 1536·576) + 49152·576 (134.5M, SmolLM2-135M less its norms).
        let s = GPTConfig::config_s();
        assert_eq!(s.product_params(), 30 * 3_538_944 + 28_311_552);
        assert_eq!(s.product_params(), 134_479_872);
        assert_eq!(s.train_flops_per_token(512), 859_963_392.0);
    }
}

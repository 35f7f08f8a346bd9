//! `GPTConfig`: the model's hyper-parameters, with nanoGPT-style field names and defaults.
//!
//! It only describes a model; it never allocates one. `validate` is the single place that decides
//! whether a configuration is usable, so every constructor reports the same clear errors.

use serde::{Deserialize, Serialize};

use crate::GptError;

/// Hyper-parameters of the GPT-2 style model (a nanoGPT-style `GPTConfig` plus `bias` and tying).
///
/// Missing fields in a serialized config take the defaults below, so the original seven-field
/// config deserializes as is.
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
}

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
        }
    }

    /// Width of one attention head (C / NH).
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads
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
    }
}

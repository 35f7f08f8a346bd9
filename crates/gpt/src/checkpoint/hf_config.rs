//! config.json as Hugging Face's `GPT2Config` writes and reads it, and its translation to and
//! from [`GPTConfig`] (Llama-family configs are `hf_llama`'s). Settings this model cannot honour are refused by name, never ignored.

use super::*;

/// config.json as Hugging Face's `GPT2Config` writes and reads it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct HfGpt2Config {
    #[serde(default = "gpt2")]
    pub(super) model_type: String,
    #[serde(default)]
    pub(super) architectures: Vec<String>,
    pub(super) vocab_size: usize,
    pub(super) n_positions: usize,
    pub(super) n_embd: usize,
    pub(super) n_layer: usize,
    pub(super) n_head: usize,
    /// null means 4 * n_embd.
    #[serde(default)]
    pub(super) n_inner: Option<usize>,
    #[serde(default = "gelu_new")]
    pub(super) activation_function: String,
    #[serde(default = "pdrop")]
    pub(super) resid_pdrop: f32,
    #[serde(default = "pdrop")]
    pub(super) embd_pdrop: f32,
    #[serde(default = "pdrop")]
    pub(super) attn_pdrop: f32,
    #[serde(default = "ln_eps")]
    pub(super) layer_norm_epsilon: f64,
    #[serde(default = "init_range")]
    pub(super) initializer_range: f64,
    #[serde(default = "yes")]
    pub(super) tie_word_embeddings: bool,
    #[serde(default = "yes")]
    pub(super) scale_attn_weights: bool,
    #[serde(default)]
    pub(super) scale_attn_by_inverse_layer_idx: bool,
    /// Not a GPT2Config field: our bias-free variant (Hugging Face keeps unknown keys).
    #[serde(default = "yes")]
    pub(super) bias: bool,
    /// Any other keys (bos_token_id, n_ctx, transformers_version, ...): read and ignored.
    #[serde(flatten)]
    pub(super) other: serde_json::Map<String, serde_json::Value>,
}

pub(super) fn gpt2() -> String {
    "gpt2".into()
}
pub(super) fn gelu_new() -> String {
    "gelu_new".into()
}
pub(super) fn pdrop() -> f32 {
    0.1
}
pub(super) fn ln_eps() -> f64 {
    1e-5
}
pub(super) fn init_range() -> f64 {
    0.02
}
pub(super) fn yes() -> bool {
    true
}

impl HfGpt2Config {
    pub(super) fn from_config(cfg: &GPTConfig) -> Self {
        HfGpt2Config {
            model_type: gpt2(),
            architectures: vec!["GPT2LMHeadModel".into()],
            vocab_size: cfg.vocab_size,
            n_positions: cfg.max_position_embeddings,
            n_embd: cfg.d_model,
            n_layer: cfg.n_layers,
            n_head: cfg.n_heads,
            n_inner: Some(cfg.d_ff),
            activation_function: gelu_new(),
            resid_pdrop: cfg.dropout,
            embd_pdrop: cfg.dropout,
            attn_pdrop: cfg.dropout,
            layer_norm_epsilon: ln_eps(),
            initializer_range: init_range(),
            tie_word_embeddings: cfg.tie_word_embeddings,
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
            bias: cfg.bias,
            other: serde_json::Map::new(),
        }
    }

    pub(super) fn to_config(&self, path: &Path) -> Result<GPTConfig, CheckpointError> {
        let unsupported = |field, value: String, reason| CheckpointError::UnsupportedConfig {
            path: path.to_path_buf(),
            field,
            value,
            reason,
        };
        if self.model_type != "gpt2" {
            return Err(unsupported(
                "model_type",
                self.model_type.clone(),
                "only GPT-2, Llama and Qwen2 checkpoints",
            ));
        }
        // Both names denote GPT-2's tanh approximation, which is what the engine computes.
        if !matches!(
            self.activation_function.as_str(),
            "gelu_new" | "gelu_pytorch_tanh"
        ) {
            return Err(unsupported(
                "activation_function",
                self.activation_function.clone(),
                "the engine computes GELU's tanh form (gelu_new) only",
            ));
        }
        if (self.layer_norm_epsilon - 1e-5).abs() > 1e-12 {
            return Err(unsupported(
                "layer_norm_epsilon",
                self.layer_norm_epsilon.to_string(),
                "the engine's LayerNorm uses 1e-5",
            ));
        }
        if !self.scale_attn_weights || self.scale_attn_by_inverse_layer_idx {
            return Err(unsupported(
                "scale_attn_weights",
                format!(
                    "{} (scale_attn_by_inverse_layer_idx {})",
                    self.scale_attn_weights, self.scale_attn_by_inverse_layer_idx
                ),
                "attention scores are scaled by 1/sqrt(head_dim) only",
            ));
        }
        if self.embd_pdrop != self.resid_pdrop || self.attn_pdrop != self.resid_pdrop {
            return Err(unsupported(
                "attn_pdrop/embd_pdrop",
                format!(
                    "{}/{} vs resid_pdrop {}",
                    self.attn_pdrop, self.embd_pdrop, self.resid_pdrop
                ),
                "the model has one dropout probability for all three sites",
            ));
        }
        let cfg = GPTConfig {
            vocab_size: self.vocab_size,
            max_position_embeddings: self.n_positions,
            n_layers: self.n_layer,
            n_heads: self.n_head,
            d_model: self.n_embd,
            d_ff: self.n_inner.unwrap_or(4 * self.n_embd),
            dropout: self.resid_pdrop,
            bias: self.bias,
            tie_word_embeddings: self.tie_word_embeddings,
            ..GPTConfig::default()
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// The model configuration stored in checkpoint directory `dir` (config.json).
pub fn load_config(dir: &Path) -> Result<GPTConfig, CheckpointError> {
    let path = dir.join(CONFIG_FILE);
    let bytes = read_verified(dir, CONFIG_FILE)?;
    if is_llama_family(&bytes) {
        return llama_to_config(&path, &bytes);
    }
    let hf: HfGpt2Config = serde_json::from_slice(&bytes).map_err(|e| format_err(&path, e))?;
    hf.to_config(&path)
}

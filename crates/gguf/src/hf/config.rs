//! The Llama hyperparameters a GGUF file's `llama.*` metadata states, checked against its token
//! embedding, and the config.json and generation_config.json that Hugging Face's
//! `LlamaForCausalLM` reads them from. Key names are llama.cpp's (`gguf-py/gguf/constants.py`).

use serde_json::{json, Value as Json};

use crate::error::GgufError;
use crate::reader::GgufFile;

/// llama.cpp's default RoPE base when a file does not state `llama.rope.freq_base`.
const DEFAULT_ROPE_THETA: f64 = 10_000.0;

/// A Llama model's shape and special ids, as the file states them.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Decoder blocks (`llama.block_count`).
    pub layers: usize,
    /// Model width (`llama.embedding_length`).
    pub hidden: usize,
    /// The MLP's inner width (`llama.feed_forward_length`).
    pub ffn: usize,
    /// Query heads (`llama.attention.head_count`).
    pub heads: usize,
    /// Key/value heads (`llama.attention.head_count_kv`, default: `heads`).
    pub kv_heads: usize,
    /// Width of one head (`hidden / heads`).
    pub head_dim: usize,
    /// Rows of the token embedding.
    pub vocab: usize,
    /// Trained context (`llama.context_length`).
    pub context: usize,
    /// RoPE base (`llama.rope.freq_base`).
    pub rope_theta: f64,
    /// RMSNorm epsilon (`llama.attention.layer_norm_rms_epsilon`).
    pub rms_eps: f64,
    /// True when the file has no `output.weight`: the head is the token embedding.
    pub tied: bool,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos: Option<u64>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos: Option<u64>,
    /// `tokenizer.ggml.padding_token_id`.
    pub pad: Option<u64>,
}

impl LlamaConfig {
    /// Reads and checks the hyperparameters of `file`, whose `general.architecture` is "llama".
    pub fn from_file(file: &GgufFile) -> Result<LlamaConfig, GgufError> {
        let path = file.path();
        let usize_key = |key: &str| -> Result<usize, GgufError> {
            let v = file.u64(key)?;
            usize::try_from(v)
                .ok()
                .filter(|&v| v > 0)
                .ok_or_else(|| GgufError::WrongKey {
                    path: path.to_path_buf(),
                    key: key.into(),
                    expected: "a positive size".into(),
                    found: v.to_string(),
                })
        };
        let layers = usize_key("llama.block_count")?;
        let hidden = usize_key("llama.embedding_length")?;
        let ffn = usize_key("llama.feed_forward_length")?;
        let heads = usize_key("llama.attention.head_count")?;
        let kv_heads = match file.get("llama.attention.head_count_kv") {
            None => heads,
            Some(_) => usize_key("llama.attention.head_count_kv")?,
        };
        let wrong = |key: &str, expected: String, found: String| GgufError::WrongKey {
            path: path.to_path_buf(),
            key: key.into(),
            expected,
            found,
        };
        if hidden % heads != 0 || heads % kv_heads != 0 {
            return Err(wrong(
                "llama.attention.head_count_kv",
                format!("a divisor of head_count {heads}, which divides embedding_length {hidden}"),
                kv_heads.to_string(),
            ));
        }
        let head_dim = hidden / heads;
        if head_dim % 2 != 0 {
            return Err(wrong(
                "llama.attention.head_count",
                format!("a count that leaves an even head width (RoPE rotates pairs) of {hidden}"),
                heads.to_string(),
            ));
        }
        // Partial rotary (RoPE on part of each head) is not Llama's; HF's LlamaForCausalLM
        // rotates whole heads.
        if let Some(rot) = file.opt_u64("llama.rope.dimension_count")? {
            if rot != head_dim as u64 {
                return Err(wrong(
                    "llama.rope.dimension_count",
                    format!("the head width {head_dim} (RoPE on whole heads)"),
                    rot.to_string(),
                ));
            }
        }
        let rms_eps = file.opt_f64("llama.attention.layer_norm_rms_epsilon")?;
        let rms_eps = rms_eps.ok_or_else(|| GgufError::MissingKey {
            path: path.to_path_buf(),
            key: "llama.attention.layer_norm_rms_epsilon".into(),
        })?;
        let rope_theta = file
            .opt_f64("llama.rope.freq_base")?
            .unwrap_or(DEFAULT_ROPE_THETA);
        if file.get("llama.rope.scaling.type").is_some()
            || file.tensor("rope_freqs.weight").is_some()
        {
            return Err(GgufError::Unsupported {
                path: path.to_path_buf(),
                what: "RoPE scaling (llama.rope.scaling.* or rope_freqs.weight)".into(),
                reason: "only plain RoPE is converted".into(),
            });
        }

        let embd = file
            .tensor("token_embd.weight")
            .ok_or_else(|| GgufError::Tensor {
                path: path.to_path_buf(),
                tensor: "token_embd.weight".into(),
                reason: "missing".into(),
            })?;
        let vocab = match embd.dims[..] {
            [h, v] if h == hidden as u64 => v as usize,
            _ => {
                return Err(GgufError::Tensor {
                    path: path.to_path_buf(),
                    tensor: embd.name.clone(),
                    reason: format!("ggml dims {:?}, expected [{hidden}, vocab]", embd.dims),
                })
            }
        };
        if let Some(stated) = file.opt_u64("llama.vocab_size")? {
            if stated != vocab as u64 {
                return Err(wrong(
                    "llama.vocab_size",
                    format!("the token embedding's {vocab} rows"),
                    stated.to_string(),
                ));
            }
        }
        let context = file.opt_u64("llama.context_length")?.unwrap_or(2048) as usize;
        Ok(LlamaConfig {
            layers,
            hidden,
            ffn,
            heads,
            kv_heads,
            head_dim,
            vocab,
            context,
            rope_theta: f32_decimal(rope_theta),
            rms_eps: f32_decimal(rms_eps),
            tied: file.tensor("output.weight").is_none(),
            bos: file.opt_u64("tokenizer.ggml.bos_token_id")?,
            eos: file.opt_u64("tokenizer.ggml.eos_token_id")?,
            pad: file.opt_u64("tokenizer.ggml.padding_token_id")?,
        })
    }

    /// config.json for `LlamaForCausalLM`.
    pub fn config_json(&self) -> Json {
        json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.context,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": null,
            "attention_bias": false,
            "attention_dropout": 0.0,
            "mlp_bias": false,
            "tie_word_embeddings": self.tied,
            "vocab_size": self.vocab,
            "bos_token_id": self.bos,
            "eos_token_id": self.eos,
            "pad_token_id": self.pad,
            "initializer_range": 0.02,
            "use_cache": true,
            "torch_dtype": "float32",
        })
    }

    /// generation_config.json: the special ids generation stops at and pads with.
    pub fn generation_config_json(&self) -> Json {
        json!({
            "bos_token_id": self.bos,
            "eos_token_id": self.eos,
            "pad_token_id": self.pad,
        })
    }
}

/// A float the file stored as f32 (so 1e-5 reads as 9.999999747e-6), written as the shortest
/// decimal that f32 round-trips (1e-5), as the model's own config.json spells it.
fn f32_decimal(v: f64) -> f64 {
    let single = v as f32;
    if f64::from(single) == v {
        single.to_string().parse().unwrap_or(v)
    } else {
        v
    }
}

#[cfg(test)]
mod tests {
    use super::f32_decimal;

    #[test]
    fn f32_values_are_written_as_their_shortest_decimal() {
        assert_eq!(f32_decimal(f64::from(1e-5f32)), 1e-5);
        assert_eq!(f32_decimal(100000.0), 100000.0);
        // A genuine f64 is kept.
        assert_eq!(f32_decimal(1e-5), 1e-5);
        assert_eq!(f32_decimal(0.1), 0.1);
    }
}

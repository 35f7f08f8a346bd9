//! Hugging Face's Llama and Qwen2 formats (`LlamaForCausalLM`, `Qwen2ForCausalLM`): config.json
//! translated to and from [`GPTConfig`], and model.safetensors (or a sharded
//! `model.safetensors.index.json`) mapped to and from the flat parameter buffer.
//!
//! The flat buffer keeps the family's tensors under GPT-2's names in Conv1D layout [in, out],
//! with q, k, v (and gate, up) side by side (see `layout.rs`); Hugging Face stores each
//! projection on its own as an `nn.Linear` weight [out, in]. [`hf_tensors`] is the one table
//! between the two: each Hugging Face tensor is a slice of a flat tensor, transposed for the
//! matrices. Saving gathers through it and loading scatters through it, so the two cannot
//! disagree. Settings this model cannot honour are refused by name, never ignored, and every
//! tensor's name, dtype and shape is checked before any parameter is written.

use std::ops::Range;

use serde_json::{json, Map, Value};

use super::*;
use crate::{Mlp, Norm, Positions, RopeScaling};

/// The sharded weights' index, as `save_pretrained` writes it for large models.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Whether config.json at `bytes` names a Llama-family `model_type`.
pub(super) fn is_llama_family(bytes: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct ModelType {
        #[serde(default)]
        model_type: String,
    }
    serde_json::from_slice::<ModelType>(bytes)
        .is_ok_and(|m| matches!(m.model_type.as_str(), "llama" | "qwen2"))
}

/// config.json of a `LlamaConfig` / `Qwen2Config`, as `transformers` 4.x and 5.x write it.
#[derive(Debug, Deserialize)]
struct HfLlamaConfig {
    model_type: String,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    #[serde(default = "default_positions")]
    max_position_embeddings: usize,
    #[serde(default = "default_rms_eps")]
    rms_norm_eps: f64,
    /// transformers 4.x.
    #[serde(default)]
    rope_theta: Option<f64>,
    /// transformers 4.x.
    #[serde(default)]
    rope_scaling: Option<Value>,
    /// transformers 5.x: `rope_theta`, `rope_type` and the scaling's fields in one object.
    #[serde(default)]
    rope_parameters: Option<Value>,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    #[serde(default = "silu")]
    hidden_act: String,
    #[serde(default)]
    use_sliding_window: bool,
}

fn default_positions() -> usize {
    2048
}
fn default_rms_eps() -> f64 {
    1e-6
}
fn silu() -> String {
    "silu".into()
}

/// The model config.json at `path` (bytes `bytes`) describes.
pub(super) fn llama_to_config(path: &Path, bytes: &[u8]) -> Result<GPTConfig, CheckpointError> {
    let hf: HfLlamaConfig = serde_json::from_slice(bytes).map_err(|e| format_err(path, e))?;
    let unsupported = |field, value: String, reason| CheckpointError::UnsupportedConfig {
        path: path.to_path_buf(),
        field,
        value,
        reason,
    };
    if hf.hidden_act != "silu" {
        return Err(unsupported(
            "hidden_act",
            hf.hidden_act,
            "the engine's gated MLP computes SiLU only",
        ));
    }
    if hf.attention_bias && hf.model_type == "llama" {
        return Err(unsupported(
            "attention_bias",
            "true".into(),
            "an o_proj bias without the MLP's is not supported",
        ));
    }
    if hf.mlp_bias {
        return Err(unsupported(
            "mlp_bias",
            "true".into(),
            "MLP biases are not supported",
        ));
    }
    if hf.use_sliding_window {
        return Err(unsupported(
            "use_sliding_window",
            "true".into(),
            "sliding-window attention is not supported",
        ));
    }
    if hf.num_attention_heads == 0 || !hf.hidden_size.is_multiple_of(hf.num_attention_heads) {
        return Err(unsupported(
            "num_attention_heads",
            hf.num_attention_heads.to_string(),
            "must divide hidden_size",
        ));
    }
    if let Some(hd) = hf.head_dim {
        if hd * hf.num_attention_heads != hf.hidden_size {
            return Err(unsupported(
                "head_dim",
                hd.to_string(),
                "heads must split hidden_size evenly (head_dim = hidden_size / num_attention_heads)",
            ));
        }
    }
    // transformers 5 keeps theta and the scaling in rope_parameters, 4.x beside it.
    let params = hf.rope_parameters.as_ref().or(hf.rope_scaling.as_ref());
    let field = |name: &str| params.and_then(|p| p.get(name));
    let theta = field("rope_theta")
        .and_then(Value::as_f64)
        .or(hf.rope_theta)
        .unwrap_or(10000.0);
    let rope_type = field("rope_type")
        .or(field("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let scaling = match rope_type {
        "default" => None,
        "llama3" => {
            let num = |name: &'static str| {
                field(name).and_then(Value::as_f64).ok_or_else(|| {
                    unsupported(
                        "rope_scaling",
                        format!("{params:?}"),
                        "llama3 scaling lacks a field",
                    )
                })
            };
            Some(RopeScaling {
                factor: num("factor")? as f32,
                low_freq_factor: num("low_freq_factor")? as f32,
                high_freq_factor: num("high_freq_factor")? as f32,
                original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
            })
        }
        other => {
            return Err(unsupported(
                "rope_type",
                other.to_string(),
                "only default and llama3 rotary embeddings are supported",
            ))
        }
    };
    let cfg = GPTConfig {
        vocab_size: hf.vocab_size,
        max_position_embeddings: hf.max_position_embeddings,
        n_layers: hf.num_hidden_layers,
        n_heads: hf.num_attention_heads,
        d_model: hf.hidden_size,
        d_ff: hf.intermediate_size,
        dropout: 0.0,
        bias: false,
        tie_word_embeddings: hf.tie_word_embeddings,
        norm: Norm::RmsNorm {
            eps: hf.rms_norm_eps as f32,
        },
        positions: Positions::Rope {
            theta: theta as f32,
            scaling,
        },
        mlp: Mlp::SwiGlu,
        // Set only where they differ from the defaults, as a config built in Rust has them, so
        // that a model written and read back compares equal.
        n_kv_heads: hf
            .num_key_value_heads
            .filter(|&k| k != hf.num_attention_heads),
        qkv_bias: (hf.model_type == "qwen2" || hf.attention_bias).then_some(true),
    };
    cfg.validate()?;
    Ok(cfg)
}

/// `x` as JSON by its shortest decimal (1e-5, not f32's 9.999999747378752e-6 widened).
fn json_num(x: f32) -> Value {
    json!(x.to_string().parse::<f64>().unwrap_or(x as f64))
}

/// Hugging Face's name for `cfg`'s architecture: ("llama" | "qwen2", class), or an error when
/// its format cannot describe the model.
fn hf_arch(cfg: &GPTConfig) -> Result<(&'static str, &'static str), CheckpointError> {
    let family = matches!(cfg.norm, Norm::RmsNorm { .. })
        && matches!(cfg.positions, Positions::Rope { .. })
        && cfg.mlp == Mlp::SwiGlu
        && !cfg.bias;
    if !family {
        return Err(CheckpointError::UnsupportedConfig {
            path: PathBuf::from(CONFIG_FILE),
            field: "architecture",
            value: format!("{:?} / {:?} / {:?}", cfg.norm, cfg.positions, cfg.mlp),
            reason: "neither GPT-2 (LayerNorm, learned positions, GELU) nor Llama/Qwen2 \
                     (RMSNorm, RoPE, SwiGLU, no biases but QKV's): no Hugging Face class reads it",
        });
    }
    Ok(if cfg.has_qkv_bias() {
        ("qwen2", "Qwen2ForCausalLM")
    } else {
        ("llama", "LlamaForCausalLM")
    })
}

/// config.json's keys for `cfg` in Hugging Face's Llama or Qwen2 format (both the 4.x and
/// the 5.x spelling of the rotary settings, so either version reads it as written).
pub(super) fn llama_config_json(cfg: &GPTConfig) -> Result<Map<String, Value>, CheckpointError> {
    let (model_type, class) = hf_arch(cfg)?;
    let (Norm::RmsNorm { eps }, Positions::Rope { theta, scaling }) = (cfg.norm, cfg.positions)
    else {
        unreachable!("hf_arch checked the family")
    };
    let mut rope = json!({"rope_type": "default", "rope_theta": json_num(theta)});
    if let Some(s) = scaling {
        rope = json!({
            "rope_type": "llama3",
            "rope_theta": json_num(theta),
            "factor": json_num(s.factor),
            "low_freq_factor": json_num(s.low_freq_factor),
            "high_freq_factor": json_num(s.high_freq_factor),
            "original_max_position_embeddings": s.original_max_position_embeddings,
        });
    }
    let mut m = json!({
        "architectures": [class],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads(),
        "head_dim": cfg.head_dim(),
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": json_num(eps),
        "rope_theta": json_num(theta),
        "rope_parameters": rope,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "use_cache": true,
        "torch_dtype": "float32",
    });
    let fields = m.as_object_mut().expect("an object");
    if model_type == "llama" {
        fields.insert("attention_bias".into(), json!(false));
        fields.insert("mlp_bias".into(), json!(false));
    } else {
        fields.insert("use_sliding_window".into(), json!(false));
    }
    Ok(std::mem::take(fields))
}

/// Where one Hugging Face tensor lives in the flat buffer.
#[derive(Clone, Debug)]
pub(super) enum Source {
    /// `range` of the flat buffer as it is (embeddings, norms, biases, the head).
    Slice(Range<usize>),
    /// Columns `col0..col0 + len` of the flat (rows, cols) matrix at `start`, transposed:
    /// the Hugging Face tensor is (len, rows).
    Columns {
        start: usize,
        rows: usize,
        cols: usize,
        col0: usize,
        len: usize,
    },
}

/// One tensor of Hugging Face's state dict.
#[derive(Clone, Debug)]
pub(super) struct HfTensor {
    pub(super) name: String,
    pub(super) shape: Vec<usize>,
    pub(super) source: Source,
}

/// The Hugging Face tensors of a Llama-family model of `cfg` whose flat layout is `views`, in
/// state-dict order.
pub(super) fn hf_tensors(cfg: &GPTConfig, views: &[ParamView]) -> Vec<HfTensor> {
    let (c, hs) = (cfg.d_model, cfg.head_dim());
    let kw = cfg.kv_heads() * hs;
    let mut out = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, source: Source| {
        out.push(HfTensor {
            name,
            shape,
            source,
        })
    };
    for v in views {
        let r = v.range.clone();
        let parts: Vec<&str> = v.name.split('.').collect();
        let cols = |col0: usize, len: usize| Source::Columns {
            start: r.start,
            rows: v.shape[0],
            cols: v.shape[1],
            col0,
            len,
        };
        let slice = |off: usize, len: usize| Source::Slice(r.start + off..r.start + off + len);
        match parts.as_slice() {
            ["wte", "weight"] => push(
                "model.embed_tokens.weight".into(),
                v.shape.clone(),
                slice(0, r.len()),
            ),
            ["ln_f", "weight"] => push(
                "model.norm.weight".into(),
                v.shape.clone(),
                slice(0, r.len()),
            ),
            ["lm_head", "weight"] => {
                push("lm_head.weight".into(), v.shape.clone(), slice(0, r.len()))
            }
            ["h", l, rest @ ..] => {
                let p = |s: &str| format!("model.layers.{l}.{s}");
                match rest {
                    ["ln_1", "weight"] => push(p("input_layernorm.weight"), vec![c], slice(0, c)),
                    ["ln_2", "weight"] => {
                        push(p("post_attention_layernorm.weight"), vec![c], slice(0, c))
                    }
                    ["attn", "c_attn", "weight"] => {
                        push(p("self_attn.q_proj.weight"), vec![c, c], cols(0, c));
                        push(p("self_attn.k_proj.weight"), vec![kw, c], cols(c, kw));
                        push(p("self_attn.v_proj.weight"), vec![kw, c], cols(c + kw, kw));
                    }
                    ["attn", "c_attn", "bias"] => {
                        push(p("self_attn.q_proj.bias"), vec![c], slice(0, c));
                        push(p("self_attn.k_proj.bias"), vec![kw], slice(c, kw));
                        push(p("self_attn.v_proj.bias"), vec![kw], slice(c + kw, kw));
                    }
                    ["attn", "c_proj", "weight"] => {
                        push(p("self_attn.o_proj.weight"), vec![c, c], cols(0, c))
                    }
                    ["mlp", "c_fc", "weight"] => {
                        let f = cfg.d_ff;
                        push(p("mlp.gate_proj.weight"), vec![f, c], cols(0, f));
                        push(p("mlp.up_proj.weight"), vec![f, c], cols(f, f));
                    }
                    ["mlp", "c_proj", "weight"] => {
                        push(p("mlp.down_proj.weight"), vec![c, cfg.d_ff], cols(0, c))
                    }
                    _ => unreachable!("the layout of a Llama has no {}", v.name),
                }
            }
            _ => unreachable!("the layout of a Llama has no {}", v.name),
        }
    }
    out
}

/// The values of `t` gathered from the flat `params`, in Hugging Face's layout.
pub(super) fn gather(params: &[f32], t: &HfTensor) -> Vec<f32> {
    match &t.source {
        Source::Slice(r) => params[r.clone()].to_vec(),
        &Source::Columns {
            start,
            rows,
            cols,
            col0,
            len,
        } => {
            let m = &params[start..start + rows * cols];
            let mut out = vec![0.0; len * rows];
            for (o, row) in out.chunks_exact_mut(rows).enumerate() {
                for (i, x) in row.iter_mut().enumerate() {
                    *x = m[i * cols + col0 + o];
                }
            }
            out
        }
    }
}

/// Writes `data` (Hugging Face's layout of `t`) into the flat `params`.
fn scatter(params: &mut [f32], t: &HfTensor, data: &[f32]) {
    match &t.source {
        Source::Slice(r) => params[r.clone()].copy_from_slice(data),
        &Source::Columns {
            start,
            rows,
            cols,
            col0,
            len,
        } => {
            let m = &mut params[start..start + rows * cols];
            for (o, row) in data.chunks_exact(rows).take(len).enumerate() {
                for (i, &x) in row.iter().enumerate() {
                    m[i * cols + col0 + o] = x;
                }
            }
        }
    }
}

/// Writes model.safetensors of a Llama-family `model` into `dir` under Hugging Face's names;
/// returns its sum.
pub(super) fn write_llama_tensors(dir: &Path, model: &GPT) -> Result<Sum, CheckpointError> {
    let params = model.params();
    let table = hf_tensors(model.config(), model.param_views());
    // The transposed matrices need a copy each (one at a time would need a writer that pulls
    // tensors lazily); a model's worth of copies is what PyTorch's save_pretrained holds too.
    let data: Vec<Vec<f32>> = table.iter().map(|t| gather(params, t)).collect();
    let tensors = table
        .iter()
        .zip(&data)
        .map(|(t, d)| {
            let view = F32View {
                shape: t.shape.clone(),
                data: d,
            };
            (t.name.clone(), view)
        })
        .collect();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_safetensors(&dir.join(MODEL_FILE), tensors, metadata)
}

/// The safetensors files holding the weights of `dir`: model.safetensors, or the files a
/// sharded index names (each once, in name order).
fn weight_files(dir: &Path) -> Result<Vec<String>, CheckpointError> {
    if dir.join(MODEL_FILE).exists() || !dir.join(INDEX_FILE).exists() {
        return Ok(vec![MODEL_FILE.to_string()]);
    }
    let path = dir.join(INDEX_FILE);
    let bytes = read_verified(dir, INDEX_FILE)?;
    let index: Value = serde_json::from_slice(&bytes).map_err(|e| format_err(&path, e))?;
    let map = index
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| format_err(&path, "no weight_map object"))?;
    let mut files: Vec<String> = Vec::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .filter(|f| !f.is_empty() && !f.contains(['/', '\\']) && !f.starts_with('.'))
            .ok_or_else(|| format_err(&path, format!("tensor {name:?}: a bad file name {file}")))?;
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
    }
    files.sort();
    Ok(files)
}

/// Converts stored little-endian values of `dtype` to f32, or None for a dtype not read here.
fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect(),
        _ => return None,
    })
}

/// IEEE half precision to single, exactly.
fn f16_to_f32(h: u16) -> f32 {
    let (sign, exp, man) = (
        (h >> 15) as u32,
        ((h >> 10) & 0x1f) as u32,
        (h & 0x3ff) as u32,
    );
    let bits = match (exp, man) {
        (0, 0) => sign << 31,
        (0, _) => {
            // subnormal: man · 2^-24
            let v = man as f32 * (1.0 / (1u32 << 24) as f32);
            return if sign == 1 { -v } else { v };
        }
        (0x1f, _) => (sign << 31) | (0xff << 23) | (man << 13),
        _ => (sign << 31) | ((exp + 127 - 15) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// Whether `name` is a buffer some Llama files carry that is no parameter (rotary inverse
/// frequencies of older transformers).
fn is_llama_buffer(name: &str) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
}

/// Loads a Llama-family model's weights (model.safetensors or a sharded index; f32, bf16 or
/// f16) from `dir` into `model`. Every tensor is checked before any parameter is written.
pub(super) fn load_llama_params(dir: &Path, model: &mut GPT) -> Result<(), CheckpointError> {
    let table = hf_tensors(model.config(), model.param_views());
    let mut want: HashMap<&str, &HfTensor> = table.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut plan: Vec<(&HfTensor, Vec<f32>)> = Vec::with_capacity(table.len());
    let mut tied_head: Option<(PathBuf, Vec<f32>)> = None;
    for file in weight_files(dir)? {
        let path = dir.join(&file);
        let bytes = read_verified(dir, &file)?;
        let st = parse_safetensors(&path, &bytes)?;
        let mut names: Vec<String> = st.names().into_iter().map(|n| n.to_string()).collect();
        names.sort();
        for name in names {
            let t = st.tensor(&name).map_err(|e| format_err(&path, e))?;
            if is_llama_buffer(&name) {
                continue;
            }
            let values = |t: &safetensors::tensor::TensorView| {
                to_f32(t.dtype(), t.data()).ok_or_else(|| CheckpointError::DtypeMismatch {
                    path: path.clone(),
                    name: name.clone(),
                    found: format!("{:?} (F32, BF16 or F16 are read)", t.dtype()),
                })
            };
            if name == "lm_head.weight" && model.config().tie_word_embeddings {
                tied_head = Some((path.clone(), values(&t)?));
                continue;
            }
            let Some(h) = want.remove(name.as_str()) else {
                return Err(CheckpointError::UnexpectedTensor { path, name });
            };
            if t.shape() != h.shape.as_slice() {
                return Err(CheckpointError::ShapeMismatch {
                    path,
                    name,
                    expected: h.shape.clone(),
                    found: t.shape().to_vec(),
                });
            }
            let v = values(&t)?;
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                return Err(format_err(
                    &path,
                    format!(
                        "tensor {name:?} holds a non-finite value ({} at element {i})",
                        v[i]
                    ),
                ));
            }
            plan.push((h, v));
        }
    }
    if !want.is_empty() {
        let mut names: Vec<String> = want.keys().map(|k| k.to_string()).collect();
        names.sort();
        return Err(CheckpointError::MissingTensors {
            path: dir.join(weight_files(dir)?.remove(0)),
            names,
        });
    }
    if let Some((path, head)) = tied_head {
        // Files written with the head tied may still store it; accept an identical copy only.
        let wte = plan
            .iter()
            .find(|(t, _)| t.name == "model.embed_tokens.weight");
        if wte.map(|(_, d)| d) != Some(&head) {
            return Err(CheckpointError::UntiedHead { path });
        }
    }
    let params = model.params_mut();
    for (t, v) in plan {
        scatter(params, t, &v);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_and_scatter_are_inverse_and_transpose_the_matrices() {
        let cfg = GPTConfig {
            qkv_bias: Some(true),
            tie_word_embeddings: false,
            ..GPTConfig::llama_like(GPTConfig {
                vocab_size: 11,
                max_position_embeddings: 8,
                n_layers: 2,
                n_heads: 4,
                d_model: 8,
                d_ff: 12,
                ..GPTConfig::default()
            })
        };
        let model = GPT::new(cfg.clone(), 3).unwrap();
        let table = hf_tensors(&cfg, model.param_views());
        let total: usize = table
            .iter()
            .map(|t| t.shape.iter().product::<usize>())
            .sum();
        assert_eq!(total, model.num_params());
        let q = table
            .iter()
            .find(|t| t.name == "model.layers.1.self_attn.k_proj.weight");
        let q = q.unwrap();
        assert_eq!(q.shape, vec![4, 8]); // 2 key/value heads of 2
        let data = gather(model.params(), q);
        let view = &model
            .param_views()
            .iter()
            .find(|v| v.name == "h.1.attn.c_attn.weight");
        let w = &model.params()[view.unwrap().range.clone()];
        // k's row o, input i is the flat (C, W) matrix's row i, column C + o
        assert_eq!(data[3 * 8 + 5], w[5 * 16 + 8 + 3]);
        let mut back = vec![0.0; model.num_params()];
        for t in &table {
            scatter(&mut back, t, &gather(model.params(), t));
        }
        assert!(back == model.params());
    }

    #[test]
    fn half_precision_converts_exactly() {
        for (h, f) in [
            (0x3c00u16, 1.0f32),
            (0xc000, -2.0),
            (0x0001, 5.960_464_5e-8),
            (0x7bff, 65504.0),
        ] {
            assert_eq!(f16_to_f32(h), f);
        }
    }

    #[test]
    fn hub_configs_of_both_transformers_versions_read_as_the_family() {
        let path = Path::new("config.json");
        // SmolLM2-135M as transformers 4.x wrote it
        let smol = br#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
            "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-05, "rope_theta": 100000, "rope_scaling": null,
            "tie_word_embeddings": true, "vocab_size": 49152, "hidden_act": "silu",
            "torch_dtype": "bfloat16"}"#;
        let cfg = llama_to_config(path, smol).unwrap();
        assert_eq!((cfg.n_heads, cfg.kv_heads(), cfg.head_dim()), (9, 3, 64));
        assert_eq!(cfg.norm, Norm::RmsNorm { eps: 1e-5 });
        assert_eq!(
            cfg.positions,
            Positions::Rope {
                theta: 1e5,
                scaling: None
            }
        );
        assert!(cfg.tie_word_embeddings && !cfg.has_qkv_bias() && !cfg.is_gpt2());
        // Llama 3.2 1B's scaling, 4.x and 5.x spellings
        let scaling = r#"{"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192"#;
        let base = r#""model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1,
            "max_position_embeddings": 131072, "vocab_size": 10"#;
        let v4 = format!(r#"{{{base}, "rope_theta": 500000.0, "rope_scaling": {scaling}}}}}"#);
        let v5 = format!(r#"{{{base}, "rope_parameters": {scaling}, "rope_theta": 500000.0}}}}"#);
        let a = llama_to_config(path, v4.as_bytes()).unwrap();
        let b = llama_to_config(path, v5.as_bytes()).unwrap();
        assert_eq!(a, b);
        let Positions::Rope {
            theta,
            scaling: Some(s),
        } = a.positions
        else {
            panic!("{:?}", a.positions)
        };
        assert_eq!(
            (theta, s.factor, s.original_max_position_embeddings),
            (5e5, 32.0, 8192)
        );
        // what cohort writes reads back as the same model
        let written = serde_json::to_vec(&llama_config_json(&a).unwrap()).unwrap();
        assert_eq!(llama_to_config(path, &written).unwrap(), a);
        // and what it cannot compute is refused by name
        for (key, value) in [
            ("hidden_act", "\"gelu\""),
            ("mlp_bias", "true"),
            ("attention_bias", "true"),
            ("head_dim", "32"),
        ] {
            let bad = format!(r#"{{{base}, "{key}": {value}}}"#);
            match llama_to_config(path, bad.as_bytes()) {
                Err(CheckpointError::UnsupportedConfig { field, .. }) => assert_eq!(field, key),
                other => panic!("{key}: {other:?}"),
            }
        }
    }
}

//! A Llama GGUF's tensors as Hugging Face's `LlamaForCausalLM` names and lays them out, written
//! to model.safetensors in f32 one tensor at a time (a model's f32 weights need never be in
//! memory at once).
//!
//! Three things differ between the two layouts:
//! - names: `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight`, and so on
//!   ([`hf_name`]);
//! - shapes: ggml lists dimensions fastest first, PyTorch slowest first, so the dims reverse
//!   (the bytes do not move);
//! - the rows of q_proj and k_proj: llama.cpp's convert_hf_to_gguf.py permutes them so that
//!   each head's rotary pairs are adjacent (GPT-J style, what ggml's RoPE rotates), where HF
//!   rotates the first half of a head against the second. [`unpermute_rows`] undoes it.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use safetensors::{Dtype, View};

use super::config::LlamaConfig;
use crate::dequant::Dequantizer;
use crate::error::GgufError;
use crate::reader::{GgufFile, TensorInfo};

/// One block's tensors: (GGUF suffix after `blk.N.`, HF suffix after `model.layers.N.`).
const BLOCK_TENSORS: [(&str, &str); 9] = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
];

/// The Hugging Face name of GGUF tensor `name`, or `None` for a tensor Llama does not have.
pub fn hf_name(name: &str) -> Option<String> {
    match name {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (_, hf) = BLOCK_TENSORS.iter().find(|(g, _)| *g == part)?;
    Some(format!("model.layers.{layer}.{hf}"))
}

/// Every tensor `LlamaForCausalLM` of `cfg` has: (GGUF name, HF shape).
fn expected(cfg: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let (h, q, kv) = (
        cfg.hidden,
        cfg.heads * cfg.head_dim,
        cfg.kv_heads * cfg.head_dim,
    );
    let mut all = vec![
        ("token_embd.weight".to_string(), vec![cfg.vocab, h]),
        ("output_norm.weight".to_string(), vec![h]),
    ];
    if !cfg.tied {
        all.push(("output.weight".to_string(), vec![cfg.vocab, h]));
    }
    for l in 0..cfg.layers {
        let shapes = [
            vec![h],
            vec![q, h],
            vec![kv, h],
            vec![kv, h],
            vec![h, q],
            vec![h],
            vec![cfg.ffn, h],
            vec![cfg.ffn, h],
            vec![h, cfg.ffn],
        ];
        for ((gguf, _), shape) in BLOCK_TENSORS.iter().zip(shapes) {
            all.push((format!("blk.{l}.{gguf}"), shape));
        }
    }
    all
}

/// Undoes llama.cpp's rotary permutation of a q_proj or k_proj weight in place: `rows` rows of
/// `cols` values, in `n_head` heads of `2·half` rows. llama.cpp stored HF row
/// `h·2half + s·half + d` (s the half, d the pair) at row `h·2half + 2d + s`.
pub fn unpermute_rows(w: &mut [f32], rows: usize, cols: usize, n_head: usize) {
    permute(w, rows, cols, n_head, false);
}

/// llama.cpp's permutation itself (HF rows to GGUF rows), the inverse of [`unpermute_rows`].
pub fn permute_rows(w: &mut [f32], rows: usize, cols: usize, n_head: usize) {
    permute(w, rows, cols, n_head, true);
}

/// Moves whole rows of `cols` elements (values, or the bytes of values).
fn permute<T: Copy>(w: &mut [T], rows: usize, cols: usize, n_head: usize, to_gguf: bool) {
    let half = rows / n_head / 2;
    let src = w.to_vec();
    for h in 0..n_head {
        for s in 0..2 {
            for d in 0..half {
                let hf = h * 2 * half + s * half + d;
                let gguf = h * 2 * half + 2 * d + s;
                let (to, from) = if to_gguf { (gguf, hf) } else { (hf, gguf) };
                w[to * cols..(to + 1) * cols].copy_from_slice(&src[from * cols..(from + 1) * cols]);
            }
        }
    }
}

/// One tensor to write: dequantised (and un-permuted) only when the writer asks for its bytes.
struct Lazy<'a> {
    bytes: &'a [u8],
    kernel: Dequantizer,
    shape: Vec<usize>,
    /// The heads whose rotary rows to un-permute (q_proj and k_proj only).
    heads: Option<usize>,
}

impl View for Lazy<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let n: usize = self.shape.iter().product();
        let mut bytes = self.kernel.run_to_le_bytes(self.bytes, n);
        if let Some(heads) = self.heads {
            // Rows of the f32 bytes: the same moves as rows of values.
            permute(&mut bytes, self.shape[0], self.shape[1] * 4, heads, false);
        }
        Cow::Owned(bytes)
    }

    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * 4
    }
}

/// Checks that `file` holds exactly the tensors of `cfg`'s `LlamaForCausalLM`, with their shapes
/// and types this crate dequantises, then writes them, in f32 under HF names, to `out`.
pub fn write_safetensors(file: &GgufFile, cfg: &LlamaConfig, out: &Path) -> Result<(), GgufError> {
    let err = |tensor: &str, reason: String| GgufError::Tensor {
        path: file.path().to_path_buf(),
        tensor: tensor.to_string(),
        reason,
    };
    let expected = expected(cfg);
    let wanted: HashMap<&str, &Vec<usize>> =
        expected.iter().map(|(n, s)| (n.as_str(), s)).collect();
    for t in file.tensors() {
        if !wanted.contains_key(t.name.as_str()) {
            return Err(err(
                &t.name,
                match hf_name(&t.name) {
                    Some(_) => format!("not in a {}-layer Llama", cfg.layers),
                    None => "not a tensor of Llama (LlamaForCausalLM) this converter knows".into(),
                },
            ));
        }
    }
    let mut tensors = Vec::with_capacity(expected.len());
    for (name, shape) in &expected {
        let t: &TensorInfo = file
            .tensor(name)
            .ok_or_else(|| err(name, "missing".into()))?;
        if t.shape() != *shape {
            return Err(err(
                name,
                format!("shape {:?}, expected {shape:?}", t.shape()),
            ));
        }
        let heads = if name.ends_with(".attn_q.weight") {
            Some(cfg.heads)
        } else if name.ends_with(".attn_k.weight") {
            Some(cfg.kv_heads)
        } else {
            None
        };
        let lazy = Lazy {
            kernel: file.dequantizer(t)?,
            bytes: file.tensor_bytes(t)?,
            shape: shape.clone(),
            heads,
        };
        // `expected` only holds names `hf_name` maps.
        tensors.push((hf_name(name).unwrap_or_default(), lazy));
    }
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(tensors, Some(meta), out).map_err(|source| {
        GgufError::Safetensors {
            path: out.to_path_buf(),
            source,
        }
    })?;
    // safetensors writes through a private temporary file (mode 0600); the model is as readable
    // as the other files of the directory.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::Permissions::from_mode(0o644);
        std::fs::set_permissions(out, mode).map_err(GgufError::io("chmod", out))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_as_transformers_expects() {
        assert_eq!(
            hf_name("token_embd.weight").unwrap(),
            "model.embed_tokens.weight"
        );
        assert_eq!(
            hf_name("blk.12.attn_k.weight").unwrap(),
            "model.layers.12.self_attn.k_proj.weight"
        );
        assert_eq!(
            hf_name("blk.0.ffn_norm.weight").unwrap(),
            "model.layers.0.post_attention_layernorm.weight"
        );
        assert_eq!(hf_name("output.weight").unwrap(), "lm_head.weight");
        assert_eq!(hf_name("blk.x.attn_q.weight"), None);
        assert_eq!(hf_name("blk.0.attn_q.bias"), None);
        assert_eq!(hf_name("rope_freqs.weight"), None);
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // 3 heads of 4 rows (2 pairs), 2 columns; every value distinct.
        let (rows, cols, heads) = (12, 2, 3);
        let hf: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let mut w = hf.clone();
        permute_rows(&mut w, rows, cols, heads);
        assert_ne!(w, hf);
        // Head 0 of HF is rows [r0 r1 | r2 r3] (first half, second half); llama.cpp interleaves
        // the halves: r0 r2 r1 r3.
        assert_eq!(&w[..8], &[0., 1., 4., 5., 2., 3., 6., 7.]);
        unpermute_rows(&mut w, rows, cols, heads);
        assert_eq!(w, hf);
    }

    #[test]
    fn unpermute_matches_transformers_reverse_permute() {
        // transformers: w.reshape(n_head, half, 2, cols).swapaxes(2, 1).reshape(rows, cols), so
        // HF row (h, s, d) is GGUF row (h, d, s).
        let (rows, cols, heads) = (16, 3, 2);
        let gguf: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.5).collect();
        let mut w = gguf.clone();
        unpermute_rows(&mut w, rows, cols, heads);
        let half = rows / heads / 2;
        for h in 0..heads {
            for s in 0..2 {
                for d in 0..half {
                    let hf_row = (h * 2 + s) * half + d;
                    let gguf_row = (h * half + d) * 2 + s;
                    assert_eq!(w[hf_row * cols..][..cols], gguf[gguf_row * cols..][..cols]);
                }
            }
        }
    }
}

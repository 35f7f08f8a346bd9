//! `cohort convert`: a GGUF file (llama.cpp's format) as a Hugging Face model directory. Wiring
//! only: parse flags, call cohort-gguf, print what was converted.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;

/// Convert a Llama GGUF file (F32, F16, BF16, Q8_0, Q4_0, Q4_1 tensors) into a Hugging Face
/// LlamaForCausalLM directory: config.json, model.safetensors (f32), tokenizer.json and
/// tokenizer_config.json (with the chat template), generation_config.json.
#[derive(clap::Args, Debug)]
pub struct ConvertArgs {
    /// The GGUF file.
    #[arg(value_name = "FILE.gguf")]
    file: PathBuf,
    /// The directory to write (must not exist, or be empty); written whole or not at all.
    #[arg(long)]
    out: PathBuf,
}

pub fn main(a: ConvertArgs) -> anyhow::Result<()> {
    let start = Instant::now();
    let c = cohort_gguf::convert_to_hf(&a.file, &a.out).with_context(|| {
        format!(
            "cohort convert {} --out {}",
            a.file.display(),
            a.out.display()
        )
    })?;
    let m = &c.config;
    let types: Vec<String> = c
        .tensor_types
        .iter()
        .map(|(t, n)| format!("{t} {n}"))
        .collect();
    println!(
        "converted {} ({}) into {}",
        a.file.display(),
        c.name.as_deref().unwrap_or("unnamed"),
        c.out.display()
    );
    println!(
        "  {} -> LlamaForCausalLM: {} layers, d {}, {} heads / {} kv heads, ffn {}, vocab {}, \
         context {}, {} head, {:.1}M parameters",
        c.architecture,
        m.layers,
        m.hidden,
        m.heads,
        m.kv_heads,
        m.ffn,
        m.vocab,
        m.context,
        if m.tied { "tied" } else { "untied" },
        c.parameters as f64 / 1e6
    );
    println!(
        "  tensors: {} ({}), written as f32 in {:.1} s",
        c.tensor_types.values().sum::<usize>(),
        types.join(", "),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

//! cohort's own GPT checkpoints as a backend (`platform: "cohort_gpt"`): one input,
//! `input_ids` (INT64 `[batch, seq]`), and two outputs, `logits` (FP32 `[batch, seq, vocab]`)
//! and `next_token` (INT64 `[batch]`, the argmax after each row's last position). Each instance
//! owns a copy of the parameters and its own engine thread pool, and is also the decoder the
//! generate extension steps (see the `model` module). This module never reads a request off
//! the wire and never writes to the checkpoint.

use std::path::{Path, PathBuf};

use cohort_engine::cpu::Cpu;
use cohort_gpt::checkpoint;
use cohort_gpt::GPT;

use super::{Backend, Instance, Loaded, Version};
use crate::config::ModelConfig;
use crate::error::ServeError;
use crate::tensor::{DataType, Request, Tensor, TensorSpec, INPUT_IDS, LOGITS, NEXT_TOKEN};
use crate::text::TextCodec;

/// The tensors of a GPT with vocabulary `vocab` (-1: not known yet, for checking a config
/// before its checkpoint is read).
pub(crate) fn tensors(vocab: i64) -> (Vec<TensorSpec>, Vec<TensorSpec>) {
    (
        vec![TensorSpec::new(INPUT_IDS, DataType::Int64, vec![-1, -1])],
        vec![
            TensorSpec::new(LOGITS, DataType::Fp32, vec![-1, -1, vocab]),
            TensorSpec::new(NEXT_TOKEN, DataType::Int64, vec![-1]),
        ],
    )
}

/// Checks a config's declared tensors against a GPT's, before its checkpoint (and so its
/// vocabulary) is read.
pub(crate) fn check_config(cfg: &ModelConfig) -> Result<(), String> {
    let (inputs, outputs) = tensors(-1);
    super::check_section("input", &cfg.input, &inputs)?;
    super::check_section("output", &cfg.output, &outputs)
}

/// A loaded GPT checkpoint.
pub(crate) struct GptBackend {
    inputs: Vec<TensorSpec>,
    outputs: Vec<TensorSpec>,
    vocab: usize,
    max_seq: usize,
    /// The resolved checkpoint directory (its text codec is read from there).
    dir: PathBuf,
    /// The ids generation stops at.
    eos: Vec<u32>,
}

impl Backend for GptBackend {
    fn inputs(&self) -> &[TensorSpec] {
        &self.inputs
    }

    fn outputs(&self) -> &[TensorSpec] {
        &self.outputs
    }

    fn check(&self, request: &Request) -> Result<(), ServeError> {
        let ids = &request.inputs[0];
        let seq = ids.shape[1];
        if seq < 1 || seq > self.max_seq {
            return Err(ServeError::Shape {
                tensor: INPUT_IDS.into(),
                shape: ids.wire_shape(),
                reason: format!(
                    "seq must be in 1..={} (the model's max_position_embeddings)",
                    self.max_seq
                ),
            });
        }
        for (index, value) in ids.i64s().unwrap_or_default().into_iter().enumerate() {
            if value < 0 || value as u64 >= self.vocab as u64 {
                return Err(ServeError::TokenOutOfRange {
                    tensor: INPUT_IDS.into(),
                    index,
                    value,
                    vocab: self.vocab,
                });
            }
        }
        Ok(())
    }

    fn text(&self) -> Result<TextCodec, String> {
        TextCodec::load(&self.dir)
    }

    fn eos_ids(&self) -> Vec<u32> {
        self.eos.clone()
    }

    fn chat_template(&self) -> Result<std::sync::Arc<cohort_tokenizer::ChatTemplate>, String> {
        cohort_tokenizer::ChatTemplate::from_dir(&self.dir)
            .map(std::sync::Arc::new)
            .map_err(|e| e.to_string())
    }
}

/// One GPT instance.
struct GptInstance {
    gpt: GPT,
}

impl Instance for GptInstance {
    fn execute(&mut self, inputs: &[Tensor], want: &[bool]) -> Result<Vec<Option<Tensor>>, String> {
        let ids = &inputs[0];
        let (rows, seq) = (ids.shape[0], ids.shape[1]);
        // the backend's check put every id inside the vocabulary
        let tokens: Vec<u32> = ids
            .i64s()
            .ok_or("input_ids is not INT64")?
            .into_iter()
            .map(|v| v as u32)
            .collect();
        self.gpt
            .forward(cohort_gpt::Forward::new(&tokens, rows, seq))
            .map_err(|e| e.to_string())?;
        let vocab = self.gpt.config().vocab_size;
        let logits = self.gpt.logits();
        let next_token = want[1].then(|| {
            let ids: Vec<i64> = logits
                .chunks_exact(seq * vocab)
                .map(|row| cohort_gpt::sample::argmax(&row[(seq - 1) * vocab..]) as i64)
                .collect();
            Tensor::from_i64(vec![rows], &ids)
        });
        let logits = want[0].then(|| Tensor::from_f32(vec![rows, seq, vocab], logits));
        Ok(vec![logits, next_token])
    }

    fn decoder(&self) -> Option<&GPT> {
        Some(&self.gpt)
    }
}

/// Reads the checkpoint in `version_dir` (a checkpoint, or a root whose `latest` is served)
/// and builds `count` instances of `threads` engine threads each.
pub(crate) fn load(
    what: &Version<'_>,
    version_dir: &Path,
    cfg: &ModelConfig,
    count: usize,
    threads: usize,
) -> Result<Loaded, ServeError> {
    let load_err = |source| ServeError::Load {
        model: what.model.to_string(),
        version: what.version,
        source: Box::new(source),
    };
    let dir = checkpoint::resolve(version_dir).map_err(load_err)?;
    let gpt_cfg = checkpoint::load_config(&dir).map_err(load_err)?;
    // A malformed generation_config.json is refused at load, naming the file, rather than
    // generating past the model's end of text. An id outside the vocabulary (GPT-2's 50256
    // left in a small model's config.json) can never be generated: it is dropped, not fatal.
    let mut eos = cohort_pretrained::eos_token_ids(&dir).map_err(|e| what.error(e.to_string()))?;
    eos.retain(|&id| (id as usize) < gpt_cfg.vocab_size);
    let build = |i: usize| -> Result<GPT, ServeError> {
        let cpu = Cpu::new(threads).map_err(|e| ServeError::Instance {
            model: what.model.to_string(),
            reason: format!("instance {i}: {e}"),
        })?;
        let mut gpt =
            GPT::with_backend(gpt_cfg.clone(), 0, Box::new(cpu)).map_err(|e| load_err(e.into()))?;
        gpt.set_training(false);
        Ok(gpt)
    };
    let mut first = build(0)?;
    checkpoint::load_params_into(&dir, &mut first).map_err(load_err)?;
    let mut gpts = vec![first];
    for i in 1..count {
        let mut g = build(i)?;
        g.params_mut().copy_from_slice(gpts[0].params());
        gpts.push(g);
    }
    let (inputs, outputs) = tensors(gpt_cfg.vocab_size as i64);
    let backend = GptBackend {
        inputs,
        outputs,
        vocab: gpt_cfg.vocab_size,
        max_seq: gpt_cfg.max_position_embeddings,
        dir,
        eos,
    };
    super::check_declared(cfg, &backend).map_err(|e| what.error(e))?;
    Ok(Loaded {
        backend: Box::new(backend),
        instances: gpts
            .into_iter()
            .map(|gpt| Box::new(GptInstance { gpt }) as Box<dyn Instance>)
            .collect(),
    })
}

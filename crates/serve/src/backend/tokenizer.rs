//! Text <-> token ids as a model (`backend: "cohort_tokenizer"`), so that a pipeline such as
//! tokenizer -> GPT -> detokenizer is served as one ensemble, as Triton users serve one with a
//! Python tokenizer model. The version directory holds a Hugging Face `tokenizer.json`, or else
//! a character-level `vocab.json` (what older cohort checkpoints carry).
//!
//! As for Triton's Python models, the config declares the tensors, one input and one output,
//! and their datatypes say which way the model goes:
//!
//! ```text
//! backend: "cohort_tokenizer"            # encode: one text per row -> its ids
//! max_batch_size: 1
//! input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
//! output [ { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] } ]
//!
//! backend: "cohort_tokenizer"            # decode: each row's ids -> one text
//! max_batch_size: 8
//! input [ { name: "ids" data_type: TYPE_INT64 dims: [ -1 ] } ]
//! output [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
//! ```
//!
//! Encoding gives each row as many ids as its text has tokens; an INT64 tensor is rectangular,
//! so the rows of one request must encode to the same length (the request is refused, naming
//! the rows, otherwise), and `dynamic_batching` is refused for an encoder, since it would join
//! other clients' texts into one tensor. Nothing is padded: a pad id would change what the
//! model downstream computes. A decoder's input may also be one id per row, `dims: [ 1 ]` with
//! `reshape: { shape: [ ] }` (a GPT's `next_token`, INT64 `[batch]`). Decoding joins a row's
//! ids into one text; it batches freely.
//!
//! Every failure a request can cause (text that is not UTF-8, a character the vocabulary lacks,
//! an id outside it, rows of different lengths) is found by [`Backend::check`], before the
//! request is queued, and answered as a bad request naming the tensor. This module never reads
//! a request off the wire and never writes to the repository.

use std::path::Path;
use std::sync::Arc;

use cohort_tokenizer::char_vocab::{CharVocab, VOCAB_FILE};
use cohort_tokenizer::{Tokenizer, TOKENIZER_FILE};

use super::{Backend, Instance, Loaded, Version};
use crate::config::{ModelConfig, TensorConfig};
use crate::error::ServeError;
use crate::tensor::{DataType, Request, Tensor, TensorSpec};
use crate::text::TextCodec;

/// Which way a tokenizer model goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// BYTES text -> INT64 ids.
    Encode,
    /// INT64 ids -> BYTES text.
    Decode,
}

/// What a tokenizer model's config declares: its direction and its two tensors.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    pub mode: Mode,
    pub input: TensorSpec,
    pub output: TensorSpec,
}

/// The usage line every layout error ends with.
const USAGE: &str = "a cohort_tokenizer model declares one input and one output: TYPE_STRING \
                     text (dims [1]) -> TYPE_INT64 ids (dims [-1]) encodes, TYPE_INT64 ids \
                     (dims [-1], or [1] with reshape { shape: [] }) -> TYPE_STRING text (dims \
                     [1]) decodes";

/// Whether `t` says its one element per row is a scalar (`dims: [1]`, `reshape: { shape: [] }`,
/// as Triton writes a `[batch]` tensor).
fn scalar_per_row(t: &TensorConfig) -> bool {
    let empty_reshape = t.reshape.as_ref().is_some_and(|r| {
        r.get("shape")
            .is_none_or(|s| s.as_array().is_some_and(Vec::is_empty))
    });
    t.dims == [1] && empty_reshape
}

/// Checks that `cfg` declares a layout a tokenizer can serve (the config is where a tokenizer
/// model's tensors come from).
pub(crate) fn check_config(cfg: &ModelConfig) -> Result<(), String> {
    layout(cfg).map(|_| ())
}

/// The layout `cfg` declares, or why it declares none a tokenizer can serve.
pub(crate) fn layout(cfg: &ModelConfig) -> Result<Layout, String> {
    let ([input], [output]) = (&cfg.input[..], &cfg.output[..]) else {
        return Err(format!(
            "{USAGE}; this config declares {} input(s) and {} output(s)",
            cfg.input.len(),
            cfg.output.len()
        ));
    };
    let datatype = |t: &TensorConfig, section: &str| {
        let dt = t
            .data_type
            .as_deref()
            .ok_or_else(|| format!("{section} {:?} needs a data_type; {USAGE}", t.name))?;
        DataType::from_triton(dt)
            .filter(|d| matches!(d, DataType::Bytes | DataType::Int64))
            .ok_or_else(|| format!("{section} {:?} has data_type {dt}; {USAGE}", t.name))
    };
    let (din, dout) = (datatype(input, "input")?, datatype(output, "output")?);
    let spec = |t: &TensorConfig, shape: Vec<i64>, datatype| TensorSpec {
        name: t.name.clone(),
        datatype,
        shape,
    };
    let dims_err = |t: &TensorConfig, section: &str| {
        Err(format!(
            "{section} {:?} has dims {:?}; {USAGE}",
            t.name, t.dims
        ))
    };
    match (din, dout) {
        (DataType::Bytes, DataType::Int64) => {
            if input.dims != [1] || scalar_per_row(input) {
                return dims_err(input, "input");
            }
            if output.dims != [-1] {
                return dims_err(output, "output");
            }
            if cfg.dynamic_batching.is_some() {
                return Err(format!(
                    "an encoding cohort_tokenizer model cannot have dynamic_batching: texts \
                     encode to different numbers of ids, so requests joined into one batch \
                     would not fit one INT64 tensor (input {:?} -> output {:?})",
                    input.name, output.name
                ));
            }
            Ok(Layout {
                mode: Mode::Encode,
                input: spec(input, vec![-1, 1], DataType::Bytes),
                output: spec(output, vec![-1, -1], DataType::Int64),
            })
        }
        (DataType::Int64, DataType::Bytes) => {
            let shape = if scalar_per_row(input) {
                vec![-1]
            } else if input.dims.len() == 1 && (input.dims[0] == -1 || input.dims[0] > 0) {
                vec![-1, input.dims[0]]
            } else {
                return dims_err(input, "input");
            };
            if output.dims != [1] || scalar_per_row(output) {
                return dims_err(output, "output");
            }
            Ok(Layout {
                mode: Mode::Decode,
                input: spec(input, shape, DataType::Int64),
                output: spec(output, vec![-1, 1], DataType::Bytes),
            })
        }
        _ => Err(format!(
            "input {:?} is {} and output {:?} is {}; {USAGE}",
            input.name,
            din.triton(),
            output.name,
            dout.triton()
        )),
    }
}

/// The vocabulary a tokenizer model was loaded with.
enum Codec {
    Tokenizer(Box<Tokenizer>),
    Chars(CharVocab),
}

impl Codec {
    /// The codec in `dir`: its tokenizer.json, else its vocab.json.
    fn load(dir: &Path) -> Result<Codec, String> {
        let tokenizer = dir.join(TOKENIZER_FILE);
        if tokenizer.is_file() {
            return Tokenizer::from_file(&tokenizer)
                .map(|t| Codec::Tokenizer(Box::new(t)))
                .map_err(|e| e.to_string());
        }
        match CharVocab::load(dir) {
            Ok(Some(v)) => Ok(Codec::Chars(v)),
            Ok(None) => Err(format!(
                "{} has neither {TOKENIZER_FILE} nor {VOCAB_FILE}",
                dir.display()
            )),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Ids 0..this are in the vocabulary.
    fn vocab_size(&self) -> usize {
        match self {
            Codec::Tokenizer(t) => t.vocab_size(),
            Codec::Chars(v) => v.len(),
        }
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        match self {
            Codec::Tokenizer(t) => t.encode(text).map_err(|e| e.to_string()),
            Codec::Chars(v) => v.encode(text).map_err(|e| e.to_string()),
        }
    }

    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        match self {
            Codec::Tokenizer(t) => t.decode(ids).map_err(|e| e.to_string()),
            Codec::Chars(v) => v.decode(ids).map_err(|e| e.to_string()),
        }
    }
}

/// A loaded tokenizer model.
struct TokenizerBackend {
    model: String,
    mode: Mode,
    inputs: Vec<TensorSpec>,
    outputs: Vec<TensorSpec>,
    codec: Arc<Codec>,
}

impl Backend for TokenizerBackend {
    fn inputs(&self) -> &[TensorSpec] {
        &self.inputs
    }

    fn outputs(&self) -> &[TensorSpec] {
        &self.outputs
    }

    /// Does the whole work once and keeps only the verdict: tokenizing is cheap next to the
    /// model it feeds, and every way it can fail is the request's fault, which must be a bad
    /// request answered before queueing rather than a failed execution.
    fn check(&self, request: &Request) -> Result<(), ServeError> {
        run(
            &self.model,
            self.mode,
            &self.codec,
            &self.inputs[0],
            &request.inputs[0],
        )
        .map(|_| ())
    }

    fn text(&self) -> Result<TextCodec, String> {
        Err("a tokenizer model does not generate text; a GPT model does".into())
    }
}

/// Encodes or decodes `input` (the checked tensor of `spec`), row by row.
fn run(
    model: &str,
    mode: Mode,
    codec: &Codec,
    spec: &TensorSpec,
    input: &Tensor,
) -> Result<Tensor, ServeError> {
    let rows = input.shape[0];
    let bad = |reason: String| ServeError::Bytes {
        tensor: spec.name.clone(),
        reason,
    };
    match mode {
        Mode::Encode => {
            let texts = input
                .byte_elements()
                .ok_or_else(|| bad("is not BYTES".into()))?;
            let mut ids: Vec<i64> = Vec::new();
            let mut seq = None;
            for (row, bytes) in texts.into_iter().enumerate() {
                let text = std::str::from_utf8(bytes).map_err(|e| {
                    bad(format!(
                        "element {row} is not UTF-8 (invalid byte at offset {}), and text is \
                         needed to tokenize",
                        e.valid_up_to()
                    ))
                })?;
                let row_ids = codec.encode(text).map_err(|reason| ServeError::Text {
                    model: model.to_string(),
                    reason: format!("{}[{row}]: {reason}", spec.name),
                })?;
                match seq {
                    None => seq = Some(row_ids.len()),
                    Some(n) if n != row_ids.len() => {
                        return Err(bad(format!(
                            "row 0 encodes to {n} ids and row {row} to {}; the ids of one \
                             request form one INT64 tensor, so its texts must encode to the \
                             same length (send them in separate requests)",
                            row_ids.len()
                        )))
                    }
                    Some(_) => {}
                }
                ids.extend(row_ids.into_iter().map(i64::from));
            }
            Ok(Tensor::from_i64(vec![rows, seq.unwrap_or(0)], &ids))
        }
        Mode::Decode => {
            let ids = input.i64s().ok_or_else(|| bad("is not INT64".into()))?;
            let vocab = codec.vocab_size();
            if let Some((index, &value)) = ids
                .iter()
                .enumerate()
                .find(|(_, &v)| v < 0 || v as u64 >= vocab as u64)
            {
                return Err(ServeError::TokenOutOfRange {
                    tensor: spec.name.clone(),
                    index,
                    value,
                    vocab,
                });
            }
            let per_row: usize = input.shape[1..].iter().product();
            let mut texts = Vec::with_capacity(rows);
            for row in 0..rows {
                // the range check above put every id in u32
                let row_ids: Vec<u32> = ids[row * per_row..(row + 1) * per_row]
                    .iter()
                    .map(|&v| v as u32)
                    .collect();
                texts.push(codec.decode(&row_ids).map_err(|reason| ServeError::Text {
                    model: model.to_string(),
                    reason: format!("{}[{row}]: {reason}", spec.name),
                })?);
            }
            Ok(Tensor::from_bytes(vec![rows, 1], &texts))
        }
    }
}

/// One tokenizer instance (they share the read-only vocabulary).
struct TokenizerInstance {
    model: String,
    mode: Mode,
    spec: TensorSpec,
    codec: Arc<Codec>,
}

impl Instance for TokenizerInstance {
    fn execute(&mut self, inputs: &[Tensor], want: &[bool]) -> Result<Vec<Option<Tensor>>, String> {
        let input = inputs.first().ok_or("no input tensor")?;
        let out = run(&self.model, self.mode, &self.codec, &self.spec, input)
            .map_err(|e| e.to_string())?;
        Ok(vec![want.first().copied().unwrap_or(true).then_some(out)])
    }
}

/// Reads the vocabulary in `version_dir` and builds `count` instances.
pub(crate) fn load(
    what: &Version<'_>,
    version_dir: &Path,
    cfg: &ModelConfig,
    count: usize,
) -> Result<Loaded, ServeError> {
    let layout = layout(cfg).map_err(|e| what.error(e))?;
    let codec = Arc::new(Codec::load(version_dir).map_err(|e| what.error(e))?);
    let backend = TokenizerBackend {
        model: what.model.to_string(),
        mode: layout.mode,
        inputs: vec![layout.input.clone()],
        outputs: vec![layout.output],
        codec: codec.clone(),
    };
    let instances = (0..count)
        .map(|_| {
            Box::new(TokenizerInstance {
                model: what.model.to_string(),
                mode: layout.mode,
                spec: layout.input.clone(),
                codec: codec.clone(),
            }) as Box<dyn Instance>
        })
        .collect();
    Ok(Loaded {
        backend: Box::new(backend),
        instances,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> Result<ModelConfig, String> {
        ModelConfig::from_pbtxt(
            &format!("backend: \"cohort_tokenizer\"\nmax_batch_size: 4\n{text}"),
            Path::new("config.pbtxt"),
        )
        .map_err(|e| e.to_string())
    }

    const ENCODE: &str = "input [ { name: \"TEXT\" data_type: TYPE_STRING dims: [ 1 ] } ]\n\
                          output [ { name: \"IDS\" data_type: TYPE_INT64 dims: [ -1 ] } ]\n";
    const DECODE_ONE: &str = "input [ { name: \"ID\" data_type: TYPE_INT64 dims: [ 1 ] \
                              reshape: { shape: [ ] } } ]\n\
                              output [ { name: \"TEXT\" data_type: TYPE_STRING dims: [ 1 ] } ]\n";

    #[test]
    fn the_declared_datatypes_say_the_direction_and_bad_layouts_are_refused_by_name() {
        let enc = layout(&config(ENCODE).unwrap()).unwrap();
        assert_eq!(enc.mode, Mode::Encode);
        assert_eq!(
            (enc.input.shape, enc.output.shape),
            (vec![-1, 1], vec![-1, -1])
        );
        let dec = layout(&config(DECODE_ONE).unwrap()).unwrap();
        assert_eq!(dec.mode, Mode::Decode);
        assert_eq!((dec.input.shape, dec.output.shape), (vec![-1], vec![-1, 1]));
        let dec = layout(
            &config(&DECODE_ONE.replace("dims: [ 1 ] reshape: { shape: [ ] }", "dims: [ -1 ]"))
                .unwrap(),
        )
        .unwrap();
        assert_eq!(dec.input.shape, [-1, -1]);

        for (text, needle) in [
            ("", "declares 0 input(s) and 0 output(s)"),
            (
                &ENCODE.replace("TYPE_INT64", "TYPE_STRING"),
                "input \"TEXT\" is TYPE_STRING and output \"IDS\" is TYPE_STRING",
            ),
            (
                &ENCODE.replace("TYPE_INT64", "TYPE_FP32"),
                "output \"IDS\" has data_type TYPE_FP32",
            ),
            (
                &ENCODE.replace("dims: [ 1 ]", "dims: [ 2 ]"),
                "input \"TEXT\" has dims [2]",
            ),
            (
                &format!("{ENCODE}dynamic_batching {{ }}\n"),
                "cannot have dynamic_batching",
            ),
        ] {
            let err = config(text).unwrap_err();
            assert!(err.contains(needle), "{needle:?} not in {err:?}");
            assert!(err.contains("config.pbtxt"), "{err}");
        }
        // a decoder batches freely
        config(&format!("{DECODE_ONE}dynamic_batching {{ }}\n")).unwrap();
    }

    #[test]
    fn encode_and_decode_round_trip_and_refuse_what_they_cannot_do() {
        let codec = Codec::Tokenizer(Box::new(Tokenizer::char_level("abc é".chars())));
        let enc = layout(&config(ENCODE).unwrap()).unwrap();
        let text = Tensor::from_bytes(vec![2, 1], &["ab é", "cab "]);
        let ids = run("tok", Mode::Encode, &codec, &enc.input, &text).unwrap();
        assert_eq!(ids.shape, [2, 4]);
        let dec = layout(
            &config(&DECODE_ONE.replace("dims: [ 1 ] reshape: { shape: [ ] }", "dims: [ -1 ]"))
                .unwrap(),
        )
        .unwrap();
        let back = run("tok", Mode::Decode, &codec, &dec.input, &ids).unwrap();
        assert_eq!(back, text);

        let uneven = Tensor::from_bytes(vec![2, 1], &["ab", "abc"]);
        let err = run("tok", Mode::Encode, &codec, &enc.input, &uneven).unwrap_err();
        assert!(
            err.to_string()
                .contains("row 0 encodes to 2 ids and row 1 to 3"),
            "{err}"
        );
        let bad_utf8 = Tensor::from_bytes(vec![1, 1], &[&b"a\xff"[..]]);
        let err = run("tok", Mode::Encode, &codec, &enc.input, &bad_utf8).unwrap_err();
        assert!(
            err.to_string()
                .contains("\"TEXT\": element 0 is not UTF-8 (invalid byte at offset 1)"),
            "{err}"
        );
        let unknown = Tensor::from_bytes(vec![1, 1], &["abz"]);
        let err = run("tok", Mode::Encode, &codec, &enc.input, &unknown).unwrap_err();
        assert!(err.to_string().contains("TEXT[0]"), "{err}");
        let out_of_vocab = Tensor::from_i64(vec![1, 2], &[1, 9]);
        let err = run("tok", Mode::Decode, &codec, &dec.input, &out_of_vocab).unwrap_err();
        assert!(
            err.to_string()
                .contains("ID[1] = 9 is outside the vocabulary 0..5"),
            "{err}"
        );
    }

    #[test]
    fn a_version_directory_gives_its_tokenizer_json_else_its_vocab_json() {
        let dir = tempfile::tempdir().unwrap();
        let err = Codec::load(dir.path()).err().unwrap();
        assert!(
            err.contains("has neither tokenizer.json nor vocab.json"),
            "{err}"
        );
        let vocab = CharVocab::new("xyz".chars()).unwrap();
        std::fs::write(dir.path().join(VOCAB_FILE), vocab.to_json()).unwrap();
        let chars = Codec::load(dir.path()).unwrap();
        assert!(matches!(chars, Codec::Chars(_)));
        assert_eq!(chars.vocab_size(), 3);
        assert_eq!(chars.decode(&chars.encode("zyx").unwrap()).unwrap(), "zyx");
        let tok = Tokenizer::char_level("ab".chars());
        tok.save(dir.path().join(TOKENIZER_FILE)).unwrap();
        let hf = Codec::load(dir.path()).unwrap();
        assert!(matches!(hf, Codec::Tokenizer(_)));
        assert_eq!(hf.vocab_size(), 2);
        std::fs::write(dir.path().join(TOKENIZER_FILE), "{").unwrap();
        let err = Codec::load(dir.path()).err().unwrap();
        assert!(err.contains("tokenizer.json"), "{err}");
    }
}

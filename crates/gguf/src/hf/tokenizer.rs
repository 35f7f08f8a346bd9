//! tokenizer.json and tokenizer_config.json rebuilt from a GGUF file's `tokenizer.*` metadata.
//!
//! A GGUF carries no tokenizer.json: it stores the vocabulary (`tokenizer.ggml.tokens`, the id is
//! the index), the merges, each token's type (1 normal, 3 control, 4 user-defined...), the
//! special ids, and under `tokenizer.ggml.pre` the name of the pre-tokenizer llama.cpp applies
//! (its `llama-vocab.cpp`). The BPE pieces are the same as Hugging Face's; what this module adds
//! back is the pipeline around them, as the model's own tokenizer.json spells it:
//!
//! - byte-level BPE (`tokenizer.ggml.model` "gpt2"); other models (sentencepiece "llama", ...)
//!   are refused, as is a pre-tokenizer not in [`pre_tokenizer`]'s table;
//! - control tokens become special added tokens (never split, skipped when decoding with
//!   `skip_special_tokens`), user-defined ones plain added tokens, as transformers' own GGUF
//!   loader does (`integrations/gguf/gguf_tokenizer_mapping.py`);
//! - `tokenizer.ggml.add_bos_token` becomes a template that prepends BOS.

use serde_json::{json, Map, Value as Json};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, PostProcessorWrapper, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer,
};

use crate::error::GgufError;
use crate::reader::GgufFile;

/// llama.cpp's token types (`llama_token_type`).
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// Llama 3's split (llama.cpp's LLAMA3 pre-tokenizer; its tokenizer.json's `Split`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's split (llama.cpp's QWEN2 pre-tokenizer): Llama 3's with single digits.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer llama.cpp's `tokenizer.ggml.pre` names, as Hugging Face's tokenizer.json of
/// such a model writes it, and whether its BPE skips merging a word that is a whole token
/// (`ignore_merges`, Llama 3's). `None` for a name not handled here.
fn pre_tokenizer(pre: &str) -> Option<(Vec<PreTokenizerWrapper>, bool)> {
    let byte_level =
        |use_regex: bool| -> PreTokenizerWrapper { ByteLevel::new(false, true, use_regex).into() };
    let split = |re: &str| -> Option<PreTokenizerWrapper> {
        let split = Split::new(
            SplitPattern::Regex(re.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        );
        split.ok().map(Into::into)
    };
    Some(match pre {
        // GPT-2's own regex, inside ByteLevel.
        "default" | "gpt2" | "gpt-2" => (vec![byte_level(true)], false),
        // SmolLM (llama.cpp: "\p{N}" then GPT-2's regex): HF's SmolLM2 tokenizer.json has
        // Digits(individual_digits) before the byte-level split.
        "smollm" => (vec![Digits::new(true).into(), byte_level(true)], false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" | "dbrx" | "smaug-bpe" => {
            (vec![split(LLAMA3_SPLIT)?, byte_level(false)], true)
        }
        "qwen2" | "deepseek-r1-qwen" => (vec![split(QWEN2_SPLIT)?, byte_level(false)], false),
        _ => return None,
    })
}

/// GPT-2's byte-to-character table: printable Latin-1 maps to itself, the other bytes to
/// U+0100 onwards, in byte order. Byte-level vocabularies spell every token with these.
fn byte_chars() -> [char; 256] {
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let mut table = ['\0'; 256];
    let mut next = 256;
    for (b, c) in table.iter_mut().enumerate() {
        let b = b as u32;
        let code = if printable(b) {
            b
        } else {
            next += 1;
            next - 1
        };
        *c = char::from_u32(code).unwrap_or('\u{fffd}');
    }
    table
}

/// tokenizer.json and tokenizer_config.json for `file`.
pub fn build(file: &GgufFile, context: usize) -> Result<(String, Json), GgufError> {
    let path = file.path();
    let unsupported = |what: String, reason: &str| GgufError::Unsupported {
        path: path.to_path_buf(),
        what,
        reason: reason.into(),
    };
    let model = file.str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(unsupported(
            format!("tokenizer.ggml.model = {model:?}"),
            "only byte-level BPE (\"gpt2\") tokenizers are converted",
        ));
    }
    let pre = file.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
    let (pre_tokenizers, ignore_merges) = pre_tokenizer(pre).ok_or_else(|| {
        unsupported(
            format!("tokenizer.ggml.pre = {pre:?}"),
            "known: default, gpt-2, smollm, llama3/llama-bpe/llama-v3 (and kin), qwen2",
        )
    })?;
    let missing = |key: &str| GgufError::MissingKey {
        path: path.to_path_buf(),
        key: key.into(),
    };
    let tokens = file
        .opt_strings("tokenizer.ggml.tokens")?
        .ok_or_else(|| missing("tokenizer.ggml.tokens"))?;
    let merges = file
        .opt_strings("tokenizer.ggml.merges")?
        .ok_or_else(|| missing("tokenizer.ggml.merges"))?;
    let types = file
        .opt_ints("tokenizer.ggml.token_type")?
        .unwrap_or_default();
    if !types.is_empty() && types.len() != tokens.len() {
        return Err(GgufError::WrongKey {
            path: path.to_path_buf(),
            key: "tokenizer.ggml.token_type".into(),
            expected: format!("one type per token ({})", tokens.len()),
            found: format!("{} types", types.len()),
        });
    }

    // Tokens are spelled in the byte alphabet; one that is not (a rare llama.cpp export) is
    // respelled from its UTF-8 bytes, as transformers does.
    let chars = byte_chars();
    let in_alphabet = |t: &str| t.chars().all(|c| chars.contains(&c));
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(id, &t)| {
            let spelled = if in_alphabet(t) {
                t.to_string()
            } else {
                t.bytes().map(|b| chars[b as usize]).collect()
            };
            (spelled, id as u32)
        })
        .collect();
    let merges = merges
        .iter()
        .enumerate()
        .map(|(i, m)| match m.split_once(' ') {
            Some((a, b)) => Ok((a.to_string(), b.to_string())),
            None => Err(GgufError::WrongKey {
                path: path.to_path_buf(),
                key: format!("tokenizer.ggml.merges[{i}]"),
                expected: "two tokens separated by a space".into(),
                found: format!("{m:?}"),
            }),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let tok_err = |e: tokenizers::Error| GgufError::Tokenizer {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(tok_err)?;
    let mut tok = Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(Sequence::new(pre_tokenizers)));
    tok.with_decoder(Some(ByteLevelDecoder::default()));

    let special_id = |key: &str| -> Result<Option<(u64, &str)>, GgufError> {
        let Some(id) = file.opt_u64(key)? else {
            return Ok(None);
        };
        match tokens.get(id as usize) {
            Some(&t) => Ok(Some((id, t))),
            None => Err(GgufError::WrongKey {
                path: path.to_path_buf(),
                key: key.into(),
                expected: format!("a token id below {}", tokens.len()),
                found: id.to_string(),
            }),
        }
    };
    let bos = special_id("tokenizer.ggml.bos_token_id")?;
    let eos = special_id("tokenizer.ggml.eos_token_id")?;
    let unk = special_id("tokenizer.ggml.unknown_token_id")?;
    let pad = special_id("tokenizer.ggml.padding_token_id")?;
    let add_bos = file
        .opt_bool("tokenizer.ggml.add_bos_token")?
        .unwrap_or(false);
    let add_eos = file
        .opt_bool("tokenizer.ggml.add_eos_token")?
        .unwrap_or(false);
    let post = post_processor(
        add_bos.then_some(bos).flatten(),
        add_eos.then_some(eos).flatten(),
    )
    .map_err(|reason| GgufError::Tokenizer {
        path: path.to_path_buf(),
        reason,
    })?;
    tok.with_post_processor(Some(post));

    // A control token outside the byte alphabet is a llama.cpp mislabel (it is no BPE piece), and
    // adding it would grow the vocabulary past the model's: skipped, as transformers does.
    let of_type = |want: i64| -> Vec<AddedToken> {
        tokens
            .iter()
            .zip(&types)
            .filter(|&(&t, &ty)| ty == want && in_alphabet(t))
            .map(|(&t, _)| AddedToken::from(t, want == CONTROL).normalized(false))
            .collect()
    };
    tok.add_special_tokens(of_type(CONTROL)).map_err(tok_err)?;
    tok.add_tokens(of_type(USER_DEFINED)).map_err(tok_err)?;
    let json = tok.to_string(true).map_err(tok_err)?;

    let mut config = Map::new();
    config.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    config.insert("add_bos_token".into(), json!(add_bos));
    config.insert("add_eos_token".into(), json!(add_eos));
    for (name, tok) in [
        ("bos_token", bos),
        ("eos_token", eos),
        ("unk_token", unk),
        ("pad_token", pad),
    ] {
        config.insert(name.into(), json!(tok.map(|(_, t)| t)));
    }
    config.insert("clean_up_tokenization_spaces".into(), json!(false));
    config.insert("model_max_length".into(), json!(context));
    if let Some(template) = file.opt_str("tokenizer.chat_template")? {
        config.insert("chat_template".into(), json!(template));
    }
    Ok((json, Json::Object(config)))
}

/// The post-processor: Hugging Face's ByteLevel one (offsets only) when nothing is added, else
/// a template that adds BOS before and/or EOS after each sequence.
fn post_processor(
    bos: Option<(u64, &str)>,
    eos: Option<(u64, &str)>,
) -> Result<PostProcessorWrapper, String> {
    if bos.is_none() && eos.is_none() {
        return Ok(ByteLevel::new(true, false, true).into());
    }
    let around = |seq: &str, type_id: u32| {
        let mut parts = Vec::new();
        parts.extend(bos.map(|(_, t)| format!("{t}:{type_id}")));
        parts.push(format!("{seq}:{type_id}"));
        parts.extend(eos.map(|(_, t)| format!("{t}:{type_id}")));
        parts.join(" ")
    };
    let specials: Vec<(String, u32)> = bos
        .into_iter()
        .chain(eos)
        .map(|(id, t)| (t.to_string(), id as u32))
        .collect();
    let mut b = TemplateProcessing::builder();
    b.try_single(around("$A", 0)).map_err(|e| e.to_string())?;
    b.try_pair(format!("{} {}", around("$A", 0), around("$B", 1)))
        .map_err(|e| e.to_string())?;
    b.special_tokens(specials);
    Ok(b.build().map_err(|e| e.to_string())?.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    fn splits(pre: &str, text: &str) -> Vec<String> {
        let (pres, _) = pre_tokenizer(pre).unwrap();
        let mut s = PreTokenizedString::from(text);
        Sequence::new(pres).pre_tokenize(&mut s).unwrap();
        let splits = s.get_splits(OffsetReferential::Original, OffsetType::None);
        splits.into_iter().map(|(p, _, _)| p.to_string()).collect()
    }

    #[test]
    fn pre_tokenizers_split_digits_as_their_models_do() {
        assert_eq!(splits("gpt-2", "a 12345"), ["a", "Ġ12345"]);
        assert_eq!(
            splits("smollm", "a 12345"),
            ["a", "Ġ", "1", "2", "3", "4", "5"]
        );
        assert_eq!(splits("llama-bpe", "a 12345"), ["a", "Ġ", "123", "45"]);
        assert_eq!(
            splits("qwen2", "a 12345"),
            ["a", "Ġ", "1", "2", "3", "4", "5"]
        );
        assert_eq!(splits("llama3", "I'M fine"), ["I", "'M", "Ġfine"]);
        assert!(pre_tokenizer("jais").is_none());
    }

    #[test]
    fn byte_chars_is_gpt2s_table() {
        let c = byte_chars();
        assert_eq!(
            (c[b'a' as usize], c[b' ' as usize], c[b'\n' as usize]),
            ('a', 'Ġ', 'Ċ')
        );
        assert_eq!((c[0], c[0xad], c[0xff]), ('\u{100}', '\u{143}', 'ÿ'));
        let distinct: std::collections::HashSet<char> = c.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }
}

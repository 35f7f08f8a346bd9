//! `resize_token_embeddings`: grows a model's vocabulary after a tokenizer gained tokens, keeping
//! every existing row and initialising the new ones by a chosen strategy (Hugging Face's
//! `model.resize_token_embeddings`).
//!
//! The model's layout is only read through its public named views; this never changes the
//! input model and knows nothing of tokenizers (a new row's description is token ids).

use crate::{GPTConfig, GptError, GPT};

/// How a new embedding row starts.
#[derive(Debug, Clone, PartialEq)]
pub enum RowInit {
    /// The model's own random init (GPT-2: N(0, 0.02)), drawn from the resize seed.
    Random,
    /// All zeros.
    Zeros,
    /// A copy of an existing token's row (e.g. "entity" for `[ENT_START]`).
    Copy(u32),
    /// The mean of existing tokens' rows: a description's token ids
    /// (`[ENT_START]` := mean of "start of entity").
    Mean(Vec<u32>),
}

/// Why a resize is refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ResizeError {
    /// The new vocabulary is smaller than the current one (rows would be lost).
    #[error("cannot shrink the vocabulary from {old} to {new}: existing rows would be dropped")]
    Shrink {
        /// Current vocabulary size.
        old: usize,
        /// Requested size.
        new: usize,
    },
    /// `init` has neither one strategy nor one per new row.
    #[error("{found} init strategies given for {new_rows} new rows (give 1 or {new_rows})")]
    InitCount {
        /// Strategies given.
        found: usize,
        /// Rows added.
        new_rows: usize,
    },
    /// A strategy refers to a row that is not an existing one.
    #[error("new row {row}: {what} id {id} is not an existing token (vocabulary {old})")]
    SourceRow {
        /// The new row being initialised.
        row: usize,
        /// `copy` or `mean`.
        what: &'static str,
        /// The id at fault.
        id: u32,
        /// Rows that existed before the resize.
        old: usize,
    },
    /// `Mean` of nothing.
    #[error("new row {row}: mean of an empty description")]
    EmptyMean {
        /// The new row.
        row: usize,
    },
    /// Building the resized model failed.
    #[error("building the resized model: {0}")]
    Model(#[from] GptError),
}

/// A copy of `model` with `new_vocab` token rows: rows `0..old` unchanged (in the embedding and,
/// when untied, in the LM head), new rows initialised by `init` (one strategy for all new rows,
/// or one per new row in id order). Random rows are drawn from `seed`. A tied head follows the
/// embedding by construction; an untied head gets the same strategy applied to its own rows.
pub fn resize_token_embeddings(
    model: &GPT,
    new_vocab: usize,
    init: &[RowInit],
    seed: u64,
) -> Result<GPT, ResizeError> {
    let old = model.config().vocab_size;
    if new_vocab < old {
        return Err(ResizeError::Shrink {
            old,
            new: new_vocab,
        });
    }
    let new_rows = new_vocab - old;
    if new_rows > 0 && init.len() != 1 && init.len() != new_rows {
        return Err(ResizeError::InitCount {
            found: init.len(),
            new_rows,
        });
    }
    for (k, strategy) in init.iter().enumerate() {
        let row = if init.len() == 1 { old } else { old + k };
        let ids: &[u32] = match strategy {
            RowInit::Copy(id) => std::slice::from_ref(id),
            RowInit::Mean(ids) if ids.is_empty() => return Err(ResizeError::EmptyMean { row }),
            RowInit::Mean(ids) => ids,
            RowInit::Random | RowInit::Zeros => &[],
        };
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= old) {
            let what = if matches!(strategy, RowInit::Copy(_)) {
                "copy"
            } else {
                "mean"
            };
            return Err(ResizeError::SourceRow { row, what, id, old });
        }
    }
    let config = GPTConfig {
        vocab_size: new_vocab,
        ..model.config().clone()
    };
    let c = config.d_model;
    // The fresh model supplies the random rows (and is the destination).
    let mut resized = GPT::new(config, seed)?;
    let src = model.params();
    let views: Vec<_> = resized.param_views().to_vec();
    let dst = resized.params_mut();
    for view in &views {
        let from = model
            .param_views()
            .iter()
            .find(|v| v.name == view.name)
            .expect("same architecture, same tensor names");
        let old_rows = &src[from.range.clone()];
        let out = &mut dst[view.range.clone()];
        if view.name != "wte.weight" && view.name != "lm_head.weight" {
            out.copy_from_slice(old_rows);
            continue;
        }
        out[..old * c].copy_from_slice(old_rows);
        for r in old..new_vocab {
            let strategy = &init[if init.len() == 1 { 0 } else { r - old }];
            let (kept, fresh) = out.split_at_mut(r * c);
            let row = &mut fresh[..c];
            match strategy {
                RowInit::Random => {}
                RowInit::Zeros => row.fill(0.0),
                RowInit::Copy(id) => {
                    let id = *id as usize;
                    row.copy_from_slice(&kept[id * c..(id + 1) * c]);
                }
                RowInit::Mean(ids) => {
                    row.fill(0.0);
                    for &id in ids {
                        let id = id as usize;
                        row.iter_mut()
                            .zip(&kept[id * c..(id + 1) * c])
                            .for_each(|(x, y)| *x += y);
                    }
                    row.iter_mut().for_each(|x| *x /= ids.len() as f32);
                }
            }
        }
    }
    Ok(resized)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Forward;

    fn small(tied: bool) -> GPT {
        let cfg = GPTConfig {
            vocab_size: 10,
            max_position_embeddings: 8,
            n_layers: 1,
            n_heads: 2,
            d_model: 8,
            d_ff: 16,
            dropout: 0.0,
            tie_word_embeddings: tied,
            ..GPTConfig::default()
        };
        GPT::new(cfg, 7).unwrap()
    }

    fn tensor<'a>(m: &'a GPT, name: &str) -> &'a [f32] {
        let v = m.param_views().iter().find(|v| v.name == name).unwrap();
        &m.params()[v.range.clone()]
    }

    #[test]
    fn keeps_every_row_and_applies_each_strategy() {
        for tied in [true, false] {
            let m = small(tied);
            let inits = [
                RowInit::Random,
                RowInit::Zeros,
                RowInit::Copy(3),
                RowInit::Mean(vec![1, 2, 6]),
            ];
            let r = resize_token_embeddings(&m, 14, &inits, 99).unwrap();
            assert_eq!(r.config().vocab_size, 14);
            assert_eq!(
                r.num_params(),
                m.num_params() + 4 * 8 * if tied { 1 } else { 2 }
            );
            let mut heads = vec!["wte.weight"];
            if !tied {
                heads.push("lm_head.weight");
            }
            for name in heads {
                let (old, new) = (tensor(&m, name), tensor(&r, name));
                assert_eq!(&new[..80], old, "{name}: existing rows kept");
                let row = |k: usize| &new[k * 8..(k + 1) * 8];
                let std = (row(10).iter().map(|x| x * x).sum::<f32>() / 8.0).sqrt();
                assert!(std > 0.002 && std < 0.08, "{name}: random row std {std}");
                assert!(row(11).iter().all(|&x| x == 0.0));
                assert_eq!(row(12), &old[24..32]);
                for i in 0..8 {
                    let mean = (old[8 + i] + old[16 + i] + old[48 + i]) / 3.0;
                    assert!((row(13)[i] - mean).abs() < 1e-7);
                }
            }
            // Every other tensor is untouched.
            for v in m.param_views() {
                if v.name != "wte.weight" && v.name != "lm_head.weight" {
                    assert_eq!(tensor(&r, &v.name), tensor(&m, &v.name), "{}", v.name);
                }
            }
        }
    }

    #[test]
    fn tied_head_follows_the_embedding() {
        let m = small(true);
        let mut r = resize_token_embeddings(&m, 12, &[RowInit::Copy(4)], 1).unwrap();
        // With row 10 and 11 equal to row 4, their logits equal token 4's at every position.
        r.forward(Forward::new(&[1, 2, 3], 1, 3)).unwrap();
        let logits = r.logits();
        for p in 0..3 {
            let l = &logits[p * 12..(p + 1) * 12];
            assert_eq!(l[10], l[4]);
            assert_eq!(l[11], l[4]);
        }
    }

    #[test]
    fn bad_requests_are_errors() {
        let m = small(true);
        let err = |init: &[RowInit], v| resize_token_embeddings(&m, v, init, 0).unwrap_err();
        assert!(matches!(
            err(&[RowInit::Zeros], 9),
            ResizeError::Shrink { old: 10, new: 9 }
        ));
        assert!(matches!(
            err(&[RowInit::Zeros, RowInit::Zeros], 13),
            ResizeError::InitCount {
                found: 2,
                new_rows: 3
            }
        ));
        let e = err(&[RowInit::Copy(10)], 12).to_string();
        assert!(
            e.contains("copy id 10") && e.contains("vocabulary 10"),
            "{e}"
        );
        let e = err(&[RowInit::Zeros, RowInit::Mean(vec![])], 12).to_string();
        assert!(e.contains("new row 11"), "{e}");
        // Same size: an identical copy.
        let same = resize_token_embeddings(&m, 10, &[], 0).unwrap();
        assert_eq!(same.params(), m.params());
    }
}

//! [`Labels`]: what the loss scores each position on, in the two conventions users arrive
//! with. Only the meaning of the ids lives here; it never computes a loss (the model applies
//! it).

/// Labels of a (batch, seq) row-major batch; -100 marks a position the loss ignores.
#[derive(Debug, Clone, Copy)]
pub enum Labels<'a> {
    /// Hugging Face's convention (`GPT2LMHeadModel(labels=input_ids)`): aligned with the
    /// inputs, position t is scored on `labels[t + 1]`. The last position of every row has no
    /// label, so a window of T tokens trains T - 1 positions.
    Aligned(&'a [i32]),
    /// nanoGPT's: `targets[t]` is the token position t must predict (the window shifted by
    /// one), so a window of T + 1 tokens trains all T positions.
    Next(&'a [i32]),
}

impl<'a> Labels<'a> {
    /// The ids, whichever the convention.
    pub fn ids(self) -> &'a [i32] {
        match self {
            Labels::Aligned(ids) | Labels::Next(ids) => ids,
        }
    }
}

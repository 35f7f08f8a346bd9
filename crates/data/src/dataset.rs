//! The two views of training data: a [`Dataset`] (what a training loop asks for: both splits,
//! the vocabulary, the loss floor) and [`Samples`] (one split's indexed sequences, what the
//! samplers and the loader read), with the file-backed [`Samples`]: [`TokenWindows`]
//! (fixed-length windows of a token stream) and [`Documents`] (one sample per document).
//!
//! A sample of n tokens trains n - 1 positions: position t sees tokens 0..=t and is scored on
//! token t + 1, as in nanoGPT. So a fixed-length sample holds `seq_len + 1` tokens and every one
//! of the model's `seq_len` positions is trained.
//!
//! A sample is a pure function of its index, so any worker thread or rank can read any sample
//! and the order of reads never changes what is read. Nothing here allocates per token file.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use crate::token_file::TokenFile;
use crate::DataError;

/// Which part of a data set: training sequences or held-out ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Sequences the model trains on.
    Train,
    /// Held-out sequences for the validation loss.
    Val,
}

/// A data set of fixed-length token sequences (the seam for file-backed data).
pub trait Dataset: Send + Sync {
    /// Number of sequences in `split`.
    fn len(&self, split: Split) -> usize;
    /// Trained positions per sequence (the model's context); a full sequence holds one token
    /// more.
    fn seq_len(&self) -> usize;
    /// Token ids are in `0..vocab_size()`.
    fn vocab_size(&self) -> usize;
    /// Writes sequence `index` of `split` into `tokens` (length
    /// `sample_len(split, index)`). The targets are the same tokens one
    /// place on (the loader's `collate` shifts them).
    fn read(&self, split: Split, index: usize, tokens: &mut [u32]);
    /// Tokens in sequence `index` of `split`: at most `seq_len() + 1`, and
    /// exactly that unless the data set has [`Dataset::variable_length`].
    fn sample_len(&self, _split: Split, _index: usize) -> usize {
        self.seq_len() + 1
    }
    /// Whether sequences differ in length (documents): they are then batched
    /// by token budget and padded, instead of `batch_size` full rows.
    fn variable_length(&self) -> bool {
        false
    }
    /// The lowest expected loss any model can reach on this data, if known.
    fn loss_floor(&self) -> Option<f64>;
    /// One line saying what the data is, for the log.
    fn describe(&self) -> String;
    /// Writes which tokens of sequence `index` of `split` are trained as targets (1) or ignored
    /// (0) into `out` (length `sample_len`); false, writing nothing, when every token is
    /// (the default: only conversations carry a loss mask).
    fn read_loss_mask(&self, _split: Split, _index: usize, _out: &mut [u8]) -> bool {
        false
    }
    /// The tokenizer.json of file data, saved with every checkpoint.
    fn tokenizer_json(&self) -> Option<String> {
        None
    }
}

/// Indexed token sequences of one split.
pub trait Samples: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;
    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Tokens in sample `index` (what the token-budget sampler sorts by).
    fn sample_len(&self, index: usize) -> usize;
    /// Writes sample `index` into `out` (length `sample_len(index)`).
    fn read(&self, index: usize, out: &mut [u32]);
    /// Writes which tokens of sample `index` are targets (1) or ignored (0) into `out`; false,
    /// writing nothing, when every token is (see [`Dataset::read_loss_mask`]).
    fn read_loss_mask(&self, _index: usize, _out: &mut [u8]) -> bool {
        false
    }
}

/// Windows of `seq_len + 1` tokens (`seq_len` trained positions) over a range of a token file,
/// `stride` apart.
///
/// Training uses stride 1 (every offset is a sample, nanoGPT's random `ix`); validation uses
/// stride `seq_len` (no overlap) and visits the windows in a spread order, so the first k
/// samples cover the whole split rather than its beginning.
#[derive(Debug, Clone)]
pub struct TokenWindows {
    file: Arc<TokenFile>,
    range: Range<usize>,
    seq_len: usize,
    stride: usize,
    count: usize,
    /// Multiplier of the spread order (coprime with `count`); 1 keeps file order.
    step: usize,
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl TokenWindows {
    /// Windows of `seq_len + 1` tokens over `range` of `file`; `split` names the split in
    /// errors.
    pub fn new(
        file: Arc<TokenFile>,
        range: Range<usize>,
        seq_len: usize,
        stride: usize,
        split: &'static str,
    ) -> Result<TokenWindows, DataError> {
        let window = seq_len + 1;
        if range.len() < window {
            return Err(DataError::TooShort {
                path: file.path().into(),
                have: range.len(),
                need: window,
                split,
            });
        }
        let count = (range.len() - window) / stride + 1;
        let step = if stride == 1 {
            1
        } else {
            // Near the golden ratio of the count: consecutive samples land far apart.
            let mut s = ((count as f64 * 0.618) as usize).max(1);
            while gcd(s, count) != 1 {
                s += 1;
            }
            s
        };
        Ok(TokenWindows {
            file,
            range,
            seq_len,
            stride,
            count,
            step,
        })
    }

    /// Trained positions per window (one token fewer than the window).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Tokens in the split.
    pub fn tokens(&self) -> usize {
        self.range.len()
    }

    /// The token file.
    pub fn path(&self) -> &Path {
        self.file.path()
    }
}

impl Samples for TokenWindows {
    fn len(&self) -> usize {
        self.count
    }

    fn sample_len(&self, _index: usize) -> usize {
        self.seq_len + 1
    }

    fn read(&self, index: usize, out: &mut [u32]) {
        let window = (index % self.count) * self.step % self.count;
        self.file.read(
            self.range.start + window * self.stride,
            &mut out[..self.seq_len + 1],
        );
    }
}

/// Documents of a token file, delimited by an offset index, with their loss mask when they
/// are conversations.
#[derive(Debug, Clone)]
pub struct Documents {
    file: Arc<TokenFile>,
    /// n + 1 increasing token offsets.
    offsets: Vec<u64>,
    /// One byte per token of `file`: 1 where the token is a target (the assistant's).
    mask: Option<Arc<memmap2::Mmap>>,
}

impl Documents {
    /// Documents `offsets[i]..offsets[i + 1]` of `file`.
    pub fn new(file: Arc<TokenFile>, offsets: Vec<u64>) -> Documents {
        Documents {
            file,
            offsets,
            mask: None,
        }
    }

    /// The same documents with a loss mask (one byte per token of the file; None: none).
    pub fn with_mask(mut self, mask: Option<Arc<memmap2::Mmap>>) -> Documents {
        self.mask = mask;
        self
    }

    /// The token file.
    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// The documents concatenated into one stream, as windows (for fixed-length training).
    pub fn as_windows(
        &self,
        seq_len: usize,
        stride: usize,
        split: &'static str,
    ) -> Result<TokenWindows, DataError> {
        let start = self.offsets.first().copied().unwrap_or(0) as usize;
        let end = self.offsets.last().copied().unwrap_or(0) as usize;
        TokenWindows::new(self.file.clone(), start..end, seq_len, stride, split)
    }
}

impl Samples for Documents {
    fn len(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    fn sample_len(&self, index: usize) -> usize {
        (self.offsets[index + 1] - self.offsets[index]) as usize
    }

    fn read(&self, index: usize, out: &mut [u32]) {
        let n = self.sample_len(index);
        self.file.read(self.offsets[index] as usize, &mut out[..n]);
    }

    fn read_loss_mask(&self, index: usize, out: &mut [u8]) -> bool {
        let Some(mask) = &self.mask else {
            return false;
        };
        let (start, end) = (
            self.offsets[index] as usize,
            self.offsets[index + 1] as usize,
        );
        out[..end - start].copy_from_slice(&mask[start..end]);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token_file::write_token_file;

    #[test]
    fn windows_cover_the_split_and_val_order_is_a_spread_permutation() {
        let dir = tempfile::tempdir().unwrap();
        let ids: Vec<u32> = (0..100).collect();
        let f = Arc::new(
            TokenFile::open(
                write_token_file(dir.path().join("t.bin"), &ids, 100).unwrap(),
                100,
            )
            .unwrap(),
        );
        // 8 positions: windows of 9 tokens, so the last one ends at the range's end.
        let train = TokenWindows::new(f.clone(), 0..90, 8, 1, "train").unwrap();
        assert_eq!(train.len(), 82);
        assert_eq!(train.sample_len(0), 9);
        let mut out = vec![0; 9];
        train.read(81, &mut out);
        assert_eq!(out, (81..90).collect::<Vec<u32>>());
        let val = TokenWindows::new(f.clone(), 90..100, 4, 4, "val").unwrap();
        assert_eq!(val.len(), 2);
        // Validation windows overlap by the one token that is the last position's target, so
        // every token but the first of the split is a target exactly once.
        let val = TokenWindows::new(f.clone(), 0..101 - 1, 4, 4, "val").unwrap();
        let mut starts: Vec<u32> = (0..val.len())
            .map(|i| {
                val.read(i, &mut out[..5]);
                out[0]
            })
            .collect();
        assert_ne!(starts[1], 4, "spread, not file order");
        starts.sort();
        assert_eq!(starts, (0..24).map(|w| w * 4).collect::<Vec<u32>>());
        let e = TokenWindows::new(f, 90..100, 64, 64, "val")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("10 tokens, need at least 65") && e.contains("val"),
            "{e}"
        );
    }
}

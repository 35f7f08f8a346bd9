//! Token files: flat arrays of token ids on disk, memory-mapped for training.
//!
//! Two layouts, told apart by the first 8 bytes:
//!
//! ```text
//! uint16 (nanoGPT's train.bin / val.bin):  id0 id1 id2 ...            (2 bytes each, LE)
//! uint32 (vocabularies above 65536):       "COHORTTK" u32 version=1 u32 width=4, then ids (4 bytes each, LE)
//! ```
//!
//! The uint16 layout has no header so nanoGPT's files are read as they are; a uint16 file whose
//! first four ids spell the magic would be misread, which takes ids above 16000 in a fixed
//! order. Opening validates the length and every id against the vocabulary, so a bad file is
//! reported once, with the index of the bad token, and never yields garbage later. Writers go to
//! a temporary file renamed into place, so a crash never leaves a half-written file under the
//! final name. This module never tokenizes text.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::DataError;

const MAGIC: &[u8; 8] = b"COHORTTK";
const HEADER: usize = 16;

/// A validated, memory-mapped token file.
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    map: Mmap,
    offset: usize,
    width: usize,
    len: usize,
}

impl TokenFile {
    /// Maps `path` and checks that every id is below `vocab_size`.
    pub fn open(path: impl AsRef<Path>, vocab_size: usize) -> Result<TokenFile, DataError> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(DataError::io("open", &path))?;
        let bytes = file.metadata().map_err(DataError::io("stat", &path))?.len();
        if bytes == 0 {
            return Err(DataError::Empty { path });
        }
        // Safety: the map is read-only and private to this process; a file truncated by another
        // process while mapped is outside what this type promises (as for any mmap reader).
        let map = unsafe { Mmap::map(&file) }.map_err(DataError::io("mmap", &path))?;
        let (offset, width) = if map.len() >= 8 && &map[..8] == MAGIC {
            if map.len() < HEADER {
                return Err(DataError::Truncated {
                    path,
                    len: bytes,
                    reason: "is shorter than the 16-byte uint32 header",
                });
            }
            let version = u32::from_le_bytes(map[8..12].try_into().unwrap());
            let width = u32::from_le_bytes(map[12..16].try_into().unwrap());
            if version != 1 || width != 4 {
                return Err(DataError::BadHeader {
                    path,
                    reason: format!("version {version}, width {width} (expected 1, 4)"),
                });
            }
            (HEADER, 4)
        } else {
            (0, 2)
        };
        let body = map.len() - offset;
        if body % width != 0 {
            return Err(DataError::Truncated {
                path,
                len: bytes,
                reason: if width == 2 {
                    "is not a whole number of uint16 tokens"
                } else {
                    "is not a whole number of uint32 tokens after the header"
                },
            });
        }
        if body == 0 {
            return Err(DataError::Empty { path });
        }
        let tf = TokenFile {
            path,
            map,
            offset,
            width,
            len: body / width,
        };
        tf.validate(vocab_size)?;
        Ok(tf)
    }

    fn validate(&self, vocab: usize) -> Result<(), DataError> {
        let bad = |index: usize, id: u32| DataError::TokenOutOfRange {
            path: self.path.clone(),
            index: index as u64,
            id,
            vocab,
        };
        let body = &self.map[self.offset..];
        if self.width == 2 {
            if let Some((i, c)) = body
                .chunks_exact(2)
                .enumerate()
                .find(|(_, c)| u16::from_le_bytes([c[0], c[1]]) as usize >= vocab)
            {
                return Err(bad(i, u16::from_le_bytes([c[0], c[1]]) as u32));
            }
        } else if let Some((i, c)) = body
            .chunks_exact(4)
            .enumerate()
            .find(|(_, c)| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as usize >= vocab)
        {
            return Err(bad(i, u32::from_le_bytes([c[0], c[1], c[2], c[3]])));
        }
        Ok(())
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the file has no tokens (never true for an opened file).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes per token (2 or 4).
    pub fn width(&self) -> usize {
        self.width
    }

    /// Copies tokens `start..start + out.len()` into `out`.
    ///
    /// # Panics
    /// When the range is past the end (callers compute ranges from `len`).
    pub fn read(&self, start: usize, out: &mut [u32]) {
        let w = self.width;
        let bytes = &self.map[self.offset + start * w..self.offset + (start + out.len()) * w];
        if w == 2 {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = u16::from_le_bytes([c[0], c[1]]) as u32;
            }
        } else {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    }
}

/// Streams ids into a new token file: uint16 (nanoGPT's layout) when the vocabulary fits,
/// uint32 with the header otherwise. Written to `PATH.tmpPID`, renamed by
/// [`TokenWriter::finish`]; a writer dropped before that (a failed tokenization) deletes
/// its temp file.
#[derive(Debug)]
pub struct TokenWriter {
    path: PathBuf,
    tmp: PathBuf,
    /// `None` once finished.
    out: Option<BufWriter<File>>,
    wide: bool,
    count: u64,
}

impl Drop for TokenWriter {
    fn drop(&mut self) {
        if self.out.is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

impl TokenWriter {
    /// Creates the writer for ids below `vocab_size`.
    pub fn create(path: impl AsRef<Path>, vocab_size: usize) -> Result<TokenWriter, DataError> {
        let path = path.as_ref().to_path_buf();
        let mut tmp = path.clone().into_os_string();
        // Per process: ranks preparing the same cache never write one file together.
        tmp.push(format!(".tmp{}", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let file = File::create(&tmp).map_err(DataError::io("create", &tmp))?;
        let wide = vocab_size > 1 << 16;
        let mut w = TokenWriter {
            path,
            tmp,
            out: Some(BufWriter::with_capacity(1 << 20, file)),
            wide,
            count: 0,
        };
        if wide {
            let mut header = [0u8; HEADER];
            header[..8].copy_from_slice(MAGIC);
            header[8..12].copy_from_slice(&1u32.to_le_bytes());
            header[12..16].copy_from_slice(&4u32.to_le_bytes());
            w.out_mut()
                .write_all(&header)
                .map_err(DataError::io("write", &w.tmp))?;
        }
        Ok(w)
    }

    fn out_mut(&mut self) -> &mut BufWriter<File> {
        self.out
            .as_mut()
            .expect("a writer is unfinished until finish() consumes it")
    }

    /// Appends ids.
    pub fn write(&mut self, ids: &[u32]) -> Result<(), DataError> {
        let mut buf = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            if self.wide {
                buf.extend_from_slice(&id.to_le_bytes());
            } else {
                buf.extend_from_slice(&(id as u16).to_le_bytes());
            }
        }
        self.count += ids.len() as u64;
        let tmp = self.tmp.clone();
        self.out_mut()
            .write_all(&buf)
            .map_err(DataError::io("write", &tmp))
    }

    /// Tokens written so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Flushes, syncs and renames the file into place; returns its path.
    pub fn finish(mut self) -> Result<PathBuf, DataError> {
        // Until the rename, a failure leaves `out` set: Drop deletes the temp file.
        let file = self
            .out_mut()
            .flush()
            .map_err(DataError::io("write", &self.tmp))
            .and_then(|()| {
                self.out_mut()
                    .get_ref()
                    .sync_all()
                    .map_err(DataError::io("fsync", &self.tmp))
            });
        file?;
        std::fs::rename(&self.tmp, &self.path).map_err(DataError::io("rename", &self.tmp))?;
        self.out = None;
        Ok(self.path.clone())
    }
}

/// Writes `ids` as a token file in one go.
pub fn write_token_file(
    path: impl AsRef<Path>,
    ids: &[u32],
    vocab_size: usize,
) -> Result<PathBuf, DataError> {
    let mut w = TokenWriter::create(path, vocab_size)?;
    w.write(ids)?;
    w.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_widths_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        for (vocab, width) in [(65usize, 2usize), (70_000, 4)] {
            let ids: Vec<u32> = (0..1000).map(|i| (i * 7919 % vocab) as u32).collect();
            let p =
                write_token_file(dir.path().join(format!("t{vocab}.bin")), &ids, vocab).unwrap();
            let tf = TokenFile::open(&p, vocab).unwrap();
            assert_eq!((tf.len(), tf.width()), (1000, width));
            let mut out = vec![0; 10];
            tf.read(990, &mut out);
            assert_eq!(out, &ids[990..]);
        }
        // A nanoGPT file is raw little-endian uint16, read as is.
        let raw: Vec<u8> = [3u16, 1, 2].iter().flat_map(|x| x.to_le_bytes()).collect();
        std::fs::write(dir.path().join("train.bin"), raw).unwrap();
        let tf = TokenFile::open(dir.path().join("train.bin"), 4).unwrap();
        let mut out = vec![0; 3];
        tf.read(0, &mut out);
        assert_eq!(out, [3, 1, 2]);
    }

    #[test]
    fn bad_token_files_name_file_and_position() {
        let dir = tempfile::tempdir().unwrap();
        let err = |bytes: &[u8], vocab| {
            let p = dir.path().join("bad.bin");
            std::fs::write(&p, bytes).unwrap();
            TokenFile::open(&p, vocab).unwrap_err().to_string()
        };
        let e = err(b"", 10);
        assert!(e.contains("bad.bin") && e.contains("empty"), "{e}");
        let e = err(&[1, 0, 2], 10);
        assert!(e.contains("truncated") && e.contains("3 bytes"), "{e}");
        let ids: Vec<u8> = [1u16, 2, 65, 3]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let e = err(&ids, 65);
        assert!(e.contains("token 2 is id 65") && e.contains("0..65"), "{e}");
        let mut wide = MAGIC.to_vec();
        wide.extend_from_slice(&1u32.to_le_bytes());
        wide.extend_from_slice(&4u32.to_le_bytes());
        wide.extend_from_slice(&[0, 0, 0]);
        let e = err(&wide, 10);
        assert!(e.contains("uint32"), "{e}");
        let e = err(&wide[..12], 10);
        assert!(e.contains("header"), "{e}");
        wide[12] = 8;
        let e = err(&wide[..16], 10);
        assert!(e.contains("width 8"), "{e}");
        let missing = TokenFile::open(dir.path().join("nope.bin"), 10).unwrap_err();
        assert!(missing.to_string().contains("nope.bin"), "{missing}");
    }
}

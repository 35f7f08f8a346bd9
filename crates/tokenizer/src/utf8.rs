//! [`Utf8Chunks`]: reads a UTF-8 file in bounded chunks, each ending at a line break where there
//! is one, so a corpus larger than memory can be scanned or tokenized piece by piece.
//!
//! Bad bytes are reported with their absolute byte offset; a chunk never splits a character. It
//! never holds more than one chunk (plus one partial line) in memory.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::TokenizerError;

/// A UTF-8 file read chunk by chunk.
#[derive(Debug)]
pub struct Utf8Chunks {
    path: PathBuf,
    file: File,
    chunk_bytes: usize,
    buf: Vec<u8>,
    /// Bytes of `buf` handed out by the last `next_chunk`, removed at the next call.
    consumed: usize,
    /// File offset of `buf[0]`.
    offset: u64,
    eof: bool,
}

impl Utf8Chunks {
    /// Opens `path`; chunks are about `chunk_bytes` long (longer when a line is).
    pub fn open(path: impl AsRef<Path>, chunk_bytes: usize) -> Result<Utf8Chunks, TokenizerError> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|source| TokenizerError::Io {
            op: "read",
            path: path.clone(),
            source,
        })?;
        Ok(Utf8Chunks {
            path,
            file,
            chunk_bytes: chunk_bytes.max(4),
            buf: Vec::new(),
            consumed: 0,
            offset: 0,
            eof: false,
        })
    }

    /// The next chunk and its byte offset in the file; `None` at the end.
    pub fn next_chunk(&mut self) -> Result<Option<(&str, u64)>, TokenizerError> {
        self.buf.drain(..self.consumed);
        self.offset += self.consumed as u64;
        self.consumed = 0;
        // Fill until the chunk holds a line break past the target size, or the file ends.
        loop {
            let have_break = self.buf.len() >= self.chunk_bytes
                && self.buf[self.chunk_bytes / 2..].contains(&b'\n');
            if self.eof || have_break || self.buf.len() >= 64 * self.chunk_bytes {
                break;
            }
            let start = self.buf.len();
            self.buf.resize(start + self.chunk_bytes, 0);
            let n =
                self.file
                    .read(&mut self.buf[start..])
                    .map_err(|source| TokenizerError::Io {
                        op: "read",
                        path: self.path.clone(),
                        source,
                    })?;
            self.buf.truncate(start + n);
            self.eof = n == 0;
        }
        if self.buf.is_empty() {
            return Ok(None);
        }
        let end = if self.eof {
            self.buf.len()
        } else {
            match self.buf.iter().rposition(|&b| b == b'\n') {
                Some(i) => i + 1,
                // One enormous line: cut at a character boundary instead.
                None => {
                    let mut i = self.buf.len();
                    while i > 0 && (self.buf[i - 1] & 0xC0) == 0x80 {
                        i -= 1;
                    }
                    i.saturating_sub(1).max(1)
                }
            }
        };
        let text = std::str::from_utf8(&self.buf[..end]).map_err(|e| {
            // An incomplete character at the very end of the file is a truncation, reported
            // the same way: the offset of the first byte that is not a whole character.
            TokenizerError::NotUtf8 {
                path: self.path.clone(),
                offset: self.offset + e.valid_up_to() as u64,
            }
        })?;
        self.consumed = end;
        Ok(Some((text, self.offset)))
    }
}

/// Calls `f` on each chunk of the UTF-8 file `path` (1 MiB chunks) with its byte offset.
pub(crate) fn for_each_chunk(
    path: &Path,
    mut f: impl FnMut(&str, u64),
) -> Result<(), TokenizerError> {
    let mut chunks = Utf8Chunks::open(path, 1 << 20)?;
    while let Some((text, offset)) = chunks.next_chunk()? {
        f(text, offset);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks(bytes: &[u8], size: usize) -> Result<Vec<(String, u64)>, TokenizerError> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.txt");
        std::fs::write(&p, bytes).unwrap();
        let mut c = Utf8Chunks::open(&p, size)?;
        let mut out = Vec::new();
        while let Some((t, o)) = c.next_chunk()? {
            out.push((t.to_string(), o));
        }
        Ok(out)
    }

    #[test]
    fn chunks_end_at_line_breaks_and_never_split_a_character() {
        let text = "ab\nçé✓ line two\nthree ✓✓✓✓✓✓✓✓✓✓✓✓ no break at all\nend";
        for size in [4, 5, 7, 16, 1000] {
            let out = chunks(text.as_bytes(), size).unwrap();
            let joined: String = out.iter().map(|(t, _)| t.as_str()).collect();
            assert_eq!(joined, text, "size {size}");
            let mut at = 0;
            for (t, o) in &out {
                assert_eq!(*o, at);
                at += t.len() as u64;
            }
        }
    }

    #[test]
    fn bad_bytes_are_reported_at_their_offset() {
        let mut bytes = "ok line\n".repeat(10).into_bytes();
        bytes.extend_from_slice(b"caf\xe9\n");
        for size in [4, 16, 4096] {
            let err = chunks(&bytes, size).unwrap_err().to_string();
            assert!(err.contains("byte offset 83"), "size {size}: {err}");
        }
        // A truncated multi-byte character at the end.
        let err = chunks(&"ab✓".as_bytes()[..4], 64).unwrap_err().to_string();
        assert!(err.contains("byte offset 2"), "{err}");
    }
}

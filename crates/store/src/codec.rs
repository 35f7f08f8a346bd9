//! Little-endian encoding shared by the `TcpStore` protocol and the
//! `FileStore` log.
//!
//! Decoding must never trust a length field: every read is checked against
//! the bytes actually present and against the caller's limit before anything
//! is sliced, so a corrupt or hostile length is an error, never a panic or a
//! large allocation.

/// Builds a byte string field by field.
#[derive(Debug, Default)]
pub(crate) struct Encoder {
    buf: Vec<u8>,
}

impl Encoder {
    pub(crate) fn new() -> Self {
        Encoder::default()
    }

    /// An encoder for a frame: four bytes are reserved for its length, which
    /// [`Encoder::finish_frame`] fills in.
    pub(crate) fn frame() -> Self {
        Encoder { buf: vec![0; 4] }
    }

    pub(crate) fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub(crate) fn i32(&mut self, v: i32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub(crate) fn i64(&mut self, v: i64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// A u32 length, then the bytes. Callers bound `bytes` by
    /// [`MAX_VALUE_LEN`](crate::MAX_VALUE_LEN), far below `u32::MAX`.
    pub(crate) fn blob(&mut self, bytes: &[u8]) -> &mut Self {
        let len = u32::try_from(bytes.len()).expect("blob lengths are bounded by MAX_VALUE_LEN");
        self.u32(len);
        self.buf.extend_from_slice(bytes);
        self
    }

    pub(crate) fn finish(self) -> Vec<u8> {
        self.buf
    }

    /// The frame, its length prefix (the bytes after the prefix) filled in.
    pub(crate) fn finish_frame(mut self) -> Vec<u8> {
        let len = u32::try_from(self.buf.len() - 4).unwrap_or(u32::MAX);
        self.buf[..4].copy_from_slice(&len.to_le_bytes());
        self.buf
    }
}

/// Reads fields from a byte string; each error says what was wrong and where.
#[derive(Debug)]
pub(crate) struct Decoder<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Decoder<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Decoder { buf, pos: 0 }
    }

    /// Offset of the next unread byte.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.pos == self.buf.len()
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        let left = self.buf.len() - self.pos;
        if n > left {
            return Err(format!(
                "{what} at offset {} needs {n} bytes but only {left} remain",
                self.pos
            ));
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        let bytes = self.take(N, what)?;
        Ok(bytes.try_into().expect("take returned N bytes"))
    }

    pub(crate) fn u8(&mut self, what: &str) -> Result<u8, String> {
        Ok(self.array::<1>(what)?[0])
    }

    pub(crate) fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn i32(&mut self, what: &str) -> Result<i32, String> {
        Ok(i32::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn i64(&mut self, what: &str) -> Result<i64, String> {
        Ok(i64::from_le_bytes(self.array(what)?))
    }

    /// A u32 length of at most `limit`, then that many bytes.
    pub(crate) fn blob(&mut self, what: &str, limit: usize) -> Result<&'a [u8], String> {
        let at = self.pos;
        let len = self.u32(what)? as usize;
        if len > limit {
            return Err(format!(
                "{what} at offset {at} claims {len} bytes, over the limit of {limit}"
            ));
        }
        self.take(len, what)
    }

    /// A blob that must be UTF-8.
    pub(crate) fn str(&mut self, what: &str, limit: usize) -> Result<&'a str, String> {
        let at = self.pos;
        std::str::from_utf8(self.blob(what, limit)?)
            .map_err(|_| format!("{what} at offset {at} is not UTF-8"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_field() {
        let mut e = Encoder::frame();
        e.u8(7).u32(9).i32(-3).u64(u64::MAX).i64(-42).blob(b"key");
        let frame = e.finish_frame();
        assert_eq!(
            u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize,
            frame.len() - 4
        );
        let mut d = Decoder::new(&frame[4..]);
        assert_eq!(d.u8("a").unwrap(), 7);
        assert_eq!(d.u32("b").unwrap(), 9);
        assert_eq!(d.i32("c").unwrap(), -3);
        assert_eq!(d.u64("d").unwrap(), u64::MAX);
        assert_eq!(d.i64("e").unwrap(), -42);
        assert_eq!(d.str("f", 3).unwrap(), "key");
        assert!(d.is_empty());
    }

    #[test]
    fn rejects_lengths_past_the_end_or_the_limit() {
        let mut e = Encoder::new();
        e.u32(1_000_000).u8(1);
        let buf = e.finish();
        let err = Decoder::new(&buf).blob("value", usize::MAX).unwrap_err();
        assert!(
            err.contains("needs 1000000 bytes but only 1 remain"),
            "{err}"
        );
        let err = Decoder::new(&buf).blob("value", 10).unwrap_err();
        assert!(err.contains("over the limit of 10"), "{err}");
        let mut e = Encoder::new();
        e.blob(&[0xff, 0xfe]);
        let buf = e.finish();
        assert!(Decoder::new(&buf)
            .str("key", 10)
            .unwrap_err()
            .contains("UTF-8"));
        assert!(Decoder::new(&[1, 2]).u32("len").is_err());
    }
}

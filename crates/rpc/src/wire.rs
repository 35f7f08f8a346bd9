//! The bytes on an RPC connection: a handshake when it opens, then frames.
//!
//! ```text
//! frame   = header_len u32 LE | payload_len u32 LE | header | payload
//! header  = postcard(Header)        at most MAX_HEADER bytes
//! payload = postcard(arguments, result or rref value), raw bytes here
//! ```
//!
//! The payload travels beside the header, not inside it, so that a large
//! argument is copied once into the socket and never re-encoded. Both
//! lengths are checked against their limits before anything is allocated:
//! a malformed or hostile frame is an error on that connection, never a
//! huge allocation or a panic. This module knows nothing of handlers,
//! futures or references; it only moves frames.

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

use crate::rref::RRefId;

/// Largest encoded header; names and error messages are short.
pub(crate) const MAX_HEADER: usize = 1 << 20;

/// What the connecting side says after the secret handshake.
pub(crate) const HELLO_MAGIC: &[u8; 8] = b"CRPC\x00\x01\x00\x00";

/// A frame's header: what the payload is.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Header {
    /// Run `func` on the payload; `rref` set means keep the result on the
    /// callee as that reference's value and answer with an empty payload.
    Call {
        id: u64,
        func: String,
        types: u64,
        rref: Option<RRefId>,
    },
    /// The answer to the call or request `id`.
    Reply { id: u64, status: Status },
    /// Send back the value of an owned reference (`to_here`).
    Fetch { id: u64, rref: RRefId, ty: u64 },
    /// One more user of an owned reference; answered once counted.
    Fork { id: u64, rref: RRefId },
    /// One user fewer; not answered.
    Release { rref: RRefId },
    /// The sender has shut down and sends nothing more.
    Goodbye,
}

/// How a call ended on the callee.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum Status {
    /// The payload is the result.
    Ok,
    /// The handler failed with this message.
    Handler(String),
    /// No such function; the registered names.
    Unknown(String),
    /// The caller's types are not the handler's; the handler's.
    Types(String),
    /// The arguments did not decode, or the result did not encode.
    Codec { op: String, detail: String },
    /// The reference has no value here.
    RRef(String),
}

/// Writes one frame: header and payload in one buffer when small (one
/// segment on the wire), else header then payload (no copy of the payload).
pub(crate) fn write_frame(w: &mut impl Write, header: &Header, payload: &[u8]) -> io::Result<()> {
    let head = postcard::to_allocvec(header).map_err(io::Error::other)?;
    let mut buf = Vec::with_capacity(8 + head.len() + payload.len().min(64 << 10));
    buf.extend_from_slice(&(head.len() as u32).to_le_bytes());
    buf.extend_from_slice(
        &u32::try_from(payload.len())
            .map_err(io::Error::other)?
            .to_le_bytes(),
    );
    buf.extend_from_slice(&head);
    if payload.len() <= 64 << 10 {
        buf.extend_from_slice(payload);
        w.write_all(&buf)
    } else {
        w.write_all(&buf)?;
        w.write_all(payload)
    }
}

/// Why a frame could not be read.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// The stream ended or failed.
    Io(io::Error),
    /// The bytes are not a frame.
    Malformed(String),
}

/// Reads one frame; `max_payload` bounds what a peer may make us allocate.
pub(crate) fn read_frame(
    r: &mut impl Read,
    max_payload: usize,
) -> Result<(Header, Vec<u8>), ReadError> {
    let mut lens = [0u8; 8];
    r.read_exact(&mut lens).map_err(ReadError::Io)?;
    let head_len = u32::from_le_bytes(lens[..4].try_into().expect("4 bytes")) as usize;
    let payload_len = u32::from_le_bytes(lens[4..].try_into().expect("4 bytes")) as usize;
    if head_len == 0 || head_len > MAX_HEADER {
        return Err(ReadError::Malformed(format!(
            "header of {head_len} bytes (limit {MAX_HEADER})"
        )));
    }
    if payload_len > max_payload {
        return Err(ReadError::Malformed(format!(
            "payload of {payload_len} bytes (limit {max_payload})"
        )));
    }
    let mut head = vec![0u8; head_len];
    r.read_exact(&mut head).map_err(ReadError::Io)?;
    let header: Header = postcard::from_bytes(&head)
        .map_err(|e| ReadError::Malformed(format!("undecodable header: {e}")))?;
    let mut payload = vec![0u8; payload_len];
    r.read_exact(&mut payload).map_err(ReadError::Io)?;
    Ok((header, payload))
}

/// The connecting side's introduction: who it is and which group it joins.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Hello {
    pub(crate) rank: u32,
    pub(crate) world: u32,
    pub(crate) name: String,
}

/// Writes a length-prefixed hello.
pub(crate) fn write_hello(w: &mut impl Write, hello: &Hello) -> io::Result<()> {
    let body = postcard::to_allocvec(hello).map_err(io::Error::other)?;
    let mut buf = Vec::with_capacity(12 + body.len());
    buf.extend_from_slice(HELLO_MAGIC);
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf)?;
    w.flush()
}

/// Reads a hello; anything else is an error (a stray client, another protocol).
pub(crate) fn read_hello(r: &mut impl Read) -> Result<Hello, ReadError> {
    let mut magic = [0u8; 12];
    r.read_exact(&mut magic).map_err(ReadError::Io)?;
    if &magic[..8] != HELLO_MAGIC {
        return Err(ReadError::Malformed(
            "not a cohort rpc hello (another program, or a peer without the job secret)".into(),
        ));
    }
    let len = u32::from_le_bytes(magic[8..].try_into().expect("4 bytes")) as usize;
    if len > 4096 {
        return Err(ReadError::Malformed(format!("hello of {len} bytes")));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).map_err(ReadError::Io)?;
    postcard::from_bytes(&body).map_err(|e| ReadError::Malformed(format!("bad hello: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_lengths_are_refused() {
        let mut buf = Vec::new();
        let big = vec![7u8; 100_000];
        write_frame(
            &mut buf,
            &Header::Call {
                id: 9,
                func: "f".into(),
                types: 3,
                rref: None,
            },
            b"abc",
        )
        .unwrap();
        write_frame(&mut buf, &Header::Goodbye, &big).unwrap();
        let mut r = &buf[..];
        let (h, p) = read_frame(&mut r, 1 << 20).unwrap();
        assert!(matches!(h, Header::Call { id: 9, .. }));
        assert_eq!(p, b"abc");
        let (h, p) = read_frame(&mut r, 1 << 20).unwrap();
        assert!(matches!(h, Header::Goodbye));
        assert_eq!(p, big);
        assert!(matches!(read_frame(&mut r, 1 << 20), Err(ReadError::Io(_))));

        // A payload over the limit is refused before it is allocated.
        let mut r = &buf[..];
        read_frame(&mut r, 1 << 20).unwrap();
        assert!(
            matches!(read_frame(&mut r, 1000), Err(ReadError::Malformed(m)) if m.contains("100000"))
        );
        // Garbage: absurd header length, then an undecodable header.
        let mut r: &[u8] = &[0xff; 16];
        assert!(matches!(
            read_frame(&mut r, 10),
            Err(ReadError::Malformed(_))
        ));
        let mut r: &[u8] = &[2, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];
        assert!(matches!(
            read_frame(&mut r, 10),
            Err(ReadError::Malformed(_))
        ));
        // A truncated frame is an I/O error (the stream ended), not a panic.
        let mut r = &buf[..buf.len() - 1];
        read_frame(&mut r, 1 << 20).unwrap();
        assert!(matches!(read_frame(&mut r, 1 << 20), Err(ReadError::Io(_))));
    }

    #[test]
    fn hellos_round_trip_and_strangers_are_refused() {
        let mut buf = Vec::new();
        write_hello(
            &mut buf,
            &Hello {
                rank: 2,
                world: 3,
                name: "trainer".into(),
            },
        )
        .unwrap();
        let h = read_hello(&mut &buf[..]).unwrap();
        assert_eq!((h.rank, h.world, h.name.as_str()), (2, 3, "trainer"));
        assert!(read_hello(&mut &b"GET / HTTP/1.1\r\n\r\n"[..]).is_err());
    }
}

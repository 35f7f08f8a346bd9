//! The `TcpStore` wire protocol: binary, length-prefixed frames.
//!
//! Every message is a frame: a u32 little-endian length, then that many
//! bytes. A request is `op:u8` then its fields, a response `status:u8` then
//! its fields (blobs are a u32 length then the bytes, timeouts u64
//! microseconds). A connection opens with `Hello` (magic and version, so
//! that talking to the wrong service fails at once), then carries one
//! request at a time, each answered by one response.
//!
//! This module must never trust a length: a frame over [`MAX_FRAME_LEN`] is
//! refused before its body is read, a body is buffered only as fast as its
//! bytes arrive, and every field is checked against what the frame holds.

use std::io::{self, Read};
use std::time::Duration;

use crate::codec::{Decoder, Encoder};
use crate::{MAX_KEY_LEN, MAX_VALUE_LEN};

/// What a client says first.
pub(crate) const MAGIC: &[u8] = b"cohort-store";
/// Bumped whenever the frames change meaning.
pub(crate) const VERSION: u32 = 1;
/// Room for a `compare_set` of two maximal values plus its key.
pub(crate) const MAX_FRAME_LEN: usize = 2 * MAX_VALUE_LEN + (1 << 20);

const OP_HELLO: u8 = 0;
const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_COMPARE_SET: u8 = 4;
const OP_WAIT: u8 = 5;
const OP_CHECK: u8 = 6;
const OP_DELETE: u8 = 7;
const OP_NUM_KEYS: u8 = 8;

const ST_DONE: u8 = 0;
const ST_VALUE: u8 = 1;
const ST_INT: u8 = 2;
const ST_BOOL: u8 = 3;
const ST_COUNT: u8 = 4;
const ST_HELLO: u8 = 5;
const ST_TIMEOUT: u8 = 6;
const ST_NOT_A_COUNTER: u8 = 7;
const ST_ERROR: u8 = 8;

/// A request, borrowing its keys and values from the caller or the frame.
#[derive(Debug, PartialEq)]
pub(crate) enum Request<'a> {
    Hello {
        magic: &'a [u8],
        version: u32,
    },
    Set {
        key: &'a str,
        value: &'a [u8],
    },
    /// Answered once `key` exists, or with `Timeout` after `timeout`.
    Get {
        key: &'a str,
        timeout: Duration,
    },
    Add {
        key: &'a str,
        delta: i64,
    },
    CompareSet {
        key: &'a str,
        expected: &'a [u8],
        desired: &'a [u8],
    },
    /// Answered once every key exists, or with `Timeout` after `timeout`.
    Wait {
        keys: Vec<&'a str>,
        timeout: Duration,
    },
    Check {
        keys: Vec<&'a str>,
    },
    Delete {
        key: &'a str,
    },
    NumKeys,
}

/// The server's answer to one request.
#[derive(Debug, PartialEq)]
pub(crate) enum Response {
    /// `set` and `wait` succeeded.
    Done,
    /// The value for `get` or `compare_set`.
    Value(Vec<u8>),
    /// The counter after `add`.
    Int(i64),
    /// The answer to `check` or `delete`.
    Bool(bool),
    /// The answer to `num_keys`.
    Count(u64),
    /// The server's protocol version.
    Hello(u32),
    /// These keys were still missing at the deadline.
    Timeout(Vec<String>),
    /// `add` found this non-integer value.
    NotACounter(Vec<u8>),
    /// The request was refused; the server closes the connection after it.
    Error(String),
}

fn micros(timeout: Duration) -> u64 {
    u64::try_from(timeout.as_micros()).unwrap_or(u64::MAX)
}

fn keys<'a>(d: &mut Decoder<'a>) -> Result<Vec<&'a str>, String> {
    let n = d.u32("key count")?;
    // No capacity from `n`: each key needs at least its 4-byte length, so
    // the frame bounds how many can really follow.
    let mut keys = Vec::new();
    for _ in 0..n {
        keys.push(d.str("key", MAX_KEY_LEN)?);
    }
    Ok(keys)
}

impl<'a> Request<'a> {
    /// The request as a frame (length prefix included).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::frame();
        match self {
            Request::Hello { magic, version } => e.u8(OP_HELLO).blob(magic).u32(*version),
            Request::Set { key, value } => e.u8(OP_SET).blob(key.as_bytes()).blob(value),
            Request::Get { key, timeout } => {
                e.u8(OP_GET).blob(key.as_bytes()).u64(micros(*timeout))
            }
            Request::Add { key, delta } => e.u8(OP_ADD).blob(key.as_bytes()).i64(*delta),
            Request::CompareSet {
                key,
                expected,
                desired,
            } => e
                .u8(OP_COMPARE_SET)
                .blob(key.as_bytes())
                .blob(expected)
                .blob(desired),
            Request::Wait { keys, timeout } => {
                e.u8(OP_WAIT).u32(keys.len() as u32);
                for k in keys {
                    e.blob(k.as_bytes());
                }
                e.u64(micros(*timeout))
            }
            Request::Check { keys } => {
                e.u8(OP_CHECK).u32(keys.len() as u32);
                for k in keys {
                    e.blob(k.as_bytes());
                }
                &mut e
            }
            Request::Delete { key } => e.u8(OP_DELETE).blob(key.as_bytes()),
            Request::NumKeys => e.u8(OP_NUM_KEYS),
        };
        e.finish_frame()
    }

    /// Parses a frame's body; the error says what was wrong and where.
    pub(crate) fn decode(body: &'a [u8]) -> Result<Request<'a>, String> {
        let mut d = Decoder::new(body);
        let request = match d.u8("op")? {
            OP_HELLO => Request::Hello {
                magic: d.blob("magic", MAGIC.len())?,
                version: d.u32("version")?,
            },
            OP_SET => Request::Set {
                key: d.str("key", MAX_KEY_LEN)?,
                value: d.blob("value", MAX_VALUE_LEN)?,
            },
            OP_GET => Request::Get {
                key: d.str("key", MAX_KEY_LEN)?,
                timeout: Duration::from_micros(d.u64("timeout")?),
            },
            OP_ADD => Request::Add {
                key: d.str("key", MAX_KEY_LEN)?,
                delta: d.i64("delta")?,
            },
            OP_COMPARE_SET => Request::CompareSet {
                key: d.str("key", MAX_KEY_LEN)?,
                expected: d.blob("expected value", MAX_VALUE_LEN)?,
                desired: d.blob("desired value", MAX_VALUE_LEN)?,
            },
            OP_WAIT => Request::Wait {
                keys: keys(&mut d)?,
                timeout: Duration::from_micros(d.u64("timeout")?),
            },
            OP_CHECK => Request::Check {
                keys: keys(&mut d)?,
            },
            OP_DELETE => Request::Delete {
                key: d.str("key", MAX_KEY_LEN)?,
            },
            OP_NUM_KEYS => Request::NumKeys,
            op => return Err(format!("unknown op {op}")),
        };
        if !d.is_empty() {
            return Err(format!(
                "{} bytes left over after the request",
                body.len() - d.pos()
            ));
        }
        Ok(request)
    }
}

impl Response {
    /// The response as a frame (length prefix included).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::frame();
        match self {
            Response::Done => e.u8(ST_DONE),
            Response::Value(v) => e.u8(ST_VALUE).blob(v),
            Response::Int(n) => e.u8(ST_INT).i64(*n),
            Response::Bool(b) => e.u8(ST_BOOL).u8(u8::from(*b)),
            Response::Count(n) => e.u8(ST_COUNT).u64(*n),
            Response::Hello(v) => e.u8(ST_HELLO).u32(*v),
            Response::Timeout(keys) => {
                e.u8(ST_TIMEOUT).u32(keys.len() as u32);
                for k in keys {
                    e.blob(k.as_bytes());
                }
                &mut e
            }
            Response::NotACounter(v) => e.u8(ST_NOT_A_COUNTER).blob(v),
            Response::Error(msg) => {
                let msg = &msg.as_bytes()[..msg.len().min(MAX_KEY_LEN)];
                e.u8(ST_ERROR).blob(msg)
            }
        };
        e.finish_frame()
    }

    /// Parses a frame's body; the error says what was wrong and where.
    pub(crate) fn decode(body: &[u8]) -> Result<Response, String> {
        let mut d = Decoder::new(body);
        let response = match d.u8("status")? {
            ST_DONE => Response::Done,
            ST_VALUE => Response::Value(d.blob("value", MAX_VALUE_LEN)?.to_vec()),
            ST_INT => Response::Int(d.i64("counter")?),
            ST_BOOL => match d.u8("bool")? {
                0 => Response::Bool(false),
                1 => Response::Bool(true),
                b => return Err(format!("bool byte {b} is neither 0 nor 1")),
            },
            ST_COUNT => Response::Count(d.u64("count")?),
            ST_HELLO => Response::Hello(d.u32("version")?),
            ST_TIMEOUT => Response::Timeout(keys(&mut d)?.into_iter().map(String::from).collect()),
            ST_NOT_A_COUNTER => Response::NotACounter(d.blob("value", MAX_VALUE_LEN)?.to_vec()),
            ST_ERROR => Response::Error(
                String::from_utf8_lossy(d.blob("message", MAX_KEY_LEN)?).into_owned(),
            ),
            status => return Err(format!("unknown status {status}")),
        };
        if !d.is_empty() {
            return Err(format!(
                "{} bytes left over after the response",
                body.len() - d.pos()
            ));
        }
        Ok(response)
    }
}

/// Reads one frame's body. `Ok(None)`: the peer closed the connection
/// cleanly, between frames. An oversized or empty frame is an
/// `InvalidData` error, raised before any of its body is read.
pub(crate) fn read_frame(r: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < len.len() {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a frame's length",
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_FRAME_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame length {len} is outside 1..={MAX_FRAME_LEN}"),
        ));
    }
    // Grow with the bytes that really arrive, not with what `len` claims.
    let mut body = Vec::with_capacity(len.min(64 << 10));
    r.take(len as u64).read_to_end(&mut body)?;
    if body.len() < len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "connection closed after {} of a frame's {len} bytes",
                body.len()
            ),
        ));
    }
    Ok(Some(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(frame: &[u8]) -> &[u8] {
        &frame[4..]
    }

    #[test]
    fn every_request_round_trips() {
        let requests = [
            Request::Hello {
                magic: MAGIC,
                version: VERSION,
            },
            Request::Set {
                key: "k",
                value: b"\0v",
            },
            Request::Get {
                key: "k",
                timeout: Duration::from_micros(1500),
            },
            Request::Add {
                key: "n",
                delta: -9,
            },
            Request::CompareSet {
                key: "k",
                expected: b"",
                desired: b"d",
            },
            Request::Wait {
                keys: vec!["a", "b"],
                timeout: Duration::from_secs(3),
            },
            Request::Check { keys: vec![] },
            Request::Delete { key: "k" },
            Request::NumKeys,
        ];
        for request in requests {
            let frame = request.encode();
            assert_eq!(Request::decode(body(&frame)).unwrap(), request);
        }
    }

    #[test]
    fn every_response_round_trips() {
        let responses = [
            Response::Done,
            Response::Value(b"v".to_vec()),
            Response::Int(-3),
            Response::Bool(true),
            Response::Count(7),
            Response::Hello(VERSION),
            Response::Timeout(vec!["a".into(), "b".into()]),
            Response::NotACounter(b"x".to_vec()),
            Response::Error("bad".into()),
        ];
        for response in responses {
            let frame = response.encode();
            assert_eq!(Response::decode(body(&frame)).unwrap(), response);
        }
    }

    #[test]
    fn malformed_bodies_are_errors() {
        assert!(Request::decode(&[]).is_err());
        assert!(Request::decode(&[99]).unwrap_err().contains("unknown op"));
        let mut frame = Request::NumKeys.encode();
        frame.push(0);
        assert!(Request::decode(body(&frame))
            .unwrap_err()
            .contains("left over"));
        // A key count far beyond what the frame holds.
        let mut e = Encoder::new();
        e.u8(OP_CHECK).u32(u32::MAX);
        assert!(Request::decode(&e.finish()).is_err());
        // A value length over the limit.
        let mut e = Encoder::new();
        e.u8(OP_SET).blob(b"k").u32(MAX_VALUE_LEN as u32 + 1);
        assert!(Request::decode(&e.finish())
            .unwrap_err()
            .contains("over the limit"));
    }

    #[test]
    fn frames_are_bounded_before_reading_their_body() {
        let mut huge: &[u8] = &[0xff, 0xff, 0xff, 0xff, 1, 2, 3];
        let err = read_frame(&mut huge).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        let mut empty: &[u8] = &[0, 0, 0, 0];
        assert_eq!(
            read_frame(&mut empty).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        let mut short: &[u8] = &[10, 0, 0, 0, 1, 2];
        assert_eq!(
            read_frame(&mut short).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
        let mut nothing: &[u8] = &[];
        assert!(read_frame(&mut nothing).unwrap().is_none());
        let mut two = Request::NumKeys.encode();
        two.extend(Request::Delete { key: "k" }.encode());
        let mut r: &[u8] = &two;
        assert_eq!(read_frame(&mut r).unwrap().unwrap(), [OP_NUM_KEYS]);
        assert!(read_frame(&mut r).unwrap().is_some());
        assert!(read_frame(&mut r).unwrap().is_none());
    }

    #[test]
    fn random_and_mutated_bytes_decode_to_errors_never_panics() {
        let mut rng = cohort_rng::SplitMix64::new(1);
        let mut next = move || rng.next_u64();
        let seeds: Vec<Vec<u8>> = [
            Request::Wait {
                keys: vec!["a", "bb"],
                timeout: Duration::from_secs(1),
            }
            .encode(),
            Request::CompareSet {
                key: "k",
                expected: b"e",
                desired: b"d",
            }
            .encode(),
            Response::Timeout(vec!["a".into()]).encode(),
            Response::Value(b"v".to_vec()).encode(),
        ]
        .into_iter()
        .map(|f| f[4..].to_vec())
        .collect();
        for i in 0..20_000 {
            let body: Vec<u8> = if i % 2 == 0 {
                let n = (next() % 64) as usize;
                (0..n).map(|_| next() as u8).collect()
            } else {
                let mut b = seeds[i % seeds.len()].clone();
                let at = (next() as usize) % b.len();
                b[at] = next() as u8;
                b.truncate(b.len() - (next() as usize) % 3);
                b
            };
            let _ = Request::decode(&body);
            let _ = Response::decode(&body);
            let mut framed = (body.len() as u32).to_le_bytes().to_vec();
            framed.extend(&body);
            framed.truncate(framed.len() - (next() as usize) % 2);
            let _ = read_frame(&mut &framed[..]);
        }
    }
}

//! TensorBoard event files for scalar curves: what
//! `torch.utils.tensorboard.SummaryWriter.add_scalar` writes, read by
//! TensorBoard as the file grows.
//!
//! An event file is a sequence of records (TFRecord framing): the length as
//! a little-endian u64, a masked CRC-32C of those 8 bytes, the payload, and
//! a masked CRC-32C of the payload. Each payload is one `Event` protocol
//! buffer (`tensorboard/compat/proto/event.proto`):
//!
//! ```text
//! message Event { double wall_time = 1; int64 step = 2;
//!                 oneof what { string file_version = 3; Summary summary = 5;
//!                              SessionLog session_log = 7; } }
//! message Summary { repeated Value value = 1; }
//! message Value { string tag = 1; float simple_value = 2; }      // Summary.Value
//! message SessionLog { SessionStatus status = 1; }                // START = 1
//! ```
//!
//! Only these fields are written, so the encoder is a few lines here rather
//! than a protobuf code generator. The first event of a file carries
//! `file_version = "brain.Event:2"`. A `SessionLog` START at step `s` tells
//! TensorBoard that a run restarted from `s`: it drops what earlier files
//! logged at later steps, so a resumed run's curves have each step once.
//!
//! This crate knows files and records, never what a training run is.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// What went wrong with an event file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EventError {
    /// Creating, writing or reading a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file (or directory).
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A record is cut short or fails its checksum.
    #[error("{path}: record at byte {offset}: {what}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Where the record starts.
        offset: u64,
        /// What is wrong.
        what: &'static str,
    },
}

/// The `file_version` of the first event, as TensorBoard expects it.
pub const FILE_VERSION: &str = "brain.Event:2";

/// CRC-32C of `data`, masked as TFRecord does (so that a CRC of data that
/// itself holds CRCs is not degenerate).
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One event, as written or read back.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Seconds since the Unix epoch.
    pub wall_time: f64,
    /// The training step.
    pub step: i64,
    /// What happened.
    pub what: What,
}

/// The kinds of event this crate writes.
#[derive(Debug, Clone, PartialEq)]
pub enum What {
    /// The first event of a file.
    FileVersion(String),
    /// Scalars, as `(tag, value)`.
    Scalars(Vec<(String, f32)>),
    /// A (re)start of the run at this event's step.
    SessionStart,
    /// Anything else (read back from a file another writer wrote).
    Other,
}

/// Appends events to a new event file in a directory.
pub struct EventWriter {
    out: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// Creates the directory if needed and a new event file in it, named as
    /// TensorBoard's writers name theirs (`events.out.tfevents.TIME.HOST.PID.N`,
    /// TIME later than any other file's there), and writes its first event.
    pub fn create(dir: &Path) -> Result<EventWriter, EventError> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| EventError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let now = now();
        // Readers take a directory's files in name order: the new file's
        // timestamp is after every existing one, even within one second.
        let newest = std::fs::read_dir(dir)
            .map_err(io(dir))?
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let rest = name.strip_prefix("events.out.tfevents.")?;
                rest.split('.').next()?.parse::<u64>().ok()
            })
            .max();
        let stamp = newest.map_or(now as u64, |n| (now as u64).max(n + 1));
        let path = dir.join(format!(
            "events.out.tfevents.{}.{}.{}.{}",
            stamp,
            hostname(),
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let file = File::create(&path).map_err(io(&path))?;
        let mut w = EventWriter {
            out: BufWriter::new(file),
            path,
        };
        w.write(&Event {
            wall_time: now,
            step: 0,
            what: What::FileVersion(FILE_VERSION.into()),
        })?;
        w.flush()?;
        Ok(w)
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Scalars of one step, as one event (call [`EventWriter::flush`] for
    /// TensorBoard to see them).
    pub fn add_scalars(
        &mut self,
        step: u64,
        wall_time: f64,
        scalars: &[(&str, f32)],
    ) -> Result<(), EventError> {
        self.write(&Event {
            wall_time,
            step: step as i64,
            what: What::Scalars(scalars.iter().map(|&(t, v)| (t.to_string(), v)).collect()),
        })
    }

    /// Marks a (re)start of the run at `step`: TensorBoard then drops what
    /// earlier files logged at steps after it.
    pub fn session_start(&mut self, step: u64, wall_time: f64) -> Result<(), EventError> {
        self.write(&Event {
            wall_time,
            step: step as i64,
            what: What::SessionStart,
        })
    }

    /// Writes one event's record.
    pub fn write(&mut self, event: &Event) -> Result<(), EventError> {
        let payload = encode(event);
        let len = (payload.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(payload.len() + 16);
        record.extend_from_slice(&len);
        record.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
        record.extend_from_slice(&payload);
        record.extend_from_slice(&masked_crc32c(&payload).to_le_bytes());
        self.out
            .write_all(&record)
            .map_err(|source| EventError::Io {
                path: self.path.clone(),
                source,
            })
    }

    /// Pushes what was written to the file.
    pub fn flush(&mut self) -> Result<(), EventError> {
        self.out.flush().map_err(|source| EventError::Io {
            path: self.path.clone(),
            source,
        })
    }
}

/// Seconds since the Unix epoch, as TensorBoard's `wall_time`.
pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty() && !h.contains(['/', '\0']))
        .unwrap_or_else(|| "localhost".into())
}

/// Reads every event of a file, checking each record's checksums.
pub fn read_events(path: &Path) -> Result<Vec<Event>, EventError> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|source| EventError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    let mut events = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        let corrupt = |what| EventError::Corrupt {
            path: path.to_path_buf(),
            offset: at as u64,
            what,
        };
        let header = bytes.get(at..at + 12).ok_or_else(|| corrupt("cut short"))?;
        let (len, crc) = header.split_at(8);
        if masked_crc32c(len) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(corrupt("length checksum mismatch"));
        }
        let n = u64::from_le_bytes(len.try_into().expect("8 bytes")) as usize;
        let body = at + 12;
        let payload = bytes
            .get(body..body.saturating_add(n))
            .ok_or_else(|| corrupt("cut short"))?;
        let crc = bytes
            .get(body + n..body + n + 4)
            .ok_or_else(|| corrupt("cut short"))?;
        if masked_crc32c(payload) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(corrupt("payload checksum mismatch"));
        }
        events.push(decode(payload).ok_or_else(|| corrupt("not an Event"))?);
        at = body + n + 4;
    }
    Ok(events)
}

// -- protocol buffer wire format: only what the messages above use ---------

const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, u64::from(field) << 3 | u64::from(wire));
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn bytes_field(out: &mut Vec<u8>, field: u32, data: &[u8]) {
    key(out, field, LEN);
    varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

fn encode(e: &Event) -> Vec<u8> {
    let mut out = Vec::new();
    key(&mut out, 1, FIXED64);
    out.extend_from_slice(&e.wall_time.to_le_bytes());
    key(&mut out, 2, VARINT);
    varint(&mut out, e.step as u64);
    match &e.what {
        What::FileVersion(v) => bytes_field(&mut out, 3, v.as_bytes()),
        What::Scalars(values) => {
            let mut summary = Vec::new();
            for (tag, value) in values {
                let mut v = Vec::new();
                bytes_field(&mut v, 1, tag.as_bytes());
                key(&mut v, 2, FIXED32);
                v.extend_from_slice(&value.to_le_bytes());
                bytes_field(&mut summary, 1, &v);
            }
            bytes_field(&mut out, 5, &summary);
        }
        What::SessionStart => {
            let mut log = Vec::new();
            key(&mut log, 1, VARINT);
            varint(&mut log, 1);
            bytes_field(&mut out, 7, &log);
        }
        What::Other => {}
    }
    out
}

/// One field of a message: `(field number, wire type, value, bytes)`; a
/// varint or fixed value is in the u64, a length-delimited one in the slice.
type Field<'a> = (u32, u8, u64, &'a [u8]);

/// A message's fields, in order.
fn fields(mut buf: &[u8]) -> Option<Vec<Field<'_>>> {
    fn take<'a>(buf: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (buf.get(..n)?, buf.get(n..)?);
        *buf = rest;
        Some(head)
    }
    fn read_varint(buf: &mut &[u8]) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = buf.split_first()?;
            *buf = rest;
            v |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                return Some(v);
            }
        }
        None
    }
    let mut out = Vec::new();
    while !buf.is_empty() {
        let k = read_varint(&mut buf)?;
        let (field, wire) = ((k >> 3) as u32, (k & 7) as u8);
        match wire {
            VARINT => {
                let v = read_varint(&mut buf)?;
                out.push((field, wire, v, &[][..]));
            }
            FIXED64 => {
                let b = take(&mut buf, 8)?;
                out.push((field, wire, u64::from_le_bytes(b.try_into().ok()?), &[][..]));
            }
            FIXED32 => {
                let b = take(&mut buf, 4)?;
                let v = u32::from_le_bytes(b.try_into().ok()?);
                out.push((field, wire, u64::from(v), &[][..]));
            }
            LEN => {
                let n = read_varint(&mut buf)? as usize;
                let b = take(&mut buf, n)?;
                out.push((field, wire, 0, b));
            }
            _ => return None,
        }
    }
    Some(out)
}

fn decode(payload: &[u8]) -> Option<Event> {
    let mut e = Event {
        wall_time: 0.0,
        step: 0,
        what: What::Other,
    };
    for (field, _, v, b) in fields(payload)? {
        match field {
            1 => e.wall_time = f64::from_bits(v),
            2 => e.step = v as i64,
            3 => e.what = What::FileVersion(String::from_utf8_lossy(b).into_owned()),
            5 => {
                let mut values = Vec::new();
                for (f, _, _, value) in fields(b)? {
                    if f != 1 {
                        continue;
                    }
                    let (mut tag, mut x) = (String::new(), None);
                    for (vf, _, vv, vb) in fields(value)? {
                        match vf {
                            1 => tag = String::from_utf8_lossy(vb).into_owned(),
                            2 => x = Some(f32::from_bits(vv as u32)),
                            _ => {}
                        }
                    }
                    if let Some(x) = x {
                        values.push((tag, x));
                    }
                }
                e.what = What::Scalars(values);
            }
            7 => {
                let start = fields(b)?.iter().any(|&(f, _, v, _)| f == 1 && v == 1);
                if start {
                    e.what = What::SessionStart;
                }
            }
            _ => {}
        }
    }
    Some(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc_matches_the_published_crc32c_check_value() {
        // CRC-32C("123456789") = 0xE3069283 (RFC 3720's check value); the
        // mask rotates right by 15 and adds 0xa282ead8.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        let masked = 0xe306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8);
        assert_eq!(masked_crc32c(b"123456789"), masked);
        // An empty record's length field, as every TFRecord reader checks it.
        assert_eq!(masked_crc32c(&0u64.to_le_bytes()), {
            let c = crc32c::crc32c(&[0; 8]);
            c.rotate_right(15).wrapping_add(0xa282_ead8)
        });
    }

    #[test]
    fn events_round_trip_and_a_flipped_bit_is_caught() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.add_scalars(10, 1.5, &[("train/loss", 2.25), ("lr", 1e-3)])
            .unwrap();
        w.session_start(10, 2.0).unwrap();
        w.add_scalars(20, 3.0, &[("train/loss", -0.5)]).unwrap();
        w.flush().unwrap();
        let name = w.path().file_name().unwrap().to_string_lossy().to_string();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        let events = read_events(w.path()).unwrap();
        assert_eq!(events.len(), 4);
        assert_eq!(events[0].what, What::FileVersion(FILE_VERSION.into()));
        assert_eq!(
            events[1],
            Event {
                wall_time: 1.5,
                step: 10,
                what: What::Scalars(vec![("train/loss".into(), 2.25), ("lr".into(), 1e-3)]),
            }
        );
        assert_eq!(events[2].what, What::SessionStart);
        assert_eq!(events[3].step, 20);

        let mut bytes = std::fs::read(w.path()).unwrap();
        let last = bytes.len() - 6;
        bytes[last] ^= 1;
        std::fs::write(w.path(), &bytes).unwrap();
        let e = read_events(w.path()).unwrap_err().to_string();
        assert!(e.contains("payload checksum mismatch"), "{e}");
        bytes.truncate(bytes.len() - 2);
        std::fs::write(w.path(), &bytes).unwrap();
        let e = read_events(w.path()).unwrap_err().to_string();
        assert!(e.contains("cut short"), "{e}");
    }

    #[test]
    fn a_large_step_and_a_long_tag_encode_as_varints() {
        let e = Event {
            wall_time: 0.25,
            step: 1 << 40,
            what: What::Scalars(vec![("x".repeat(300), 7.0)]),
        };
        assert_eq!(decode(&encode(&e)), Some(e));
    }
}

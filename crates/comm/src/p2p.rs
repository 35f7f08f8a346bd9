//! Point-to-point messages (send/recv) on the P2p channel, matched by tag.
//!
//! Messages are framed like collective frames (kind `send`, the tag in the
//! root field). Sends to one peer are serialised by a per-peer lock and
//! written whole. Receives from one peer share a mailbox: one receiver at a
//! time reads the next frame off the socket; if its tag is wanted by that
//! receiver the payload goes straight into the caller's buffer, otherwise it
//! is stashed for whoever asks for that tag, so messages with different
//! tags may be received in any order (as in PyTorch), while messages with
//! the same tag arrive in the order they were sent. Nothing here may block
//! past the call's deadline, and nothing may allocate on a header's say-so:
//! a stashed payload grows only as its bytes arrive.

use std::io::{self, IoSlice};
use std::sync::{Condvar, Mutex};
use std::time::Instant;

use crate::engine::{Header, OpEnv, HEADER_BYTES, WAKE_BYTES};
use crate::error::CommError;
use crate::transport::Interest;

/// A stashed payload grows by at most this much before its bytes arrive.
const STASH_CHUNK: usize = 1 << 20;

struct Stashed {
    header: Header,
    payload: Vec<u8>,
}

#[derive(Default)]
struct MailState {
    reading: bool,
    stash: Vec<Stashed>,
}

#[derive(Default)]
struct Mailbox {
    state: Mutex<MailState>,
    changed: Condvar,
}

/// Per-peer locks and mailboxes of one group.
pub(crate) struct P2p {
    send_locks: Vec<Mutex<()>>,
    boxes: Vec<Mailbox>,
}

impl P2p {
    pub fn new(size: usize) -> P2p {
        P2p {
            send_locks: (0..size).map(|_| Mutex::new(())).collect(),
            boxes: (0..size).map(|_| Mailbox::default()).collect(),
        }
    }

    /// Sends `payload` to `peer` as one frame described by `env.desc`.
    pub fn send(&self, env: &OpEnv<'_>, peer: usize, payload: &[u8]) -> Result<(), CommError> {
        let deadline = Instant::now() + env.timeout;
        let hdr = Header {
            desc: env.desc,
            bytes: payload.len() as u64,
        }
        .encode();
        let _guard = self.send_locks[peer]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut done = 0;
        let total = HEADER_BYTES + payload.len();
        while done < total {
            let r = if done < HEADER_BYTES {
                env.transport.try_write(
                    env.channel,
                    peer,
                    &[IoSlice::new(&hdr[done..]), IoSlice::new(payload)],
                )
            } else {
                env.transport.try_write(
                    env.channel,
                    peer,
                    &[IoSlice::new(&payload[done - HEADER_BYTES..])],
                )
            };
            match r {
                Ok(0) => return Err(env.lost(peer, &io::Error::from(io::ErrorKind::WriteZero))),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let i = Interest {
                        peer,
                        read: 0,
                        write: true,
                    };
                    wait(env, peer, i, deadline)?;
                }
                Err(e) => return Err(env.lost(peer, &e)),
            }
        }
        Ok(())
    }

    /// Receives into `dst` the next message from `peer` whose tag and shape
    /// are `env.desc`'s (kind `send`, as the sender described it).
    pub fn recv(
        &self,
        env: &OpEnv<'_>,
        ours: &str,
        peer: usize,
        dst: &mut [u8],
    ) -> Result<(), CommError> {
        let deadline = Instant::now() + env.timeout;
        let tag = env.desc.root;
        let mb = &self.boxes[peer];
        let mut st = mb.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(i) = st.stash.iter().position(|m| m.header.desc.root == tag) {
                let m = st.stash.remove(i);
                drop(st);
                check(env, ours, peer, &m.header, dst.len())?;
                dst.copy_from_slice(&m.payload);
                return Ok(());
            }
            if !st.reading {
                st.reading = true;
                drop(st);
                let r = read_frame(env, ours, peer, dst, deadline);
                st = mb.state.lock().unwrap_or_else(|e| e.into_inner());
                st.reading = false;
                mb.changed.notify_all();
                match r {
                    Ok(None) => return Ok(()),
                    Ok(Some(other)) => st.stash.push(other),
                    Err(e) => return Err(e),
                }
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(env.timed_out(peer));
            }
            st = mb
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

fn wait(env: &OpEnv<'_>, peer: usize, i: Interest, deadline: Instant) -> Result<(), CommError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(env.timed_out(peer));
    }
    env.transport
        .wait(env.channel, &[i], left)
        .map_err(|e| env.lost(peer, &e))?;
    Ok(())
}

fn read_exact(
    env: &OpEnv<'_>,
    peer: usize,
    buf: &mut [u8],
    deadline: Instant,
) -> Result<(), CommError> {
    let mut got = 0;
    while got < buf.len() {
        match env.transport.try_read(env.channel, peer, &mut buf[got..]) {
            Ok(0) => return Err(env.lost(peer, &io::Error::from(io::ErrorKind::UnexpectedEof))),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => wait(
                env,
                peer,
                Interest {
                    peer,
                    read: (buf.len() - got).min(WAKE_BYTES),
                    write: false,
                },
                deadline,
            )?,
            Err(e) => return Err(env.lost(peer, &e)),
        }
    }
    Ok(())
}

fn check(
    env: &OpEnv<'_>,
    ours: &str,
    peer: usize,
    h: &Header,
    want: usize,
) -> Result<(), CommError> {
    if h.desc.kind != env.desc.kind
        || h.desc.dtype != env.desc.dtype
        || h.desc.count != env.desc.count
        || h.bytes != want as u64
    {
        return Err(CommError::Mismatch {
            group: env.group.to_string(),
            rank: env.rank(),
            peer,
            ours: ours.to_string(),
            theirs: h.desc.describe(),
        });
    }
    Ok(())
}

/// Reads one frame: `None` if it was ours (payload now in `dst`), or the
/// frame for another tag.
fn read_frame(
    env: &OpEnv<'_>,
    ours: &str,
    peer: usize,
    dst: &mut [u8],
    deadline: Instant,
) -> Result<Option<Stashed>, CommError> {
    let mut raw = [0u8; HEADER_BYTES];
    read_exact(env, peer, &mut raw, deadline)?;
    let header = Header::decode(&raw).ok_or_else(|| {
        env.lost(
            peer,
            &io::Error::new(
                io::ErrorKind::InvalidData,
                "received bytes that are not a cohort frame header (stream out of sync)",
            ),
        )
    })?;
    if header.desc.root == env.desc.root {
        check(env, ours, peer, &header, dst.len())?;
        read_exact(env, peer, dst, deadline)?;
        return Ok(None);
    }
    // A frame nobody waits for yet: its length is only the sender's word.
    let claimed = header
        .desc
        .dtype
        .and_then(|d| header.desc.count.checked_mul(d.size() as u64));
    let len = match usize::try_from(header.bytes) {
        Ok(len) if header.desc.kind == env.desc.kind && claimed == Some(header.bytes) => len,
        _ => {
            return Err(env.lost(
                peer,
                &io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "received a frame header claiming {} bytes for {} (corrupt, or the stream is out of sync)",
                        header.bytes,
                        header.desc.describe()
                    ),
                ),
            ))
        }
    };
    let mut payload = Vec::new();
    while payload.len() < len {
        let at = payload.len();
        payload.resize(at + (len - at).min(STASH_CHUNK), 0);
        read_exact(env, peer, &mut payload[at..], deadline)?;
    }
    Ok(Some(Stashed { header, payload }))
}

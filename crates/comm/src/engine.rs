//! The progress engine: runs one collective's schedule of frames over a
//! transport, in the calling thread, and checks every frame's header.
//!
//! An algorithm describes its communication as a [`Schedule`]: for each peer
//! it sends to, an ordered list of frames (a region of a buffer), and for
//! each peer it receives from, an ordered list of frames (where the bytes
//! land, and optionally a region to reduce them into). A frame may wait for
//! a dependency: "after k frames of receive stream s are complete". That is
//! enough to express pipelining: a ring sends segment j of step s+1 as soon
//! as segment j of step s has arrived and been reduced, while later segments
//! of step s are still on the wire.
//!
//! The engine drives all streams at once with non-blocking I/O from one
//! thread: it writes whatever the socket accepts, reads whatever has
//! arrived, reduces each completed receive frame, and when nothing moves it
//! sleeps in the transport's `wait` until a socket is ready or the op's
//! deadline passes. Sending and receiving thus
//! overlap without a thread per peer, and no byte is copied except by the
//! kernel and the reduction.
//!
//! Wire format: every frame is a 32-byte [`Header`] then its payload. The
//! header names the op (kind, sequence number, dtype, element count, reduce
//! op, root) and the payload length; the receiver compares it with what it
//! expects before a payload byte is read, so a mismatched call is reported
//! as [`CommError::Mismatch`] and never lands in a user buffer. The engine
//! must never read a payload whose header it has not checked, and never
//! block without a deadline.

use std::io::{self, IoSlice};
use std::time::{Duration, Instant};

use crate::element::DType;
use crate::error::CommError;
use crate::kinds::OpKind;
use crate::reduce_op::{finish_avg, reduce_into, ReduceOp};
use crate::transport::{Channel, Interest, Transport};

/// Bytes of a frame header.
pub(crate) const HEADER_BYTES: usize = 32;
const MAGIC: u8 = 0xc7;
/// Header flag: the frame is the `COHORT_DEBUG=detail` digest of a call, not data.
pub(crate) const FLAG_DIGEST: u8 = 1;

/// A waiting receiver asks to be woken once this much of its frame (or
/// all of it, if less) has arrived: one wake-up per segment, not per packet.
pub(crate) const WAKE_BYTES: usize = 256 << 10;

/// How long a failing op waits to learn which other peers are gone too.
const HANG_UP_GRACE: Duration = Duration::from_millis(100);

/// What a call is: the part of the header both sides must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OpDesc {
    pub kind: OpKind,
    pub seq: u64,
    pub dtype: Option<DType>,
    pub count: u64,
    pub reduce: Option<ReduceOp>,
    /// Root of rooted collectives; the tag of point-to-point messages.
    pub root: u32,
    pub flags: u8,
}

impl OpDesc {
    /// Human description used in mismatch errors.
    pub fn describe(&self) -> String {
        let mut s = match self.kind {
            OpKind::Send | OpKind::Recv => format!("{} with tag {}", self.kind, self.root),
            _ => format!("{} #{}", self.kind, self.seq),
        };
        if self.kind != OpKind::Barrier {
            let dt = self.dtype.map_or("?", |d| d.name());
            s += &format!(" of {} x {dt}", self.count);
        }
        if let Some(r) = self.reduce {
            s += &format!(" ({r})");
        }
        if self.flags & FLAG_DIGEST != 0 {
            s += " [COHORT_DEBUG=detail digest]";
        }
        if matches!(
            self.kind,
            OpKind::Broadcast | OpKind::Reduce | OpKind::Gather | OpKind::Scatter
        ) {
            s += &format!(" with root {}", self.root);
        }
        s
    }
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Header {
    pub desc: OpDesc,
    pub bytes: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let d = &self.desc;
        let mut b = [0u8; HEADER_BYTES];
        b[0] = MAGIC;
        b[1] = d.kind.code();
        b[2] = d.dtype.map_or(0, DType::code);
        b[3] = d.reduce.map_or(0, ReduceOp::code);
        b[4] = d.flags;
        b[8..12].copy_from_slice(&d.root.to_le_bytes());
        b[12..16].copy_from_slice(&(self.bytes as u32).to_le_bytes());
        b[16..24].copy_from_slice(&d.seq.to_le_bytes());
        b[24..32].copy_from_slice(&d.count.to_le_bytes());
        // The high half of the payload length rides in bytes 5..8: frames are
        // segments, far below 2^56 bytes.
        b[5..8].copy_from_slice(&((self.bytes >> 32) as u32).to_le_bytes()[..3]);
        b
    }

    /// Decodes `b`; `None` if it is not a header at all (stream out of sync).
    pub fn decode(b: &[u8; HEADER_BYTES]) -> Option<Header> {
        if b[0] != MAGIC {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        let hi = u32::from_le_bytes([b[5], b[6], b[7], 0]) as u64;
        Some(Header {
            desc: OpDesc {
                kind: OpKind::from_code(b[1])?,
                dtype: if b[2] == 0 {
                    None
                } else {
                    Some(DType::from_code(b[2])?)
                },
                reduce: if b[3] == 0 {
                    None
                } else {
                    Some(ReduceOp::from_code(b[3])?)
                },
                flags: b[4],
                root: u32_at(8),
                seq: u64_at(16),
                count: u64_at(24),
            },
            bytes: (hi << 32) | u32_at(12) as u64,
        })
    }
}

/// A byte range of one of the buffers an op works on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Region {
    /// The op's output (in-place buffer for all_reduce and broadcast).
    Out(usize, usize),
    /// The op's separate input, read-only.
    In(usize, usize),
    /// The group's scratch buffer.
    Scratch(usize, usize),
}

impl Region {
    pub fn len(self) -> usize {
        match self {
            Region::Out(_, n) | Region::In(_, n) | Region::Scratch(_, n) => n,
        }
    }
}

/// A point in the schedule that a frame may wait for.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Dep {
    /// `count` frames of receive stream `stream` arrived (and were reduced).
    Recv { stream: usize, count: usize },
    /// `count` frames of send stream `stream` were handed to the transport.
    Sent { stream: usize, count: usize },
}

#[derive(Clone, Debug)]
pub(crate) struct SendFrame {
    pub src: Region,
    pub after: Option<Dep>,
}

#[derive(Clone, Debug)]
pub(crate) struct RecvFrame {
    pub dst: Region,
    pub after: Option<Dep>,
    /// Reduce the received bytes into this region (same length).
    pub reduce_into: Option<Region>,
    /// Complete (reduce) only after this: reading goes ahead, but a region
    /// that is still being sent must not change under the send.
    pub hold: Option<Dep>,
    /// Then divide that region by the world size (the end of `Avg`).
    pub finish_avg: bool,
}

impl RecvFrame {
    /// Receive straight into `dst`.
    pub fn copy(dst: Region) -> RecvFrame {
        RecvFrame {
            dst,
            after: None,
            reduce_into: None,
            hold: None,
            finish_avg: false,
        }
    }

    /// Receive into `tmp`, then reduce into `into`.
    pub fn reduce(tmp: Region, into: Region) -> RecvFrame {
        RecvFrame {
            reduce_into: Some(into),
            ..RecvFrame::copy(tmp)
        }
    }

    /// Start reading only after `dep`.
    pub fn after(self, dep: Option<Dep>) -> RecvFrame {
        RecvFrame { after: dep, ..self }
    }

    /// Complete (reduce) only after `dep`.
    pub fn hold(self, dep: Option<Dep>) -> RecvFrame {
        RecvFrame { hold: dep, ..self }
    }

    /// Divide the reduced region by the world size if `yes`.
    pub fn finish_avg(self, yes: bool) -> RecvFrame {
        RecvFrame {
            finish_avg: yes,
            ..self
        }
    }
}

/// Frames to or from one peer, in wire order.
#[derive(Clone, Debug)]
pub(crate) struct Stream<F> {
    pub peer: usize,
    pub frames: Vec<F>,
}

/// Everything one rank sends and receives in one op.
#[derive(Clone, Debug, Default)]
pub(crate) struct Schedule {
    pub sends: Vec<Stream<SendFrame>>,
    pub recvs: Vec<Stream<RecvFrame>>,
}

impl Schedule {
    /// Index of the send stream to `peer`, created on first use.
    pub fn send_stream(&mut self, peer: usize) -> usize {
        if let Some(i) = self.sends.iter().position(|s| s.peer == peer) {
            return i;
        }
        self.sends.push(Stream {
            peer,
            frames: Vec::new(),
        });
        self.sends.len() - 1
    }

    /// Index of the receive stream from `peer`, created on first use.
    pub fn recv_stream(&mut self, peer: usize) -> usize {
        if let Some(i) = self.recvs.iter().position(|s| s.peer == peer) {
            return i;
        }
        self.recvs.push(Stream {
            peer,
            frames: Vec::new(),
        });
        self.recvs.len() - 1
    }

    /// Appends a send of `src` to `peer`; returns the dependency that is
    /// satisfied once the frame has been handed to the transport.
    pub fn send(&mut self, peer: usize, src: Region, after: Option<Dep>) -> Dep {
        let s = self.send_stream(peer);
        self.sends[s].frames.push(SendFrame { src, after });
        Dep::Sent {
            stream: s,
            count: self.sends[s].frames.len(),
        }
    }

    /// Appends a receive from `peer`; returns the dependency that is
    /// satisfied once this frame is complete.
    pub fn recv(&mut self, peer: usize, frame: RecvFrame) -> Dep {
        let s = self.recv_stream(peer);
        self.recvs[s].frames.push(frame);
        Dep::Recv {
            stream: s,
            count: self.recvs[s].frames.len(),
        }
    }
}

/// The buffers an op's regions point into.
pub(crate) struct Bufs<'a> {
    pub out: &'a mut [u8],
    pub inp: &'a [u8],
    pub scratch: &'a mut [u8],
}

impl Bufs<'_> {
    fn get(&self, r: Region) -> &[u8] {
        match r {
            Region::Out(o, n) => &self.out[o..o + n],
            Region::In(o, n) => &self.inp[o..o + n],
            Region::Scratch(o, n) => &self.scratch[o..o + n],
        }
    }

    fn get_mut(&mut self, r: Region) -> &mut [u8] {
        match r {
            Region::Out(o, n) => &mut self.out[o..o + n],
            Region::Scratch(o, n) => &mut self.scratch[o..o + n],
            Region::In(..) => unreachable!("schedules never write the input"),
        }
    }

    /// `into = into op from`, for the region pairs schedules use.
    fn reduce(&mut self, dtype: DType, op: ReduceOp, into: Region, from: Region) {
        match (into, from) {
            (Region::Out(o, n), Region::Scratch(s, _)) => {
                reduce_into(dtype, op, &mut self.out[o..o + n], &self.scratch[s..s + n])
            }
            (Region::Out(o, n), Region::In(s, _)) => {
                reduce_into(dtype, op, &mut self.out[o..o + n], &self.inp[s..s + n])
            }
            (Region::Scratch(a, n), Region::Scratch(b, _)) => {
                debug_assert!(a + n <= b || b + n <= a, "overlapping scratch regions");
                if a < b {
                    let (lo, hi) = self.scratch.split_at_mut(b);
                    reduce_into(dtype, op, &mut lo[a..a + n], &hi[..n]);
                } else {
                    let (lo, hi) = self.scratch.split_at_mut(a);
                    reduce_into(dtype, op, &mut hi[..n], &lo[b..b + n]);
                }
            }
            (into, from) => unreachable!("no schedule reduces {from:?} into {into:?}"),
        }
    }

    /// Copies `from` into `to` (local moves of algorithms, outside the engine).
    pub fn copy(&mut self, to: Region, from: Region) {
        match (to, from) {
            (Region::Out(o, n), Region::In(i, _)) => {
                self.out[o..o + n].copy_from_slice(&self.inp[i..i + n])
            }
            (Region::Scratch(o, n), Region::In(i, _)) => {
                self.scratch[o..o + n].copy_from_slice(&self.inp[i..i + n])
            }
            (Region::Out(o, n), Region::Scratch(i, _)) => {
                self.out[o..o + n].copy_from_slice(&self.scratch[i..i + n])
            }
            (to, from) => unreachable!("no algorithm copies {from:?} into {to:?}"),
        }
    }
}

/// Who is running the op, for errors and headers.
pub(crate) struct OpEnv<'a> {
    pub transport: &'a dyn Transport,
    pub channel: Channel,
    pub group: &'a str,
    pub timeout: Duration,
    pub desc: OpDesc,
}

impl OpEnv<'_> {
    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    pub fn size(&self) -> usize {
        self.transport.size()
    }

    pub fn lost(&self, peer: usize, e: &io::Error) -> CommError {
        let detail = match e.kind() {
            io::ErrorKind::UnexpectedEof => {
                "the peer closed the connection (it exited, crashed or aborted)".to_string()
            }
            io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => {
                format!("{e} (the peer exited, crashed or aborted)")
            }
            _ => e.to_string(),
        };
        // When one rank dies, its neighbours abort and their neighbours see
        // *them* close: name every rank that is gone so the first one shows.
        // The dead rank's sockets close within moments of each other, so a
        // short wait on this error path catches them.
        let others: Vec<usize> = (0..self.size())
            .filter(|&p| p != peer && p != self.rank())
            .collect();
        let gone = self.transport.hung_up(self.channel, &others, HANG_UP_GRACE);
        let detail = if gone.is_empty() {
            detail
        } else {
            let list: Vec<String> = gone.iter().map(|p| p.to_string()).collect();
            format!(
                "{detail}; other ranks that have closed their connections to this one: {}",
                list.join(", ")
            )
        };
        CommError::PeerLost {
            op: self.desc.kind,
            seq: self.desc.seq,
            group: self.group.to_string(),
            rank: self.rank(),
            peer,
            detail,
        }
    }

    pub fn timed_out(&self, peer: usize) -> CommError {
        CommError::Timeout {
            op: self.desc.kind,
            seq: self.desc.seq,
            group: self.group.to_string(),
            rank: self.rank(),
            peer,
            timeout: self.timeout,
        }
    }

    /// Checks a received header against what this rank expects.
    pub fn check(
        &self,
        peer: usize,
        raw: &[u8; HEADER_BYTES],
        expect_bytes: usize,
    ) -> Result<(), CommError> {
        let Some(h) = Header::decode(raw) else {
            return Err(self.lost(
                peer,
                &io::Error::new(
                    io::ErrorKind::InvalidData,
                    "received bytes that are not a cohort frame header (stream out of sync)",
                ),
            ));
        };
        if h.desc != self.desc {
            return Err(CommError::Mismatch {
                group: self.group.to_string(),
                rank: self.rank(),
                peer,
                ours: self.desc.describe(),
                theirs: h.desc.describe(),
            });
        }
        if h.bytes != expect_bytes as u64 {
            return Err(CommError::Mismatch {
                group: self.group.to_string(),
                rank: self.rank(),
                peer,
                ours: format!(
                    "{} (expecting a frame of {expect_bytes} bytes)",
                    self.desc.describe()
                ),
                theirs: format!("{} (sent a frame of {} bytes)", h.desc.describe(), h.bytes),
            });
        }
        Ok(())
    }
}

#[derive(Default, Clone, Copy)]
struct SendState {
    next: usize,
    written: usize,
}

#[derive(Clone, Copy)]
struct RecvState {
    done: usize,
    hdr: [u8; HEADER_BYTES],
    hdr_got: usize,
    got: usize,
}

/// The error for a failed write to `peer`. A peer that hit a mismatch may
/// have sent its frame and closed before this rank wrote: over a Unix
/// socket the write then fails at once, while the peer's header still
/// waits unread. Reading that header names the mismatch, the root cause.
fn write_failed(
    env: &OpEnv<'_>,
    sched: &Schedule,
    recvs: &mut [RecvState],
    peer: usize,
    e: &io::Error,
) -> CommError {
    for (st, stream) in recvs.iter_mut().zip(&sched.recvs) {
        let Some(f) = stream.frames.get(st.done) else {
            continue;
        };
        if stream.peer != peer || st.hdr_got == HEADER_BYTES {
            continue;
        }
        while st.hdr_got < HEADER_BYTES {
            match env
                .transport
                .try_read(env.channel, peer, &mut st.hdr[st.hdr_got..])
            {
                Ok(n) if n > 0 => st.hdr_got += n,
                _ => break,
            }
        }
        if st.hdr_got == HEADER_BYTES {
            if let Err(m @ CommError::Mismatch { .. }) = env.check(peer, &st.hdr, f.dst.len()) {
                return m;
            }
        }
    }
    env.lost(peer, e)
}

/// Runs `sched` to completion, reducing with `reduce` where frames ask for it.
pub(crate) fn run(
    env: &OpEnv<'_>,
    sched: &Schedule,
    bufs: &mut Bufs<'_>,
    reduce: Option<(DType, ReduceOp)>,
) -> Result<(), CommError> {
    let t = env.transport;
    let ch = env.channel;
    let deadline = Instant::now() + env.timeout;
    let mut sends = vec![SendState::default(); sched.sends.len()];
    let mut recvs = vec![
        RecvState {
            done: 0,
            hdr: [0; HEADER_BYTES],
            hdr_got: 0,
            got: 0,
        };
        sched.recvs.len()
    ];
    fn dep_ok(sends: &[SendState], recvs: &[RecvState], d: Option<Dep>) -> bool {
        match d {
            None => true,
            Some(Dep::Recv { stream, count }) => recvs[stream].done >= count,
            Some(Dep::Sent { stream, count }) => sends[stream].next >= count,
        }
    }
    let mut interests: Vec<Interest> = Vec::new();
    loop {
        let mut moved = false;
        for si in 0..sends.len() {
            let stream = &sched.sends[si];
            while let Some(f) = stream.frames.get(sends[si].next) {
                if !dep_ok(&sends, &recvs, f.after) {
                    break;
                }
                let st = &mut sends[si];
                let payload = bufs.get(f.src);
                let hdr = Header {
                    desc: env.desc,
                    bytes: payload.len() as u64,
                }
                .encode();
                let r = if st.written < HEADER_BYTES {
                    t.try_write(
                        ch,
                        stream.peer,
                        &[IoSlice::new(&hdr[st.written..]), IoSlice::new(payload)],
                    )
                } else {
                    t.try_write(
                        ch,
                        stream.peer,
                        &[IoSlice::new(&payload[st.written - HEADER_BYTES..])],
                    )
                };
                match r {
                    Ok(0) => {
                        return Err(
                            env.lost(stream.peer, &io::Error::from(io::ErrorKind::WriteZero))
                        )
                    }
                    Ok(n) => {
                        moved = true;
                        st.written += n;
                        if st.written == HEADER_BYTES + payload.len() {
                            st.next += 1;
                            st.written = 0;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(write_failed(env, sched, &mut recvs, stream.peer, &e)),
                }
            }
        }
        for si in 0..recvs.len() {
            let stream = &sched.recvs[si];
            while let Some(f) = stream.frames.get(recvs[si].done) {
                if !dep_ok(&sends, &recvs, f.after) {
                    break;
                }
                let st = &mut recvs[si];
                let want = f.dst.len();
                if st.hdr_got < HEADER_BYTES {
                    match t.try_read(ch, stream.peer, &mut st.hdr[st.hdr_got..]) {
                        Ok(0) => {
                            return Err(env
                                .lost(stream.peer, &io::Error::from(io::ErrorKind::UnexpectedEof)))
                        }
                        Ok(n) => {
                            moved = true;
                            st.hdr_got += n;
                            if st.hdr_got < HEADER_BYTES {
                                continue;
                            }
                            env.check(stream.peer, &st.hdr, want)?;
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) => return Err(env.lost(stream.peer, &e)),
                    }
                }
                if st.got < want {
                    let dst = &mut bufs.get_mut(f.dst)[st.got..];
                    match t.try_read(ch, stream.peer, dst) {
                        Ok(0) => {
                            return Err(env
                                .lost(stream.peer, &io::Error::from(io::ErrorKind::UnexpectedEof)))
                        }
                        Ok(n) => {
                            moved = true;
                            st.got += n;
                            if st.got < want {
                                continue;
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) => return Err(env.lost(stream.peer, &e)),
                    }
                }
                if !dep_ok(&sends, &recvs, f.hold) {
                    break;
                }
                let st = &mut recvs[si];
                st.done += 1;
                st.hdr_got = 0;
                st.got = 0;
                moved = true;
                if let (Some(into), Some((dtype, op))) = (f.reduce_into, reduce) {
                    bufs.reduce(dtype, op, into, f.dst);
                    if f.finish_avg {
                        finish_avg(dtype, bufs.get_mut(into), env.size());
                    }
                }
                // Let the sends that waited for this frame go out while its
                // bytes are still in cache, before reading further ahead.
                break;
            }
        }
        let sends_done = sends
            .iter()
            .zip(&sched.sends)
            .all(|(s, st)| s.next == st.frames.len());
        let recvs_done = recvs
            .iter()
            .zip(&sched.recvs)
            .all(|(r, st)| r.done == st.frames.len());
        if sends_done && recvs_done {
            return Ok(());
        }
        if moved {
            continue;
        }
        // Nothing moved: sleep until a socket is ready. Spinning first was
        // measured to lose: on two cores the spinner steals the time its
        // peer (or the caller's compute threads) needs to make the data.
        let now = Instant::now();
        interests.clear();
        for (st, stream) in sends.iter().zip(&sched.sends) {
            if let Some(f) = stream.frames.get(st.next) {
                if dep_ok(&sends, &recvs, f.after) {
                    interests.push(Interest {
                        peer: stream.peer,
                        read: 0,
                        write: true,
                    });
                }
            }
        }
        for (st, stream) in recvs.iter().zip(&sched.recvs) {
            if let Some(f) = stream.frames.get(st.done) {
                let left = HEADER_BYTES - st.hdr_got + f.dst.len() - st.got;
                if dep_ok(&sends, &recvs, f.after) && left > 0 {
                    let read = left.min(WAKE_BYTES);
                    match interests.iter_mut().find(|i| i.peer == stream.peer) {
                        Some(i) => i.read = read,
                        None => interests.push(Interest {
                            peer: stream.peer,
                            read,
                            write: false,
                        }),
                    }
                }
            }
        }
        let left = deadline.saturating_duration_since(now);
        // A peer we wait to read from is the one to blame on timeout.
        let blame = interests
            .iter()
            .find(|i| i.read > 0)
            .or(interests.first())
            .map_or(env.rank(), |i| i.peer);
        if left.is_zero() {
            return Err(env.timed_out(blame));
        }
        debug_assert!(!interests.is_empty(), "schedule deadlocked on itself");
        t.wait(ch, &interests, left)
            .map_err(|e| env.lost(blame, &e))?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_describes() {
        let h = Header {
            desc: OpDesc {
                kind: OpKind::AllReduce,
                seq: 7,
                dtype: Some(DType::F32),
                count: 10,
                reduce: Some(ReduceOp::Sum),
                root: 0,
                flags: 0,
            },
            bytes: (5u64 << 32) + 40,
        };
        let d = Header::decode(&h.encode()).unwrap();
        assert_eq!(d.desc, h.desc);
        assert_eq!(d.bytes, h.bytes);
        assert_eq!(h.desc.describe(), "all_reduce #7 of 10 x float32 (sum)");
        let mut bad = h.encode();
        bad[0] = 0;
        assert!(Header::decode(&bad).is_none());
    }
}

//! Transports: byte pipes between pairs of ranks, and nothing more.
//!
//! A [`Transport`] gives every pair of ranks two ordered, reliable byte
//! channels ([`Channel::Collective`] and [`Channel::P2p`]), non-blocking
//! reads and writes on them, and a way to sleep until one of them is ready.
//! Framing, matching, algorithms and errors with op names live above it (in
//! the engine and the mesh backend), so that a shared-memory transport can be
//! slotted under the same algorithms. A transport must never interpret the
//! bytes it moves, and must never block in `try_read` / `try_write`.

pub mod tcp;

use std::io::{self, IoSlice};
use std::time::Duration;

/// Which of the two channels between a pair of ranks.
///
/// Collectives run in lockstep on every rank, one at a time, so their frames
/// never interleave with anything; point-to-point messages may be in flight
/// at any moment, from any thread, so they get a channel of their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Channel {
    /// Used by one collective at a time.
    Collective,
    /// Used by send/recv, with per-peer locking above.
    P2p,
}

/// What a waiter wants from one peer's channel.
#[derive(Clone, Copy, Debug)]
pub struct Interest {
    /// The peer.
    pub peer: usize,
    /// Wake once this many bytes can be read, or the peer hung up (0: not
    /// waiting to read). Waking for a whole frame rather than its first
    /// packet saves wake-ups; transports may wake earlier.
    pub read: usize,
    /// Wake when there is room to write.
    pub write: bool,
}

/// Reliable, ordered byte channels to every other rank of a group.
pub trait Transport: Send + Sync {
    /// This process's rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Writes a prefix of `bufs` to `peer` without blocking; returns how many
    /// bytes went out, or `WouldBlock` if none could.
    fn try_write(&self, ch: Channel, peer: usize, bufs: &[IoSlice<'_>]) -> io::Result<usize>;
    /// Reads into `buf` from `peer` without blocking; `Ok(0)` means the peer
    /// closed the channel, `WouldBlock` that nothing has arrived yet.
    fn try_read(&self, ch: Channel, peer: usize, buf: &mut [u8]) -> io::Result<usize>;
    /// Sleeps until one of `interests` is ready or `timeout` passes; returns
    /// whether something is ready. Spurious wake-ups are allowed.
    fn wait(&self, ch: Channel, interests: &[Interest], timeout: Duration) -> io::Result<bool>;
    /// Those of `among` whose end of `ch` is closed (they exited, crashed
    /// or aborted), waiting up to `wait` for the first; used to name the
    /// root cause in errors.
    fn hung_up(&self, ch: Channel, among: &[usize], wait: Duration) -> Vec<usize>;
    /// Breaks every channel: pending and later reads and writes on both ends
    /// fail promptly.
    fn shutdown(&self);
}

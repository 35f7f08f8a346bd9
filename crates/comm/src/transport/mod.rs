//! Transports: byte pipes between pairs of ranks, and nothing more.
//!
//! A [`Transport`] gives every pair of ranks two ordered, reliable byte
//! channels ([`Channel::Collective`] and [`Channel::P2p`]), non-blocking
//! reads and writes on them, and a way to sleep until one of them is ready.
//! Framing, matching, algorithms and errors with op names live above it (in
//! the engine and the mesh backend), so that a shared-memory transport can be
//! slotted under the same algorithms. A transport must never interpret the
//! bytes it moves, and must never block in `try_read` / `try_write`.
//!
//! Which transport a group gets ([`connect`], `COHORT_TRANSPORT`):
//! - `auto` (default): shared memory ([`shm::ShmTransport`]) when every
//!   rank of the group is on this host, else sockets ([`tcp::TcpTransport`]:
//!   Unix sockets between ranks on one host, TCP between hosts);
//! - `shm`: shared memory, and an error naming the ranks that cannot;
//! - `unix`: sockets as in `auto`, never shared memory;
//! - `tcp`: TCP sockets only, even on one host.

pub mod shm;
pub mod tcp;

use std::io::{self, IoSlice};
use std::net::IpAddr;
use std::time::Duration;

use cohort_store::Store;

use crate::error::CommError;
pub use crate::kinds::TransportKind;

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
    /// Short name (`tcp`, `shm`), shown as the backend's name.
    fn name(&self) -> &'static str {
        "tcp"
    }
    /// The shared memory behind this transport, if it has some: the direct
    /// shared-memory collectives use it instead of streaming through rings.
    fn shm(&self) -> Option<&shm::ShmTransport> {
        None
    }
}

/// Connects `rank` of `size` to its peers through `store` (namespaced to
/// the group) with the transport `kind` asks for, shared memory only if
/// `one_host` (every rank runs on this host); fails after `timeout` naming
/// what is missing.
#[allow(clippy::too_many_arguments)] // the rendezvous's inputs, each needed
pub(crate) fn connect(
    store: &dyn Store,
    group: &str,
    rank: usize,
    size: usize,
    bind_ip: IpAddr,
    timeout: Duration,
    kind: TransportKind,
    one_host: bool,
) -> Result<Box<dyn Transport>, CommError> {
    if kind == TransportKind::Shm && !one_host && size > 1 {
        return Err(CommError::Rendezvous {
            group: group.to_string(),
            rank,
            detail: "COHORT_TRANSPORT=shm, but the ranks do not all run on one host".to_string(),
        });
    }
    let local = match kind {
        TransportKind::Tcp => tcp::Local::Tcp,
        _ => tcp::Local::Unix,
    };
    let sockets =
        tcp::TcpTransport::connect_with(store, group, rank, size, bind_ip, timeout, local)?;
    match kind {
        TransportKind::Auto | TransportKind::Shm if one_host && size > 1 => Ok(Box::new(
            shm::ShmTransport::upgrade(sockets, group, timeout)?,
        )),
        _ => Ok(Box::new(sockets)),
    }
}

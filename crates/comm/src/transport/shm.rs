//! Shared-memory transport: ring buffers in memory every rank of a host
//! maps, as NCCL's SHM transport, for groups whose ranks all share one host.
//!
//! # Setup
//! The group first forms the socket mesh ([`TcpTransport`], Unix sockets on
//! one host). Each rank then creates one anonymous `memfd` (its *region*),
//! sends the descriptor to every peer over the Unix socket (`SCM_RIGHTS`),
//! maps the peers' regions, and closes every descriptor. The memory has no
//! name anywhere (nothing in `/dev/shm`), and the kernel frees it when the
//! last process that maps it exits, however it exits, SIGKILL included.
//!
//! # Region of rank r
//! - A header: per [`Channel`] a doorbell word and a sleeper count (futex
//!   wake-ups), the `closed` flag, and the progress counters of the direct
//!   shared-memory collectives.
//! - For every peer p and channel, the ring p -> r: single producer (p),
//!   single consumer (r), `head` and `tail` byte counters on their own cache
//!   lines, then the data. Rings live with their reader so that a writer
//!   only ever stores into rings of ranks it sends to.
//! - A staging area that the direct all-reduce (`collectives/all_reduce/shm.rs`)
//!   reads from peers' mappings instead of going through rings.
//!
//! # Wake-ups and failures
//! A waiter spins briefly, then registers as a sleeper on its doorbell and
//! sleeps on it with `futex(2)`; whoever changes something a rank may be
//! waiting for (data into its ring, space in a ring it writes, the closed
//! flag) rings that rank's doorbell, and makes the syscall only when someone
//! sleeps. The sockets stay open as the liveness channel: a sleeper wakes
//! at least every [`LIVENESS_SLICE`] and polls its peers' sockets, so a
//! SIGKILLed peer (whose socket the kernel closes) fails survivors within
//! that slice; a peer that shuts down or drops its transport sets its
//! `closed` flag and rings every doorbell, which fails them at once. As with
//! sockets, bytes written before a close can still be read; then reads see
//! end of stream and writes `EPIPE`. This module must never block without a
//! deadline and never read or write outside the rings' ranges it owns.

use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::tcp::TcpTransport;
use super::{Channel, Interest, Transport};
use crate::error::CommError;

/// Bytes per cache-line slot of shared counters (two lines: the adjacent
/// line prefetcher would otherwise couple neighbours).
const LINE: usize = 128;
/// Bytes of the region header.
const HEADER: usize = 4096;
/// Ring data bytes per channel: collectives stream segments of 256 KB, so
/// a ring holds several in flight; point-to-point traffic is lighter.
const COLLECTIVE_RING: usize = 2 << 20;
const P2P_RING: usize = 256 << 10;
/// Bytes before a ring's data (head and tail lines).
const RING_HEADER: usize = 2 * LINE;
/// Staging bytes per rank for the direct collectives.
pub(crate) const STAGING: usize = 4 << 20;
/// Number of progress counters in the header for the direct collectives.
pub(crate) const COUNTERS: usize = 4;

const MAGIC: u64 = 0x636f_686f_7274_7368; // "cohortsh"

/// How long a sleeper may go without checking that its peers are alive.
pub(crate) const LIVENESS_SLICE: Duration = Duration::from_millis(50);
/// The longest a waiter spins before it sleeps: enough to catch a peer that
/// is a few microseconds behind (a 4 KB exchange) without the cost of a
/// futex wake-up. The budget adapts below it (see [`ShmTransport::wait_until`]).
const SPIN_MAX_NS: u32 = 20_000;

// Header offsets.
const OFF_MAGIC: usize = 0;
const OFF_CLOSED: usize = LINE;
const fn off_bell(ch: usize) -> usize {
    LINE * (2 + 2 * ch)
}
const fn off_sleepers(ch: usize) -> usize {
    LINE * (3 + 2 * ch)
}
const fn off_counter(i: usize) -> usize {
    LINE * (6 + i)
}

fn ch_index(ch: Channel) -> usize {
    match ch {
        Channel::Collective => 0,
        Channel::P2p => 1,
    }
}

fn ring_cap(ch: usize) -> usize {
    if ch == 0 {
        COLLECTIVE_RING
    } else {
        P2P_RING
    }
}

/// Where things are in a region of a group of `size` ranks.
#[derive(Clone, Copy, Debug)]
struct Layout {
    size: usize,
}

impl Layout {
    /// Offset of the ring from `peer` on channel `ch`.
    fn ring(&self, peer: usize, ch: usize) -> usize {
        let per_peer = RING_HEADER * 2 + COLLECTIVE_RING + P2P_RING;
        HEADER
            + peer * per_peer
            + if ch == 0 {
                0
            } else {
                RING_HEADER + COLLECTIVE_RING
            }
    }

    fn staging(&self) -> usize {
        self.ring(self.size, 0)
    }

    fn bytes(&self) -> usize {
        self.staging() + STAGING
    }
}

/// A shared mapping of one rank's region.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; every access goes through
// atomics or through ranges that the ring protocol gives to one side.
unsafe impl Send for Mapping {}
// SAFETY: as for Send: shared access is by atomics or by disjoint ranges.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn map(fd: RawFd, len: usize) -> io::Result<Mapping> {
        // safety: a fresh shared mapping of `len` bytes of an open memfd.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr: p.cast(), len })
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off + 8 <= self.len && off.is_multiple_of(8));
        // safety: in bounds, aligned, and only ever accessed atomically.
        unsafe { &*(self.ptr.add(off) as *const AtomicU64) }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off + 4 <= self.len && off.is_multiple_of(4));
        // safety: as above.
        unsafe { &*(self.ptr.add(off) as *const AtomicU32) }
    }

    fn bell(&self, ch: usize) -> &AtomicU32 {
        self.u32_at(off_bell(ch))
    }

    /// 0 while open; then when the rank closed (CLOCK_MONOTONIC
    /// nanoseconds + 1, a clock every process of the host shares).
    fn closed(&self) -> &AtomicU64 {
        self.u64_at(OFF_CLOSED)
    }

    /// Wakes whoever sleeps on this region's doorbell of channel `ch`.
    fn ring_bell(&self, ch: usize) {
        self.bell(ch).fetch_add(1, Ordering::SeqCst);
        if self.u32_at(off_sleepers(ch)).load(Ordering::SeqCst) != 0 {
            futex_wake(self.bell(ch));
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // safety: unmaps exactly what `map` mapped; nothing borrows it any more.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// One direction of one channel: the ring that `writer` fills in `reader`'s region.
struct Ring<'a> {
    region: &'a Mapping,
    base: usize,
    cap: usize,
}

impl Ring<'_> {
    fn head(&self) -> &AtomicU64 {
        self.region.u64_at(self.base)
    }

    fn tail(&self) -> &AtomicU64 {
        self.region.u64_at(self.base + LINE)
    }

    fn data(&self) -> *mut u8 {
        // safety: the data area lies inside the region.
        unsafe { self.region.ptr.add(self.base + RING_HEADER) }
    }

    /// Bytes the reader may take now.
    fn readable(&self) -> usize {
        (self.head().load(Ordering::Acquire) - self.tail().load(Ordering::Relaxed)) as usize
    }

    /// Bytes the writer may add now.
    fn writable(&self) -> usize {
        self.cap
            - (self.head().load(Ordering::Relaxed) - self.tail().load(Ordering::Acquire)) as usize
    }

    /// Producer side: copies a prefix of `bufs`; returns the bytes written.
    fn write(&self, bufs: &[IoSlice<'_>]) -> usize {
        let head = self.head().load(Ordering::Relaxed);
        let tail = self.tail().load(Ordering::Acquire);
        let mut free = self.cap - (head - tail) as usize;
        let mut pos = head;
        for b in bufs {
            if free == 0 {
                break;
            }
            let n = b.len().min(free);
            self.copy_in(pos, &b[..n]);
            pos += n as u64;
            free -= n;
        }
        self.head().store(pos, Ordering::Release);
        (pos - head) as usize
    }

    /// Consumer side: copies out up to `buf.len()` bytes; returns how many.
    fn read(&self, buf: &mut [u8]) -> usize {
        let tail = self.tail().load(Ordering::Relaxed);
        let head = self.head().load(Ordering::Acquire);
        let n = ((head - tail) as usize).min(buf.len());
        self.copy_out(tail, &mut buf[..n]);
        self.tail().store(tail + n as u64, Ordering::Release);
        n
    }

    fn copy_in(&self, pos: u64, src: &[u8]) {
        let at = (pos % self.cap as u64) as usize;
        let first = src.len().min(self.cap - at);
        // safety: [at, at+first) and [0, rest) are inside the data area and
        // belong to the writer until `head` moves past them.
        unsafe {
            ptr::copy_nonoverlapping(src.as_ptr(), self.data().add(at), first);
            ptr::copy_nonoverlapping(src.as_ptr().add(first), self.data(), src.len() - first);
        }
    }

    fn copy_out(&self, pos: u64, dst: &mut [u8]) {
        let at = (pos % self.cap as u64) as usize;
        let first = dst.len().min(self.cap - at);
        // safety: the ranges are inside the data area and belong to the
        // reader until `tail` moves past them.
        unsafe {
            ptr::copy_nonoverlapping(self.data().add(at), dst.as_mut_ptr(), first);
            ptr::copy_nonoverlapping(self.data(), dst.as_mut_ptr().add(first), dst.len() - first);
        }
    }
}

/// Rings in shared memory to every other rank of a group on one host.
pub struct ShmTransport {
    tcp: TcpTransport,
    rank: usize,
    layout: Layout,
    /// Every rank's region, this rank's included.
    regions: Vec<Mapping>,
    /// Peers whose socket was seen hung up (dead without closing).
    dead: Vec<AtomicBool>,
    shut: AtomicBool,
    /// Current spin budget in nanoseconds.
    spin_ns: AtomicU32,
}

impl std::fmt::Debug for ShmTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmTransport")
            .field("rank", &self.rank)
            .field("size", &self.layout.size)
            .finish()
    }
}

impl ShmTransport {
    /// Upgrades a connected socket mesh whose peers all share this host
    /// (every connection a Unix socket): exchanges regions over the sockets
    /// and keeps them as the liveness channel. Fails after `timeout`, or if
    /// some peer is connected otherwise.
    pub(crate) fn upgrade(
        tcp: TcpTransport,
        group: &str,
        timeout: Duration,
    ) -> Result<ShmTransport, CommError> {
        let deadline = Instant::now() + timeout;
        let (rank, size) = (tcp.rank(), tcp.size());
        let rdv = |detail: String| CommError::Rendezvous {
            group: group.to_string(),
            rank,
            detail,
        };
        let layout = Layout { size };
        let len = layout.bytes();
        let fd = create_region(len).map_err(|e| rdv(format!("shared memory: {e}")))?;
        let own = Mapping::map(fd.as_raw_fd(), len)
            .map_err(|e| rdv(format!("mapping {len} bytes of shared memory: {e}")))?;
        own.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Release);

        let mut payload = [0u8; 16];
        payload[..8].copy_from_slice(&MAGIC.to_le_bytes());
        payload[8..].copy_from_slice(&(len as u64).to_le_bytes());
        let sock = |peer: usize| {
            tcp.unix_fd(peer).ok_or_else(|| {
                rdv(format!(
                    "rank {peer} is not connected over a Unix socket (not on this host)"
                ))
            })
        };
        for peer in (0..size).filter(|&p| p != rank) {
            send_fd(sock(peer)?, fd.as_raw_fd(), &payload)
                .map_err(|e| rdv(format!("sending shared memory to rank {peer}: {e}")))?;
        }
        let mut regions: Vec<Option<Mapping>> = (0..size).map(|_| None).collect();
        for peer in (0..size).filter(|&p| p != rank) {
            let (pfd, got) = recv_fd(sock(peer)?, deadline)
                .map_err(|e| rdv(format!("receiving shared memory from rank {peer}: {e}")))?;
            if got != payload {
                return Err(rdv(format!(
                    "rank {peer} sent a shared-memory region of another layout \
                     (a different cohort version?)"
                )));
            }
            let m = Mapping::map(pfd.as_raw_fd(), len)
                .map_err(|e| rdv(format!("mapping rank {peer}'s shared memory: {e}")))?;
            if m.u64_at(OFF_MAGIC).load(Ordering::Acquire) != MAGIC {
                return Err(rdv(format!(
                    "rank {peer}'s shared memory is not initialised"
                )));
            }
            regions[peer] = Some(m);
        }
        regions[rank] = Some(own);
        Ok(ShmTransport {
            tcp,
            rank,
            layout,
            regions: regions
                .into_iter()
                .map(|m| m.expect("every region mapped"))
                .collect(),
            dead: (0..size).map(|_| AtomicBool::new(false)).collect(),
            shut: AtomicBool::new(false),
            spin_ns: AtomicU32::new(SPIN_MAX_NS),
        })
    }

    fn own(&self) -> &Mapping {
        &self.regions[self.rank]
    }

    /// The ring `from` -> `to` on channel `ch`.
    fn ring(&self, from: usize, to: usize, ch: usize) -> Ring<'_> {
        Ring {
            region: &self.regions[to],
            base: self.layout.ring(from, ch),
            cap: ring_cap(ch),
        }
    }

    fn check_peer(&self, peer: usize) -> io::Result<()> {
        if peer >= self.layout.size || peer == self.rank {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                format!("no connection to rank {peer}"),
            ));
        }
        Ok(())
    }

    /// Whether `peer` closed its end or died.
    pub(crate) fn peer_gone(&self, peer: usize) -> bool {
        self.regions[peer].closed().load(Ordering::Acquire) != 0
            || self.dead[peer].load(Ordering::Relaxed)
    }

    /// Of `peers`, the one whose loss most likely caused the others: one
    /// that died without closing (SIGKILL), else the first to close.
    pub(crate) fn first_gone(&self, peers: &[usize]) -> Option<usize> {
        peers
            .iter()
            .copied()
            .filter(|&p| self.peer_gone(p))
            .min_by_key(
                |&p| match self.regions[p].closed().load(Ordering::Acquire) {
                    0 => 0,
                    t => t,
                },
            )
    }

    /// Whether this rank shut its end down.
    pub(crate) fn is_shut(&self) -> bool {
        self.shut.load(Ordering::Acquire)
    }

    /// Polls the sockets of `peers` (no waiting) and records the dead ones;
    /// returns whether any is gone.
    pub(crate) fn check_alive(&self, ch: Channel, peers: &[usize]) -> bool {
        let alive: Vec<usize> = peers
            .iter()
            .copied()
            .filter(|&p| !self.peer_gone(p))
            .collect();
        let mut gone = alive.len() < peers.len();
        for p in self.tcp.hung_up(ch, &alive, Duration::ZERO) {
            self.dead[p].store(true, Ordering::Relaxed);
            gone = true;
        }
        gone
    }

    /// Rings `peer`'s doorbell of channel `ch`.
    pub(crate) fn notify(&self, peer: usize, ch: Channel) {
        self.regions[peer].ring_bell(ch_index(ch));
    }

    /// This rank's staging area (`STAGING` bytes), written only by this rank.
    pub(crate) fn staging(&self, rank: usize) -> *mut u8 {
        // safety: the staging area lies inside every region.
        unsafe { self.regions[rank].ptr.add(self.layout.staging()) }
    }

    /// Progress counter `i` of `rank` (written only by that rank).
    pub(crate) fn counter(&self, rank: usize, i: usize) -> &AtomicU32 {
        debug_assert!(i < COUNTERS);
        self.regions[rank].u32_at(off_counter(i))
    }

    /// Sleeps until `ready()` holds, this rank shuts down, one of `peers`
    /// closes or dies, or `deadline` passes; spins for a moment first.
    /// Returns whether `ready()` (or a failure to report) holds.
    ///
    /// The spin budget adapts to how long waits turn out to be: a wait
    /// that ends within [`SPIN_MAX_NS`] after all sets the budget to twice
    /// its length (a longer spin would have saved the sleep), a longer one
    /// halves it. Ranks in lockstep (a benchmark loop) keep spinning; a
    /// communication thread whose peer lags behind its backward pass stops
    /// burning the core its own compute thread needs.
    pub(crate) fn wait_until(
        &self,
        ch: Channel,
        peers: &[usize],
        deadline: Instant,
        mut ready: impl FnMut() -> bool,
    ) -> bool {
        let failed = |t: &Self| t.is_shut() || peers.iter().any(|&p| t.peer_gone(p));
        if ready() || failed(self) {
            return true;
        }
        let start = Instant::now();
        let budget = self.spin_ns.load(Ordering::Relaxed);
        let spin_end = start + Duration::from_nanos(u64::from(budget));
        let mut i = 0u32;
        loop {
            if ready() || failed(self) {
                return true;
            }
            std::hint::spin_loop();
            i += 1;
            if i.is_multiple_of(64) && Instant::now() >= spin_end {
                break;
            }
        }
        let woke = self.sleep_until(ch, peers, deadline, &mut ready, failed);
        let waited = start.elapsed().as_nanos().min(u128::from(u32::MAX)) as u32;
        let next = if waited <= SPIN_MAX_NS {
            waited.saturating_mul(2).clamp(budget, SPIN_MAX_NS)
        } else {
            budget / 2
        };
        self.spin_ns.store(next, Ordering::Relaxed);
        woke
    }

    /// The sleeping half of [`wait_until`](Self::wait_until).
    fn sleep_until(
        &self,
        ch: Channel,
        peers: &[usize],
        deadline: Instant,
        ready: &mut impl FnMut() -> bool,
        failed: impl Fn(&Self) -> bool,
    ) -> bool {
        let c = ch_index(ch);
        let own = self.own();
        let bell = own.bell(c);
        let sleepers = own.u32_at(off_sleepers(c));
        loop {
            let now = Instant::now();
            if now >= deadline {
                return ready() || failed(self);
            }
            sleepers.fetch_add(1, Ordering::SeqCst);
            let seen = bell.load(Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if ready() || failed(self) {
                sleepers.fetch_sub(1, Ordering::SeqCst);
                return true;
            }
            futex_wait(bell, seen, (deadline - now).min(LIVENESS_SLICE));
            sleepers.fetch_sub(1, Ordering::SeqCst);
            if ready() || self.check_alive(ch, peers) || failed(self) {
                return true;
            }
        }
    }
}

impl Transport for ShmTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.layout.size
    }

    fn name(&self) -> &'static str {
        "shm"
    }

    fn shm(&self) -> Option<&ShmTransport> {
        Some(self)
    }

    fn try_write(&self, ch: Channel, peer: usize, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.check_peer(peer)?;
        if self.is_shut() || self.peer_gone(peer) {
            return Err(io::Error::from(io::ErrorKind::BrokenPipe));
        }
        let n = self.ring(self.rank, peer, ch_index(ch)).write(bufs);
        if n == 0 {
            if bufs.iter().all(|b| b.is_empty()) {
                return Ok(0);
            }
            return Err(io::Error::from(io::ErrorKind::WouldBlock));
        }
        self.notify(peer, ch);
        Ok(n)
    }

    fn try_read(&self, ch: Channel, peer: usize, buf: &mut [u8]) -> io::Result<usize> {
        self.check_peer(peer)?;
        if self.is_shut() {
            return Ok(0);
        }
        // The flag first: a peer stores its last bytes before its flag, so
        // an empty ring after a set flag is really the end of the stream.
        let gone = self.peer_gone(peer);
        let n = self.ring(peer, self.rank, ch_index(ch)).read(buf);
        if n > 0 {
            // The writer may be waiting for room.
            self.notify(peer, ch);
            return Ok(n);
        }
        if gone || buf.is_empty() {
            return Ok(0);
        }
        Err(io::Error::from(io::ErrorKind::WouldBlock))
    }

    fn wait(&self, ch: Channel, interests: &[Interest], timeout: Duration) -> io::Result<bool> {
        let c = ch_index(ch);
        let peers: Vec<usize> = interests.iter().map(|i| i.peer).collect();
        for &p in &peers {
            self.check_peer(p)?;
        }
        let deadline = Instant::now() + timeout;
        let ready = || {
            interests.iter().any(|i| {
                (i.read > 0
                    && self.ring(i.peer, self.rank, c).readable() >= i.read.min(ring_cap(c)))
                    || (i.write && self.ring(self.rank, i.peer, c).writable() > 0)
            })
        };
        Ok(self.wait_until(ch, &peers, deadline, ready))
    }

    fn hung_up(&self, ch: Channel, among: &[usize], wait: Duration) -> Vec<usize> {
        let among: Vec<usize> = among
            .iter()
            .copied()
            .filter(|&p| self.check_peer(p).is_ok())
            .collect();
        let mut gone: Vec<usize> = among
            .iter()
            .copied()
            .filter(|&p| self.peer_gone(p))
            .collect();
        let rest: Vec<usize> = among
            .iter()
            .copied()
            .filter(|p| !gone.contains(p))
            .collect();
        let wait = if gone.is_empty() {
            wait
        } else {
            Duration::ZERO
        };
        if !rest.is_empty() {
            gone.extend(self.tcp.hung_up(ch, &rest, wait));
        }
        gone.sort_unstable();
        gone
    }

    fn shutdown(&self) {
        if self.shut.swap(true, Ordering::SeqCst) {
            return;
        }
        self.own()
            .closed()
            .store(monotonic_ns() + 1, Ordering::SeqCst);
        for r in &self.regions {
            r.ring_bell(0);
            r.ring_bell(1);
        }
        self.tcp.shutdown();
    }
}

impl Drop for ShmTransport {
    /// Like closing sockets: peers blocked on this rank fail at once.
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn create_region(len: usize) -> io::Result<OwnedFd> {
    // safety: memfd_create takes a NUL-terminated name and flags.
    let fd = unsafe { libc::memfd_create(c"cohort-shm".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // safety: fd is a fresh descriptor that we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // safety: fd is open; the length fits off_t.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Sends `fd` and `payload` as one message over the Unix socket `sock`.
fn send_fd(sock: RawFd, fd: RawFd, payload: &[u8]) -> io::Result<()> {
    let mut cmsg = [0u64; 8];
    let mut iov = libc::iovec {
        iov_base: payload.as_ptr() as *mut libc::c_void,
        iov_len: payload.len(),
    };
    // safety: an all-zero msghdr is valid; the control buffer is big and
    // aligned enough for one descriptor.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg.as_mut_ptr().cast();
        msg.msg_controllen = libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) as _;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        ptr::write_unaligned(libc::CMSG_DATA(c) as *mut RawFd, fd);
        // A fresh socket's buffer is empty, so this small message never
        // blocks; retry only on a signal.
        loop {
            let n = libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL);
            if n == payload.len() as isize {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if n < 0 && e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(if n < 0 {
                e
            } else {
                io::Error::from(io::ErrorKind::WriteZero)
            });
        }
    }
}

/// Receives one descriptor and its 16-byte payload from `sock` by `deadline`.
fn recv_fd(sock: RawFd, deadline: Instant) -> io::Result<(OwnedFd, [u8; 16])> {
    let mut payload = [0u8; 16];
    let mut cmsg = [0u64; 8];
    loop {
        let mut iov = libc::iovec {
            iov_base: payload.as_mut_ptr().cast(),
            iov_len: payload.len(),
        };
        // safety: as in `send_fd`; the kernel writes at most msg_controllen
        // bytes of control data and `payload.len()` bytes of data.
        let (n, msg) = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = cmsg.as_mut_ptr().cast();
            msg.msg_controllen = std::mem::size_of_val(&cmsg) as _;
            let n = libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT);
            (n, msg)
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, "timed out"));
                    }
                    let mut pfd = libc::pollfd {
                        fd: sock,
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
                    // safety: one valid pollfd.
                    unsafe { libc::poll(&mut pfd, 1, ms) };
                    continue;
                }
                _ => return Err(e),
            }
        }
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        // safety: msg's control buffer was filled by the kernel.
        let fd = unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            if c.is_null()
                || (*c).cmsg_level != libc::SOL_SOCKET
                || (*c).cmsg_type != libc::SCM_RIGHTS
            {
                None
            } else {
                Some(OwnedFd::from_raw_fd(ptr::read_unaligned(
                    libc::CMSG_DATA(c) as *const RawFd,
                )))
            }
        };
        return match (fd, n as usize == payload.len()) {
            (Some(fd), true) => Ok((fd, payload)),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "expected one descriptor and 16 bytes",
            )),
        };
    }
}

fn monotonic_ns() -> u64 {
    // safety: an all-zero timespec is valid; clock_gettime only writes it.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // safety: CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // safety: `word` is a valid, aligned u32 in shared memory; the kernel
    // only reads it. Errors (EAGAIN: the value changed; ETIMEDOUT; EINTR)
    // all mean "look again", which the caller does.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            ptr::null::<u32>(),
            0u32,
        )
    };
}

fn futex_wake(word: &AtomicU32) {
    // safety: as above; FUTEX_WAKE only wakes sleepers on this address.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            ptr::null::<libc::timespec>(),
            ptr::null::<u32>(),
            0u32,
        )
    };
}

//! Direct shared-memory all_reduce: a reduce-scatter and an all-gather
//! through every rank's staging area, without rings or frames.
//!
//! Scheme (N ranks on one host, rank r): the buffer is processed in rounds
//! of `ROUND` bytes; each round is cut into N chunks, and rank r owns chunk
//! r. Every rank's staging area holds `SLOTS` rounds. For round g (counted
//! over the group's life, so that slots and counters carry across calls):
//!
//! - **stage**: copy the chunks this rank does not own into its slot g % SLOTS,
//!   then publish `staged = g + 1`;
//! - **reduce**: once every peer has staged round g, reduce chunk r of the
//!   buffer with chunk r of every peer's slot (in rank order, so the result
//!   does not depend on timing), copy it into this rank's slot, publish
//!   `reduced = g + 1`;
//! - **gather**: once every peer has reduced round g, copy each peer's chunk
//!   from its slot into the buffer, publish `gathered = g + 1`.
//!
//! A slot is staged again only after every peer has gathered the round that
//! last used it. Step t of a call stages round t, reduces round t-1 and
//! gathers round t-2, so each wait is for work a peer finished a step ago
//! and, with ranks running in parallel, rarely waits at all. Each rank copies
//! (N-1)/N of the buffer in, reduces 1/N, and copies (N-1)/N out: against
//! the ring over shared-memory rings it skips the copies into and out of the
//! rings and the per-frame bookkeeping.
//!
//! Before any peer memory is read, every rank sends the op's frame header
//! through its collective ring to every peer and checks theirs, so mismatched
//! calls are reported as by the other algorithms. Waits sleep on the
//! transport's doorbell with the op's deadline, and a peer that closes or
//! dies fails the call naming it. This module must never touch a peer's
//! staging area outside the protocol above.

use std::io::{self, IoSlice};
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::super::{chunk, Comm};
use crate::engine::{Header, HEADER_BYTES};
use crate::error::CommError;
use crate::reduce_op::{finish_avg, reduce_into, ReduceOp};
use crate::transport::shm::{ShmTransport, STAGING};
use crate::transport::{Channel, Transport};

/// Rounds in a staging area: at least 3, since step t stages round t while
/// peers may still gather round t - 2 from their own slots. Rounds of 1 MB
/// (4 slots) were measured cheaper than rounds of 256 KB (16 slots): 16 MB
/// at 2 ranks took 1.4 ms of CPU per rank against 2.2-2.5 ms.
const SLOTS: usize = 4;
/// Bytes of the buffer per round.
const ROUND: usize = STAGING / SLOTS;

const STAGED: usize = 0;
const REDUCED: usize = 1;
const GATHERED: usize = 2;

/// `a >= b` for counters that wrap.
fn reached(a: u32, b: u32) -> bool {
    a.wrapping_sub(b) as i32 >= 0
}

pub(super) fn run(
    comm: &Comm<'_>,
    shm: &ShmTransport,
    buf: &mut [u8],
    op: ReduceOp,
) -> Result<(), CommError> {
    let env = &comm.env;
    let (r, n, es) = (comm.rank(), comm.size(), comm.es());
    let deadline = Instant::now() + env.timeout;
    let peers: Vec<usize> = (0..n).filter(|&p| p != r).collect();
    let count = buf.len() / es;
    let per_round = (ROUND / es).max(1);
    let rounds = count.div_ceil(per_round);
    let round = |i: usize| {
        let start = i * per_round;
        (start * es, per_round.min(count - start))
    };
    let base = shm.counter(r, STAGED).load(Ordering::Relaxed);

    // Waits until every peer's counter `which` reaches `target`.
    let wait_for = |which: usize, target: u32| -> Result<(), CommError> {
        let behind = || {
            peers
                .iter()
                .copied()
                .find(|&p| !reached(shm.counter(p, which).load(Ordering::Acquire), target))
        };
        if behind().is_none() {
            return Ok(());
        }
        shm.wait_until(Channel::Collective, &peers, deadline, || behind().is_none());
        match behind() {
            None => Ok(()),
            Some(p) => Err(failure(env, shm, &peers, p)),
        }
    };
    let publish = |which: usize, value: u32| {
        shm.counter(r, which).store(value, Ordering::Release);
        for &p in &peers {
            shm.notify(p, Channel::Collective);
        }
    };

    let header = Header {
        desc: env.desc,
        bytes: buf.len() as u64,
    }
    .encode();
    for &p in &peers {
        send_header(env, shm, p, &header, deadline)?;
    }
    let mut checked = false;
    for t in 0..rounds + 2 {
        if t < rounds {
            let g = base.wrapping_add(t as u32);
            wait_for(GATHERED, g.wrapping_sub(SLOTS as u32).wrapping_add(1))?;
            let (off, cnt) = round(t);
            let slot = shm.staging(r).wrapping_add((g as usize % SLOTS) * ROUND);
            for c in (0..n).filter(|&c| c != r) {
                let (co, cl) = chunk(cnt, n, c, es);
                // safety: the slot is this rank's, and no peer reads it
                // until `staged` says so.
                unsafe {
                    std::ptr::copy_nonoverlapping(buf[off + co..].as_ptr(), slot.add(co), cl)
                };
            }
            publish(STAGED, g.wrapping_add(1));
        }
        if (1..=rounds).contains(&t) {
            if !checked {
                for &p in &peers {
                    recv_header(env, shm, p, buf.len(), deadline)?;
                }
                checked = true;
            }
            let i = t - 1;
            let g = base.wrapping_add(i as u32);
            wait_for(STAGED, g.wrapping_add(1))?;
            let (off, cnt) = round(i);
            let (co, cl) = chunk(cnt, n, r, es);
            let at = (g as usize % SLOTS) * ROUND + co;
            let mine = &mut buf[off + co..off + co + cl];
            for &p in &peers {
                // safety: peer p staged this round (counter seen above) and
                // will not touch the slot until this rank has gathered it.
                let theirs = unsafe { std::slice::from_raw_parts(shm.staging(p).add(at), cl) };
                reduce_into(comm.dtype, op, mine, theirs);
            }
            if op == ReduceOp::Avg {
                finish_avg(comm.dtype, mine, n);
            }
            // safety: chunk r of this rank's slot is read by peers only
            // after `reduced` says so.
            unsafe { std::ptr::copy_nonoverlapping(mine.as_ptr(), shm.staging(r).add(at), cl) };
            publish(REDUCED, g.wrapping_add(1));
        }
        if t >= 2 {
            let i = t - 2;
            let g = base.wrapping_add(i as u32);
            wait_for(REDUCED, g.wrapping_add(1))?;
            let (off, cnt) = round(i);
            let slot = (g as usize % SLOTS) * ROUND;
            for &p in &peers {
                let (co, cl) = chunk(cnt, n, p, es);
                // safety: peer p reduced its chunk of this round and leaves
                // it alone until every rank has gathered it.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        shm.staging(p).add(slot + co),
                        buf[off + co..].as_mut_ptr(),
                        cl,
                    )
                };
            }
            publish(GATHERED, g.wrapping_add(1));
        }
    }
    if !checked {
        // An empty buffer has no rounds, but the call is still checked.
        for &p in &peers {
            recv_header(env, shm, p, buf.len(), deadline)?;
        }
    }
    Ok(())
}

/// The error for a wait on `peer` that ended without progress.
fn failure(
    env: &crate::engine::OpEnv<'_>,
    shm: &ShmTransport,
    peers: &[usize],
    peer: usize,
) -> CommError {
    if shm.is_shut() {
        return env.lost(peer, &io::Error::from(io::ErrorKind::BrokenPipe));
    }
    match shm.first_gone(peers) {
        Some(p) => env.lost(p, &io::Error::from(io::ErrorKind::UnexpectedEof)),
        None => env.timed_out(peer),
    }
}

fn send_header(
    env: &crate::engine::OpEnv<'_>,
    shm: &ShmTransport,
    peer: usize,
    header: &[u8; HEADER_BYTES],
    deadline: Instant,
) -> Result<(), CommError> {
    let mut sent = 0;
    while sent < HEADER_BYTES {
        match shm.try_write(Channel::Collective, peer, &[IoSlice::new(&header[sent..])]) {
            Ok(k) => sent += k,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let i = crate::transport::Interest {
                    peer,
                    read: 0,
                    write: true,
                };
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(env.timed_out(peer));
                }
                shm.wait(Channel::Collective, &[i], left)
                    .map_err(|e| env.lost(peer, &e))?;
            }
            Err(e) => return Err(env.lost(peer, &e)),
        }
    }
    Ok(())
}

fn recv_header(
    env: &crate::engine::OpEnv<'_>,
    shm: &ShmTransport,
    peer: usize,
    bytes: usize,
    deadline: Instant,
) -> Result<(), CommError> {
    let mut hdr = [0u8; HEADER_BYTES];
    let mut got = 0;
    while got < HEADER_BYTES {
        match shm.try_read(Channel::Collective, peer, &mut hdr[got..]) {
            Ok(0) => return Err(env.lost(peer, &io::Error::from(io::ErrorKind::UnexpectedEof))),
            Ok(k) => got += k,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let i = crate::transport::Interest {
                    peer,
                    read: HEADER_BYTES - got,
                    write: false,
                };
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(env.timed_out(peer));
                }
                shm.wait(Channel::Collective, &[i], left)
                    .map_err(|e| env.lost(peer, &e))?;
            }
            Err(e) => return Err(env.lost(peer, &e)),
        }
    }
    env.check(peer, &hdr, bytes)
}

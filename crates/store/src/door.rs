//! What a stranger at a listener's door may cost: the three bounds that every
//! cohort listener (the store server, the collective mesh, RPC) puts on
//! connections that have not yet proven who they are.
//!
//! - [`Deadline`]: one deadline for a whole handshake, not one per read, so a
//!   stranger that sends a byte now and then is dropped on time instead of
//!   being kept alive byte by byte;
//! - [`WaitingRoom`]: at most `cap` connections handshaking at once; a newer
//!   one hangs up on the oldest, so a flood of idle strangers holds a bounded
//!   number of descriptors and threads, and the job's own processes, which
//!   handshake within microseconds, still get in;
//! - [`RefusalLog`]: refusals summed up on stderr, one line per interval (the
//!   first at once), so that a flood cannot flood the log either.
//!
//! The listeners differ in their protocols but not in these rules; keeping
//! them here, in the lowest crate that every listener depends on, gives them
//! one home. This module knows nothing of any protocol, and must never block
//! (a hang-up it orders is a `shutdown(2)`, which returns at once) or print
//! more than one line per interval and log.
//!
//! ```
//! use cohort_store::door::{Deadline, WaitingRoom};
//! use std::io::Read;
//! use std::net::{TcpListener, TcpStream};
//! use std::time::Duration;
//!
//! let listener = TcpListener::bind("127.0.0.1:0").unwrap();
//! let room = WaitingRoom::new(1);
//! let _first = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
//! let (a, _) = listener.accept().unwrap();
//! let hang_up = a.try_clone().unwrap();
//! let seat = room.enter(move || {
//!     let _ = hang_up.shutdown(std::net::Shutdown::Both);
//! });
//! // A second stranger: the first one's seat goes to it.
//! let _second = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
//! let (b, _) = listener.accept().unwrap();
//! let hang_up = b.try_clone().unwrap();
//! let _newer = room.enter(move || {
//!     let _ = hang_up.shutdown(std::net::Shutdown::Both);
//! });
//! assert!(seat.evicted());
//! // Reading the evicted stranger ends at once, not at its deadline.
//! let mut buf = [0u8; 8];
//! assert_eq!(Deadline::new(&a, Duration::from_secs(10)).read(&mut buf).unwrap(), 0);
//! ```

use std::collections::VecDeque;
use std::fmt::Display;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Connections handshaking at once at one listener unless it needs more
/// (its own peers all connecting together); only a flood ever reaches it.
pub const MAX_PENDING: usize = 64;

/// How often a listener sums up the connections it refused.
pub const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);

/// A socket whose read and write timeouts can be set: what a [`Deadline`]
/// needs of the stream it wraps.
pub trait Timeouts {
    /// As [`TcpStream::set_read_timeout`].
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// As [`TcpStream::set_write_timeout`].
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
}

impl Timeouts for TcpStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_write_timeout(self, timeout)
    }
}

impl Timeouts for UnixStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        UnixStream::set_write_timeout(self, timeout)
    }
}

impl<T: Timeouts + ?Sized> Timeouts for &T {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        (**self).set_read_timeout(timeout)
    }
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        (**self).set_write_timeout(timeout)
    }
}

/// A blocking stream whose reads and writes all end by one instant: each
/// call sets the socket's timeout to the time left, and fails with
/// [`io::ErrorKind::TimedOut`] once none is. The socket keeps the last
/// timeout set; a caller that goes on using it sets its own.
#[derive(Debug)]
pub struct Deadline<S> {
    stream: S,
    until: Instant,
}

impl<S> Deadline<S> {
    /// `stream`, for `within` from now.
    pub fn new(stream: S, within: Duration) -> Deadline<S> {
        Deadline {
            stream,
            until: crate::deadline_after(within),
        }
    }

    /// `stream` until `until`.
    pub fn until(stream: S, until: Instant) -> Deadline<S> {
        Deadline { stream, until }
    }

    /// The stream back.
    pub fn into_inner(self) -> S {
        self.stream
    }

    /// The time left, or a timeout error once none is.
    fn left(&self) -> io::Result<Duration> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the handshake's deadline passed",
            ));
        }
        Ok(left)
    }
}

impl<S: Read + Timeouts> Read for Deadline<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        self.stream.read(buf)
    }
}

impl<S: Write + Timeouts> Write for Deadline<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        self.stream.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

/// The connections still handshaking at one listener, oldest first, at
/// most `cap` of them: entering a full room hangs up on the oldest.
///
/// Clones share one room. Each entrant leaves a way to hang up on it (a
/// closure that shuts its socket down, typically over a `try_clone` of it,
/// which the room holds until the seat is left); the thread reading that
/// socket then sees the connection end and gives up at once.
#[derive(Clone)]
pub struct WaitingRoom {
    inner: Arc<Mutex<Room>>,
}

type HangUp = Box<dyn FnOnce() + Send>;

struct Room {
    cap: usize,
    next: u64,
    /// Oldest first.
    seats: VecDeque<(u64, HangUp)>,
}

impl std::fmt::Debug for WaitingRoom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let room = self.lock();
        f.debug_struct("WaitingRoom")
            .field("cap", &room.cap)
            .field("len", &room.seats.len())
            .finish()
    }
}

impl WaitingRoom {
    /// A room for `cap` connections (at least one).
    pub fn new(cap: usize) -> WaitingRoom {
        WaitingRoom {
            inner: Arc::new(Mutex::new(Room {
                cap: cap.max(1),
                next: 0,
                seats: VecDeque::new(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Room> {
        // Nothing panics while holding the lock; ignore poisoning.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Seats a new connection, hanging up on the oldest ones while the
    /// room is full. `hang_up` is called at most once, and never under the
    /// room's lock; the returned seat leaves the room when dropped.
    pub fn enter(&self, hang_up: impl FnOnce() + Send + 'static) -> Seat {
        let (id, evicted) = {
            let mut room = self.lock();
            let mut evicted = Vec::new();
            while room.seats.len() >= room.cap {
                if let Some((_, old)) = room.seats.pop_front() {
                    evicted.push(old);
                }
            }
            let id = room.next;
            room.next += 1;
            room.seats.push_back((id, Box::new(hang_up)));
            (id, evicted)
        };
        for hang_up in evicted {
            hang_up();
        }
        Seat {
            room: self.clone(),
            id,
        }
    }

    /// Connections seated now.
    pub fn len(&self) -> usize {
        self.lock().seats.len()
    }

    /// Whether no connection is seated.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A connection's place in a [`WaitingRoom`]; dropping it leaves the room
/// (the handshake ended, either way).
pub struct Seat {
    room: WaitingRoom,
    id: u64,
}

impl std::fmt::Debug for Seat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seat").field("id", &self.id).finish()
    }
}

impl Seat {
    /// Whether a newer connection took this seat (and hung up on this one).
    pub fn evicted(&self) -> bool {
        !self.room.lock().seats.iter().any(|(id, _)| *id == self.id)
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        let gone = {
            let mut room = self.room.lock();
            let at = room.seats.iter().position(|(id, _)| *id == self.id);
            at.and_then(|at| room.seats.remove(at))
        };
        // Its hang-up (and the socket it may hold) is dropped unused, outside
        // the lock.
        drop(gone);
    }
}

/// Refused connections of one listener, summed up on stderr: the first at
/// once, then one line per interval at most, naming how many and the
/// latest; whatever is left is summed up when the log is dropped.
#[derive(Debug)]
pub struct RefusalLog {
    /// Who refuses, e.g. `cohort-store server 127.0.0.1:29500`.
    who: String,
    /// What was refused, plural, e.g. `connection(s) without the job secret`.
    what: String,
    every: Duration,
    state: Mutex<Tally>,
}

#[derive(Debug, Default)]
struct Tally {
    /// Refusals not yet in a line.
    count: u64,
    /// When the last line was printed (`None`: never).
    logged: Option<Instant>,
    /// The latest refusal: who, and why.
    latest: String,
}

impl RefusalLog {
    /// A log for `who` (the listener) refusing `what`, one line per `every`.
    pub fn new(who: impl Into<String>, what: impl Into<String>, every: Duration) -> RefusalLog {
        RefusalLog {
            who: who.into(),
            what: what.into(),
            every,
            state: Mutex::new(Tally::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Tally> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a connection from `peer` refused for `why`, and prints the
    /// summary line when one is due.
    pub fn refused(&self, peer: &str, why: &dyn Display) {
        if let Some(line) = self.note(peer, why, Instant::now()) {
            eprintln!("{line}");
        }
    }

    /// Prints the refusals not yet summed up, if any.
    pub fn flush(&self) {
        if let Some(line) = self.summary(&mut self.lock(), Instant::now()) {
            eprintln!("{line}");
        }
    }

    /// The line that counting this refusal at `now` calls for, if any.
    fn note(&self, peer: &str, why: &dyn Display, now: Instant) -> Option<String> {
        let mut tally = self.lock();
        tally.count += 1;
        tally.latest = format!("{peer}: {why}");
        match tally.logged {
            Some(t) if now.saturating_duration_since(t) < self.every => None,
            _ => self.summary(&mut tally, now),
        }
    }

    /// The line summing up what `tally` holds (`None`: nothing), which it
    /// then forgets.
    fn summary(&self, tally: &mut Tally, now: Instant) -> Option<String> {
        if tally.count == 0 {
            return None;
        }
        let window = match tally.logged {
            Some(t) => format!(
                " in the last {} s",
                now.saturating_duration_since(t).as_secs()
            ),
            None => String::new(),
        };
        let line = format!(
            "{}: refused {} {}{window} (latest {})",
            self.who, tally.count, self.what, tally.latest
        );
        tally.count = 0;
        tally.logged = Some(now);
        Some(line)
    }
}

impl Drop for RefusalLog {
    fn drop(&mut self) {
        self.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Shutdown, TcpListener};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::thread;

    #[test]
    fn a_deadline_bounds_the_whole_exchange_not_each_read() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        // One byte every 100 ms: each read would beat a 300 ms per-read
        // timeout for ever.
        let trickler = thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            for _ in 0..30 {
                if s.write_all(&[7]).is_err() {
                    return;
                }
                thread::sleep(Duration::from_millis(100));
            }
        });
        let (s, _) = listener.accept().unwrap();
        let started = Instant::now();
        let mut within = Deadline::new(&s, Duration::from_millis(300));
        let mut buf = [0u8; 64];
        let err = within.read_exact(&mut buf).unwrap_err();
        let took = started.elapsed();
        assert!(
            matches!(
                err.kind(),
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
            ),
            "{err:?}"
        );
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_millis(900),
            "{took:?}"
        );
        drop(s);
        trickler.join().unwrap();
    }

    #[test]
    fn a_full_room_hangs_up_on_the_oldest_and_a_seat_left_frees_its_place() {
        let room = WaitingRoom::new(3);
        let hung_up = Arc::new(AtomicUsize::new(0));
        let seats: Vec<Seat> = (0..5)
            .map(|i| {
                let hung_up = hung_up.clone();
                room.enter(move || {
                    hung_up.fetch_add(1 << (8 * i), Ordering::SeqCst);
                })
            })
            .collect();
        // Seats 0 and 1 were the oldest when 3 and 4 came.
        assert_eq!(hung_up.load(Ordering::SeqCst), 1 | 1 << 8);
        assert_eq!(room.len(), 3);
        assert!(seats[0].evicted() && seats[1].evicted() && !seats[2].evicted());
        let mut seats = seats.into_iter();
        let (s0, s1, s2) = (seats.next(), seats.next(), seats.next());
        drop((s0, s1));
        assert_eq!(room.len(), 3);
        // A seat left is a place free: the next entrant evicts no one.
        drop(s2);
        assert_eq!(room.len(), 2);
        let _s5 = room.enter(|| panic!("no one should hang up on the newest"));
        assert_eq!(room.len(), 3);
        assert_eq!(hung_up.load(Ordering::SeqCst), 1 | 1 << 8);
    }

    #[test]
    fn an_evicted_socket_ends_its_reader_at_once() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let room = WaitingRoom::new(1);
        let _c1 = TcpStream::connect(addr).unwrap();
        let (s1, _) = listener.accept().unwrap();
        let h = s1.try_clone().unwrap();
        let seat = room.enter(move || {
            let _ = h.shutdown(Shutdown::Both);
        });
        let reader = thread::spawn(move || {
            let started = Instant::now();
            let mut buf = [0u8; 1];
            let n = Deadline::new(&s1, Duration::from_secs(10)).read(&mut buf);
            (n.ok(), started.elapsed())
        });
        thread::sleep(Duration::from_millis(50));
        let _c2 = TcpStream::connect(addr).unwrap();
        let (s2, _) = listener.accept().unwrap();
        let _newer = room.enter(move || {
            let _ = s2.shutdown(Shutdown::Both);
        });
        let (n, took) = reader.join().unwrap();
        assert_eq!(n, Some(0));
        assert!(took < Duration::from_secs(2), "{took:?}");
        assert!(seat.evicted());
    }

    #[test]
    fn refusals_are_summed_up_once_per_interval() {
        let log = RefusalLog::new("srv", "connection(s) of strangers", Duration::from_secs(10));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        // The first at once.
        assert_eq!(
            log.note("a:1", &"bad", at(0)).as_deref(),
            Some("srv: refused 1 connection(s) of strangers (latest a:1: bad)")
        );
        // Then silence within the interval, however many come.
        for i in 0..1000 {
            assert_eq!(log.note(&format!("b:{i}"), &"worse", at(1)), None);
        }
        // One line once it has passed, with the count and the latest.
        assert_eq!(
            log.note("c:3", &"worst", at(11)).as_deref(),
            Some(
                "srv: refused 1001 connection(s) of strangers in the last 11 s (latest c:3: worst)"
            )
        );
        assert_eq!(log.note("d:4", &"again", at(12)), None);
        // What is left is summed up on demand (and when the log is dropped).
        let left = log.summary(&mut log.lock(), at(13));
        assert_eq!(
            left.as_deref(),
            Some("srv: refused 1 connection(s) of strangers in the last 2 s (latest d:4: again)")
        );
        assert_eq!(log.summary(&mut log.lock(), at(14)), None);
    }
}

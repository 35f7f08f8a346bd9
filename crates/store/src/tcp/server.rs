//! `TcpStoreServer`: the table behind every `TcpStore`, served from
//! background threads of the process that hosts it (the launcher or rank 0).
//!
//! One thread accepts; each connection gets a thread that reads a request,
//! answers it, and repeats. A `get` or `wait` blocks that thread on the
//! table's condition variable until the keys exist or the client's deadline
//! passes, so waiting costs no traffic and wakes at once; while it blocks,
//! the thread checks now and then that its client is still there, so a
//! client that vanished does not pin a thread until a 30-minute deadline.
//!
//! With a job secret, each connection first runs the handshake of
//! [`auth`](crate::auth), all of it within [`AUTH_TIMEOUT`] (a deadline for
//! the whole handshake, not for each read, so a stranger sending a byte now
//! and then is dropped too); a client that fails it is told so in one error
//! frame and dropped before a single request of it is read. At most
//! [`MAX_PENDING`] connections may be handshaking at once: a newer one
//! drops the oldest, so a flood of strangers holds a bounded number of
//! descriptors and threads and never starves the job's own processes.
//! Refusals are logged as one summary line per [`REFUSAL_LOG_EVERY`]. These
//! bounds live in [`door`](crate::door), shared with every other listener.
//!
//! The server must never panic or allocate on a client's say-so: a
//! malformed or oversized frame, a failed handshake, or a client that
//! disconnects mid-request, costs that connection only (logged on stderr),
//! never the server. Dropping the server stops accepting, closes every
//! connection and joins every thread.

use std::collections::HashMap;
use std::fmt::{self, Display};
use std::io::{self, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::wire::{read_frame, Request, Response, MAGIC, VERSION};
use super::AUTH_SERVICE;
use crate::auth::{authenticate_server, AuthError, Secret, SECRET_ENV};
use crate::door::{Deadline, RefusalLog, WaitingRoom, REFUSAL_LOG_EVERY};
use crate::{HashStore, Store, StoreError};

/// How often a thread blocked in `get`/`wait` checks that its client is
/// still connected.
const PEER_CHECK_EVERY: Duration = Duration::from_millis(500);
/// How long a new connection may take to authenticate, all of it. Real
/// clients answer within microseconds; this bounds what a silent or
/// trickling stranger costs (a parked thread). Shorter in unit tests.
#[cfg(not(test))]
pub(crate) const AUTH_TIMEOUT: Duration = Duration::from_secs(10);
#[cfg(test)]
pub(crate) const AUTH_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections handshaking at once; a newer one drops the oldest. Real
/// clients handshake within microseconds, so only a flood ever reaches it.
pub(crate) const MAX_PENDING: usize = crate::door::MAX_PENDING;
/// Connection threads only parse and copy; a small stack lets a server
/// hold thousands of clients.
const CONNECTION_STACK: usize = 256 << 10;

/// A store server running in background threads of this process.
///
/// Clients connect with [`TcpStore::connect`](crate::TcpStore::connect).
/// The table lives as long as the server: dropping it stops accepting,
/// closes every connection (clients then get an error) and joins its
/// threads, all within milliseconds.
///
/// ```
/// use cohort_store::{Store, TcpStore, TcpStoreServer};
/// use std::time::Duration;
///
/// let server = TcpStoreServer::bind("127.0.0.1:0").unwrap(); // port 0: any free port
/// let store = TcpStore::connect(server.local_addr(), Duration::from_secs(5)).unwrap();
/// store.set("k", b"v").unwrap();
/// assert_eq!(store.get("k").unwrap(), b"v");
/// ```
pub struct TcpStoreServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

struct Shared {
    table: HashStore,
    /// Set first when the server shuts down; checked by every thread.
    closed: AtomicBool,
    conns: Mutex<Connections>,
    local_addr: SocketAddr,
    /// Clients must prove they know it, when set.
    secret: Option<Secret>,
    /// Connections refused for lacking the secret, summed up now and then.
    refusals: RefusalLog,
    /// The connections still handshaking (with a secret only).
    room: WaitingRoom,
}

#[derive(Default)]
struct Connections {
    next_id: u64,
    /// A handle on each open connection, to shut it down from `Drop`.
    streams: HashMap<u64, TcpStream>,
    threads: Vec<JoinHandle<()>>,
}

impl fmt::Debug for TcpStoreServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpStoreServer")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

impl TcpStoreServer {
    /// Listens on `addr` (port 0 picks a free port; see
    /// [`local_addr`](Self::local_addr)) and serves clients in background
    /// threads until dropped. Fails with [`StoreError::Bind`], naming the
    /// address, when it cannot listen (for example, the port is in use).
    pub fn bind<A: ToSocketAddrs + Display>(addr: A) -> Result<TcpStoreServer, StoreError> {
        TcpStoreServer::bind_with_secret(addr, None)
    }

    /// [`bind`](Self::bind), serving only clients that prove they know
    /// `secret` (with `None`, anyone, as `bind`). Clients connect with
    /// [`TcpStore::connect_with_secret`](crate::TcpStore::connect_with_secret).
    ///
    /// ```
    /// use cohort_store::{Secret, Store, StoreError, TcpStore, TcpStoreServer};
    /// use std::time::Duration;
    ///
    /// let secret = Secret::generate().unwrap();
    /// let server = TcpStoreServer::bind_with_secret("127.0.0.1:0", Some(secret.clone())).unwrap();
    /// let addr = server.local_addr();
    /// let store = TcpStore::connect_with_secret(addr, Duration::from_secs(5), Some(secret)).unwrap();
    /// store.set("k", b"v").unwrap();
    /// // A client without the secret is turned away.
    /// let stranger = TcpStore::connect(addr, Duration::from_secs(5)).unwrap_err();
    /// assert!(matches!(stranger, StoreError::Protocol { .. }), "{stranger}");
    /// ```
    pub fn bind_with_secret<A: ToSocketAddrs + Display>(
        addr: A,
        secret: Option<Secret>,
    ) -> Result<TcpStoreServer, StoreError> {
        let bind_err = |source| StoreError::Bind {
            addr: addr.to_string(),
            source,
        };
        let listener = TcpListener::bind(&addr).map_err(bind_err)?;
        let local_addr = listener.local_addr().map_err(bind_err)?;
        let shared = Arc::new(Shared {
            // Waits come with the client's own timeout; this one is unused.
            table: HashStore::new(),
            closed: AtomicBool::new(false),
            conns: Mutex::new(Connections::default()),
            local_addr,
            secret,
            refusals: RefusalLog::new(
                format!("cohort-store server {local_addr}"),
                "connection(s) without the job secret",
                REFUSAL_LOG_EVERY,
            ),
            room: WaitingRoom::new(MAX_PENDING),
        });
        let accept = {
            let shared = shared.clone();
            thread::Builder::new()
                .name("cohort-store-accept".into())
                .spawn(move || accept_loop(&shared, listener))
                .map_err(bind_err)?
        };
        Ok(TcpStoreServer {
            local_addr,
            shared,
            accept: Some(accept),
        })
    }

    /// The address the server listens on (with the real port when bound to
    /// port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Connections being served now.
    #[cfg(test)]
    pub(crate) fn connections(&self) -> usize {
        self.shared.conns().streams.len()
    }

    /// An address at which this host reaches the server: the listening
    /// address, or loopback when listening on every interface.
    pub(crate) fn reachable_addr(&self) -> SocketAddr {
        reachable(self.local_addr)
    }
}

fn reachable(addr: SocketAddr) -> SocketAddr {
    let ip = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, addr.port())
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        let shared = &self.shared;
        shared.closed.store(true, Ordering::SeqCst);
        shared.table.wake_waiters();
        let threads = {
            let mut conns = shared.conns();
            for stream in conns.streams.values() {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
            std::mem::take(&mut conns.threads)
        };
        // Wake the accept thread with a connection of our own; if even that
        // fails, leave it detached rather than hang here (it exits on the
        // next connection it accepts).
        let woke =
            TcpStream::connect_timeout(&self.reachable_addr(), Duration::from_secs(1)).is_ok();
        if let Some(accept) = self.accept.take() {
            if woke {
                let _ = accept.join();
            }
        }
        for thread in threads {
            let _ = thread.join();
        }
    }
}

impl Shared {
    fn conns(&self) -> MutexGuard<'_, Connections> {
        // Updates of `Connections` cannot panic half-way; ignore poisoning.
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// A connection refused for lacking the secret: counted, and summed up
    /// in one line now and then (the first at once), so that a flood of
    /// strangers cannot flood the log.
    fn refused(&self, peer: &str, what: &dyn Display) {
        if !self.is_closed() {
            self.refusals.refused(peer, what);
        }
    }

    fn log(&self, peer: &str, what: &dyn Display) {
        if !self.is_closed() {
            eprintln!(
                "cohort-store server {}: dropping client {peer}: {what}",
                self.local_addr
            );
        }
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: TcpListener) {
    for incoming in listener.incoming() {
        if shared.is_closed() {
            return;
        }
        match incoming {
            Ok(stream) => start_connection(shared, stream),
            Err(e) => {
                // Typically out of file descriptors: back off, keep serving
                // the clients already connected.
                eprintln!("cohort-store server {}: accept: {e}", shared.local_addr);
                thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn start_connection(shared: &Arc<Shared>, stream: TcpStream) {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "?".to_string(), |a| a.to_string());
    let handle = match stream.set_nodelay(true).and_then(|()| stream.try_clone()) {
        Ok(handle) => handle,
        Err(e) => return shared.log(&peer, &e),
    };
    // With a secret, a way to hang up on this connection while it is a
    // stranger; the waiting room holds it until the handshake ends.
    let hang_up = match &shared.secret {
        Some(_) => match stream.try_clone() {
            Ok(h) => Some(h),
            Err(e) => return shared.log(&peer, &e),
        },
        None => None,
    };
    let mut conns = shared.conns();
    // Checked under the lock that `Drop` takes to shut connections down, so
    // a connection is either shut down there or never started.
    if shared.is_closed() {
        return;
    }
    conns.threads.retain(|t| !t.is_finished());
    let id = conns.next_id;
    conns.next_id += 1;
    // Too many strangers at the door: the oldest goes.
    let seat = hang_up.map(|h| {
        shared.room.enter(move || {
            let _ = h.shutdown(std::net::Shutdown::Both);
        })
    });
    let thread = {
        let shared = shared.clone();
        let peer = peer.clone();
        thread::Builder::new()
            .name("cohort-store-conn".into())
            .stack_size(CONNECTION_STACK)
            .spawn(move || {
                let admitted = match (&shared.secret, seat) {
                    (Some(secret), Some(seat)) => match admit(&stream, secret) {
                        Err(Dropped::Handshake(_)) if seat.evicted() => Err(Dropped::Handshake(
                            io::Error::other("dropped to make room for newer connections"),
                        )),
                        admitted => admitted,
                    },
                    _ => Ok(()),
                };
                match admitted.and_then(|()| serve(&shared, &stream)) {
                    Err(reason @ (Dropped::Unauthenticated(_) | Dropped::Handshake(_))) => {
                        shared.refused(&peer, &reason)
                    }
                    Err(reason) => shared.log(&peer, &reason),
                    Ok(()) => {}
                }
                shared.conns().streams.remove(&id);
            })
    };
    match thread {
        Ok(thread) => {
            conns.streams.insert(id, handle);
            conns.threads.push(thread);
        }
        Err(e) => shared.log(&peer, &e),
    }
}

/// Why a connection was dropped.
enum Dropped {
    /// The client broke the protocol; it was told why.
    Protocol(String),
    /// The connection failed or closed inside a request.
    Io(io::Error),
    /// The client failed the job-secret handshake.
    Unauthenticated(AuthError),
    /// The connection failed or timed out before the handshake ended (or
    /// was dropped to make room for a newer one).
    Handshake(io::Error),
}

impl Display for Dropped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dropped::Protocol(detail) => write!(f, "protocol error: {detail}"),
            Dropped::Io(e) => write!(f, "connection lost mid-request: {e}"),
            Dropped::Unauthenticated(e) => write!(f, "failed authentication: {e}"),
            Dropped::Handshake(e) => write!(f, "handshake not completed: {e}"),
        }
    }
}

/// Runs the server's side of the handshake on a new connection. A client
/// that sent no handshake gets one error frame saying what it lacks (a
/// cohort client without the secret then reports it instead of retrying).
fn admit(stream: &TcpStream, secret: &Secret) -> Result<(), Dropped> {
    let timeouts = |t: Option<Duration>| {
        stream
            .set_read_timeout(t)
            .and_then(|()| stream.set_write_timeout(t))
    };
    let mut within = Deadline::new(stream, AUTH_TIMEOUT);
    match authenticate_server(&mut within, secret, AUTH_SERVICE) {
        Ok(()) => timeouts(None).map_err(Dropped::Io),
        Err(AuthError::Io(e)) => Err(Dropped::Handshake(e)),
        Err(e @ AuthError::NoHandshake) => {
            let refusal = format!(
                "this store admits only the processes of its job: set {SECRET_ENV} to the job's secret"
            );
            let _ = (&*stream).write_all(&Response::Error(refusal).encode());
            linger(stream);
            Err(Dropped::Unauthenticated(e))
        }
        Err(e) => Err(Dropped::Unauthenticated(e)),
    }
}

/// Closes our side after a refusal and discards what the client still
/// sends for a moment: closing with unread bytes would reset the
/// connection, and a reset may destroy the refusal before it is read.
fn linger(stream: &TcpStream) {
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
    let mut sink = [0u8; 4096];
    for _ in 0..16 {
        match (&*stream).read(&mut sink) {
            Ok(n) if n > 0 => {}
            _ => return,
        }
    }
}

/// Serves one connection until the client leaves (`Ok`) or misbehaves.
fn serve(shared: &Shared, stream: &TcpStream) -> Result<(), Dropped> {
    let mut reader = BufReader::new(stream);
    let mut greeted = false;
    loop {
        let body = match read_frame(&mut reader) {
            Ok(Some(body)) => body,
            Ok(None) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                return Err(refuse(stream, e.to_string()))
            }
            Err(e) => return Err(Dropped::Io(e)),
        };
        let request = Request::decode(&body).map_err(|detail| refuse(stream, detail))?;
        let response = match request {
            Request::Hello { .. } if greeted => {
                return Err(refuse(stream, "a second hello".into()))
            }
            Request::Hello { magic, .. } if magic != MAGIC => {
                return Err(refuse(stream, "not a cohort-store hello".into()))
            }
            Request::Hello { version, .. } if version != VERSION => {
                return Err(refuse(
                    stream,
                    format!("protocol version {version}, this server speaks {VERSION}"),
                ))
            }
            Request::Hello { .. } => {
                greeted = true;
                Response::Hello(VERSION)
            }
            _ if !greeted => {
                return Err(refuse(stream, "expected a cohort-store hello first".into()))
            }
            request => match answer(shared, request, stream) {
                Some(response) => response,
                // Shutting down, or the client left while we waited.
                None => return Ok(()),
            },
        };
        (&*stream)
            .write_all(&response.encode())
            .map_err(Dropped::Io)?;
    }
}

/// Tells the client why it is being dropped, as far as it still listens.
fn refuse(mut stream: &TcpStream, detail: String) -> Dropped {
    let _ = stream.write_all(&Response::Error(detail.clone()).encode());
    linger(stream);
    Dropped::Protocol(detail)
}

/// The response to one request; `None` when the connection should close
/// without one (the server is shutting down, or the client left).
fn answer(shared: &Shared, request: Request<'_>, stream: &TcpStream) -> Option<Response> {
    let table = &shared.table;
    let result = match request {
        // `serve` answers hellos itself and never passes one here.
        Request::Hello { .. } => return None,
        Request::Set { key, value } => table.set(key, value).map(|()| Response::Done),
        Request::Get { key, timeout } => match wait(shared, &[key], timeout, stream) {
            Ok(true) => Ok(Response::Value(table.value(key).unwrap_or_default())),
            Ok(false) => return None,
            Err(e) => Err(e),
        },
        Request::Add { key, delta } => table.add(key, delta).map(Response::Int),
        Request::CompareSet {
            key,
            expected,
            desired,
        } => table
            .compare_set(key, expected, desired)
            .map(Response::Value),
        Request::Wait { keys, timeout } => match wait(shared, &keys, timeout, stream) {
            Ok(true) => Ok(Response::Done),
            Ok(false) => return None,
            Err(e) => Err(e),
        },
        Request::Check { keys } => table.check(&keys).map(Response::Bool),
        Request::Delete { key } => table.delete(key).map(Response::Bool),
        Request::NumKeys => table.num_keys().map(|n| Response::Count(n as u64)),
    };
    Some(match result {
        Ok(response) => response,
        Err(StoreError::Timeout { keys, .. }) => Response::Timeout(keys),
        Err(StoreError::NotACounter { value, .. }) => Response::NotACounter(value.into_bytes()),
        Err(other) => Response::Error(other.to_string()),
    })
}

/// Waits for `keys` on behalf of a client; `Ok(false)` when the server shuts
/// down or the client disconnects first.
fn wait(
    shared: &Shared,
    keys: &[&str],
    timeout: Duration,
    stream: &TcpStream,
) -> Result<bool, StoreError> {
    let mut last_check = Instant::now();
    shared
        .table
        .wait_or_give_up(keys, timeout, PEER_CHECK_EVERY, || {
            if shared.is_closed() {
                return true;
            }
            if last_check.elapsed() < PEER_CHECK_EVERY {
                return false;
            }
            last_check = Instant::now();
            peer_gone(stream)
        })
}

/// Whether the client closed its end. It sends nothing while it waits for
/// an answer, so readable data means only that it is alive.
fn peer_gone(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return true;
    }
    let gone = match stream.peek(&mut [0u8; 1]) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != io::ErrorKind::WouldBlock,
    };
    gone || stream.set_nonblocking(false).is_err()
}

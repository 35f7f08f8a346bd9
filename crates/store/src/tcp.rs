//! `TcpStore`: a store served over TCP by one process (the launcher or rank
//! 0) to every rank, like c10d's TCPStore.
//!
//! The client keeps a small pool of connections: each call takes an idle
//! connection (or opens one), makes one round trip on it and puts it back,
//! so a thread blocked in `get` or `wait` never holds up other threads'
//! calls. Blocking is done by the server, which answers when the keys exist
//! or when the client's deadline passes; the client never polls.
//!
//! With a job secret, every connection runs the handshake of
//! [`auth`](crate::auth) before its hello: the client checks the server's
//! proof first and never sends a request to a server that failed it.
//!
//! The client must never wait without a bound (every socket read has a
//! timeout derived from the call's) and never reuse a connection after an
//! error, since its stream may be out of step.

mod connection;
mod server;
#[cfg(test)]
mod tests;
mod wire;

use connection::*;

pub use server::TcpStoreServer;

use std::fmt::{self, Display};
use std::io::{self, BufReader, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use crate::auth::{authenticate_client, AuthError, Secret, SECRET_ENV};
use crate::{check_entry, check_key, deadline_after, Store, StoreError};
use wire::{read_frame, Request, Response, MAGIC, MAX_FRAME_LEN, VERSION};

/// How long a `get`/`wait` reply may lag behind the deadline the server
/// enforces, and the least time any other reply or write may take, before
/// the client gives up on the server itself. Keeps a short store timeout
/// (meant for missing keys) from failing a `set` on a busy machine.
const REPLY_GRACE: Duration = Duration::from_secs(10);
/// Idle connections kept for reuse; more are closed after their call.
const MAX_IDLE: usize = 8;
/// Longest pause between two connection attempts while the server is not up.
const RETRY_MAX: Duration = Duration::from_millis(50);
/// The service label of the store's handshake (see [`auth`](crate::auth)).
pub(crate) const AUTH_SERVICE: &[u8] = b"cohort-store";

/// Client of a [`TcpStoreServer`]; `Send + Sync`, share it with an `Arc`.
///
/// ```
/// use cohort_store::{Store, TcpStore};
/// use std::time::Duration;
///
/// // Rank 0 hosts the server in-process; other ranks pass `false`.
/// let rank0 = TcpStore::new_master_or_client("127.0.0.1:0", true, Duration::from_secs(5)).unwrap();
/// let rank1 = TcpStore::connect(rank0.server_addr(), Duration::from_secs(5)).unwrap();
/// rank1.set("addr/1", b"127.0.0.1:4001").unwrap();
/// assert_eq!(rank0.get("addr/1").unwrap(), b"127.0.0.1:4001");
/// ```
pub struct TcpStore {
    /// The address as the caller gave it, for error messages.
    addr: String,
    /// Where the first connection got through; later ones go there too.
    server_addr: SocketAddr,
    timeout: Duration,
    /// Proven to the server on every connection, when set.
    secret: Option<Secret>,
    idle: Mutex<Vec<Connection>>,
    /// The server, when this client hosts it; dropped after `idle`.
    server: Option<TcpStoreServer>,
}

impl fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr)
            .field("server_addr", &self.server_addr)
            .field("timeout", &self.timeout)
            .field("hosts_server", &self.server.is_some())
            .finish_non_exhaustive()
    }
}

impl TcpStore {
    /// Connects to the server at `addr` (`"host:port"` or a `SocketAddr`),
    /// retrying until `timeout` since ranks may start before the server is
    /// up. `timeout` is also the store's [`Store::timeout`]. Fails with
    /// [`StoreError::Connect`], naming the address and the timeout, when no
    /// server answered in time, and with [`StoreError::Protocol`] at once
    /// when something other than a store server answered.
    pub fn connect<A: ToSocketAddrs + Display>(
        addr: A,
        timeout: Duration,
    ) -> Result<TcpStore, StoreError> {
        TcpStore::connect_with_secret(addr, timeout, None)
    }

    /// [`connect`](Self::connect) to a server bound with
    /// [`TcpStoreServer::bind_with_secret`]: every connection proves that
    /// this client knows `secret` and checks that the server does (`None`:
    /// no handshake, as `connect`). A server that holds another secret, or
    /// none, is a [`StoreError::Auth`] or [`StoreError::Protocol`] at once,
    /// not a retry until the timeout.
    pub fn connect_with_secret<A: ToSocketAddrs + Display>(
        addr: A,
        timeout: Duration,
        secret: Option<Secret>,
    ) -> Result<TcpStore, StoreError> {
        let name = addr.to_string();
        let deadline = deadline_after(timeout);
        let mut pause = Duration::from_millis(1);
        let mut last_err = io::Error::new(io::ErrorKind::TimedOut, "no attempt finished");
        loop {
            match addr.to_socket_addrs() {
                Ok(candidates) => {
                    for server_addr in candidates {
                        let left = deadline.saturating_duration_since(Instant::now());
                        let attempt = left.clamp(Duration::from_millis(1), Duration::from_secs(1));
                        let io_timeout = timeout.max(REPLY_GRACE);
                        match Connection::open(&server_addr, attempt, io_timeout, secret.as_ref()) {
                            Ok(conn) => {
                                return Ok(TcpStore {
                                    addr: name,
                                    server_addr,
                                    timeout,
                                    secret,
                                    idle: Mutex::new(vec![conn]),
                                    server: None,
                                })
                            }
                            Err(OpenError::Protocol(detail)) => {
                                return Err(StoreError::Protocol {
                                    location: name,
                                    detail,
                                })
                            }
                            Err(OpenError::Auth(source)) => {
                                return Err(StoreError::Auth {
                                    location: name,
                                    source: Box::new(source),
                                })
                            }
                            Err(OpenError::Io(e)) => last_err = e,
                        }
                    }
                }
                Err(e) => last_err = e,
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(StoreError::Connect {
                    addr: name,
                    timeout,
                    source: last_err,
                });
            }
            thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(RETRY_MAX);
        }
    }

    /// PyTorch's `TCPStore(host, port, is_master=...)`: the master binds a
    /// [`TcpStoreServer`] on `addr` in this process and connects to it; the
    /// others [`connect`](Self::connect) to `addr`. The master's server lives
    /// as long as this `TcpStore`, so rank 0 must keep it until the other
    /// ranks are done with the store.
    pub fn new_master_or_client<A: ToSocketAddrs + Display>(
        addr: A,
        is_master: bool,
        timeout: Duration,
    ) -> Result<TcpStore, StoreError> {
        TcpStore::new_master_or_client_with_secret(addr, is_master, timeout, None)
    }

    /// [`new_master_or_client`](Self::new_master_or_client) where the
    /// server admits, and the clients prove, only the job secret `secret`.
    pub fn new_master_or_client_with_secret<A: ToSocketAddrs + Display>(
        addr: A,
        is_master: bool,
        timeout: Duration,
        secret: Option<Secret>,
    ) -> Result<TcpStore, StoreError> {
        if !is_master {
            return TcpStore::connect_with_secret(addr, timeout, secret);
        }
        let server = TcpStoreServer::bind_with_secret(addr, secret.clone())?;
        let mut store = TcpStore::connect_with_secret(server.reachable_addr(), timeout, secret)?;
        store.server = Some(server);
        Ok(store)
    }

    /// The server's address as this client reaches it (for a master bound to
    /// port 0, the real port, to hand to the other ranks).
    pub fn server_addr(&self) -> SocketAddr {
        self.server_addr
    }

    /// Bound on connecting and on any write or non-blocking reply.
    fn io_timeout(&self) -> Duration {
        self.timeout.max(REPLY_GRACE)
    }

    fn idle(&self) -> MutexGuard<'_, Vec<Connection>> {
        // The pool is only pushed to and popped from; poisoning is harmless.
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn io_err(&self, source: io::Error) -> StoreError {
        let source = if source.kind() == io::ErrorKind::UnexpectedEof {
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the store server closed the connection",
            )
        } else {
            source
        };
        StoreError::Io {
            location: self.addr.clone(),
            source,
        }
    }

    fn protocol_err(&self, detail: String) -> StoreError {
        StoreError::Protocol {
            location: self.addr.clone(),
            detail,
        }
    }

    /// One round trip; `blocks_for` is how long the server may hold the
    /// answer (a `get` or `wait` timeout).
    fn call(
        &self,
        request: &Request<'_>,
        blocks_for: Option<Duration>,
    ) -> Result<Response, StoreError> {
        let frame = request.encode();
        if frame.len() - 4 > MAX_FRAME_LEN {
            return Err(self.protocol_err(format!(
                "a request of {} bytes is over the frame limit of {MAX_FRAME_LEN}",
                frame.len() - 4
            )));
        }
        let reply_within = match blocks_for {
            Some(t) => t.saturating_add(REPLY_GRACE),
            None => self.io_timeout(),
        };
        let popped = self.idle().pop();
        let mut conn = match popped {
            Some(conn) => conn,
            None => Connection::open(
                &self.server_addr,
                self.io_timeout(),
                self.io_timeout(),
                self.secret.as_ref(),
            )
            .map_err(|e| match e {
                OpenError::Io(e) => self.io_err(e),
                OpenError::Protocol(detail) => self.protocol_err(detail),
                OpenError::Auth(source) => StoreError::Auth {
                    location: self.addr.clone(),
                    source: Box::new(source),
                },
            })?,
        };
        let response = conn.round_trip(&frame, reply_within).map_err(|e| {
            if e.kind() == io::ErrorKind::InvalidData {
                self.protocol_err(e.to_string())
            } else {
                self.io_err(e)
            }
        })?;
        if let Response::Error(detail) = response {
            return Err(self.protocol_err(format!("the server refused the request: {detail}")));
        }
        let mut idle = self.idle();
        if idle.len() < MAX_IDLE {
            idle.push(conn);
        }
        Ok(response)
    }

    fn unexpected(&self, op: &str, response: Response) -> StoreError {
        self.protocol_err(format!("unexpected answer to {op}: {response:?}"))
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_entry(key, value)?;
        match self.call(&Request::Set { key, value }, None)? {
            Response::Done => Ok(()),
            other => Err(self.unexpected("set", other)),
        }
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let timeout = self.timeout;
        match self.call(&Request::Get { key, timeout }, Some(timeout))? {
            Response::Value(v) => Ok(v),
            Response::Timeout(keys) => Err(StoreError::Timeout { keys, timeout }),
            other => Err(self.unexpected("get", other)),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        check_key(key)?;
        match self.call(&Request::Add { key, delta }, None)? {
            Response::Int(n) => Ok(n),
            Response::NotACounter(value) => Err(StoreError::NotACounter {
                key: key.to_string(),
                value: String::from_utf8_lossy(&value).into_owned(),
            }),
            other => Err(self.unexpected("add", other)),
        }
    }

    fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        check_entry(key, desired)?;
        check_entry(key, expected)?;
        let request = Request::CompareSet {
            key,
            expected,
            desired,
        };
        match self.call(&request, None)? {
            Response::Value(v) => Ok(v),
            other => Err(self.unexpected("compare_set", other)),
        }
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let request = Request::Wait {
            keys: keys.to_vec(),
            timeout,
        };
        match self.call(&request, Some(timeout))? {
            Response::Done => Ok(()),
            Response::Timeout(keys) => Err(StoreError::Timeout { keys, timeout }),
            other => Err(self.unexpected("wait", other)),
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let request = Request::Check {
            keys: keys.to_vec(),
        };
        match self.call(&request, None)? {
            Response::Bool(b) => Ok(b),
            other => Err(self.unexpected("check", other)),
        }
    }

    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        match self.call(&Request::Delete { key }, None)? {
            Response::Bool(b) => Ok(b),
            other => Err(self.unexpected("delete", other)),
        }
    }

    fn num_keys(&self) -> Result<usize, StoreError> {
        match self.call(&Request::NumKeys, None)? {
            Response::Count(n) => Ok(usize::try_from(n).unwrap_or(usize::MAX)),
            other => Err(self.unexpected("num_keys", other)),
        }
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}

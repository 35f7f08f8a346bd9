//! Building the mesh: listeners, the store rendezvous (addresses, nonce), connecting to lower
//! ranks and accepting higher ones, the job-secret handshake and the hello that refuses stray or
//! stale connections, on TCP or on Unix sockets between ranks of one host.
//!
//! Everything here runs once per group, before the first byte of data; every wait has a
//! deadline, and a refused peer is logged and never sees a byte of the job.
//!
//! The listeners bound what strangers may cost with the rules of `cohort_store::door`: each
//! accepted connection has one deadline for its whole handshake (a stranger trickling a byte
//! now and then is dropped on time), at most [`MAX_PENDING`] of them (or as many as this
//! rank's own peers, if more) handshake at once and a newer one hangs up on the oldest, and
//! refusals are summed up in one stderr line per interval. A flood thus holds a bounded number
//! of descriptors and threads, and never keeps the group's own ranks out.

use super::*;

impl TcpTransport {
    /// Builds the mesh for `rank` of `size` through `store` (already
    /// namespaced to the group), listening on `bind_ip` (and on a Unix
    /// socket for peers on this host unless `COHORT_TRANSPORT=tcp`). Fails
    /// after `timeout` if some rank never shows up, naming it. When
    /// `COHORT_SECRET` holds the job secret, every connection must pass the
    /// job-secret handshake.
    pub fn connect(
        store: &dyn Store,
        group: &str,
        rank: usize,
        size: usize,
        bind_ip: IpAddr,
        timeout: Duration,
    ) -> Result<TcpTransport, CommError> {
        let local = Local::from_env()?;
        Self::connect_with(store, group, rank, size, bind_ip, timeout, local)
    }

    /// [`connect`](Self::connect) with the job secret given instead of read
    /// from `COHORT_SECRET` (`None`: no handshake, anyone who knows the
    /// group's nonce may connect).
    pub fn connect_with_secret(
        store: &dyn Store,
        group: &str,
        rank: usize,
        size: usize,
        bind_ip: IpAddr,
        timeout: Duration,
        secret: Option<&Secret>,
    ) -> Result<TcpTransport, CommError> {
        let local = Local::from_env()?;
        Self::mesh(store, group, rank, size, bind_ip, timeout, local, secret)
    }

    /// [`connect`](Self::connect) over `local` sockets between ranks of
    /// one host; the secret comes from `COHORT_SECRET`.
    pub(crate) fn connect_with(
        store: &dyn Store,
        group: &str,
        rank: usize,
        size: usize,
        bind_ip: IpAddr,
        timeout: Duration,
        local: Local,
    ) -> Result<TcpTransport, CommError> {
        let secret = Secret::from_env().map_err(|e| CommError::Init {
            name: SECRET_ENV.to_string(),
            detail: e.to_string(),
        })?;
        Self::mesh(
            store,
            group,
            rank,
            size,
            bind_ip,
            timeout,
            local,
            secret.as_ref(),
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn mesh(
        store: &dyn Store,
        group: &str,
        rank: usize,
        size: usize,
        bind_ip: IpAddr,
        timeout: Duration,
        local: Local,
        secret: Option<&Secret>,
    ) -> Result<TcpTransport, CommError> {
        let deadline = Instant::now() + timeout;
        let rdv = |detail: String| CommError::Rendezvous {
            group: group.to_string(),
            rank,
            detail,
        };
        let store_err = |source| CommError::Store {
            group: group.to_string(),
            source,
        };
        let mut t = TcpTransport {
            rank,
            size,
            collective: (0..size).map(|_| None).collect(),
            p2p: (0..size).map(|_| None).collect(),
            lowat: (0..2 * size).map(|_| AtomicUsize::new(1)).collect(),
        };
        if size == 1 {
            return Ok(t);
        }
        let listener = TcpListener::bind((bind_ip, 0))
            .map_err(|e| rdv(format!("cannot listen on {bind_ip}: {e}")))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| rdv(format!("listener: {e}")))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| rdv(format!("listener: {e}")))?;

        let nonce = if rank == 0 {
            let n = fresh_nonce();
            store
                .set("nonce", n.to_string().as_bytes())
                .map_err(store_err)?;
            n
        } else {
            wait_key(store, "nonce", deadline)
                .map_err(|e| rdv(format!("rank 0 never published the group nonce: {e}")))?
                .parse::<u64>()
                .map_err(|e| rdv(format!("bad nonce in store: {e}")))?
        };
        // Published before the TCP address, so a peer that sees the
        // address finds this too.
        let host = host_id();
        let unix = match (&host, local) {
            (Some(host), Local::Unix) => {
                unix_listener(nonce, rank).map(|(l, name)| (l, host, name))
            }
            _ => None,
        };
        let unix_entry = unix
            .as_ref()
            .map_or(String::new(), |(_, host, name)| format!("{host} {name}"));
        store
            .set(&format!("unix/{rank}"), unix_entry.as_bytes())
            .map_err(store_err)?;
        store
            .set(&format!("addr/{rank}"), local_addr.to_string().as_bytes())
            .map_err(store_err)?;
        let unix_listener = unix.as_ref().map(|(l, _, _)| l);

        let expected = 2 * (size - 1 - rank);
        let accepted = std::thread::scope(|scope| {
            let acceptor = scope.spawn(|| {
                let me = Acceptor {
                    group,
                    nonce,
                    rank,
                    size,
                    secret,
                };
                me.accept_peers(&listener, unix_listener, expected, deadline)
            });
            for peer in 0..rank {
                let addr = wait_key(store, &format!("addr/{peer}"), deadline)
                    .map_err(|e| rdv(format!("rank {peer} never published its address: {e}")))?;
                let addr: SocketAddr = addr.parse().map_err(|e| {
                    rdv(format!("rank {peer} published a bad address {addr:?}: {e}"))
                })?;
                let peer_unix = wait_key(store, &format!("unix/{peer}"), deadline)
                    .map_err(|e| rdv(format!("rank {peer} never published its host: {e}")))?;
                // The peer's abstract socket, if it is on this host and this
                // rank may use it.
                let same_host = match (&host, local, peer_unix.split_once(' ')) {
                    (Some(h), Local::Unix, Some((ph, name))) if ph == h => Some(name),
                    _ => None,
                };
                for ch in [Channel::Collective, Channel::P2p] {
                    let hello = Hello {
                        nonce,
                        rank,
                        peer,
                        ch,
                        secret,
                    };
                    let unix = same_host.and_then(|name| connect_unix(name, &hello, deadline).ok());
                    let s = match unix {
                        Some(s) => s,
                        None => connect_peer(addr, &hello, deadline).map_err(|e| {
                            rdv(format!("connecting to rank {peer} at {addr}: {e}"))
                        })?,
                    };
                    *t.slot(ch, peer) = Some(s);
                }
            }
            acceptor
                .join()
                .unwrap_or_else(|_| Err("acceptor thread panicked".to_string()))
                .map_err(rdv)
        })?;
        for (peer, ch, s) in accepted {
            *t.slot(ch, peer) = Some(s);
        }
        for s in t.collective.iter().chain(&t.p2p).flatten() {
            tune(s).map_err(|e| rdv(format!("socket options: {e}")))?;
        }
        Ok(t)
    }
}

pub(super) fn tune(s: &Conn) -> io::Result<()> {
    s.set_blocking(None)?;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // safety: fd is open; the option value is a c_int as SO_*BUF expects.
        let r = unsafe {
            libc::setsockopt(
                s.fd(),
                libc::SOL_SOCKET,
                opt,
                (&SOCKET_BUFFER_BYTES as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

pub(super) fn fresh_nonce() -> u64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// Waits for `key` until `deadline` and returns it as a string.
pub(super) fn wait_key(store: &dyn Store, key: &str, deadline: Instant) -> Result<String, String> {
    let left = deadline.saturating_duration_since(Instant::now());
    store.wait(&[key], left).map_err(|e| e.to_string())?;
    let v = store.get(key).map_err(|e| e.to_string())?;
    String::from_utf8(v).map_err(|e| format!("key {key:?} is not UTF-8: {e}"))
}

pub(super) fn hello(nonce: u64, from: usize, to: usize, ch: Channel) -> [u8; HELLO_BYTES] {
    let mut b = [0u8; HELLO_BYTES];
    b[..8].copy_from_slice(HELLO_MAGIC);
    b[8..16].copy_from_slice(&nonce.to_le_bytes());
    b[16..20].copy_from_slice(&(from as u32).to_le_bytes());
    b[20..24].copy_from_slice(&(to as u32).to_le_bytes());
    b[24] = matches!(ch, Channel::P2p) as u8;
    b
}

/// What a connecting rank presents to the rank it connects to.
pub(super) struct Hello<'a> {
    nonce: u64,
    rank: usize,
    peer: usize,
    ch: Channel,
    secret: Option<&'a Secret>,
}

pub(super) fn connect_peer(
    addr: SocketAddr,
    hello: &Hello<'_>,
    deadline: Instant,
) -> io::Result<Conn> {
    let s = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "timed out"));
        }
        match TcpStream::connect_timeout(&addr, left) {
            Ok(s) => break s,
            // The listener exists before its address is published, so a
            // refusal is a transient overload; retry until the deadline.
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => return Err(e),
        }
    };
    say_hello(Conn::Tcp(s), hello, deadline)
}

/// Connects to a same-host peer's abstract Unix socket `name`.
pub(super) fn connect_unix(name: &str, hello: &Hello<'_>, deadline: Instant) -> io::Result<Conn> {
    let addr = UnixAddr::from_abstract_name(name.as_bytes())?;
    let s = UnixStream::connect_addr(&addr)?;
    say_hello(Conn::Unix(s), hello, deadline)
}

/// Proves the job secret (if any) on a fresh connection, sends the hello
/// and waits for the acceptor's yes.
pub(super) fn say_hello(mut s: Conn, h: &Hello<'_>, deadline: Instant) -> io::Result<Conn> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    s.set_blocking(Some(left))?;
    if let Some(secret) = h.secret {
        authenticate_client(&mut s, secret, AUTH_SERVICE).map_err(|e| match e {
            AuthError::Io(e) if e.kind() == io::ErrorKind::UnexpectedEof => io::Error::new(
                io::ErrorKind::ConnectionRefused,
                "the listener hung up on the job-secret handshake (it runs without \
                 COHORT_SECRET, or a different job uses this address)",
            ),
            AuthError::Io(e) => e,
            e => io::Error::new(io::ErrorKind::PermissionDenied, e.to_string()),
        })?;
    }
    s.write_all(&hello(h.nonce, h.rank, h.peer, h.ch))?;
    let mut ack = [0u8; 1];
    match s.read(&mut ack) {
        Ok(1) if ack[0] == 1 => Ok(s),
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::ConnectionRefused,
            "the listener refused the hello (a different group or job uses this address, \
             or only one side has COHORT_SECRET)",
        )),
        Err(e) => Err(e),
    }
}

pub(super) type Accepted = Vec<(usize, Channel, Conn)>;

/// This host as seen by abstract Unix sockets: the kernel (boot id) and
/// the network namespace, which scopes abstract names. `None` if either is
/// unknown, and then only TCP is used.
pub(crate) fn host_id() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let netns = std::fs::read_link("/proc/self/ns/net").ok()?;
    Some(format!("{}/{}", boot.trim(), netns.to_str()?).replace(' ', "_"))
}

/// A non-blocking listener on a fresh abstract name; `None` if the kernel
/// refuses (then peers use TCP).
pub(super) fn unix_listener(nonce: u64, rank: usize) -> Option<(UnixListener, String)> {
    let name = format!("cohort/{nonce:016x}/{rank}/{}", std::process::id());
    let addr = UnixAddr::from_abstract_name(name.as_bytes()).ok()?;
    let l = UnixListener::bind_addr(&addr).ok()?;
    l.set_nonblocking(true).ok()?;
    Some((l, name))
}

/// The accepting side of one rank's rendezvous.
pub(super) struct Acceptor<'a> {
    group: &'a str,
    nonce: u64,
    rank: usize,
    size: usize,
    secret: Option<&'a Secret>,
}

impl Acceptor<'_> {
    /// Accepts `expected` connections from higher ranks. Each one is
    /// authenticated and its hello checked on a thread of its own; those
    /// that are not peers of this group are logged and dropped there.
    pub(super) fn accept_peers(
        &self,
        listener: &TcpListener,
        unix: Option<&UnixListener>,
        expected: usize,
        deadline: Instant,
    ) -> Result<Accepted, String> {
        // Room for every peer of this rank at once, so that a crowd of
        // strangers can push out only strangers and peers that are slow.
        let door = Door {
            room: WaitingRoom::new(MAX_PENDING.max(expected)),
            log: Arc::new(RefusalLog::new(
                format!("cohort-comm: group {:?} rank {}", self.group, self.rank),
                "connection(s) that are not peers of this group",
                REFUSAL_LOG_EVERY,
            )),
        };
        let (admitted_tx, admitted) = mpsc::channel::<(usize, Channel, Conn)>();
        // Handshake threads write a byte here after each verdict, so that
        // the poll on the listeners also wakes for them.
        let (wake_rx, wake_tx) =
            UnixStream::pair().map_err(|e| format!("creating a wake-up socket: {e}"))?;
        wake_rx
            .set_nonblocking(true)
            .map_err(|e| format!("wake-up socket: {e}"))?;
        let mut got: Accepted = Vec::with_capacity(expected);
        loop {
            while let Ok((from, ch, mut s)) = admitted.try_recv() {
                if got.iter().any(|(p, c, _)| *p == from && *c == ch) {
                    door.log.refused(
                        &s.peer(),
                        &format!("a second {ch:?} connection of rank {from}"),
                    );
                } else if s.write_all(&[1]).is_ok() {
                    got.push((from, ch, s));
                }
            }
            if got.len() == expected {
                return Ok(got);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let missing: Vec<String> = (self.rank + 1..self.size)
                    .filter(|p| got.iter().filter(|(q, _, _)| q == p).count() < 2)
                    .map(|p| p.to_string())
                    .collect();
                return Err(format!(
                    "ranks {} never connected (timeout)",
                    missing.join(", ")
                ));
            }
            let accepted = match listener.accept() {
                Ok((s, _)) => Ok(Conn::Tcp(s)),
                Err(e) => match unix.map(|u| u.accept()) {
                    Some(Ok((s, _))) => Ok(Conn::Unix(s)),
                    Some(Err(u)) if u.kind() != io::ErrorKind::WouldBlock => Err(u),
                    _ => Err(e),
                },
            };
            match accepted {
                Ok(s) => self.admit_in_background(s, left, &door, &admitted_tx, &wake_tx),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let mut fds: Vec<libc::pollfd> = [listener.as_raw_fd(), wake_rx.as_raw_fd()]
                        .into_iter()
                        .chain(unix.map(|u| u.as_raw_fd()))
                        .map(|fd| libc::pollfd {
                            fd,
                            events: libc::POLLIN,
                            revents: 0,
                        })
                        .collect();
                    poll(&mut fds, left).map_err(|e| format!("poll on listener: {e}"))?;
                    while matches!((&wake_rx).read(&mut [0u8; 64]), Ok(n) if n > 0) {}
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("accept: {e}")),
            }
        }
    }

    /// Authenticates `s` and reads its hello on a new thread, seated in the
    /// door's waiting room meanwhile; the thread sends it to `admitted` if
    /// it is a peer of this group and logs it otherwise.
    pub(super) fn admit_in_background(
        &self,
        s: Conn,
        left: Duration,
        door: &Door,
        admitted: &mpsc::Sender<(usize, Channel, Conn)>,
        wake: &UnixStream,
    ) {
        let who = s.peer();
        let (Ok(wake), Ok(hang_up), admitted) = (wake.try_clone(), s.try_clone(), admitted.clone())
        else {
            return door
                .log
                .refused(&who, &"cannot clone its socket or the wake-up socket");
        };
        // Full of strangers: the oldest is hung up on (its thread's read ends).
        let seat = door.room.enter(move || {
            let _ = hang_up.shutdown();
        });
        let log = door.log.clone();
        let peer = who.clone();
        let me = Admission {
            nonce: self.nonce,
            rank: self.rank,
            size: self.size,
            secret: self.secret.cloned(),
            // A peer speaks right after connecting and is through within
            // microseconds; anything slower (a port scanner, a stuck
            // process, a trickler) only holds its own thread, and only
            // until this deadline for its whole handshake.
            timeout: left.clamp(Duration::from_millis(1), HELLO_TIMEOUT),
        };
        let spawned = std::thread::Builder::new()
            .name("cohort-admit".into())
            .stack_size(64 << 10)
            .spawn(move || {
                let verdict = me.check(s);
                let evicted = seat.evicted();
                drop(seat);
                match verdict {
                    Ok(found) => {
                        let _ = admitted.send(found);
                    }
                    Err(_) if evicted => {
                        log.refused(&peer, &"dropped to make room for newer connections")
                    }
                    Err(why) => log.refused(&peer, &why),
                }
                let _ = (&wake).write_all(&[1]);
            });
        if let Err(e) = spawned {
            door.log
                .refused(&who, &format!("cannot start its handshake: {e}"));
        }
    }
}

/// What strangers may cost one rendezvous: the waiting room of connections
/// still handshaking, and the log that sums up refusals (its last line is
/// printed when the last handshake thread is done with it).
pub(super) struct Door {
    room: WaitingRoom,
    log: Arc<RefusalLog>,
}

/// What a handshake thread needs, owned (it may outlive the rendezvous).
pub(super) struct Admission {
    nonce: u64,
    rank: usize,
    size: usize,
    secret: Option<Secret>,
    timeout: Duration,
}

impl Admission {
    /// Authenticates an accepted connection and checks its hello, all of it
    /// within the timeout; the error says why it is no peer of this group.
    pub(super) fn check(&self, s: Conn) -> Result<(usize, Channel, Conn), String> {
        s.set_blocking(Some(self.timeout))
            .map_err(|e| e.to_string())?;
        let mut s = Deadline::new(s, self.timeout);
        if let Some(secret) = &self.secret {
            authenticate_server(&mut s, secret, AUTH_SERVICE)
                .map_err(|e| format!("failed authentication: {e}"))?;
        }
        let mut b = [0u8; HELLO_BYTES];
        s.read_exact(&mut b).map_err(|e| format!("no hello: {e}"))?;
        let s = s.into_inner();
        let from = u32::from_le_bytes(b[16..20].try_into().unwrap()) as usize;
        let to = u32::from_le_bytes(b[20..24].try_into().unwrap()) as usize;
        let ch = if b[24] == 1 {
            Channel::P2p
        } else {
            Channel::Collective
        };
        if &b[..8] != HELLO_MAGIC {
            return Err("not a cohort hello".to_string());
        }
        if u64::from_le_bytes(b[8..16].try_into().unwrap()) != self.nonce {
            return Err("a hello for another group or an earlier run (nonce differs)".to_string());
        }
        if to != self.rank || from <= self.rank || from >= self.size {
            return Err(format!(
                "a hello from rank {from} to rank {to}, but this is rank {} of {}",
                self.rank, self.size
            ));
        }
        Ok((from, ch, s))
    }
}

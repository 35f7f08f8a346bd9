use super::*;
use crate::auth::authenticate_client;
use crate::contract::check_store;
use std::io::{Read, Write};
use std::sync::Arc;

const SHORT: Duration = Duration::from_millis(150);

fn server() -> TcpStoreServer {
    TcpStoreServer::bind("127.0.0.1:0").unwrap()
}

#[test]
fn meets_the_store_contract() {
    let server = server();
    let a = TcpStore::connect(server.local_addr(), SHORT).unwrap();
    let b = TcpStore::connect(server.local_addr(), SHORT).unwrap();
    check_store(&a, &b);
}

#[test]
fn master_hosts_the_server_for_the_others() {
    let master = TcpStore::new_master_or_client("127.0.0.1:0", true, SHORT).unwrap();
    let addr = master.server_addr();
    assert_ne!(addr.port(), 0);
    let client =
        TcpStore::new_master_or_client(addr.to_string(), false, Duration::from_secs(5)).unwrap();
    client.set("k", b"v").unwrap();
    assert_eq!(master.get("k").unwrap(), b"v");
    drop(master);
    // The server went with the master.
    assert!(matches!(client.num_keys(), Err(StoreError::Io { .. })));
}

#[test]
fn a_taken_port_is_a_bind_error_naming_it() {
    let first = server();
    let addr = first.local_addr().to_string();
    let err = TcpStoreServer::bind(addr.as_str()).unwrap_err();
    assert!(matches!(err, StoreError::Bind { .. }), "{err:?}");
    assert!(err.to_string().contains(&addr), "{err}");
}

/// A port on which nothing listens (free a moment ago), below the
/// kernel's ephemeral range: a port from that range could be handed to
/// a server another test binds to port 0 meanwhile.
fn dead_addr() -> SocketAddr {
    let first_ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let start = first_ephemeral.saturating_sub(4096).max(1024);
    let spread = (first_ephemeral - start).max(1);
    let seed = std::process::id() as u16 ^ Instant::now().elapsed().subsec_nanos() as u16;
    (0..spread)
        .map(|i| start + (seed.wrapping_add(i.wrapping_mul(97))) % spread)
        .find_map(|port| {
            std::net::TcpListener::bind(("127.0.0.1", port))
                .and_then(|l| l.local_addr())
                .ok()
        })
        .expect("a free port below the ephemeral range")
}

#[test]
fn a_server_that_never_appears_is_a_timeout_naming_the_address() {
    let addr = dead_addr();
    let started = Instant::now();
    let err = TcpStore::connect(addr, Duration::from_millis(300)).unwrap_err();
    let waited = started.elapsed();
    assert!(matches!(err, StoreError::Connect { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains(&addr.to_string()) && msg.contains("300ms"),
        "{msg}"
    );
    assert!(
        waited >= Duration::from_millis(300),
        "gave up after {waited:?}"
    );
    assert!(waited < Duration::from_secs(2), "took {waited:?}");
}

#[test]
fn a_client_started_before_its_server_waits_for_it() {
    let addr = dead_addr();
    let (answered, server_may_go) = std::sync::mpsc::channel();
    let late = thread::spawn(move || {
        thread::sleep(Duration::from_millis(100));
        let server = TcpStoreServer::bind(addr).unwrap();
        let store = TcpStore::connect(addr, SHORT).unwrap();
        store.wait(&["done"], Duration::from_secs(10)).unwrap();
        // The key is set before its setter has the answer: keep the
        // server up until it does.
        server_may_go.recv().unwrap();
        drop(server);
    });
    let store = TcpStore::connect(addr, Duration::from_secs(10)).unwrap();
    store.set("done", b"").unwrap();
    answered.send(()).unwrap();
    late.join().unwrap();
}

#[test]
fn a_blocked_get_does_not_block_other_threads() {
    let server = server();
    let store = Arc::new(TcpStore::connect(server.local_addr(), Duration::from_secs(10)).unwrap());
    let getter = {
        let store = store.clone();
        thread::spawn(move || store.get("later").unwrap())
    };
    thread::sleep(Duration::from_millis(50));
    // Same client, other thread: not queued behind the blocked get.
    let started = Instant::now();
    store.set("other", b"x").unwrap();
    assert_eq!(store.get("other").unwrap(), b"x");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    store.set("later", b"now").unwrap();
    assert_eq!(getter.join().unwrap(), b"now");
}

#[test]
fn dropping_the_server_wakes_waiting_clients_and_returns_promptly() {
    let server = server();
    let store = Arc::new(TcpStore::connect(server.local_addr(), Duration::from_secs(60)).unwrap());
    let waiter = {
        let store = store.clone();
        thread::spawn(move || {
            let started = Instant::now();
            let result = store.wait(&["never"], Duration::from_secs(60));
            (result, started.elapsed())
        })
    };
    thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    drop(server);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "drop took {:?}",
        started.elapsed()
    );
    let (result, waited) = waiter.join().unwrap();
    let err = result.unwrap_err();
    assert!(matches!(err, StoreError::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("closed the connection"), "{err}");
    assert!(waited < Duration::from_secs(2), "woke after {waited:?}");
}

/// Sends raw bytes to the server; returns what it answered before closing.
fn raw_exchange(addr: SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(bytes).unwrap();
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).unwrap();
    answer
}

fn refusal(answer: &[u8]) -> String {
    match read_frame(&mut &answer[..]) {
        Ok(Some(body)) => match Response::decode(&body) {
            Ok(Response::Error(detail)) => detail,
            other => panic!("expected a refusal, got {other:?}"),
        },
        other => panic!("expected a frame, got {other:?}"),
    }
}

#[test]
fn garbage_and_oversized_frames_are_refused_and_the_server_keeps_serving() {
    let server = server();
    let addr = server.local_addr();
    let store = TcpStore::connect(addr, Duration::from_secs(5)).unwrap();
    store.set("k", b"v").unwrap();

    let http = raw_exchange(addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(
        refusal(&http).contains("frame length"),
        "{}",
        refusal(&http)
    );

    let oversized = raw_exchange(addr, &u32::MAX.to_le_bytes());
    assert!(refusal(&oversized).contains("frame length 4294967295"));

    let mut unknown_op = 1u32.to_le_bytes().to_vec();
    unknown_op.push(200);
    assert!(refusal(&raw_exchange(addr, &unknown_op)).contains("unknown op 200"));

    // A well-formed request without the hello first.
    assert!(refusal(&raw_exchange(addr, &Request::NumKeys.encode())).contains("hello"));

    // A hello, then a set whose value length runs past its frame.
    let mut lying = Request::Hello {
        magic: MAGIC,
        version: VERSION,
    }
    .encode();
    let mut set = Request::Set {
        key: "x",
        value: b"abc",
    }
    .encode();
    let value_len_at = 4 + 1 + 4 + 1;
    set[value_len_at..value_len_at + 4].copy_from_slice(&1_000_000u32.to_le_bytes());
    lying.extend(set);
    let answer = raw_exchange(addr, &lying);
    let mut r = &answer[..];
    let hello = read_frame(&mut r).unwrap().unwrap();
    assert_eq!(Response::decode(&hello).unwrap(), Response::Hello(VERSION));
    assert!(refusal(r).contains("remain"), "{}", refusal(r));

    // Disconnecting mid-frame and mid-wait.
    drop(raw_exchange_partial(addr, &[10, 0, 0]));
    let mut waiting = Request::Hello {
        magic: MAGIC,
        version: VERSION,
    }
    .encode();
    waiting.extend(
        Request::Wait {
            keys: vec!["never"],
            timeout: Duration::from_secs(600),
        }
        .encode(),
    );
    drop(raw_exchange_partial(addr, &waiting));
    // The thread that waited for the vanished client is freed well
    // before the wait's 600 s deadline; only `store`'s connection stays.
    let started = Instant::now();
    while server.connections() > 1 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{} connections still open",
            server.connections()
        );
        thread::sleep(Duration::from_millis(20));
    }

    // A client from another version is told so.
    let old = Request::Hello {
        magic: MAGIC,
        version: VERSION + 1,
    }
    .encode();
    assert!(refusal(&raw_exchange(addr, &old)).contains("protocol version"));

    // Through all of that, the server kept serving.
    assert_eq!(store.get("k").unwrap(), b"v");
    let fresh = TcpStore::connect(addr, Duration::from_secs(5)).unwrap();
    assert_eq!(fresh.add("n", 2).unwrap(), 2);
    assert_eq!(fresh.num_keys().unwrap(), 2);
}

/// Sends `bytes` and hangs up without reading the answer.
fn raw_exchange_partial(addr: SocketAddr, bytes: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(bytes).unwrap();
    thread::sleep(Duration::from_millis(20));
    s
}

#[test]
fn a_server_that_is_not_a_store_is_a_protocol_error() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let impostor = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut hello = [0u8; 64];
        let _ = s.read(&mut hello);
        s.write_all(b"SSH-2.0-OpenSSH_9.6\r\n").unwrap();
    });
    let err = TcpStore::connect(addr, Duration::from_secs(5)).unwrap_err();
    assert!(matches!(err, StoreError::Protocol { .. }), "{err:?}");
    assert!(
        err.to_string().contains("not a cohort-store server"),
        "{err}"
    );
    impostor.join().unwrap();
}

fn secret_server() -> (TcpStoreServer, Secret) {
    let secret = Secret::generate().unwrap();
    let server = TcpStoreServer::bind_with_secret("127.0.0.1:0", Some(secret.clone())).unwrap();
    (server, secret)
}

/// A raw connection that passed the handshake: a client that knows the
/// secret but speaks garbage.
fn authenticated_raw(addr: SocketAddr, secret: &Secret) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    authenticate_client(&mut s, secret, AUTH_SERVICE).unwrap();
    s
}

/// Waits until only `n` connections are left open on `server`.
fn settles_to(server: &TcpStoreServer, n: usize) {
    let started = Instant::now();
    while server.connections() > n {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{} connections still open, expected {n}",
            server.connections()
        );
        thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn an_authenticated_store_serves_its_job_and_refuses_everyone_else_at_once() {
    let (server, secret) = secret_server();
    let addr = server.local_addr();
    let a = TcpStore::connect_with_secret(addr, SHORT, Some(secret.clone())).unwrap();
    let b = TcpStore::connect_with_secret(addr, SHORT, Some(secret.clone())).unwrap();
    check_store(&a, &b);
    let store = TcpStore::connect_with_secret(addr, Duration::from_secs(60), Some(secret)).unwrap();
    store.set("k", b"v").unwrap();
    let keys = store.num_keys().unwrap();
    let clients = server.connections();

    // A silent stranger holds a connection; nobody waits for it.
    let silent = TcpStream::connect(addr).unwrap();

    // A cohort client without the secret is told what it lacks, at once
    // (its timeout is a minute).
    let started = Instant::now();
    let err = TcpStore::connect(addr, Duration::from_secs(60)).unwrap_err();
    assert!(matches!(err, StoreError::Protocol { .. }), "{err:?}");
    assert!(err.to_string().contains(SECRET_ENV), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );

    // With another job's secret: the server's proof fails on the client.
    let other = Secret::generate().unwrap();
    let err =
        TcpStore::connect_with_secret(addr, Duration::from_secs(60), Some(other)).unwrap_err();
    assert!(
        matches!(&err, StoreError::Auth { source, .. }
            if matches!(**source, AuthError::WrongProof { peer: "server" })),
        "{err:?}"
    );
    assert!(err.to_string().contains(SECRET_ENV), "{err}");

    // Well-formed requests without a handshake change nothing.
    let mut raw = Request::Hello {
        magic: MAGIC,
        version: VERSION,
    }
    .encode();
    raw.extend(
        Request::Set {
            key: "k",
            value: b"stranger",
        }
        .encode(),
    );
    raw.extend(Request::NumKeys.encode());
    assert!(refusal(&raw_exchange(addr, &raw)).contains(SECRET_ENV));

    // A forged proof: opens the handshake, echoes the server's MAC.
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut opening = b"COHAUTH1".to_vec();
    opening.extend([1u8; 32]);
    s.write_all(&opening).unwrap();
    let mut answer = [0u8; 64];
    s.read_exact(&mut answer).unwrap();
    s.write_all(&answer[32..]).unwrap();
    let _ = s.write_all(&raw);
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(
        rest.is_empty(),
        "a forger got {} bytes of answer",
        rest.len()
    );

    assert_eq!(store.get("k").unwrap(), b"v");
    assert_eq!(store.num_keys().unwrap(), keys);
    drop(silent);
    settles_to(&server, clients);
}

#[test]
fn a_client_with_a_secret_will_not_talk_to_a_server_without_one() {
    let server = server();
    let started = Instant::now();
    let err = TcpStore::connect_with_secret(
        server.local_addr(),
        Duration::from_secs(60),
        Some(Secret::generate().unwrap()),
    )
    .unwrap_err();
    assert!(matches!(err, StoreError::Protocol { .. }), "{err:?}");
    assert!(err.to_string().contains("handshake"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

/// Deterministic pseudo-random bytes (xorshift64).
struct Noise(u64);

impl Noise {
    fn byte(&mut self) -> u8 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 24) as u8
    }

    fn below(&mut self, n: usize) -> usize {
        (u32::from_le_bytes([self.byte(), self.byte(), self.byte(), self.byte()]) as usize) % n
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.byte()).collect()
    }
}

/// One hostile input: garbage, a frame with a lying or huge length, a
/// valid request cut short, or a valid request with bytes flipped.
fn hostile(noise: &mut Noise) -> Vec<u8> {
    let hello = Request::Hello {
        magic: MAGIC,
        version: VERSION,
    }
    .encode();
    let valid = [
        Request::Set {
            key: "fuzz",
            value: b"value",
        }
        .encode(),
        Request::Wait {
            keys: vec!["a", "b"],
            timeout: Duration::from_millis(1),
        }
        .encode(),
        Request::CompareSet {
            key: "c",
            expected: b"",
            desired: b"d",
        }
        .encode(),
        Request::Add { key: "n", delta: 1 }.encode(),
    ];
    let request = &valid[noise.below(valid.len())];
    let mut input = if noise.below(2) == 0 {
        hello
    } else {
        Vec::new()
    };
    match noise.below(5) {
        0 => {
            let n = noise.below(300);
            input.extend(noise.bytes(n));
        }
        1 => {
            // Oversized or absurd length headers, then a little data.
            let len = [u32::MAX, MAX_FRAME_LEN as u32 + 1, 1 << 30, 0][noise.below(4)];
            input.extend(len.to_le_bytes());
            let n = noise.below(64);
            input.extend(noise.bytes(n));
        }
        2 => {
            let cut = noise.below(request.len());
            input.extend(&request[..cut]);
        }
        3 => {
            let mut r = request.clone();
            for _ in 0..1 + noise.below(4) {
                let at = noise.below(r.len());
                r[at] = noise.byte();
            }
            input.extend(r);
        }
        _ => {
            // A body that claims a length far past itself.
            let n = noise.below(32);
            let body = noise.bytes(n);
            input.extend((body.len() as u32 + 1 + noise.below(1 << 20) as u32).to_le_bytes());
            input.extend(body);
        }
    }
    input
}

/// Sends `input` and hangs up; a refusal is fine, a hang is not.
fn throw_at(addr: SocketAddr, input: &[u8], secret: Option<&Secret>) {
    let mut s = match secret {
        Some(secret) => authenticated_raw(addr, secret),
        None => TcpStream::connect(addr).unwrap(),
    };
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let _ = s.write_all(input);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut sink = Vec::new();
    let _ = s.read_to_end(&mut sink);
}

#[test]
fn fuzzed_frames_never_take_the_server_down_with_or_without_a_secret() {
    // Strangers only; clients that passed the handshake but send
    // garbage; anyone, on a server without a secret.
    let (guarded, secret) = secret_server();
    let (insiders, insider_secret) = secret_server();
    let open = TcpStoreServer::bind("127.0.0.1:0").unwrap();
    let timeout = Duration::from_secs(10);
    let clients = [
        TcpStore::connect_with_secret(guarded.local_addr(), timeout, Some(secret.clone())),
        TcpStore::connect_with_secret(insiders.local_addr(), timeout, Some(insider_secret.clone())),
        TcpStore::connect(open.local_addr(), timeout),
    ]
    .map(Result::unwrap);
    let mut noise = Noise(0x853c_49e6_748f_ea9b);
    for i in 0..120 {
        let input = hostile(&mut noise);
        throw_at(guarded.local_addr(), &input, None);
        throw_at(insiders.local_addr(), &input, Some(&insider_secret));
        throw_at(open.local_addr(), &input, None);
        if i % 20 == 0 {
            for c in &clients {
                c.set("alive", i.to_string().as_bytes()).unwrap();
                assert_eq!(c.get("alive").unwrap(), i.to_string().as_bytes());
            }
        }
    }
    for server in [&guarded, &insiders, &open] {
        settles_to(server, 1);
    }
    // No stranger got a key in; the real clients kept being served.
    assert_eq!(clients[0].num_keys().unwrap(), 1);
    for c in &clients {
        assert_eq!(c.get("alive").unwrap(), b"100");
    }
    let fresh = TcpStore::connect_with_secret(guarded.local_addr(), timeout, Some(secret)).unwrap();
    assert_eq!(fresh.add("n", 2).unwrap(), 2);
}

/// Whether the other end of `s` has hung up on it (without waiting).
fn hung_up_now(s: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut fd = libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: `fd` is one valid pollfd, exclusively borrowed for the call.
    let n = unsafe { libc::poll(&mut fd, 1, 0) };
    n > 0 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// A flood of strangers holds at most MAX_PENDING connections (each is hung up on as soon as
/// MAX_PENDING newer ones came, long before its handshake's deadline, so a missing or larger
/// cap fails here), a stranger trickling a byte now and then is dropped at the handshake's
/// deadline, and the job's own clients still get in at once.
#[test]
fn a_flood_of_strangers_is_bounded_and_the_job_still_gets_in() {
    use super::server::{AUTH_TIMEOUT, MAX_PENDING};
    let (server, secret) = secret_server();
    let addr = server.local_addr();
    // One at a time, each once the one MAX_PENDING before it is out: a burst would overflow
    // the listen backlog, and the kernel would then queue connections out of order. The
    // server's deadline for a stranger starts when it accepts it, after `at`: a hang-up seen
    // before `at + AUTH_TIMEOUT` can only be the cap's doing.
    let mut flood: Vec<(TcpStream, Instant)> = Vec::new();
    for i in 0..4 * MAX_PENDING {
        flood.push((TcpStream::connect(addr).unwrap(), Instant::now()));
        if let Some(old) = i.checked_sub(MAX_PENDING) {
            let (s, at) = &flood[old];
            while !hung_up_now(s) {
                assert!(
                    at.elapsed() < AUTH_TIMEOUT,
                    "stranger {old} is still held {MAX_PENDING} strangers later ({} connections open)",
                    server.connections()
                );
                thread::sleep(Duration::from_millis(1));
            }
        }
    }
    // The threads of those hung up on end as well (at once: their reads fail).
    let t = Instant::now();
    while server.connections() > MAX_PENDING {
        assert!(t.elapsed() < AUTH_TIMEOUT / 2, "{}", server.connections());
        thread::sleep(Duration::from_millis(5));
    }
    // Then a trickler (the newest, so no later stranger pushes it out): a well-formed
    // handshake one byte every 300 ms, each read well within any per-read timeout, too
    // slow to ever finish (about 70 bytes).
    let trickler = thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        let started = Instant::now();
        let mut bytes = b"COHAUTH1".iter().chain(std::iter::repeat(&0u8));
        while started.elapsed() < AUTH_TIMEOUT * 3 {
            if s.write_all(&[*bytes.next().unwrap()]).is_err() || hung_up_now(&s) {
                return Some(started.elapsed());
            }
            thread::sleep(Duration::from_millis(300));
        }
        None
    });
    // The job's own client gets in and is served at once.
    let t = Instant::now();
    let store = TcpStore::connect_with_secret(addr, Duration::from_secs(5), Some(secret)).unwrap();
    store.set("k", b"v").unwrap();
    assert_eq!(store.get("k").unwrap(), b"v");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // The trickler was dropped at the deadline of the whole handshake, not kept alive
    // byte by byte.
    let dropped = trickler.join().unwrap();
    assert!(
        dropped.is_some_and(|d| d >= AUTH_TIMEOUT / 2 && d < AUTH_TIMEOUT * 2),
        "{dropped:?}"
    );
    drop(flood);
}

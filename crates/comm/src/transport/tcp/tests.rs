use super::setup::*;
use super::*;
use crate::engine::{Header, OpDesc};
use crate::kinds::OpKind;
use crate::DType;
use cohort_rng::SplitMix64;
use cohort_store::HashStore;
use std::net::Ipv4Addr;
use std::sync::Arc;

#[test]
fn mesh_moves_bytes_between_every_pair_over_unix_sockets() {
    mesh_moves_bytes(Local::Unix, None);
}

#[test]
fn mesh_moves_bytes_between_every_pair_over_forced_tcp() {
    mesh_moves_bytes(Local::Tcp, None);
}

#[test]
fn authenticated_mesh_moves_bytes_over_unix_sockets_and_tcp() {
    let secret = Secret::generate().unwrap();
    mesh_moves_bytes(Local::Unix, Some(&secret));
    mesh_moves_bytes(Local::Tcp, Some(&secret));
}

fn mesh_moves_bytes(local: Local, secret: Option<&Secret>) {
    let store = Arc::new(HashStore::new());
    let n = 3;
    std::thread::scope(|s| {
        for rank in 0..n {
            let store = store.clone();
            s.spawn(move || {
                let t = TcpTransport::mesh(
                    &*store,
                    "g",
                    rank,
                    n,
                    Ipv4Addr::LOCALHOST.into(),
                    Duration::from_secs(10),
                    local,
                    secret,
                )
                .unwrap();
                let conns: Vec<&Conn> = t.collective.iter().chain(&t.p2p).flatten().collect();
                assert_eq!(conns.len(), 2 * (n - 1));
                for c in conns {
                    let unix = matches!(c, Conn::Unix(_));
                    assert_eq!(unix, local == Local::Unix, "rank {rank}: {c:?}");
                }
                for peer in (0..n).filter(|&p| p != rank) {
                    let msg = [rank as u8; 3];
                    assert_eq!(
                        t.try_write(Channel::P2p, peer, &[IoSlice::new(&msg)])
                            .unwrap(),
                        3
                    );
                }
                for peer in (0..n).filter(|&p| p != rank) {
                    let mut got = [0u8; 3];
                    let mut n_read = 0;
                    while n_read < 3 {
                        let i = Interest {
                            peer,
                            read: 1,
                            write: false,
                        };
                        t.wait(Channel::P2p, &[i], Duration::from_secs(5)).unwrap();
                        match t.try_read(Channel::P2p, peer, &mut got[n_read..]) {
                            Ok(k) => n_read += k,
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                            Err(e) => panic!("{e}"),
                        }
                    }
                    assert_eq!(got, [peer as u8; 3]);
                }
            });
        }
    });
}

#[test]
fn stray_connections_are_refused_and_the_mesh_still_forms() {
    let store = Arc::new(HashStore::new());
    std::thread::scope(|s| {
        let rank0 = s.spawn(|| {
            TcpTransport::connect(
                &*store,
                "g",
                0,
                2,
                Ipv4Addr::LOCALHOST.into(),
                Duration::from_secs(10),
            )
        });
        // Another job's process (or a scanner) reaches rank 0 first.
        store.wait(&["addr/0"], Duration::from_secs(10)).unwrap();
        let addr = String::from_utf8(store.get("addr/0").unwrap()).unwrap();
        let mut stray = TcpStream::connect(&addr).unwrap();
        stray.write_all(&[0x55; HELLO_BYTES]).unwrap();
        let mut ack = [0u8; 1];
        assert_eq!(
            stray.read(&mut ack).unwrap(),
            0,
            "a stray hello must be refused"
        );
        let rank1 = TcpTransport::connect(
            &*store,
            "g",
            1,
            2,
            Ipv4Addr::LOCALHOST.into(),
            Duration::from_secs(10),
        )
        .unwrap();
        let rank0 = rank0.join().unwrap().unwrap();
        assert_eq!(
            rank1
                .try_write(Channel::Collective, 0, &[IoSlice::new(b"x")])
                .unwrap(),
            1
        );
        let i = Interest {
            peer: 1,
            read: 1,
            write: false,
        };
        assert!(rank0
            .wait(Channel::Collective, &[i], Duration::from_secs(5))
            .unwrap());
    });
}

/// Where a stranger can reach rank 0 while it waits for rank 1.
struct Target {
    tcp: SocketAddr,
    unix: Option<String>,
    nonce: u64,
}

impl Target {
    /// Connections a stranger can open: TCP, and the abstract Unix
    /// socket when rank 0 listens on one.
    fn connectors(&self) -> Vec<Box<dyn Fn() -> Conn + '_>> {
        let tcp = move || {
            let s = TcpStream::connect(self.tcp).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
            Conn::Tcp(s)
        };
        let mut all: Vec<Box<dyn Fn() -> Conn + '_>> = vec![Box::new(tcp)];
        if let Some(name) = &self.unix {
            all.push(Box::new(move || {
                let a = UnixAddr::from_abstract_name(name.as_bytes()).unwrap();
                let s = UnixStream::connect_addr(&a).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
                Conn::Unix(s)
            }));
        }
        all
    }
}

/// Rank 0 of a 2-rank group with `secret` over `local`, with rank 1
/// held back until `intrude` has had its go at rank 0; returns once the
/// mesh moved a byte, with how long rank 0 took to form it.
fn mesh_despite(local: Local, secret: &Secret, intrude: impl FnOnce(&Target)) -> Duration {
    let store = Arc::new(HashStore::new());
    let bind = Ipv4Addr::LOCALHOST.into();
    let timeout = Duration::from_secs(20);
    std::thread::scope(|s| {
        let rank0 = s.spawn(|| {
            let started = Instant::now();
            let t = TcpTransport::mesh(&*store, "g", 0, 2, bind, timeout, local, Some(secret));
            (t, started.elapsed())
        });
        store.wait(&["addr/0", "unix/0"], timeout).unwrap();
        let key = |k| String::from_utf8(store.get(k).unwrap()).unwrap();
        intrude(&Target {
            tcp: key("addr/0").parse().unwrap(),
            unix: key("unix/0").split_once(' ').map(|(_, n)| n.to_string()),
            nonce: key("nonce").parse().unwrap(),
        });
        let rank1 =
            TcpTransport::mesh(&*store, "g", 1, 2, bind, timeout, local, Some(secret)).unwrap();
        let (rank0, took) = rank0.join().unwrap();
        let rank0 = rank0.unwrap();
        rank1
            .try_write(Channel::Collective, 0, &[IoSlice::new(b"x")])
            .unwrap();
        let i = Interest {
            peer: 1,
            read: 1,
            write: false,
        };
        assert!(rank0
            .wait(Channel::Collective, &[i], Duration::from_secs(5))
            .unwrap());
        let mut got = [0u8; 1];
        assert_eq!(rank0.try_read(Channel::Collective, 1, &mut got).unwrap(), 1);
        assert_eq!(&got, b"x");
        took
    })
}

/// Whether the listener hung up on us (EOF or reset) without a byte of
/// acceptance, as it must for anyone who does not know the secret.
fn hung_up_on(mut s: impl Read) -> bool {
    let mut seen = 0;
    let mut b = [0u8; 128];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return true,
            // The server's half of the handshake (64 bytes) is all a
            // stranger may ever read; an ack would be one more.
            Ok(n) if seen + n <= 64 => seen += n,
            other => panic!("unexpected answer to a stranger: {other:?}"),
        }
    }
}

fn random_bytes(rng: &mut SplitMix64, len: usize) -> Vec<u8> {
    (0..len).map(|_| rng.next_u64() as u8).collect()
}

#[test]
fn strangers_cannot_join_an_authenticated_mesh_over_tcp_or_unix() {
    for local in [Local::Tcp, Local::Unix] {
        let secret = Secret::generate().unwrap();
        let wrong = Secret::generate().unwrap();
        let mut silent = Vec::new();
        let took = mesh_despite(local, &secret, |target| {
            for connect in target.connectors() {
                // Connects and says nothing until the mesh has formed.
                silent.push(connect());
                // The hello of a rank without the secret, with the
                // group's nonce and all: no handshake, no entry.
                let mut s = connect();
                s.write_all(&hello(target.nonce, 1, 0, Channel::Collective))
                    .unwrap();
                assert!(hung_up_on(&mut s));
                // The wrong secret: the server's proof already fails
                // on the stranger's side.
                let mut s = connect();
                let err = authenticate_client(&mut s, &wrong, AUTH_SERVICE).unwrap_err();
                assert!(
                    matches!(err, AuthError::WrongProof { peer: "server" }),
                    "{err:?}"
                );
                // Opens the handshake, ignores the server's proof and
                // answers with a forged one, then a valid hello.
                let mut s = connect();
                let mut opening = b"COHAUTH1".to_vec();
                opening.extend([7u8; 32]);
                s.write_all(&opening).unwrap();
                let mut answer = [0u8; 64];
                s.read_exact(&mut answer).unwrap();
                s.write_all(&answer[32..]).unwrap();
                let _ = s.write_all(&hello(target.nonce, 1, 0, Channel::Collective));
                assert!(hung_up_on(&mut s));
                // Random bytes; 8 or more are refused at once (not the
                // magic), fewer are just dropped.
                let mut seed = SplitMix64::new(0x2545_f491_4f6c_dd1d);
                for len in [1usize, 7, 8, 40, 41, 72, 104, 300] {
                    let mut s = connect();
                    let _ = s.write_all(&random_bytes(&mut seed, len));
                    if len >= 8 {
                        assert!(hung_up_on(&mut s), "{len} random bytes");
                    }
                }
            }
        });
        drop(silent);
        // The silent strangers held up nobody (their handshakes run on
        // threads of their own; the hello timeout is 10 s).
        assert!(
            took < Duration::from_secs(5),
            "{local:?}: rank 0 took {took:?}"
        );
    }
}

#[test]
fn a_rank_with_another_secret_is_refused_naming_the_secret() {
    let store = Arc::new(HashStore::new());
    let bind = Ipv4Addr::LOCALHOST.into();
    let (ours, theirs) = (Secret::generate().unwrap(), Secret::generate().unwrap());
    std::thread::scope(|s| {
        let rank0 = s.spawn(|| {
            TcpTransport::mesh(
                &*store,
                "g",
                0,
                2,
                bind,
                Duration::from_millis(1500),
                Local::Unix,
                Some(&ours),
            )
        });
        let err = TcpTransport::mesh(
            &*store,
            "g",
            1,
            2,
            bind,
            Duration::from_secs(10),
            Local::Unix,
            Some(&theirs),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("rank 0") && err.contains("COHORT_SECRET"),
            "{err}"
        );
        let err = rank0.join().unwrap().unwrap_err().to_string();
        assert!(err.contains("ranks 1 never connected"), "{err}");
    });
}

/// Whether the other end of `s` has hung up on it (without waiting).
fn hung_up_now(s: &TcpStream) -> bool {
    let mut fds = [libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    }];
    poll(&mut fds, Duration::ZERO).unwrap();
    fds[0].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// Waits until rank 0 hangs up on `s`, which connected at `at`; fails once rank 0 could have
/// done so for the handshake's deadline (which starts at its accept, after `at`): a hang-up
/// seen before then can only be the waiting room's doing.
fn evicted(s: &TcpStream, at: Instant, what: &str) {
    while !hung_up_now(s) {
        assert!(
            at.elapsed() < HELLO_TIMEOUT,
            "{what} is still held after {:?}",
            at.elapsed()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A flood of four waiting rooms' worth of idle strangers at rank 0's listener, then a few
/// trickling a well-formed handshake one byte every 300 ms: each stranger is hung up on as
/// soon as a room's worth of newer ones came (long before any handshake deadline, so a
/// missing or larger cap fails here), each trickler is dropped at the deadline of its whole
/// handshake (never kept alive byte by byte), rank 1 gets in as if no one were there, and
/// rank 0 ends up holding none of them.
#[test]
fn a_flood_of_strangers_is_bounded_and_the_mesh_still_forms() {
    let secret = Secret::generate().unwrap();
    let mut flood: Vec<(TcpStream, Instant)> = Vec::new();
    let mut tricklers = Vec::new();
    let mut intruded = Duration::ZERO;
    let took = mesh_despite(Local::Tcp, &secret, |target| {
        let started = Instant::now();
        // One at a time, each once the one a room before it is out: a burst would overflow
        // the listen backlog, and the kernel would then queue connections out of order.
        for i in 0..4 * MAX_PENDING {
            flood.push((TcpStream::connect(target.tcp).unwrap(), Instant::now()));
            if let Some(old) = i.checked_sub(MAX_PENDING) {
                let what = format!("stranger {old}, {MAX_PENDING} strangers later,");
                evicted(&flood[old].0, flood[old].1, &what);
            }
        }
        for _ in 0..3 {
            let addr = target.tcp;
            tricklers.push(std::thread::spawn(move || {
                let mut s = TcpStream::connect(addr).unwrap();
                let since = Instant::now();
                let mut bytes = b"COHAUTH1".iter().chain(std::iter::repeat(&0u8));
                while since.elapsed() < HELLO_TIMEOUT * 3 {
                    if s.write_all(&[*bytes.next().unwrap()]).is_err() || hung_up_now(&s) {
                        return Some(since.elapsed());
                    }
                    std::thread::sleep(Duration::from_millis(300));
                }
                None
            }));
        }
        // The tricklers pushed out the three oldest left.
        for (old, (s, at)) in flood.iter().enumerate().skip(3 * MAX_PENDING).take(3) {
            evicted(s, *at, &format!("stranger {old}, with the tricklers in,"));
        }
        let held = flood.iter().filter(|(s, _)| !hung_up_now(s)).count();
        assert_eq!(held, MAX_PENDING - 3);
        intruded = started.elapsed();
    });
    // Rank 1 got in at once, not after some stranger's deadline.
    assert!(
        took < intruded + HELLO_TIMEOUT / 2,
        "the mesh took {took:?}, {intruded:?} of it the flood"
    );
    for t in tricklers {
        let dropped = t.join().unwrap();
        assert!(
            dropped.is_some_and(|d| d >= HELLO_TIMEOUT / 2 && d < HELLO_TIMEOUT * 2),
            "a trickler was dropped after {dropped:?}, its handshake's deadline is {HELLO_TIMEOUT:?}"
        );
    }
    // The idle strangers left in the room met the same deadline: none is held.
    let started = Instant::now();
    while let Some(held) = flood.iter().position(|(s, _)| !hung_up_now(s)) {
        assert!(
            started.elapsed() < HELLO_TIMEOUT * 2,
            "stranger {held} is still held after the handshake deadline"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What a hostile (but admitted) rank 1 sends to rank 0.
enum Hostile {
    /// These bytes.
    Bytes(Channel, Vec<u8>),
    /// A frame header, then `payload` bytes of its payload.
    Frame(Channel, Header, usize),
}

/// Rank 0 of a real group runs `call` while rank 1 is a raw transport
/// sending `hostile`, then hanging up at once or (`hang_up` false) only
/// once rank 0 gave up; returns rank 0's error.
fn against_hostile_peer(
    hostile: Hostile,
    hang_up: bool,
    call: impl FnOnce(&crate::ProcessGroup) -> Result<(), CommError> + Send,
) -> CommError {
    let store = Arc::new(HashStore::new());
    let bind: IpAddr = Ipv4Addr::LOCALHOST.into();
    let timeout = Duration::from_secs(10);
    let opts = crate::GroupOptions {
        name: "g".into(),
        timeout,
        ..crate::GroupOptions::default()
    };
    std::thread::scope(|s| {
        let rank0 = s.spawn(|| {
            let t =
                TcpTransport::mesh(&*store, "g", 0, 2, bind, timeout, Local::Unix, None).unwrap();
            let backend = Box::new(crate::MeshBackend::new(Box::new(t)));
            let pg = crate::ProcessGroup::with_backend(backend, store.clone(), opts);
            let started = Instant::now();
            let err = call(&pg).expect_err("a hostile peer's bytes were accepted");
            assert!(started.elapsed() < timeout, "took {:?}", started.elapsed());
            err
        });
        let rank1 =
            TcpTransport::mesh(&*store, "g", 1, 2, bind, timeout, Local::Unix, None).unwrap();
        let (ch, bytes) = match hostile {
            Hostile::Bytes(ch, b) => (ch, b),
            Hostile::Frame(ch, h, payload) => {
                let mut b = h.encode().to_vec();
                b.resize(b.len() + payload, 0x42);
                (ch, b)
            }
        };
        let mut sent = 0;
        while sent < bytes.len() {
            match rank1.try_write(ch, 0, &[IoSlice::new(&bytes[sent..])]) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                // Rank 0 already gave up on us.
                Err(_) => break,
            }
        }
        if hang_up {
            drop(rank1);
        }
        rank0.join().unwrap()
    })
}

fn frame(kind: OpKind, dtype: DType, count: u64, root: u32, bytes: u64) -> Header {
    Header {
        desc: OpDesc {
            kind,
            seq: 0,
            dtype: Some(dtype),
            count,
            reduce: None,
            root,
            flags: 0,
        },
        bytes,
    }
}

#[test]
fn a_hostile_peer_gets_errors_naming_it_never_a_crash_or_a_huge_allocation() {
    let names_rank_1 = |e: &CommError| {
        let t = e.to_string();
        assert!(t.contains("rank 1"), "{t}");
        t
    };
    let all_reduce = |pg: &crate::ProcessGroup| {
        let mut x = vec![1f32; 4096];
        pg.all_reduce(&mut x, crate::ReduceOp::Sum)
    };
    let recv = |pg: &crate::ProcessGroup| {
        let mut x = vec![0f32; 16];
        pg.recv(&mut x, 1, 7)
    };
    let mut seed = SplitMix64::new(1);

    // Garbage where a collective's frame header should be.
    let mut junk = random_bytes(&mut seed, 256);
    junk[0] = 0x11;
    let e = against_hostile_peer(Hostile::Bytes(Channel::Collective, junk), false, all_reduce);
    assert!(
        names_rank_1(&e).contains("not a cohort frame header"),
        "{e}"
    );

    // A header claiming a petabyte for the op rank 0 is running.
    let huge = frame(OpKind::AllReduce, DType::F32, 4096, 0, 1 << 50);
    let e = against_hostile_peer(
        Hostile::Frame(Channel::Collective, huge, 0),
        false,
        all_reduce,
    );
    assert!(matches!(e, CommError::Mismatch { peer: 1, .. }), "{e}");

    // A header cut short, then a hang-up.
    let cut = frame(OpKind::AllReduce, DType::F32, 4096, 0, 16384).encode()[..10].to_vec();
    let e = against_hostile_peer(Hostile::Bytes(Channel::Collective, cut), true, all_reduce);
    names_rank_1(&e);

    // Point-to-point: a frame for another tag claiming a length its
    // count and type deny; then one whose (huge) claim is consistent
    // but whose bytes never come: buffered only as they arrive.
    let lying = frame(OpKind::Send, DType::F32, 4, 8, 1 << 50);
    let e = against_hostile_peer(Hostile::Frame(Channel::P2p, lying, 0), false, recv);
    assert!(names_rank_1(&e).contains("claiming"), "{e}");
    let vast = frame(OpKind::Send, DType::F32, 1 << 40, 8, 4 << 40);
    let e = against_hostile_peer(Hostile::Frame(Channel::P2p, vast, 3000), true, recv);
    names_rank_1(&e);

    // Random bytes of many lengths on both channels: an error naming
    // rank 1 every time.
    for len in [1usize, 31, 32, 33, 100, 5000] {
        for ch in [Channel::Collective, Channel::P2p] {
            let bytes = random_bytes(&mut seed, len);
            let call = |pg: &crate::ProcessGroup| match ch {
                Channel::Collective => all_reduce(pg),
                Channel::P2p => recv(pg),
            };
            names_rank_1(&against_hostile_peer(Hostile::Bytes(ch, bytes), true, call));
        }
    }
}

#[test]
fn missing_rank_times_out_naming_it() {
    let store = HashStore::new();
    let err = TcpTransport::connect(
        &store,
        "g",
        0,
        2,
        Ipv4Addr::LOCALHOST.into(),
        Duration::from_millis(200),
    )
    .unwrap_err();
    assert!(err.to_string().contains("ranks 1 never connected"), "{err}");
}

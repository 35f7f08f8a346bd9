//! The job secret and the handshake with which every cohort socket (the
//! store, the collective mesh, RPC) makes a peer prove that it knows it
//! before trusting a byte it sends.
//!
//! A [`Secret`] is 32 random bytes, written as 64 hex characters in
//! `COHORT_SECRET` ([`SECRET_ENV`]). The launcher makes one per job from the
//! OS random generator and hands it to its workers through that variable.
//!
//! The handshake is a mutual challenge-response over any byte stream. With
//! `K` the secret, `svc` a label naming the service (so that a proof made for
//! one protocol is worthless on another), `cn` and `sn` fresh 32-byte random
//! nonces of the client and the server:
//!
//! ```text
//! client -> server   MAGIC (8 bytes) || cn
//! server -> client   sn || HMAC-SHA256(K, "server" || svc || cn || sn)
//! client -> server   HMAC-SHA256(K, "client" || svc || cn || sn)
//! ```
//!
//! Each side checks the other's MAC in constant time ([`Mac::verify_slice`])
//! and hangs up on a mismatch. The client checks the server first, so a
//! client never proves itself to an impostor; the role labels keep a
//! server's answer from ever passing as a client's. The client speaks
//! first, so a server without a secret (which reads `MAGIC` as an absurd
//! frame length) refuses at once instead of both sides waiting, and a
//! server with one recognises a client without one from its first 8 bytes.
//! Neither side learns anything about `K` from a failed attempt, and a
//! recorded exchange cannot be replayed (the other side's nonce is new).
//!
//! What it does not do: encrypt or sign the traffic that follows. It keeps
//! strangers from joining, reading or writing a job's sockets; an attacker
//! who can already rewrite packets between two hosts can hijack a
//! connection after the handshake (run multi-node jobs on a trusted network
//! or a VPN, as with any MPI or NCCL job).
//!
//! This module must never print, log or put in an error the secret or a
//! MAC, and never block longer than the timeouts the caller set on the
//! stream.

use std::fmt;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// The environment variable that carries the job secret to every process.
pub const SECRET_ENV: &str = "COHORT_SECRET";

/// Bytes of a secret (64 hex characters).
pub const SECRET_BYTES: usize = 32;

/// What a client sends first. As a store frame length its first four bytes
/// read as over a gigabyte, so a store server without a secret refuses it
/// at once.
const MAGIC: &[u8; 8] = b"COHAUTH1";
const NONCE_BYTES: usize = 32;
const MAC_BYTES: usize = 32;

/// The job secret: 32 bytes every process of a job shares, and nothing else.
///
/// Its `Debug` output is redacted, and it is wiped from memory when dropped.
#[derive(Clone)]
pub struct Secret([u8; SECRET_BYTES]);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        for b in &mut self.0 {
            // safety: `b` is a valid, exclusively borrowed byte; the volatile
            // write keeps the compiler from dropping a store to dead memory.
            unsafe { std::ptr::write_volatile(b, 0) };
        }
    }
}

impl Secret {
    /// A fresh secret from the operating system's random generator.
    pub fn generate() -> Result<Secret, AuthError> {
        let mut bytes = [0u8; SECRET_BYTES];
        random(&mut bytes)?;
        Ok(Secret(bytes))
    }

    /// Parses 64 hex characters (either case; surrounding whitespace, such
    /// as a file's final newline, is ignored). `origin` names where the text
    /// came from, for the error; the text itself never appears in it.
    pub fn from_hex(text: &str, origin: &str) -> Result<Secret, AuthError> {
        let bad = |detail: String| AuthError::BadSecret {
            origin: origin.to_string(),
            detail,
        };
        let text = text.trim().as_bytes();
        if text.len() != 2 * SECRET_BYTES {
            return Err(bad(format!(
                "{} characters, expected {} hex characters",
                text.len(),
                2 * SECRET_BYTES
            )));
        }
        let mut bytes = [0u8; SECRET_BYTES];
        for (i, pair) in text.chunks_exact(2).enumerate() {
            let (Some(hi), Some(lo)) = (hex_digit(pair[0]), hex_digit(pair[1])) else {
                return Err(bad(format!(
                    "character {} or {} is not a hex digit",
                    2 * i + 1,
                    2 * i + 2
                )));
            };
            bytes[i] = hi << 4 | lo;
        }
        Ok(Secret(bytes))
    }

    /// Reads a secret written as 64 hex characters in the file at `path`.
    pub fn from_file(path: &Path) -> Result<Secret, AuthError> {
        let text = std::fs::read_to_string(path).map_err(|source| AuthError::SecretFile {
            path: path.to_path_buf(),
            source,
        })?;
        Secret::from_hex(&text, &path.display().to_string())
    }

    /// The secret in [`SECRET_ENV`], or `None` when it is unset or empty
    /// (then sockets run without authentication, as before secrets existed).
    pub fn from_env() -> Result<Option<Secret>, AuthError> {
        match std::env::var(SECRET_ENV) {
            Ok(v) if v.trim().is_empty() => Ok(None),
            Ok(v) => Secret::from_hex(&v, SECRET_ENV).map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(AuthError::BadSecret {
                origin: SECRET_ENV.to_string(),
                detail: "not valid UTF-8".to_string(),
            }),
        }
    }

    /// The 64 hex characters, to hand the secret to a child process through
    /// its environment ([`SECRET_ENV`]). Never print them or put them on a
    /// command line, where every user of the machine can read them.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// HMAC-SHA256 of the handshake transcript, as `role` sees it.
    fn proof(&self, role: &[u8], service: &[u8], cn: &[u8], sn: &[u8]) -> Hmac<Sha256> {
        let mut mac =
            <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0).expect("HMAC takes any key length");
        // Lengths first, so that no two (role, service) pairs read the same.
        for part in [role, service] {
            mac.update(&(part.len() as u32).to_le_bytes());
            mac.update(part);
        }
        mac.update(cn);
        mac.update(sn);
        mac
    }
}

/// `read_exact`, with a hang-up said in words.
fn read_all(stream: &mut impl Read, buf: &mut [u8]) -> Result<(), AuthError> {
    stream.read_exact(buf).map_err(|e| {
        AuthError::Io(if e.kind() == io::ErrorKind::UnexpectedEof {
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the peer hung up mid-handshake",
            )
        } else {
            e
        })
    })
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

fn random(buf: &mut [u8]) -> Result<(), AuthError> {
    getrandom::fill(buf).map_err(|e| AuthError::Random(e.to_string()))
}

/// Why a secret could not be had, or a handshake failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// A secret was malformed (the value itself is never shown).
    #[error("job secret from {origin}: {detail}")]
    BadSecret {
        /// Where it came from: a variable name, a flag or a path.
        origin: String,
        /// What was wrong with it.
        detail: String,
    },
    /// A secret file could not be read.
    #[error("job secret file {}: {source}", path.display())]
    SecretFile {
        /// The file.
        path: PathBuf,
        /// Why it could not be read.
        #[source]
        source: io::Error,
    },
    /// The operating system's random generator failed.
    #[error("cannot get random bytes from the operating system: {0}")]
    Random(String),
    /// The peer's first bytes were not a handshake: it has no secret, or it
    /// is not a cohort process at all.
    #[error("the peer did not authenticate (it has no job secret, or is not part of this job)")]
    NoHandshake,
    /// The peer's proof did not verify: it holds a different secret.
    #[error("the {peer}'s proof of the job secret is wrong (it belongs to another job, or {SECRET_ENV} differs)")]
    WrongProof {
        /// `"server"` or `"client"`: whose proof failed.
        peer: &'static str,
    },
    /// The connection failed, closed or timed out during the handshake.
    #[error("connection failed during authentication: {0}")]
    Io(#[source] io::Error),
}

/// Authenticates the server at the other end of `stream` and proves this
/// client's knowledge of `secret` to it. `service` must be the label the
/// server uses. The caller sets read and write timeouts on the stream
/// beforehand; on any error the connection must be dropped.
pub fn authenticate_client<S: Read + Write>(
    stream: &mut S,
    secret: &Secret,
    service: &[u8],
) -> Result<(), AuthError> {
    let mut hello = [0u8; MAGIC.len() + NONCE_BYTES];
    hello[..MAGIC.len()].copy_from_slice(MAGIC);
    random(&mut hello[MAGIC.len()..])?;
    let cn = &hello[MAGIC.len()..];
    stream.write_all(&hello).map_err(AuthError::Io)?;
    let mut answer = [0u8; NONCE_BYTES + MAC_BYTES];
    read_all(stream, &mut answer)?;
    let (sn, server_mac) = answer.split_at(NONCE_BYTES);
    secret
        .proof(b"server", service, cn, sn)
        .verify_slice(server_mac)
        .map_err(|_| AuthError::WrongProof { peer: "server" })?;
    let client_mac = secret.proof(b"client", service, cn, sn).finalize();
    stream
        .write_all(&client_mac.into_bytes())
        .map_err(AuthError::Io)
}

/// Checks that the client at the other end of `stream` knows `secret`, and
/// proves this server's knowledge of it. `service` names the protocol (the
/// client must use the same). The caller sets read and write timeouts on
/// the stream beforehand; on any error it must drop the connection.
///
/// Reads exactly the handshake's bytes, so whatever the client sent after
/// it stays in the stream for the protocol. When the client's first bytes
/// are not a handshake, fails with [`AuthError::NoHandshake`] after reading
/// only 8 of them, so a server may still answer in its own protocol.
pub fn authenticate_server<S: Read + Write>(
    stream: &mut S,
    secret: &Secret,
    service: &[u8],
) -> Result<(), AuthError> {
    let mut magic = [0u8; MAGIC.len()];
    read_all(stream, &mut magic)?;
    if &magic != MAGIC {
        return Err(AuthError::NoHandshake);
    }
    let mut cn = [0u8; NONCE_BYTES];
    read_all(stream, &mut cn)?;
    let mut answer = [0u8; NONCE_BYTES + MAC_BYTES];
    random(&mut answer[..NONCE_BYTES])?;
    let (sn, mac_out) = answer.split_at_mut(NONCE_BYTES);
    let server_mac = secret.proof(b"server", service, &cn, sn).finalize();
    mac_out.copy_from_slice(&server_mac.into_bytes());
    stream.write_all(&answer).map_err(AuthError::Io)?;
    let mut client_mac = [0u8; MAC_BYTES];
    read_all(stream, &mut client_mac)?;
    secret
        .proof(b"client", service, &cn, &answer[..NONCE_BYTES])
        .verify_slice(&client_mac)
        .map_err(|_| AuthError::WrongProof { peer: "client" })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;
    use std::thread;
    use std::time::Duration;

    fn secret(byte: u8) -> Secret {
        Secret([byte; SECRET_BYTES])
    }

    fn pair() -> (UnixStream, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        for s in [&a, &b] {
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        }
        (a, b)
    }

    /// Runs both sides; returns (client's result, server's result).
    fn handshake(
        client: Secret,
        server: Secret,
        c_service: &'static [u8],
        s_service: &'static [u8],
    ) -> (Result<(), AuthError>, Result<(), AuthError>) {
        let (mut c, mut s) = pair();
        let srv = thread::spawn(move || {
            let r = authenticate_server(&mut s, &server, s_service);
            drop(s);
            r
        });
        let rc = authenticate_client(&mut c, &client, c_service);
        drop(c);
        (rc, srv.join().unwrap())
    }

    #[test]
    fn the_same_secret_passes_both_ways_and_leaves_the_stream_in_step() {
        let (mut c, mut s) = pair();
        let srv = thread::spawn(move || {
            authenticate_server(&mut s, &secret(7), b"svc").unwrap();
            let mut after = [0u8; 5];
            s.read_exact(&mut after).unwrap();
            after
        });
        authenticate_client(&mut c, &secret(7), b"svc").unwrap();
        c.write_all(b"hello").unwrap();
        assert_eq!(&srv.join().unwrap(), b"hello");
    }

    #[test]
    fn a_different_secret_fails_at_the_client_before_it_proves_anything() {
        let (rc, rs) = handshake(secret(1), secret(2), b"svc", b"svc");
        assert!(
            matches!(rc, Err(AuthError::WrongProof { peer: "server" })),
            "{rc:?}"
        );
        // The client hung up instead of answering.
        assert!(matches!(rs, Err(AuthError::Io(_))), "{rs:?}");
    }

    #[test]
    fn a_proof_for_another_service_is_refused() {
        let (rc, _) = handshake(secret(1), secret(1), b"cohort-store", b"cohort-mesh");
        assert!(matches!(rc, Err(AuthError::WrongProof { .. })), "{rc:?}");
    }

    #[test]
    fn a_client_that_replays_the_servers_proof_is_refused() {
        // The client cannot compute the client proof, so it echoes back the
        // server's MAC (the only MAC it has): the role label must stop it.
        let (mut c, mut s) = pair();
        let srv = thread::spawn(move || authenticate_server(&mut s, &secret(3), b"svc"));
        let mut hello = MAGIC.to_vec();
        hello.extend([9u8; NONCE_BYTES]);
        c.write_all(&hello).unwrap();
        let mut answer = [0u8; NONCE_BYTES + MAC_BYTES];
        c.read_exact(&mut answer).unwrap();
        c.write_all(&answer[NONCE_BYTES..]).unwrap();
        let r = srv.join().unwrap();
        assert!(
            matches!(r, Err(AuthError::WrongProof { peer: "client" })),
            "{r:?}"
        );
    }

    #[test]
    fn a_peer_without_a_handshake_is_recognised_from_its_first_bytes() {
        let (mut c, mut s) = pair();
        // A store hello from a client that has no secret, then it waits.
        c.write_all(&[25, 0, 0, 0, 0, 0, 0, 0]).unwrap();
        let r = authenticate_server(&mut s, &secret(1), b"svc");
        assert!(matches!(r, Err(AuthError::NoHandshake)), "{r:?}");
    }

    #[test]
    fn a_silent_or_truncating_peer_is_an_io_error_within_the_timeout() {
        let (mut c, mut s) = pair();
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        c.write_all(&MAGIC[..]).unwrap();
        c.write_all(&[1, 2, 3]).unwrap();
        let r = authenticate_server(&mut s, &secret(1), b"svc");
        assert!(matches!(r, Err(AuthError::Io(_))), "{r:?}");
        drop(c);
        let (mut c, s) = pair();
        c.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let r = authenticate_client(&mut c, &secret(1), b"svc");
        assert!(matches!(r, Err(AuthError::Io(_))), "{r:?}");
        drop(s);
    }

    #[test]
    fn random_bytes_never_pass_and_never_panic() {
        // A deterministic stream: every length from 0 to 120 bytes, with
        // and without the right magic in front.
        let mut rng = cohort_rng::SplitMix64::new(1);
        let mut next = || rng.next_u64() as u8;
        for len in 0..120 {
            for with_magic in [false, true] {
                let mut bytes: Vec<u8> = (0..len).map(|_| next()).collect();
                if with_magic {
                    bytes.splice(0..0, MAGIC.iter().copied());
                }
                let mut stream = io::Cursor::new(bytes);
                let mut duplex = Duplex {
                    input: &mut stream,
                    output: Vec::new(),
                };
                assert!(authenticate_server(&mut duplex, &secret(5), b"svc").is_err());
            }
        }
    }

    /// Reads from a fixed input, collects what is written.
    struct Duplex<'a> {
        input: &'a mut io::Cursor<Vec<u8>>,
        output: Vec<u8>,
    }

    impl Read for Duplex<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.input.read(buf)
        }
    }

    impl Write for Duplex<'_> {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.output.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn secrets_parse_from_hex_and_never_show_their_value() {
        let hex = "00112233445566778899aabbccddeeff00112233445566778899AABBCCDDEEFF";
        let s = Secret::from_hex(&format!("{hex}\n"), "test").unwrap();
        assert_eq!(s.to_hex(), hex.to_ascii_lowercase());
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
        let short = Secret::from_hex("abcd", "COHORT_SECRET").unwrap_err();
        assert!(
            short.to_string().contains("COHORT_SECRET")
                && short.to_string().contains("4 characters"),
            "{short}"
        );
        let bad = format!("{}zz", &hex[..62]);
        let err = Secret::from_hex(&bad, "--secret").unwrap_err().to_string();
        assert!(
            err.contains("not a hex digit") && !err.contains(&hex[..62]),
            "{err}"
        );
    }

    #[test]
    fn generated_secrets_differ_and_read_back_from_a_file() {
        let (a, b) = (Secret::generate().unwrap(), Secret::generate().unwrap());
        assert_ne!(a.to_hex(), b.to_hex());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, format!("{}\n", a.to_hex())).unwrap();
        assert_eq!(Secret::from_file(&path).unwrap().to_hex(), a.to_hex());
        let missing = Secret::from_file(&dir.path().join("nope")).unwrap_err();
        assert!(missing.to_string().contains("nope"), "{missing}");
    }
}

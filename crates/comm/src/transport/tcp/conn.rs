//! One connection to a peer, TCP or Unix, as the data path uses it: non-blocking reads,
//! `sendmsg` writes that never raise SIGPIPE, readiness and shutdown.
//!
//! This module never opens or accepts a connection (that is `setup`).

use super::*;

/// One connection to a peer: TCP, or a Unix socket when both share a host.
#[derive(Debug)]
pub(super) enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Conn {
    pub(super) fn fd(&self) -> RawFd {
        match self {
            Conn::Tcp(s) => s.as_raw_fd(),
            Conn::Unix(s) => s.as_raw_fd(),
        }
    }

    pub(super) fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => (&*s).read(buf),
            Conn::Unix(s) => (&*s).read(buf),
        }
    }

    /// Who is at the other end, for logs: an address, or on a Unix socket
    /// the process and user (abstract sockets have no peer address).
    pub(super) fn peer(&self) -> String {
        match self {
            Conn::Tcp(s) => s
                .peer_addr()
                .map_or_else(|_| "an unknown TCP peer".to_string(), |a| a.to_string()),
            Conn::Unix(s) => {
                let mut cred = libc::ucred {
                    pid: 0,
                    uid: 0,
                    gid: 0,
                };
                let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
                // safety: fd is open; `cred` is a ucred and `len` its size,
                // as SO_PEERCRED expects.
                let r = unsafe {
                    libc::getsockopt(
                        s.as_raw_fd(),
                        libc::SOL_SOCKET,
                        libc::SO_PEERCRED,
                        (&mut cred as *mut libc::ucred).cast(),
                        &mut len,
                    )
                };
                if r == 0 {
                    format!("local process {} (uid {})", cred.pid, cred.uid)
                } else {
                    "an unknown local process".to_string()
                }
            }
        }
    }

    /// Another handle on the same socket (to hang up on it from elsewhere).
    pub(super) fn try_clone(&self) -> io::Result<Conn> {
        Ok(match self {
            Conn::Tcp(s) => Conn::Tcp(s.try_clone()?),
            Conn::Unix(s) => Conn::Unix(s.try_clone()?),
        })
    }

    pub(super) fn shutdown(&self) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.shutdown(Shutdown::Both),
            Conn::Unix(s) => s.shutdown(Shutdown::Both),
        }
    }

    /// Blocking with `timeout` (handshake) or non-blocking (`None`). TCP
    /// sockets get `TCP_NODELAY` from the start: the handshake's messages
    /// are small and back to back, and Nagle's algorithm would hold each
    /// second one for the peer's delayed ACK (40 ms).
    pub(super) fn set_blocking(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => {
                s.set_nodelay(true)?;
                s.set_nonblocking(timeout.is_none())?;
                s.set_read_timeout(timeout)?;
                s.set_write_timeout(timeout)
            }
            Conn::Unix(s) => {
                s.set_nonblocking(timeout.is_none())?;
                s.set_read_timeout(timeout)?;
                s.set_write_timeout(timeout)
            }
        }
    }
}

/// What a handshake's `Deadline` needs: the socket's own timeouts.
impl Timeouts for Conn {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.set_read_timeout(timeout),
            Conn::Unix(s) => s.set_read_timeout(timeout),
        }
    }

    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.set_write_timeout(timeout),
            Conn::Unix(s) => s.set_write_timeout(timeout),
        }
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        Conn::read(self, buf)
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.write(buf),
            Conn::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

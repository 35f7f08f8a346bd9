//! One client connection to the store server: connect (with the job-secret handshake when the
//! job has a secret), send a request, read its reply, each within a deadline. `TcpStore` keeps
//! a small pool of these and retries a request on a fresh one when a kept one went stale.
//!
//! This module never retries by itself and never outlives a deadline.

use super::*;

/// One greeted connection to the server.
pub(super) struct Connection {
    reader: BufReader<TcpStream>,
}

pub(super) enum OpenError {
    /// Worth retrying: nothing listens yet, or the connection broke.
    Io(io::Error),
    /// Something other than a store server answered.
    Protocol(String),
    /// The server failed the job-secret handshake.
    Auth(AuthError),
}

impl Connection {
    /// Connects within `connect_within`, proves `secret` when there is one,
    /// and greets the server; writes may block at most `io_timeout`.
    pub(super) fn open(
        addr: &SocketAddr,
        connect_within: Duration,
        io_timeout: Duration,
        secret: Option<&Secret>,
    ) -> Result<Connection, OpenError> {
        let stream = TcpStream::connect_timeout(addr, connect_within).map_err(OpenError::Io)?;
        // Retrying a local port that nothing listens on can connect the
        // socket to itself (TCP simultaneous open, when the kernel picks
        // that very port as ours): nobody is there yet.
        if stream.local_addr().ok() == Some(*addr) {
            return Err(OpenError::Io(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                "connected to itself: nothing listens there yet",
            )));
        }
        stream.set_nodelay(true).map_err(OpenError::Io)?;
        stream
            .set_write_timeout(Some(io_timeout.max(Duration::from_millis(1))))
            .map_err(OpenError::Io)?;
        if let Some(secret) = secret {
            stream
                .set_read_timeout(Some(connect_within.max(Duration::from_secs(1))))
                .map_err(OpenError::Io)?;
            match authenticate_client(&mut &stream, secret, AUTH_SERVICE) {
                Ok(()) => {}
                // A server that hangs up on a handshake has no secret (it
                // read the magic as an absurd frame length) or another
                // protocol: retrying cannot help.
                Err(AuthError::Io(e))
                    if matches!(
                        e.kind(),
                        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
                    ) =>
                {
                    return Err(OpenError::Protocol(format!(
                        "the server hung up on the job-secret handshake: it runs without \
                         {SECRET_ENV}, or it is not a cohort-store server"
                    )))
                }
                Err(AuthError::Io(e)) => return Err(OpenError::Io(e)),
                Err(e) => return Err(OpenError::Auth(e)),
            }
        }
        let mut conn = Connection {
            reader: BufReader::new(stream),
        };
        let hello = Request::Hello {
            magic: MAGIC,
            version: VERSION,
        }
        .encode();
        match conn.round_trip(&hello, connect_within.max(Duration::from_secs(1))) {
            Ok(Response::Hello(VERSION)) => Ok(conn),
            Ok(Response::Error(detail)) => Err(OpenError::Protocol(format!(
                "the server refused this client: {detail}"
            ))),
            Ok(other) => Err(OpenError::Protocol(format!(
                "not a cohort-store server (it answered hello with {other:?})"
            ))),
            Err(e) if e.kind() == io::ErrorKind::InvalidData => Err(OpenError::Protocol(format!(
                "not a cohort-store server ({e})"
            ))),
            Err(e) => Err(OpenError::Io(e)),
        }
    }

    /// Sends `frame` and reads the response, waiting at most `reply_within`.
    pub(super) fn round_trip(
        &mut self,
        frame: &[u8],
        reply_within: Duration,
    ) -> io::Result<Response> {
        let stream = self.reader.get_ref();
        stream.set_read_timeout(Some(reply_within.max(Duration::from_millis(1))))?;
        (&*stream).write_all(frame)?;
        let body = read_frame(&mut self.reader)?
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed"))?;
        Response::decode(&body).map_err(|detail| io::Error::new(io::ErrorKind::InvalidData, detail))
    }
}

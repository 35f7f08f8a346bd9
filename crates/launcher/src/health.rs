//! The agent's health-check endpoint (torchrun's
//! `TORCHELASTIC_HEALTH_CHECK_PORT`): a minimal HTTP/1.1 server on a thread
//! of its own that answers `GET /health` with the agent's state as one JSON
//! object, status 200 while the agent's heartbeats reach the rendezvous
//! store and 503 once they have not for the heartbeat timeout (a cluster
//! manager's liveness probe then restarts the node). It serves one short
//! request at a time, with read and write timeouts, and never reveals more
//! than the state below (no environment, no secret, no paths).

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Largest request head the endpoint reads; a probe's is a few dozen bytes.
const MAX_REQUEST: usize = 4096;

/// How long one client may take to send its request or read the answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(1);

/// How often the accept loop looks at its stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(20);

/// What the agent is doing, as the endpoint reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Connecting to the store and agreeing on the run id.
    Starting,
    /// Waiting for a round's nodes.
    Rendezvous,
    /// Workers are running.
    Running,
    /// Stopping workers after a failure, a lost node or a signal.
    Stopping,
    /// The job ended (success or not); the agent is leaving.
    Finished,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Starting => "starting",
            Phase::Rendezvous => "rendezvous",
            Phase::Running => "running",
            Phase::Stopping => "stopping",
            Phase::Finished => "finished",
        }
    }
}

struct State {
    phase: Phase,
    round: u32,
    restarts: u32,
    nodes: usize,
    world_size: usize,
    last_beat: Instant,
}

/// The agent's state, shared by the agent (writes), its heartbeat thread
/// (records beats) and the endpoint (reads).
pub(crate) struct AgentStatus {
    heartbeat_timeout: Duration,
    state: Mutex<State>,
}

impl AgentStatus {
    /// A starting agent; it counts as healthy for one heartbeat timeout
    /// before its first beat.
    pub fn new(heartbeat_timeout: Duration) -> Self {
        AgentStatus {
            heartbeat_timeout,
            state: Mutex::new(State {
                phase: Phase::Starting,
                round: 0,
                restarts: 0,
                nodes: 0,
                world_size: 0,
                last_beat: Instant::now(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state stays consistent even if a writer panicked mid-update:
        // every field is written whole.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records what the agent does now.
    pub fn set_phase(&self, phase: Phase) {
        self.lock().phase = phase;
    }

    /// Records the round the agent is in: its number, the failure restarts
    /// so far, its nodes and workers.
    pub fn set_round(&self, round: u32, restarts: u32, nodes: usize, world_size: usize) {
        let mut s = self.lock();
        s.round = round;
        s.restarts = restarts;
        s.nodes = nodes;
        s.world_size = world_size;
    }

    /// Records a heartbeat that reached the store.
    pub fn beat(&self) {
        self.lock().last_beat = Instant::now();
    }

    /// Whether the last heartbeat reached the store within the timeout.
    pub fn healthy(&self) -> bool {
        self.lock().last_beat.elapsed() <= self.heartbeat_timeout
    }

    fn json(&self) -> String {
        let s = self.lock();
        let age = s.last_beat.elapsed();
        format!(
            "{{\"healthy\":{},\"state\":\"{}\",\"round\":{},\"restarts\":{},\"nodes\":{},\
             \"world_size\":{},\"last_heartbeat_ms\":{}}}",
            age <= self.heartbeat_timeout,
            s.phase.name(),
            s.round,
            s.restarts,
            s.nodes,
            s.world_size,
            age.as_millis()
        )
    }
}

/// The endpoint's server thread; stops when dropped.
pub(crate) struct HealthServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HealthServer {
    /// Serves `status` on `port` of every interface (0: a free port), for
    /// probes that come from outside the machine.
    pub fn start(port: u16, status: Arc<AgentStatus>) -> io::Result<Self> {
        let listener = TcpListener::bind((Ipv4Addr::UNSPECIFIED, port))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = thread::Builder::new()
            .name("launcher health".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    match listener.accept() {
                        // A client that misbehaves only loses its own answer.
                        Ok((stream, _)) => drop(serve(stream, &status)),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            thread::sleep(ACCEPT_POLL)
                        }
                        Err(_) => thread::sleep(ACCEPT_POLL),
                    }
                }
            })?;
        Ok(HealthServer {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for HealthServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Answers one request on `stream`.
fn serve(mut stream: TcpStream, status: &AgentStatus) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
    let mut head = Vec::with_capacity(256);
    let mut buf = [0u8; 512];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() >= MAX_REQUEST {
            respond(&mut stream, 431, "Request Header Fields Too Large", "")?;
            // Read what the client still sends (bounded by the timeout), so
            // that closing does not reset the connection under its answer.
            stream.shutdown(std::net::Shutdown::Write)?;
            let _ = io::copy(&mut (&mut stream).take(1 << 20), &mut io::sink());
            return Ok(());
        }
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head
        .split(|&b| b == b'\r' || b == b'\n')
        .next()
        .unwrap_or(&[]);
    let line = String::from_utf8_lossy(line);
    let mut words = line.split(' ');
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    if method != "GET" {
        return respond(&mut stream, 405, "Method Not Allowed", "");
    }
    match path.split('?').next() {
        Some("/" | "/health") => {
            let (code, reason) = if status.healthy() {
                (200, "OK")
            } else {
                (503, "Service Unavailable")
            };
            respond(&mut stream, code, reason, &status.json())
        }
        _ => respond(&mut stream, 404, "Not Found", ""),
    }
}

fn respond(stream: &mut TcpStream, code: u16, reason: &str, body: &str) -> io::Result<()> {
    let kind = if body.is_empty() {
        "text/plain"
    } else {
        "application/json"
    };
    write!(
        stream,
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(addr: SocketAddr, request: &str) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", addr.port())).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        answer
    }

    #[test]
    fn the_endpoint_reports_the_state_and_turns_503_without_heartbeats() {
        let status = Arc::new(AgentStatus::new(Duration::from_millis(200)));
        status.set_phase(Phase::Running);
        status.set_round(3, 1, 2, 4);
        let server = HealthServer::start(0, status.clone()).unwrap();
        let addr = server.local_addr();
        let ok = get(addr, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(
            ok.contains(
                "\"healthy\":true,\"state\":\"running\",\"round\":3,\"restarts\":1,\"nodes\":2,\
                 \"world_size\":4"
            ),
            "{ok}"
        );
        thread::sleep(Duration::from_millis(250));
        let stale = get(addr, "GET / HTTP/1.0\r\n\r\n");
        assert!(stale.starts_with("HTTP/1.1 503 "), "{stale}");
        assert!(stale.contains("\"healthy\":false"), "{stale}");
        status.beat();
        assert!(get(addr, "GET /health HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 200 "));
    }

    #[test]
    fn bad_requests_get_errors_and_the_server_keeps_serving() {
        let status = Arc::new(AgentStatus::new(Duration::from_secs(5)));
        let server = HealthServer::start(0, status).unwrap();
        let addr = server.local_addr();
        assert!(get(addr, "GET /secrets HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404 "));
        assert!(get(addr, "POST /health HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405 "));
        let huge = format!("GET /health HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(10_000));
        assert!(get(addr, &huge).starts_with("HTTP/1.1 431 "));
        // A client that connects and says nothing is dropped after its timeout.
        let _silent = TcpStream::connect(("127.0.0.1", addr.port())).unwrap();
        assert!(get(addr, "GET /health HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 200 "));
    }
}

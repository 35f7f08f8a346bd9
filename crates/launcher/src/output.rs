//! Forwarding of the workers' output: each line a worker writes is copied to
//! the launcher's stdout or stderr behind a `[rank1]: ` prefix, in one write,
//! so lines of different workers never mix mid-line; the last lines of each
//! worker are kept for the failure report. A forwarder never stops draining
//! its pipe (a worker blocked on a full pipe would hang the job), even when
//! the launcher's own output is closed. The launcher's own notes ([`note`])
//! go to stderr from here too.

use std::collections::VecDeque;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

/// Lines of each worker kept for its failure report.
pub(crate) const TAIL_LINES: usize = 20;

/// A line longer than this is forwarded in pieces, so that a worker that
/// never writes a newline cannot make the launcher buffer without bound.
const MAX_LINE: usize = 64 * 1024;

/// Which of the launcher's streams a worker stream goes to.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Sink {
    Stdout,
    Stderr,
}

/// The last lines of one worker (both streams) and how many of its streams
/// are still open.
pub(crate) struct Tail {
    state: Mutex<TailState>,
    closed: Condvar,
}

struct TailState {
    lines: VecDeque<String>,
    open_streams: usize,
}

impl Tail {
    pub fn new(open_streams: usize) -> Arc<Self> {
        Arc::new(Tail {
            state: Mutex::new(TailState {
                lines: VecDeque::with_capacity(TAIL_LINES),
                open_streams,
            }),
            closed: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, TailState> {
        // Every update is a push or a counter change: a panic cannot leave it torn.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(&self, line: String) {
        let mut state = self.lock();
        if state.lines.len() == TAIL_LINES {
            state.lines.pop_front();
        }
        state.lines.push_back(line);
    }

    fn close_stream(&self) {
        self.lock().open_streams -= 1;
        self.closed.notify_all();
    }

    /// Waits until every stream reached end of file or `timeout` passed; a
    /// worker's children may keep its pipes open long after it exited.
    pub fn wait_closed(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut state = self.lock();
        while state.open_streams > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            state = self
                .closed
                .wait_timeout(state, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// The kept lines, oldest first.
    pub fn lines(&self) -> Vec<String> {
        self.lock().lines.iter().cloned().collect()
    }
}

/// Starts a thread that copies `from` line by line to `sink`, each line
/// behind `prefix`, and keeps the last lines in `tail`.
pub(crate) fn forward(
    from: impl Read + Send + 'static,
    prefix: String,
    sink: Sink,
    tail: Arc<Tail>,
) -> io::Result<()> {
    thread::Builder::new()
        .name(format!("forward {prefix}"))
        .spawn(move || {
            // The launcher's stdout may be a closed pipe (`cohort run ... | head`);
            // the worker must still be drained, so write errors are dropped.
            copy_lines(BufReader::new(from), prefix.as_bytes(), &tail, |line| {
                let _ = match sink {
                    Sink::Stdout => io::stdout().lock().write_all(line),
                    Sink::Stderr => io::stderr().lock().write_all(line),
                };
            });
            tail.close_stream();
        })
        .map(drop)
}

/// Copies `from` to `write`, one call per prefixed, newline-ended line.
fn copy_lines(mut from: impl BufRead, prefix: &[u8], tail: &Tail, mut write: impl FnMut(&[u8])) {
    let mut line = Vec::with_capacity(256);
    loop {
        line.clear();
        line.extend_from_slice(prefix);
        let body_start = line.len();
        // A read error on a pipe means the worker is gone: same as end of file.
        let ended = read_line(&mut from, &mut line).unwrap_or(true);
        if line.len() == body_start {
            return;
        }
        if line.last() != Some(&b'\n') {
            line.push(b'\n');
        }
        tail.push(String::from_utf8_lossy(&line[body_start..line.len() - 1]).into_owned());
        write(&line);
        if ended {
            return;
        }
    }
}

/// Appends bytes up to and including the next newline (or [`MAX_LINE`]
/// bytes) to `line`; returns whether the stream ended.
fn read_line(from: &mut impl BufRead, line: &mut Vec<u8>) -> io::Result<bool> {
    let mut taken = 0;
    loop {
        let buf = match from.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok(true);
        }
        let room = MAX_LINE - taken;
        let (n, done) = match buf.iter().take(room).position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len().min(room), buf.len() >= room),
        };
        line.extend_from_slice(&buf[..n]);
        from.consume(n);
        taken += n;
        if done {
            return Ok(false);
        }
    }
}

/// The launcher's own messages, on stderr, prefixed so that they stand apart from the workers'.
pub(crate) fn note(message: &str) {
    let _ = writeln!(std::io::stderr().lock(), "cohort run: {message}");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines_of(input: &[u8]) -> Vec<Vec<u8>> {
        let mut from = BufReader::with_capacity(7, input);
        let mut out = Vec::new();
        loop {
            let mut line = Vec::new();
            let ended = read_line(&mut from, &mut line).unwrap();
            if !line.is_empty() {
                out.push(line);
            }
            if ended {
                return out;
            }
        }
    }

    #[test]
    fn lines_are_split_at_newlines_across_buffer_refills() {
        assert_eq!(
            lines_of(b"first line\nsecond\n\nlast without newline"),
            vec![
                b"first line\n".to_vec(),
                b"second\n".to_vec(),
                b"\n".to_vec(),
                b"last without newline".to_vec()
            ]
        );
        assert!(lines_of(b"").is_empty());
    }

    #[test]
    fn an_endless_line_is_cut_into_bounded_pieces() {
        let input = vec![b'x'; MAX_LINE * 2 + 5];
        let pieces = lines_of(&input);
        assert_eq!(
            pieces.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![MAX_LINE, MAX_LINE, 5]
        );
    }

    #[test]
    fn the_tail_keeps_the_last_lines_and_reports_closing() {
        let tail = Tail::new(1);
        let input: String = (0..30).map(|i| format!("line {i}\n")).collect();
        let mut out = Vec::new();
        copy_lines(input.as_bytes(), b"[rank3]: ", &tail, |l| {
            out.push(l.to_vec())
        });
        tail.close_stream();
        assert_eq!(out.len(), 30);
        assert_eq!(out[29], b"[rank3]: line 29\n");
        tail.wait_closed(Duration::ZERO);
        let lines = tail.lines();
        assert_eq!(lines.len(), TAIL_LINES);
        assert_eq!(lines[0], "line 10");
        assert_eq!(lines[TAIL_LINES - 1], "line 29");
    }
}

//! The agent's background threads: a reader per connection (frames in; replies complete
//! calls, requests go to the handler pool), the control writer (acknowledgements, releases,
//! goodbyes, in order) and the reaper (calls past their deadline fail).
//!
//! A reader never writes to a socket, so two workers flooding each other cannot deadlock.

use super::*;

impl Inner {
    pub(super) fn read_loop(self: Arc<Self>, peer: usize, stream: TcpStream) {
        let mut r = BufReader::with_capacity(1 << 16, stream);
        loop {
            match read_frame(&mut r, self.opts.max_message_bytes) {
                Ok((header, payload)) => match header {
                    Header::Call {
                        id,
                        func,
                        types,
                        rref,
                    } => self.serve_call(peer, id, func, types, rref, payload),
                    Header::Reply { id, status } => self.complete_status(id, status, payload),
                    Header::Fetch { id, rref, ty } => self.serve_fetch(peer, id, rref, ty),
                    Header::Fork { id, rref } => self.serve_fork(peer, id, rref),
                    Header::Release { rref } => self.on_release(rref),
                    Header::Goodbye => {
                        self.peer_gone(peer, "it shut down".into(), true);
                        break;
                    }
                },
                Err(e) => {
                    if !self.closing.load(Ordering::Acquire) {
                        let why = match e {
                            ReadError::Io(e) if e.kind() == ErrorKind::UnexpectedEof => {
                                "its connection closed (the process exited or was killed)"
                                    .to_string()
                            }
                            ReadError::Io(e) => format!("reading from it failed: {e}"),
                            ReadError::Malformed(m) => {
                                let _ = self.peers[peer]
                                    .as_ref()
                                    .map(|p| p.stream.shutdown(Shutdown::Both));
                                format!("it sent a malformed frame ({m}); connection dropped")
                            }
                        };
                        self.peer_gone(peer, why, false);
                    }
                    break;
                }
            }
        }
        *lock(&self.readers_live) -= 1;
        self.readers_cv.notify_all();
    }

    pub(super) fn control_loop(&self, rx: mpsc::Receiver<Control>) {
        while let Ok(Control::Frame(peer, header)) = rx.recv() {
            let Some(p) = self.peers[peer].as_ref() else {
                continue;
            };
            // A dead peer is already handled by its reader.
            let _ = write_frame(&mut *lock(&p.writer), &header, &[]);
        }
    }

    pub(super) fn reap_loop(&self) {
        let mut calls = lock(&self.calls);
        loop {
            if calls.stop {
                return;
            }
            let now = Instant::now();
            let expired: Vec<u64> = calls
                .map
                .iter()
                .filter(|(_, p)| p.deadline <= now)
                .map(|(id, _)| *id)
                .collect();
            if !expired.is_empty() {
                drop(calls);
                for id in expired {
                    self.complete(id, |p| {
                        Err(RpcError::Timeout {
                            worker: self.name_of(p.peer),
                            func: p.func.clone(),
                            timeout: p.timeout,
                        })
                    });
                }
                calls = lock(&self.calls);
                continue;
            }
            let next = calls.map.values().map(|p| p.deadline).min();
            calls.reaper_wakes = next;
            let wait = next.map_or(Duration::from_secs(3600), |t| t - now);
            calls = self
                .reaper_cv
                .wait_timeout(calls, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    // ----------------------------------------------------------- shutdown
}

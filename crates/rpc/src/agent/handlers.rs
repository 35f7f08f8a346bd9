//! The calls this worker serves: the handler pool runs registered functions and writes their
//! replies; fetches and forks of the references this worker owns are answered here too.
//!
//! A handler never runs on a reader thread.

use super::*;

impl Inner {
    /// Serves a call (from a reader, or from this worker to itself): the
    /// reference's entry exists before this returns, the handler runs on
    /// the pool.
    pub(super) fn serve_call(
        self: &Arc<Self>,
        from: usize,
        id: u64,
        func: String,
        types: u64,
        rref: Option<RRefId>,
        payload: Vec<u8>,
    ) {
        let cell = rref.map(|rid| {
            let cell = Arc::new(Cell::default());
            self.owned().insert(
                rid,
                Owned {
                    users: 1,
                    cell: cell.clone(),
                },
            );
            cell
        });
        let me = self.clone();
        self.submit(Box::new(move || {
            let (status, bytes) = me.run_handler(from, &func, types, &payload, cell.as_deref());
            me.respond(from, id, status, bytes);
        }));
    }

    /// Runs `func`, returning the reply's status and payload; with `cell`,
    /// the result is kept there (or the failure, for later fetches).
    pub(super) fn run_handler(
        self: &Arc<Self>,
        from: usize,
        func: &str,
        types: u64,
        payload: &[u8],
        cell: Option<&Cell>,
    ) -> (Status, Vec<u8>) {
        let outcome = match self.registry.handlers.get(func) {
            None => Err(Status::Unknown(self.registry.names())),
            Some(h) if h.types != types => Err(Status::Types(h.signature.clone())),
            Some(h) => {
                let ctx = CallContext {
                    caller: self.workers[from].clone(),
                    rpc: Rpc {
                        inner: self.clone(),
                    },
                };
                with_agent(self.clone(), || h.call(&ctx, payload)).map_err(|f| match f {
                    Failure::Decode(detail) => Status::Codec {
                        op: "decode".into(),
                        detail,
                    },
                    Failure::Handler(m) => Status::Handler(m),
                })
            }
        };
        match (outcome, cell) {
            (Ok(value), None) => match with_agent(self.clone(), || value.encode()) {
                Ok(bytes) => (Status::Ok, bytes),
                Err(detail) => (
                    Status::Codec {
                        op: "encode".into(),
                        detail,
                    },
                    Vec::new(),
                ),
            },
            (Ok(value), Some(cell)) => {
                cell.set(Ok(value));
                (Status::Ok, Vec::new())
            }
            (Err(status), cell) => {
                if let Some(cell) = cell {
                    let kept = match &status {
                        Status::Handler(m) => Status::Handler(format!("creating the value: {m}")),
                        other => other.clone(),
                    };
                    cell.set(Err(kept));
                }
                (status, Vec::new())
            }
        }
    }

    pub(super) fn respond(&self, to: usize, id: u64, status: Status, payload: Vec<u8>) {
        if to == self.me {
            self.complete_status(id, status, payload);
            return;
        }
        let peer = self.peers[to].as_ref().expect("not this worker");
        // A caller that died gets no answer; its own side already failed.
        let _ = write_frame(
            &mut *lock(&peer.writer),
            &Header::Reply { id, status },
            &payload,
        );
    }

    /// Serves a fetch on the pool: waits for the value, encodes it.
    pub(super) fn serve_fetch(self: &Arc<Self>, from: usize, id: u64, rref: RRefId, ty: u64) {
        let me = self.clone();
        self.submit(Box::new(move || {
            let (status, bytes) = match me.owned_cell(rref) {
                None => (
                    Status::RRef("no such value here (freed, or never created)".into()),
                    Vec::new(),
                ),
                Some(cell) => {
                    let encoded = cell.with(me.opts.timeout, |v| {
                        if v.ty != ty {
                            return Err(Status::Types(
                                "a value of another type than the caller's RRef<T>".into(),
                            ));
                        }
                        with_agent(me.clone(), || v.encode()).map_err(|detail| Status::Codec {
                            op: "encode".into(),
                            detail,
                        })
                    });
                    match encoded {
                        Ok(Ok(bytes)) => (Status::Ok, bytes),
                        Ok(Err(s)) | Err(s) => (s, Vec::new()),
                    }
                }
            };
            me.respond(from, id, status, bytes);
        }));
    }

    /// Counts a fork from `from` (on a reader: no handler involved) and
    /// acknowledges it through the control thread.
    pub(super) fn serve_fork(&self, from: usize, id: u64, rref: RRefId) {
        let status = match self.owned().get_mut(&rref) {
            Some(o) => {
                o.users += 1;
                Status::Ok
            }
            None => Status::RRef("the value is already freed".into()),
        };
        self.control(from, Header::Reply { id, status });
    }

    // ------------------------------------------------------------ threads

    pub(super) fn submit(&self, job: Box<dyn FnOnce() + Send>) {
        lock(&self.jobs).queue.push_back(job);
        self.jobs_cv.notify_one();
    }

    pub(super) fn pool_loop(&self) {
        loop {
            let job = {
                let mut jobs = lock(&self.jobs);
                loop {
                    if jobs.stop {
                        return;
                    }
                    if let Some(j) = jobs.queue.pop_front() {
                        break j;
                    }
                    jobs = self.jobs_cv.wait(jobs).unwrap_or_else(|p| p.into_inner());
                }
            };
            job();
        }
    }
}

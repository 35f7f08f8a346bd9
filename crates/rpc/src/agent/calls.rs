//! The pending-call table and the calls this worker makes: register a call before checking its
//! peer, complete each slot exactly once (reply, deadline or dead peer), fetches, forks and
//! releases of remote references, and the frames the control thread writes.
//!
//! Nothing here holds the table lock while completing a slot or dropping a user value.

use super::*;

impl Inner {
    /// Registers a call to `to` and returns its slot and id.
    pub(super) fn register(
        &self,
        to: usize,
        func: &str,
        types: fn() -> String,
        timeout: Duration,
    ) -> (u64, Arc<Slot>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let slot = Slot::new();
        let deadline = Instant::now() + timeout;
        let mut calls = lock(&self.calls);
        calls.map.insert(
            id,
            Pending {
                peer: to,
                func: func.to_string(),
                types,
                deadline,
                timeout,
                slot: slot.clone(),
            },
        );
        if calls.reaper_wakes.is_none_or(|t| deadline < t) {
            calls.reaper_wakes = Some(deadline);
            self.reaper_cv.notify_one();
        }
        (id, slot)
    }

    /// Takes call `id` out of the table and completes it with `r` (nothing
    /// if someone else already did).
    pub(super) fn complete(&self, id: u64, r: impl FnOnce(&Pending) -> Result<Vec<u8>, RpcError>) {
        let pending = {
            let mut calls = lock(&self.calls);
            let p = calls.map.remove(&id);
            if calls.map.is_empty() {
                self.drained_cv.notify_all();
            }
            p
        };
        if let Some(p) = pending {
            let result = r(&p);
            p.slot.complete(result);
        }
    }

    /// Completes call `id` with the callee's status.
    pub(super) fn complete_status(&self, id: u64, status: Status, payload: Vec<u8>) {
        self.complete(id, |p| {
            let worker = self.name_of(p.peer);
            let func = p.func.clone();
            match status {
                Status::Ok => Ok(payload),
                Status::Handler(message) => Err(RpcError::Handler {
                    worker,
                    func,
                    message,
                }),
                Status::Unknown(registered) => Err(RpcError::UnknownFunction {
                    worker,
                    func,
                    registered,
                }),
                Status::Types(handler) => Err(RpcError::TypeMismatch {
                    worker,
                    func,
                    handler,
                    caller: (p.types)(),
                }),
                Status::Codec { op, detail } => Err(RpcError::Codec {
                    func: format!("{func} on {worker}"),
                    op: if op == "decode" { "decode" } else { "encode" },
                    what: if op == "decode" {
                        "arguments"
                    } else {
                        "result"
                    },
                    detail,
                }),
                Status::RRef(detail) => Err(RpcError::RRef {
                    worker,
                    rref: func,
                    detail,
                }),
            }
        });
    }

    /// Sends call `func(args)` to `to` (or runs it here when `to` is this
    /// worker); `rref` set keeps the result there as that reference's value.
    /// Fails at once if the call cannot leave (shut down, unencodable
    /// arguments, a dead peer); otherwise its slot says how it ended.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn call<A: Serialize>(
        self: &Arc<Self>,
        to: usize,
        func: &str,
        types: u64,
        describe: fn() -> String,
        args: &A,
        rref: Option<RRefId>,
        timeout: Duration,
    ) -> Result<Arc<Slot>, RpcError> {
        if self.closing.load(Ordering::Acquire) {
            return Err(self.shut_down_error());
        }
        let payload = with_agent(self.clone(), || postcard::to_allocvec(args)).map_err(|e| {
            RpcError::Codec {
                func: func.to_string(),
                op: "encode",
                what: "arguments",
                detail: e.to_string(),
            }
        })?;
        let (id, slot) = self.register(to, func, describe, timeout);
        if to == self.me {
            self.serve_call(self.me, id, func.to_string(), types, rref, payload);
        } else {
            let header = Header::Call {
                id,
                func: func.to_string(),
                types,
                rref,
            };
            self.send_request(to, id, func, &header, &payload)?;
        }
        Ok(slot)
    }

    /// Writes a request frame to `to`; if the connection is gone or
    /// breaks, fails the call (taking it out of the table) and says why.
    pub(super) fn send_request(
        &self,
        to: usize,
        id: u64,
        func: &str,
        header: &Header,
        payload: &[u8],
    ) -> Result<(), RpcError> {
        let peer = self.peers[to].as_ref().expect("not this worker");
        // After registering: see the module doc.
        let gone = lock(&peer.gone).as_ref().map(|g| g.why.clone());
        let why = match gone {
            Some(why) => why,
            None => match write_frame(&mut *lock(&peer.writer), header, payload) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    let why = format!("writing to it failed: {e}");
                    self.peer_gone(to, why.clone(), false);
                    why
                }
            },
        };
        let e = self.gone_error(to, func, &why);
        self.complete(id, |_| Err(e.clone()));
        Err(e)
    }

    pub(super) fn gone_error(&self, peer: usize, func: &str, why: &str) -> RpcError {
        RpcError::WorkerGone {
            worker: self.name_of(peer),
            func: func.to_string(),
            detail: why.to_string(),
        }
    }

    /// Marks `peer` dead and fails every call to it.
    pub(super) fn peer_gone(&self, peer: usize, why: String, goodbye: bool) {
        {
            let mut gone = lock(&self.peers[peer].as_ref().expect("a peer").gone);
            if gone.is_none() {
                *gone = Some(Gone {
                    at: Instant::now(),
                    why: why.clone(),
                    goodbye,
                });
            }
        }
        let ids: Vec<u64> = lock(&self.calls)
            .map
            .iter()
            .filter(|(_, p)| p.peer == peer)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.complete(id, |p| Err(self.gone_error(peer, &p.func, &why)));
        }
    }

    /// The first peer whose connection broke (not by a goodbye), and why:
    /// the root cause, when one death brings down others.
    pub(super) fn dead_peer(&self) -> Option<(usize, String)> {
        self.peers
            .iter()
            .enumerate()
            .filter_map(|(r, p)| {
                let gone = lock(&p.as_ref()?.gone);
                let g = gone.as_ref().filter(|g| !g.goodbye)?;
                Some((g.at, r, g.why.clone()))
            })
            .min_by_key(|(at, _, _)| *at)
            .map(|(_, r, why)| (r, why))
    }

    // ---------------------------------------------------------- references

    /// Asks `owner` for the value of `id`.
    pub(crate) fn fetch(
        self: &Arc<Self>,
        owner: usize,
        id: RRefId,
        ty: u64,
        timeout: Duration,
    ) -> Result<Arc<Slot>, RpcError> {
        if self.closing.load(Ordering::Acquire) {
            return Err(self.shut_down_error());
        }
        let func = format!("to_here of rref {id}");
        let (call, slot) = self.register(owner, &func, || "another type".into(), timeout);
        if owner == self.me {
            self.serve_fetch(owner, call, id, ty);
        } else {
            let header = Header::Fetch {
                id: call,
                rref: id,
                ty,
            };
            self.send_request(owner, call, &func, &header, &[])?;
        }
        Ok(slot)
    }

    /// Adds a fork of `id` on its owner and waits until it is counted.
    pub(crate) fn fork(&self, owner: usize, id: RRefId) -> Result<(), RpcError> {
        if owner == self.me {
            return match self.owned().get_mut(&id) {
                Some(o) => {
                    o.users += 1;
                    Ok(())
                }
                None => Err(RpcError::RRef {
                    worker: self.name_of(owner),
                    rref: id.to_string(),
                    detail: "the value is already freed".into(),
                }),
            };
        }
        if self.closing.load(Ordering::Acquire) {
            return Err(self.shut_down_error());
        }
        let func = format!("fork of rref {id}");
        let (call, slot) = self.register(owner, &func, String::new, self.opts.timeout);
        let header = Header::Fork { id: call, rref: id };
        self.send_request(owner, call, &func, &header, &[])?;
        slot.wait().map(drop)
    }

    /// A fork of `id` was dropped on this worker.
    pub(crate) fn release(&self, owner: usize, id: RRefId) {
        if self.closing.load(Ordering::Acquire) {
            return;
        }
        if owner == self.me {
            self.on_release(id);
        } else {
            self.control(owner, Header::Release { rref: id });
        }
    }

    /// One fork fewer of a value owned here; the last one frees it.
    pub(super) fn on_release(&self, id: RRefId) {
        let freed = {
            let mut owned = self.owned();
            match owned.get_mut(&id) {
                Some(o) if o.users > 1 => {
                    o.users -= 1;
                    None
                }
                Some(_) => owned.remove(&id),
                None => None,
            }
        };
        // Dropped here, outside the lock: the value may hold references.
        drop(freed);
    }

    pub(super) fn control(&self, peer: usize, header: Header) {
        // The receiver lives until shutdown; a send after it is moot.
        let _ = lock(&self.control).send(Control::Frame(peer, header));
    }

    // ------------------------------------------------------------ serving
}

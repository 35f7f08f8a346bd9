//! The RPC agent: one per worker, connected to every other worker by one
//! TCP connection that carries calls both ways, many in flight at once.
//!
//! # Threads
//!
//! - A **reader** per connection reads frames and never writes: replies
//!   complete pending calls, calls and fetches go to the handler pool,
//!   reference counts change inline. Since no reader ever blocks on a
//!   socket write, two workers that flood each other cannot deadlock.
//! - A **handler pool** of `num_worker_threads` threads runs handlers and
//!   writes their replies. A handler may block and may call other workers;
//!   as in PyTorch, a pool whose every thread waits on calls that need this
//!   same pool deadlocks until their timeouts.
//! - A **control** thread writes the frames that readers or destructors
//!   produce (fork acknowledgements, releases, goodbyes), in order.
//! - A **reaper** fails calls whose deadline passed.
//!
//! Callers write their own requests, under the connection's write lock.
//!
//! # Pending calls
//!
//! Every call sits in one table until exactly one party takes it out and
//! completes its slot: the reader (the reply arrived), the reaper (the
//! deadline passed), or whoever saw the connection die (every call to that
//! worker fails at once). A call is registered *before* its peer's state is
//! checked and the peer is marked dead *before* its calls are swept, so no
//! call can slip between the two and wait for its timeout.
//!
//! This module must never run a handler on a reader thread, and never hold
//! the table lock while completing a slot or dropping a user value.

use std::collections::{HashMap, VecDeque};
use std::io::{BufReader, ErrorKind};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cohort_store::Store;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::RpcError;
use crate::future::{RpcFuture, Slot};
use crate::registry::{call_types, signature, CallContext, Failure, Registry, WorkerInfo};
use crate::rref::{with_agent, Cell, Fork, Owned, RRef, RRefId};
use crate::wire::{read_frame, write_frame, Header, ReadError, Status};

/// Settings of an agent.
#[derive(Clone, Debug)]
pub struct RpcOptions {
    /// Default timeout of every call, fetch and fork (PyTorch's
    /// `rpc_timeout`, 60 s); per-call timeouts override it.
    pub timeout: Duration,
    /// How long [`init_rpc`](crate::init_rpc) waits for every worker to
    /// join, and [`Rpc::shutdown`] for every worker to arrive.
    pub init_timeout: Duration,
    /// Threads that run handlers (PyTorch's `num_worker_threads`, 16).
    pub num_worker_threads: usize,
    /// Largest argument, result or value a peer may send, in bytes.
    pub max_message_bytes: usize,
    /// The job secret: with one, every connection is authenticated with
    /// `cohort_store::auth`'s handshake and strangers are refused.
    pub secret: Option<cohort_store::Secret>,
    /// Address to listen on (default: loopback; [`init_rpc`](crate::init_rpc)
    /// picks the interface that reaches MASTER_ADDR).
    pub bind_ip: Option<std::net::IpAddr>,
}

impl Default for RpcOptions {
    fn default() -> Self {
        RpcOptions {
            timeout: Duration::from_secs(60),
            init_timeout: cohort_store::DEFAULT_TIMEOUT,
            num_worker_threads: 16,
            max_message_bytes: 1 << 30,
            secret: None,
            bind_ip: None,
        }
    }
}

/// A worker to call: its name (`&str`, `String`), rank (`usize`) or
/// [`WorkerInfo`].
pub trait ToWorker {
    /// The worker's rank in `rpc`'s group.
    fn rank_in(&self, rpc: &Rpc) -> Result<usize, RpcError>;
}

impl ToWorker for usize {
    fn rank_in(&self, rpc: &Rpc) -> Result<usize, RpcError> {
        if *self < rpc.inner.world() {
            Ok(*self)
        } else {
            Err(rpc.inner.unknown_worker(&format!("rank {self}")))
        }
    }
}

impl ToWorker for &str {
    fn rank_in(&self, rpc: &Rpc) -> Result<usize, RpcError> {
        rpc.inner
            .by_name
            .get(*self)
            .copied()
            .ok_or_else(|| rpc.inner.unknown_worker(self))
    }
}

impl ToWorker for String {
    fn rank_in(&self, rpc: &Rpc) -> Result<usize, RpcError> {
        self.as_str().rank_in(rpc)
    }
}

impl ToWorker for &WorkerInfo {
    fn rank_in(&self, rpc: &Rpc) -> Result<usize, RpcError> {
        self.rank.rank_in(rpc)
    }
}

/// This worker's RPC agent: call other workers, create remote references,
/// shut down. Cheap to clone (all clones are the same agent).
#[derive(Clone)]
pub struct Rpc {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Rpc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Rpc({}, rank {} of {})",
            self.me().name,
            self.inner.me,
            self.inner.world()
        )
    }
}

impl Rpc {
    /// This worker.
    pub fn me(&self) -> &WorkerInfo {
        self.inner.worker(self.inner.me)
    }

    /// Every worker of the group, by rank.
    pub fn workers(&self) -> &[WorkerInfo] {
        &self.inner.workers
    }

    /// The worker of that name or rank.
    pub fn worker_info(&self, to: impl ToWorker) -> Result<WorkerInfo, RpcError> {
        Ok(self.inner.worker(to.rank_in(self)?).clone())
    }

    /// Calls `func(args)` on `to` and waits for the result, up to the
    /// agent's timeout.
    pub fn rpc_sync<A, R>(&self, to: impl ToWorker, func: &str, args: A) -> Result<R, RpcError>
    where
        A: Serialize,
        R: DeserializeOwned + 'static,
    {
        self.rpc_async(to, func, args).wait()
    }

    /// Calls `func(args)` on `to` without waiting: the returned future
    /// completes with the result, or the error, by the agent's timeout.
    pub fn rpc_async<A, R>(&self, to: impl ToWorker, func: &str, args: A) -> RpcFuture<R>
    where
        A: Serialize,
        R: DeserializeOwned + 'static,
    {
        self.rpc_async_timeout(to, func, args, self.inner.opts.timeout)
    }

    /// [`rpc_async`](Rpc::rpc_async) with its own timeout.
    pub fn rpc_async_timeout<A, R>(
        &self,
        to: impl ToWorker,
        func: &str,
        args: A,
        timeout: Duration,
    ) -> RpcFuture<R>
    where
        A: Serialize,
        R: DeserializeOwned + 'static,
    {
        let slot = to
            .rank_in(self)
            .and_then(|to| {
                self.inner.call(
                    to,
                    func,
                    call_types::<A, R>(),
                    signature::<A, R>,
                    &args,
                    None,
                    timeout,
                )
            })
            .unwrap_or_else(|e| Slot::ready(Err(e)));
        RpcFuture::new(slot, self.inner.clone(), func)
    }

    /// Runs `func(args)` on `to` and keeps the result there: the returned
    /// reference's value lives on `to` until every reference to it is
    /// dropped. Returns at once; a failure to create the value shows in
    /// [`RRef::to_here`].
    pub fn remote<A, R>(&self, to: impl ToWorker, func: &str, args: A) -> Result<RRef<R>, RpcError>
    where
        A: Serialize,
        R: 'static,
    {
        let owner = to.rank_in(self)?;
        let id = RRefId {
            creator: self.inner.me as u32,
            seq: self.inner.next_rref.fetch_add(1, Ordering::Relaxed),
        };
        // The fork exists before the call leaves, so that an early failure
        // (which releases it) still balances the owner's count.
        let rref = RRef::new(Fork {
            id,
            owner,
            agent: self.inner.clone(),
        });
        // The creation's own result is the value's, seen by to_here; only a
        // failure before the call left is this call's.
        self.inner.call(
            owner,
            func,
            call_types::<A, R>(),
            signature::<A, R>,
            &args,
            Some(id),
            self.inner.opts.timeout,
        )?;
        Ok(rref)
    }

    /// On the owner: how many forks (handles on any worker) of the value
    /// `id` are alive, or `None` when it holds no such value (freed).
    pub fn rref_users(&self, id: RRefId) -> Option<u64> {
        self.inner.owned().get(&id).map(|o| o.users)
    }

    /// On the owner: how many values it holds for remote references.
    pub fn owned_rrefs(&self) -> usize {
        self.inner.owned().len()
    }

    /// Fails with [`RpcError::WorkerGone`] naming the first worker whose
    /// connection broke (a worker that shut down does not count): how a
    /// long wait for work from other workers notices that one died.
    pub fn check_workers(&self) -> Result<(), RpcError> {
        match self.inner.dead_peer() {
            Some((r, why)) => Err(self.inner.gone_error(r, "check_workers", &why)),
            None => Ok(()),
        }
    }

    /// Waits for this worker's outstanding calls, then for every worker to
    /// reach `shutdown` (so that no worker has work outstanding anywhere),
    /// then closes the connections. Fails (after closing) if a worker died
    /// or did not arrive within the init timeout. Values this worker owns
    /// are dropped; references still held afterwards are inert.
    pub fn shutdown(&self) -> Result<(), RpcError> {
        self.inner.shutdown()
    }
}

/// A peer's connection.
pub(crate) struct Peer {
    /// For `shutdown()`.
    stream: TcpStream,
    writer: Mutex<TcpStream>,
    /// `None` while the connection works; why it ended otherwise.
    gone: Mutex<Option<Gone>>,
}

impl Peer {
    pub(crate) fn new(stream: TcpStream) -> std::io::Result<Peer> {
        Ok(Peer {
            writer: Mutex::new(stream.try_clone()?),
            stream,
            gone: Mutex::new(None),
        })
    }
}

/// How a peer's connection ended.
struct Gone {
    at: Instant,
    why: String,
    /// It said goodbye (shut down), as opposed to died.
    goodbye: bool,
}

struct Pending {
    peer: usize,
    func: String,
    /// The caller's types, for a type-mismatch error.
    types: fn() -> String,
    deadline: Instant,
    timeout: Duration,
    slot: Arc<Slot>,
}

#[derive(Default)]
struct Calls {
    map: HashMap<u64, Pending>,
    /// When the reaper will next look (it is woken for an earlier deadline).
    reaper_wakes: Option<Instant>,
    stop: bool,
}

#[derive(Default)]
struct Jobs {
    queue: VecDeque<Box<dyn FnOnce() + Send>>,
    stop: bool,
}

/// Frames written by the control thread, in order.
enum Control {
    Frame(usize, Header),
    Stop,
}

pub(crate) struct Inner {
    pub(crate) me: usize,
    pub(crate) workers: Vec<WorkerInfo>,
    pub(crate) by_name: HashMap<String, usize>,
    peers: Vec<Option<Peer>>,
    registry: Registry,
    pub(crate) opts: RpcOptions,
    store: Arc<dyn Store>,
    next_id: AtomicU64,
    pub(crate) next_rref: AtomicU64,
    calls: Mutex<Calls>,
    reaper_cv: Condvar,
    drained_cv: Condvar,
    owned: Mutex<HashMap<RRefId, Owned>>,
    jobs: Mutex<Jobs>,
    jobs_cv: Condvar,
    control: Mutex<mpsc::Sender<Control>>,
    control_rx: Mutex<Option<mpsc::Receiver<Control>>>,
    /// Set once the goodbyes go out: nothing more is sent.
    closing: AtomicBool,
    shut: AtomicBool,
    readers_live: Mutex<usize>,
    readers_cv: Condvar,
    /// Readers and the reaper.
    threads: Mutex<Vec<JoinHandle<()>>>,
    control_thread: Mutex<Option<JoinHandle<()>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Inner {
    pub(crate) fn new(
        me: usize,
        workers: Vec<WorkerInfo>,
        peers: Vec<Option<Peer>>,
        registry: Registry,
        opts: RpcOptions,
        store: Arc<dyn Store>,
    ) -> Inner {
        let by_name = workers.iter().map(|w| (w.name.clone(), w.rank)).collect();
        let (tx, rx) = mpsc::channel();
        Inner {
            me,
            workers,
            by_name,
            peers,
            registry,
            opts,
            store,
            next_id: AtomicU64::new(1),
            next_rref: AtomicU64::new(0),
            calls: Mutex::new(Calls::default()),
            reaper_cv: Condvar::new(),
            drained_cv: Condvar::new(),
            owned: Mutex::new(HashMap::new()),
            jobs: Mutex::new(Jobs::default()),
            jobs_cv: Condvar::new(),
            control: Mutex::new(tx),
            control_rx: Mutex::new(Some(rx)),
            closing: AtomicBool::new(false),
            shut: AtomicBool::new(false),
            readers_live: Mutex::new(0),
            readers_cv: Condvar::new(),
            threads: Mutex::new(Vec::new()),
            control_thread: Mutex::new(None),
        }
    }

    /// Starts the readers, the handler pool, the control thread and the reaper.
    pub(crate) fn start(self: &Arc<Self>) -> Result<(), RpcError> {
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|e| RpcError::Init {
                    what: "starting threads".into(),
                    detail: e.to_string(),
                })
        };
        let mut threads = Vec::new();
        for (rank, peer) in self.peers.iter().enumerate() {
            let Some(peer) = peer else { continue };
            let stream = peer.stream.try_clone().map_err(|e| RpcError::Init {
                what: format!("connection to {}", self.workers[rank].name),
                detail: e.to_string(),
            })?;
            *lock(&self.readers_live) += 1;
            let me = self.clone();
            threads.push(spawn(
                format!("rpc-read-{rank}"),
                Box::new(move || me.read_loop(rank, stream)),
            )?);
        }
        let rx = lock(&self.control_rx).take().expect("started once");
        let me = self.clone();
        *lock(&self.control_thread) = Some(spawn(
            "rpc-control".into(),
            Box::new(move || me.control_loop(rx)),
        )?);
        let me = self.clone();
        threads.push(spawn(
            "rpc-reaper".into(),
            Box::new(move || me.reap_loop()),
        )?);
        // Pool threads are not joined: one may be inside a handler that
        // never returns, and shutdown must not wait on it.
        for i in 0..self.opts.num_worker_threads.max(1) {
            let me = self.clone();
            spawn(format!("rpc-handler-{i}"), Box::new(move || me.pool_loop()))?;
        }
        *lock(&self.threads) = threads;
        Ok(())
    }

    pub(crate) fn rank(&self) -> usize {
        self.me
    }

    pub(crate) fn world(&self) -> usize {
        self.workers.len()
    }

    pub(crate) fn worker(&self, rank: usize) -> &WorkerInfo {
        &self.workers[rank]
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.opts.timeout
    }

    fn name_of(&self, rank: usize) -> String {
        self.workers[rank].name.clone()
    }

    pub(crate) fn unknown_worker(&self, asked: &str) -> RpcError {
        RpcError::UnknownWorker {
            worker: asked.to_string(),
            known: self
                .workers
                .iter()
                .map(|w| w.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        }
    }

    fn shut_down_error(&self) -> RpcError {
        RpcError::ShutDown {
            worker: self.name_of(self.me),
        }
    }

    pub(crate) fn owned(&self) -> MutexGuard<'_, HashMap<RRefId, Owned>> {
        lock(&self.owned)
    }

    pub(crate) fn owned_cell(&self, id: RRefId) -> Option<Arc<Cell>> {
        self.owned().get(&id).map(|o| o.cell.clone())
    }

    // ------------------------------------------------------------ calling

    /// Registers a call to `to` and returns its slot and id.
    fn register(
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
    fn complete(&self, id: u64, r: impl FnOnce(&Pending) -> Result<Vec<u8>, RpcError>) {
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
    fn complete_status(&self, id: u64, status: Status, payload: Vec<u8>) {
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
    fn call<A: Serialize>(
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
        let payload =
            with_agent(self, || postcard::to_allocvec(args)).map_err(|e| RpcError::Codec {
                func: func.to_string(),
                op: "encode",
                what: "arguments",
                detail: e.to_string(),
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
    fn send_request(
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

    fn gone_error(&self, peer: usize, func: &str, why: &str) -> RpcError {
        RpcError::WorkerGone {
            worker: self.name_of(peer),
            func: func.to_string(),
            detail: why.to_string(),
        }
    }

    /// Marks `peer` dead and fails every call to it.
    fn peer_gone(&self, peer: usize, why: String, goodbye: bool) {
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
    fn dead_peer(&self) -> Option<(usize, String)> {
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
    fn on_release(&self, id: RRefId) {
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

    fn control(&self, peer: usize, header: Header) {
        // The receiver lives until shutdown; a send after it is moot.
        let _ = lock(&self.control).send(Control::Frame(peer, header));
    }

    // ------------------------------------------------------------ serving

    /// Serves a call (from a reader, or from this worker to itself): the
    /// reference's entry exists before this returns, the handler runs on
    /// the pool.
    fn serve_call(
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
    fn run_handler(
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
                with_agent(self, || h.call(&ctx, payload)).map_err(|f| match f {
                    Failure::Decode(detail) => Status::Codec {
                        op: "decode".into(),
                        detail,
                    },
                    Failure::Handler(m) => Status::Handler(m),
                })
            }
        };
        match (outcome, cell) {
            (Ok(value), None) => match with_agent(self, || value.encode()) {
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

    fn respond(&self, to: usize, id: u64, status: Status, payload: Vec<u8>) {
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
    fn serve_fetch(self: &Arc<Self>, from: usize, id: u64, rref: RRefId, ty: u64) {
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
                        with_agent(&me, || v.encode()).map_err(|detail| Status::Codec {
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
    fn serve_fork(&self, from: usize, id: u64, rref: RRefId) {
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

    fn submit(&self, job: Box<dyn FnOnce() + Send>) {
        lock(&self.jobs).queue.push_back(job);
        self.jobs_cv.notify_one();
    }

    fn pool_loop(&self) {
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

    fn read_loop(self: Arc<Self>, peer: usize, stream: TcpStream) {
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

    fn control_loop(&self, rx: mpsc::Receiver<Control>) {
        while let Ok(Control::Frame(peer, header)) = rx.recv() {
            let Some(p) = self.peers[peer].as_ref() else {
                continue;
            };
            // A dead peer is already handled by its reader.
            let _ = write_frame(&mut *lock(&p.writer), &header, &[]);
        }
    }

    fn reap_loop(&self) {
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

    fn shutdown(&self) -> Result<(), RpcError> {
        if self.shut.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let result = self.shutdown_barrier();
        self.teardown(result.is_ok());
        if result.is_ok() {
            self.leave();
        }
        result
    }

    /// Waits for this worker's calls, then for every worker to get here.
    fn shutdown_barrier(&self) -> Result<(), RpcError> {
        let deadline = Instant::now() + self.opts.init_timeout;
        {
            let mut calls = lock(&self.calls);
            while !calls.map.is_empty() {
                // Every call ends by its own deadline; this bound is a backstop.
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    let p = calls.map.values().next().expect("not empty");
                    return Err(RpcError::Timeout {
                        worker: self.name_of(p.peer),
                        func: format!("shutdown waiting for {}", p.func),
                        timeout: self.opts.init_timeout,
                    });
                }
                calls = self
                    .drained_cv
                    .wait_timeout(calls, left.min(Duration::from_millis(100)))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
        self.store.set(&format!("shutdown/{}", self.me), b"1")?;
        let keys: Vec<String> = (0..self.world()).map(|r| format!("shutdown/{r}")).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        loop {
            if let Some((r, why)) = self.dead_peer() {
                return Err(self.gone_error(r, "shutdown", &why));
            }
            if self.store.check(&keys)? {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(RpcError::Timeout {
                    worker: "every worker".into(),
                    func: "shutdown".into(),
                    timeout: self.opts.init_timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Says goodbye (after everything queued before), waits for the peers'
    /// goodbyes when `graceful`, then stops every thread this agent joins.
    fn teardown(&self, graceful: bool) {
        for (rank, p) in self.peers.iter().enumerate() {
            if p.is_some() {
                self.control(rank, Header::Goodbye);
            }
        }
        let _ = lock(&self.control).send(Control::Stop);
        if graceful {
            let deadline = Instant::now() + self.opts.timeout;
            let mut live = lock(&self.readers_live);
            while *live > 0 && Instant::now() < deadline {
                live = self
                    .readers_cv
                    .wait_timeout(live, Duration::from_millis(50))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
        self.closing.store(true, Ordering::Release);
        // The control thread flushes the goodbyes before the sockets close.
        if let Some(t) = lock(&self.control_thread).take() {
            let _ = t.join();
        }
        let threads = std::mem::take(&mut *lock(&self.threads));
        for p in self.peers.iter().flatten() {
            let _ = p.stream.shutdown(Shutdown::Both);
        }
        {
            let mut calls = lock(&self.calls);
            calls.stop = true;
            self.reaper_cv.notify_all();
        }
        {
            let mut jobs = lock(&self.jobs);
            jobs.stop = true;
            jobs.queue.clear();
            self.jobs_cv.notify_all();
        }
        for t in threads {
            let _ = t.join();
        }
        // Whatever is still pending fails now rather than at its deadline.
        let ids: Vec<u64> = lock(&self.calls).map.keys().copied().collect();
        for id in ids {
            self.complete(id, |_| Err(self.shut_down_error()));
        }
        let owned = std::mem::take(&mut *self.owned());
        drop(owned);
    }

    /// Lets rank 0, which may host the store, know this worker is done with it.
    fn leave(&self) {
        if self.store.add("left", 1).is_err() || self.me != 0 {
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            match self.store.add("left", 0) {
                Ok(n) if n as usize >= self.world() => return,
                Ok(_) => std::thread::sleep(Duration::from_millis(2)),
                Err(_) => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::type_id;

    #[test]
    fn type_fingerprints_are_per_call_shape() {
        assert_ne!(call_types::<(i64, i64), i64>(), call_types::<i64, i64>());
        assert_eq!(type_id::<String>(), type_id::<String>());
    }
}

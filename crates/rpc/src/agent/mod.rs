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
use crate::rref::{with_agent, Cell, Fork, Owned, RRef, RRefAgent, RRefId};
use crate::wire::{read_frame, write_frame, Header, ReadError, Status};

mod calls;
mod handlers;
mod reader;
mod shutdown;

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
}

/// What references and futures reach the agent through.
impl RRefAgent for Inner {
    fn rank(&self) -> usize {
        Inner::rank(self)
    }
    fn world(&self) -> usize {
        Inner::world(self)
    }
    fn worker(&self, rank: usize) -> &WorkerInfo {
        Inner::worker(self, rank)
    }
    fn timeout(&self) -> Duration {
        Inner::timeout(self)
    }
    fn fetch_value(
        self: Arc<Self>,
        owner: usize,
        id: RRefId,
        ty: u64,
        timeout: Duration,
    ) -> Result<Vec<u8>, RpcError> {
        self.fetch(owner, id, ty, timeout)?.wait()
    }
    fn fork(&self, owner: usize, id: RRefId) -> Result<(), RpcError> {
        Inner::fork(self, owner, id)
    }
    fn release(&self, owner: usize, id: RRefId) {
        Inner::release(self, owner, id)
    }
    fn owned_cell(&self, id: RRefId) -> Option<Arc<Cell>> {
        Inner::owned_cell(self, id)
    }
    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

impl<T> RRef<T> {
    /// The agent this reference belongs to.
    pub fn rpc(&self) -> Rpc {
        let inner = self
            .agent()
            .as_any()
            .downcast::<Inner>()
            .unwrap_or_else(|_| unreachable!("the rpc agent is RRefAgent's only implementor"));
        Rpc { inner }
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

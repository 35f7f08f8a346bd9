//! `ProcessGroup`: the typed, ordered, fail-stop front of a backend.
//!
//! # State
//! - Every collective gets the next sequence number when it is *issued*
//!   (the blocking call, or the `*_async` call that returns a [`Work`]) and
//!   *runs* only when all earlier ones have finished, so the order in which
//!   one rank issues collectives is the order on the wire. As in c10d, every
//!   rank must issue the same collectives in the same order.
//! - Blocking collectives run on the caller's thread; async ones on the
//!   group's worker thread, in issue order. Send/recv run outside this
//!   order (on the caller's thread, or a thread per async call), matched by
//!   tag.
//! - The first communication error (timeout, lost peer, mismatch) aborts
//!   the group: its connections are shut down so that peers fail fast too,
//!   and every later call returns [`CommError::Aborted`] with the original
//!   reason. Argument errors are returned before a sequence number is taken
//!   and leave the group usable.
//!
//! `ProcessGroup` is a cheap handle (`Clone`, `Send`, `Sync`): clones share
//! one group. It must never reorder collectives or run two at once.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::Duration;

use cohort_store::{PrefixStore, Store};

use crate::backend::{nodes, Backend, MeshBackend, OpContext};
use crate::config::GroupOptions;
use crate::element::{as_bytes, as_bytes_mut, DType, Element};
use crate::error::CommError;
use crate::flight;
use crate::kinds::{Algorithm, OpKind};
use crate::reduce_op::ReduceOp;
use crate::transport;
use crate::work::Work;

mod async_collectives;
mod hang;

type Job = Box<dyn FnOnce() + Send>;
type BackendCall<R> = dyn FnOnce(&dyn Backend, &OpContext) -> Result<R, CommError> + Send;

/// A group of ranks that run collectives together (c10d's `ProcessGroup`).
///
/// Blocking calls take slices; `*_async` calls take owned `Vec`s and return
/// a [`Work`] that hands them back. See the module docs for ordering and
/// failure semantics.
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Box<dyn Backend>,
    opts: GroupOptions,
    rank: usize,
    size: usize,
    local_rank: usize,
    local_world_size: usize,
    algorithm: AtomicU8,
    issued: AtomicU64,
    turn: Mutex<u64>,
    turn_changed: Condvar,
    p2p_seq: AtomicU64,
    aborted: Mutex<Option<String>>,
    store: Arc<dyn Store>,
    subgroups: AtomicU64,
    worker: Mutex<Option<mpsc::Sender<Job>>>,
    /// The flight recorder's ring of this group's last collectives.
    flight: flight::Ring,
    /// The hang diagnosis this rank made, if it made one.
    verdict: Mutex<Option<String>>,
}

/// What the flight recorder notes of a collective when it is issued.
pub(crate) struct Issue {
    op: OpKind,
    bytes: u64,
    dtype: Option<DType>,
}

impl Issue {
    /// Collective `op` over `buf`.
    pub(crate) fn of<T: Element>(op: OpKind, buf: &[T]) -> Issue {
        Issue {
            op,
            bytes: std::mem::size_of_val(buf) as u64,
            dtype: Some(T::DTYPE),
        }
    }
}

impl From<OpKind> for Issue {
    fn from(op: OpKind) -> Issue {
        Issue {
            op,
            bytes: 0,
            dtype: None,
        }
    }
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("name", &self.inner.opts.name)
            .field("backend", &self.inner.backend.name())
            .field("rank", &self.inner.rank)
            .field("size", &self.inner.size)
            .finish()
    }
}

fn algorithm_code(a: Algorithm) -> u8 {
    match a {
        Algorithm::Auto => 0,
        Algorithm::Ring => 1,
        Algorithm::Tree => 2,
        Algorithm::Shm => 3,
        Algorithm::Hierarchical => 4,
    }
}

impl ProcessGroup {
    /// Joins group `opts.name` as `rank` of `size` with the mesh backend
    /// (shared memory or sockets, see [`transport`](crate::transport)),
    /// meeting the other ranks through `store`. Blocks until every rank has
    /// connected, or fails after `opts.timeout` naming the missing ranks.
    pub fn new(
        store: Arc<dyn Store>,
        rank: usize,
        size: usize,
        opts: GroupOptions,
    ) -> Result<ProcessGroup, CommError> {
        if size == 0 || rank >= size {
            return Err(CommError::InvalidArgument {
                op: OpKind::Init,
                group: opts.name.clone(),
                detail: format!("rank {rank} is not in a world of size {size}"),
            });
        }
        let scoped: Arc<dyn Store> = Arc::new(PrefixStore::new(
            format!("cohort/{}", opts.name),
            store.clone(),
        ));
        let placement = nodes::find(&*scoped, &opts.name, rank, size, opts.timeout)?;
        let all: Vec<usize> = (0..size).collect();
        let transport = transport::connect(
            &*scoped,
            &opts.name,
            rank,
            size,
            opts.bind_ip,
            opts.timeout,
            opts.transport,
            placement.one_host(&all),
        )?;
        let nodes = nodes::connect(scoped, &opts, rank, &placement)?;
        let backend = Box::new(MeshBackend::new(transport).with_nodes(nodes));
        Ok(Self::with_backend(backend, store, opts))
    }

    /// Wraps an already connected backend (how other backends plug in);
    /// `store` serves later [`new_group`](Self::new_group) calls and is kept
    /// alive as long as the group (rank 0's may host the server).
    pub fn with_backend(
        backend: Box<dyn Backend>,
        store: Arc<dyn Store>,
        opts: GroupOptions,
    ) -> ProcessGroup {
        let (rank, size) = (backend.rank(), backend.size());
        ProcessGroup {
            inner: Arc::new(Inner {
                algorithm: AtomicU8::new(algorithm_code(opts.algorithm)),
                backend,
                opts,
                rank,
                size,
                local_rank: rank,
                local_world_size: size,
                issued: AtomicU64::new(0),
                turn: Mutex::new(0),
                turn_changed: Condvar::new(),
                p2p_seq: AtomicU64::new(0),
                aborted: Mutex::new(None),
                store,
                subgroups: AtomicU64::new(0),
                worker: Mutex::new(None),
                flight: flight::Ring::from_env(),
                verdict: Mutex::new(None),
            }),
        }
    }

    /// The store this group's ranks met through (the job's authenticated one under `cohort
    /// run`), for a library that sets itself up over it, as NCCL hands its unique id round.
    /// The caller scopes its keys; the group's own live under their own prefixes.
    pub fn store(&self) -> Arc<dyn Store> {
        self.inner.store.clone()
    }

    /// The ranks of each node when this group's all_reduce, reduce_scatter
    /// and all_gather run hierarchically: the group spans several nodes, one of them with more
    /// than one rank, and the algorithm is `auto` or `hierarchical`. `None`
    /// when it runs flat.
    pub fn hierarchy(&self) -> Option<Vec<usize>> {
        match self.algorithm() {
            Algorithm::Auto | Algorithm::Hierarchical => self.inner.backend.node_sizes(),
            _ => None,
        }
    }

    /// Records where this rank sits on its node (from LOCAL_RANK and
    /// LOCAL_WORLD_SIZE, or from the backend, as cohort-mpi does); only
    /// before the group is shared (cloned), else it changes nothing.
    pub fn with_local(mut self, local_rank: usize, local_world_size: usize) -> ProcessGroup {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.local_rank = local_rank;
            inner.local_world_size = local_world_size;
        }
        self
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// Rank among the workers of this node (LOCAL_RANK).
    pub fn local_rank(&self) -> usize {
        self.inner.local_rank
    }

    /// Number of workers on this node (LOCAL_WORLD_SIZE).
    pub fn local_world_size(&self) -> usize {
        self.inner.local_world_size
    }

    /// The group's name.
    pub fn name(&self) -> &str {
        &self.inner.opts.name
    }

    /// The backend's name (`tcp`).
    pub fn backend_name(&self) -> &'static str {
        self.inner.backend.name()
    }

    /// How long one operation may take.
    pub fn timeout(&self) -> Duration {
        self.inner.opts.timeout
    }

    /// The algorithm override in force.
    pub fn algorithm(&self) -> Algorithm {
        self.inner.algorithm()
    }

    /// Changes the algorithm override for later calls. Every rank must make
    /// the same change at the same point of its sequence of collectives.
    pub fn set_algorithm(&self, a: Algorithm) {
        self.inner
            .algorithm
            .store(algorithm_code(a), Ordering::Relaxed);
    }

    /// Why the group was aborted, if it was.
    pub fn abort_reason(&self) -> Option<String> {
        self.inner
            .aborted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Aborts the group now: connections are shut down (peers blocked on
    /// this rank fail fast) and every later call fails.
    pub fn abort(&self, reason: &str) {
        self.inner.abort(reason.to_string());
    }

    /// Creates a sub-group of `ranks` (of this group). Every rank of this
    /// group must call it, in the same order relative to other `new_group`
    /// calls, as in PyTorch; members get `Some(group)` (ranked by their
    /// position in sorted `ranks`), others `None`.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>, CommError> {
        let k = self.inner.subgroups.fetch_add(1, Ordering::SeqCst);
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        let invalid = |detail: String| CommError::InvalidArgument {
            op: OpKind::Init,
            group: self.name().to_string(),
            detail,
        };
        if sorted.is_empty() {
            return Err(invalid("new_group: ranks is empty".to_string()));
        }
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(invalid(format!("new_group: rank {} listed twice", w[0])));
        }
        if let Some(&r) = sorted.iter().find(|&&r| r >= self.size()) {
            return Err(invalid(format!(
                "new_group: rank {r} is not in a group of size {}",
                self.size()
            )));
        }
        let opts = GroupOptions {
            name: format!("{}/{k}", self.name()),
            algorithm: self.algorithm(),
            ..self.inner.opts.clone()
        };
        let (local_rank, local_world) = (self.local_rank(), self.local_world_size());
        // In its turn among the collectives: MPI's split is one of them.
        let split =
            self.collective(OpKind::Init, |backend, _| Ok(backend.split(&sorted, &opts)))?;
        if let Some(split) = split {
            return Ok(split?.map(|backend| {
                ProcessGroup::with_backend(backend, self.inner.store.clone(), opts)
                    .with_local(local_rank, local_world)
            }));
        }
        let Some(sub_rank) = sorted.iter().position(|&r| r == self.rank()) else {
            return Ok(None);
        };
        let g = ProcessGroup::new(self.inner.store.clone(), sub_rank, sorted.len(), opts)?;
        Ok(Some(g.with_local(local_rank, local_world)))
    }

    // ---------------------------------------------------------------- checks

    fn invalid(&self, op: OpKind, detail: String) -> CommError {
        CommError::InvalidArgument {
            op,
            group: self.name().to_string(),
            detail,
        }
    }

    fn check_rank(&self, op: OpKind, what: &str, r: usize) -> Result<(), CommError> {
        if r >= self.size() {
            return Err(self.invalid(
                op,
                format!("{what} {r} is not in a group of size {}", self.size()),
            ));
        }
        Ok(())
    }

    fn check_peer(&self, op: OpKind, peer: usize) -> Result<(), CommError> {
        self.check_rank(op, "peer", peer)?;
        if peer == self.rank() {
            return Err(self.invalid(op, format!("peer {peer} is this rank itself")));
        }
        Ok(())
    }

    fn check_reduce(&self, op: OpKind, dtype: DType, reduce: ReduceOp) -> Result<(), CommError> {
        if !reduce.supports(dtype) {
            return Err(CommError::Unsupported {
                op,
                group: self.name().to_string(),
                reduce,
                dtype,
            });
        }
        Ok(())
    }

    fn check_len(&self, op: OpKind, what: &str, got: usize, want: usize) -> Result<(), CommError> {
        if got != want {
            return Err(self.invalid(op, format!("{what} has {got} elements, expected {want}")));
        }
        Ok(())
    }

    fn check_all_to_all(&self, input: usize, output: usize) -> Result<(), CommError> {
        let op = OpKind::AllToAll;
        self.check_len(op, "output", output, input)?;
        if !input.is_multiple_of(self.size()) {
            return Err(self.invalid(
                op,
                format!(
                    "{input} elements do not split into {} equal slots",
                    self.size()
                ),
            ));
        }
        Ok(())
    }

    fn check_gather(
        &self,
        root: usize,
        input: usize,
        output: Option<usize>,
    ) -> Result<(), CommError> {
        let op = OpKind::Gather;
        self.check_rank(op, "root", root)?;
        match (self.rank() == root, output) {
            (true, Some(n)) => self.check_len(op, "output", n, input * self.size()),
            (true, None) => {
                Err(self.invalid(op, "the root must pass an output buffer".to_string()))
            }
            (false, Some(_)) => {
                Err(self.invalid(op, "only the root passes an output buffer".to_string()))
            }
            (false, None) => Ok(()),
        }
    }

    fn check_scatter(
        &self,
        root: usize,
        input: Option<usize>,
        output: usize,
    ) -> Result<(), CommError> {
        let op = OpKind::Scatter;
        self.check_rank(op, "root", root)?;
        match (self.rank() == root, input) {
            (true, Some(n)) => self.check_len(op, "input", n, output * self.size()),
            (true, None) => Err(self.invalid(op, "the root must pass an input buffer".to_string())),
            (false, Some(_)) => {
                Err(self.invalid(op, "only the root passes an input buffer".to_string()))
            }
            (false, None) => Ok(()),
        }
    }

    // ------------------------------------------------------------ execution

    /// Runs a collective now, on this thread, in its turn.
    fn collective<R>(
        &self,
        issue: impl Into<Issue>,
        f: impl FnOnce(&dyn Backend, &OpContext) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        let issue = issue.into();
        let op = issue.op;
        self.inner.alive(op)?;
        let seq = self.inner.issued.fetch_add(1, Ordering::SeqCst);
        self.inner.flight.issued(seq, op, issue.bytes, issue.dtype);
        if seq == 0 {
            // Not at construction: `with_local` needs the only reference to the group.
            hang::publish_live(&self.inner);
        }
        self.inner.execute(op, seq, f)
    }

    /// Queues a collective on the worker thread; it runs in its turn.
    fn submit<R: Send + 'static>(
        &self,
        issue: impl Into<Issue>,
        f: Box<BackendCall<R>>,
    ) -> Work<R> {
        let issue = issue.into();
        let op = issue.op;
        if let Err(e) = self.inner.alive(op) {
            return Work::failed(op, e);
        }
        let tx = match self.worker() {
            Ok(tx) => tx,
            Err(e) => return Work::failed(op, e),
        };
        let seq = self.inner.issued.fetch_add(1, Ordering::SeqCst);
        self.inner.flight.issued(seq, op, issue.bytes, issue.dtype);
        if seq == 0 {
            // Not at construction: `with_local` needs the only reference to the group.
            hang::publish_live(&self.inner);
        }
        let (work, done) = Work::new(op, seq);
        let inner = self.inner.clone();
        let job: Job = Box::new(move || {
            let r = catch_unwind(AssertUnwindSafe(|| inner.execute(op, seq, f)))
                .unwrap_or_else(|p| Err(inner.panicked(op, p)));
            done.complete(r);
        });
        if let Err(mpsc::SendError(job)) = tx.send(job) {
            // The worker only exits once the group is gone, so this cannot
            // happen while we hold the group; run the job here regardless.
            job();
        }
        work
    }

    fn worker(&self) -> Result<mpsc::Sender<Job>, CommError> {
        let mut w = self.inner.worker.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = &*w {
            return Ok(tx.clone());
        }
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name(format!("cohort-{}", self.name()))
            .spawn(move || {
                for job in rx {
                    job();
                }
            })
            .map_err(|source| CommError::Io {
                context: format!("group {:?}: starting the async worker thread", self.name()),
                source,
            })?;
        *w = Some(tx.clone());
        Ok(tx)
    }

    /// Runs a send or recv now, on this thread.
    fn p2p<R>(
        &self,
        op: OpKind,
        f: impl FnOnce(&dyn Backend, &OpContext) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        let seq = self.inner.p2p_seq.fetch_add(1, Ordering::SeqCst);
        self.p2p_numbered(op, seq, f)
    }

    fn p2p_numbered<R>(
        &self,
        op: OpKind,
        seq: u64,
        f: impl FnOnce(&dyn Backend, &OpContext) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        self.inner.alive(op)?;
        let ctx = self.inner.ctx(op, seq, self.algorithm());
        let r = f(&*self.inner.backend, &ctx);
        if let Err(e) = &r {
            if e.is_fatal() {
                self.inner.abort(e.to_string());
            }
        }
        r
    }

    /// Runs `f` with the next send/recv sequence number on a thread of its
    /// own (async send/recv).
    fn spawn_async<R: Send + 'static>(
        &self,
        op: OpKind,
        f: impl FnOnce(&ProcessGroup, u64) -> Result<R, CommError> + Send + 'static,
    ) -> Work<R> {
        let seq = self.inner.p2p_seq.fetch_add(1, Ordering::SeqCst);
        let (work, done) = Work::new(op, seq);
        let pg = self.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("cohort-{}-{op}", self.name()))
            .spawn(move || {
                let r = catch_unwind(AssertUnwindSafe(|| f(&pg, seq)))
                    .unwrap_or_else(|p| Err(pg.inner.panicked(op, p)));
                done.complete(r);
            });
        match spawned {
            Ok(_) => work,
            Err(source) => Work::failed(
                op,
                CommError::Io {
                    context: format!("group {:?}: starting a thread for {op}", self.name()),
                    source,
                },
            ),
        }
    }

    // ------------------------------------------------------- point to point

    /// Sends `buf` to rank `dst`; the matching [`recv`](Self::recv) names
    /// this rank and the same `tag`.
    pub fn send<T: Element>(&self, buf: &[T], dst: usize, tag: u32) -> Result<(), CommError> {
        self.check_peer(OpKind::Send, dst)?;
        self.p2p(OpKind::Send, |b, ctx| {
            b.send(ctx, as_bytes(buf), T::DTYPE, dst, tag)
        })
    }

    /// Receives into `buf` the message rank `src` sent with `tag`; its
    /// length and type must match (else [`CommError::Mismatch`]).
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize, tag: u32) -> Result<(), CommError> {
        self.check_peer(OpKind::Recv, src)?;
        self.p2p(OpKind::Recv, |b, ctx| {
            b.recv(ctx, as_bytes_mut(buf), T::DTYPE, src, tag)
        })
    }

    /// [`send`](Self::send) on a thread of its own; the work gives `buf` back.
    pub fn isend<T: Element>(&self, buf: Vec<T>, dst: usize, tag: u32) -> Work<Vec<T>> {
        if let Err(e) = self.check_peer(OpKind::Send, dst) {
            return Work::failed(OpKind::Send, e);
        }
        self.spawn_async(OpKind::Send, move |pg, seq| {
            pg.p2p_numbered(OpKind::Send, seq, |b, ctx| {
                b.send(ctx, as_bytes(&buf), T::DTYPE, dst, tag)
            })
            .map(|()| buf)
        })
    }

    /// [`recv`](Self::recv) on a thread of its own; the work gives `buf` back filled.
    pub fn irecv<T: Element>(&self, mut buf: Vec<T>, src: usize, tag: u32) -> Work<Vec<T>> {
        if let Err(e) = self.check_peer(OpKind::Recv, src) {
            return Work::failed(OpKind::Recv, e);
        }
        self.spawn_async(OpKind::Recv, move |pg, seq| {
            pg.p2p_numbered(OpKind::Recv, seq, |b, ctx| {
                b.recv(ctx, as_bytes_mut(&mut buf), T::DTYPE, src, tag)
            })
            .map(|()| buf)
        })
    }

    // ---------------------------------------------------------- collectives

    /// Copies `root`'s `buf` into every rank's `buf`.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<(), CommError> {
        self.check_rank(OpKind::Broadcast, "root", root)?;
        self.collective(Issue::of(OpKind::Broadcast, buf), |b, ctx| {
            b.broadcast(ctx, as_bytes_mut(buf), T::DTYPE, root)
        })
    }

    /// Combines every rank's `buf` with `op` into `root`'s `buf`; the other
    /// ranks' buffers are left unchanged.
    pub fn reduce<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CommError> {
        self.check_rank(OpKind::Reduce, "root", root)?;
        self.check_reduce(OpKind::Reduce, T::DTYPE, op)?;
        self.collective(Issue::of(OpKind::Reduce, buf), |b, ctx| {
            b.reduce(ctx, as_bytes_mut(buf), T::DTYPE, op, root)
        })
    }

    /// Combines every rank's `buf` with `op`, in place, on every rank.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        self.check_reduce(OpKind::AllReduce, T::DTYPE, op)?;
        if flight::skip_this_all_reduce(self.rank()) {
            return Ok(());
        }
        self.collective(Issue::of(OpKind::AllReduce, buf), |b, ctx| {
            b.all_reduce(ctx, as_bytes_mut(buf), T::DTYPE, op)
        })
    }

    /// Combines every rank's `input` (size x n elements) with `op` and leaves
    /// slot `rank` of the result in `output` (n elements).
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.check_len(
            OpKind::ReduceScatter,
            "input",
            input.len(),
            output.len() * self.size(),
        )?;
        self.check_reduce(OpKind::ReduceScatter, T::DTYPE, op)?;
        self.collective(Issue::of(OpKind::ReduceScatter, input), |b, ctx| {
            b.reduce_scatter(ctx, as_bytes(input), as_bytes_mut(output), T::DTYPE, op)
        })
    }

    /// Puts every rank r's `input` (n elements) at slot r of every rank's
    /// `output` (size x n elements).
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<(), CommError> {
        self.check_len(
            OpKind::AllGather,
            "output",
            output.len(),
            input.len() * self.size(),
        )?;
        self.collective(Issue::of(OpKind::AllGather, input), |b, ctx| {
            b.all_gather(ctx, as_bytes(input), as_bytes_mut(output), T::DTYPE)
        })
    }

    /// Puts every rank r's `input` at slot r of `root`'s `output`
    /// (`Some` on the root, `None` elsewhere).
    pub fn gather<T: Element>(
        &self,
        input: &[T],
        output: Option<&mut [T]>,
        root: usize,
    ) -> Result<(), CommError> {
        self.check_gather(root, input.len(), output.as_ref().map(|o| o.len()))?;
        self.collective(OpKind::Gather, |b, ctx| {
            b.gather(
                ctx,
                as_bytes(input),
                output.map(as_bytes_mut),
                T::DTYPE,
                root,
            )
        })
    }

    /// Puts slot r of `root`'s `input` (`Some` on the root, `None`
    /// elsewhere) into rank r's `output`.
    pub fn scatter<T: Element>(
        &self,
        input: Option<&[T]>,
        output: &mut [T],
        root: usize,
    ) -> Result<(), CommError> {
        self.check_scatter(root, input.map(|i| i.len()), output.len())?;
        self.collective(OpKind::Scatter, |b, ctx| {
            b.scatter(
                ctx,
                input.map(as_bytes),
                as_bytes_mut(output),
                T::DTYPE,
                root,
            )
        })
    }

    /// Slot j of rank i's `input` goes to slot i of rank j's `output`
    /// (equal slots: the length must divide by the group size).
    pub fn all_to_all<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<(), CommError> {
        self.check_all_to_all(input.len(), output.len())?;
        self.collective(Issue::of(OpKind::AllToAll, input), |b, ctx| {
            b.all_to_all(ctx, as_bytes(input), as_bytes_mut(output), T::DTYPE)
        })
    }

    /// The hang diagnosis this rank made from every rank's flight recorder
    /// when a collective failed (only the first rank to fail makes one).
    pub fn flight_verdict(&self) -> Option<String> {
        self.inner
            .verdict
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// This rank's flight recorder now: its last collectives, oldest first.
    pub fn flight_dump(&self) -> flight::Dump {
        self.inner.flight.dump(self.inner.rank)
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&self) -> Result<(), CommError> {
        self.collective(OpKind::Barrier, |b, ctx| b.barrier(ctx))
    }
}

/// Advances the group's turn when a collective ends, however it ends.
struct Turn<'a> {
    inner: &'a Inner,
    seq: u64,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        *self.inner.turn.lock().unwrap_or_else(|e| e.into_inner()) = self.seq + 1;
        self.inner.turn_changed.notify_all();
    }
}

impl Inner {
    fn alive(&self, op: OpKind) -> Result<(), CommError> {
        match &*self.aborted.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(reason) => Err(CommError::Aborted {
                op,
                group: self.opts.name.clone(),
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    fn abort(&self, reason: String) {
        let mut a = self.aborted.lock().unwrap_or_else(|e| e.into_inner());
        if a.is_none() {
            *a = Some(reason);
            drop(a);
            self.backend.abort();
        }
    }

    fn panicked(&self, op: OpKind, payload: Box<dyn Any + Send>) -> CommError {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".to_string());
        let reason = format!("{op} panicked: {msg}");
        self.abort(reason.clone());
        CommError::Aborted {
            op,
            group: self.opts.name.clone(),
            reason,
        }
    }

    fn ctx(&self, op: OpKind, seq: u64, algorithm: Algorithm) -> OpContext {
        OpContext {
            op,
            seq,
            group: self.opts.name.clone(),
            timeout: self.opts.timeout,
            algorithm,
            debug: self.opts.debug,
        }
    }

    fn algorithm(&self) -> Algorithm {
        match self.algorithm.load(Ordering::Relaxed) {
            1 => Algorithm::Ring,
            2 => Algorithm::Tree,
            3 => Algorithm::Shm,
            4 => Algorithm::Hierarchical,
            _ => Algorithm::Auto,
        }
    }

    /// Waits for collective `seq`'s turn, runs it, and aborts the group if
    /// it failed in a way that leaves the wire in an unknown state.
    fn execute<R>(
        &self,
        op: OpKind,
        seq: u64,
        f: impl FnOnce(&dyn Backend, &OpContext) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        let mut turn = self.turn.lock().unwrap_or_else(|e| e.into_inner());
        while *turn != seq {
            turn = self
                .turn_changed
                .wait(turn)
                .unwrap_or_else(|e| e.into_inner());
        }
        drop(turn);
        let _next = Turn { inner: self, seq };
        self.alive(op)?;
        self.flight.started(seq);
        let ctx = self.ctx(op, seq, self.algorithm());
        let r = f(&*self.backend, &ctx);
        if let Err(e) = &r {
            if e.is_fatal() {
                self.abort(e.to_string());
                self.explain_hang();
            }
        } else {
            self.flight.completed(seq);
        }
        r
    }
}

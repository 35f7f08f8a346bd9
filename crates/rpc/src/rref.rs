//! Remote references: a value that lives on its owner, and handles to it
//! on any worker, counted so that the owner frees it when the last one goes.
//!
//! # The protocol
//!
//! Every [`RRef`] is one *fork*: a handle on one worker. Clones of an
//! `RRef` in one process share their fork; a fork is made only when an
//! `RRef` is serialized (sent as an argument or result), and the receiver
//! gets the new fork. The owner counts the live forks of each value it
//! holds:
//!
//! - `remote()` creates the value with a count of one (the creator's fork).
//!   The creating call is written to the owner before `remote()` returns.
//! - Serializing an `RRef` first adds one to the owner's count and waits for
//!   the owner to confirm (a local increment on the owner itself, a `Fork`
//!   round trip elsewhere). Only then can the new fork reach anyone, so its
//!   eventual release can never overtake its own increment, whichever
//!   connection each travels on.
//! - Dropping the last clone of a fork sends a `Release` (a local decrement
//!   on the owner). At zero, the owner drops the value.
//!
//! So the count never reaches zero while a fork lives. What it does not
//! cover: a fork serialized into a message that is then lost (its receiver
//! died, or a result never waited for) is never released.
//!
//! `RRef`'s serde impls need the agent that sends or receives them; the
//! agent installs itself in a thread-local ([`with_agent`]) around every
//! encode and decode of arguments and results, so an `RRef` can only be
//! (de)serialized as part of an RPC. This module never writes a socket
//! itself; releases go through the agent's control thread. It reaches the
//! agent only through [`RRefAgent`], which the agent implements: references
//! (and futures, which decode them) sit below the agent and never name its
//! type.

use std::cell::RefCell;
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::RpcError;
use crate::registry::{type_id, Value, WorkerInfo};
use crate::wire::Status;

/// A remote reference's id: the rank that created it and a sequence number
/// of that rank, unique in the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RRefId {
    /// The rank that called `remote()`.
    pub creator: u32,
    /// The creator's count of `remote()` calls.
    pub seq: u64,
}

impl fmt::Display for RRefId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.creator, self.seq)
    }
}

/// What a reference needs of the agent it belongs to.
pub(crate) trait RRefAgent: Send + Sync {
    /// This worker's rank.
    fn rank(&self) -> usize;
    /// The number of workers.
    fn world(&self) -> usize;
    /// The worker of `rank`.
    fn worker(&self, rank: usize) -> &WorkerInfo;
    /// The agent's call timeout.
    fn timeout(&self) -> Duration;
    /// Asks `owner` for the value of `id` (of type id `ty`) and waits for
    /// its encoding.
    fn fetch_value(
        self: Arc<Self>,
        owner: usize,
        id: RRefId,
        ty: u64,
        timeout: Duration,
    ) -> Result<Vec<u8>, RpcError>;
    /// Adds a fork of `id` on its owner and waits until it is counted.
    fn fork(&self, owner: usize, id: RRefId) -> Result<(), RpcError>;
    /// A fork of `id` was dropped on this worker.
    fn release(&self, owner: usize, id: RRefId);
    /// On the owner, the cell of a value it holds.
    fn owned_cell(&self, id: RRefId) -> Option<Arc<Cell>>;
    /// The agent as `Any`, for the agent's own code to get its type back.
    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync>;
}

thread_local! {
    static AGENTS: RefCell<Vec<Arc<dyn RRefAgent>>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with `agent` as the one that (de)serializes `RRef`s.
pub(crate) fn with_agent<R>(agent: Arc<dyn RRefAgent>, f: impl FnOnce() -> R) -> R {
    struct Pop;
    impl Drop for Pop {
        fn drop(&mut self) {
            AGENTS.with(|a| a.borrow_mut().pop());
        }
    }
    AGENTS.with(|a| a.borrow_mut().push(agent));
    let _pop = Pop;
    f()
}

fn current_agent() -> Option<Arc<dyn RRefAgent>> {
    AGENTS.with(|a| a.borrow().last().cloned())
}

/// One worker's handle on an owned value; dropping it releases the value.
pub(crate) struct Fork {
    pub(crate) id: RRefId,
    pub(crate) owner: usize,
    pub(crate) agent: Arc<dyn RRefAgent>,
}

impl Drop for Fork {
    fn drop(&mut self) {
        self.agent.release(self.owner, self.id);
    }
}

/// A reference to a value of type `T` held by its owner worker
/// ([`Rpc::remote`](crate::Rpc::remote)). Fetch a copy with [`to_here`](RRef::to_here); send it
/// to other workers as (part of) an argument or result, where it stays a
/// reference to the same value. The owner frees the value once every
/// worker has dropped every `RRef` to it.
pub struct RRef<T> {
    fork: Arc<Fork>,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for RRef<T> {
    fn clone(&self) -> Self {
        RRef {
            fork: self.fork.clone(),
            _t: PhantomData,
        }
    }
}

impl<T> fmt::Debug for RRef<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RRef({} on {})",
            self.fork.id,
            self.fork.agent.worker(self.fork.owner).name
        )
    }
}

impl<T> RRef<T> {
    pub(crate) fn new(fork: Fork) -> Self {
        RRef {
            fork: Arc::new(fork),
            _t: PhantomData,
        }
    }

    /// The reference's id (what [`Rpc::rref_users`](crate::Rpc::rref_users) takes on the owner).
    pub fn id(&self) -> RRefId {
        self.fork.id
    }

    /// The worker that holds the value.
    pub fn owner(&self) -> WorkerInfo {
        self.fork.agent.worker(self.fork.owner).clone()
    }

    /// Whether this worker holds the value.
    pub fn is_owner(&self) -> bool {
        self.fork.owner == self.fork.agent.rank()
    }

    /// A copy of the value, fetched from the owner (waiting, up to the
    /// agent's timeout, for it to be created). A value whose creation
    /// failed returns the handler's error.
    pub fn to_here(&self) -> Result<T, RpcError>
    where
        T: DeserializeOwned + 'static,
    {
        self.to_here_timeout(self.fork.agent.timeout())
    }

    /// [`to_here`](RRef::to_here) with its own timeout.
    pub fn to_here_timeout(&self, timeout: Duration) -> Result<T, RpcError>
    where
        T: DeserializeOwned + 'static,
    {
        let agent = self.fork.agent.clone();
        let bytes =
            agent
                .clone()
                .fetch_value(self.fork.owner, self.fork.id, type_id::<T>(), timeout)?;
        with_agent(agent, || postcard::from_bytes(&bytes)).map_err(|e| RpcError::Codec {
            func: format!("to_here of rref {}", self.fork.id),
            op: "decode",
            what: "rref value",
            detail: e.to_string(),
        })
    }

    /// On the owner, the value itself (shared, not copied), once created.
    pub fn local_value(&self) -> Result<Arc<T>, RpcError>
    where
        T: Send + Sync + 'static,
    {
        let agent = &self.fork.agent;
        let not_here = |detail: String| RpcError::RRef {
            worker: agent.worker(agent.rank()).name.clone(),
            rref: self.fork.id.to_string(),
            detail,
        };
        if !self.is_owner() {
            return Err(not_here(format!(
                "local_value needs the owner ({}); use to_here",
                self.owner().name
            )));
        }
        let cell = agent
            .owned_cell(self.fork.id)
            .ok_or_else(|| not_here("no such value here".into()))?;
        let value = cell
            .wait(agent.timeout())
            .map_err(|s| not_here(format!("{s:?}")))?;
        value
            .downcast::<T>()
            .map_err(|_| not_here(format!("the value is not a {}", std::any::type_name::<T>())))
    }

    /// The agent this reference belongs to, as the trait references see.
    pub(crate) fn agent(&self) -> Arc<dyn RRefAgent> {
        self.fork.agent.clone()
    }
}

impl<T> Serialize for RRef<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::Error;
        let agent = current_agent()
            .ok_or_else(|| S::Error::custom("an RRef is only sent as an RPC argument or result"))?;
        if !std::ptr::addr_eq(Arc::as_ptr(&agent), Arc::as_ptr(&self.fork.agent)) {
            return Err(S::Error::custom("an RRef is only sent by its own agent"));
        }
        agent
            .fork(self.fork.owner, self.fork.id)
            .map_err(|e| S::Error::custom(format!("forking rref {}: {e}", self.fork.id)))?;
        (self.fork.owner as u32, self.fork.id).serialize(s)
    }
}

impl<'de, T> Deserialize<'de> for RRef<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let (owner, id) = <(u32, RRefId)>::deserialize(d)?;
        let agent = current_agent().ok_or_else(|| {
            D::Error::custom("an RRef is only received as an RPC argument or result")
        })?;
        if owner as usize >= agent.world() {
            return Err(D::Error::custom(format!(
                "rref {id} owned by rank {owner} of a world of {}",
                agent.world()
            )));
        }
        Ok(RRef::new(Fork {
            id,
            owner: owner as usize,
            agent,
        }))
    }
}

/// An owned value: created (or failed) once, read by any number of fetches.
#[derive(Default)]
pub(crate) struct Cell {
    state: Mutex<CellState>,
    cv: Condvar,
}

#[derive(Default)]
enum CellState {
    #[default]
    Pending,
    Ready(Value),
    Failed(Status),
}

impl Cell {
    pub(crate) fn set(&self, r: Result<Value, Status>) {
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = match r {
            Ok(v) => CellState::Ready(v),
            Err(s) => CellState::Failed(s),
        };
        self.cv.notify_all();
    }

    /// The value once created (its `Arc`, not a copy), or why it never was.
    pub(crate) fn wait(
        &self,
        timeout: Duration,
    ) -> Result<Arc<dyn std::any::Any + Send + Sync>, Status> {
        self.with(timeout, |v| v.value.clone())
    }

    /// Runs `f` on the value once created.
    pub(crate) fn with<R>(
        &self,
        timeout: Duration,
        f: impl FnOnce(&Value) -> R,
    ) -> Result<R, Status> {
        let deadline = Instant::now() + timeout;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match &*st {
                CellState::Ready(v) => return Ok(f(v)),
                CellState::Failed(s) => return Err(s.clone()),
                CellState::Pending => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Status::RRef(format!(
                            "the value was still being created after {timeout:?}"
                        )));
                    }
                    st = self
                        .cv
                        .wait_timeout(st, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
    }
}

/// What the owner keeps per value: its live forks and the value.
pub(crate) struct Owned {
    pub(crate) users: u64,
    pub(crate) cell: Arc<Cell>,
}

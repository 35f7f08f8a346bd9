//! The backend interface: what a [`ProcessGroup`](crate::ProcessGroup) dispatches to.
//!
//! A backend implements every operation on byte buffers tagged with a
//! [`DType`]. The group above it owns ordering (sequence numbers, one
//! collective at a time), argument validation, async work and the abort
//! state; a backend owns only moving and reducing bytes. So an MPI backend, a
//! shared-memory transport under the mesh backend, or an NCCL backend plug in
//! by implementing [`Backend`] (or [`Transport`](crate::transport::Transport)),
//! without touching any caller. A backend must never keep references to the
//! buffers it is given past the call, and must never call back into the
//! group.

pub(crate) mod hierarchical;
pub(crate) mod hierarchical_scatter;
pub(crate) mod mesh;
pub(crate) mod nodes;

use std::time::Duration;

use crate::config::GroupOptions;
use crate::element::DType;
use crate::error::CommError;
use crate::reduce_op::ReduceOp;

pub use crate::kinds::{Algorithm, DebugLevel, OpKind, ALL_COLLECTIVES};
pub use mesh::MeshBackend;

/// What a backend knows about the call it is executing.
#[derive(Clone, Debug)]
pub struct OpContext {
    /// The operation.
    pub op: OpKind,
    /// Sequence number of the call in its group (collectives), or of the
    /// point-to-point call in this process (send/recv).
    pub seq: u64,
    /// The group's name, for errors.
    pub group: String,
    /// How long the call may take before it fails with a timeout.
    pub timeout: Duration,
    /// The algorithm override.
    pub algorithm: Algorithm,
    /// The checking level.
    pub debug: DebugLevel,
}

/// An implementation of every operation of a process group, on bytes.
///
/// Buffers are byte views of `dtype` elements, aligned for `dtype`. Calls
/// of collectives arrive one at a time, in the same order on every rank;
/// `send` and `recv` may arrive concurrently with anything. Lengths and ranks
/// are validated by the group before the call.
pub trait Backend: Send + Sync {
    /// Short name (`tcp`).
    fn name(&self) -> &'static str;
    /// This process's rank in the group.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Sends `buf` to `peer`, matched by `tag` on the other side.
    fn send(
        &self,
        ctx: &OpContext,
        buf: &[u8],
        dtype: DType,
        peer: usize,
        tag: u32,
    ) -> Result<(), CommError>;
    /// Receives into `buf` the message `peer` sent with `tag`.
    fn recv(
        &self,
        ctx: &OpContext,
        buf: &mut [u8],
        dtype: DType,
        peer: usize,
        tag: u32,
    ) -> Result<(), CommError>;
    /// Copies `root`'s `buf` into every rank's `buf`.
    fn broadcast(
        &self,
        ctx: &OpContext,
        buf: &mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<(), CommError>;
    /// Combines every rank's `buf` into `root`'s; other ranks' buffers stay unchanged.
    fn reduce(
        &self,
        ctx: &OpContext,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CommError>;
    /// Combines every rank's `buf` into every rank's `buf`.
    fn all_reduce(
        &self,
        ctx: &OpContext,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError>;
    /// Combines every rank's `input` (size x n) and leaves slice `rank` in `output` (n).
    fn reduce_scatter(
        &self,
        ctx: &OpContext,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError>;
    /// Puts rank r's `input` (n) at slot r of every rank's `output` (size x n).
    fn all_gather(
        &self,
        ctx: &OpContext,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
    ) -> Result<(), CommError>;
    /// Puts rank r's `input` at slot r of `root`'s `output` (None elsewhere).
    fn gather(
        &self,
        ctx: &OpContext,
        input: &[u8],
        output: Option<&mut [u8]>,
        dtype: DType,
        root: usize,
    ) -> Result<(), CommError>;
    /// Puts slot r of `root`'s `input` (None elsewhere) into rank r's `output`.
    fn scatter(
        &self,
        ctx: &OpContext,
        input: Option<&[u8]>,
        output: &mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<(), CommError>;
    /// Slot j of rank i's `input` goes to slot i of rank j's `output`.
    fn all_to_all(
        &self,
        ctx: &OpContext,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
    ) -> Result<(), CommError>;
    /// Returns once every rank has entered the barrier.
    fn barrier(&self, ctx: &OpContext) -> Result<(), CommError>;
    /// The ranks of each node (nodes ordered by their lowest rank) when
    /// this backend runs all_reduce hierarchically under the `auto` and
    /// `hierarchical` algorithms; `None` (the default) when it never does.
    fn node_sizes(&self) -> Option<Vec<usize>> {
        None
    }
    /// Breaks every connection so that peers blocked on this process fail
    /// fast; called once when the group fails or is dropped.
    fn abort(&self);
    /// The backend of the subgroup `ranks` (sorted, distinct, in range) for
    /// [`ProcessGroup::new_group`](crate::ProcessGroup::new_group), made
    /// the backend's own way: called on every rank of this group, in its
    /// turn among the collectives, and `Ok(None)` on the ranks outside
    /// `ranks`. `None` (the default) when the backend has no way of its
    /// own; the group then connects a new mesh through its store.
    #[allow(clippy::type_complexity)]
    fn split(
        &self,
        ranks: &[usize],
        opts: &GroupOptions,
    ) -> Option<Result<Option<Box<dyn Backend>>, CommError>> {
        let _ = (ranks, opts);
        None
    }
}

//! The mesh backend: Gloo's design, collectives as schedules over a
//! [`Transport`] that connects every pair of ranks.
//!
//! It maps each call to an algorithm in `collectives/`, wraps it with the
//! op's header description (so every frame is checked), runs the
//! `COHORT_DEBUG=detail` digest round first when asked, and keeps the one
//! scratch buffer that the group's serialised collectives share. It must
//! never decide ordering or validate user arguments: the group did both.

use std::sync::Mutex;

use super::hierarchical_scatter;
use super::nodes::Nodes;
use super::{Algorithm, Backend, DebugLevel, OpContext, OpKind};
use crate::collectives::{self, Comm};
use crate::element::DType;
use crate::engine::{self, Bufs, OpDesc, RecvFrame, Region, Schedule, FLAG_DIGEST};
use crate::error::CommError;
use crate::p2p::P2p;
use crate::reduce_op::ReduceOp;
use crate::transport::{Channel, Transport};

/// Collectives over any [`Transport`]; with [`TcpTransport`](crate::transport::tcp::TcpTransport)
/// it is the `tcp` backend.
pub struct MeshBackend {
    transport: Box<dyn Transport>,
    scratch: Mutex<Vec<f64>>,
    p2p: P2p,
    /// The node meshes, when the group spans several nodes.
    nodes: Option<Box<Nodes>>,
}

impl MeshBackend {
    /// A backend that runs its algorithms over `transport`.
    pub fn new(transport: Box<dyn Transport>) -> MeshBackend {
        let size = transport.size();
        MeshBackend {
            transport,
            scratch: Mutex::new(Vec::new()),
            p2p: P2p::new(size),
            nodes: None,
        }
    }

    /// Runs all_reduce, reduce_scatter and all_gather hierarchically over
    /// `nodes` (when the algorithm is `auto` or `hierarchical`).
    pub(crate) fn with_nodes(mut self, nodes: Option<Box<Nodes>>) -> MeshBackend {
        self.nodes = nodes;
        self
    }

    fn env<'a>(&'a self, ctx: &'a OpContext, desc: OpDesc, channel: Channel) -> engine::OpEnv<'a> {
        engine::OpEnv {
            transport: &*self.transport,
            channel,
            group: &ctx.group,
            timeout: ctx.timeout,
            desc,
        }
    }

    /// Runs `f` as collective `ctx.op` on `count` elements of `dtype`.
    fn collective(
        &self,
        ctx: &OpContext,
        dtype: Option<DType>,
        count: usize,
        reduce: Option<ReduceOp>,
        root: usize,
        f: impl FnOnce(&Comm<'_>) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        let desc = OpDesc {
            kind: ctx.op,
            seq: ctx.seq,
            dtype,
            count: count as u64,
            reduce,
            root: root as u32,
            flags: 0,
        };
        if ctx.debug == DebugLevel::Detail && self.size() > 1 {
            self.digest(ctx, desc)?;
        }
        let comm = Comm {
            env: self.env(ctx, desc, Channel::Collective),
            algorithm: ctx.algorithm,
            dtype: dtype.unwrap_or(DType::U8),
            scratch: &self.scratch,
        };
        f(&comm)
    }

    /// `COHORT_DEBUG=detail`: every rank sends a header-only frame describing
    /// its call to every other rank, which compares it with its own.
    fn digest(&self, ctx: &OpContext, mut desc: OpDesc) -> Result<(), CommError> {
        desc.flags = FLAG_DIGEST;
        let env = self.env(ctx, desc, Channel::Collective);
        let mut sched = Schedule::default();
        for p in (0..self.size()).filter(|&p| p != self.rank()) {
            sched.send(p, Region::Out(0, 0), None);
            sched.recv(p, RecvFrame::copy(Region::Out(0, 0)));
        }
        let mut bufs = Bufs {
            out: &mut [],
            inp: &[],
            scratch: &mut [],
        };
        engine::run(&env, &sched, &mut bufs, None)
    }

    /// Whether a collective that has a hierarchical form runs it: with the
    /// node meshes (the group spans several nodes, some with more than one
    /// rank) under the `auto` or `hierarchical` algorithm.
    fn hierarchical(&self, ctx: &OpContext) -> bool {
        self.nodes.is_some() && matches!(ctx.algorithm, Algorithm::Auto | Algorithm::Hierarchical)
    }

    /// Point-to-point frames are matched by tag, not by the group's
    /// collective sequence, so the sequence number stays out of the header.
    fn p2p_desc(dtype: DType, bytes: usize, tag: u32) -> OpDesc {
        OpDesc {
            kind: OpKind::Send,
            seq: 0,
            dtype: Some(dtype),
            count: (bytes / dtype.size()) as u64,
            reduce: None,
            root: tag,
            flags: 0,
        }
    }
}

impl Backend for MeshBackend {
    fn name(&self) -> &'static str {
        self.transport.name()
    }

    fn rank(&self) -> usize {
        self.transport.rank()
    }

    fn size(&self) -> usize {
        self.transport.size()
    }

    fn node_sizes(&self) -> Option<Vec<usize>> {
        self.nodes.as_ref().map(|n| n.sizes.clone())
    }

    fn send(
        &self,
        ctx: &OpContext,
        buf: &[u8],
        dtype: DType,
        peer: usize,
        tag: u32,
    ) -> Result<(), CommError> {
        let env = self.env(ctx, Self::p2p_desc(dtype, buf.len(), tag), Channel::P2p);
        self.p2p.send(&env, peer, buf)
    }

    fn recv(
        &self,
        ctx: &OpContext,
        buf: &mut [u8],
        dtype: DType,
        peer: usize,
        tag: u32,
    ) -> Result<(), CommError> {
        let desc = Self::p2p_desc(dtype, buf.len(), tag);
        let ours = OpDesc {
            kind: OpKind::Recv,
            ..desc
        }
        .describe();
        let env = self.env(ctx, desc, Channel::P2p);
        self.p2p.recv(&env, &ours, peer, buf)
    }

    fn broadcast(
        &self,
        ctx: &OpContext,
        buf: &mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<(), CommError> {
        self.collective(
            ctx,
            Some(dtype),
            buf.len() / dtype.size(),
            None,
            root,
            |c| collectives::broadcast::broadcast(c, buf, root),
        )
    }

    fn reduce(
        &self,
        ctx: &OpContext,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CommError> {
        self.collective(
            ctx,
            Some(dtype),
            buf.len() / dtype.size(),
            Some(op),
            root,
            |c| collectives::reduce::reduce(c, buf, op, root),
        )
    }

    fn all_reduce(
        &self,
        ctx: &OpContext,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let (hierarchical, world) = (self.hierarchical(ctx), self.size());
        self.collective(
            ctx,
            Some(dtype),
            buf.len() / dtype.size(),
            Some(op),
            0,
            |c| match &self.nodes {
                Some(nodes) if hierarchical => {
                    super::hierarchical::run(nodes, ctx, world, buf, dtype, op)
                }
                _ => collectives::all_reduce::all_reduce(c, buf, op),
            },
        )
    }

    fn reduce_scatter(
        &self,
        ctx: &OpContext,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let (hierarchical, world) = (self.hierarchical(ctx), self.size());
        self.collective(
            ctx,
            Some(dtype),
            output.len() / dtype.size(),
            Some(op),
            0,
            |c| match &self.nodes {
                Some(nodes) if hierarchical => hierarchical_scatter::reduce_scatter(
                    nodes,
                    ctx,
                    world,
                    (input, output),
                    dtype,
                    op,
                ),
                _ => collectives::reduce_scatter::reduce_scatter(c, input, output, op),
            },
        )
    }

    fn all_gather(
        &self,
        ctx: &OpContext,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
    ) -> Result<(), CommError> {
        let hierarchical = self.hierarchical(ctx);
        self.collective(
            ctx,
            Some(dtype),
            input.len() / dtype.size(),
            None,
            0,
            |c| match &self.nodes {
                Some(nodes) if hierarchical => {
                    hierarchical_scatter::all_gather(nodes, ctx, (input, output), dtype)
                }
                _ => collectives::all_gather::all_gather(c, input, output),
            },
        )
    }

    fn gather(
        &self,
        ctx: &OpContext,
        input: &[u8],
        output: Option<&mut [u8]>,
        dtype: DType,
        root: usize,
    ) -> Result<(), CommError> {
        self.collective(
            ctx,
            Some(dtype),
            input.len() / dtype.size(),
            None,
            root,
            |c| collectives::gather::gather(c, input, output, root),
        )
    }

    fn scatter(
        &self,
        ctx: &OpContext,
        input: Option<&[u8]>,
        output: &mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<(), CommError> {
        self.collective(
            ctx,
            Some(dtype),
            output.len() / dtype.size(),
            None,
            root,
            |c| collectives::scatter::scatter(c, input, output, root),
        )
    }

    fn all_to_all(
        &self,
        ctx: &OpContext,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
    ) -> Result<(), CommError> {
        self.collective(ctx, Some(dtype), input.len() / dtype.size(), None, 0, |c| {
            collectives::all_to_all::all_to_all(c, input, output)
        })
    }

    fn barrier(&self, ctx: &OpContext) -> Result<(), CommError> {
        self.collective(ctx, None, 0, None, 0, collectives::barrier::barrier)
    }

    fn abort(&self) {
        self.transport.shutdown();
        if let Some(nodes) = &self.nodes {
            nodes.meshes().for_each(|m| m.abort());
        }
    }
}

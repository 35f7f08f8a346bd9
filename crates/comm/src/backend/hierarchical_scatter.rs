//! Hierarchical reduce_scatter and all_gather for groups that span several
//! nodes, as `hierarchical.rs` is for all_reduce: each crosses the link
//! once per byte and node, spread over one rank per node and local index.
//!
//! Scheme (M nodes, node i holding L_i ranks m_i[0..L_i] in rank order,
//! Lmax the largest L_i, n the bytes of one rank's chunk; chunk r is the
//! one flat reduce_scatter leaves on rank r). The chunks fall into Lmax
//! *peer groups*: group g holds, for each node j, the chunk of m_j[g]
//! (a *dummy*, which nobody keeps, where node j has no rank g). Peer mesh g
//! joins one rank of each node: m_j[g mod L_j], so a node with fewer ranks
//! than Lmax lends a rank to several groups (see `nodes`).
//!
//! reduce_scatter:
//! 1. inside node i, a reduce_scatter (sum) of L_i slots: slot k holds, for
//!    each group g = k, k + L_i, ... (V_i = ceil(Lmax / L_i) sub-slots,
//!    padded with zeros), the M chunks of group g. Local rank k ends with
//!    its node's sum of every chunk of the groups it stands for;
//! 2. for each such group g, ascending, a reduce_scatter (sum) on peer mesh
//!    g of those M chunks: the rank of node j ends with chunk m_j[g]
//!    summed over the nodes; for g = k that is this rank's own chunk, for
//!    g >= L_i a dummy, dropped;
//! 3. `Avg` divides once by the world size at the end, as all_reduce does.
//!
//! all_gather is the reverse: each group's all_gather on its peer mesh
//! (this rank's chunk in its own group, zeros in a dummy's place), then an
//! all_gather inside the node of those, each chunk then copied to its
//! rank's place.
//!
//! Only phase 2 crosses the link: of each node, L ranks (all of them, on a
//! node of Lmax) each send (M - 1) / M of 1/L of the data, instead of every
//! rank's share of a flat ring. A dummy chunk travels with its group (a
//! node short of ranks costs the link 1/M of those groups). The staging
//! copies (the reordered input, the node phase's result) cost memory
//! bandwidth, not link time. The sums' order differs from the flat ring's
//! (node first, then nodes), so a float result may differ from flat by
//! rounding; it is the same on every run, as every rank runs the same
//! phases in the same order (the groups ascending, so that a rank lent to
//! several waits only on groups below the one it is in). Each phase is an
//! ordinary collective on its sub-mesh, with this call's sequence number,
//! so its frames are checked and its failures named with the sub-mesh.

use super::nodes::Nodes;
use super::{Backend, OpContext};
use crate::element::DType;
use crate::error::CommError;
use crate::kinds::OpKind;
use crate::reduce_op::{finish_avg, ReduceOp};

/// Where each chunk sits in the node phase's buffer (L local slots of V
/// sub-slots of M chunks): the scheme's arithmetic for this rank's node.
struct Slots<'a> {
    members: &'a [Vec<usize>],
    /// This rank's local index.
    local: usize,
    /// L: this node's ranks.
    l: usize,
    /// V: the groups each local rank stands for, padded.
    v: usize,
    /// M: nodes.
    m: usize,
}

impl Slots<'_> {
    fn new(nodes: &Nodes) -> Slots<'_> {
        let members = &nodes.members[..];
        let l = members[nodes.node].len();
        let largest = members.iter().map(Vec::len).max().unwrap_or(1);
        Slots {
            members,
            local: nodes.local.rank(),
            l,
            v: largest.div_ceil(l),
            m: members.len(),
        }
    }

    /// Each chunk of the node phase's buffer that belongs to a rank: its
    /// index in that buffer (in chunks) and the rank.
    fn chunks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.l * self.v * self.m).filter_map(|at| {
            let (k, sub, j) = (at / (self.v * self.m), at / self.m % self.v, at % self.m);
            let g = k + sub * self.l;
            self.members[j].get(g).map(|&rank| (at, rank))
        })
    }
}

/// The context of a phase on sub-mesh `mesh`.
fn phase(ctx: &OpContext, kind: OpKind, mesh: &str) -> OpContext {
    OpContext {
        op: kind,
        group: format!("{}/{mesh}", ctx.group),
        ..ctx.clone()
    }
}

/// The name of peer mesh `g` (its store prefix, and its group's suffix in
/// errors).
pub(crate) fn peer_name(g: usize) -> String {
    match g {
        0 => "leaders".to_string(),
        g => format!("peers{g}"),
    }
}

pub(crate) fn reduce_scatter(
    nodes: &Nodes,
    ctx: &OpContext,
    world: usize,
    (input, output): (&[u8], &mut [u8]),
    dtype: DType,
    op: ReduceOp,
) -> Result<(), CommError> {
    let sum = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    let s = Slots::new(nodes);
    let n = output.len();
    let slot = s.v * s.m * n;
    let mut packed = vec![0u8; s.l * slot];
    for (at, rank) in s.chunks() {
        packed[at * n..(at + 1) * n].copy_from_slice(&input[rank * n..(rank + 1) * n]);
    }
    let mine = if s.l > 1 {
        let mut mine = vec![0u8; slot];
        let node = phase(ctx, OpKind::ReduceScatter, "node");
        nodes
            .local
            .reduce_scatter(&node, &packed, &mut mine, dtype, sum)?;
        mine
    } else {
        packed
    };
    let mut dummy = vec![0u8; n];
    // The peer meshes, g ascending, are the sub-slots in order.
    for (sub, (g, mesh)) in nodes.peers.iter().enumerate() {
        let out = if *g == s.local {
            &mut *output
        } else {
            &mut dummy[..]
        };
        let chunks = &mine[sub * s.m * n..(sub + 1) * s.m * n];
        let across = phase(ctx, OpKind::ReduceScatter, &peer_name(*g));
        mesh.reduce_scatter(&across, chunks, out, dtype, sum)?;
    }
    if op == ReduceOp::Avg {
        finish_avg(dtype, output, world);
    }
    Ok(())
}

pub(crate) fn all_gather(
    nodes: &Nodes,
    ctx: &OpContext,
    (input, output): (&[u8], &mut [u8]),
    dtype: DType,
) -> Result<(), CommError> {
    let s = Slots::new(nodes);
    let n = input.len();
    let slot = s.v * s.m * n;
    let mut mine = vec![0u8; slot];
    let dummy = vec![0u8; n];
    for (sub, (g, mesh)) in nodes.peers.iter().enumerate() {
        let send = if *g == s.local { input } else { &dummy[..] };
        let chunks = &mut mine[sub * s.m * n..(sub + 1) * s.m * n];
        let across = phase(ctx, OpKind::AllGather, &peer_name(*g));
        mesh.all_gather(&across, send, chunks, dtype)?;
    }
    let packed = if s.l > 1 {
        let mut packed = vec![0u8; s.l * slot];
        let node = phase(ctx, OpKind::AllGather, "node");
        nodes.local.all_gather(&node, &mine, &mut packed, dtype)?;
        packed
    } else {
        mine
    };
    for (at, rank) in s.chunks() {
        output[rank * n..(rank + 1) * n].copy_from_slice(&packed[at * n..(at + 1) * n]);
    }
    Ok(())
}

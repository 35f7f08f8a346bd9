//! Hierarchical all_reduce for groups that span several nodes: reduce
//! inside each node onto its leader, all_reduce among the leaders, then
//! broadcast inside each node. It lives with the backends, not with the
//! transport-level algorithms of `collectives`, because it composes whole
//! sub-mesh backends.
//!
//! Inside a node the ranks share memory (the node mesh gets the
//! shared-memory transport), so only one rank per node sends each byte
//! across the network, and it sends it once per algorithm step among
//! leaders instead of once per rank: the frequent, cheap sync inside a node
//! and the rare, expensive one across nodes. `Avg` sums all the way and
//! divides once at the end, so nodes of different sizes weigh each rank
//! equally. Each phase is an ordinary collective on a sub-mesh, with this
//! call's sequence number and timeout, so its frames are checked and its
//! failures named as anywhere else (with the sub-mesh's group name and
//! ranks). Every rank runs the same phases in the same order, so the
//! sub-meshes stay in lockstep.

use super::nodes::Nodes;
use super::{Backend, OpContext};
use crate::element::DType;
use crate::error::CommError;
use crate::kinds::OpKind;
use crate::reduce_op::{finish_avg, ReduceOp};

pub(crate) fn run(
    nodes: &Nodes,
    ctx: &OpContext,
    world: usize,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<(), CommError> {
    let sum = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    let phase = |kind: OpKind, mesh: &str| OpContext {
        op: kind,
        group: format!("{}/{mesh}", ctx.group),
        ..ctx.clone()
    };
    nodes
        .local
        .reduce(&phase(OpKind::Reduce, "node"), buf, dtype, sum, 0)?;
    if let Some(leaders) = nodes.leaders() {
        leaders.all_reduce(&phase(OpKind::AllReduce, "leaders"), buf, dtype, sum)?;
    }
    nodes
        .local
        .broadcast(&phase(OpKind::Broadcast, "node"), buf, dtype, 0)?;
    if op == ReduceOp::Avg {
        finish_avg(dtype, buf, world);
    }
    Ok(())
}

//! Where the ranks of a group run: which share a host (and so can share
//! memory), which share a node, and the meshes the hierarchical collectives
//! run on: one among the ranks of each node, and one per local index g
//! (the *peer* meshes), among one rank of each node: local rank g, or
//! g mod L on a node of L <= g ranks. Peer mesh 0 is the node leaders',
//! the lowest rank of each node: all_reduce uses it alone, reduce_scatter
//! and all_gather all of them (see `hierarchical`).
//!
//! A node is what `COHORT_NODE_ID` names (so that tests can pretend one
//! host is several), else the host. A host is the kernel and network
//! namespace a rank runs in (boot id and netns: ranks that can share memory
//! and abstract Unix sockets). Every rank publishes both in the group's
//! store *before* the group's sockets connect, so that no rank reads the
//! store after a peer may have left it (rank 0 may host it and exit as soon
//! as its last collective ends), and all ranks derive the same placement,
//! nodes ordered by their lowest rank. This module only sets up; it must
//! never run a collective other than the barrier that ends its setup.

use std::sync::Arc;
use std::time::Duration;

use cohort_store::{PrefixStore, Store};

use super::{Backend, DebugLevel, MeshBackend, OpContext, OpKind};
use crate::config::{var, GroupOptions};
use crate::error::CommError;
use crate::transport;

/// Where every rank of a group runs.
#[derive(Clone, Debug)]
pub(crate) struct Placement {
    /// Each rank's host.
    hosts: Vec<String>,
    /// The nodes, ordered by lowest rank; members in rank order.
    nodes: Vec<Vec<usize>>,
}

impl Placement {
    /// Whether all of `ranks` run on one host.
    pub fn one_host(&self, ranks: &[usize]) -> bool {
        ranks.iter().all(|&r| self.hosts[r] == self.hosts[ranks[0]])
    }

    /// Whether the hierarchical all_reduce applies: several nodes, and some
    /// node with more than one rank.
    fn hierarchical(&self) -> bool {
        self.nodes.len() > 1 && self.nodes.len() < self.hosts.len()
    }
}

/// The node-local and peer meshes of a group that spans several nodes.
pub(crate) struct Nodes {
    /// This node's ranks (this rank is `local.rank()`, the leader is 0).
    pub local: MeshBackend,
    /// The peer meshes this rank is in, by local index g ascending: g = its
    /// own local index, then + L, + 2L... below the largest node's size
    /// (L this node's size). Each has one rank per node, its rank there the
    /// node's index. Peer mesh 0 is the leaders'.
    pub peers: Vec<(usize, MeshBackend)>,
    /// Each node's ranks in rank order, nodes ordered by their lowest rank.
    pub members: Vec<Vec<usize>>,
    /// This rank's node, an index into `members`.
    pub node: usize,
    /// How many ranks each node holds, nodes ordered by their lowest rank.
    pub sizes: Vec<usize>,
}

impl Nodes {
    /// The leaders' mesh, on leaders only.
    pub fn leaders(&self) -> Option<&MeshBackend> {
        self.peer(0)
    }

    /// Peer mesh `g`, if this rank is in it.
    pub fn peer(&self, g: usize) -> Option<&MeshBackend> {
        self.peers.iter().find(|(h, _)| *h == g).map(|(_, m)| m)
    }

    /// Every mesh this rank is in, for an abort.
    pub fn meshes(&self) -> impl Iterator<Item = &MeshBackend> {
        std::iter::once(&self.local).chain(self.peers.iter().map(|(_, m)| m))
    }
}

/// Publishes this rank's host and node and reads everybody's.
pub(crate) fn find(
    store: &dyn Store,
    group: &str,
    rank: usize,
    size: usize,
    timeout: Duration,
) -> Result<Placement, CommError> {
    // A rank whose host is unknown shares it with nobody.
    let host = transport::tcp::host_id().unwrap_or_else(|| format!("unknown/{rank}"));
    if size == 1 {
        return Ok(Placement {
            hosts: vec![host],
            nodes: vec![vec![0]],
        });
    }
    let node = var("COHORT_NODE_ID")?.unwrap_or_else(|| host.clone());
    let store_err = |source| CommError::Store {
        group: group.to_string(),
        source,
    };
    store
        .set(
            &format!("place/{rank}"),
            format!("{node}\n{host}").as_bytes(),
        )
        .map_err(store_err)?;
    let keys: Vec<String> = (0..size).map(|r| format!("place/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    store.wait(&refs, timeout).map_err(store_err)?;
    let mut names = Vec::with_capacity(size);
    let mut hosts = Vec::with_capacity(size);
    for k in &keys {
        let v = String::from_utf8_lossy(&store.get(k).map_err(store_err)?).into_owned();
        let (n, h) = v.split_once('\n').unwrap_or((&v, ""));
        names.push(n.to_string());
        hosts.push(h.to_string());
    }
    let mut nodes: Vec<Vec<usize>> = Vec::new();
    for r in 0..size {
        match nodes.iter_mut().find(|m| names[m[0]] == names[r]) {
            Some(m) => m.push(r),
            None => nodes.push(vec![r]),
        }
    }
    Ok(Placement { hosts, nodes })
}

/// Connects the node and peer meshes when the group spans several nodes
/// (`None` otherwise), then waits until every rank has (a barrier through
/// them), so that nobody leaves the store while others still use it. Every
/// rank connects its meshes in the same order (its node's, then the peer
/// meshes by g ascending), so no two ranks wait on each other.
pub(crate) fn connect(
    store: Arc<dyn Store>,
    opts: &GroupOptions,
    rank: usize,
    placement: &Placement,
) -> Result<Option<Box<Nodes>>, CommError> {
    if !placement.hierarchical() {
        return Ok(None);
    }
    let nodes = &placement.nodes;
    let node = nodes
        .iter()
        .position(|m| m.contains(&rank))
        .expect("every rank is on a node");
    let members = &nodes[node];
    let local_rank = members
        .iter()
        .position(|&r| r == rank)
        .expect("a rank is a member of its node");
    let sub = |prefix: String, rank: usize, ranks: &[usize]| -> Result<MeshBackend, CommError> {
        let name = format!("{}/{prefix}", opts.name);
        let scoped = PrefixStore::new(prefix, store.clone());
        let t = transport::connect(
            &scoped,
            &name,
            rank,
            ranks.len(),
            opts.bind_ip,
            opts.timeout,
            opts.transport,
            placement.one_host(ranks),
        )?;
        Ok(MeshBackend::new(t))
    };
    let local = sub(format!("node{node}"), local_rank, members)?;
    let largest = nodes.iter().map(Vec::len).max().unwrap_or(1);
    let mut peers = Vec::new();
    for g in (local_rank..largest).step_by(members.len()) {
        // Each node's rank of peer mesh g: local index g, or g mod L.
        let ranks: Vec<usize> = nodes.iter().map(|m| m[g % m.len()]).collect();
        let name = super::hierarchical_scatter::peer_name(g);
        let mesh = sub(name.clone(), node, &ranks)?;
        peers.push((g, name, mesh));
    }
    let ctx = |mesh: &str| OpContext {
        op: OpKind::Barrier,
        seq: 0,
        group: format!("{}/{mesh}", opts.name),
        timeout: opts.timeout,
        algorithm: opts.algorithm,
        debug: DebugLevel::Off,
    };
    // In the node, across each peer mesh, in the node again: a barrier of
    // all (every rank is in the peer mesh of its own local index).
    local.barrier(&ctx("node"))?;
    for (_, name, mesh) in &peers {
        mesh.barrier(&ctx(name))?;
    }
    local.barrier(&OpContext {
        seq: 1,
        ..ctx("node")
    })?;
    let sizes = nodes.iter().map(Vec::len).collect();
    Ok(Some(Box::new(Nodes {
        local,
        peers: peers.into_iter().map(|(g, _, m)| (g, m)).collect(),
        members: nodes.clone(),
        node,
        sizes,
    })))
}

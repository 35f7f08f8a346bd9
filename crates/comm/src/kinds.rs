//! The names every layer of comm shares: which operation a call, frame or error is about
//! ([`OpKind`]), which algorithm family to use ([`Algorithm`]), how much checking happens before
//! each collective ([`DebugLevel`]) and which transport a group asks for ([`TransportKind`]).
//!
//! A leaf: it imports nothing from the crate, so the group, the backends, the engine, the
//! transports, the settings and the errors can all name these without importing each other.

/// Which operation a call, frame or error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OpKind {
    /// Point-to-point send.
    Send,
    /// Point-to-point receive.
    Recv,
    /// One root's buffer to every rank.
    Broadcast,
    /// Every rank's buffer combined onto one root.
    Reduce,
    /// Every rank's buffer combined onto every rank.
    AllReduce,
    /// Combined, then rank r keeps slice r.
    ReduceScatter,
    /// Every rank's slice to every rank.
    AllGather,
    /// Every rank's slice to one root.
    Gather,
    /// One root's slices, one to each rank.
    Scatter,
    /// Slice j of rank i to slot i of rank j.
    AllToAll,
    /// Nobody leaves before everybody arrived.
    Barrier,
    /// Setting up a group (rendezvous).
    Init,
}

impl OpKind {
    /// PyTorch's name for the operation.
    pub const fn name(self) -> &'static str {
        match self {
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::AllReduce => "all_reduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::Gather => "gather",
            OpKind::Scatter => "scatter",
            OpKind::AllToAll => "all_to_all",
            OpKind::Barrier => "barrier",
            OpKind::Init => "init",
        }
    }

    /// Parses a name as printed by [`OpKind::name`].
    pub fn parse(s: &str) -> Option<OpKind> {
        ALL_COLLECTIVES
            .iter()
            .chain(&[OpKind::Send, OpKind::Recv])
            .copied()
            .find(|k| k.name() == s)
    }

    pub(crate) const fn code(self) -> u8 {
        match self {
            OpKind::Send => 1,
            OpKind::Recv => 2,
            OpKind::Broadcast => 3,
            OpKind::Reduce => 4,
            OpKind::AllReduce => 5,
            OpKind::ReduceScatter => 6,
            OpKind::AllGather => 7,
            OpKind::Gather => 8,
            OpKind::Scatter => 9,
            OpKind::AllToAll => 10,
            OpKind::Barrier => 11,
            OpKind::Init => 12,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<OpKind> {
        ALL_COLLECTIVES
            .iter()
            .chain(&[OpKind::Send, OpKind::Recv, OpKind::Init])
            .copied()
            .find(|k| k.code() == code)
    }
}

/// Every collective, in the order the benchmark runs them.
pub const ALL_COLLECTIVES: [OpKind; 9] = [
    OpKind::AllReduce,
    OpKind::Broadcast,
    OpKind::Reduce,
    OpKind::AllGather,
    OpKind::ReduceScatter,
    OpKind::Gather,
    OpKind::Scatter,
    OpKind::AllToAll,
    OpKind::Barrier,
];

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which algorithm family a backend should use (`COHORT_ALGO`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Algorithm {
    /// Pick by message size and world size.
    #[default]
    Auto,
    /// Bandwidth-optimal: rings and pipelined chains.
    Ring,
    /// Latency-optimal: recursive doubling and binomial trees.
    Tree,
    /// all_reduce straight through shared memory at every size, where the
    /// transport has it (otherwise as `Auto`).
    Shm,
    /// all_reduce within each node, then across one leader per node, then
    /// back within each node; reduce_scatter within each node, then across
    /// one rank per node and local index (all_gather the reverse). Where
    /// the group spans several nodes, some with more than one rank
    /// (otherwise as `Auto`, which also picks these there).
    Hierarchical,
}

impl Algorithm {
    /// Parses `auto`, `ring`, `tree`, `shm` or `hierarchical`.
    pub fn parse(s: &str) -> Option<Algorithm> {
        Some(match s {
            "auto" | "" => Algorithm::Auto,
            "ring" => Algorithm::Ring,
            "tree" | "recursive_doubling" => Algorithm::Tree,
            "shm" | "direct" => Algorithm::Shm,
            "hierarchical" | "hier" => Algorithm::Hierarchical,
            _ => return None,
        })
    }
}

/// How much checking happens before each collective (`COHORT_DEBUG`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DebugLevel {
    /// Only the per-frame header check.
    #[default]
    Off,
    /// Before every collective, all ranks exchange a description of their
    /// call (op, dtype, length, reduce op, root) and compare all of them, like
    /// `TORCH_DISTRIBUTED_DEBUG=DETAIL`.
    Detail,
}

/// Which transport a group asks for (`COHORT_TRANSPORT`; see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TransportKind {
    /// Shared memory when every rank is on this host, else sockets.
    #[default]
    Auto,
    /// Shared memory, or an error.
    Shm,
    /// Sockets: Unix sockets on one host, TCP across hosts.
    Unix,
    /// TCP sockets only.
    Tcp,
}

impl TransportKind {
    /// Parses `auto`, `shm`, `unix` or `tcp` (any case).
    pub fn parse(s: &str) -> Option<TransportKind> {
        Some(match s.to_ascii_lowercase().as_str() {
            "auto" | "" => TransportKind::Auto,
            "shm" => TransportKind::Shm,
            "unix" => TransportKind::Unix,
            "tcp" => TransportKind::Tcp,
            _ => return None,
        })
    }
}

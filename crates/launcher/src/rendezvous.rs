//! How the node agents of a job agree through the store: which nodes run
//! each round (fixed jobs: all `nnodes`; elastic jobs: whoever joined, at
//! least `min_nodes`, at most `nnodes`), whether a round failed somewhere or
//! must regroup to admit a waiting node (so every node stops and restarts
//! together), whether it succeeded everywhere, and when node 0 may stop
//! hosting the store. A round is a set of keys under `round/<r>/`, so a
//! later round never reads an earlier one's state. This module only reads
//! and writes store keys; it never touches a process.
//!
//! Keys, inside the `cohort_launcher` prefix:
//! - `run_id`: chosen by node 0, read by the others;
//! - `round/<r>/rank/<n>`: the agent that claimed node rank `n`, set once;
//! - `round/<r>/joined`: how many agents joined round `r`; the `i`-th
//!   (from 1) announces itself in `round/<r>/joiner/<i>` ([`NodeInfo`]);
//! - `round/<r>/members`: `"<k> <f>"`, set once by whichever agent closes
//!   the round: its nodes are the first `k` joiners, and `f` failure
//!   restarts happened before it. An agent that joined after the `k`-th
//!   waits for the next round; while it waits, a round with room for it
//!   regroups;
//! - `round/<r>/failed`: why round `r` failed, first writer wins (counts
//!   against `max_restarts`);
//! - `round/<r>/regroup`: round `r` stopped to admit a waiting node (does
//!   not count);
//! - `round/<r>/succeeded`, `round/<r>/left`: counters of the round's nodes
//!   whose workers all exited 0, and of those done with the store;
//! - `heartbeat/<n>`: node `n`'s heartbeat counter (see
//!   [`heartbeat`](crate::heartbeat));
//! - `closed`: how the job ended (`succeeded`, or why it stopped for good),
//!   set once; no round starts after it.
//!
//! A round closes as soon as `nnodes` agents joined, or `last_call` after
//! `min_nodes` had joined, and never before the previous round ended (so a
//! node that arrives while a round runs cannot start a job of its own).

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use cohort_store::{PrefixStore, Store, StoreError};

use crate::events::Events;
use crate::heartbeat::{heartbeat_key, Liveness, Lost};
use crate::LaunchError;

/// Namespace of the launcher's keys in the job's store, apart from the workers'.
const PREFIX: &str = "cohort_launcher";

/// How often an agent looks at the store while it waits on other nodes.
pub(crate) const PEER_POLL: Duration = Duration::from_millis(50);

/// The value of `closed` when every node's workers succeeded.
const SUCCEEDED: &str = "succeeded";

/// What a node agent announces about itself when it joins a round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeInfo {
    pub node_rank: usize,
    pub nproc_per_node: usize,
    pub max_restarts: u32,
    pub min_nodes: usize,
    pub max_nodes: usize,
    pub host: String,
    pub pid: u32,
}

impl NodeInfo {
    fn encode(&self) -> String {
        format!(
            "node_rank={} nproc_per_node={} max_restarts={} nnodes={}:{} pid={} host={}",
            self.node_rank,
            self.nproc_per_node,
            self.max_restarts,
            self.min_nodes,
            self.max_nodes,
            self.pid,
            self.host
        )
    }

    fn decode(text: &str) -> Option<Self> {
        let mut fields = text.splitn(6, ' ');
        let mut field = |name: &str| fields.next()?.strip_prefix(name)?.strip_prefix('=');
        let node_rank = field("node_rank")?.parse().ok()?;
        let nproc_per_node = field("nproc_per_node")?.parse().ok()?;
        let max_restarts = field("max_restarts")?.parse().ok()?;
        let (min, max) = field("nnodes")?.split_once(':')?;
        Some(NodeInfo {
            node_rank,
            nproc_per_node,
            max_restarts,
            min_nodes: min.parse().ok()?,
            max_nodes: max.parse().ok()?,
            pid: field("pid")?.parse().ok()?,
            host: field("host")?.to_string(),
        })
    }
}

/// How waiting for the other nodes ended, when it did not fail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Wait<T> {
    /// The awaited state was reached.
    Done(T),
    /// The launcher received this stop signal while waiting.
    Stopped(i32),
}

/// The nodes of one round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Membership {
    pub round: u32,
    /// Their node ranks, ascending: a node's place here is its `GROUP_RANK`.
    pub nodes: Vec<usize>,
    /// Failure restarts before this round.
    pub restarts: u32,
}

impl Membership {
    /// `GROUP_RANK` of node `node_rank` in this round.
    pub fn group_rank(&self, node_rank: usize) -> usize {
        self.nodes
            .iter()
            .position(|&n| n == node_rank)
            .expect("a member's own node rank")
    }

    /// The other nodes of the round.
    pub fn others(&self, node_rank: usize) -> Vec<usize> {
        self.nodes
            .iter()
            .copied()
            .filter(|&n| n != node_rank)
            .collect()
    }
}

/// How joining a round ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Joined {
    /// This node runs the round.
    Member(Membership),
    /// The round closed without this node; it waits for the next one.
    Late,
    /// The job ended before this node got a round.
    Closed(JobEnd),
}

/// How the job ended, as recorded in `closed`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum JobEnd {
    Succeeded,
    Stopped(String),
}

/// How a round ended for the whole job, seen by a node whose workers succeeded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RoundResult {
    /// Every node's workers exited 0.
    AllSucceeded,
    /// A node reported this failure, or this node found one lost.
    Failed(String),
}

/// Why a running round must end early, seen from the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Interruption {
    /// Some node reported this failure (a worker, a lost node, a signal).
    Failed(String),
    /// A node waits to join and the round has room for it.
    Regroup,
}

/// One node agent's view of the rendezvous.
pub(crate) struct Rendezvous {
    store: Arc<PrefixStore>,
    /// The whole store, where the workers meet (under their own prefixes).
    root: Arc<dyn Store>,
    /// For error messages.
    addr: String,
    port: u16,
    me: NodeInfo,
    last_call: Duration,
}

impl Rendezvous {
    pub fn new(
        store: Arc<dyn Store>,
        addr: &str,
        port: u16,
        me: NodeInfo,
        last_call: Duration,
    ) -> Self {
        Rendezvous {
            store: Arc::new(PrefixStore::new(PREFIX, store.clone())),
            root: store,
            addr: addr.to_string(),
            port,
            me,
            last_call,
        }
    }

    /// The whole store, as the workers see it (their flight recorder rings are there).
    pub fn root_store(&self) -> Arc<dyn Store> {
        self.root.clone()
    }

    /// The launcher's namespace of the store, for the heartbeat thread.
    pub fn store(&self) -> Arc<dyn Store> {
        self.store.clone()
    }

    fn err(&self, op: impl Into<String>) -> impl FnOnce(StoreError) -> LaunchError + '_ {
        let op = op.into();
        move |source| LaunchError::Store {
            addr: self.addr.clone(),
            port: self.port,
            op,
            source,
        }
    }

    fn has(&self, key: &str, op: impl FnOnce() -> String) -> Result<bool, LaunchError> {
        self.store.check(&[key]).map_err(self.err(op()))
    }

    fn text(&self, key: &str, op: impl FnOnce() -> String) -> Result<Option<String>, LaunchError> {
        let op = op();
        if !self.has(key, || op.clone())? {
            return Ok(None);
        }
        let value = self.store.get(key).map_err(self.err(op))?;
        Ok(Some(String::from_utf8_lossy(&value).into_owned()))
    }

    fn counter(&self, key: &str, op: impl FnOnce() -> String) -> Result<i64, LaunchError> {
        self.store.add(key, 0).map_err(self.err(op()))
    }

    /// The job's run id: `proposal` if this is node 0, else node 0's.
    pub fn run_id(
        &self,
        proposal: &str,
        timeout: Duration,
        events: &Events,
    ) -> Result<Wait<String>, LaunchError> {
        if self.me.node_rank == 0 {
            let id = self
                .store
                .compare_set("run_id", b"", proposal.as_bytes())
                .map_err(self.err("publish the run id"))?;
            return Ok(Wait::Done(String::from_utf8_lossy(&id).into_owned()));
        }
        match self.wait_key("run_id", timeout, events)? {
            Wait::Done(()) => {}
            Wait::Stopped(signal) => return Ok(Wait::Stopped(signal)),
        }
        let id = self
            .store
            .get("run_id")
            .map_err(self.err("read the run id"))?;
        Ok(Wait::Done(String::from_utf8_lossy(&id).into_owned()))
    }

    /// The round a newly started agent joins: the first that has not closed
    /// or has not ended (an agent that joins a running round waits for the
    /// next, and the running one regroups if it has room).
    pub fn current_round(&self) -> Result<u32, LaunchError> {
        let mut round = 0;
        while self.members_record(round)?.is_some() && self.ended(round)? {
            round += 1;
        }
        Ok(round)
    }

    /// Joins round `round`: claims this node's rank in it, announces this
    /// node, and waits until the round closes (see the module doc), then
    /// checks that its nodes all run the same job shape. `timeout` bounds
    /// the wait for enough nodes once the previous round has ended.
    pub fn join(
        &self,
        round: u32,
        timeout: Duration,
        events: &Events,
    ) -> Result<Wait<Joined>, LaunchError> {
        let mine = self.me.encode();
        let claim = rank_key(round, self.me.node_rank);
        let held = self
            .store
            .compare_set(&claim, b"", mine.as_bytes())
            .map_err(self.err(format!("join round {round}")))?;
        if held != mine.as_bytes() {
            return Err(LaunchError::DuplicateNodeRank {
                node_rank: self.me.node_rank,
                holder: String::from_utf8_lossy(&held).into_owned(),
            });
        }
        let joined = joined_key(round);
        let index = self
            .store
            .add(&joined, 1)
            .map_err(self.err(format!("join round {round}")))?;
        self.store
            .set(&joiner_key(round, index), mine.as_bytes())
            .map_err(self.err(format!("announce this node in round {round}")))?;

        let mut deadline = Instant::now() + timeout;
        let mut enough_since: Option<Instant> = None;
        loop {
            if let Some(end) = self.closed()? {
                return Ok(Wait::Done(Joined::Closed(end)));
            }
            if let Some((k, restarts)) = self.members_record(round)? {
                if index > k as i64 {
                    return Ok(Wait::Done(Joined::Late));
                }
                return self.members(round, k, restarts).map(Wait::Done);
            }
            let previous_ended = round == 0 || self.ended(round - 1)?;
            if !previous_ended {
                // Waiting for a running round to end is not waiting for nodes.
                deadline = Instant::now() + timeout;
            } else {
                let arrived = self.counter(&joined, || format!("count round {round}'s nodes"))?;
                let arrived = usize::try_from(arrived).unwrap_or(0);
                if arrived >= self.me.max_nodes {
                    self.close_round(round, self.me.max_nodes)?;
                    continue;
                }
                if arrived >= self.me.min_nodes {
                    let since = *enough_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= self.last_call {
                        self.close_round(round, arrived)?;
                        continue;
                    }
                }
                if Instant::now() >= deadline {
                    return Err(self.join_timeout(round, arrived, timeout));
                }
            }
            if let Some(signal) = events.pending_stop() {
                return Ok(Wait::Stopped(signal));
            }
            thread::sleep(PEER_POLL);
        }
    }

    fn join_timeout(&self, round: u32, arrived: usize, timeout: Duration) -> LaunchError {
        let joined: Vec<usize> = (1..=arrived as i64)
            .filter_map(|i| self.text(&joiner_key(round, i), String::new).ok().flatten())
            .filter_map(|text| NodeInfo::decode(&text))
            .map(|info| info.node_rank)
            .collect();
        LaunchError::JoinTimeout {
            round,
            arrived,
            needed: self.me.min_nodes,
            missing: (0..self.me.max_nodes)
                .filter(|n| !joined.contains(n))
                .collect(),
            timeout,
        }
    }

    /// Fixes round `round`'s nodes as its first `k` joiners, unless another
    /// agent closed it first.
    fn close_round(&self, round: u32, k: usize) -> Result<(), LaunchError> {
        let restarts = match round.checked_sub(1) {
            None => 0,
            Some(previous) => {
                let (_, before) = self.members_record(previous)?.unwrap_or((0, 0));
                before + u32::from(self.failure(previous)?.is_some())
            }
        };
        self.store
            .compare_set(
                &members_key(round),
                b"",
                format!("{k} {restarts}").as_bytes(),
            )
            .map(drop)
            .map_err(self.err(format!("close round {round}")))
    }

    /// `(k, restarts)` of round `round`, once it closed.
    fn members_record(&self, round: u32) -> Result<Option<(usize, u32)>, LaunchError> {
        let op = || format!("read round {round}'s nodes");
        let Some(text) = self.text(&members_key(round), op)? else {
            return Ok(None);
        };
        let parsed = text
            .split_once(' ')
            .and_then(|(k, f)| Some((k.parse().ok()?, f.parse().ok()?)));
        parsed
            .map(Some)
            .ok_or_else(|| self.malformed(&members_key(round), &text, "a round's nodes"))
    }

    fn malformed(&self, key: &str, text: &str, what: &str) -> LaunchError {
        LaunchError::Store {
            addr: self.addr.clone(),
            port: self.port,
            op: format!("read {key}"),
            source: StoreError::Protocol {
                location: format!("{}:{}", self.addr, self.port),
                detail: format!("{key} holds {text:?}, not {what}"),
            },
        }
    }

    /// Reads the first `k` joiners of round `round`, checks that they run
    /// this job's shape, and orders them by node rank.
    fn members(&self, round: u32, k: usize, restarts: u32) -> Result<Joined, LaunchError> {
        let mut nodes = Vec::with_capacity(k);
        for index in 1..=k as i64 {
            let key = joiner_key(round, index);
            // The joiner counted itself before announcing; give it a moment.
            self.store
                .wait(&[&key], PEER_POLL * 100)
                .map_err(self.err(format!("read round {round}'s node announcements")))?;
            let text = self
                .text(&key, || format!("read round {round}'s node announcements"))?
                .unwrap_or_default();
            let theirs = NodeInfo::decode(&text)
                .ok_or_else(|| self.malformed(&key, &text, "a node announcement"))?;
            self.check_same_job(&theirs)?;
            nodes.push(theirs.node_rank);
        }
        nodes.sort_unstable();
        Ok(Joined::Member(Membership {
            round,
            nodes,
            restarts,
        }))
    }

    fn check_same_job(&self, theirs: &NodeInfo) -> Result<(), LaunchError> {
        let differ = |setting: &'static str, t: String, o: String| {
            (t != o).then_some(LaunchError::NodeMismatch {
                node_rank: theirs.node_rank,
                setting,
                theirs: t,
                ours: o,
            })
        };
        let me = &self.me;
        let checks = [
            differ(
                "nproc_per_node",
                theirs.nproc_per_node.to_string(),
                me.nproc_per_node.to_string(),
            ),
            differ(
                "max_restarts",
                theirs.max_restarts.to_string(),
                me.max_restarts.to_string(),
            ),
            differ(
                "nnodes",
                format!("{}:{}", theirs.min_nodes, theirs.max_nodes),
                format!("{}:{}", me.min_nodes, me.max_nodes),
            ),
        ];
        match checks.into_iter().flatten().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Whether round `round` stopped: it failed, regrouped, or the job closed.
    fn ended(&self, round: u32) -> Result<bool, LaunchError> {
        let op = || format!("check whether round {round} ended");
        Ok(self.has(&failed_key(round), op)?
            || self.has(&regroup_key(round), op)?
            || self.closed()?.is_some())
    }

    /// Why round `round` failed on some node, if it did.
    pub fn failure(&self, round: u32) -> Result<Option<String>, LaunchError> {
        self.text(&failed_key(round), || {
            format!("check round {round} for failures")
        })
    }

    /// Records that round `round` failed; the first node to report wins.
    pub fn report_failure(&self, round: u32, detail: &str) -> Result<(), LaunchError> {
        self.store
            .compare_set(&failed_key(round), b"", detail.as_bytes())
            .map(drop)
            .map_err(self.err(format!("report round {round}'s failure")))
    }

    /// Records that round `round` stops to admit a waiting node.
    pub fn report_regroup(&self, round: u32) -> Result<(), LaunchError> {
        self.store
            .compare_set(&regroup_key(round), b"", b"1")
            .map(drop)
            .map_err(self.err(format!("regroup round {round}")))
    }

    /// Whether the running round `members` must end early, and why.
    pub fn interruption(&self, members: &Membership) -> Result<Option<Interruption>, LaunchError> {
        let round = members.round;
        if let Some(detail) = self.failure(round)? {
            return Ok(Some(Interruption::Failed(detail)));
        }
        let op = || format!("check round {round} for waiting nodes");
        if self.has(&regroup_key(round), op)? {
            return Ok(Some(Interruption::Regroup));
        }
        if members.nodes.len() < self.me.max_nodes {
            let joined = self.counter(&joined_key(round), op)?;
            if joined > members.nodes.len() as i64 {
                return Ok(Some(Interruption::Regroup));
            }
        }
        Ok(None)
    }

    /// Ends the job for good: no round starts after this. The first reason wins.
    pub fn close(&self, end: &JobEnd) -> Result<(), LaunchError> {
        let value = match end {
            JobEnd::Succeeded => SUCCEEDED,
            JobEnd::Stopped(why) => why.as_str(),
        };
        self.store
            .compare_set("closed", b"", value.as_bytes())
            .map(drop)
            .map_err(self.err("close the rendezvous"))
    }

    /// How the job ended, if it did.
    pub fn closed(&self) -> Result<Option<JobEnd>, LaunchError> {
        Ok(self
            .text("closed", || "check whether the rendezvous is closed".into())?
            .map(|v| match v.as_str() {
                SUCCEEDED => JobEnd::Succeeded,
                _ => JobEnd::Stopped(v),
            }))
    }

    /// Node `node_rank`'s heartbeat counter.
    pub fn heartbeats(&self, node_rank: usize) -> Result<i64, LaunchError> {
        self.counter(&heartbeat_key(node_rank), || {
            format!("read node {node_rank}'s heartbeat")
        })
    }

    /// Checks the other members' heartbeats; a lost node fails the round.
    pub fn lost_node(&self, liveness: &mut Liveness) -> Result<Option<Lost>, LaunchError> {
        liveness.check(|n| self.heartbeats(n))
    }

    /// Records that this node's workers all succeeded in round `members` and
    /// waits until every node's did, one reports a failure, or one is lost.
    pub fn finish(
        &self,
        members: &Membership,
        liveness: &mut Liveness,
        events: &Events,
    ) -> Result<Wait<RoundResult>, LaunchError> {
        let round = members.round;
        let key = format!("round/{round}/succeeded");
        let mut done = self
            .store
            .add(&key, 1)
            .map_err(self.err(format!("report round {round}'s success")))?;
        loop {
            if done >= members.nodes.len() as i64 {
                return Ok(Wait::Done(RoundResult::AllSucceeded));
            }
            if let Some(detail) = self.failure(round)? {
                return Ok(Wait::Done(RoundResult::Failed(detail)));
            }
            if let Some(lost) = self.lost_node(liveness)? {
                let detail = lost_detail(lost);
                self.report_failure(round, &detail)?;
                return Ok(Wait::Done(RoundResult::Failed(detail)));
            }
            if let Some(signal) = events.pending_stop() {
                return Ok(Wait::Stopped(signal));
            }
            thread::sleep(PEER_POLL);
            done = self.counter(&key, || format!("count round {round}'s successes"))?;
        }
    }

    /// Says this agent is done with the store. Node 0, which hosts it, then
    /// waits (up to `timeout`, or until a stop signal) for the other `nodes`
    /// of the last round to say so, so that none of them loses the store
    /// while reading how the job ended.
    pub fn leave(
        &self,
        round: u32,
        nodes: usize,
        timeout: Duration,
        events: &Events,
    ) -> Result<(), LaunchError> {
        let key = format!("round/{round}/left");
        let mut left = self
            .store
            .add(&key, 1)
            .map_err(self.err("leave the rendezvous"))?;
        if self.me.node_rank != 0 {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        while left < nodes as i64 && Instant::now() < deadline && events.pending_stop().is_none() {
            thread::sleep(PEER_POLL);
            left = self.counter(&key, || "count the agents that left".into())?;
        }
        Ok(())
    }

    /// Where a torch.distributed program's rank 0 hosts its own store in round
    /// `members` (the workers' `MASTER_ADDR`/`MASTER_PORT`): the round's first
    /// node, which runs rank 0, picks it with `pick` and publishes it; the
    /// other nodes wait for it. A fresh port each round, so a restarted rank 0
    /// never finds the last round's socket in TIME_WAIT.
    pub fn worker_master(
        &self,
        members: &Membership,
        pick: impl FnOnce() -> std::io::Result<(String, u16)>,
        timeout: Duration,
        events: &Events,
    ) -> Result<Wait<(String, u16)>, LaunchError> {
        let key = worker_master_key(members.round);
        if members.nodes.first() == Some(&self.me.node_rank) {
            let (addr, port) = pick().map_err(|source| LaunchError::Agent {
                what: "a free port for the workers' MASTER_PORT".into(),
                source,
            })?;
            self.store
                .set(&key, format!("{port} {addr}").as_bytes())
                .map_err(self.err("publish the workers' MASTER_ADDR"))?;
            return Ok(Wait::Done((addr, port)));
        }
        if let Wait::Stopped(signal) = self.wait_key(&key, timeout, events)? {
            return Ok(Wait::Stopped(signal));
        }
        let text = self
            .text(&key, || "read the workers' MASTER_ADDR".into())?
            .unwrap_or_default();
        let parsed = text
            .split_once(' ')
            .and_then(|(port, addr)| Some((addr.to_string(), port.parse().ok()?)));
        parsed
            .map(Wait::Done)
            .ok_or_else(|| self.malformed(&key, &text, "a port and an address"))
    }

    /// Waits for `key` in short slices, so that a stop signal is noticed
    /// while the other nodes are awaited.
    fn wait_key(
        &self,
        key: &str,
        timeout: Duration,
        events: &Events,
    ) -> Result<Wait<()>, LaunchError> {
        let deadline = Instant::now() + timeout;
        loop {
            let slice = deadline
                .saturating_duration_since(Instant::now())
                .min(PEER_POLL * 4);
            match self.store.wait(&[key], slice) {
                Ok(()) => return Ok(Wait::Done(())),
                Err(StoreError::Timeout { .. }) if Instant::now() < deadline => {}
                Err(StoreError::Timeout { keys, .. }) => {
                    return Err(self.err("wait for node 0")(StoreError::Timeout {
                        keys,
                        timeout,
                    }))
                }
                Err(e) => return Err(self.err("wait for node 0")(e)),
            }
            if let Some(signal) = events.pending_stop() {
                return Ok(Wait::Stopped(signal));
            }
        }
    }
}

/// How a lost node is reported to the other nodes.
pub(crate) fn lost_detail(lost: Lost) -> String {
    format!(
        "node {} lost: no heartbeat for {:.1} s",
        lost.node_rank,
        lost.silent_for.as_secs_f64()
    )
}

fn rank_key(round: u32, node_rank: usize) -> String {
    format!("round/{round}/rank/{node_rank}")
}

fn joined_key(round: u32) -> String {
    format!("round/{round}/joined")
}

fn joiner_key(round: u32, index: i64) -> String {
    format!("round/{round}/joiner/{index}")
}

fn members_key(round: u32) -> String {
    format!("round/{round}/members")
}

fn failed_key(round: u32) -> String {
    format!("round/{round}/failed")
}

fn worker_master_key(round: u32) -> String {
    format!("round/{round}/worker_master")
}

fn regroup_key(round: u32) -> String {
    format!("round/{round}/regroup")
}

#[cfg(test)]
mod tests;

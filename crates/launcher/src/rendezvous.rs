//! How the node agents of a job agree through the store: who is in each
//! restart round, whether a round failed somewhere (so every node stops and
//! restarts together), whether it succeeded everywhere, and when node 0 may
//! stop hosting the store. A round is a set of keys under `round/<r>/`, so a
//! later round never reads an earlier one's state. This module only reads and
//! writes store keys; it never touches a process.
//!
//! Keys, inside the `cohort_launcher` prefix:
//! - `run_id`: chosen by node 0, read by the others;
//! - `round/<r>/node/<n>`: node `n`'s announcement ([`NodeInfo`]), set once;
//! - `round/<r>/failed`: why round `r` failed, first writer wins;
//! - `round/<r>/succeeded`: how many nodes' workers all exited 0;
//! - `closed`: set when the job will not restart again (a node was
//!   interrupted, or ran out of restarts);
//! - `left`: how many agents are done with the store.
//!
//! Elastic membership (issue 6) fits in the same scheme: a round's members
//! become whoever joined before a deadline, and heartbeats live beside them.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use cohort_store::{PrefixStore, Store, StoreError};

use crate::events::Events;
use crate::LaunchError;

/// Namespace of the launcher's keys in the job's store, apart from the workers'.
const PREFIX: &str = "cohort_launcher";

/// How often an agent looks at the store while it waits on other nodes.
pub(crate) const PEER_POLL: Duration = Duration::from_millis(50);

/// What a node agent announces about itself when it joins a round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeInfo {
    pub nproc_per_node: usize,
    pub max_restarts: u32,
    pub host: String,
    pub pid: u32,
}

impl NodeInfo {
    fn encode(&self) -> String {
        format!(
            "nproc_per_node={} max_restarts={} pid={} host={}",
            self.nproc_per_node, self.max_restarts, self.pid, self.host
        )
    }

    fn decode(text: &str) -> Option<Self> {
        let mut fields = text.splitn(4, ' ');
        let mut field = |name: &str| fields.next()?.strip_prefix(name)?.strip_prefix('=');
        Some(NodeInfo {
            nproc_per_node: field("nproc_per_node")?.parse().ok()?,
            max_restarts: field("max_restarts")?.parse().ok()?,
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

/// How a round ended for the whole job, seen by a node whose workers succeeded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RoundResult {
    /// Every node's workers exited 0.
    AllSucceeded,
    /// Another node reported this failure.
    Failed(String),
}

/// One node agent's view of the rendezvous.
pub(crate) struct Rendezvous {
    store: PrefixStore,
    /// For error messages.
    addr: String,
    port: u16,
    node_rank: usize,
    nnodes: usize,
    me: NodeInfo,
}

impl Rendezvous {
    pub fn new(
        store: Arc<dyn Store>,
        addr: &str,
        port: u16,
        node_rank: usize,
        nnodes: usize,
        me: NodeInfo,
    ) -> Self {
        Rendezvous {
            store: PrefixStore::new(PREFIX, store),
            addr: addr.to_string(),
            port,
            node_rank,
            nnodes,
            me,
        }
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

    /// The job's run id: `proposal` if this is node 0, else node 0's.
    pub fn run_id(
        &self,
        proposal: &str,
        timeout: Duration,
        events: &Events,
    ) -> Result<Wait<String>, LaunchError> {
        if self.node_rank == 0 {
            let id = self
                .store
                .compare_set("run_id", b"", proposal.as_bytes())
                .map_err(self.err("publish the run id"))?;
            return Ok(Wait::Done(String::from_utf8_lossy(&id).into_owned()));
        }
        match self.wait_keys(&["run_id".to_string()], timeout, events)? {
            Wait::Done(()) => {}
            Wait::Stopped(signal) => return Ok(Wait::Stopped(signal)),
        }
        let id = self
            .store
            .get("run_id")
            .map_err(self.err("read the run id"))?;
        Ok(Wait::Done(String::from_utf8_lossy(&id).into_owned()))
    }

    /// Announces this node in round `round` and waits until every node has,
    /// checking that they all run the same job shape.
    pub fn join(
        &self,
        round: u32,
        timeout: Duration,
        events: &Events,
    ) -> Result<Wait<()>, LaunchError> {
        let mine = self.me.encode();
        let key = node_key(round, self.node_rank);
        let held = self
            .store
            .compare_set(&key, b"", mine.as_bytes())
            .map_err(self.err(format!("join round {round}")))?;
        if held != mine.as_bytes() {
            return Err(LaunchError::DuplicateNodeRank {
                node_rank: self.node_rank,
                holder: String::from_utf8_lossy(&held).into_owned(),
            });
        }
        let keys: Vec<String> = (0..self.nnodes).map(|n| node_key(round, n)).collect();
        match self.wait_keys(&keys, timeout, events) {
            Ok(Wait::Done(())) => {}
            Ok(stopped) => return Ok(stopped),
            Err(LaunchError::Store {
                source: StoreError::Timeout { .. },
                ..
            }) => {
                let missing: Vec<usize> = (0..self.nnodes)
                    .filter(|&n| !self.store.check(&[&node_key(round, n)]).unwrap_or(false))
                    .collect();
                return Err(LaunchError::JoinTimeout {
                    round,
                    arrived: self.nnodes - missing.len(),
                    nnodes: self.nnodes,
                    missing,
                    timeout,
                });
            }
            Err(e) => return Err(e),
        }
        for (node_rank, key) in keys.iter().enumerate() {
            let value = self
                .store
                .get(key)
                .map_err(self.err(format!("read node {node_rank}'s announcement")))?;
            let text = String::from_utf8_lossy(&value);
            let theirs = NodeInfo::decode(&text).ok_or_else(|| LaunchError::Store {
                addr: self.addr.clone(),
                port: self.port,
                op: format!("read node {node_rank}'s announcement"),
                source: StoreError::Protocol {
                    location: format!("{}:{}", self.addr, self.port),
                    detail: format!("{key} holds {text:?}, not a node announcement"),
                },
            })?;
            let mismatch = |setting, theirs: String, ours: String| LaunchError::NodeMismatch {
                node_rank,
                setting,
                theirs,
                ours,
            };
            if theirs.nproc_per_node != self.me.nproc_per_node {
                return Err(mismatch(
                    "nproc_per_node",
                    theirs.nproc_per_node.to_string(),
                    self.me.nproc_per_node.to_string(),
                ));
            }
            if theirs.max_restarts != self.me.max_restarts {
                return Err(mismatch(
                    "max_restarts",
                    theirs.max_restarts.to_string(),
                    self.me.max_restarts.to_string(),
                ));
            }
        }
        Ok(Wait::Done(()))
    }

    /// Why round `round` failed on some node, if it did.
    pub fn failure(&self, round: u32) -> Result<Option<String>, LaunchError> {
        let key = failed_key(round);
        let op = || format!("check round {round} for failures");
        if !self.store.check(&[&key]).map_err(self.err(op()))? {
            return Ok(None);
        }
        let detail = self.store.get(&key).map_err(self.err(op()))?;
        Ok(Some(String::from_utf8_lossy(&detail).into_owned()))
    }

    /// Records that round `round` failed; the first node to report wins.
    pub fn report_failure(&self, round: u32, detail: &str) -> Result<(), LaunchError> {
        self.store
            .compare_set(&failed_key(round), b"", detail.as_bytes())
            .map(drop)
            .map_err(self.err(format!("report round {round}'s failure")))
    }

    /// Marks the job as not restarting again.
    pub fn close(&self) -> Result<(), LaunchError> {
        self.store
            .set("closed", b"1")
            .map_err(self.err("close the rendezvous"))
    }

    /// Whether some node closed the job.
    pub fn is_closed(&self) -> Result<bool, LaunchError> {
        self.store
            .check(&["closed"])
            .map_err(self.err("check whether the rendezvous is closed"))
    }

    /// Records that this node's workers all succeeded in round `round` and
    /// waits until every node's did, or one reports a failure.
    pub fn finish(&self, round: u32, events: &Events) -> Result<Wait<RoundResult>, LaunchError> {
        let key = format!("round/{round}/succeeded");
        let mut done = self
            .store
            .add(&key, 1)
            .map_err(self.err(format!("report round {round}'s success")))?;
        loop {
            if done >= self.nnodes as i64 {
                return Ok(Wait::Done(RoundResult::AllSucceeded));
            }
            if let Some(detail) = self.failure(round)? {
                return Ok(Wait::Done(RoundResult::Failed(detail)));
            }
            if let Some(signal) = events.pending_stop() {
                return Ok(Wait::Stopped(signal));
            }
            thread::sleep(PEER_POLL);
            done = self
                .store
                .add(&key, 0)
                .map_err(self.err(format!("count round {round}'s successes")))?;
        }
    }

    /// Says this agent is done with the store. Node 0, which hosts it, then
    /// waits (up to `timeout`, or until a stop signal) for the others to say
    /// so, so that none of them loses the store while reading how the job ended.
    pub fn leave(&self, timeout: Duration, events: &Events) -> Result<(), LaunchError> {
        let mut left = self
            .store
            .add("left", 1)
            .map_err(self.err("leave the rendezvous"))?;
        if self.node_rank != 0 {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        while left < self.nnodes as i64
            && Instant::now() < deadline
            && events.pending_stop().is_none()
        {
            thread::sleep(PEER_POLL);
            left = self
                .store
                .add("left", 0)
                .map_err(self.err("count the agents that left"))?;
        }
        Ok(())
    }

    /// Waits for `keys` in short slices, so that a stop signal is noticed
    /// while the other nodes are awaited.
    fn wait_keys(
        &self,
        keys: &[String],
        timeout: Duration,
        events: &Events,
    ) -> Result<Wait<()>, LaunchError> {
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let deadline = Instant::now() + timeout;
        loop {
            let slice = deadline
                .saturating_duration_since(Instant::now())
                .min(PEER_POLL * 4);
            match self.store.wait(&keys, slice) {
                Ok(()) => return Ok(Wait::Done(())),
                Err(StoreError::Timeout { .. }) if Instant::now() < deadline => {}
                Err(StoreError::Timeout { keys, .. }) => {
                    return Err(self.err("wait for the other nodes")(StoreError::Timeout {
                        keys,
                        timeout,
                    }))
                }
                Err(e) => return Err(self.err("wait for the other nodes")(e)),
            }
            if let Some(signal) = events.pending_stop() {
                return Ok(Wait::Stopped(signal));
            }
        }
    }
}

fn node_key(round: u32, node_rank: usize) -> String {
    format!("round/{round}/node/{node_rank}")
}

fn failed_key(round: u32) -> String {
    format!("round/{round}/failed")
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_store::HashStore;

    fn info(nproc_per_node: usize) -> NodeInfo {
        NodeInfo {
            nproc_per_node,
            max_restarts: 1,
            host: "host a".into(),
            pid: 42,
        }
    }

    fn agents(store: &Arc<HashStore>, infos: &[NodeInfo]) -> Vec<Rendezvous> {
        infos
            .iter()
            .enumerate()
            .map(|(n, me)| {
                Rendezvous::new(store.clone(), "127.0.0.1", 1, n, infos.len(), me.clone())
            })
            .collect()
    }

    #[test]
    fn node_info_survives_encoding_even_with_spaces_in_the_host() {
        let me = info(3);
        assert_eq!(NodeInfo::decode(&me.encode()), Some(me));
        assert_eq!(NodeInfo::decode("nproc_per_node=x"), None);
    }

    #[test]
    fn nodes_join_agree_on_the_run_id_and_see_each_others_failures() {
        let events = Events::install().unwrap();
        let store = Arc::new(HashStore::new());
        let [a, b] = <[Rendezvous; 2]>::try_from(agents(&store, &[info(2), info(2)]))
            .ok()
            .unwrap();
        let t = Duration::from_secs(5);
        let joined = thread::scope(|s| {
            let h = s.spawn(|| {
                let events = Events::install().unwrap();
                (b.run_id("ignored", t, &events), b.join(0, t, &events))
            });
            let mine = (a.run_id("run-a", t, &events), a.join(0, t, &events));
            (mine, h.join().unwrap())
        });
        let ((id_a, join_a), (id_b, join_b)) = joined;
        assert_eq!(id_a.unwrap(), Wait::Done("run-a".to_string()));
        assert_eq!(id_b.unwrap(), Wait::Done("run-a".to_string()));
        assert_eq!(join_a.unwrap(), Wait::Done(()));
        assert_eq!(join_b.unwrap(), Wait::Done(()));

        assert_eq!(a.failure(0).unwrap(), None);
        b.report_failure(0, "rank 3 failed").unwrap();
        a.report_failure(0, "rank 0 failed later").unwrap();
        assert_eq!(a.failure(0).unwrap().as_deref(), Some("rank 3 failed"));
        // The failure belongs to round 0 only.
        assert_eq!(a.failure(1).unwrap(), None);
        assert_eq!(
            a.finish(0, &events).unwrap(),
            Wait::Done(RoundResult::Failed("rank 3 failed".into()))
        );
        assert!(!a.is_closed().unwrap());
        b.close().unwrap();
        assert!(a.is_closed().unwrap());
    }

    #[test]
    fn a_round_succeeds_when_every_node_finished() {
        let store = Arc::new(HashStore::new());
        let nodes = agents(&store, &[info(1), info(1), info(1)]);
        let results: Vec<_> = thread::scope(|s| {
            let handles: Vec<_> = nodes
                .iter()
                .map(|n| s.spawn(|| n.finish(2, &Events::install().unwrap())))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap().unwrap())
                .collect()
        });
        assert!(results
            .iter()
            .all(|r| *r == Wait::Done(RoundResult::AllSucceeded)));
    }

    #[test]
    fn mismatched_and_duplicate_nodes_are_named() {
        let events = Events::install().unwrap();
        let t = Duration::from_secs(5);
        let store = Arc::new(HashStore::new());
        let [a, b] = <[Rendezvous; 2]>::try_from(agents(&store, &[info(2), info(4)]))
            .ok()
            .unwrap();
        let (ra, rb) = thread::scope(|s| {
            let h = s.spawn(|| b.join(0, t, &Events::install().unwrap()));
            (a.join(0, t, &events), h.join().unwrap())
        });
        let err = ra.unwrap_err().to_string();
        assert!(
            err.contains("node 1") && err.contains("nproc_per_node = 4"),
            "{err}"
        );
        assert!(rb.is_err());

        let store = Arc::new(HashStore::new());
        let a = Rendezvous::new(store.clone(), "h", 1, 0, 2, info(2));
        let mut other = info(2);
        other.pid = 7;
        let twin = Rendezvous::new(store, "h", 1, 0, 2, other);
        let _ = a.join(0, Duration::from_millis(1), &events);
        let err = twin.join(0, t, &events).unwrap_err();
        assert!(
            matches!(err, LaunchError::DuplicateNodeRank { node_rank: 0, .. }),
            "{err}"
        );
    }

    #[test]
    fn a_missing_node_is_a_timeout_naming_it() {
        let events = Events::install().unwrap();
        let store = Arc::new(HashStore::new());
        let a = Rendezvous::new(store, "h", 1, 0, 3, info(1));
        let err = a.join(0, Duration::from_millis(300), &events).unwrap_err();
        match err {
            LaunchError::JoinTimeout {
                arrived, missing, ..
            } => assert_eq!((arrived, missing), (1, vec![1, 2])),
            other => panic!("{other}"),
        }
    }
}

//! Heartbeats: how the node agents of a job notice that one of them is gone
//! (its machine died, its network broke, it was SIGKILLed or stopped) even
//! when its workers did not fail first. Each agent bumps a counter in the
//! rendezvous store from a thread of its own; each agent watches the
//! counters of the other nodes of its round, and a counter that has not
//! moved for the heartbeat timeout, measured on the watcher's own clock (so
//! the nodes' clocks need not agree), is a lost node. This module only
//! reads and writes counters; it never touches a process.

use std::collections::HashMap;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use cohort_store::Store;

use crate::health::AgentStatus;

/// The store key of node `node_rank`'s heartbeat counter.
pub(crate) fn heartbeat_key(node_rank: usize) -> String {
    format!("heartbeat/{node_rank}")
}

/// How often an agent beats for a given timeout: several beats per timeout,
/// so that one slow store call does not make a live node look dead.
pub(crate) fn beat_interval(timeout: Duration) -> Duration {
    (timeout / 5).clamp(Duration::from_millis(20), Duration::from_secs(3))
}

/// The thread that beats for this agent until dropped.
pub(crate) struct Heartbeat {
    /// Dropping it wakes the thread at once, mid-interval: a job's exit
    /// must not wait out a beat.
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Heartbeat {
    /// Starts beating for `node_rank` in `store` (already in the launcher's
    /// namespace) every `interval`; each beat that reaches the store is
    /// recorded in `status`. A failed beat is not fatal here: the agent's
    /// own store calls report a lost store, and the other agents decide
    /// whether this node is lost.
    pub fn start(
        store: Arc<dyn Store>,
        node_rank: usize,
        interval: Duration,
        status: Arc<AgentStatus>,
    ) -> std::io::Result<Self> {
        let (stop, stopped) = mpsc::channel::<()>();
        let key = heartbeat_key(node_rank);
        let thread = thread::Builder::new()
            .name("launcher heartbeat".into())
            .spawn(move || loop {
                if store.add(&key, 1).is_ok() {
                    status.beat();
                }
                match stopped.recv_timeout(interval) {
                    Err(RecvTimeoutError::Timeout) => continue,
                    Ok(()) | Err(RecvTimeoutError::Disconnected) => break,
                }
            })?;
        Ok(Heartbeat {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A node whose heartbeat stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lost {
    /// Its node rank.
    pub node_rank: usize,
    /// How long its counter has not moved, as this agent saw it.
    pub silent_for: Duration,
}

/// One agent's view of the other nodes' heartbeats.
pub(crate) struct Liveness {
    timeout: Duration,
    /// Last counter value seen per node, and when it last changed.
    seen: HashMap<usize, (i64, Instant)>,
}

impl Liveness {
    pub fn new(timeout: Duration) -> Self {
        Liveness {
            timeout,
            seen: HashMap::new(),
        }
    }

    /// Starts watching `nodes` afresh: each gets a full timeout from now
    /// (a round's start, when nothing is known yet).
    pub fn watch(&mut self, nodes: &[usize]) {
        let now = Instant::now();
        self.seen = nodes.iter().map(|&n| (n, (i64::MIN, now))).collect();
    }

    /// Reads every watched node's counter through `read` and returns the
    /// first whose counter has not moved for the timeout.
    pub fn check<E>(
        &mut self,
        mut read: impl FnMut(usize) -> Result<i64, E>,
    ) -> Result<Option<Lost>, E> {
        let now = Instant::now();
        let mut nodes: Vec<usize> = self.seen.keys().copied().collect();
        nodes.sort_unstable();
        for node_rank in nodes {
            let beats = read(node_rank)?;
            let (last, since) = self.seen.get_mut(&node_rank).expect("watched node");
            if beats != *last {
                *last = beats;
                *since = now;
            } else if now.duration_since(*since) > self.timeout {
                return Ok(Some(Lost {
                    node_rank,
                    silent_for: now.duration_since(*since),
                }));
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_store::HashStore;

    #[test]
    fn a_beating_node_stays_alive_and_a_silent_one_is_lost_after_the_timeout() {
        let store = Arc::new(HashStore::new());
        let status = Arc::new(AgentStatus::new(Duration::from_secs(1)));
        let _beating =
            Heartbeat::start(store.clone(), 0, Duration::from_millis(20), status.clone()).unwrap();
        let mut liveness = Liveness::new(Duration::from_millis(300));
        liveness.watch(&[0, 1]);
        let read = |n: usize| store.add(&heartbeat_key(n), 0);
        let started = Instant::now();
        let lost = loop {
            if let Some(lost) = liveness.check(read).unwrap() {
                break lost;
            }
            assert!(started.elapsed() < Duration::from_secs(5), "never lost");
            thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(lost.node_rank, 1, "node 0 beats, node 1 never did");
        assert!(lost.silent_for > Duration::from_millis(300));
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert!(status.healthy(), "the beats reached the store");
    }

    #[test]
    fn dropping_the_heartbeat_stops_the_beats() {
        let store = Arc::new(HashStore::new());
        let status = Arc::new(AgentStatus::new(Duration::from_secs(1)));
        let beat = Heartbeat::start(store.clone(), 3, Duration::from_millis(10), status).unwrap();
        while store.add(&heartbeat_key(3), 0).unwrap() < 2 {
            thread::sleep(Duration::from_millis(5));
        }
        drop(beat);
        let after = store.add(&heartbeat_key(3), 0).unwrap();
        thread::sleep(Duration::from_millis(60));
        assert_eq!(store.add(&heartbeat_key(3), 0).unwrap(), after);
    }

    #[test]
    fn the_interval_is_a_fraction_of_the_timeout_within_bounds() {
        assert_eq!(
            beat_interval(Duration::from_secs(10)),
            Duration::from_secs(2)
        );
        assert_eq!(
            beat_interval(Duration::from_millis(50)),
            Duration::from_millis(20)
        );
        assert_eq!(
            beat_interval(Duration::from_secs(600)),
            Duration::from_secs(3)
        );
    }
}

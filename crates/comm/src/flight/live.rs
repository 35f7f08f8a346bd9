//! The flight recorder seen from outside a running job: every rank of a group
//! of two or more publishes the newest [`TAIL`] records of its ring in the
//! group's store every [`INTERVAL`] (a thread per group, started by the group),
//! so that a launcher that finds a worker silent, or `cohort debug dump`, can
//! gather every reachable rank's ring ([`gather`]) and say where each rank is
//! ([`summary`]) and who diverged ([`super::verdict`]) without stopping the job.
//! A frozen rank's ring is the one it published last.
//!
//! Cost: one store write of a few kilobytes per rank every [`INTERVAL`], off
//! the training thread. This module only reads and writes the store; it never
//! runs a collective or touches a ring but through [`super::Ring::tail`].

use std::sync::Arc;
use std::time::Duration;

use cohort_store::{PrefixStore, Store};

use super::{shape, where_, Dump};

/// How often a rank publishes its ring.
pub const INTERVAL: Duration = Duration::from_secs(2);
/// Records each publication carries: enough to see past a step's collectives.
pub const TAIL: usize = 32;
/// Restart incarnations [`find`] looks through (the launcher's `restart<N>` prefixes).
const MAX_RESTARTS: u32 = 1000;

/// The key rank `rank` of group `group` publishes its ring under.
pub fn key(group: &str, rank: usize) -> String {
    format!("flight/{group}/live/{rank}")
}

/// The key holding the group's size, written by each rank at its first publication.
pub fn world_key(group: &str) -> String {
    format!("flight/{group}/live/world")
}

/// The group's store as its ranks see it, from the job's store `root`: a launcher's
/// workers meet under `restart<N>/` (the newest incarnation that published), a job
/// started without one at the root. `None` when no rank of `group` published there.
pub fn find(root: Arc<dyn Store>, group: &str) -> Option<Arc<dyn Store>> {
    let world = world_key(group);
    let mut newest: Option<u32> = None;
    for n in 0..MAX_RESTARTS {
        if matches!(root.check(&[&format!("restart{n}/{world}")]), Ok(true)) {
            newest = Some(n);
        } else if n > newest.map_or(1, |m| m + 1) {
            // Incarnations are numbered from 0; one may have failed before it published.
            break;
        }
    }
    if let Some(n) = newest {
        return Some(Arc::new(PrefixStore::new(format!("restart{n}"), root)));
    }
    matches!(root.check(&[&world]), Ok(true)).then_some(root)
}

/// Every rank's last published ring in `store` (the group's store, see [`find`]), and the
/// group's size when known. A rank that never published is left out.
pub fn gather(store: &dyn Store, group: &str) -> (Option<usize>, Vec<Dump>) {
    let world = (store.check(&[&world_key(group)]).ok())
        .filter(|found| *found)
        .and_then(|_| store.get(&world_key(group)).ok())
        .and_then(|b| String::from_utf8_lossy(&b).trim().parse::<usize>().ok());
    let mut dumps = Vec::new();
    for rank in 0..world.unwrap_or(0) {
        let k = key(group, rank);
        if !matches!(store.check(&[&k]), Ok(true)) {
            continue;
        }
        if let Some(d) =
            (store.get(&k).ok()).and_then(|b| Dump::from_lines(rank, &String::from_utf8_lossy(&b)))
        {
            dumps.push(d);
        }
    }
    (world, dumps)
}

/// Where one rank is, in a line: the collective it is in (and for how long), or the last
/// one it finished.
pub fn summary(d: &Dump) -> String {
    if let Some(r) = d.pending() {
        let waited = d.now_us.saturating_sub(r.issued_us) as f64 / 1e6;
        return format!(
            "rank {}: in {} ({}, {waited:.1} s), issued {}",
            d.rank,
            shape(r),
            r.state.name(),
            where_(r)
        );
    }
    match d.records.last() {
        Some(r) => format!(
            "rank {}: between collectives; its last: {} (completed), {}",
            d.rank,
            shape(r),
            where_(r)
        ),
        None => format!("rank {}: no collective yet", d.rank),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::element::DType;
    use crate::flight::{set_context, Ring};
    use crate::kinds::OpKind;
    use cohort_store::HashStore;

    #[test]
    fn published_rings_are_found_under_the_newest_restart_and_summarised() {
        let _context = crate::flight::CONTEXT_TEST_LOCK
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let root: Arc<dyn Store> = Arc::new(HashStore::new());
        assert!(find(root.clone(), "default").is_none());
        let ring = Ring::new(8);
        set_context("forward", 7);
        ring.issued(0, OpKind::AllReduce, 64, Some(DType::F32));
        ring.completed(0);
        ring.issued(1, OpKind::Broadcast, 4, Some(DType::I32));
        for n in [0, 1] {
            let store = PrefixStore::new(format!("restart{n}"), root.clone());
            store.set(&world_key("default"), b"2").unwrap();
            let tail = ring.tail(n, 1);
            store
                .set(&key("default", 0), tail.to_lines().as_bytes())
                .unwrap();
        }
        let store = find(root, "default").unwrap();
        let (world, dumps) = gather(&*store, "default");
        assert_eq!((world, dumps.len()), (Some(2), 1));
        // Restart 1 published rank 1's tail as rank 0's key: its rank is the key's.
        let line = summary(&dumps[0]);
        assert!(
            line.starts_with("rank 0: in broadcast #1 of 4 B I32 (issued, ")
                && line.ends_with("issued in forward at step 7"),
            "{line}"
        );
        let done = ring.tail(3, 8);
        let mut done = done.clone();
        done.records.pop();
        assert_eq!(
            summary(&done),
            "rank 3: between collectives; its last: all_reduce #0 of 64 B F32 (completed), \
             in forward at step 7"
        );
    }
}

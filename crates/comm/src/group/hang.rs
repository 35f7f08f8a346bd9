//! What a rank does after a collective of its group failed for good: it
//! publishes its flight recorder's ring in the group's store, and the first
//! rank to fail gathers the others' and says in one line who diverged
//! ([`flight::verdict`]). While the group lives, a thread of its own
//! publishes the tail of its ring in the store ([`flight::live`]), for a
//! launcher or `cohort debug dump` to read. It must never run or retry a
//! collective.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::flight;

use super::Inner;

/// Starts the thread that publishes `inner`'s ring every [`flight::live::INTERVAL`] while
/// the group lives (groups of two or more ranks with the recorder on). Best effort: a
/// store write that fails is tried again at the next interval.
pub(super) fn publish_live(inner: &Arc<Inner>) {
    if inner.size < 2 || !inner.flight.is_on() {
        return;
    }
    let weak: Weak<Inner> = Arc::downgrade(inner);
    let _ = std::thread::Builder::new()
        .name("cohort-flight".into())
        .spawn(move || {
            let mut announced = false;
            loop {
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                let name = &inner.opts.name;
                if !announced {
                    let world = inner.size.to_string();
                    announced = inner
                        .store
                        .set(&flight::live::world_key(name), world.as_bytes())
                        .is_ok();
                }
                let tail = inner.flight.tail(inner.rank, flight::live::TAIL);
                let key = flight::live::key(name, inner.rank);
                let _ = inner.store.set(&key, tail.to_lines().as_bytes());
                drop(inner);
                std::thread::sleep(flight::live::INTERVAL);
            }
        });
}

impl Inner {
    /// After a collective failed for good: publishes this rank's ring in the
    /// store (as authenticated as the group's store is); the first rank of
    /// the group to fail gathers the rings the others publish within a few
    /// seconds and says in one line which rank diverged (see
    /// [`flight::verdict`]), on stderr and in [`ProcessGroup::flight_verdict`];
    /// with a dump directory ([`flight::dump_dir`]), every rank's ring is
    /// also written there as JSON; the other failing ranks wait (briefly)
    /// until it has. Best effort: a store that fails only loses the diagnosis.
    pub(super) fn explain_hang(&self) {
        let name = &self.opts.name;
        let key = |rank: usize| format!("flight/{name}/{rank}");
        let dump = self.flight.dump(self.rank);
        if self
            .store
            .set(&key(self.rank), dump.to_lines().as_bytes())
            .is_err()
        {
            return;
        }
        // The others fail soon after this rank aborts (their sockets close),
        // or at their own timeout; a dead rank never publishes, so the wait is
        // short (it delays only the failing ranks' errors).
        let window = (self.opts.timeout / 2).min(Duration::from_secs(2));
        let explained = format!("flight/{name}/explained");
        if !matches!(
            self.store.add(&format!("flight/{name}/explainer"), 1),
            Ok(1)
        ) {
            // Stay until the explainer has spoken: a rank that exits now
            // would have a launcher stop the explainer mid-sentence.
            let _ = self
                .store
                .wait(&[&explained], window + Duration::from_secs(1));
            return;
        }
        let deadline = Instant::now() + window;
        let mut dumps = vec![dump];
        for rank in (0..self.size).filter(|r| *r != self.rank) {
            let left = deadline.saturating_duration_since(Instant::now());
            let k = key(rank);
            if self
                .store
                .wait(&[&k], left.max(Duration::from_millis(1)))
                .is_err()
            {
                continue;
            }
            let got = self.store.get(&k).ok();
            if let Some(d) =
                got.and_then(|b| flight::Dump::from_lines(rank, &String::from_utf8_lossy(&b)))
            {
                dumps.push(d);
            }
        }
        dumps.sort_by_key(|d| d.rank);
        if let Some(dir) = flight::dump_dir() {
            for d in &dumps {
                let path = dir.join(format!("flight-{name}-rank{}.json", d.rank));
                let _ =
                    std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, d.to_json()));
            }
        }
        if let Some(line) = flight::verdict(name, self.size, &dumps) {
            eprintln!("flight recorder (group {name}): {line}");
            *self.verdict.lock().unwrap_or_else(|e| e.into_inner()) = Some(line);
        }
        let _ = self.store.set(&explained, b"1");
    }
}

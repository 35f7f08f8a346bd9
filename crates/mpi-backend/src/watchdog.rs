//! The deadline of MPI calls (NCCL's watchdog, for MPI).
//!
//! MPI calls block until they complete and cannot be cancelled, so a
//! missing or dead peer would hang a rank forever. Every call registers
//! itself here ([`Watchdog::watch`]) with its deadline, and a thread checks
//! the registered calls a few times per timeout; the first call found past
//! its deadline is handed to the expiry function, which in the backend
//! prints it and ends the job (`MPI_Abort`). Registering costs two
//! uncontended mutex locks and no wake-up: the thread polls, so a
//! timeout is noticed at most one tick (an eighth of the timeout, 10 ms to
//! 1 s) late. This module must never call MPI itself.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cohort_comm::{OpContext, OpKind};

/// A call that did not complete in time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Expired {
    pub(crate) op: OpKind,
    pub(crate) seq: u64,
    pub(crate) timeout: Duration,
}

struct Pending {
    id: u64,
    deadline: Instant,
    call: Expired,
}

#[derive(Default)]
struct Calls {
    pending: Vec<Pending>,
    next_id: u64,
    stop: bool,
}

struct Shared {
    calls: Mutex<Calls>,
    stopped: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Calls> {
        self.calls.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Watches the calls of one backend from a thread of its own.
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// A registered call; dropping it (however the call ends) unregisters it.
pub(crate) struct Watch<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        self.shared.lock().pending.retain(|p| p.id != self.id);
    }
}

impl Watchdog {
    /// Starts the thread; `on_expiry` runs on it for the first overdue call
    /// (and the watchdog stops watching after that: the job is ending).
    pub(crate) fn start(
        timeout: Duration,
        on_expiry: impl FnOnce(Expired) + Send + 'static,
    ) -> std::io::Result<Watchdog> {
        let shared = Arc::new(Shared {
            calls: Mutex::new(Calls::default()),
            stopped: Condvar::new(),
        });
        let tick = (timeout / 8).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("cohort-mpi-watchdog".to_string())
            .spawn(move || {
                let mut calls = s.lock();
                loop {
                    if calls.stop {
                        return;
                    }
                    let now = Instant::now();
                    if let Some(p) = calls.pending.iter().find(|p| p.deadline <= now) {
                        let call = p.call.clone();
                        drop(calls);
                        on_expiry(call);
                        return;
                    }
                    calls = s
                        .stopped
                        .wait_timeout(calls, tick)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            })?;
        Ok(Watchdog {
            shared,
            thread: Some(thread),
        })
    }

    /// Registers the call `ctx` describes, due within `ctx.timeout`.
    pub(crate) fn watch(&self, ctx: &OpContext) -> Watch<'_> {
        let deadline = Instant::now() + ctx.timeout;
        let mut calls = self.shared.lock();
        let id = calls.next_id;
        calls.next_id += 1;
        calls.pending.push(Pending {
            id,
            deadline,
            call: Expired {
                op: ctx.op,
                seq: ctx.seq,
                timeout: ctx.timeout,
            },
        });
        Watch {
            shared: &self.shared,
            id,
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.stopped.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_comm::{Algorithm, DebugLevel};
    use std::sync::mpsc;

    fn ctx(op: OpKind, seq: u64, timeout: Duration) -> OpContext {
        OpContext {
            op,
            seq,
            group: "default".to_string(),
            timeout,
            algorithm: Algorithm::Auto,
            debug: DebugLevel::Off,
        }
    }

    #[test]
    fn an_overdue_call_is_reported_within_a_tick_and_finished_ones_never() {
        let timeout = Duration::from_millis(200);
        let (tx, rx) = mpsc::channel();
        let dog = Watchdog::start(timeout, move |e| tx.send((e, Instant::now())).unwrap()).unwrap();
        for seq in 0..50 {
            drop(dog.watch(&ctx(OpKind::AllReduce, seq, timeout)));
        }
        std::thread::sleep(timeout * 2);
        assert!(rx.try_recv().is_err(), "completed calls must not expire");

        let start = Instant::now();
        let _w = dog.watch(&ctx(OpKind::Broadcast, 50, timeout));
        let (e, at) = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(
            e,
            Expired {
                op: OpKind::Broadcast,
                seq: 50,
                timeout
            }
        );
        let late = at.duration_since(start);
        assert!(
            late >= timeout && late < timeout + Duration::from_millis(150),
            "reported after {late:?}"
        );
    }

    #[test]
    fn dropping_the_watchdog_stops_its_thread_promptly() {
        let dog = Watchdog::start(Duration::from_secs(3600), |_| unreachable!()).unwrap();
        let _w = dog.watch(&ctx(OpKind::Barrier, 0, Duration::from_secs(3600)));
        let t0 = Instant::now();
        drop(_w);
        drop(dog);
        assert!(t0.elapsed() < Duration::from_millis(500));
    }
}

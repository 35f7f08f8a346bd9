//! The board between the RPC handlers and the server thread: workers' pushes wait here for the
//! server, and the server's answers (parameters, or the reason it stopped) wait here for the
//! handlers to send. Handlers only pass data through it; the server thread owns the model, and
//! the board never touches it.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cohort_rpc::{Floats, Registry};

use super::messages::{Params, Push};
use crate::config::PsMode;

/// What the handlers and the server's thread share.
pub(super) struct Board {
    pub(super) mode: PsMode,
    pub(super) workers: usize,
    /// How long a push may wait for its answer (the RPC timeout).
    pub(super) wait_limit: Duration,
    pub(super) st: Mutex<BoardState>,
    pub(super) cv: Condvar,
}

pub(super) struct BoardState {
    pub(super) params: Arc<Vec<f32>>,
    pub(super) version: u64,
    pub(super) done: bool,
    /// Where the workers' data start (epoch, offset).
    pub(super) start: (u64, usize),
    /// Set when the server's loop fails: every waiting push returns it.
    pub(super) failed: Option<String>,
    /// Sync: this step's push of each worker.
    pub(super) inbox: Vec<Option<Push>>,
    /// Async: pushes in arrival order, with their tickets.
    pub(super) queue: VecDeque<(u64, Push)>,
    pub(super) next_ticket: u64,
    /// Async: every ticket below this one is answered.
    pub(super) answered: u64,
}

impl Board {
    pub(super) fn lock(&self) -> MutexGuard<'_, BoardState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn register(self: &Arc<Self>, registry: &mut Registry) {
        let board = self.clone();
        registry.register("ps.pull", move |_, ()| {
            let st = board.lock();
            Ok::<_, String>(board.reply(st))
        });
        let board = self.clone();
        registry.register("ps.push", move |_, push: Push| board.push(push));
    }

    /// The current parameters (copied outside the lock).
    pub(super) fn reply(&self, st: MutexGuard<'_, BoardState>) -> Params {
        let (params, version, done, start) = (st.params.clone(), st.version, st.done, st.start);
        drop(st);
        Params {
            version,
            done,
            params: Floats(params.to_vec()),
            epoch: start.0,
            offset: start.1 as u64,
        }
    }

    pub(super) fn push(&self, push: Push) -> Result<Params, String> {
        let mut st = self.lock();
        let w = push.worker as usize;
        if w >= self.workers {
            return Err(format!("worker index {w} out of {} workers", self.workers));
        }
        if let Some(f) = &st.failed {
            return Err(format!("the server failed: {f}"));
        }
        if st.done {
            return Ok(self.reply(st));
        }
        let ready: Box<dyn Fn(&BoardState) -> bool> = match self.mode {
            PsMode::Sync => {
                if push.version != st.version || st.inbox[w].is_some() {
                    return Err(format!(
                        "worker {} pushed a gradient of step {} while the server is at step {}",
                        w + 1,
                        push.version + 1,
                        st.version + 1
                    ));
                }
                let step = push.version;
                st.inbox[w] = Some(push);
                Box::new(move |st: &BoardState| st.version > step)
            }
            PsMode::Async => {
                let ticket = st.next_ticket;
                st.next_ticket += 1;
                st.queue.push_back((ticket, push));
                Box::new(move |st: &BoardState| st.answered > ticket)
            }
        };
        self.cv.notify_all();
        let deadline = Instant::now() + self.wait_limit;
        while !(ready(&st) || st.done || st.failed.is_some()) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "no update from the server within {:?}",
                    self.wait_limit
                ));
            }
            st = self
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        if let Some(f) = &st.failed {
            return Err(format!("the server failed: {f}"));
        }
        Ok(self.reply(st))
    }
}

//! Work handles of asynchronous operations.
//!
//! A [`Work`] is filled exactly once by the thread that ran the operation.
//! Dropping it does not cancel anything: the operation still runs in its
//! turn (as in c10d), and its buffer is dropped with the result.

use std::sync::{Arc, Condvar, Mutex};

use crate::error::CommError;
use crate::kinds::OpKind;

struct Slot<R> {
    result: Mutex<Option<Result<R, CommError>>>,
    done: Condvar,
}

/// The pending result of an asynchronous operation (c10d's `Work`).
///
/// `R` is what the operation hands back: the buffer(s) it was given, so
/// that async calls can own their memory while the caller keeps going.
pub struct Work<R> {
    slot: Arc<Slot<R>>,
    op: OpKind,
    seq: u64,
}

/// The filling end of a [`Work`].
pub(crate) struct Completer<R> {
    slot: Arc<Slot<R>>,
}

impl<R> Work<R> {
    pub(crate) fn new(op: OpKind, seq: u64) -> (Work<R>, Completer<R>) {
        let slot = Arc::new(Slot {
            result: Mutex::new(None),
            done: Condvar::new(),
        });
        (
            Work {
                slot: slot.clone(),
                op,
                seq,
            },
            Completer { slot },
        )
    }

    /// A work that has already failed (the group was aborted before the call).
    pub(crate) fn failed(op: OpKind, err: CommError) -> Work<R> {
        let (w, c) = Work::new(op, 0);
        c.complete(Err(err));
        w
    }

    /// Blocks until the operation finished and returns its result. Never
    /// hangs: every operation fails at the latest after the group's timeout.
    pub fn wait(self) -> Result<R, CommError> {
        let mut r = self.slot.result.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(res) = r.take() {
                return res;
            }
            r = self.slot.done.wait(r).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Whether the operation finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        self.slot
            .result
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// The operation.
    pub fn op(&self) -> OpKind {
        self.op
    }

    /// Its sequence number (collectives: in the group; send/recv: in this process).
    pub fn seq(&self) -> u64 {
        self.seq
    }
}

impl<R> std::fmt::Debug for Work<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("op", &self.op)
            .field("seq", &self.seq)
            .field("completed", &self.is_completed())
            .finish()
    }
}

impl<R> Completer<R> {
    pub(crate) fn complete(self, r: Result<R, CommError>) {
        *self.slot.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        self.slot.done.notify_all();
    }
}

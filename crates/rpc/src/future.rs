//! The result of a call that may not have come back yet.
//!
//! A [`Slot`] is filled exactly once, by whoever takes the call out of the
//! agent's table of pending calls: the connection's reader (the reply came),
//! the timeout reaper, or the code that saw the peer die. Every pending call
//! is therefore completed by its deadline at the latest, however (and
//! whether) it is waited for. An [`RpcFuture`] waits on a slot, either by
//! blocking ([`RpcFuture::wait`]) or as a `std::future::Future`, and decodes
//! the result. This module never touches a socket.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use serde::de::DeserializeOwned;

use crate::error::RpcError;
use crate::rref::{with_agent, RRefAgent};

/// Where a call's result lands: encoded bytes, or why there are none.
#[derive(Default)]
pub(crate) struct Slot {
    state: Mutex<SlotState>,
    cv: Condvar,
}

#[derive(Default)]
struct SlotState {
    result: Option<Result<Vec<u8>, RpcError>>,
    taken: bool,
    waker: Option<Waker>,
}

impl Slot {
    pub(crate) fn new() -> Arc<Slot> {
        Arc::new(Slot::default())
    }

    /// A slot that already holds `r` (a call that failed before leaving).
    pub(crate) fn ready(r: Result<Vec<u8>, RpcError>) -> Arc<Slot> {
        let s = Slot::new();
        s.complete(r);
        s
    }

    fn lock(&self) -> MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fills the slot and wakes its waiter.
    pub(crate) fn complete(&self, r: Result<Vec<u8>, RpcError>) {
        let waker = {
            let mut st = self.lock();
            st.result = Some(r);
            st.waker.take()
        };
        self.cv.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        let st = self.lock();
        st.result.is_some() || st.taken
    }

    /// Blocks until the slot is filled and takes its content.
    pub(crate) fn wait(&self) -> Result<Vec<u8>, RpcError> {
        let mut st = self.lock();
        loop {
            if let Some(r) = st.result.take() {
                st.taken = true;
                return r;
            }
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn poll(&self, cx: &mut Context<'_>) -> Poll<Result<Vec<u8>, RpcError>> {
        let mut st = self.lock();
        match st.result.take() {
            Some(r) => {
                st.taken = true;
                Poll::Ready(r)
            }
            None => {
                st.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// The pending result of [`Rpc::rpc_async`](crate::Rpc::rpc_async).
///
/// It completes when the answer arrives, when the call's timeout passes
/// ([`RpcError::Timeout`]) or as soon as the worker is seen to die
/// ([`RpcError::WorkerGone`]), whichever comes first; it never waits past
/// the timeout. Wait for it with [`wait`](RpcFuture::wait), or `.await` it
/// in any executor (it implements `Future`).
///
/// # Cancel safety
/// Dropping it does not cancel the call: the callee still runs the handler.
/// A result that carries [`RRef`](crate::RRef)s must be waited for, or the
/// references it holds are never released on their owners.
#[must_use = "a call's result or error is only seen by waiting for it"]
pub struct RpcFuture<T> {
    slot: Arc<Slot>,
    agent: Arc<dyn RRefAgent>,
    func: String,
    _t: PhantomData<fn() -> T>,
}

impl<T: DeserializeOwned> RpcFuture<T> {
    pub(crate) fn new(slot: Arc<Slot>, agent: Arc<dyn RRefAgent>, func: &str) -> Self {
        RpcFuture {
            slot,
            agent,
            func: func.to_string(),
            _t: PhantomData,
        }
    }

    /// Whether the result (or error) is in.
    pub fn is_done(&self) -> bool {
        self.slot.is_done()
    }

    /// Blocks until the call completes and returns its result.
    pub fn wait(self) -> Result<T, RpcError> {
        let bytes = self.slot.wait()?;
        self.decode(&bytes)
    }

    fn decode(&self, bytes: &[u8]) -> Result<T, RpcError> {
        with_agent(self.agent.clone(), || postcard::from_bytes(bytes)).map_err(|e| {
            RpcError::Codec {
                func: self.func.clone(),
                op: "decode",
                what: "result",
                detail: e.to_string(),
            }
        })
    }
}

impl<T: DeserializeOwned> Future for RpcFuture<T> {
    type Output = Result<T, RpcError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.slot.poll(cx) {
            Poll::Ready(Ok(bytes)) => Poll::Ready(self.decode(&bytes)),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}

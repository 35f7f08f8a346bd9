//! [`Communicator`]: one rank of an NCCL communicator on one GPU, its collectives queued on
//! the CUDA backend's stream (in order with the kernels before and after them) and waited
//! for by polling, so that none outlives the timeout.
//!
//! # The communication stream
//! [`Communicator::all_reduce_after`] queues an all-reduce on a stream of the communicator's
//! own instead (made on first use, non-blocking: it waits for the kernels' stream only through
//! the event it is given, `cuStreamWaitEvent`), so that a bucket of gradients is reduced while
//! the kernels launched after its event run, as PyTorch's ProcessGroupNCCL does on its
//! communication streams. The caller's thread waits for it as for any collective (a reducer
//! thread beside the one that launches the kernels); [`Communicator::order_kernels_after`]
//! then makes the kernels' stream wait, by an event, for everything queued on the
//! communication stream before the kernels that read the result are launched.
//!
//! # The watchdog, inline
//! The communicator is made nonblocking (`ncclConfig_t.blocking = 0`): its set-up and each
//! enqueue may return `ncclInProgress`, and are polled with `ncclCommGetAsyncError`. After a
//! collective is queued, an event recorded behind it is polled the same way. An error from
//! NCCL, or a collective (or set-up) still running at the timeout, aborts the communicator
//! (`ncclCommAbort`, which also ends its kernels on the GPU): the call returns a one-line
//! error naming the rank and the operation, and every later call returns
//! [`NcclError::Aborted`] with the first reason. This is what PyTorch's watchdog thread does,
//! on the calling thread instead (each collective here is waited for before it returns).
//!
//! # State
//! The NCCL handle is used under one mutex: NCCL communicators are not thread-safe, and a
//! handle once aborted is never used again. Dropping the communicator aborts it rather than
//! destroying it (`ncclCommDestroy` may wait for peers that are gone); its event and its
//! hold on the device's primary context go with it.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cohort_cuda::libraries::Search;
use cohort_engine::{Backend, Device as EngineDevice, Elem, Event, View, ViewMut};
use cudarc::driver::{result, sys, CudaContext, CudaEvent};

use crate::ffi::{self, Comm, Res};
use crate::{Nccl, NcclError, UniqueId};

/// What an all-reduce or reduce-scatter computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    /// The sum over the ranks.
    Sum,
    /// The mean over the ranks (`ncclAvg`).
    Avg,
}

impl Reduce {
    fn code(self) -> std::ffi::c_int {
        match self {
            Reduce::Sum => ffi::OP_SUM,
            Reduce::Avg => ffi::OP_AVG,
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for u16 {}
}

/// An element type NCCL moves: f32, and u16 as bf16 bits (the engine's bf16 buffers).
pub trait NcclElem: Elem + sealed::Sealed {
    /// The `ncclDataType_t`.
    #[doc(hidden)]
    const TYPE: std::ffi::c_int;
}

impl NcclElem for f32 {
    const TYPE: std::ffi::c_int = ffi::FLOAT32;
}

/// bf16, held as its bits.
impl NcclElem for u16 {
    const TYPE: std::ffi::c_int = ffi::BFLOAT16;
}

/// The GPU and stream a communicator works on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding {
    /// The device ordinal (as this process sees it, after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: usize,
    /// The raw `CUstream` the collectives are queued on (0: the default stream).
    pub stream: u64,
}

impl Binding {
    /// The device and stream of an engine backend on a CUDA GPU (`None` for any other).
    pub fn of(backend: &dyn Backend) -> Option<Binding> {
        match (backend.device(), backend.stream_handle()) {
            (EngineDevice::Cuda(ordinal), Some(stream)) => Some(Binding {
                ordinal: ordinal as usize,
                stream,
            }),
            _ => None,
        }
    }
}

/// Where a collective is queued.
#[derive(Clone, Copy)]
enum Queue {
    /// The binding's stream, the kernels'.
    Kernels,
    /// The communication stream, after this event of the kernels' stream (if any).
    Side { after: Option<sys::CUevent> },
}

/// The handle and whether an earlier failure aborted it.
struct State {
    comm: Comm,
    aborted: Option<String>,
    /// The communication stream (null until its first use; see the module doc).
    side: sys::CUstream,
}

/// One rank of an NCCL communicator (see the module doc).
pub struct Communicator {
    nccl: &'static Nccl,
    state: Mutex<State>,
    rank: usize,
    world: usize,
    binding: Binding,
    /// The device's primary context (the CUDA backend's), current on the calling thread
    /// around every NCCL and driver call.
    ctx: Arc<CudaContext>,
    /// Recorded behind each collective and polled.
    event: sys::CUevent,
    /// Recorded on the communication stream for the kernels' stream to wait for.
    fence: sys::CUevent,
    timeout: Duration,
}

// SAFETY: the NCCL handle is only touched under `state`'s mutex (NCCL allows a communicator
// to be used from any thread, one call at a time); the events and the communication stream
// are only recorded, queried and queued on under the same mutex, and the context is an Arc
// of a thread-safe cudarc context.
unsafe impl Send for Communicator {}
// SAFETY: as above: every method that touches the handle or the event takes the mutex.
unsafe impl Sync for Communicator {}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("binding", &self.binding)
            .finish()
    }
}

impl Communicator {
    /// Rank `rank` of `world` of the communicator `id` names, on `binding`'s GPU and stream.
    /// Collective: every rank must call it with the same id; one that is missing makes the
    /// others fail after `timeout`, never hang.
    pub fn new(
        nccl: &'static Nccl,
        search: &Search,
        id: &UniqueId,
        (rank, world): (usize, usize),
        binding: Binding,
        timeout: Duration,
    ) -> Result<Communicator, NcclError> {
        const OP: &str = "init";
        let driver = |e: cudarc::driver::DriverError| NcclError::Driver {
            op: OP,
            rank,
            reason: format!("{:?}", e.0),
        };
        if rank >= world {
            return Err(NcclError::Argument {
                op: OP,
                rank,
                what: format!("rank {rank} is not below the world size {world}"),
            });
        }
        // The driver first, by cohort-cuda's lookup: cudarc would panic on a missing one.
        let count = cohort_cuda::device_count(search)?;
        if binding.ordinal >= count {
            return Err(NcclError::Driver {
                op: OP,
                rank,
                reason: format!("no GPU {}: the driver sees {count}", binding.ordinal),
            });
        }
        let ctx = CudaContext::new(binding.ordinal).map_err(driver)?;
        ctx.bind_to_thread().map_err(driver)?;
        let event =
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(driver)?;
        let fence = match result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING) {
            Ok(f) => f,
            Err(e) => {
                // SAFETY: created just above, never used.
                let _ = unsafe { result::event::destroy(event) };
                return Err(driver(e));
            }
        };
        let mut comm: Comm = std::ptr::null_mut();
        let mut config = ffi::Config::nonblocking();
        let (nranks, r) = (world as std::ffi::c_int, rank as std::ffi::c_int);
        // SAFETY: the out-pointer and config are valid for the call; the id is passed by
        // value; the device's context is current on this thread, as NCCL requires (it
        // takes the current device). Nonblocking: the call may return before set-up ends,
        // and `comm` is then polled below.
        let rc = unsafe {
            (nccl.api.comm_init_rank_config)(&mut comm, nranks, id.to_ffi(), r, &mut config)
        };
        let c = Communicator {
            nccl,
            state: Mutex::new(State {
                comm,
                aborted: None,
                side: std::ptr::null_mut(),
            }),
            rank,
            world,
            binding,
            ctx,
            event,
            fence,
            timeout,
        };
        let mut st = c.lock();
        if rc != ffi::SUCCESS && rc != ffi::IN_PROGRESS {
            let reason = nccl.api.describe(rc, st.comm);
            return Err(c.fail(
                &mut st,
                NcclError::Call {
                    op: OP,
                    rank,
                    reason,
                },
            ));
        }
        if st.comm.is_null() {
            st.aborted = Some("ncclCommInitRankConfig returned no communicator".into());
            return Err(NcclError::Call {
                op: OP,
                rank,
                reason: "ncclCommInitRankConfig returned no communicator".into(),
            });
        }
        c.settle(&mut st, OP, Instant::now())?;
        drop(st);
        Ok(c)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The library.
    pub fn nccl(&self) -> &'static Nccl {
        self.nccl
    }

    /// `buf` reduced over the ranks, in place, on every rank; returns once it is done.
    pub fn all_reduce<T: NcclElem>(
        &self,
        buf: ViewMut<'_, T>,
        op: Reduce,
    ) -> Result<(), NcclError> {
        const OP: &str = "all_reduce";
        self.check_device(OP, buf.device())?;
        let (p, n) = (buf.addr() as usize as *mut c_void, buf.len());
        // SAFETY: `buf` is `n` elements of device memory on this GPU, borrowed exclusively
        // for the call, which waits for the collective to finish; in place (send = recv) is
        // allowed by NCCL.
        self.run(OP, |comm, s| unsafe {
            (self.nccl.api.all_reduce)(p, p, n, T::TYPE, op.code(), comm, s)
        })
    }

    /// [`Communicator::all_reduce`] on the communication stream (see the module doc), once the
    /// work before `after` (an event the CUDA backend recorded on its stream; one already
    /// complete, [`Event::done`], waits for nothing) is done; returns once it is done. The
    /// caller promises that no kernel launched after `after` reads or writes `buf` before
    /// [`Communicator::order_kernels_after`].
    pub fn all_reduce_after<T: NcclElem>(
        &self,
        buf: ViewMut<'_, T>,
        op: Reduce,
        after: &Event,
    ) -> Result<(), NcclError> {
        const OP: &str = "all_reduce";
        self.check_device(OP, buf.device())?;
        let wait = match after.device() {
            None => None,
            Some(e) => match e.downcast_ref::<CudaEvent>() {
                Some(e) => Some(e.cu_event()),
                None => {
                    return Err(NcclError::Argument {
                        op: OP,
                        rank: self.rank,
                        what: "an event of another backend than CUDA's".into(),
                    })
                }
            },
        };
        let (p, n) = (buf.addr() as usize as *mut c_void, buf.len());
        // SAFETY: `buf` is `n` elements of device memory on this GPU, borrowed exclusively
        // for the call, which waits for the collective to finish; the communication stream
        // waits for `after`, after which no kernel touches `buf` (the caller's promise); in
        // place is allowed by NCCL.
        self.run_on(OP, Queue::Side { after: wait }, |comm, s| unsafe {
            (self.nccl.api.all_reduce)(p, p, n, T::TYPE, op.code(), comm, s)
        })
    }

    /// Makes the kernels' stream (the binding's) wait for every collective queued on the
    /// communication stream so far, by an event: what the kernels that read a reduced buffer
    /// must come after. Returns without waiting on the host; nothing to do before the first
    /// [`Communicator::all_reduce_after`].
    pub fn order_kernels_after(&self) -> Result<(), NcclError> {
        const OP: &str = "order the kernels after the communication stream";
        let mut st = self.lock();
        if let Some(first) = &st.aborted {
            return Err(NcclError::Aborted {
                op: OP,
                rank: self.rank,
                first: first.clone(),
            });
        }
        if st.side.is_null() {
            return Ok(());
        }
        self.bind(&mut st, OP)?;
        let kernels = self.binding.stream as usize as sys::CUstream;
        // SAFETY: the fence was created in this context, which is current; the communication
        // stream is live (destroyed only on drop) and the kernels' stream is the backend's,
        // of the same context; recording and waiting happen under the mutex.
        let queued = unsafe {
            result::event::record(self.fence, st.side).and_then(|()| {
                result::stream::wait_event(
                    kernels,
                    self.fence,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            })
        };
        queued.map_err(|e| self.fail(&mut st, self.driver(OP, e)))
    }

    /// Rank r's `recv` = the reduction over the ranks of block r of `send`
    /// (`send.len() == recv.len() * world`).
    pub fn reduce_scatter<T: NcclElem>(
        &self,
        send: View<'_, T>,
        recv: ViewMut<'_, T>,
        op: Reduce,
    ) -> Result<(), NcclError> {
        const OP: &str = "reduce_scatter";
        self.check_device(OP, send.device())?;
        self.check_device(OP, recv.device())?;
        self.check_len(OP, "send", send.len(), recv.len() * self.world)?;
        let (sp, rp, n) = (
            send.addr() as usize as *const c_void,
            recv.addr() as usize as *mut c_void,
            recv.len(),
        );
        // SAFETY: `send` holds world × n elements and `recv` n, both on this GPU (checked),
        // alive and unaliased (a shared and an exclusive borrow) until the collective ends.
        self.run(OP, |comm, s| unsafe {
            (self.nccl.api.reduce_scatter)(sp, rp, n, T::TYPE, op.code(), comm, s)
        })
    }

    /// Every rank's `recv` = the ranks' `send`s in rank order (`recv.len() == send.len() * world`).
    pub fn all_gather<T: NcclElem>(
        &self,
        send: View<'_, T>,
        recv: ViewMut<'_, T>,
    ) -> Result<(), NcclError> {
        const OP: &str = "all_gather";
        self.check_device(OP, send.device())?;
        self.check_device(OP, recv.device())?;
        self.check_len(OP, "recv", recv.len(), send.len() * self.world)?;
        let (sp, rp, n) = (
            send.addr() as usize as *const c_void,
            recv.addr() as usize as *mut c_void,
            send.len(),
        );
        // SAFETY: `send` holds n elements and `recv` world × n, both on this GPU (checked),
        // alive and unaliased until the collective ends.
        self.run(OP, |comm, s| unsafe {
            (self.nccl.api.all_gather)(sp, rp, n, T::TYPE, comm, s)
        })
    }

    /// `root`'s `buf` on every rank, in place.
    pub fn broadcast<T: NcclElem>(
        &self,
        buf: ViewMut<'_, T>,
        root: usize,
    ) -> Result<(), NcclError> {
        const OP: &str = "broadcast";
        self.check_device(OP, buf.device())?;
        if root >= self.world {
            return Err(NcclError::Argument {
                op: OP,
                rank: self.rank,
                what: format!("root {root} is not a rank of {}", self.world),
            });
        }
        let (p, n) = (buf.addr() as usize as *mut c_void, buf.len());
        // SAFETY: `buf` is n elements on this GPU, borrowed exclusively until the collective
        // ends; in place is allowed by NCCL.
        self.run(OP, |comm, s| unsafe {
            (self.nccl.api.broadcast)(p, p, n, T::TYPE, root as std::ffi::c_int, comm, s)
        })
    }

    /// Aborts the communicator now (what a failure does by itself); later calls fail.
    pub fn abort(&self, reason: &str) {
        let mut st = self.lock();
        self.abort_locked(&mut st, reason.to_string());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check_device(&self, op: &'static str, device: EngineDevice) -> Result<(), NcclError> {
        if device == EngineDevice::Cuda(self.binding.ordinal as u32) {
            return Ok(());
        }
        Err(NcclError::Argument {
            op,
            rank: self.rank,
            what: format!(
                "a buffer on {device}, the communicator is on cuda:{}",
                self.binding.ordinal
            ),
        })
    }

    fn check_len(
        &self,
        op: &'static str,
        arg: &str,
        got: usize,
        need: usize,
    ) -> Result<(), NcclError> {
        if got == need {
            return Ok(());
        }
        Err(NcclError::Argument {
            op,
            rank: self.rank,
            what: format!(
                "{arg} holds {got} elements, {need} needed ({} ranks)",
                self.world
            ),
        })
    }

    /// Queues one collective with `call` (given the handle and the stream) on the binding's
    /// stream, then waits for it (see the module doc).
    fn run(
        &self,
        op: &'static str,
        call: impl FnOnce(Comm, ffi::Stream) -> Res,
    ) -> Result<(), NcclError> {
        self.run_on(op, Queue::Kernels, call)
    }

    /// [`Communicator::run`] on the stream `queue` names.
    fn run_on(
        &self,
        op: &'static str,
        queue: Queue,
        call: impl FnOnce(Comm, ffi::Stream) -> Res,
    ) -> Result<(), NcclError> {
        let mut st = self.lock();
        if let Some(first) = &st.aborted {
            return Err(NcclError::Aborted {
                op,
                rank: self.rank,
                first: first.clone(),
            });
        }
        let start = Instant::now();
        self.bind(&mut st, op)?;
        let stream = match queue {
            Queue::Kernels => self.binding.stream as usize as ffi::Stream,
            Queue::Side { after } => {
                let side = self.side_stream(&mut st, op)?;
                if let Some(event) = after {
                    // SAFETY: the communication stream is live; `event` is the backend's,
                    // alive for the call (the caller borrows it), of the same context.
                    let waited = unsafe {
                        result::stream::wait_event(
                            side,
                            event,
                            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                        )
                    };
                    if let Err(e) = waited {
                        return Err(self.fail(&mut st, self.driver(op, e)));
                    }
                }
                side as ffi::Stream
            }
        };
        let rc = call(st.comm, stream);
        if rc != ffi::SUCCESS && rc != ffi::IN_PROGRESS {
            let reason = self.nccl.api.describe(rc, st.comm);
            return Err(self.fail(
                &mut st,
                NcclError::Call {
                    op,
                    rank: self.rank,
                    reason,
                },
            ));
        }
        self.settle(&mut st, op, start)?;
        // SAFETY: the event was created in this context, which is current; the stream is the
        // backend's stream of the same context.
        if let Err(e) = unsafe { result::event::record(self.event, stream as sys::CUstream) } {
            return Err(self.fail(&mut st, self.driver(op, e)));
        }
        let mut nap = Duration::from_micros(20);
        loop {
            // SAFETY: the event is live (destroyed only on drop) and was recorded above.
            match unsafe { result::event::query(self.event) } {
                Ok(()) => return Ok(()),
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => {}
                Err(e) => return Err(self.fail(&mut st, self.driver(op, e))),
            }
            self.check_async(&mut st, op, start)?;
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }

    /// The communication stream, made on first use (non-blocking: it never waits for the
    /// legacy default stream, only for the events it is told to).
    fn side_stream(&self, st: &mut State, op: &'static str) -> Result<sys::CUstream, NcclError> {
        if st.side.is_null() {
            match result::stream::create(result::stream::StreamKind::NonBlocking) {
                Ok(s) => st.side = s,
                Err(e) => return Err(self.fail(st, self.driver(op, e))),
            }
        }
        Ok(st.side)
    }

    /// Makes the device's context current on this thread.
    fn bind(&self, st: &mut State, op: &'static str) -> Result<(), NcclError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.fail(st, self.driver(op, e)))
    }

    /// Polls `ncclCommGetAsyncError` until the last call is no longer in progress.
    fn settle(&self, st: &mut State, op: &'static str, start: Instant) -> Result<(), NcclError> {
        let mut nap = Duration::from_micros(20);
        while self.check_async(st, op, start)? == ffi::IN_PROGRESS {
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
        Ok(())
    }

    /// The communicator's asynchronous state: success or in progress, else the error (the
    /// communicator aborted); past the timeout, a timeout (aborted too).
    fn check_async(
        &self,
        st: &mut State,
        op: &'static str,
        start: Instant,
    ) -> Result<Res, NcclError> {
        let mut state: Res = ffi::SUCCESS;
        // SAFETY: the handle is live (not aborted: checked by every caller under the mutex)
        // and the out-pointer valid; this call is allowed while the communicator works.
        let rc = unsafe { (self.nccl.api.comm_get_async_error)(st.comm, &mut state) };
        let code = if rc != ffi::SUCCESS { rc } else { state };
        if code != ffi::SUCCESS && code != ffi::IN_PROGRESS {
            let reason = self.nccl.api.describe(code, st.comm);
            return Err(self.fail(
                st,
                NcclError::Call {
                    op,
                    rank: self.rank,
                    reason,
                },
            ));
        }
        if start.elapsed() > self.timeout {
            return Err(self.fail(
                st,
                NcclError::Timeout {
                    op,
                    rank: self.rank,
                    timeout: self.timeout,
                },
            ));
        }
        Ok(code)
    }

    fn driver(&self, op: &'static str, e: cudarc::driver::DriverError) -> NcclError {
        NcclError::Driver {
            op,
            rank: self.rank,
            reason: format!("{:?}", e.0),
        }
    }

    /// Aborts the communicator for `e` and returns `e`.
    fn fail(&self, st: &mut State, e: NcclError) -> NcclError {
        self.abort_locked(st, e.to_string());
        e
    }

    fn abort_locked(&self, st: &mut State, reason: String) {
        if st.aborted.is_some() {
            return;
        }
        st.aborted = Some(reason);
        if st.comm.is_null() {
            return;
        }
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the handle is live and is never used again (`aborted` is set); ncclCommAbort
        // frees it without waiting for the other ranks and stops its kernels.
        let _ = unsafe { (self.nccl.api.comm_abort)(st.comm) };
        st.comm = std::ptr::null_mut();
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        if st.aborted.is_none() && !st.comm.is_null() {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: the handle is live and this is its last use. Abort rather than
            // destroy: it never waits for peers that may be gone.
            let _ = unsafe { (self.nccl.api.comm_abort)(st.comm) };
            st.comm = std::ptr::null_mut();
        }
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the events and the stream were created by this communicator and no call
        // uses them any more (the communicator is aborted: nothing is queued on the stream).
        unsafe {
            let _ = result::event::destroy(self.event);
            let _ = result::event::destroy(self.fence);
            if !st.side.is_null() {
                let _ = result::stream::destroy(st.side);
            }
        }
    }
}

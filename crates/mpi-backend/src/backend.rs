//! [`MpiBackend`]: cohort's [`Backend`] on MPI calls, and [`init`].
//!
//! # State
//! - One duplicate of `MPI_COMM_WORLD` per process, with `MPI_ERRORS_RETURN`
//!   so that a failed call comes back as a [`CommError`] instead of killing
//!   the process inside MPI. The group above serialises collectives; sends
//!   and receives may run on other threads at the same time, which
//!   `MPI_THREAD_MULTIPLE` allows (MPI keeps point-to-point and collective
//!   traffic of a communicator apart).
//! - Every call is registered with the [`Watchdog`] for the group's
//!   timeout. On expiry, and on [`Backend::abort`], the job ends with
//!   `MPI_Abort` after the reason is printed to stderr: MPI has no way to
//!   cancel a pending call and keep going.
//!
//! # Safety
//! Every `unsafe` block is an MPI call on buffers the group has validated:
//! byte views of whole elements of `dtype`, aligned for it, whose element
//! counts fit a C `int` (checked in [`count`]), alive and not aliased for
//! the duration of the call (MPI keeps no pointer after a blocking call
//! returns). This module must never hand MPI a pointer that outlives its
//! call.

use std::os::raw::{c_char, c_int, c_void};
use std::sync::{Arc, Mutex};

use cohort_comm::{Backend, CommError, DType, GroupOptions, OpContext, ProcessGroup, ReduceOp};
use mpi::environment::{Threading, Universe};
use mpi::ffi::{self, MPI_Comm};

use crate::error::MpiError;
use crate::no_store::NoStore;
use crate::ops::{datatype, finish_avg, Reductions};
use crate::watchdog::{Expired, Watchdog};

extern "C" {
    fn cohort_mpi_in_place() -> *mut c_void;
    fn cohort_mpi_tag_ub() -> c_int;
}

/// An MPI communicator handle that may be used from any thread.
#[derive(Clone, Copy)]
struct Comm(MPI_Comm);

// safety: MPI handles are plain identifiers of library objects; with
// MPI_THREAD_MULTIPLE (checked in `init`) any thread may call MPI with them.
unsafe impl Send for Comm {}
// safety: as above; concurrent calls on one communicator are MPI's to order.
unsafe impl Sync for Comm {}

/// The sentinel address `MPI_IN_PLACE`, which MPI compares, never dereferences.
#[derive(Clone, Copy)]
struct InPlace(*mut c_void);

// safety: a constant address that is never dereferenced by us.
unsafe impl Send for InPlace {}
// safety: as above.
unsafe impl Sync for InPlace {}

/// What the groups of one MPI initialisation share: the user-defined
/// operators, freed when the last group goes, and then MPI itself,
/// finalised.
struct Library {
    reductions: Reductions,
    _universe: Universe,
}

impl Drop for Library {
    fn drop(&mut self) {
        self.reductions.free();
    }
}

// safety: `Reductions` holds MPI_Op handles, usable from any thread under
// MPI_THREAD_MULTIPLE; `Universe` is only dropped (finalising MPI), once,
// by the last group.
unsafe impl Send for Library {}
// safety: as above; neither is mutated after creation.
unsafe impl Sync for Library {}

/// cohort's [`Backend`] over MPI (see the crate docs for the mapping).
pub struct MpiBackend {
    comm: Comm,
    rank: usize,
    size: usize,
    tag_ub: u32,
    in_place: InPlace,
    /// The last error this backend returned, printed when the group aborts
    /// (`abort` gets no reason, and MPI_Abort ends the process).
    last_error: Mutex<Option<String>>,
    watchdog: Watchdog,
    /// Declared last, so that it drops after the watchdog thread has
    /// stopped: the last group's drop finalises MPI.
    library: Arc<Library>,
}

/// MPI's description of an error code.
fn error_string(code: c_int) -> String {
    let mut buf = vec![0u8; 1024];
    let mut len: c_int = 0;
    // safety: MPI writes at most MPI_MAX_ERROR_STRING (256 in Open MPI and
    // MPICH) bytes into `buf`, which is larger.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast::<c_char>(), &mut len) };
    if rc != 0 {
        return format!("MPI error code {code}");
    }
    buf.truncate(usize::try_from(len).unwrap_or(0));
    String::from_utf8_lossy(&buf).trim().to_string()
}

fn world() -> MPI_Comm {
    // safety: a constant handle of the `mpi-sys` shim.
    unsafe { ffi::RSMPI_COMM_WORLD }
}

/// Ends the whole MPI job (every rank), after `why` is on stderr.
fn abort_job(rank: usize, why: &str) {
    eprintln!("cohort-mpi: rank {rank}: {why}; ending the MPI job (MPI_Abort): MPI cannot cancel a pending call");
    // safety: MPI_Abort may be called from any thread at any time after
    // init; it does not return in practice.
    unsafe { ffi::MPI_Abort(world(), 1) };
}

/// Turns an MPI return code of `call` into a result.
fn call(call: &'static str, rc: c_int) -> Result<(), MpiError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(MpiError::Call {
            call,
            detail: error_string(rc),
        })
    }
}

pub(crate) fn init(opts: GroupOptions) -> Result<ProcessGroup, MpiError> {
    let (universe, provided) =
        mpi::initialize_with_threading(Threading::Multiple).ok_or(MpiError::AlreadyInitialized)?;
    if provided < Threading::Multiple {
        return Err(MpiError::Threading {
            provided: format!("{provided:?}"),
        });
    }
    let reductions = Reductions::create().map_err(|rc| MpiError::Call {
        call: "MPI_Op_create",
        detail: error_string(rc),
    })?;
    let library = Arc::new(Library {
        reductions,
        _universe: universe,
    });
    let mut comm = world();
    // safety: `comm` is a valid MPI_Comm to write; MPI is initialised.
    call("MPI_Comm_dup", unsafe {
        ffi::MPI_Comm_dup(world(), &mut comm)
    })?;
    let backend = MpiBackend::attach(comm, library, &opts)?;
    let size = backend.size;
    if let Some(env_world) = std::env::var("WORLD_SIZE")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
    {
        if env_world > size {
            return Err(MpiError::NotLaunchedByMpi {
                env_world,
                mpi_world: size,
            });
        }
    }
    // Where this rank sits on its node: the ranks that can share memory.
    let mut node = world();
    // safety: valid communicator, constants of the shim, out-pointer.
    call("MPI_Comm_split_type", unsafe {
        ffi::MPI_Comm_split_type(
            backend.comm.0,
            ffi::RSMPI_COMM_TYPE_SHARED,
            backend.rank as c_int,
            ffi::RSMPI_INFO_NULL,
            &mut node,
        )
    })?;
    let (mut local_rank, mut local_size): (c_int, c_int) = (0, 0);
    // safety: `node` was just created; it is freed right after.
    unsafe {
        call("MPI_Comm_rank", ffi::MPI_Comm_rank(node, &mut local_rank))?;
        call("MPI_Comm_size", ffi::MPI_Comm_size(node, &mut local_size))?;
        call("MPI_Comm_free", ffi::MPI_Comm_free(&mut node))?;
    }
    Ok(
        ProcessGroup::with_backend(Box::new(backend), Arc::new(NoStore), opts)
            .with_local(local_rank as usize, local_size as usize),
    )
}

/// What MPI is given for an empty buffer: a real address. An empty slice's
/// dangling pointer is its alignment, 0x1 for bytes, which is the value of
/// MPI_IN_PLACE in Open MPI (a broadcast of 0 bytes fails as "in place").
static EMPTY: [u64; 1] = [0];

fn src(b: &[u8]) -> *const c_void {
    if b.is_empty() {
        EMPTY.as_ptr().cast()
    } else {
        b.as_ptr().cast()
    }
}

/// As [`src`]; MPI writes nothing through the address of an empty buffer.
fn dst(b: &mut [u8]) -> *mut c_void {
    if b.is_empty() {
        EMPTY.as_ptr().cast_mut().cast()
    } else {
        b.as_mut_ptr().cast()
    }
}

/// Element count of a buffer as MPI's C `int`.
fn count(ctx: &OpContext, bytes: usize, dtype: DType) -> Result<c_int, CommError> {
    let n = bytes / dtype.size();
    c_int::try_from(n).map_err(|_| CommError::InvalidArgument {
        op: ctx.op,
        group: ctx.group.clone(),
        detail: format!(
            "{n} elements exceed what one MPI call can take ({} with C int counts)",
            c_int::MAX
        ),
    })
}

impl MpiBackend {
    /// The backend of `comm`, a communicator of our own (freed with the
    /// backend), watched for `opts`' timeout.
    fn attach(
        comm: MPI_Comm,
        library: Arc<Library>,
        opts: &GroupOptions,
    ) -> Result<MpiBackend, MpiError> {
        // Owned from here on: freed by the backend's drop, or below.
        let mut owned = Comm(comm);
        let attached = (|| {
            // safety: `comm` is a live communicator; RSMPI_ERRORS_RETURN is a constant handle.
            call("MPI_Comm_set_errhandler", unsafe {
                ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN)
            })?;
            let (mut rank, mut size): (c_int, c_int) = (0, 0);
            // safety: valid communicator and out-pointers.
            call("MPI_Comm_rank", unsafe {
                ffi::MPI_Comm_rank(comm, &mut rank)
            })?;
            // safety: as above.
            call("MPI_Comm_size", unsafe {
                ffi::MPI_Comm_size(comm, &mut size)
            })?;
            // safety: plain function of the C shim; MPI is initialised.
            let tag_ub = unsafe { cohort_mpi_tag_ub() };
            let tag_ub = u32::try_from(tag_ub).map_err(|_| MpiError::Call {
                call: "MPI_Comm_get_attr(MPI_TAG_UB)",
                detail: format!("no tag bound ({tag_ub})"),
            })?;
            let (rank, group) = (rank as usize, opts.name.clone());
            let watchdog = Watchdog::start(opts.timeout, move |e: Expired| {
                abort_job(
                    rank,
                    &format!(
                        "{} #{} on group {group:?} did not complete within {:?} (COHORT_TIMEOUT)",
                        e.op, e.seq, e.timeout
                    ),
                )
            })
            .map_err(|e| MpiError::Call {
                call: "starting the watchdog thread",
                detail: e.to_string(),
            })?;
            Ok((rank, size as usize, tag_ub, watchdog))
        })();
        match attached {
            Ok((rank, size, tag_ub, watchdog)) => Ok(MpiBackend {
                comm: owned,
                rank,
                size,
                tag_ub,
                // safety: plain function of the C shim.
                in_place: InPlace(unsafe { cohort_mpi_in_place() }),
                last_error: Mutex::new(None),
                watchdog,
                library,
            }),
            Err(e) => {
                // safety: nothing else holds the communicator.
                unsafe { ffi::MPI_Comm_free(&mut owned.0) };
                Err(e)
            }
        }
    }

    /// `MPI_Comm_split` of this backend's communicator: the members of
    /// `ranks` get a backend on the new communicator, ranked in their order.
    fn split_comm(
        &self,
        ranks: &[usize],
        opts: &GroupOptions,
    ) -> Result<Option<Box<dyn Backend>>, CommError> {
        let key = ranks.iter().position(|&r| r == self.rank);
        // safety: a constant of the shim.
        let color = key.map_or(unsafe { ffi::RSMPI_UNDEFINED }, |_| 0);
        // safety: a constant handle of the shim.
        let mut sub = unsafe { ffi::RSMPI_COMM_NULL };
        let failed = |e: MpiError| CommError::Io {
            context: format!("new_group {:?} (rank {}) on MPI", opts.name, self.rank),
            source: std::io::Error::other(e.to_string()),
        };
        // safety: a live communicator, plain integers and an out-pointer;
        // every rank of the communicator makes this call in the same turn.
        call("MPI_Comm_split", unsafe {
            ffi::MPI_Comm_split(self.comm.0, color, key.unwrap_or(0) as c_int, &mut sub)
        })
        .map_err(failed)?;
        if key.is_none() {
            return Ok(None);
        }
        let backend = MpiBackend::attach(sub, self.library.clone(), opts).map_err(failed)?;
        Ok(Some(Box::new(backend)))
    }

    /// Turns an MPI return code into a result, remembering the error.
    fn check(&self, ctx: &OpContext, call: &'static str, rc: c_int) -> Result<(), CommError> {
        if rc == 0 {
            return Ok(());
        }
        let e = CommError::Io {
            context: format!(
                "{} #{} on group {:?} (rank {}): {call}",
                ctx.op, ctx.seq, ctx.group, self.rank
            ),
            source: std::io::Error::other(error_string(rc)),
        };
        self.remember(&e);
        Err(e)
    }

    fn remember(&self, e: &CommError) {
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.to_string());
    }

    fn tag(&self, ctx: &OpContext, tag: u32) -> Result<c_int, CommError> {
        if tag > self.tag_ub {
            return Err(CommError::InvalidArgument {
                op: ctx.op,
                group: ctx.group.clone(),
                detail: format!("tag {tag} is above this MPI's largest tag, {}", self.tag_ub),
            });
        }
        Ok(tag as c_int)
    }

    fn finish(&self, op: ReduceOp, dtype: DType, buf: &mut [u8]) {
        if op == ReduceOp::Avg {
            finish_avg(dtype, buf, self.size);
        }
    }
}

impl Backend for MpiBackend {
    fn name(&self) -> &'static str {
        "mpi"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn send(
        &self,
        ctx: &OpContext,
        buf: &[u8],
        dtype: DType,
        peer: usize,
        tag: u32,
    ) -> Result<(), CommError> {
        let _w = self.watchdog.watch(ctx);
        let (n, tag) = (count(ctx, buf.len(), dtype)?, self.tag(ctx, tag)?);
        // safety: see the module docs.
        let rc = unsafe {
            ffi::MPI_Send(
                src(buf),
                n,
                datatype(dtype),
                peer as c_int,
                tag,
                self.comm.0,
            )
        };
        self.check(ctx, "MPI_Send", rc)
    }

    fn recv(
        &self,
        ctx: &OpContext,
        buf: &mut [u8],
        dtype: DType,
        peer: usize,
        tag: u32,
    ) -> Result<(), CommError> {
        let _w = self.watchdog.watch(ctx);
        let (n, tag) = (count(ctx, buf.len(), dtype)?, self.tag(ctx, tag)?);
        // Matched probe, then receive: the length is known before any byte
        // lands, and no other thread can take the probed message.
        // safety: zeroed MPI_Status and MPI_Message are valid out-values.
        let (mut status, mut msg) = unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        // safety: valid communicator and out-pointers.
        let rc = unsafe { ffi::MPI_Mprobe(peer as c_int, tag, self.comm.0, &mut msg, &mut status) };
        self.check(ctx, "MPI_Mprobe", rc)?;
        let mut bytes: c_int = 0;
        // safety: `status` was filled by MPI_Mprobe.
        let rc = unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut bytes) };
        self.check(ctx, "MPI_Get_count", rc)?;
        if usize::try_from(bytes).ok() != Some(buf.len()) {
            // Take the message off the wire anyway, then report.
            let mut sink = vec![0u8; usize::try_from(bytes).unwrap_or(0)];
            // safety: `sink` holds `bytes` bytes; `msg` came from MPI_Mprobe.
            let rc = unsafe {
                ffi::MPI_Mrecv(
                    dst(&mut sink),
                    bytes,
                    ffi::RSMPI_UINT8_T,
                    &mut msg,
                    ffi::RSMPI_STATUS_IGNORE,
                )
            };
            self.check(ctx, "MPI_Mrecv", rc)?;
            let e = CommError::Mismatch {
                group: ctx.group.clone(),
                rank: self.rank,
                peer,
                ours: format!(
                    "recv #{} of {n} x {dtype} ({} bytes, tag {tag})",
                    ctx.seq,
                    buf.len()
                ),
                theirs: format!("send of {bytes} bytes with tag {tag}"),
            };
            self.remember(&e);
            return Err(e);
        }
        // safety: see the module docs; `msg` came from MPI_Mprobe.
        let rc = unsafe {
            ffi::MPI_Mrecv(
                dst(buf),
                n,
                datatype(dtype),
                &mut msg,
                ffi::RSMPI_STATUS_IGNORE,
            )
        };
        self.check(ctx, "MPI_Mrecv", rc)
    }

    fn broadcast(
        &self,
        ctx: &OpContext,
        buf: &mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<(), CommError> {
        let _w = self.watchdog.watch(ctx);
        let n = count(ctx, buf.len(), dtype)?;
        // safety: see the module docs.
        let rc =
            unsafe { ffi::MPI_Bcast(dst(buf), n, datatype(dtype), root as c_int, self.comm.0) };
        self.check(ctx, "MPI_Bcast", rc)
    }

    fn reduce(
        &self,
        ctx: &OpContext,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CommError> {
        let _w = self.watchdog.watch(ctx);
        let n = count(ctx, buf.len(), dtype)?;
        let (dt, mop) = self.library.reductions.get(dtype, op);
        let is_root = self.rank == root;
        // The root reduces in place; the others only send, so their
        // buffers stay as they were.
        let (send, recv) = if is_root {
            (self.in_place.0.cast_const(), dst(buf))
        } else {
            (src(buf), std::ptr::null_mut())
        };
        // safety: see the module docs; the receive buffer is significant
        // only at the root, where it is `buf`.
        let rc = unsafe { ffi::MPI_Reduce(send, recv, n, dt, mop, root as c_int, self.comm.0) };
        self.check(ctx, "MPI_Reduce", rc)?;
        if is_root {
            self.finish(op, dtype, buf);
        }
        Ok(())
    }

    fn all_reduce(
        &self,
        ctx: &OpContext,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let _w = self.watchdog.watch(ctx);
        let n = count(ctx, buf.len(), dtype)?;
        let (dt, mop) = self.library.reductions.get(dtype, op);
        // safety: see the module docs.
        let rc = unsafe {
            ffi::MPI_Allreduce(
                self.in_place.0.cast_const(),
                dst(buf),
                n,
                dt,
                mop,
                self.comm.0,
            )
        };
        self.check(ctx, "MPI_Allreduce", rc)?;
        self.finish(op, dtype, buf);
        Ok(())
    }

    fn reduce_scatter(
        &self,
        ctx: &OpContext,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let _w = self.watchdog.watch(ctx);
        count(ctx, input.len(), dtype)?;
        let n = count(ctx, output.len(), dtype)?;
        let (dt, mop) = self.library.reductions.get(dtype, op);
        // safety: see the module docs; `input` holds size x n elements.
        let rc = unsafe {
            ffi::MPI_Reduce_scatter_block(src(input), dst(output), n, dt, mop, self.comm.0)
        };
        self.check(ctx, "MPI_Reduce_scatter_block", rc)?;
        self.finish(op, dtype, output);
        Ok(())
    }

    fn all_gather(
        &self,
        ctx: &OpContext,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
    ) -> Result<(), CommError> {
        let _w = self.watchdog.watch(ctx);
        count(ctx, output.len(), dtype)?;
        let n = count(ctx, input.len(), dtype)?;
        let dt = datatype(dtype);
        // safety: see the module docs; `output` holds size x n elements.
        let rc = unsafe { ffi::MPI_Allgather(src(input), n, dt, dst(output), n, dt, self.comm.0) };
        self.check(ctx, "MPI_Allgather", rc)
    }

    fn gather(
        &self,
        ctx: &OpContext,
        input: &[u8],
        output: Option<&mut [u8]>,
        dtype: DType,
        root: usize,
    ) -> Result<(), CommError> {
        let _w = self.watchdog.watch(ctx);
        let n = count(ctx, input.len(), dtype)?;
        let recv = match output {
            Some(out) => {
                count(ctx, out.len(), dtype)?;
                dst(out)
            }
            None => std::ptr::null_mut(),
        };
        let dt = datatype(dtype);
        // safety: see the module docs; the receive buffer (size x n
        // elements) is significant only at the root, which has one.
        let rc =
            unsafe { ffi::MPI_Gather(src(input), n, dt, recv, n, dt, root as c_int, self.comm.0) };
        self.check(ctx, "MPI_Gather", rc)
    }

    fn scatter(
        &self,
        ctx: &OpContext,
        input: Option<&[u8]>,
        output: &mut [u8],
        dtype: DType,
        root: usize,
    ) -> Result<(), CommError> {
        let _w = self.watchdog.watch(ctx);
        let n = count(ctx, output.len(), dtype)?;
        let send = match input {
            Some(inp) => {
                count(ctx, inp.len(), dtype)?;
                src(inp)
            }
            None => std::ptr::null(),
        };
        let dt = datatype(dtype);
        // safety: see the module docs; the send buffer (size x n elements)
        // is significant only at the root, which has one.
        let rc = unsafe {
            ffi::MPI_Scatter(send, n, dt, dst(output), n, dt, root as c_int, self.comm.0)
        };
        self.check(ctx, "MPI_Scatter", rc)
    }

    fn all_to_all(
        &self,
        ctx: &OpContext,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
    ) -> Result<(), CommError> {
        let _w = self.watchdog.watch(ctx);
        let slot = count(ctx, input.len(), dtype)? / self.size as c_int;
        let dt = datatype(dtype);
        // safety: see the module docs; both buffers hold size x slot elements.
        let rc =
            unsafe { ffi::MPI_Alltoall(src(input), slot, dt, dst(output), slot, dt, self.comm.0) };
        self.check(ctx, "MPI_Alltoall", rc)
    }

    fn barrier(&self, ctx: &OpContext) -> Result<(), CommError> {
        let _w = self.watchdog.watch(ctx);
        // safety: valid communicator.
        let rc = unsafe { ffi::MPI_Barrier(self.comm.0) };
        self.check(ctx, "MPI_Barrier", rc)
    }

    fn split(
        &self,
        ranks: &[usize],
        opts: &GroupOptions,
    ) -> Option<Result<Option<Box<dyn Backend>>, CommError>> {
        Some(self.split_comm(ranks, opts))
    }

    fn abort(&self) {
        let why = match &*self.last_error.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(e) => format!("the group failed: {e}"),
            None => "the group was aborted".to_string(),
        };
        abort_job(self.rank, &why);
    }
}

impl Drop for MpiBackend {
    fn drop(&mut self) {
        // safety: the duplicate communicator is freed once, with no call in
        // flight (the group has been dropped).
        unsafe { ffi::MPI_Comm_free(&mut self.comm.0) };
    }
}

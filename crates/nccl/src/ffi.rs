//! NCCL's C interface, by hand: the few types and functions cohort calls, resolved with
//! `dlsym` from the library [`cohort_cuda::libraries`] found (the wheel's `libnccl.so.2`,
//! a name cudarc's loader never tries). Only what the communicator needs is here; a symbol
//! missing from the library is an error naming it and the file, at load time.
//!
//! This module must never call a function it did not resolve, and never close the library
//! (communicators keep pointers into it for the process's life).

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};

use crate::NcclError;

/// `ncclResult_t`.
pub(crate) type Res = c_int;
/// `ncclComm_t`: an opaque handle.
pub(crate) type Comm = *mut c_void;
/// `cudaStream_t` (a `CUstream`).
pub(crate) type Stream = *mut c_void;

pub(crate) const SUCCESS: Res = 0;
/// `ncclInProgress`: a nonblocking call not finished yet.
pub(crate) const IN_PROGRESS: Res = 7;

/// `ncclRedOp_t` values.
pub(crate) const OP_SUM: c_int = 0;
pub(crate) const OP_AVG: c_int = 4;
/// `ncclDataType_t` values.
pub(crate) const FLOAT32: c_int = 7;
pub(crate) const BFLOAT16: c_int = 9;

/// `NCCL_UNIQUE_ID_BYTES`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`, passed by value to `ncclCommInitRankConfig`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId {
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

/// `ncclConfig_t` as NCCL 2.14 defined it: the library reads `size` and `version` and takes
/// the later fields' defaults, so this prefix serves every release since (it is all cohort
/// sets: `blocking = 0`, the nonblocking mode its watchdog needs).
#[repr(C)]
pub(crate) struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
}

impl Config {
    /// `NCCL_CONFIG_INITIALIZER` of 2.14 with `blocking` set.
    pub(crate) fn nonblocking() -> Config {
        const UNDEF: c_int = c_int::MIN;
        Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: 21400,
            blocking: 0,
            cga_cluster_size: UNDEF,
            min_ctas: UNDEF,
            max_ctas: UNDEF,
            net_name: std::ptr::null(),
        }
    }
}

type Collective =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> Res;

/// The resolved functions. Field types are the C prototypes of `nccl.h`.
pub(crate) struct Api {
    pub path: PathBuf,
    pub get_version: unsafe extern "C" fn(*mut c_int) -> Res,
    pub get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> Res,
    pub comm_init_rank_config:
        unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int, *mut Config) -> Res,
    /// (send, recv, count, type, op, comm, stream)
    pub all_reduce: Collective,
    /// (send, recv, recvcount, type, op, comm, stream)
    pub reduce_scatter: Collective,
    /// (send, recv, sendcount, type, comm, stream)
    pub all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> Res,
    /// (send, recv, count, type, root, comm, stream)
    pub broadcast: Collective,
    pub comm_get_async_error: unsafe extern "C" fn(Comm, *mut Res) -> Res,
    pub comm_abort: unsafe extern "C" fn(Comm) -> Res,
    pub get_error_string: unsafe extern "C" fn(Res) -> *const c_char,
    /// `ncclGetLastError` (2.13+): the last failure's detail, if the library has it.
    pub get_last_error: Option<unsafe extern "C" fn(Comm) -> *const c_char>,
}

impl Api {
    /// Opens `path` and resolves every function.
    pub(crate) fn open(path: &Path) -> Result<Api, NcclError> {
        let c =
            CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| NcclError::Symbol {
                path: path.to_path_buf(),
                symbol: "(the path holds a NUL byte)",
            })?;
        // SAFETY: `c` is a NUL-terminated path alive for the call; dlopen runs NCCL's
        // initialisers, which only set up its own state (no GPU is touched until a
        // communicator is made). The handle is never closed.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW) };
        if handle.is_null() {
            return Err(NcclError::Symbol {
                path: path.to_path_buf(),
                symbol: "(dlopen refused the file)",
            });
        }
        let sym = |name: &'static str| -> Result<*mut c_void, NcclError> {
            let cname = CString::new(name).expect("symbol names hold no NUL");
            // SAFETY: `handle` is a live handle from dlopen and `cname` a NUL-terminated name.
            let p = unsafe { libc::dlsym(handle, cname.as_ptr()) };
            if p.is_null() {
                Err(NcclError::Symbol {
                    path: path.to_path_buf(),
                    symbol: name,
                })
            } else {
                Ok(p)
            }
        };
        // SAFETY: each pointer is the address of the NCCL function of that name, whose C
        // prototype in nccl.h is the field's type (checked by hand against the 2.30 header:
        // ncclResult_t is a C enum, i.e. an int; size_t is usize; handles and streams are
        // pointers; ncclUniqueId is 128 bytes passed by value). The library is never
        // unloaded, so the pointers stay valid for the process's life.
        unsafe {
            Ok(Api {
                path: path.to_path_buf(),
                get_version: func(sym("ncclGetVersion")?),
                get_unique_id: func(sym("ncclGetUniqueId")?),
                comm_init_rank_config: func(sym("ncclCommInitRankConfig")?),
                all_reduce: func(sym("ncclAllReduce")?),
                reduce_scatter: func(sym("ncclReduceScatter")?),
                all_gather: func(sym("ncclAllGather")?),
                broadcast: func(sym("ncclBroadcast")?),
                comm_get_async_error: func(sym("ncclCommGetAsyncError")?),
                comm_abort: func(sym("ncclCommAbort")?),
                get_error_string: func(sym("ncclGetErrorString")?),
                get_last_error: sym("ncclGetLastError").ok().map(|p| func(p)),
            })
        }
    }

    /// `ncclGetErrorString(code)`, with `ncclGetLastError`'s detail when there is one.
    pub(crate) fn describe(&self, code: Res, comm: Comm) -> String {
        // SAFETY: ncclGetErrorString takes any result code and returns a static
        // NUL-terminated string (or NULL for none); it is copied at once.
        let text = unsafe { c_text((self.get_error_string)(code)) };
        let detail = self.get_last_error.and_then(|f| {
            // SAFETY: ncclGetLastError takes a communicator or NULL and returns a
            // NUL-terminated string owned by the library (or NULL); it is copied at once.
            let d = unsafe { c_text(f(comm)) };
            (!d.is_empty()).then_some(d)
        });
        let text = if text.is_empty() {
            format!("NCCL error {code}")
        } else {
            text
        };
        match detail {
            // NCCL's messages may hold line breaks: an error stays one line.
            Some(d) => format!("{text} ({})", d.trim().replace('\n', "; ")),
            None => text,
        }
    }
}

/// A C string as an owned `String` (empty for NULL).
///
/// # Safety
/// `p` must be NULL or point to a NUL-terminated string valid for the call.
unsafe fn c_text(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: the caller's contract.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// The function at `p` as the function-pointer type `F`.
///
/// # Safety
/// `p` must be the address of a function whose C prototype is `F`, valid as long as `F` is
/// used.
unsafe fn func<F: Copy>(p: *mut c_void) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: the caller's contract; `F` is a function pointer, of a pointer's size (asserted).
    unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) }
}

//! cohort's process groups over MPI: the `mpi` backend of PyTorch's c10d,
//! for clusters where `mpirun` or Slurm's `srun` already start the ranks.
//!
//! [`init`] initialises MPI (`MPI_Init_thread`, `MPI_THREAD_MULTIPLE`) and
//! returns a [`ProcessGroup`] of every process of `MPI_COMM_WORLD`, whose
//! rank and size come from MPI: no store, no `MASTER_ADDR`, no launcher of
//! ours. The group is an ordinary [`ProcessGroup`], so DDP and the training
//! loop run on it unchanged; underneath, [`MpiBackend`] maps each call onto
//! the matching MPI call on a private duplicate of `MPI_COMM_WORLD`:
//!
//! | cohort | MPI |
//! |---|---|
//! | send / recv | `MPI_Send` / `MPI_Mprobe` + `MPI_Mrecv` (the length is checked first) |
//! | broadcast | `MPI_Bcast` |
//! | reduce | `MPI_Reduce` (`MPI_IN_PLACE` at the root) |
//! | all_reduce | `MPI_Allreduce` (`MPI_IN_PLACE`) |
//! | reduce_scatter | `MPI_Reduce_scatter_block` |
//! | all_gather / gather / scatter | `MPI_Allgather` / `MPI_Gather` / `MPI_Scatter` |
//! | all_to_all | `MPI_Alltoall` |
//! | barrier | `MPI_Barrier` |
//! | new_group | `MPI_Comm_split` |
//!
//! Element types: f32, f64, i32, i64 and u8 are MPI's own types; bf16 travels
//! as `MPI_UINT16_T`. Reduce operators: Sum, Product, and Min/Max on integers
//! are MPI's built-in operators; bf16 (every operator) and Min/Max on floats
//! are user-defined operators (`MPI_Op_create`) that run cohort's own kernel
//! ([`cohort_comm::reduce_into`]), so bf16 is summed in f32 and rounded to
//! nearest-even after each pairwise step, and NaN wins Min/Max whichever side
//! it is on, exactly as in cohort's TCP backend. Avg is MPI's Sum followed by
//! a division by the group size on the ranks that receive the result, as
//! cohort and Gloo do it.
//!
//! Failures follow MPI's fail-stop model, because MPI can neither cancel a
//! pending call nor leave a communicator: a call that has not completed
//! within the group's timeout (`COHORT_TIMEOUT`) is reported on stderr by a
//! watchdog thread, which then ends the job with `MPI_Abort`; a group that
//! aborts after an error (a message of the wrong length, a failed MPI call,
//! [`ProcessGroup::abort`]) ends the job the same way; a dead rank is
//! handled by the MPI launcher, which ends the others. Nothing hangs.
//!
//! [`ProcessGroup::new_group`] is `MPI_Comm_split` of the group's
//! communicator: the sub-group is an MPI group too, sharing the operators
//! and the initialisation (MPI is finalised when the last group goes).
//!
//! Limits: a receive checks the length of the message but MPI does not
//! carry its element type; counts are C `int`s (at most 2^31 - 1 elements
//! per call); MPI can be initialised once per process.
//!
//! Everything that touches MPI sits behind the cargo feature `mpi`; without
//! it this crate builds without an MPI installation and [`init`] returns
//! [`MpiError::NotBuilt`]. This crate must never start processes (mpirun
//! and srun do) and knows nothing of models.
//!
//! ```no_run
//! use cohort_comm::{GroupOptions, ReduceOp};
//!
//! // Started as `mpirun -np 4 ./my_program`.
//! let pg = cohort_mpi::init(GroupOptions::from_env().unwrap()).unwrap();
//! let mut x = vec![pg.rank() as f32; 8];
//! pg.all_reduce(&mut x, ReduceOp::Sum).unwrap();
//! assert_eq!(x[0], (0..pg.size()).sum::<usize>() as f32);
//! ```
#![deny(missing_docs)]

#[cfg(feature = "mpi")]
mod backend;
mod error;
#[cfg(feature = "mpi")]
mod no_store;
#[cfg(feature = "mpi")]
mod ops;
#[cfg(feature = "mpi")]
mod watchdog;

#[cfg(feature = "mpi")]
pub use backend::MpiBackend;
pub use error::MpiError;

use cohort_comm::{CommError, GroupOptions, InitOptions, ProcessGroup};

/// Whether this build of the crate has MPI (the `mpi` feature).
pub const BUILT_WITH_MPI: bool = cfg!(feature = "mpi");

/// Environment variables that MPI launchers set for every rank they start:
/// Open MPI's mpirun, PMIx (Open MPI 5, `srun --mpi=pmix`) and PMI
/// (MPICH's Hydra, `srun --mpi=pmi2`).
const LAUNCHER_VARS: [&str; 3] = ["OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE"];

/// Whether this process was started by an MPI launcher (mpirun, mpiexec,
/// srun with an MPI plugin), judged from the variables they set.
pub fn launched_by_mpi() -> bool {
    LAUNCHER_VARS.iter().any(|v| std::env::var_os(v).is_some())
}

/// Registers this backend as `mpi` in cohort-comm's registry, so that
/// `init_process_group("mpi", ..)` (and `cohort train --backend mpi`) builds
/// an MPI group; the init method is ignored, since mpirun or srun gave every
/// rank its place. A program calls it once at startup. A build without the
/// `mpi` feature registers it all the same: creating the group then fails
/// with [`MpiError::NotBuilt`], which says how to rebuild, rather than with
/// "unknown backend".
pub fn register() -> Result<(), CommError> {
    cohort_comm::register_backend("mpi", init_registered)
}

/// [`init`] as the registry calls it.
fn init_registered(_init_method: &str, opts: InitOptions) -> Result<ProcessGroup, CommError> {
    let group = match opts.group {
        Some(group) => group,
        None => GroupOptions::from_env()?,
    };
    init(group).map_err(|e| CommError::Init {
        name: "backend mpi".into(),
        detail: e.to_string(),
    })
}

/// Initialises MPI and returns the group of every process of
/// `MPI_COMM_WORLD` (rank and size from MPI), with `opts`' name and timeout.
///
/// Call it once per process; the group finalises MPI when its last handle
/// is dropped. A process not started by an MPI launcher becomes a world of
/// one (MPI's singleton init). Under `cohort run` (WORLD_SIZE set to more
/// than MPI's size) it fails with [`MpiError::NotLaunchedByMpi`] instead of
/// training alone unnoticed.
pub fn init(opts: GroupOptions) -> Result<ProcessGroup, MpiError> {
    #[cfg(feature = "mpi")]
    {
        backend::init(opts)
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = opts;
        Err(MpiError::NotBuilt)
    }
}

//! What can stop [`init`](crate::init). Errors of the calls themselves are
//! [`cohort_comm::CommError`]s, as on every backend.

/// Why an MPI group could not be created.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MpiError {
    /// This build has no MPI support.
    #[error("this build has no MPI support: rebuild with the `mpi` feature (cargo build --release --features mpi; needs an MPI installation such as Debian's libopenmpi-dev, and libclang)")]
    NotBuilt,
    /// MPI was initialised before in this process.
    #[error("MPI is already initialised in this process (cohort_mpi::init can be called once)")]
    AlreadyInitialized,
    /// The MPI library cannot be called from several threads at once.
    #[error("the MPI library provides thread level {provided}, but cohort needs MPI_THREAD_MULTIPLE (async collectives and send/recv run on threads of their own); use an MPI built with thread support")]
    Threading {
        /// The level MPI provided.
        provided: String,
    },
    /// The environment says the job has more ranks than MPI sees.
    #[error("WORLD_SIZE={env_world} but MPI sees {mpi_world} process(es): a job on the MPI backend must be started by mpirun, mpiexec or srun, not `cohort run`")]
    NotLaunchedByMpi {
        /// WORLD_SIZE from the environment.
        env_world: usize,
        /// The size of MPI_COMM_WORLD.
        mpi_world: usize,
    },
    /// An MPI call made while setting up the group failed.
    #[error("{call} failed: {detail}")]
    Call {
        /// The MPI function.
        call: &'static str,
        /// MPI's error string.
        detail: String,
    },
}

//! With the `mpi` feature, compiles the C shim (MPI_IN_PLACE and MPI_TAG_UB
//! are macros that the generated bindings cannot express) with the MPI
//! compiler wrapper (`MPICC`, default `mpicc`). Without it, does nothing.

fn main() {
    println!("cargo:rerun-if-changed=src/shim.c");
    println!("cargo:rerun-if-env-changed=MPICC");
    #[cfg(feature = "mpi")]
    {
        let mpicc = std::env::var("MPICC").unwrap_or_else(|_| "mpicc".to_string());
        cc::Build::new()
            .compiler(mpicc)
            .file("src/shim.c")
            .compile("cohort_mpi_shim");
    }
}

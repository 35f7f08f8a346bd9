/* The two values of mpi.h that are macros, not symbols: the bindings of the
 * `mpi` crate cannot name them, and their values differ between Open MPI and
 * MPICH, so they are read here, compiled against the installed mpi.h. */
#include <mpi.h>

void *cohort_mpi_in_place(void) { return MPI_IN_PLACE; }

/* The largest tag MPI_COMM_WORLD accepts (at least 32767), or -1. */
int cohort_mpi_tag_ub(void) {
    int *value = NULL;
    int found = 0;
    if (MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &value, &found) != MPI_SUCCESS || !found) {
        return -1;
    }
    return *value;
}

//! The store of an MPI group: MPI found the ranks, so there is nothing to
//! rendezvous through (`new_group` splits the communicator instead). Every
//! call fails at once with a message that says why, rather than a wait for
//! the group timeout. It must never pretend to store anything.

use std::time::Duration;

use cohort_store::{Store, StoreError};

pub(crate) struct NoStore;

fn refused() -> StoreError {
    StoreError::Protocol {
        location: "mpi".to_string(),
        detail: "groups of the MPI backend have no rendezvous store".to_string(),
    }
}

impl Store for NoStore {
    fn set(&self, _: &str, _: &[u8]) -> Result<(), StoreError> {
        Err(refused())
    }

    fn get(&self, _: &str) -> Result<Vec<u8>, StoreError> {
        Err(refused())
    }

    fn add(&self, _: &str, _: i64) -> Result<i64, StoreError> {
        Err(refused())
    }

    fn compare_set(&self, _: &str, _: &[u8], _: &[u8]) -> Result<Vec<u8>, StoreError> {
        Err(refused())
    }

    fn wait(&self, _: &[&str], _: Duration) -> Result<(), StoreError> {
        Err(refused())
    }

    fn check(&self, _: &[&str]) -> Result<bool, StoreError> {
        Err(refused())
    }

    fn delete(&self, _: &str) -> Result<bool, StoreError> {
        Err(refused())
    }

    fn num_keys(&self) -> Result<usize, StoreError> {
        Err(refused())
    }

    fn timeout(&self) -> Duration {
        Duration::ZERO
    }
}

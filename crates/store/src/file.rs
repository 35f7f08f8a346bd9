//! `FileStore`: a store in a file that every process of the job can open.
//! (Being written: see the store helper's task.)

/// A [`Store`](crate::Store) backed by a shared file.
pub struct FileStore;

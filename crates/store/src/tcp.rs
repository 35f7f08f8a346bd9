//! `TcpStore`: a store served over TCP by one process to all the others.
//! (Being written: see the store helper's task.)

/// Client of a [`TcpStoreServer`].
pub struct TcpStore;

/// The server side of a [`TcpStore`].
pub struct TcpStoreServer;

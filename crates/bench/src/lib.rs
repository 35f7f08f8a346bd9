//! The benchmarks behind `cohort bench`, one module per layer: each times a
//! library from outside, through its public API, and reports a table or JSON
//! lines whose keys scripts and the README depend on.
//!
//! The libraries carry no benchmark code of their own; this crate never
//! parses a command line (the binary does) and never changes what it times.

pub mod collectives;
pub mod rpc;

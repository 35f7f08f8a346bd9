//! The backend registry: the collective libraries this process can build a
//! process group on, by name, as torch.distributed's
//! `Backend.register_backend`.
//!
//! cohort-comm registers its own backend (sockets and shared memory) under
//! `cohort`, `tcp` and `gloo`. Other backends (MPI, a GPU library) live in
//! crates of their own and are registered by the program that links them,
//! at startup, so that a training loop names a backend and never depends on
//! one: adding a backend touches its crate and one registration call.
//!
//! This module must never know a backend's internals: it maps names to
//! constructors, nothing more.

use std::sync::{PoisonError, RwLock};

use crate::config::InitOptions;
use crate::error::CommError;
use crate::group::ProcessGroup;

/// Builds this process's default group on a backend, from an init method
/// (`env://`, `tcp://…`, `file://…`; a backend whose ranks come from its own
/// launcher, as MPI's from mpirun, may ignore it) and the options.
pub type BackendInit = fn(init_method: &str, opts: InitOptions) -> Result<ProcessGroup, CommError>;

/// The built-in backend's names: `cohort` (what `cohort train --backend`
/// calls it), `tcp`, and `gloo` for scripts written against PyTorch.
const BUILT_IN: [&str; 3] = ["cohort", "tcp", "gloo"];

static REGISTERED: RwLock<Vec<(String, BackendInit)>> = RwLock::new(Vec::new());

/// Registers `init` as backend `name` for this process. A name can be
/// registered once; registering it again (or a built-in name) is an
/// [`CommError::Init`] naming it, so two crates cannot silently replace each
/// other's backend.
pub fn register_backend(name: &str, init: BackendInit) -> Result<(), CommError> {
    let mut registered = REGISTERED.write().unwrap_or_else(PoisonError::into_inner);
    if BUILT_IN.contains(&name) || registered.iter().any(|(n, _)| n == name) {
        return Err(CommError::Init {
            name: "backend".into(),
            detail: format!("{name:?} is already registered"),
        });
    }
    registered.push((name.to_string(), init));
    Ok(())
}

/// The names [`init_process_group`](crate::init_process_group) accepts in
/// this process: the built-in ones, then the registered ones in order.
pub fn registered_backends() -> Vec<String> {
    let registered = REGISTERED.read().unwrap_or_else(PoisonError::into_inner);
    BUILT_IN
        .iter()
        .map(|n| n.to_string())
        .chain(registered.iter().map(|(n, _)| n.clone()))
        .collect()
}

/// What a backend name resolves to.
pub(crate) enum Registered {
    /// comm's own backend, which `init_process_group` builds itself.
    BuiltIn,
    /// A backend a program registered.
    Init(BackendInit),
}

/// What backend `name` is, or an error listing the backends this process
/// has.
pub(crate) fn lookup(name: &str) -> Result<Registered, CommError> {
    if BUILT_IN.contains(&name) {
        return Ok(Registered::BuiltIn);
    }
    let registered = REGISTERED.read().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, init)) = registered.iter().find(|(n, _)| n == name) {
        return Ok(Registered::Init(*init));
    }
    // The listing below takes the lock again; a second read while a writer
    // waits can deadlock, so let this one go first.
    drop(registered);
    // The common case of a missing backend is one this program was built
    // without: say how to get it.
    let hint = match name {
        "mpi" => "; MPI is registered by programs built with it (`cohort` with --features mpi)",
        _ => "",
    };
    Err(CommError::Init {
        name: "backend".into(),
        detail: format!(
            "unknown backend {name:?} (registered: {}{hint})",
            registered_backends().join(", ")
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fails(_: &str, _: InitOptions) -> Result<ProcessGroup, CommError> {
        Err(CommError::Init {
            name: "test".into(),
            detail: "the registered constructor ran".into(),
        })
    }

    #[test]
    fn a_registered_backend_is_found_and_listed_once() {
        register_backend("registry-test", fails).unwrap();
        assert!(registered_backends().contains(&"registry-test".to_string()));
        let err = crate::init_process_group("registry-test", "env://", InitOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("the registered constructor ran"), "{err}");
        let again = register_backend("registry-test", fails)
            .unwrap_err()
            .to_string();
        assert!(again.contains("already registered"), "{again}");
        let builtin = register_backend("gloo", fails).unwrap_err().to_string();
        assert!(builtin.contains("already registered"), "{builtin}");
    }

    #[test]
    fn an_unknown_backend_names_the_registered_ones() {
        let err = crate::init_process_group("nccl", "env://", InitOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown backend \"nccl\""), "{err}");
        assert!(err.contains("cohort, tcp, gloo"), "{err}");
        let mpi = crate::init_process_group("mpi", "env://", InitOptions::default())
            .unwrap_err()
            .to_string();
        assert!(mpi.contains("--features mpi"), "{mpi}");
    }
}

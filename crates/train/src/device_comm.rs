//! How the gradients of a model on a GPU travel between ranks: through a device collective
//! library (NCCL), or staged through the host and cohort's own collectives. The library is
//! linked by the program (the `cohort` binary registers cohort-nccl through
//! [`register_device_collectives`]), so that this crate never links a GPU library; this module
//! only asks it, as `--backend` says:
//!
//! - `--backend nccl`: NCCL or a one-line error (no library, ranks sharing a GPU that this
//!   NCCL refuses, which names the fix);
//! - otherwise (the default, `cohort`): NCCL when every rank has a GPU of its own and NCCL
//!   loads on every rank, else host staging, with the reason for the header.
//!
//! Every rank reaches the same answer (the library's set-up compares the ranks over the
//! group). This module never moves memory itself.

use std::sync::OnceLock;

use cohort_comm::ProcessGroup;
use cohort_engine::{Backend, Event, ViewMut};

use crate::error::TrainError;

/// Collectives on device memory, as the training loop uses them.
pub trait DeviceCollectives: Send + Sync {
    /// What moves the gradients, for the header ("NCCL 2.30.7").
    fn name(&self) -> String;
    /// `grads` (memory of `backend`, the model's) averaged over the group in place, queued
    /// in order with the kernels before it; returns when done. Collective. An error is one
    /// line naming the rank and the operation, and leaves the collectives unusable (a
    /// timeout aborts them instead of hanging).
    fn all_reduce_avg(&self, backend: &dyn Backend, grads: ViewMut<'_, f32>) -> Result<(), String>;

    /// [`DeviceCollectives::all_reduce_avg`] of one bucket, queued after the kernels before
    /// `after` (an event of `backend` recorded as backward handed the bucket's last range
    /// over) and apart from the kernels launched since, so that it runs while backward goes
    /// on (NCCL: on its communication stream); returns when done. Called from a reducer
    /// thread, one bucket at a time, in the same order on every rank, while the training
    /// thread launches backward's kernels; no kernel launched after `after` touches `grads`.
    /// The default queues it as [`DeviceCollectives::all_reduce_avg`] does (in order with
    /// every kernel launched so far, which `after` precedes).
    fn all_reduce_avg_after(
        &self,
        backend: &dyn Backend,
        grads: ViewMut<'_, f32>,
        after: &Event,
    ) -> Result<(), String> {
        let _ = after;
        self.all_reduce_avg(backend, grads)
    }

    /// Orders `backend`'s kernels launched from now on after every
    /// [`DeviceCollectives::all_reduce_avg_after`] so far (NCCL: the kernels' stream waits
    /// for the communication stream by an event), before anything reads the averaged
    /// gradients. The default has nothing to order: it queued on the kernels' stream.
    fn order_kernels_after(&self, backend: &dyn Backend) -> Result<(), String> {
        let _ = backend;
        Ok(())
    }
}

/// What the program's library settled on for a group.
pub enum DeviceSync {
    /// The library's collectives.
    Collectives(Box<dyn DeviceCollectives>),
    /// Host staging, for this reason (one line, the same on every rank).
    Staged(String),
}

/// Builds the device collectives over `pg` for a model on `backend`: `key` scopes the store
/// keys of the set-up; `required` is `--backend nccl` (an error rather than staging). A
/// backend the library cannot serve (not a CUDA GPU) is its to refuse or stage. Collective
/// over `pg`.
pub type DeviceCollectivesFn = fn(
    pg: &ProcessGroup,
    backend: &dyn Backend,
    key: &str,
    required: bool,
) -> Result<DeviceSync, String>;

static REGISTERED: OnceLock<DeviceCollectivesFn> = OnceLock::new();

/// Registers the device collectives (the `cohort` binary does, with cohort-nccl's). A second
/// registration is ignored.
pub fn register_device_collectives(build: DeviceCollectivesFn) {
    let _ = REGISTERED.set(build);
}

/// The gradient sync of a model on `backend` over `pg` (more than one rank) that
/// `backend_name` (`--backend`) asks for. Collective over `pg`.
pub(crate) fn device_sync(
    backend_name: &str,
    pg: &ProcessGroup,
    backend: &dyn Backend,
) -> Result<DeviceSync, TrainError> {
    let required = backend_name == "nccl";
    let refuse = |why: String| match required {
        true => Err(TrainError::DeviceComm(format!("--backend nccl: {why}"))),
        false => Ok(DeviceSync::Staged(why)),
    };
    let Some(build) = REGISTERED.get() else {
        return refuse("this program was built without NCCL (the cohort binary has it)".into());
    };
    // A restarted job meets in the same store: its set-up keys must be new ones.
    let restart = crate::elastic::restart_count_from_env()?;
    let key = format!("cohort-nccl/{}/restart-{restart}", pg.name());
    build(pg, backend, &key, required).map_err(TrainError::DeviceComm)
}

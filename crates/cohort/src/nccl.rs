//! NCCL for the training crates, which never link a GPU library themselves
//! (`cohort_train::register_device_collectives`): cohort-nccl's set-up over the process group
//! and its all-reduces behind the training crate's trait (a bucket's on NCCL's communication
//! stream after backward's event, the kernels' stream then ordered after them). Wiring only:
//! cohort-nccl finds the library, compares the ranks' GPUs, exchanges the id and runs the
//! collectives.

use cohort_cuda::libraries::Search;
use cohort_engine::{Backend, Event, ViewMut};
use cohort_nccl::{join, Binding, Communicator, Joined, Policy, Reduce};
use cohort_train::{DeviceCollectives, DeviceSync};

/// Registers [`open`] with the training crate.
pub fn register() {
    cohort_train::register_device_collectives(open);
}

/// A communicator as the training loop uses it.
struct Nccl(Communicator);

impl DeviceCollectives for Nccl {
    fn name(&self) -> String {
        format!("NCCL {}", self.0.nccl().version())
    }

    fn all_reduce_avg(&self, _: &dyn Backend, grads: ViewMut<'_, f32>) -> Result<(), String> {
        self.0
            .all_reduce(grads, Reduce::Avg)
            .map_err(|e| e.to_string())
    }

    fn all_reduce_avg_after(
        &self,
        _: &dyn Backend,
        grads: ViewMut<'_, f32>,
        after: &Event,
    ) -> Result<(), String> {
        self.0
            .all_reduce_after(grads, Reduce::Avg, after)
            .map_err(|e| e.to_string())
    }

    fn order_kernels_after(&self, _: &dyn Backend) -> Result<(), String> {
        self.0.order_kernels_after().map_err(|e| e.to_string())
    }
}

/// NCCL over `pg` on `backend`'s GPU and stream (required: `--backend nccl`), or the reason to
/// stage through the host. Collective.
fn open(
    pg: &cohort_comm::ProcessGroup,
    backend: &dyn Backend,
    key: &str,
    required: bool,
) -> Result<DeviceSync, String> {
    // Every rank has the same kind of device: all refuse, or all stage.
    let Some(binding) = Binding::of(backend) else {
        return match required {
            true => Err(format!(
                "--backend nccl: {} is not a CUDA GPU",
                backend.device()
            )),
            false => Ok(DeviceSync::Staged(format!(
                "{} has no NCCL",
                backend.device()
            ))),
        };
    };
    let policy = match required {
        true => Policy::Required,
        false => Policy::Preferred,
    };
    match join(pg, &Search::from_env(), binding, key, policy).map_err(|e| e.to_string())? {
        Joined::Nccl(c) => Ok(DeviceSync::Collectives(Box::new(Nccl(c)))),
        Joined::Staged(why) => Ok(DeviceSync::Staged(why)),
    }
}

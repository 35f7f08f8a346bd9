//! The device-collectives hook of a model on a device, with a stand-in registered for NCCL
//! (its own test program: the registry is the process's). The stand-in averages the gradients
//! through the host on the model's backend, as host staging does, so the run must match the
//! CPU's DDP; what is checked is the wiring NCCL uses on a GPU: the registry asked with the
//! group and the model's backend, the gradients averaged after the last backward, the header
//! naming the library, and the NaN skip and clipping on every rank after the average.

mod common;

use cohort_comm::{ProcessGroup, ReduceOp};
use cohort_engine::{Backend, ViewMut};
use cohort_train::{DeviceChoice, DeviceCollectives, DeviceSync, NanInjection, TrainConfig};
use common::{max_abs_diff, run_world, tiny};

/// `v` as bytes.
fn bytes(v: &mut [f32]) -> &mut [u8] {
    ViewMut::from(v).cast::<u8>().host()
}

/// Averages through the host, on the group it was made for.
struct StandIn(ProcessGroup);

impl DeviceCollectives for StandIn {
    fn name(&self) -> String {
        "a stand-in for NCCL".into()
    }

    fn all_reduce_avg(&self, backend: &dyn Backend, grads: ViewMut<'_, f32>) -> Result<(), String> {
        let mut host = vec![0f32; grads.len()];
        backend
            .copy_to_host(bytes(&mut host), grads.as_view().cast::<u8>())
            .map_err(|e| e.to_string())?;
        self.0
            .all_reduce(&mut host, ReduceOp::Avg)
            .map_err(|e| format!("stand-in all_reduce on rank {}: {e}", self.0.rank()))?;
        backend
            .copy_from_host(grads.cast::<u8>(), bytes(&mut host))
            .map_err(|e| e.to_string())
    }
}

fn stand_in(
    pg: &ProcessGroup,
    _: &dyn Backend,
    key: &str,
    _required: bool,
) -> Result<DeviceSync, String> {
    assert!(key.starts_with("cohort-nccl/"), "{key}");
    Ok(DeviceSync::Collectives(Box::new(StandIn(pg.clone()))))
}

#[test]
fn gradients_go_through_the_registered_collectives_and_the_guard_still_holds() {
    cohort_train::register_device_collectives(stand_in);
    let cfg = |device| TrainConfig {
        steps: 6,
        grad_clip: 0.5,
        inject_nan: Some(NanInjection::parse("2-3").unwrap()),
        device,
        ..tiny()
    };
    let cpu = run_world(2, &cfg(DeviceChoice::Cpu));
    let dev = run_world(2, &cfg(DeviceChoice::Emulated));
    // DDP's buckets and the one all-reduce average in their own orders.
    assert!(max_abs_diff(&dev[0].params, &cpu[0].params) < 2e-5);
    assert!(dev[0].params == dev[1].params, "the ranks diverged");
    assert!(dev[0].params.iter().all(|p| p.is_finite()));
    let text = |o: &cohort_train::Outcome| format!("{:?}", o.train_losses);
    assert_eq!(text(&dev[0]).contains("NaN"), text(&cpu[0]).contains("NaN"));
    // The header names what averaged the gradients.
    let logs = cohort_comm::spawn::threads_with(2, common::opts(), |pg| {
        let mut log = Vec::new();
        let one = TrainConfig {
            steps: 1,
            ..cfg(DeviceChoice::Emulated)
        };
        cohort_train::train(&one, pg, &mut log).map(|_| String::from_utf8(log).unwrap())
    })
    .unwrap();
    let header = logs[0].lines().find(|l| l.starts_with("model:")).unwrap();
    assert!(
        header.contains("DDP's gradients averaged on the device by a stand-in for NCCL"),
        "{header}"
    );
}

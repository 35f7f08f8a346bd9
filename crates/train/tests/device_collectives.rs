//! The device-collectives hook of a model on a device, with a stand-in registered for NCCL
//! (its own test program: the registry is the process's). The stand-in averages the gradients
//! through the host on the model's backend, as host staging does, so the run must match the
//! CPU's DDP; what is checked is the wiring NCCL uses on a GPU: the registry asked with the
//! group and the model's backend, the gradients averaged after the last backward (overlap off)
//! or bucket by bucket from a reducer thread while backward goes on (overlap on), the kernels
//! ordered after the buckets, the header naming the library, and the NaN skip and clipping on
//! every rank after the average.

mod common;

use cohort_comm::{ProcessGroup, ReduceOp};
use std::sync::atomic::{AtomicUsize, Ordering};

use cohort_engine::{Backend, Event, ViewMut};
use cohort_train::{
    DeviceChoice, DeviceCollectives, DeviceSync, NanInjection, Overlap, TrainConfig,
};
use common::{max_abs_diff, run_world, tiny};

/// `v` as bytes.
fn bytes(v: &mut [f32]) -> &mut [u8] {
    ViewMut::from(v).cast::<u8>().host()
}

/// Averages through the host, on the group it was made for.
struct StandIn(ProcessGroup);

/// Buckets averaged through [`DeviceCollectives::all_reduce_avg_after`], and the times the
/// kernels were ordered after them, over every rank of the process.
static BUCKETS: AtomicUsize = AtomicUsize::new(0);
static ORDERED: AtomicUsize = AtomicUsize::new(0);

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

    fn all_reduce_avg_after(
        &self,
        backend: &dyn Backend,
        grads: ViewMut<'_, f32>,
        _: &Event,
    ) -> Result<(), String> {
        BUCKETS.fetch_add(1, Ordering::SeqCst);
        self.all_reduce_avg(backend, grads)
    }

    fn order_kernels_after(&self, _: &dyn Backend) -> Result<(), String> {
        ORDERED.fetch_add(1, Ordering::SeqCst);
        Ok(())
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

/// The header of a one-step run of `cfg` on two ranks.
fn header(cfg: &TrainConfig) -> String {
    let logs = cohort_comm::spawn::threads_with(2, common::opts(), |pg| {
        let mut log = Vec::new();
        let one = TrainConfig {
            steps: 1,
            ..cfg.clone()
        };
        cohort_train::train(&one, pg, &mut log).map(|_| String::from_utf8(log).unwrap())
    })
    .unwrap();
    logs[0].clone()
}

#[test]
fn gradients_go_through_the_registered_collectives_and_the_guard_still_holds() {
    cohort_train::register_device_collectives(stand_in);
    let cfg = |device, overlap| TrainConfig {
        steps: 6,
        grad_clip: 0.5,
        grad_accum: 2,
        inject_nan: Some(NanInjection::parse("2-3@1").unwrap()),
        device,
        overlap,
        // 2500 floats: 11 buckets of this model's 23 thousand parameters.
        bucket_cap_mb: 0.01,
        ..tiny()
    };
    let cpu = run_world(2, &cfg(DeviceChoice::Cpu, Overlap::Off));
    for overlap in [Overlap::Off, Overlap::On] {
        let (before, ordered) = (
            BUCKETS.load(Ordering::SeqCst),
            ORDERED.load(Ordering::SeqCst),
        );
        let dev = run_world(2, &cfg(DeviceChoice::Emulated, overlap));
        let buckets = BUCKETS.load(Ordering::SeqCst) - before;
        let ordered = ORDERED.load(Ordering::SeqCst) - ordered;
        match overlap {
            // Each rank: a bucket call per bucket per step, the kernels ordered once a step.
            Overlap::On => {
                assert!(buckets >= 2 * 6 * 3, "{buckets} bucket all-reduces");
                assert_eq!(buckets % (2 * 6), 0, "{buckets} bucket all-reduces");
                assert_eq!(ordered, 2 * 6);
            }
            _ => assert_eq!((buckets, ordered), (0, 0)),
        }
        // DDP's buckets and the one all-reduce average in their own orders.
        let what = format!("overlap {overlap:?}");
        assert!(
            max_abs_diff(&dev[0].params, &cpu[0].params) < 2e-5,
            "{what}"
        );
        assert!(dev[0].params == dev[1].params, "the ranks diverged: {what}");
        assert!(dev[0].params.iter().all(|p| p.is_finite()), "{what}");
        // The skipped steps' (NaN) on both, the same loss elsewhere.
        for (c, d) in cpu[0].train_losses.iter().zip(&dev[0].train_losses) {
            let same = (c.1 - d.1).abs() < 1e-4 || (c.1.is_nan() && d.1.is_nan());
            assert!(same, "{what}: {c:?} {d:?}");
        }
    }
    let header = header(&cfg(DeviceChoice::Emulated, Overlap::On));
    let line = header.lines().find(|l| l.starts_with("model:")).unwrap();
    assert!(
        line.contains("DDP's gradients averaged on the device by a stand-in for NCCL in buckets")
            && line.contains("overlap on"),
        "{line}"
    );
    let line = header
        .lines()
        .find(|l| l.starts_with("gradients: averaged"))
        .unwrap();
    assert!(
        line.contains("bucket by bucket while backward goes on"),
        "{line}"
    );
}

#[test]
fn the_whole_gradient_goes_after_backward_with_overlap_off() {
    cohort_train::register_device_collectives(stand_in);
    let cfg = |device| TrainConfig {
        steps: 6,
        grad_clip: 0.5,
        inject_nan: Some(NanInjection::parse("2-3").unwrap()),
        device,
        overlap: Overlap::Off,
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
    let header = header(&cfg(DeviceChoice::Emulated));
    let line = header.lines().find(|l| l.starts_with("model:")).unwrap();
    assert!(
        line.contains(
            "DDP's gradients averaged on the device by a stand-in for NCCL after backward"
        ),
        "{line}"
    );
}

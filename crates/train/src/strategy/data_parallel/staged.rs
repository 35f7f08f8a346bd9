//! Data parallelism for a model in a device's memory, its gradients staged through the host:
//! what gloo does for CUDA tensors, always available, and how two ranks share one GPU.
//!
//! - [`StagedDdp`]: DDP as on the CPU (cohort-ddp's buckets, their order and its reducer) over
//!   a host copy of the gradient buffer. As backward finishes a range of gradients (the model's
//!   readiness hook, each block's MLP half first), the hook records an event on the device; a
//!   copy thread beside backward waits for that event only, copies the range into page-locked
//!   staging ([`Backend::copy_to_host_after`]) and hands it to DDP's reducer, whose thread
//!   all-reduces each bucket as soon as its ranges have landed, while backward goes on, and
//!   copies it back into the device's gradients beside the kernels still running
//!   ([`Backend::copy_from_host_beside`]). What DDP reduces after backward (the last bucket,
//!   or everything with overlap off) goes back then, before the optimizer.
//! - [`StagedZero1`]: ZeRO-1 over the same staging: the gradient copied down as backward
//!   finishes it, reduce-scattered on the host once backward ends (as the CPU's ZeRO-1 does),
//!   AdamW on this rank's shard on the host, the parameters all-gathered and uploaded.
//!
//! This module never reads device memory but through the backend's copies, and never hands
//! the reducer a staged range before the device's copy into it has landed.

use std::ops::Range;
use std::sync::{mpsc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cohort_comm::ProcessGroup;
use cohort_ddp::{Compression, Ddp, DdpOptions, ReadyHook, SyncStats};
use cohort_engine::optim::AdamWConfig;
use cohort_engine::{Backend, EngineError, Event, Staging, View, ViewMut};
use cohort_gpt::optim_groups::decay_mask;
use cohort_gpt::{Backward, GptError, GPT};

use super::step::GradSync;
use super::zero1::Zero1;
use crate::checkpoint::ShardTarget;
use crate::error::TrainError;
use crate::replica::{agree_on_size, param_specs};

/// DDP of a model in a device's memory, its buckets reduced in host staging (see the module
/// doc).
pub struct StagedDdp<'pg> {
    ddp: Ddp<'pg>,
    /// The host copy of the gradient buffer the buckets are reduced in (empty when alone and
    /// uncompressed: averaging is then the identity, and nothing is staged).
    staging: Staging,
}

impl<'pg> StagedDdp<'pg> {
    /// DDP over `model` (every rank's checked to be the same, rank 0's parameters made every
    /// rank's through the host), its buckets cut along the ranges backward hands over, with
    /// page-locked staging for the gradients from the model's backend. Collective.
    pub fn new(
        pg: &'pg ProcessGroup,
        model: &mut GPT,
        options: DdpOptions,
        stage: bool,
    ) -> Result<Self, TrainError> {
        let n = model.num_params();
        let mut host = vec![0f32; n];
        model.copy_params_to_host(&mut host)?;
        let mut ddp = Ddp::new(pg, param_specs(model), &mut host, options)?;
        model.copy_params_from_host(&host)?;
        ddp.plan_along(&model.split_ready_ranges());
        // Nothing to stage on one rank (unless compression rounds the gradients), nor where
        // NCCL averages them on the device (`stage` false).
        let solo = pg.size() == 1 && ddp.options().compression == Compression::None;
        let staging = match solo || !stage {
            true => Staging::default(),
            false => (model.backend().alloc_staging(n)).map_err(engine("allocate host staging"))?,
        };
        Ok(StagedDdp { ddp, staging })
    }

    /// The buckets and their options.
    pub fn ddp(&self) -> &Ddp<'pg> {
        &self.ddp
    }

    /// The last micro-batch's backward with the gradients' average (see the module doc): each
    /// bucket's all-reduce on the host overlaps the rest of backward when DDP's overlap is on;
    /// the averaged gradient is on the device when it returns. Collective.
    pub fn backward(&mut self, model: &mut GPT) -> Result<SyncStats, TrainError> {
        if self.staging.is_empty() {
            let t = Instant::now();
            model.backward(Backward::new())?;
            return Ok(SyncStats {
                backward: t.elapsed(),
                ..SyncStats::default()
            });
        }
        let dev = model.backend_handle();
        // The device's view of each range copied down, kept for the bucket's way back, and the
        // buckets back on the device; both shared by the copy thread and DDP's reduction thread.
        let kept = Mutex::new(Vec::new());
        let back = Mutex::new(Uploads::default());
        let staging: &mut [f32] = &mut self.staging;
        let mut reduced = |bucket: Range<usize>, averaged: &[f32]| {
            upload_bucket(&*dev, &kept, &back, bucket, averaged)
        };
        let pending = self.ddp.backward_then(
            |ready| {
                stage_during(&*dev, staging, ready, Some(&kept), |hook| {
                    model.backward(Backward::new().on_ready(hook).split_blocks())
                })
            },
            &mut reduced,
        )?;
        let mut stats = pending.finish(&mut self.staging)?;
        drop(kept);
        let Uploads { done, error } = back.into_inner().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = error {
            return Err(engine("copy averaged gradients to the device")(e));
        }
        // What DDP reduced after backward (all of it with overlap off) goes back now; the upload
        // from page-locked memory may still be queued when the copy returns, and the staging is
        // written again next step: wait.
        let t = Instant::now();
        let (dev, mut grads) = model.grads_view_mut();
        for gap in gaps(done, self.staging.len()) {
            let (dst, src) = (grads.slice_mut(gap.clone()), &self.staging[gap]);
            dev.upload(dst, src)
                .map_err(engine("copy averaged gradients to the device"))?;
        }
        dev.sync()
            .map_err(engine("copy averaged gradients to the device"))?;
        stats.comm_wait += t.elapsed();
        Ok(stats)
    }
}

/// ZeRO-1 of a model in a device's memory: the gradient staged on the host as backward
/// finishes it, the optimizer's shard on the host (see the module doc).
pub struct StagedZero1 {
    zero: Zero1,
    /// The host copy of the gradient the reduce-scatter reads.
    staging: Staging,
    /// The host copy of the parameters, which the all-gather fills and which is uploaded.
    params: Vec<f32>,
}

impl StagedZero1 {
    /// ZeRO-1 over `model` (rank 0's parameters made every rank's through the host), AdamW as
    /// `adamw` says over this rank's shard, the gradient travelling as `compression` says.
    /// Collective.
    pub fn new(
        pg: &ProcessGroup,
        model: &mut GPT,
        adamw: AdamWConfig,
        compression: Compression,
    ) -> Result<Self, TrainError> {
        let n = model.num_params();
        agree_on_size(pg, n)?;
        let mut params = vec![0f32; n];
        model.copy_params_to_host(&mut params)?;
        pg.broadcast(&mut params, 0)
            .map_err(TrainError::comm("initial parameters broadcast"))?;
        model.copy_params_from_host(&params)?;
        let mask = decay_mask(model.param_views());
        let mut zero = Zero1::new(pg, &params, &mask, adamw)?;
        zero.set_compression(compression);
        let staging =
            (model.backend().alloc_staging(n)).map_err(engine("allocate host staging"))?;
        Ok(StagedZero1 {
            zero,
            staging,
            params,
        })
    }

    /// The optimizer's shard and its collectives.
    pub fn zero(&self) -> &Zero1 {
        &self.zero
    }

    /// This rank's shard of the mean gradient, for the loop to scale, check and clip.
    pub fn shard_grads_mut(&mut self) -> &mut [f32] {
        self.zero.shard_grads_mut()
    }

    /// The last micro-batch's backward, the gradient copied to the host as backward finishes
    /// it, then reduce-scattered. Returns the backward's time and the reduce-scatter's.
    /// Collective.
    pub fn backward(
        &mut self,
        pg: &ProcessGroup,
        model: &mut GPT,
    ) -> Result<(Duration, Duration), TrainError> {
        let dev = model.backend_handle();
        let t = Instant::now();
        stage_during(&*dev, &mut self.staging, &mut |_, _| {}, None, |hook| {
            model.backward(Backward::new().on_ready(hook).split_blocks())
        })?;
        let backward = t.elapsed();
        let t = Instant::now();
        self.zero.reduce_scatter(pg, &self.staging)?;
        Ok((backward, t.elapsed()))
    }

    /// AdamW at `lr` on the shard, every rank's shard gathered and uploaded to the model.
    /// Returns the all-gather's time. Collective.
    pub fn update(
        &mut self,
        pg: &ProcessGroup,
        model: &mut GPT,
        lr: f64,
    ) -> Result<Duration, TrainError> {
        self.zero.update(lr)?;
        let t = Instant::now();
        self.zero.all_gather(pg, &mut self.params)?;
        let comm = t.elapsed();
        model.copy_params_from_host(&self.params)?;
        Ok(comm)
    }

    /// This rank's shard from a checkpoint (`target`, restored), every rank's gathered and
    /// uploaded to the model. Collective.
    pub(crate) fn restore(
        &mut self,
        pg: &ProcessGroup,
        target: &ShardTarget<'_>,
        model: &mut GPT,
    ) -> Result<(), TrainError> {
        self.zero.restore(pg, target, &mut self.params)?;
        model.copy_params_from_host(&self.params)?;
        Ok(())
    }

    /// The whole model's parameters (the host copy, the same as the device's after every
    /// update).
    pub fn params(&self) -> &[f32] {
        &self.params
    }
}

/// The header line that says how a device model's gradients move between `world` ranks
/// (`None` for a model on the host, which DDP's own line describes).
pub(crate) fn gradients_line(
    sync: &GradSync<'_>,
    world: usize,
    overlap: bool,
    compression: Compression,
) -> Option<String> {
    let wire = match compression {
        Compression::None => "f32",
        Compression::Bf16 => "bf16",
    };
    let because = |why: &Option<String>| {
        why.as_ref()
            .map_or(String::new(), |w| format!(" (host staging: {w})"))
    };
    // NCCL sums what the device holds: f32.
    let f32_only = match compression {
        Compression::Bf16 => " (bf16 compression is host staging's: NCCL moves the f32 gradients)",
        Compression::None => "",
    };
    let line = match sync {
        GradSync::Device { nccl: Some(c), .. } if overlap => format!(
            "gradients: averaged on the device by {} over {world} rank(s) in f32, bucket by \
             bucket while backward goes on: an event recorded on the kernels' stream as \
             backward finishes each range; each bucket's all-reduce queued by a reducer thread \
             on {}'s communication stream after the event of its last range; the kernels' \
             stream waits for the communication stream before the gradient guard and \
             AdamW{f32_only}",
            c.name(),
            c.name()
        ),
        GradSync::Device { nccl: Some(c), .. } => format!(
            "gradients: averaged on the device by {} over {world} rank(s) in f32 after backward \
             (overlap off){f32_only}",
            c.name()
        ),
        GradSync::Device { ddp, .. } if ddp.staging.is_empty() => {
            "gradients: on the device (one rank: nothing to average)".to_string()
        }
        GradSync::Device { staged_because, .. } if overlap => format!(
            "gradients: host-staged: each range copied to page-locked host memory as backward \
             finishes it (an event per range, a copy stream), each bucket all-reduced in {wire} \
             with cohort's collectives over {world} rank(s) and copied back beside the kernels \
             while backward goes on{}",
            because(staged_because)
        ),
        GradSync::Device { staged_because, .. } => format!(
            "gradients: host-staged: copied to page-locked host memory as backward finishes \
             them, all-reduced in {wire} over {world} rank(s) after backward (overlap off), \
             copied back before the optimizer{}",
            because(staged_because)
        ),
        GradSync::DeviceZero1(_) => format!(
            "gradients: host-staged: copied to page-locked host memory as backward finishes \
             them, reduce-scattered in {wire} over {world} rank(s) after backward; the \
             parameters all-gathered on the host and uploaded"
        ),
        _ => return None,
    };
    Some(line)
}

/// The buckets a reduction thread copied back to the device, and the first copy that failed.
#[derive(Default)]
struct Uploads {
    done: Vec<Range<usize>>,
    error: Option<EngineError>,
}

/// The device's views of the ranges copied down, with their places in the buffer.
type Kept<'m> = Mutex<Vec<(Range<usize>, ViewMut<'m, f32>)>>;

/// Copies the averaged `bucket` (`averaged`, its staging) back into the device's views of it
/// in `kept` (every range of it was copied down, so kept, before the bucket was reduced),
/// beside the kernels of the backward still running; notes it, or the error, in `back`.
fn upload_bucket(
    dev: &dyn Backend,
    kept: &Kept<'_>,
    back: &Mutex<Uploads>,
    bucket: Range<usize>,
    averaged: &[f32],
) {
    let mut views = lock(kept);
    let mut result = Ok(());
    for (range, view) in views.iter_mut() {
        let (lo, hi) = (range.start.max(bucket.start), range.end.min(bucket.end));
        if lo >= hi || result.is_err() {
            continue;
        }
        let dst = view
            .slice_mut(lo - range.start..hi - range.start)
            .cast::<u8>();
        let src = &averaged[lo - bucket.start..hi - bucket.start];
        result = dev.copy_from_host_beside(dst, View::from(src).cast::<u8>().host());
    }
    // A range wholly inside the bucket is done with.
    views.retain(|(r, _)| !(bucket.start <= r.start && r.end <= bucket.end));
    drop(views);
    let mut back = lock(back);
    match result {
        Ok(()) => back.done.push(bucket),
        Err(e) => {
            back.error.get_or_insert(e);
        }
    }
}

/// The parts of `0..len` that `done` (disjoint ranges) leaves out, ascending.
fn gaps(mut done: Vec<Range<usize>>, len: usize) -> Vec<Range<usize>> {
    done.sort_by_key(|r| r.start);
    let mut out = Vec::new();
    let mut at = 0;
    for r in done {
        if r.start > at {
            out.push(at..r.start);
        }
        at = at.max(r.end);
    }
    if at < len {
        out.push(at..len);
    }
    out
}

/// A mutex's guard, even after a panic elsewhere (each update is one push, one retain or one
/// assignment: the value stays whole).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `backward` (the model's, given the readiness hook to pass it) and copies each range of
/// gradients it hands over into the same range of `staging` on a thread beside it, once the
/// kernels before the range's event have run; there each range's view goes to `keep` (when
/// given) and `landed(range, staged)` follows. The ranges must come top down, tiling the
/// buffer, as the model hands them over.
fn stage_during<'g, 'm>(
    dev: &dyn Backend,
    staging: &'g mut [f32],
    landed: &mut ReadyHook<'_, 'g>,
    keep: Option<&Kept<'m>>,
    backward: impl FnOnce(
        &mut (dyn FnMut(Range<usize>, ViewMut<'m, f32>) + Send),
    ) -> Result<(), GptError>,
) -> Result<(), TrainError> {
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel::<(Range<usize>, ViewMut<'m, f32>, Event)>();
        let copier = s.spawn(move || -> Result<(), TrainError> {
            // What is left to fill: the staging below the ranges copied so far.
            let mut rest = staging;
            for (range, grads, done) in rx {
                if range.end != rest.len() || range.len() != grads.len() {
                    return Err(GptError::Engine {
                        op: "host staging",
                        reason: format!(
                            "backward handed over gradients {range:?} ({} floats) where \
                             {}..{} was next",
                            grads.len(),
                            rest.len().saturating_sub(range.len()),
                            rest.len()
                        ),
                    }
                    .into());
                }
                let (lower, top) = std::mem::take(&mut rest).split_at_mut(range.start);
                let bytes = ViewMut::from(&mut *top).cast::<u8>().host();
                dev.copy_to_host_after(bytes, grads.as_view().cast(), &done)
                    .map_err(engine("copy gradients to the host"))?;
                if let Some(keep) = keep {
                    lock(keep).push((range.clone(), grads));
                }
                landed(range, top);
                rest = lower;
            }
            Ok(())
        });
        let ran = backward(&mut |range, grads| {
            let done = dev.record_event();
            // Fails only if the copier stopped on an error, which its join reports.
            let _ = tx.send((range, grads, done));
        });
        drop(tx);
        let copied = copier
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
        ran?;
        copied
    })
}

/// An engine error as the model's, naming what was being done.
fn engine(op: &'static str) -> impl Fn(EngineError) -> TrainError {
    move |e| {
        GptError::Engine {
            op,
            reason: e.to_string(),
        }
        .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_engine::{DType, Emulated};
    use cohort_gpt::{Forward, GPTConfig, Labels};

    /// A bucket averaged during backward goes back into the device's views of the ranges it
    /// covers (in part for a range it cuts), and the rest is what is left to upload after.
    #[test]
    fn an_averaged_bucket_goes_back_into_the_views_it_covers() {
        let emu = Emulated::new(1, DType::F32).unwrap();
        let dev: &dyn Backend = &emu;
        let mut buf = dev.alloc(10).unwrap();
        {
            let (lo, hi) = buf.view_mut().split_at_mut(4);
            let kept = Mutex::new(vec![(4..10, hi), (0..4, lo)]);
            let back = Mutex::new(Uploads::default());
            let averaged: Vec<f32> = (2..10).map(|i| i as f32).collect();
            upload_bucket(dev, &kept, &back, 2..10, &averaged);
            // 4..10 is done with; 0..4 waits for the bucket below.
            let left: Vec<Range<usize>> = lock(&kept).iter().map(|(r, _)| r.clone()).collect();
            assert_eq!(left, vec![0..4]);
            let Uploads { done, error } = back.into_inner().unwrap();
            assert!(error.is_none());
            assert_eq!(gaps(done, 10), vec![0..2]);
        }
        let mut out = [0f32; 10];
        dev.download(&mut out, buf.view()).unwrap();
        assert_eq!(out, [0.0, 0.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
        assert_eq!(gaps(vec![4..6, 0..2], 8), vec![2..4, 6..8]);
        assert_eq!(gaps(Vec::new(), 3), vec![0..3]);
    }

    /// The staging filled range by range as the emulated device's backward hands them over,
    /// each range landed before the reducer sees it: the device's gradients, bit for bit.
    #[test]
    fn staging_during_backward_copies_every_range_in_order() {
        let config = GPTConfig {
            vocab_size: 11,
            max_position_embeddings: 8,
            n_layers: 2,
            n_heads: 2,
            d_model: 8,
            d_ff: 32,
            ..GPTConfig::default()
        };
        let dev = Box::new(Emulated::new(1, DType::F32).unwrap());
        let mut model = GPT::with_backend(config, 3, dev).unwrap();
        let ids = [1u32, 2, 3, 4, 5, 6];
        let labels = [2i32, 3, 4, 5, 6, 7];
        let pass = Forward::new(&ids, 1, 6).labels(Labels::Aligned(&labels));
        model.forward(pass).unwrap();
        let n = model.num_params();
        let mut staging = vec![f32::NAN; n];
        let mut seen = Vec::new();
        let handle = model.backend_handle();
        let mut landed = |r: Range<usize>, g: &mut [f32]| {
            assert!(
                g.iter().all(|x| x.is_finite()),
                "{r:?} seen before it landed"
            );
            seen.push(r);
        };
        stage_during(&*handle, &mut staging, &mut landed, None, |hook| {
            model.backward(Backward::new().on_ready(hook).split_blocks())
        })
        .unwrap();
        assert_eq!(seen, model.split_ready_ranges());
        let mut want = vec![0f32; n];
        model.copy_grads_to_host(&mut want).unwrap();
        assert!(
            staging == want,
            "the staged gradients differ from the device's"
        );
    }
}

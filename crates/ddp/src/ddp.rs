//! `Ddp`: keeps the replicas of a model identical across a process group.
//!
//! At construction it checks that every rank built the same model (names,
//! shapes, offsets) and copies rank 0's parameters to every rank. Each
//! synchronising backward then averages the gradients across ranks bucket by
//! bucket, on a communication thread that runs while backward is still
//! computing the lower layers (or, with `overlap = false`, in one call over
//! the whole buffer after it). It
//! knows flat f32 buffers, parameter names and process groups, never what
//! the model computes.

use crate::bucket::{
    assign_buckets, assign_buckets_aligned, buckets_from_bounds, check_layout, split_last_bucket,
    GradientBucket, ParamSpec,
};
use crate::error::DdpError;
use crate::reducer::Reducer;
use cohort_comm::{ProcessGroup, ReduceOp};
use half::bf16;
use std::ops::Range;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// PyTorch's default `bucket_cap_mb`.
pub const DEFAULT_BUCKET_CAP_MB: f64 = 25.0;
/// PyTorch's `_DEFAULT_FIRST_BUCKET_BYTES`, in MB: the first bucket is kept
/// small so that communication starts early in backward.
pub const DEFAULT_FIRST_BUCKET_MB: f64 = 1.0;
/// The most the last bucket holds where it can be cut (MB): its gradients
/// are final only when backward ends, so all of its all-reduce is exposed.
/// PyTorch's first-bucket size, for the bucket at the other end.
pub const DEFAULT_LAST_BUCKET_MB: f64 = 1.0;

/// How gradients travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// f32 all-reduce with `ReduceOp::Avg`.
    #[default]
    None,
    /// PyTorch's `bf16_compress_hook`: divide by the world size, cast to
    /// bf16, all-reduce (sum) in bf16, cast back. Half the bytes, about 3
    /// significant digits per gradient element.
    Bf16,
}

/// [`Compression::Bf16`]'s wire for `grads` over `world` ranks: each element
/// divided by the world size, then cast to bf16 (round to nearest even),
/// so that the ranks' bf16 sum is their mean. Every bf16 collective of
/// gradients (DDP's all-reduce, ZeRO's reduce-scatter, in place or in
/// flight) sends this, so that they agree bit for bit.
pub fn bf16_shares(grads: &[f32], world: usize) -> impl Iterator<Item = bf16> + '_ {
    let inv = 1.0 / world as f32;
    grads.iter().map(move |g| bf16::from_f32(g * inv))
}

/// Reusable bf16 staging for [`Compression::reduce_scatter_mean`].
#[derive(Debug, Default)]
pub struct CompressionScratch(Vec<bf16>);

impl Compression {
    /// The mean over ranks of `input` (every rank's whole gradient, a
    /// multiple of the world size long), this rank's share of it into
    /// `out`: a reduce-scatter, in f32, or compressed as [`Compression::Bf16`]
    /// says (what ZeRO's sharded strategies send in place of DDP's
    /// all-reduce). Collective.
    pub fn reduce_scatter_mean(
        self,
        pg: &ProcessGroup,
        input: &[f32],
        out: &mut [f32],
        scratch: &mut CompressionScratch,
    ) -> Result<(), cohort_comm::CommError> {
        match self {
            Compression::None => pg.reduce_scatter(input, out, ReduceOp::Avg),
            Compression::Bf16 => {
                let buf = &mut scratch.0;
                buf.clear();
                buf.extend(bf16_shares(input, pg.size()));
                buf.resize(input.len() + out.len(), bf16::ZERO);
                let (whole, share) = buf.split_at_mut(input.len());
                pg.reduce_scatter(&*whole, share, ReduceOp::Sum)?;
                for (o, c) in out.iter_mut().zip(share.iter()) {
                    *o = c.to_f32();
                }
                Ok(())
            }
        }
    }
}

/// Options of [`Ddp`], PyTorch's `DistributedDataParallel` arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct DdpOptions {
    /// Bucket size in MB (MiB, as PyTorch); 0 gives one bucket per parameter.
    pub bucket_cap_mb: f64,
    /// Size of the first bucket in MB, capped at `bucket_cap_mb`.
    pub first_bucket_mb: f64,
    /// The most the last bucket (ready when backward ends) holds, in MB,
    /// where a parameter (after the first backward, a ready range) boundary
    /// allows the cut; else it is cut as small as they allow.
    pub last_bucket_mb: f64,
    /// Reduce buckets during backward (true) or the whole buffer at once
    /// after it (false).
    pub overlap: bool,
    /// Treat the gradient of a parameter that backward never reports as
    /// zero, instead of failing.
    pub find_unused_parameters: bool,
    /// Gradient compression.
    pub compression: Compression,
    /// How many nice steps the overlapped reduction's thread runs below
    /// the caller's priority (Linux, per thread; 0: the same). Above 0 it
    /// yields to backward's threads where they take every core, so that it
    /// does not stall their fork-join kernels, and runs in their gaps and
    /// after backward.
    pub reducer_nice: u8,
}

impl Default for DdpOptions {
    fn default() -> Self {
        Self {
            bucket_cap_mb: DEFAULT_BUCKET_CAP_MB,
            first_bucket_mb: DEFAULT_FIRST_BUCKET_MB,
            last_bucket_mb: DEFAULT_LAST_BUCKET_MB,
            overlap: true,
            find_unused_parameters: false,
            compression: Compression::None,
            reducer_nice: 0,
        }
    }
}

/// The hook a model's backward calls with `(range, grads)` as soon as the
/// gradients of `range` are final, `grads` being exactly that range of its
/// flat gradient buffer. The reported ranges must be disjoint; each parameter
/// should be covered. It runs on whatever thread backward runs on, hence
/// `Send`.
pub type ReadyHook<'h, 'g> = dyn FnMut(Range<usize>, &'g mut [f32]) + Send + 'h;

/// The hook [`Ddp::backward_then`] calls on the reduction's thread with `(range, averaged)` as
/// soon as a bucket's average is in the buffer, `range` being the bucket's place in the flat
/// buffer: what lets a host-staged caller copy the bucket back to a device while backward goes
/// on. The buckets that [`PendingSync::finish`] reduces are not reported.
pub type ReducedHook<'r> = dyn FnMut(Range<usize>, &[f32]) + Send + 'r;

/// Where the time of one synchronising backward went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SyncStats {
    /// Time inside the model's backward.
    pub backward: Duration,
    /// Time after backward until every bucket was reduced: communication
    /// that backward did not hide.
    pub comm_wait: Duration,
    /// Total time spent inside all-reduce calls (overlapped or not).
    pub comm_busy: Duration,
    /// Buckets whose reduction started before backward returned.
    pub overlapped_buckets: usize,
    /// How many nice steps below the caller the reduction's thread ran,
    /// as it read its priority back (`None` without an overlapped
    /// reduction thread).
    pub reducer_nice: Option<i32>,
}

/// Data-parallel wrapper state for one model replica in a process group.
///
/// ```no_run
/// # use cohort_ddp::{Ddp, DdpOptions, ParamSpec};
/// # fn demo(pg: &cohort_comm::ProcessGroup, params: &mut [f32], specs: Vec<ParamSpec>) -> Result<(), cohort_ddp::DdpError> {
/// let mut ddp = Ddp::new(pg, specs, params, DdpOptions::default())?;
/// // each step: forward, then, instead of `model.backward()`,
/// //   ddp.backward(|ready| model.backward(ready))?.finish(model.grads_mut())?;
/// // then the optimizer step (identical on every rank).
/// # Ok(()) }
/// ```
pub struct Ddp<'pg> {
    pg: &'pg ProcessGroup,
    params: Vec<ParamSpec>,
    buckets: Vec<GradientBucket>,
    total: usize,
    options: DdpOptions,
    /// bf16 staging for [`Compression::Bf16`], reused across steps.
    scratch: Vec<bf16>,
    /// Whether the buckets were rebuilt along backward's ready ranges.
    rebuilt: bool,
}

impl<'pg> Ddp<'pg> {
    /// Checks that every rank of `pg` has the same parameter list, then
    /// overwrites `param_buffer` with rank 0's. Collective: every rank must
    /// call it.
    pub fn new(
        pg: &'pg ProcessGroup,
        params: Vec<ParamSpec>,
        param_buffer: &mut [f32],
        options: DdpOptions,
    ) -> Result<Self, DdpError> {
        let total = check_layout(&params)?;
        if param_buffer.len() != total {
            return Err(DdpError::BufferLength {
                what: "parameter",
                got: param_buffer.len(),
                expected: total,
            });
        }
        verify_same_model(pg, &params)?;
        pg.broadcast(param_buffer, 0)
            .map_err(comm("broadcast", None))?;
        let buckets = assign_buckets(
            &params,
            mb(options.first_bucket_mb),
            mb(options.bucket_cap_mb),
        );
        let starts = params.iter().map(|p| p.range.start);
        let buckets = split_last_bucket(&params, &buckets, starts, mb(options.last_bucket_mb));
        Ok(Self {
            pg,
            params,
            buckets,
            total,
            options,
            scratch: Vec::new(),
            rebuilt: false,
        })
    }

    /// The buckets, in launch order (bucket 0 holds the last parameters).
    pub fn buckets(&self) -> &[GradientBucket] {
        &self.buckets
    }

    /// The parameter list every rank agreed on.
    pub fn params(&self) -> &[ParamSpec] {
        &self.params
    }

    /// The options in force.
    pub fn options(&self) -> &DdpOptions {
        &self.options
    }

    /// The process group.
    pub fn process_group(&self) -> &'pg ProcessGroup {
        self.pg
    }

    /// Runs the model's backward, `backward(ready)`, which must call `ready`
    /// for each range of gradients as soon as it is final (see
    /// [`ReadyHook`]); with overlap on, each bucket's average across ranks
    /// starts on a communication thread while backward goes on. Then
    /// [`PendingSync::finish`], given the whole gradient buffer, reduces
    /// what backward did not hand over and checks for unused parameters.
    /// Collective: every rank must call both.
    ///
    /// For gradient accumulation (PyTorch's `no_sync`), call the model's own
    /// backward for every micro-step but the last: gradients sum locally and
    /// the last one's sync averages the sum at once.
    pub fn backward<'g, E>(
        &mut self,
        backward: impl FnOnce(&mut ReadyHook<'_, 'g>) -> Result<(), E>,
    ) -> Result<PendingSync<'_, 'pg>, DdpError>
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        self.backward_then(backward, &mut |_, _| {})
    }

    /// [`Ddp::backward`], telling `reduced` of each bucket averaged during backward (see
    /// [`ReducedHook`]). Collective.
    pub fn backward_then<'g, E>(
        &mut self,
        backward: impl FnOnce(&mut ReadyHook<'_, 'g>) -> Result<(), E>,
        reduced: &mut ReducedHook<'_>,
    ) -> Result<PendingSync<'_, 'pg>, DdpError>
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let mut stats = SyncStats::default();
        let end = if self.options.overlap && !self.solo() {
            self.backward_overlapped(backward, reduced, &mut stats)?
        } else {
            let mut reducer = Reducer::new(&self.params, &self.buckets, self.total, false);
            let t = Instant::now();
            let result =
                backward(&mut |range, grads| reducer.mark_ready(range, grads, &mut |_, _| {}));
            stats.backward = t.elapsed();
            let end = BackwardEnd::of(reducer);
            result.map_err(|e| DdpError::Backward(e.into()))?;
            end?
        };
        Ok(PendingSync {
            ddp: self,
            end,
            stats,
        })
    }

    /// Alone, averaging is the identity: only the checks remain.
    fn solo(&self) -> bool {
        self.pg.size() == 1 && self.options.compression == Compression::None
    }

    /// The second half of [`PendingSync::finish`].
    fn finish(
        &mut self,
        end: BackwardEnd,
        grads: &mut [f32],
        mut stats: SyncStats,
    ) -> Result<SyncStats, DdpError> {
        let world = self.pg.size();
        let solo = self.solo();
        let BackwardEnd {
            next,
            unused,
            covered,
            ready,
        } = end;
        stats.overlapped_buckets = next;

        // Buckets from `next` on were not launched during backward: not yet
        // covered (an unused parameter), waiting behind such a bucket, or
        // everything when overlap is off. Reduce them now.
        if let Some(p) = unused {
            if !self.options.find_unused_parameters {
                return Err(DdpError::UnusedParameter {
                    name: p.name,
                    range: p.range,
                });
            }
        }
        let t = Instant::now();
        if grads.len() != self.total {
            return Err(DdpError::BufferLength {
                what: "gradient",
                got: grads.len(),
                expected: self.total,
            });
        }
        for bucket in &self.buckets[next..] {
            for gap in Reducer::gaps(&covered[bucket.index], &bucket.range) {
                grads[gap].fill(0.0);
            }
        }
        if !solo {
            let tb = Instant::now();
            if self.options.overlap {
                // Ranks may have launched different numbers of buckets (one
                // waits on an unused parameter): only bucket-by-bucket calls
                // are sure to match theirs.
                for bucket in &self.buckets[next..] {
                    reduce_bucket(
                        self.pg,
                        Some(bucket.index),
                        &mut grads[bucket.range.clone()],
                        self.options.compression,
                        world,
                        &mut self.scratch,
                    )?;
                }
            } else {
                // Every rank reduces the whole buffer after backward: one
                // call saves each further call's handshake and wake-ups, and
                // averaging is elementwise, so the result is the same.
                reduce_bucket(
                    self.pg,
                    None,
                    grads,
                    self.options.compression,
                    world,
                    &mut self.scratch,
                )?;
            }
            stats.comm_busy += tb.elapsed();
        }
        stats.comm_wait += t.elapsed();
        if !self.rebuilt {
            self.rebuild_buckets(&ready)?;
        }
        Ok(stats)
    }

    /// After the first synchronising backward, re-cuts the buckets along the
    /// ranges backward reported (see [`assign_buckets_aligned`]), as PyTorch
    /// rebuilds its buckets after the first iteration. Rank 0's layout is
    /// broadcast so every rank keeps issuing identical all-reduces even if
    /// their backwards reported differently. Collective.
    fn rebuild_buckets(&mut self, ready: &[Range<usize>]) -> Result<(), DdpError> {
        self.rebuilt = true;
        let mut bounds: Vec<i64> = Vec::new();
        if self.pg.rank() == 0 {
            if let Some(b) = self.aligned(ready) {
                bounds.push(self.total as i64);
                bounds.extend(b.iter().map(|b| b.range.start as i64));
            }
        }
        if self.pg.size() > 1 {
            let mut n = [bounds.len() as i64];
            self.pg
                .broadcast(&mut n, 0)
                .map_err(comm("broadcast", None))?;
            bounds.resize(n[0] as usize, 0);
            self.pg
                .broadcast(&mut bounds, 0)
                .map_err(comm("broadcast", None))?;
        }
        if !bounds.is_empty() {
            let bounds: Vec<usize> = bounds.iter().map(|&b| b as usize).collect();
            self.buckets = buckets_from_bounds(&self.params, &bounds);
        }
        Ok(())
    }
}

impl Ddp<'_> {
    /// The buckets along `ready` (the ranges backward reports, in order),
    /// the last one cut small: `None` if they do not tile the buffer.
    fn aligned(&self, ready: &[Range<usize>]) -> Option<Vec<GradientBucket>> {
        let o = &self.options;
        let (first, cap) = (mb(o.first_bucket_mb), mb(o.bucket_cap_mb));
        let b = assign_buckets_aligned(&self.params, ready, first, cap)?;
        let cuts = ready.iter().map(|r| r.start);
        Some(split_last_bucket(
            &self.params,
            &b,
            cuts,
            mb(o.last_bucket_mb),
        ))
    }

    /// Cuts the buckets along `ready`, the ranges the model's backward will
    /// report, in order (a model that knows them, as cohort-gpt's
    /// `ready_ranges`), so that the layout is known before the first step;
    /// it is still checked and agreed on after the first backward. Not
    /// collective: every rank holds the same model. Ignored (the layout by
    /// parameters stays) when the ranges do not tile the buffer top down.
    pub fn plan_along(&mut self, ready: &[Range<usize>]) {
        if let Some(b) = self.aligned(ready) {
            self.buckets = b;
        }
    }

    /// Backward with a communication thread that all-reduces each bucket as
    /// soon as the reducer launches it.
    fn backward_overlapped<'g, E>(
        &mut self,
        backward: impl FnOnce(&mut ReadyHook<'_, 'g>) -> Result<(), E>,
        reduced: &mut ReducedHook<'_>,
        stats: &mut SyncStats,
    ) -> Result<BackwardEnd, DdpError>
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let world = self.pg.size();
        let (pg, params, buckets, total) = (self.pg, &self.params, &self.buckets, self.total);
        let compression = self.options.compression;
        let nice = self.options.reducer_nice;
        let scratch = &mut self.scratch;
        std::thread::scope(|s| {
            let (tx, rx) = mpsc::channel::<(usize, &'g mut [f32])>();
            let comm = s.spawn(move || -> Result<(Duration, i32), DdpError> {
                let nice = set_thread_nice(nice);
                let mut busy = Duration::ZERO;
                for (b, grads) in rx {
                    let t = Instant::now();
                    reduce_bucket(pg, Some(b), grads, compression, world, scratch)?;
                    busy += t.elapsed();
                    reduced(buckets[b].range.clone(), grads);
                }
                Ok((busy, nice))
            });
            let mut reducer = Reducer::new(params, buckets, total, true);
            let t = Instant::now();
            let result = backward(&mut |range, grads| {
                reducer.mark_ready(range, grads, &mut |b, slice| {
                    // A send fails only if the comm thread stopped on an
                    // error, which join() reports below.
                    let _ = tx.send((b, slice));
                })
            });
            stats.backward = t.elapsed();
            drop(tx);
            let end = BackwardEnd::of(reducer);
            let t = Instant::now();
            let (busy, nice) = comm
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p))?;
            stats.comm_wait = t.elapsed();
            stats.comm_busy = busy;
            stats.reducer_nice = Some(nice);
            result.map_err(|e| DdpError::Backward(e.into()))?;
            end
        })
    }
}

/// A backward whose gradients are still being averaged: call
/// [`PendingSync::finish`] with the gradient buffer.
#[must_use = "the gradients are not averaged until finish() is called"]
pub struct PendingSync<'d, 'pg> {
    ddp: &'d mut Ddp<'pg>,
    end: BackwardEnd,
    stats: SyncStats,
}

impl PendingSync<'_, '_> {
    /// Reduces the buckets backward did not hand over (all of them with
    /// overlap off) in `grads`, the model's whole gradient buffer, and
    /// reports where the time went. A parameter whose gradient was never
    /// reported is an error naming it (all ranks see it when all ranks run
    /// the same model), unless `find_unused_parameters` is set, in which case
    /// its gradient is zeroed and still averaged. Collective.
    pub fn finish(self, grads: &mut [f32]) -> Result<SyncStats, DdpError> {
        self.ddp.finish(self.end, grads, self.stats)
    }
}

/// How a backward ended.
struct BackwardEnd {
    /// The first bucket not launched during backward.
    next: usize,
    /// The first parameter whose gradient was never reported.
    unused: Option<ParamSpec>,
    /// Per bucket, the ranges reported.
    covered: Vec<Vec<Range<usize>>>,
    /// The ranges reported, in order.
    ready: Vec<Range<usize>>,
}

impl BackwardEnd {
    fn of(reducer: Reducer<'_, '_>) -> Result<BackwardEnd, DdpError> {
        let covered = reducer.covered().to_vec();
        let ready = reducer.ready_log().to_vec();
        let (next, unused) = reducer.finish()?;
        Ok(BackwardEnd {
            next,
            unused: unused.cloned(),
            covered,
            ready,
        })
    }
}

/// Raises the calling thread's nice value by `steps` (Linux: nice values
/// are per thread, and a new thread starts at its creator's), and returns
/// by how much it runs above its creator's. A value the system refuses
/// leaves it as it was: the reduction runs either way.
fn set_thread_nice(steps: u8) -> i32 {
    // SAFETY: gettid takes no arguments and cannot fail.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t;
    // SAFETY: getpriority and setpriority only read their integer
    // arguments, and `tid` is this live thread: they read or change this
    // thread's priority alone. (getpriority's -1 error value is also a
    // nice value, but it cannot fail for this thread.)
    unsafe {
        let base = libc::getpriority(libc::PRIO_PROCESS, tid);
        if steps > 0 {
            libc::setpriority(libc::PRIO_PROCESS, tid, base + i32::from(steps));
        }
        libc::getpriority(libc::PRIO_PROCESS, tid) - base
    }
}

/// Megabytes (MiB, as PyTorch) to bytes.
fn mb(x: f64) -> usize {
    (x.max(0.0) * 1024.0 * 1024.0) as usize
}

/// Averages one bucket across the group.
/// Averages the gradients of one bucket, or of the whole buffer (`None`).
fn reduce_bucket(
    pg: &ProcessGroup,
    bucket: Option<usize>,
    grads: &mut [f32],
    compression: Compression,
    world: usize,
    scratch: &mut Vec<bf16>,
) -> Result<(), DdpError> {
    let op = match bucket {
        Some(_) => "all_reduce",
        None => "all_reduce of every gradient",
    };
    match compression {
        Compression::None => pg
            .all_reduce(grads, ReduceOp::Avg)
            .map_err(comm(op, bucket)),
        Compression::Bf16 => {
            scratch.clear();
            scratch.extend(bf16_shares(grads, world));
            pg.all_reduce(scratch.as_mut_slice(), ReduceOp::Sum)
                .map_err(comm(op, bucket))?;
            grads
                .iter_mut()
                .zip(scratch.iter())
                .for_each(|(g, c)| *g = c.to_f32());
            Ok(())
        }
    }
}

fn comm(op: &'static str, bucket: Option<usize>) -> impl Fn(cohort_comm::CommError) -> DdpError {
    move |error| DdpError::Comm { op, bucket, error }
}

/// FNV-1a over the parameter list: names, shapes, ranges.
fn digest(params: &[ParamSpec]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(&(params.len() as u64).to_le_bytes());
    for p in params {
        eat(p.name.as_bytes());
        eat(&[0xff]);
        for d in p.shape.iter().chain([&p.range.start, &p.range.end]) {
            eat(&(*d as u64).to_le_bytes());
        }
    }
    h
}

fn describe(p: Option<&ParamSpec>) -> String {
    match p {
        Some(p) => format!("{} {:?} at {:?}", p.name, p.shape, p.range),
        None => "nothing".to_string(),
    }
}

/// One line per parameter, for the (rare) full comparison.
fn encode(params: &[ParamSpec]) -> Vec<u8> {
    let mut out = String::new();
    for p in params {
        let shape: Vec<String> = p.shape.iter().map(|d| d.to_string()).collect();
        out += &format!(
            "{}\t{}\t{}\t{}\n",
            p.name,
            shape.join(","),
            p.range.start,
            p.range.end
        );
    }
    out.into_bytes()
}

fn decode(bytes: &[u8]) -> Vec<ParamSpec> {
    String::from_utf8_lossy(bytes)
        .lines()
        .filter_map(|line| {
            let mut f = line.split('\t');
            let name = f.next()?.to_string();
            let shape = f
                .next()?
                .split(',')
                .filter(|s| !s.is_empty())
                .map(|d| d.parse().unwrap_or(0))
                .collect();
            let start = f.next()?.parse().ok()?;
            let end = f.next()?.parse().ok()?;
            Some(ParamSpec {
                name,
                shape,
                range: start..end,
            })
        })
        .collect()
}

/// Fails on every rank, naming the first parameter and rank that differ
/// from rank 0, unless all ranks hold the same parameter list. Costs one
/// 8-byte all-gather when they agree.
fn verify_same_model(pg: &ProcessGroup, params: &[ParamSpec]) -> Result<(), DdpError> {
    let world = pg.size();
    let mine = [digest(params) as i64];
    let mut all = vec![0i64; world];
    pg.all_gather(&mine, &mut all)
        .map_err(comm("all_gather", None))?;
    if all.iter().all(|&d| d == all[0]) {
        return Ok(());
    }
    // Somebody differs: exchange the full lists (lengths first, then the
    // lists padded to the longest) so every rank can name the difference.
    let text = encode(params);
    let mut lens = vec![0i64; world];
    pg.all_gather(&[text.len() as i64], &mut lens)
        .map_err(comm("all_gather", None))?;
    let longest = lens.iter().copied().max().unwrap_or(0) as usize;
    let mut padded = text.clone();
    padded.resize(longest, 0);
    let mut gathered = vec![0u8; longest * world];
    pg.all_gather(&padded, &mut gathered)
        .map_err(comm("all_gather", None))?;
    let lists: Vec<Vec<ParamSpec>> = (0..world)
        .map(|r| decode(&gathered[r * longest..r * longest + lens[r] as usize]))
        .collect();
    for (rank, list) in lists.iter().enumerate().skip(1) {
        let n = list.len().max(lists[0].len());
        if let Some(index) = (0..n).find(|&i| list.get(i) != lists[0].get(i)) {
            return Err(DdpError::ModelMismatch {
                rank,
                index,
                ours: describe(lists[0].get(index)),
                theirs: describe(list.get(index)),
            });
        }
    }
    // Same lists but different digests cannot happen (the digest is a
    // function of the list); if encoding lost a detail, still refuse.
    Err(DdpError::ModelMismatch {
        rank: all.iter().position(|&d| d != all[0]).unwrap_or(0),
        index: 0,
        ours: "a parameter list".into(),
        theirs: "a list that encodes identically but hashes differently".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_round_trip_and_digest_sees_shapes() {
        let p = vec![
            ParamSpec {
                name: "a.weight".into(),
                shape: vec![2, 3],
                range: 0..6,
            },
            ParamSpec {
                name: "b".into(),
                shape: vec![],
                range: 6..7,
            },
        ];
        assert_eq!(decode(&encode(&p)), p);
        let mut q = p.clone();
        q[0].shape = vec![3, 2];
        assert_ne!(digest(&p), digest(&q));
    }
}

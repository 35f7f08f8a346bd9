//! Ddp across real process groups (threads with loopback sockets, through
//! comm's spawn), on a toy model whose gradients are a known function of the
//! parameters and the rank's data, so every result can be recomputed here.

use cohort_comm::{spawn, GroupOptions};
use cohort_ddp::{Compression, Ddp, DdpError, DdpOptions, ParamSpec, ReadyHook, SyncStats};
use std::ops::Range;
use std::time::{Duration, Instant};

/// Parameter lengths of the toy model: sizes like a small transformer's
/// (embedding, blocks of matrices and vectors, final norm).
const LENS: [usize; 9] = [5000, 300, 20_000, 700, 64, 20_000, 700, 64, 128];

fn specs(lens: &[usize]) -> Vec<ParamSpec> {
    let mut off = 0;
    lens.iter()
        .enumerate()
        .map(|(i, &n)| {
            off += n;
            ParamSpec {
                name: format!("layer{i}.weight"),
                shape: vec![n],
                range: off - n..off,
            }
        })
        .collect()
}

/// A model whose gradient is `grad_i = sin(w_i * x + i) * x` for its
/// rank's data `x`, handed out top-down in "layer" ranges that cut across
/// parameters, with a little compute per layer so communication overlaps.
struct Toy {
    w: Vec<f32>,
    g: Vec<f32>,
    x: f32,
    /// Ranges reported, from the top of the buffer down.
    layers: Vec<Range<usize>>,
    /// A range never reported (an unused parameter).
    skip: Option<Range<usize>>,
}

fn grad(w: f32, x: f32, i: usize) -> f32 {
    (w * x + i as f32 * 1e-3).sin() * x
}

impl Toy {
    fn new(lens: &[usize], x: f32) -> Self {
        let n: usize = lens.iter().sum();
        // Cut into ranges of 7000 from the top, not aligned to parameters.
        let mut layers = Vec::new();
        let mut end = n;
        while end > 0 {
            let start = end.saturating_sub(7000);
            layers.push(start..end);
            end = start;
        }
        Self {
            w: (0..n)
                .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
                .collect(),
            g: vec![0.0; n],
            x,
            layers,
            skip: None,
        }
    }

    /// SGD step, identical on every rank.
    fn step(&mut self, lr: f32) {
        for (w, g) in self.w.iter_mut().zip(&mut self.g) {
            *w -= lr * *g;
            *g = 0.0;
        }
    }
}

impl Toy {
    /// Backward, calling `hook` as each layer's gradients are final (from the top layer down).
    fn backward<'g>(
        &'g mut self,
        hook: &mut ReadyHook<'_, 'g>,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let (w, x) = (&self.w, self.x);
        let mut rest: &'g mut [f32] = &mut self.g;
        for layer in &self.layers {
            let (lo, piece) = std::mem::take(&mut rest).split_at_mut(layer.start);
            rest = lo;
            for (k, g) in piece.iter_mut().enumerate() {
                let i = layer.start + k;
                *g += grad(w[i], x, i);
            }
            let skipped = self
                .skip
                .as_ref()
                .is_some_and(|s| s.start < layer.end && layer.start < s.end);
            if let (true, Some(s)) = (skipped, &self.skip) {
                // Report the layer without the skipped range.
                let (below, rest_top) = piece.split_at_mut(s.start.max(layer.start) - layer.start);
                let (_, above) =
                    rest_top.split_at_mut(s.end.min(layer.end) - s.start.max(layer.start));
                if !above.is_empty() {
                    hook(s.end.min(layer.end)..layer.end, above);
                }
                if !below.is_empty() {
                    hook(layer.start..s.start.max(layer.start), below);
                }
            } else {
                hook(layer.clone(), piece);
            }
        }
        Ok(())
    }

    /// A synchronising backward through `ddp`.
    fn sync_backward(&mut self, ddp: &mut Ddp<'_>) -> Result<SyncStats, DdpError> {
        ddp.backward(|ready| self.backward(ready))?
            .finish(&mut self.g)
    }
}

fn opts() -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_secs(20),
        ..GroupOptions::from_env().unwrap()
    }
}

fn data(rank: usize) -> f32 {
    0.5 + rank as f32 * 0.37
}

/// Trains `steps` SGD steps with Ddp on `world` ranks; returns each rank's
/// final weights.
fn train_ddp(world: usize, steps: usize, options: DdpOptions) -> Vec<Vec<f32>> {
    spawn::threads_with(world, opts(), |pg| {
        let mut m = Toy::new(&LENS, data(pg.rank()));
        if pg.rank() > 0 {
            // Different initial weights: Ddp must broadcast rank 0's.
            m.w.iter_mut().for_each(|w| *w += 1.0);
        }
        let mut ddp = Ddp::new(pg, specs(&LENS), &mut m.w, options.clone())?;
        for _ in 0..steps {
            m.sync_backward(&mut ddp)?;
            m.step(0.1);
        }
        Ok::<_, DdpError>(m.w)
    })
    .unwrap()
}

/// The same steps in one process: average the ranks' gradients by hand.
fn train_reference(world: usize, steps: usize) -> Vec<f32> {
    let mut m = Toy::new(&LENS, 0.0);
    let n = m.w.len();
    for _ in 0..steps {
        let mut sum = vec![0f32; n];
        for r in 0..world {
            for (i, s) in sum.iter_mut().enumerate() {
                *s += grad(m.w[i], data(r), i);
            }
        }
        for (i, w) in m.w.iter_mut().enumerate() {
            *w -= 0.1 * (sum[i] / world as f32);
        }
    }
    m.w
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn all_ranks_agree_and_match_the_hand_averaged_gradient() {
    // World 2: (g0 + g1) / 2 is computed the same way by hand and by the
    // all-reduce (a sum of two is commutative, halving is exact): bitwise.
    let got = train_ddp(2, 4, DdpOptions::default());
    assert_eq!(got[0], got[1]);
    assert_eq!(got[0], train_reference(2, 4));
    // World 3: the all-reduce adds in an order that depends on the chunk,
    // so the sum of three may round differently from ((g0 + g1) + g2): at
    // most an ulp of a gradient (|g| < 1.3, ulp ~1.5e-7) times lr 0.1 per
    // step, barely amplified (d grad / d w <= x^2 < 1.6): below 1e-6.
    let got = train_ddp(3, 4, DdpOptions::default());
    assert_eq!(got[0], got[1]);
    assert_eq!(got[0], got[2]);
    let d = max_abs_diff(&got[0], &train_reference(3, 4));
    assert!(d < 1e-6, "world 3 differs from the reference by {d}");
}

#[test]
fn overlapped_and_after_backward_reduction_are_identical() {
    // After backward, Ddp reduces the whole buffer in one call; overlapped,
    // one call per bucket. With one bucket (the default caps, on this small
    // model) the calls are the same: bitwise, for any world size. With small
    // buckets, world 2 sums a + b either way (bitwise); at world 3 a bucket
    // boundary changes the order of the three-term sum, as below.
    let small = DdpOptions {
        bucket_cap_mb: 0.01,
        first_bucket_mb: 0.01,
        ..DdpOptions::default()
    };
    for world in [2, 3] {
        for base in [DdpOptions::default(), small.clone()] {
            let overlapped = train_ddp(world, 3, base.clone());
            let after = train_ddp(
                world,
                3,
                DdpOptions {
                    overlap: false,
                    ..base.clone()
                },
            );
            let d = max_abs_diff(&overlapped[0], &after[0]);
            if world == 2 || base.bucket_cap_mb > 1.0 {
                assert_eq!(d, 0.0, "world {world}, {base:?}");
            } else {
                assert!(d < 1e-6, "world {world}, {base:?}: {d}");
            }
        }
    }
}

#[test]
fn bucket_sizes_from_tiny_to_huge_give_identical_parameters() {
    let caps = [0.0, 0.01, 0.05, 25.0, 1e6];
    let with_cap = |world, cap| {
        let o = DdpOptions {
            bucket_cap_mb: cap,
            first_bucket_mb: cap,
            ..DdpOptions::default()
        };
        train_ddp(world, 3, o).swap_remove(0)
    };
    // World 2: each element is a + b whatever the bucketing: bitwise.
    let base = with_cap(2, caps[0]);
    for cap in &caps[1..] {
        assert_eq!(with_cap(2, *cap), base, "bucket_cap_mb {cap}");
    }
    // World 3: a bucket boundary moves elements between ring chunks, which
    // changes the order of the three-term sum: equal to an ulp per step
    // (see above).
    let base = with_cap(3, caps[0]);
    for cap in &caps[1..] {
        let d = max_abs_diff(&with_cap(3, *cap), &base);
        assert!(d < 1e-6, "bucket_cap_mb {cap}: {d}");
    }
}

#[test]
fn bucket_layout_follows_pytorch() {
    let b = cohort_ddp::assign_buckets(&specs(&LENS), 1 << 20, 25 << 20);
    // Everything fits in the first 1 MB bucket (46,956 floats = 188 KB).
    assert_eq!(b.len(), 1);
    let b = cohort_ddp::assign_buckets(&specs(&LENS), 4 * 1000, 4 * 25_000);
    // Reverse order, first cap 1000 floats: 128 + 64 + 700 = 892, + 20000
    // closes it. Then cap 25000: 64 + 700 + 20000 + 300 = 21064, + 5000
    // closes the second with the first parameter.
    assert_eq!(b.len(), 2);
    assert_eq!(b[0].params, 5..9);
    assert_eq!(b[1].params, 0..5);
    assert_eq!(b[0].range, 26_064..46_956);
}

#[test]
fn buckets_are_recut_along_the_ready_ranges_after_the_first_backward() {
    let counts = spawn::threads_with(2, opts(), |pg| {
        let mut m = Toy::new(&LENS, data(pg.rank()));
        let o = DdpOptions {
            bucket_cap_mb: 0.05,
            first_bucket_mb: 0.05,
            ..DdpOptions::default()
        };
        let mut ddp = Ddp::new(pg, specs(&LENS), &mut m.w, o)?;
        let before = ddp.buckets().len();
        m.sync_backward(&mut ddp)?;
        // The toy reports ranges of 7000 floats that never end on a
        // parameter boundary (except at 0): one bucket is all that keeps
        // whole ranges together.
        let after: Vec<_> = ddp.buckets().iter().map(|b| b.range.clone()).collect();
        m.sync_backward(&mut ddp)?;
        Ok::<_, DdpError>((before, after))
    })
    .unwrap();
    assert_eq!(counts[0].0, 3);
    assert_eq!(counts[0].1, vec![0..46_956]);
    assert_eq!(counts[0], counts[1]);
}

#[test]
fn no_sync_accumulates_locally_and_the_last_micro_step_averages() {
    let micro = 3;
    let got = spawn::threads_with(2, opts(), |pg| {
        let mut m = Toy::new(&LENS, data(pg.rank()));
        let mut ddp = Ddp::new(pg, specs(&LENS), &mut m.w, DdpOptions::default())?;
        for _ in 0..micro - 1 {
            m.backward(&mut |_, _| {}).map_err(DdpError::Backward)?;
        }
        m.sync_backward(&mut ddp)?;
        Ok::<_, DdpError>(m.g)
    })
    .unwrap();
    assert_eq!(got[0], got[1]);
    let m = Toy::new(&LENS, 0.0);
    for i in [0, 4999, 26_000, m.w.len() - 1] {
        let per_rank: Vec<f32> = (0..2)
            .map(|r| {
                let g = grad(m.w[i], data(r), i);
                g + g + g
            })
            .collect();
        assert_eq!(got[0][i], (per_rank[0] + per_rank[1]) / 2.0, "element {i}");
    }
}

#[test]
fn an_unused_parameter_is_an_error_naming_it() {
    let unused = specs(&LENS)[2].range.clone();
    for overlap in [true, false] {
        let err = spawn::threads_with(2, opts(), |pg| {
            let mut m = Toy::new(&LENS, data(pg.rank()));
            m.skip = Some(unused.clone());
            let o = DdpOptions {
                overlap,
                ..DdpOptions::default()
            };
            let mut ddp = Ddp::new(pg, specs(&LENS), &mut m.w, o)?;
            m.sync_backward(&mut ddp).map(|_| ())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("layer2.weight"), "{err}");
        assert!(err.contains("find_unused_parameters"), "{err}");
    }
}

#[test]
fn find_unused_parameters_zeroes_and_still_reduces() {
    let unused = specs(&LENS)[2].range.clone();
    let got = spawn::threads_with(2, opts(), |pg| {
        let mut m = Toy::new(&LENS, data(pg.rank()));
        // Only rank 1 skips it: rank 0's gradient is averaged with a zero.
        if pg.rank() == 1 {
            m.skip = Some(unused.clone());
        }
        m.g.iter_mut().for_each(|g| *g = 100.0); // stale values must not leak
        let o = DdpOptions {
            find_unused_parameters: true,
            bucket_cap_mb: 0.02,
            ..DdpOptions::default()
        };
        let mut ddp = Ddp::new(pg, specs(&LENS), &mut m.w, o)?;
        m.g.iter_mut().for_each(|g| *g = 0.0);
        if pg.rank() == 1 {
            m.g[unused.clone()].iter_mut().for_each(|g| *g = 100.0);
        }
        m.sync_backward(&mut ddp)?;
        Ok::<_, DdpError>(m.g)
    })
    .unwrap();
    assert_eq!(got[0], got[1]);
    let m = Toy::new(&LENS, 0.0);
    let i = unused.start + 5;
    assert_eq!(got[0][i], grad(m.w[i], data(0), i) / 2.0);
}

#[test]
fn a_model_mismatch_fails_fast_on_every_rank_with_a_clear_error() {
    let t = Instant::now();
    let mut errors = Vec::new();
    let res = spawn::threads_with(3, opts(), |pg| {
        let mut lens = LENS.to_vec();
        if pg.rank() == 2 {
            lens[4] = 65;
        }
        let mut w = vec![0f32; lens.iter().sum()];
        match Ddp::new(pg, specs(&lens), &mut w, DdpOptions::default()) {
            Ok(_) => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    });
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    errors.push(res.unwrap_err().to_string());
    let err = &errors[0];
    assert!(err.contains("rank 2"), "{err}");
    assert!(err.contains("layer4.weight [65]"), "{err}");
    assert!(err.contains("layer4.weight [64]"), "{err}");
}

#[test]
fn bf16_compression_is_close_to_f32() {
    let exact = train_ddp(2, 1, DdpOptions::default()).swap_remove(0);
    let o = DdpOptions {
        compression: Compression::Bf16,
        ..DdpOptions::default()
    };
    let got = train_ddp(2, 1, o);
    assert_eq!(got[0], got[1]);
    // bf16 keeps 8 bits of mantissa: relative error of a gradient below
    // 2^-8; the weights move by lr * grad, so they differ by far less.
    let d = got[0]
        .iter()
        .zip(&exact)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(d > 0.0 && d < 0.1 * 0.01, "max difference {d}");
}

#[test]
fn bad_buffers_are_clear_errors() {
    let err = spawn::threads_with(1, opts(), |pg| {
        let mut w = vec![0f32; 10];
        Ddp::new(pg, specs(&LENS), &mut w, DdpOptions::default()).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("parameter buffer has 10 elements"), "{err}");
}

#[test]
fn a_compressed_reduce_scatter_is_the_bf16_rounded_mean_of_each_share() {
    use cohort_ddp::CompressionScratch;
    // 1 + 2^-10 has no bf16 (8-bit mantissa): the compressed mean rounds
    // it away, the f32 one keeps it.
    let world = 3;
    let input = |rank: usize| -> Vec<f32> {
        (0..world * 4)
            .map(|i| (1.0 + 2f32.powi(-10)) * (1 + i % 5 + rank) as f32)
            .collect()
    };
    let got = spawn::threads_with(world, opts(), |pg| {
        let mut scratch = CompressionScratch::default();
        let mut outs = Vec::new();
        for how in [Compression::None, Compression::Bf16] {
            let mut out = vec![f32::NAN; 4];
            how.reduce_scatter_mean(pg, &input(pg.rank()), &mut out, &mut scratch)?;
            outs.push(out);
        }
        Ok::<_, cohort_comm::CommError>(outs)
    })
    .unwrap();
    let bf = |x: f32| half::bf16::from_f32(x);
    for (rank, outs) in got.iter().enumerate() {
        for (j, (&f, &c)) in outs[0].iter().zip(&outs[1]).enumerate() {
            let i = rank * 4 + j;
            let exact: f32 = (0..world).map(|r| input(r)[i]).sum::<f32>() / world as f32;
            assert!((f - exact).abs() <= 1e-6 * exact, "rank {rank}");
            // summed in bf16: a bf16 value, within bf16's rounding of the mean
            assert_eq!(
                bf(c).to_f32(),
                c,
                "rank {rank} element {j}: {c} is not a bf16"
            );
            assert!(
                (c - exact).abs() <= exact / 64.0,
                "rank {rank}: {c} vs {exact}"
            );
            assert_ne!(c, f, "rank {rank} element {j}");
        }
    }
}

/// The reduction thread's priority budget: with `reducer_nice` the thread
/// runs that many nice steps below the training thread (it read its own
/// priority back), the training thread keeps its own, and the result is
/// bitwise the same as at equal priority.
#[test]
fn a_lower_priority_reducer_changes_nothing_but_its_priority() {
    let run = |nice: u8| {
        spawn::threads_with(2, opts(), move |pg| {
            // SAFETY: getpriority only reads its arguments (0: this thread).
            let before = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
            let mut m = Toy::new(&LENS, data(pg.rank()));
            let o = DdpOptions {
                reducer_nice: nice,
                ..DdpOptions::default()
            };
            let mut ddp = Ddp::new(pg, specs(&LENS), &mut m.w, o)?;
            let stats = m.sync_backward(&mut ddp)?;
            m.step(0.1);
            // SAFETY: as above.
            let after = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
            assert_eq!(before, after, "the training thread keeps its priority");
            Ok::<_, DdpError>((m.w, stats.reducer_nice))
        })
        .unwrap()
    };
    let (same, lower) = (run(0), run(5));
    assert_eq!(same[0].1, Some(0));
    // Nice values stop at 19: a test run already at 15 gets 4 steps.
    let got = lower[0].1.unwrap();
    assert!(got > 0 && got <= 5, "{got}");
    assert_eq!(same[0].0, lower[0].0);
}

/// `backward_then` tells of each bucket reduced during backward, on the reduction's thread,
/// with its range and its averaged gradients (what a host-staged caller copies back to a
/// device while backward goes on); the buckets reduced after backward are not told.
#[test]
fn backward_then_reports_each_bucket_averaged_during_backward() {
    let small = DdpOptions {
        bucket_cap_mb: 0.01,
        first_bucket_mb: 0.01,
        ..DdpOptions::default()
    };
    for overlap in [true, false] {
        let runs = spawn::threads_with(2, opts(), |pg| {
            let mut m = Toy::new(&LENS, data(pg.rank()));
            let options = DdpOptions {
                overlap,
                ..small.clone()
            };
            let mut ddp = Ddp::new(pg, specs(&LENS), &mut m.w, options)?;
            let buckets: Vec<Range<usize>> =
                ddp.buckets().iter().map(|b| b.range.clone()).collect();
            let mut told: Vec<(Range<usize>, Vec<f32>)> = Vec::new();
            let mut reduced = |r: Range<usize>, g: &[f32]| told.push((r, g.to_vec()));
            let stats = ddp
                .backward_then(|ready| m.backward(ready), &mut reduced)?
                .finish(&mut m.g)?;
            Ok::<_, DdpError>((buckets, told, stats.overlapped_buckets, m.g))
        })
        .unwrap();
        let (buckets, told, overlapped, g) = &runs[0];
        assert_eq!(told.len(), *overlapped, "overlap {overlap}");
        assert_eq!(told.is_empty(), !overlap);
        for ((range, averaged), bucket) in told.iter().zip(buckets) {
            assert_eq!(range, bucket);
            assert!(averaged[..] == g[range.clone()], "bucket {range:?}");
        }
        if overlap {
            assert!(told.len() > 2, "{}", told.len());
        }
    }
}

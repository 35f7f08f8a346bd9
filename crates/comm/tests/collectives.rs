//! Every collective against a naive reference: world sizes 1, 2, 3, 4, 5
//! and 8 (threads with real shared memory and real Unix sockets), lengths
//! 0, 1, primes and random ones, every reduce op and element type, every
//! algorithm family.

mod common;

use cohort_comm::transport::TransportKind;
use cohort_comm::{bf16, spawn, Algorithm, CommError, GroupOptions, ProcessGroup, ReduceOp};
use common::*;

/// Fixed lengths: empty, tiny, primes, and one past a 256 KB segment of f32.
const LENS: [usize; 11] = [0, 1, 2, 3, 7, 13, 31, 97, 257, 1031, 65537];

fn all_ops<T: TestElem>(pg: &ProcessGroup, len: usize, salt: usize) -> Result<(), CommError> {
    let (r, n) = (pg.rank(), pg.size());
    let ctx = |op: &str| {
        format!(
            "{op} world {n} rank {r} len {len} salt {salt} {:?} {}",
            pg.algorithm(),
            std::any::type_name::<T>()
        )
    };

    for op in OPS {
        let mut x = input::<T>(r, len, salt, op);
        if op == ReduceOp::Avg && !T::is_float() {
            let e = pg.all_reduce(&mut x, op).unwrap_err();
            assert!(matches!(e, CommError::Unsupported { .. }), "{e}");
            continue;
        }
        pg.all_reduce(&mut x, op)?;
        expect_eq(&format!("{} {op}", ctx("all_reduce")), &x, |i| {
            reduced::<T>(n, i, salt, op)
        })?;
    }

    let pick = |k: usize| {
        let op = OPS[(salt + k) % OPS.len()];
        if op == ReduceOp::Avg && !T::is_float() {
            ReduceOp::Sum
        } else {
            op
        }
    };

    let (op, root) = (pick(0), (salt + 1) % n);
    let mut x = input::<T>(r, len, salt, op);
    pg.reduce(&mut x, op, root)?;
    if r == root {
        expect_eq(&format!("{} {op} root {root}", ctx("reduce")), &x, |i| {
            reduced::<T>(n, i, salt, op)
        })?;
    } else {
        expect_eq(&ctx("reduce leaves non-roots unchanged"), &x, |i| {
            value::<T>(r, i, salt, op)
        })?;
    }

    let op = pick(1);
    // Rank q's input slot s holds elements s*len.. of q's long input.
    let x = input::<T>(r, n * len, salt, op);
    let mut out = vec![T::default(); len];
    pg.reduce_scatter(&x, &mut out, op)?;
    expect_eq(&format!("{} {op}", ctx("reduce_scatter")), &out, |i| {
        reduced::<T>(n, r * len + i, salt, op)
    })?;

    let root = (salt + 2) % n;
    let mut x = if r == root {
        input::<T>(root, len, salt, ReduceOp::Sum)
    } else {
        vec![T::default(); len]
    };
    pg.broadcast(&mut x, root)?;
    expect_eq(&format!("{} root {root}", ctx("broadcast")), &x, |i| {
        value::<T>(root, i, salt, ReduceOp::Sum)
    })?;

    let mine = input::<T>(r, len, salt, ReduceOp::Sum);
    let slot_of = |i: usize| (i / len.max(1), i % len.max(1));
    let mut out = vec![T::default(); n * len];
    pg.all_gather(&mine, &mut out)?;
    expect_eq(&ctx("all_gather"), &out, |i| {
        let (q, j) = slot_of(i);
        value::<T>(q, j, salt, ReduceOp::Sum)
    })?;

    let root = (salt + 3) % n;
    let mut out = (r == root).then(|| vec![T::default(); n * len]);
    pg.gather(&mine, out.as_deref_mut(), root)?;
    if let Some(out) = out {
        expect_eq(&format!("{} root {root}", ctx("gather")), &out, |i| {
            let (q, j) = slot_of(i);
            value::<T>(q, j, salt, ReduceOp::Sum)
        })?;
    }

    let root = (salt + 4) % n;
    let all = (r == root).then(|| input::<T>(root, n * len, salt, ReduceOp::Sum));
    let mut out = vec![T::default(); len];
    pg.scatter(all.as_deref(), &mut out, root)?;
    expect_eq(&format!("{} root {root}", ctx("scatter")), &out, |i| {
        value::<T>(root, r * len + i, salt, ReduceOp::Sum)
    })?;

    // Rank q's slot p is q's elements p*len..; rank r's output slot q is q's slot r.
    let x = input::<T>(r, n * len, salt, ReduceOp::Sum);
    let mut out = vec![T::default(); n * len];
    pg.all_to_all(&x, &mut out)?;
    expect_eq(&ctx("all_to_all"), &out, |i| {
        let (q, j) = slot_of(i);
        value::<T>(q, r * len + j, salt, ReduceOp::Sum)
    })?;

    pg.barrier()
}

fn world(n: usize) {
    // Shared memory (the default on one host; its direct all_reduce for
    // the long lengths under `auto`, and forced at every length under
    // `shm`) and Unix sockets must give the same, exact results.
    for transport in [TransportKind::Shm, TransportKind::Unix] {
        world_over(n, transport);
    }
}

fn world_over(n: usize, transport: TransportKind) {
    let o = GroupOptions {
        transport,
        ..opts(60)
    };
    spawn::threads_with(n, o, |pg| {
        let mut rng = Lcg(n as u64);
        let mut lens = LENS.to_vec();
        lens.extend((0..3).map(|_| rng.below(5000)));
        let algos: &[Algorithm] = match (transport, n) {
            (TransportKind::Shm, 1) => &[Algorithm::Auto],
            (TransportKind::Shm, _) => &[Algorithm::Ring, Algorithm::Shm, Algorithm::Auto],
            _ => &[Algorithm::Ring, Algorithm::Tree, Algorithm::Auto],
        };
        for &algo in algos {
            pg.set_algorithm(algo);
            for (salt, &len) in lens.iter().enumerate() {
                // The long length on every type would only repeat the f32 case.
                let short = len <= 5000;
                all_ops::<f32>(pg, len, salt)?;
                if short {
                    all_ops::<f64>(pg, len, salt)?;
                    all_ops::<i32>(pg, len, salt)?;
                    all_ops::<i64>(pg, len, salt)?;
                    all_ops::<u8>(pg, len, salt)?;
                    all_ops::<bf16>(pg, len, salt)?;
                }
            }
        }
        Ok::<_, CommError>(())
    })
    .unwrap();
}

#[test]
fn world_1() {
    world(1);
}

#[test]
fn world_2() {
    world(2);
}

#[test]
fn world_3() {
    world(3);
}

#[test]
fn world_4() {
    world(4);
}

#[test]
fn world_5() {
    world(5);
}

#[test]
fn world_8() {
    world(8);
}

/// Buffers of several segments on a chain and a ring of 3 (odd) ranks.
#[test]
fn large_buffers_cross_segments() {
    spawn::threads_with(3, opts(60), |pg| {
        let r = pg.rank();
        let len = 1_000_003; // 4 MB of f32, prime, not divisible by 3
        for algo in [Algorithm::Ring, Algorithm::Tree] {
            pg.set_algorithm(algo);
            let mut x = input::<f32>(r, len, 1, ReduceOp::Sum);
            pg.all_reduce(&mut x, ReduceOp::Sum)?;
            expect_eq("large all_reduce", &x, |i| {
                reduced::<f32>(3, i, 1, ReduceOp::Sum)
            })?;
            let mut x = input::<f32>(r, len, 2, ReduceOp::Avg);
            pg.all_reduce(&mut x, ReduceOp::Avg)?;
            expect_eq("large all_reduce avg", &x, |i| {
                reduced::<f32>(3, i, 2, ReduceOp::Avg)
            })?;
            let mut x = if r == 2 {
                input::<f32>(2, len, 3, ReduceOp::Sum)
            } else {
                vec![0.0; len]
            };
            pg.broadcast(&mut x, 2)?;
            expect_eq("large broadcast", &x, |i| {
                value::<f32>(2, i, 3, ReduceOp::Sum)
            })?;
            let mut x = input::<f32>(r, len, 4, ReduceOp::Max);
            pg.reduce(&mut x, ReduceOp::Max, 1)?;
            if r == 1 {
                expect_eq("large reduce", &x, |i| {
                    reduced::<f32>(3, i, 4, ReduceOp::Max)
                })?;
            }
        }
        Ok::<_, CommError>(())
    })
    .unwrap();
}

//! Shared helpers of the integration tests: deterministic inputs that every
//! rank can recompute for every other rank, and naive references.

#![allow(dead_code)] // each test binary uses a different subset

use cohort_comm::{bf16, CommError, Element, GroupOptions, ReduceOp};
use std::fmt::Debug;
use std::time::Duration;

pub const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Product,
    ReduceOp::Min,
    ReduceOp::Max,
];

/// Group settings for tests: a timeout short enough that a bug fails the
/// test instead of hanging it.
pub fn opts(timeout_s: u64) -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_secs(timeout_s),
        ..GroupOptions::default()
    }
}

/// Element types with an exact reference arithmetic on small integers.
pub trait TestElem: Element + PartialEq + Debug + Default {
    fn from_i64(v: i64) -> Self;
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self;
    fn div(a: Self, n: usize) -> Self;
    fn is_float() -> bool;
}

macro_rules! float_elem {
    ($t:ty) => {
        impl TestElem for $t {
            fn from_i64(v: i64) -> Self {
                v as $t
            }
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    ReduceOp::Product => a * b,
                    ReduceOp::Min => a.min(b),
                    _ => a.max(b),
                }
            }
            fn div(a: Self, n: usize) -> Self {
                a / n as $t
            }
            fn is_float() -> bool {
                true
            }
        }
    };
}
float_elem!(f32);
float_elem!(f64);

macro_rules! int_elem {
    ($t:ty) => {
        impl TestElem for $t {
            fn from_i64(v: i64) -> Self {
                v as $t
            }
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Product => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    _ => a.max(b),
                }
            }
            fn div(_: Self, _: usize) -> Self {
                unreachable!("avg is rejected for integers")
            }
            fn is_float() -> bool {
                false
            }
        }
    };
}
int_elem!(i32);
int_elem!(i64);
int_elem!(u8);

impl TestElem for bf16 {
    fn from_i64(v: i64) -> Self {
        bf16::from_f32(v as f32)
    }
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
        bf16::from_f32(f32::combine(a.to_f32(), b.to_f32(), op))
    }
    fn div(a: Self, n: usize) -> Self {
        bf16::from_f32(a.to_f32() / n as f32)
    }
    fn is_float() -> bool {
        true
    }
}

/// Rank `rank`'s element `i` for a test `salt`: small integers, so that
/// sums and products are exact in every type (products draw from -1, 1, 2
/// so that 8 ranks stay below bf16's 8-bit mantissa).
pub fn value<T: TestElem>(rank: usize, i: usize, salt: usize, op: ReduceOp) -> T {
    let h = rank * 7 + i * 13 + salt * 31;
    if op == ReduceOp::Product {
        T::from_i64([-1, 1, 2][h % 3])
    } else {
        T::from_i64((h % 11) as i64 - 5)
    }
}

pub fn input<T: TestElem>(rank: usize, len: usize, salt: usize, op: ReduceOp) -> Vec<T> {
    (0..len).map(|i| value(rank, i, salt, op)).collect()
}

/// The reduction over `world` ranks of element `i`, in rank order.
pub fn reduced<T: TestElem>(world: usize, i: usize, salt: usize, op: ReduceOp) -> T {
    let mut acc = value::<T>(0, i, salt, op);
    for r in 1..world {
        acc = T::combine(acc, value(r, i, salt, op), op);
    }
    if op == ReduceOp::Avg {
        acc = T::div(acc, world);
    }
    acc
}

/// A failed comparison as an error that names where.
pub fn expect_eq<T: PartialEq + Debug>(
    what: &str,
    got: &[T],
    want: impl Fn(usize) -> T,
) -> Result<(), CommError> {
    for (i, g) in got.iter().enumerate() {
        let w = want(i);
        if *g != w {
            panic!(
                "{what}: element {i} of {}: got {g:?}, want {w:?}",
                got.len()
            );
        }
    }
    Ok(())
}

/// A tiny deterministic generator (every rank draws the same numbers).
pub struct Lcg(pub u64);

impl Lcg {
    pub fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n
    }
}

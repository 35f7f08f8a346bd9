//! Reduction operators and the element-wise kernels that apply them.
//!
//! The kernels are plain loops over equal-length slices written so that the
//! compiler vectorises them (no branches that depend on data, except the
//! select in min/max, which becomes a compare-and-blend). They must never
//! allocate or depend on the order in which ranks call them beyond what the
//! operator itself implies: every algorithm reduces pairwise with
//! `dst = dst op src`, and Sum/Product/Min/Max are commutative here (NaN
//! propagates in Min/Max whichever side it is on), so all ranks that compute
//! the same pairs get bit-identical results.

use crate::element::{cast, cast_mut, DType};
use half::bf16;

/// How values from different ranks are combined (PyTorch's `ReduceOp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Element-wise sum (wrapping for integers).
    Sum,
    /// Sum divided by the group size. Floating-point types only: like
    /// PyTorch's Gloo backend, integer buffers are rejected with
    /// [`CommError::Unsupported`](crate::CommError::Unsupported) rather than
    /// silently truncated.
    Avg,
    /// Element-wise product (wrapping for integers).
    Product,
    /// Element-wise minimum; NaN wins.
    Min,
    /// Element-wise maximum; NaN wins.
    Max,
}

impl ReduceOp {
    /// Lower-case name (`sum`, `avg`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Product => "product",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
        }
    }

    /// Parses a name as printed by [`ReduceOp::name`].
    pub fn parse(s: &str) -> Option<ReduceOp> {
        Some(match s {
            "sum" => ReduceOp::Sum,
            "avg" | "mean" => ReduceOp::Avg,
            "product" | "prod" => ReduceOp::Product,
            "min" => ReduceOp::Min,
            "max" => ReduceOp::Max,
            _ => return None,
        })
    }

    pub(crate) const fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Avg => 2,
            ReduceOp::Product => 3,
            ReduceOp::Min => 4,
            ReduceOp::Max => 5,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<ReduceOp> {
        Some(match code {
            1 => ReduceOp::Sum,
            2 => ReduceOp::Avg,
            3 => ReduceOp::Product,
            4 => ReduceOp::Min,
            5 => ReduceOp::Max,
            _ => return None,
        })
    }

    /// Whether `dtype` supports this operator.
    pub fn supports(self, dtype: DType) -> bool {
        self != ReduceOp::Avg || dtype.is_float()
    }
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `dst[i] = dst[i] op src[i]` on byte views of `dtype` elements. `Avg` sums
/// here; the division by the group size happens once, after the reduction.
/// Public so that other backends (cohort-mpi's user-defined MPI operators)
/// reduce exactly as this crate does.
///
/// The same loops are compiled three times (baseline, AVX2, AVX-512) and
/// the widest the CPU supports runs: a segment that is still in cache
/// reduces about twice as fast with AVX-512 as with the SSE2 baseline.
///
/// # Panics
/// If `src` is shorter than `dst`, or either is not aligned for `dtype`.
pub fn reduce_into(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    debug_assert_eq!(dst.len(), src.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
        {
            // safety: the CPU has just been checked for these features.
            return unsafe { reduce_avx512(dtype, op, dst, src) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // safety: as above.
            return unsafe { reduce_avx2(dtype, op, dst, src) };
        }
    }
    reduce_any(dtype, op, dst, src)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn reduce_avx512(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    reduce_any(dtype, op, dst, src)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn reduce_avx2(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    reduce_any(dtype, op, dst, src)
}

/// The kernels, inlined into each instruction-set variant above.
#[inline(always)]
fn reduce_any(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    match dtype {
        DType::F32 => float_kernel(op, cast_mut::<f32>(dst), cast::<f32>(src)),
        DType::F64 => float_kernel(op, cast_mut::<f64>(dst), cast::<f64>(src)),
        DType::I32 => int_kernel(op, cast_mut::<i32>(dst), cast::<i32>(src)),
        DType::I64 => int_kernel(op, cast_mut::<i64>(dst), cast::<i64>(src)),
        DType::U8 => int_kernel(op, cast_mut::<u8>(dst), cast::<u8>(src)),
        DType::BF16 => bf16_kernel(op, cast_mut::<bf16>(dst), cast::<bf16>(src)),
    }
}

/// Divides a summed buffer by the group size (the second half of `Avg`).
pub(crate) fn finish_avg(dtype: DType, buf: &mut [u8], world: usize) {
    match dtype {
        DType::F32 => buf_div(cast_mut::<f32>(buf), world as f32),
        DType::F64 => buf_div(cast_mut::<f64>(buf), world as f64),
        DType::BF16 => {
            let w = world as f32;
            for x in cast_mut::<bf16>(buf) {
                *x = bf16::from_bits(f32_to_bf16(bf16_to_f32(x.to_bits()) / w));
            }
        }
        // Rejected by validation before any byte moves.
        DType::I32 | DType::I64 | DType::U8 => unreachable!("avg on an integer type"),
    }
}

fn buf_div<T: Copy + std::ops::Div<Output = T>>(buf: &mut [T], w: T) {
    for x in buf {
        *x = *x / w;
    }
}

trait Float: Copy + PartialOrd + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> {}
impl Float for f32 {}
impl Float for f64 {}

#[inline(always)]
#[allow(clippy::eq_op)] // `s != s` is the NaN test that vectorises.
fn fmin<T: Float>(d: T, s: T) -> T {
    if s < d || s != s {
        s
    } else {
        d
    }
}

#[inline(always)]
#[allow(clippy::eq_op)]
fn fmax<T: Float>(d: T, s: T) -> T {
    if s > d || s != s {
        s
    } else {
        d
    }
}

#[inline(always)]
fn float_kernel<T: Float>(op: ReduceOp, dst: &mut [T], src: &[T]) {
    let src = &src[..dst.len()];
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = *d + *s;
            }
        }
        ReduceOp::Product => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = *d * *s;
            }
        }
        ReduceOp::Min => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = fmin(*d, *s);
            }
        }
        ReduceOp::Max => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = fmax(*d, *s);
            }
        }
    }
}

trait Int: Copy + Ord {
    fn wrapping_add(self, o: Self) -> Self;
    fn wrapping_mul(self, o: Self) -> Self;
}

macro_rules! int {
    ($($t:ty),*) => {$(
        impl Int for $t {
            #[inline(always)]
            fn wrapping_add(self, o: Self) -> Self { <$t>::wrapping_add(self, o) }
            #[inline(always)]
            fn wrapping_mul(self, o: Self) -> Self { <$t>::wrapping_mul(self, o) }
        }
    )*};
}
int!(i32, i64, u8);

#[inline(always)]
fn int_kernel<T: Int>(op: ReduceOp, dst: &mut [T], src: &[T]) {
    let src = &src[..dst.len()];
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = d.wrapping_add(*s);
            }
        }
        ReduceOp::Product => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = d.wrapping_mul(*s);
            }
        }
        ReduceOp::Min => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = (*d).min(*s);
            }
        }
        ReduceOp::Max => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = (*d).max(*s);
            }
        }
    }
}

#[inline(always)]
fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Round-to-nearest-even, NaN kept quiet: the same result as
/// `half::bf16::from_f32`, written so that the loop vectorises.
#[inline(always)]
fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        ((bits >> 16) | 0x40) as u16
    } else {
        (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16
    }
}

#[inline(always)]
fn bf16_kernel(op: ReduceOp, dst: &mut [bf16], src: &[bf16]) {
    #[inline(always)]
    fn each(dst: &mut [bf16], src: &[bf16], f: impl Fn(f32, f32) -> f32) {
        for (d, s) in dst.iter_mut().zip(src) {
            let r = f(bf16_to_f32(d.to_bits()), bf16_to_f32(s.to_bits()));
            *d = bf16::from_bits(f32_to_bf16(r));
        }
    }
    let src = &src[..dst.len()];
    match op {
        ReduceOp::Sum | ReduceOp::Avg => each(dst, src, |d, s| d + s),
        ReduceOp::Product => each(dst, src, |d, s| d * s),
        ReduceOp::Min => each(dst, src, fmin),
        ReduceOp::Max => each(dst, src, fmax),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::element::{as_bytes, as_bytes_mut};

    #[test]
    fn bf16_rounding_matches_half() {
        let samples = [
            0.0f32,
            -0.0,
            1.0,
            1.0 + 1.0 / 256.0, // a tie: rounds to even (down)
            1.0078125,
            1.0 + 3.0 / 256.0, // a tie: rounds to even (up)
            3.3,
            -2.5e-40,
            f32::MAX,
            f32::MIN_POSITIVE,
            f32::INFINITY,
            f32::NEG_INFINITY,
            65504.0,
            1e30,
        ];
        for x in samples {
            assert_eq!(f32_to_bf16(x), bf16::from_f32(x).to_bits(), "{x}");
        }
        assert!(bf16::from_bits(f32_to_bf16(f32::NAN)).is_nan());
    }

    #[test]
    fn min_max_propagate_nan_from_either_side() {
        let mut a = [1.0f32, f32::NAN, 3.0];
        let b = [f32::NAN, 2.0, 1.0];
        reduce_into(
            DType::F32,
            ReduceOp::Min,
            as_bytes_mut(&mut a),
            as_bytes(&b),
        );
        assert!(a[0].is_nan() && a[1].is_nan());
        assert_eq!(a[2], 1.0);
    }

    #[test]
    fn integers_wrap_and_avg_divides_floats() {
        let mut a = [250u8, 3];
        reduce_into(
            DType::U8,
            ReduceOp::Sum,
            as_bytes_mut(&mut a),
            as_bytes(&[10u8, 4]),
        );
        assert_eq!(a, [4, 7]);
        let mut f = [bf16::from_f32(3.0), bf16::from_f32(-1.0)];
        finish_avg(DType::BF16, as_bytes_mut(&mut f), 2);
        assert_eq!(f, [bf16::from_f32(1.5), bf16::from_f32(-0.5)]);
        assert!(!ReduceOp::Avg.supports(DType::I64));
        assert!(ReduceOp::Avg.supports(DType::BF16));
    }
}

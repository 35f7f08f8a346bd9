//! Scalar building blocks written so LLVM vectorizes them inside the AVX-512 / AVX2 clones
//! made by `simd_fn!`: no libm calls, no branches, reductions over fixed 16-lane accumulators.
//!
//! Every function here gives bitwise the same result on every code path (no FMA contraction),
//! which keeps results independent of the CPU features detected.

/// Lanes of the fixed-order reductions (one AVX-512 register).
pub(crate) const LANES: usize = 16;

/// [`exp`]'s constants, shared with the 16-lane copy of it in the fused attention heads:
/// the range it clamps to, 1.5 · 2^23 (adding it rounds to an integer), ln 2 in two parts, and
/// the polynomial's coefficients, highest degree first.
pub(crate) const EXP_RANGE: (f32, f32) = (-87.0, 88.0);
pub(crate) const EXP_MAGIC: f32 = 12_582_912.0;
pub(crate) const EXP_LN2: (f32, f32) = (0.693_359_4, -2.121_944_4e-4);
pub(crate) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// e^x with about 1 ulp error for x in [-87, 88]; clamps outside (softmax never needs more).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let x = x.clamp(EXP_RANGE.0, EXP_RANGE.1);
    let k = x * std::f32::consts::LOG2_E + EXP_MAGIC;
    let n = k - EXP_MAGIC;
    let ni = (k.to_bits() as i32).wrapping_sub(EXP_MAGIC.to_bits() as i32);
    let f = x - n * EXP_LN2.0 - n * EXP_LN2.1;
    let mut p = EXP_POLY[0];
    p = p * f + EXP_POLY[1];
    p = p * f + EXP_POLY[2];
    p = p * f + EXP_POLY[3];
    p = p * f + EXP_POLY[4];
    p = p * f + EXP_POLY[5];
    let ef = p * f * f + f + 1.0;
    ef * f32::from_bits(((ni + 127) << 23) as u32)
}

const GELU_S: f32 = 0.797_884_6; // sqrt(2 / pi)
const GELU_C: f32 = 0.044_715;

/// tanh(u) via exp, accurate to a few 1e-8 absolute.
#[inline(always)]
fn tanh(u: f32) -> f32 {
    1.0 - 2.0 / (exp(2.0 * u) + 1.0)
}

/// GPT-2's `gelu_new`: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
#[inline(always)]
pub(crate) fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + tanh(GELU_S * (x + GELU_C * x * x * x)))
}

/// d gelu(x) / dx.
#[inline(always)]
pub(crate) fn gelu_grad(x: f32) -> f32 {
    let th = tanh(GELU_S * (x + GELU_C * x * x * x));
    0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * GELU_S * (1.0 + 3.0 * GELU_C * x * x)
}

/// `(gelu(x), gelu_grad(x))` from one tanh: the same bits as the two functions.
#[inline(always)]
pub(crate) fn gelu_and_grad(x: f32) -> (f32, f32) {
    let th = tanh(GELU_S * (x + GELU_C * x * x * x));
    (
        0.5 * x * (1.0 + th),
        0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * GELU_S * (1.0 + 3.0 * GELU_C * x * x),
    )
}

/// The logistic sigmoid 1 / (1 + e^-x), through [`exp`] (so it vectorizes).
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// SwiGLU of one gate and up pair: silu(g) · u = g · sigmoid(g) · u, in that order.
#[inline(always)]
pub(crate) fn swiglu(g: f32, u: f32) -> f32 {
    g * sigmoid(g) * u
}

/// What SwiGLU's backward needs of one (gate, up) pair, from one sigmoid: (d out / d up,
/// d out / d gate) = (silu(g), u · silu'(g)), silu'(g) = s · (1 + g · (1 - s)).
#[inline(always)]
pub(crate) fn swiglu_grads(g: f32, u: f32) -> (f32, f32) {
    let s = sigmoid(g);
    (g * s, u * s * (1.0 + g * (1.0 - s)))
}

/// SwiGLU's backward at one (gate, up) pair for d(output) `d`: (d gate, d up), in the order of
/// operations every SwiGLU backward uses.
#[inline(always)]
pub(crate) fn swiglu_backward_pair(d: f32, g: f32, u: f32) -> (f32, f32) {
    let s = sigmoid(g);
    (d * u * s * (1.0 + g * (1.0 - s)), d * g * s)
}

/// Sum in a fixed order: 16 strided partial sums, then those in order.
#[inline(always)]
pub(crate) fn sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for ch in chunks {
        for i in 0..LANES {
            acc[i] += ch[i];
        }
    }
    for (i, v) in tail.iter().enumerate() {
        acc[i] += v;
    }
    sum_lanes(&acc)
}

/// [`sum`]'s last step: its 16 partial sums (lane i: elements i, i + 16, ...) added in order.
#[inline(always)]
pub(crate) fn sum_lanes(acc: &[f32; LANES]) -> f32 {
    acc.iter().sum()
}

/// Dot product in the same fixed order as [`sum`].
#[inline(always)]
pub(crate) fn dot(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let n = x.len().min(y.len());
    let (x, y) = (&x[..n], &y[..n]);
    let full = n / LANES * LANES;
    for (cx, cy) in x[..full]
        .chunks_exact(LANES)
        .zip(y[..full].chunks_exact(LANES))
    {
        for i in 0..LANES {
            acc[i] += cx[i] * cy[i];
        }
    }
    for i in full..n {
        acc[i - full] += x[i] * y[i];
    }
    acc.iter().sum()
}

/// Maximum; `f32::NEG_INFINITY` for an empty slice.
#[inline(always)]
pub(crate) fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for ch in chunks {
        for i in 0..LANES {
            acc[i] = acc[i].max(ch[i]);
        }
    }
    for (i, v) in tail.iter().enumerate() {
        acc[i] = acc[i].max(*v);
    }
    acc.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_and_gelu_match_libm() {
        let mut worst = 0f64;
        for i in -8700..8800 {
            let x = i as f32 * 0.01;
            let rel = ((exp(x) as f64 - (x as f64).exp()) / (x as f64).exp()).abs();
            worst = worst.max(rel);
        }
        assert!(worst < 3e-7, "exp rel err {worst}");
        for i in -1000..1000 {
            let x = i as f64 * 0.01;
            let want = 0.5
                * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh());
            assert!((gelu(x as f32) as f64 - want).abs() < 1e-6, "gelu({x})");
            let h = 1e-5;
            let up = 0.5
                * (x + h)
                * (1.0
                    + ((2.0 / std::f64::consts::PI).sqrt()
                        * ((x + h) + 0.044715 * (x + h).powi(3)))
                    .tanh());
            let dn = 0.5
                * (x - h)
                * (1.0
                    + ((2.0 / std::f64::consts::PI).sqrt()
                        * ((x - h) + 0.044715 * (x - h).powi(3)))
                    .tanh());
            let fd = (up - dn) / (2.0 * h);
            assert!((gelu_grad(x as f32) as f64 - fd).abs() < 1e-5, "gelu'({x})");
        }
        for i in -1000..1000 {
            let x = i as f32 * 0.0137;
            let (g, d) = gelu_and_grad(x);
            assert_eq!(
                (g.to_bits(), d.to_bits()),
                (gelu(x).to_bits(), gelu_grad(x).to_bits())
            );
        }
        assert_eq!(gelu(-30.0), 0.0);
        assert_eq!(gelu(30.0), 30.0);
    }

    #[test]
    fn reductions() {
        let x: Vec<f32> = (0..37).map(|i| i as f32 - 5.0).collect();
        assert_eq!(sum(&x), x.iter().sum::<f32>());
        assert_eq!(max(&x), 31.0);
        assert_eq!(dot(&x, &x), x.iter().map(|v| v * v).sum::<f32>());
        assert_eq!(max(&[]), f32::NEG_INFINITY);
    }
}

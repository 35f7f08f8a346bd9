//! The elementwise loops behind the optimizers and clipping, compiled three times (AVX-512, AVX2,
//! portable) and picked at run time. The loops zip slices cut to one length, which LLVM turns
//! into 16-wide AVX-512 code; explicit 16-element chunks made it vectorise across chunks with
//! gathers instead (8x slower SGD).
//!
//! Every variant computes bitwise the same result: Rust never contracts `a * b + c` into a fused
//! multiply-add, so the only fused operations are the explicit `mul_add`s, which are correctly
//! rounded on every CPU (in software where there is no FMA unit). Must never reorder a reduction:
//! [`sum_squares`] accumulates in a fixed lane pattern so that its result does not depend on the
//! variant or on how callers split the buffer into blocks.

/// Accumulator lanes of [`sum_squares`] (one AVX-512 register of f32, two of f64).
const LANES: usize = 16;

/// Scalars of one AdamW step, already rounded to f32 the way PyTorch passes them to its kernels
/// (what [`Backend::adamw_step`](crate::Backend::adamw_step) takes).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamCoeffs {
    /// `1 - lr * weight_decay` (1.0 for exempt segments: multiplying by 1 is exact).
    pub decay: f32,
    /// `1 - beta1`, the `lerp_` weight.
    pub lerp_w: f32,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bc2_sqrt: f32,
    /// `eps`.
    pub eps: f32,
    /// `-lr / (1 - beta1^t)`.
    pub neg_step_size: f32,
}

/// Scalars of one SGD step.
#[derive(Debug, Clone, Copy)]
pub(super) struct SgdCoeffs {
    /// L2 penalty added to the gradient; `None` where it is zero (PyTorch skips the add then).
    pub weight_decay: Option<f32>,
    /// `None` without momentum.
    pub momentum: Option<f32>,
    pub one_minus_dampening: f32,
    pub nesterov: bool,
    /// First step: the momentum buffer is set to the gradient instead of updated.
    pub first: bool,
    pub neg_lr: f32,
}

/// Compiles `$body` once per instruction set and dispatches on what the CPU has.
macro_rules! multiversion {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? => $body:ident) => {
        $(#[$doc])*
        pub(super) fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,fma")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // safety: the CPU was just checked to have every feature avx512 enables.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // safety: the CPU was just checked to have every feature avx2 enables.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}

multiversion! {
    /// AdamW on one segment: `p`, `g`, `m` (exp_avg), `v` (exp_avg_sq) of equal length.
    fn adamw(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: AdamCoeffs) => adamw_body
}

multiversion! {
    /// SGD on one segment; `buf` (momentum buffer) is empty when there is no momentum.
    fn sgd(p: &mut [f32], g: &[f32], buf: &mut [f32], c: SgdCoeffs) => sgd_body
}

multiversion! {
    /// Sum of squares of `x` in f64, in a fixed order.
    fn sum_squares(x: &[f32]) -> f64 => sum_squares_body
}

multiversion! {
    /// `x *= s`.
    fn scale(x: &mut [f32], s: f32) => scale_body
}

multiversion! {
    /// `x = clamp(x, lo, hi)`; NaN stays NaN as in `torch.clamp_`.
    fn clamp(x: &mut [f32], lo: f32, hi: f32) => clamp_body
}

/// torch `_single_tensor_adam` with `decoupled_weight_decay`, per element:
/// `param.mul_(1 - lr*wd)`, `exp_avg.lerp_(grad, 1 - beta1)` (an FMA in ATen's vector kernel),
/// `exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)` (`self + (value*t1)*t2`, which
/// PyTorch's compiler contracts into an FMA), `denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)`,
/// `param.addcdiv_(exp_avg, denom, -step_size)` (`self + (value*t1)/t2`). Checked against torch
/// 2.15 (AVX-512): moments bitwise equal; parameters differ by 1 ulp in ~0.2% of elements because
/// PyTorch's `sqrt` goes through MKL's vector math (within 1 ulp) where ours is correctly rounded.
#[inline(always)]
fn adamw_elem(p: &mut f32, g: f32, m: &mut f32, v: &mut f32, c: &AdamCoeffs) {
    let pd = *p * c.decay;
    let mn = c.lerp_w.mul_add(g - *m, *m);
    let vn = (c.one_minus_beta2 * g).mul_add(g, *v * c.beta2);
    let denom = vn.sqrt() / c.bc2_sqrt + c.eps;
    *p = pd + c.neg_step_size * mn / denom;
    *m = mn;
    *v = vn;
}

#[inline(always)]
fn adamw_body(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: AdamCoeffs) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        adamw_elem(p, *g, m, v, &c);
    }
}

/// torch `_single_tensor_sgd`, per element: `grad = grad.add(param, alpha=wd)`;
/// `buf.mul_(momentum).add_(grad, alpha=1 - dampening)` (or `buf = grad` on the first step);
/// `grad = grad.add(buf, alpha=momentum)` with Nesterov, else `grad = buf`;
/// `param.add_(grad, alpha=-lr)`. ATen's vector `add` with `alpha` is `fmadd(other, alpha, self)`.
/// The flags are const parameters so that each combination is its own branch-free loop.
#[inline(always)]
fn sgd_elem<const WD: bool, const MOMENTUM: bool, const FIRST: bool, const NESTEROV: bool>(
    p: &mut f32,
    g: f32,
    b: &mut f32,
    c: &SgdCoeffs,
    wd: f32,
    mom: f32,
) {
    let mut d = g;
    if WD {
        d = p.mul_add(wd, d);
    }
    if MOMENTUM {
        let bn = if FIRST {
            d
        } else {
            d.mul_add(c.one_minus_dampening, *b * mom)
        };
        *b = bn;
        d = if NESTEROV { bn.mul_add(mom, d) } else { bn };
    }
    *p = d.mul_add(c.neg_lr, *p);
}

#[inline(always)]
fn sgd_loop<const WD: bool, const MOMENTUM: bool, const FIRST: bool, const NESTEROV: bool>(
    p: &mut [f32],
    g: &[f32],
    buf: &mut [f32],
    c: &SgdCoeffs,
) {
    let wd = c.weight_decay.unwrap_or(0.0);
    let mom = c.momentum.unwrap_or(0.0);
    let n = p.len();
    let g = &g[..n];
    if !MOMENTUM {
        let mut unused = 0.0;
        for (p, g) in p.iter_mut().zip(g) {
            sgd_elem::<WD, false, false, false>(p, *g, &mut unused, c, wd, mom);
        }
        return;
    }
    let buf = &mut buf[..n];
    for ((p, g), b) in p.iter_mut().zip(g).zip(buf.iter_mut()) {
        sgd_elem::<WD, MOMENTUM, FIRST, NESTEROV>(p, *g, b, c, wd, mom);
    }
}

#[inline(always)]
fn sgd_body(p: &mut [f32], g: &[f32], buf: &mut [f32], c: SgdCoeffs) {
    let c = &c;
    match (
        c.weight_decay.is_some(),
        c.momentum.is_some(),
        c.first,
        c.nesterov,
    ) {
        (false, false, _, _) => sgd_loop::<false, false, false, false>(p, g, buf, c),
        (true, false, _, _) => sgd_loop::<true, false, false, false>(p, g, buf, c),
        (false, true, false, false) => sgd_loop::<false, true, false, false>(p, g, buf, c),
        (false, true, false, true) => sgd_loop::<false, true, false, true>(p, g, buf, c),
        (false, true, true, false) => sgd_loop::<false, true, true, false>(p, g, buf, c),
        (false, true, true, true) => sgd_loop::<false, true, true, true>(p, g, buf, c),
        (true, true, false, false) => sgd_loop::<true, true, false, false>(p, g, buf, c),
        (true, true, false, true) => sgd_loop::<true, true, false, true>(p, g, buf, c),
        (true, true, true, false) => sgd_loop::<true, true, true, false>(p, g, buf, c),
        (true, true, true, true) => sgd_loop::<true, true, true, true>(p, g, buf, c),
    }
}

/// Lane `i` of the accumulator sums elements `i, i + 16, i + 32, ...`; lanes are added in
/// order at the end. Fixed order, so every variant gives the same bits.
#[inline(always)]
fn sum_squares_body(x: &[f32]) -> f64 {
    let mut acc = [0f64; LANES];
    let mut xc = x.chunks_exact(LANES);
    for x in &mut xc {
        for i in 0..LANES {
            let xi = f64::from(x[i]);
            acc[i] += xi * xi;
        }
    }
    for (i, xi) in xc.remainder().iter().enumerate() {
        acc[i] += f64::from(*xi) * f64::from(*xi);
    }
    acc.iter().sum()
}

#[inline(always)]
fn scale_body(x: &mut [f32], s: f32) {
    for x in x.iter_mut() {
        *x *= s;
    }
}

#[inline(always)]
fn clamp_body(x: &mut [f32], lo: f32, hi: f32) {
    for x in x.iter_mut() {
        // `f32::clamp` would also keep NaN; written out so it vectorises to min/max.
        let y = if *x < lo { lo } else { *x };
        *x = if y > hi { hi } else { y };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    /// The dispatched (vector) kernels against the portable body called directly: the same bits.
    #[test]
    fn every_variant_gives_the_same_bits() {
        let n = 16 * 9 + 11;
        let g = values(n);
        let c = AdamCoeffs {
            decay: 0.999,
            lerp_w: 0.1,
            beta2: 0.999,
            one_minus_beta2: 0.001,
            bc2_sqrt: 0.0447,
            eps: 1e-8,
            neg_step_size: -0.01,
        };
        let (mut p1, mut m1, mut v1) = (g.clone(), vec![0.3f32; n], vec![0.2f32; n]);
        let (mut p2, mut m2, mut v2) = (p1.clone(), m1.clone(), v1.clone());
        adamw(&mut p1, &g, &mut m1, &mut v1, c);
        adamw_body(&mut p2, &g, &mut m2, &mut v2, c);
        assert_eq!((p1, m1, v1), (p2, m2, v2));

        let c = SgdCoeffs {
            weight_decay: Some(0.01),
            momentum: Some(0.9),
            one_minus_dampening: 0.9,
            nesterov: true,
            first: false,
            neg_lr: -0.1,
        };
        let (mut p1, mut b1) = (g.clone(), vec![0.3f32; n]);
        let (mut p2, mut b2) = (p1.clone(), b1.clone());
        sgd(&mut p1, &g, &mut b1, c);
        sgd_body(&mut p2, &g, &mut b2, c);
        assert_eq!((p1, b1), (p2, b2));

        assert_eq!(sum_squares(&g).to_bits(), sum_squares_body(&g).to_bits());
    }
}

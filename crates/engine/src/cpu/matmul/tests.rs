use super::*;
use crate::cpu::bf16::bf16_bits_as_packed;
use crate::cpu::testing::{assert_close, rand_vec, within_pool};

fn naive(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for p in 0..k {
            for j in 0..n {
                c[i * n + j] += a[i * k + p] * b[p * n + j];
            }
        }
    }
    c
}

fn transpose(a: &[f64], r: usize, c: usize) -> Vec<f64> {
    (0..r * c).map(|i| a[(i % r) * c + i / r]).collect()
}

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

#[test]
fn packed_matmul_matches_f64_and_not_the_thread_count() {
    // one row (the vector kernel), a few, and more than a tile and a K block; N below,
    // at and past a 32-column panel
    for &(m, k, n) in &[
        (1, 5, 7),
        (1, 300, 70),
        (1, 600, 300),
        (3, 33, 32),
        (13, 257, 65),
        (40, 64, 1030),
        (260, 20, 33),
    ] {
        let inp = rand_vec(m * k, 1);
        let w = rand_vec(k * n, 2);
        let b = rand_vec(n, 3);
        let mut want = naive(&f64s(&inp), &f64s(&w), m, k, n);
        for (i, v) in want.iter_mut().enumerate() {
            *v += b[i % n] as f64;
        }
        let wt: Vec<f32> = (0..k * n).map(|i| w[(i % k) * n + i / k]).collect();
        let mut first: Option<Vec<f32>> = None;
        for (packed, what) in [
            (PackedMatrix::new(&w, k, n, false), "w"),
            (PackedMatrix::new(&wt, k, n, true), "transposed w"),
        ] {
            assert_eq!((packed.k(), packed.n()), (k, n));
            let mut alone = vec![f32::NAN; m * n];
            packed_matmul_forward(&mut alone, &inp, &packed, Some(&b), m);
            assert_close(&alone, &want, 1e-5, what);
            let mut pooled = vec![f32::NAN; m * n];
            within_pool(2, || {
                packed_matmul_forward(&mut pooled, &inp, &packed, Some(&b), m)
            });
            assert_eq!(alone, pooled, "{what}: 1 thread against 2, ({m}, {k}, {n})");
            let mut plain = vec![f32::NAN; m * n];
            packed_matmul_forward(&mut plain, &inp, &packed, None, m);
            let unbiased: Vec<f64> = want
                .iter()
                .enumerate()
                .map(|(i, v)| v - b[i % n] as f64)
                .collect();
            assert_close(&plain, &unbiased, 1e-5, what);
            match &first {
                Some(f) => assert_eq!(f, &alone, "{what}: packed from the transpose"),
                None => first = Some(alone),
            }
        }
    }
}

#[test]
fn matmul_forward_and_backward_match_f64() {
    for threads in [1, 2] {
        for &(n, c, oc) in &[
            (5, 3, 7),
            (70, 33, 65),
            (130, 64, 96),
            (37, 300, 45),
            (260, 20, 33),
        ] {
            let inp = rand_vec(n * c, 1);
            let w = rand_vec(c * oc, 2);
            let b = rand_vec(oc, 3);
            let dout = rand_vec(n * oc, 4);
            let mut out = vec![0.0; n * oc];
            let mut dinp = vec![0.0; n * c];
            let mut dw = rand_vec(c * oc, 5);
            let dw0 = dw.clone();
            let mut db = vec![1.0; oc];
            within_pool(threads, || {
                matmul_forward(DType::F32, &mut out, &inp, &w, Some(&b), n, c, oc);
                matmul_backward(
                    DType::F32,
                    Some(&mut dinp),
                    &mut dw,
                    Some(&mut db),
                    &dout,
                    &inp,
                    &w,
                    n,
                    c,
                    oc,
                    true,
                );
            });
            let mut want = naive(&f64s(&inp), &f64s(&w), n, c, oc);
            for (i, v) in want.iter_mut().enumerate() {
                *v += b[i % oc] as f64;
            }
            assert_close(&out, &want, 1e-5, "out");
            let wt = transpose(&f64s(&w), c, oc);
            assert_close(&dinp, &naive(&f64s(&dout), &wt, n, oc, c), 1e-5, "dinp");
            let it = transpose(&f64s(&inp), n, c);
            let mut want_dw = naive(&it, &f64s(&dout), c, n, oc);
            for (d, v) in want_dw.iter_mut().zip(&dw0) {
                *d += *v as f64;
            }
            assert_close(&dw, &want_dw, 1e-5, "dw");
            let want_db: Vec<f64> = (0..oc)
                .map(|j| 1.0 + (0..n).map(|i| dout[i * oc + j] as f64).sum::<f64>())
                .collect();
            assert_close(&db, &want_db, 1e-5, "db");
        }
    }
}

#[test]
fn fused_gelu_products_are_the_unfused_bits() {
    use crate::cpu::gelu_forward;
    let mut dtypes = vec![DType::F32];
    if crate::cpu::bf16_supported() {
        dtypes.push(DType::Bf16);
    }
    for dtype in dtypes {
        for threads in [1, 2] {
            // Below and past a register tile and a 32-column panel; K past one K block of
            // every kernel (256 for fp32, 2048 under AMX).
            for &(n, c, oc) in &[(5, 3, 7), (70, 33, 65), (130, 300, 96), (40, 2100, 50)] {
                let inp: Vec<f32> = rand_vec(n * c, 1).iter().map(|v| v * 3.0).collect();
                let w = rand_vec(c * oc, 2);
                let b = rand_vec(oc, 3);
                let (mut pre, mut out) = (vec![0.0; n * oc], vec![0.0; n * oc]);
                let (mut want_pre, mut want_out) = (vec![0.0; n * oc], vec![0.0; n * oc]);
                within_pool(threads, || {
                    matmul_gelu_forward(dtype, &mut pre, &mut out, &inp, &w, Some(&b), n, c, oc);
                    matmul_forward(dtype, &mut want_pre, &inp, &w, Some(&b), n, c, oc);
                    gelu_forward(&mut want_out, &want_pre);
                });
                let what = format!("{dtype} {threads} threads {n}x{c}x{oc}");
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&pre), bits(&want_pre), "pre, {what}");
                assert_eq!(bits(&out), bits(&want_out), "gelu out, {what}");
                assert!(
                    out.iter().zip(&pre).any(|(o, p)| o != p),
                    "gelu applied, {what}"
                );
            }
        }
    }
}

/// Products of a bf16 input (f32 results, the GELU kept in bf16, a result kept in bf16) give
/// the bits of the f32 products they stand for.
#[test]
fn bf16_inputs_give_the_bits_of_their_f32_values() {
    if !crate::cpu::bf16_supported() {
        eprintln!("skipped: this CPU has no bf16 product");
        return;
    }
    use crate::cpu::gelu_forward;
    let d = DType::Bf16;
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let round =
        |x: &[f32]| -> Vec<u16> { x.iter().map(|&v| crate::cpu::bf16::bf16_bits(v)).collect() };
    let widen = |x: &[u16]| -> Vec<f32> {
        x.iter()
            .map(|&h| f32::from_bits((h as u32) << 16))
            .collect()
    };
    for threads in [1, 2] {
        // Odd K (a half pair), K past a 16-pair AMX row and past a K block, rows and
        // columns off every tile size.
        for &(n, c, oc) in &[(5, 3, 7), (70, 33, 65), (130, 300, 96), (40, 2100, 50)] {
            let what = format!("{threads} threads {n}x{c}x{oc}");
            let inp16 = round(&rand_vec(n * c, 1));
            let inp = widen(&inp16);
            let w = rand_vec(c * oc, 2);
            let b = rand_vec(oc, 3);
            let dout = rand_vec(n * oc, 4);
            let (mut out, mut want) = (vec![0.0; n * oc], vec![0.0; n * oc]);
            let (mut dw, mut want_dw) = (rand_vec(c * oc, 5), rand_vec(c * oc, 5));
            let (mut db, mut want_db) = (vec![1.0; oc], vec![1.0; oc]);
            // The GELU kept in bf16 against the f32 GELU rounded, its input in bf16 against
            // the f32 values (which the product rounds).
            let x: Vec<f32> = rand_vec(n * c, 6).iter().map(|v| v * 3.0).collect();
            let x16 = round(&x);
            let (mut pre, mut g16) = (vec![0.0; n * oc], vec![0u16; n * oc]);
            let (mut want_pre, mut g) = (vec![0.0; n * oc], vec![0.0; n * oc]);
            within_pool(threads, || {
                matmul_forward_bf16_input(d, &mut out, &inp16, &w, Some(&b), n, c, oc);
                matmul_forward(d, &mut want, &inp, &w, Some(&b), n, c, oc);
                matmul_backward_weight_bf16_input(
                    d,
                    &mut dw,
                    Some(&mut db),
                    &dout,
                    &inp16,
                    n,
                    c,
                    oc,
                    true,
                );
                matmul_backward(
                    d,
                    None,
                    &mut want_dw,
                    Some(&mut want_db),
                    &dout,
                    &inp,
                    &w,
                    n,
                    c,
                    oc,
                    true,
                );
                matmul_gelu_forward_bf16(d, &mut pre, &mut g16, &x16, &w, Some(&b), n, c, oc);
                matmul_forward(d, &mut want_pre, &x, &w, Some(&b), n, c, oc);
                gelu_forward(&mut g, &want_pre);
            });
            // `pre` holds GELU's derivative at the pre-activation: 1 · gelu'(x), exactly
            let mut want_grad = vec![1.0; n * oc];
            crate::cpu::gelu_backward(&mut want_grad, &want_pre);
            assert_eq!(bits(&out), bits(&want), "forward, {what}");
            assert_eq!(bits(&dw), bits(&want_dw), "weight grad, {what}");
            assert_eq!(bits(&db), bits(&want_db), "bias grad, {what}");
            assert_eq!(bits(&pre), bits(&want_grad), "gelu derivative, {what}");
            assert_eq!(g16, round(&g), "bf16 gelu, {what}");
            // The product kept in bf16 (qkv's): the f32 product rounded as the packs round
            let (mut sums, mut out16) = (vec![0.0; n * oc], vec![0u16; n * oc]);
            within_pool(threads, || {
                matmul_forward_bf16_out(d, &mut sums, &mut out16, &inp16, &w, Some(&b), n, c, oc)
            });
            let packed = want
                .iter()
                .map(|&v| bf16_bits_as_packed(v))
                .collect::<Vec<_>>();
            assert_eq!(out16, packed, "bf16 product, {what}");
            assert_eq!(bits(&sums), bits(&want), "bf16 product's sums, {what}");
        }
    }
}

#[test]
fn bf16_products_do_not_depend_on_the_thread_count() {
    if !crate::cpu::bf16_supported() {
        eprintln!("skipped: this CPU has no bf16 product");
        return;
    }
    // Split by rows (tall) and by columns (wide); the wide one's B, packed at full K, is
    // past the size where the AMX kernel shortens its K blocks, which must not change
    // with the columns a thread gets.
    for &(n, c, oc) in &[(300, 64, 48), (40, 2100, 500)] {
        let inp = rand_vec(n * c, 1);
        let w = rand_vec(c * oc, 2);
        let dout = rand_vec(n * oc, 3);
        let run = |threads: usize| {
            let (mut out, mut dinp) = (vec![0.0; n * oc], vec![0.0; n * c]);
            let mut dw = vec![0.0; c * oc];
            within_pool(threads, || {
                matmul_forward(DType::Bf16, &mut out, &inp, &w, None, n, c, oc);
                matmul_backward(
                    DType::Bf16,
                    Some(&mut dinp),
                    &mut dw,
                    None,
                    &dout,
                    &inp,
                    &w,
                    n,
                    c,
                    oc,
                    true,
                );
            });
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            (bits(&out), bits(&dinp), bits(&dw))
        };
        assert_eq!(run(1), run(2), "{n}x{c}x{oc}");
    }
}

#[test]
fn head_forward_and_backward_match_f64() {
    let (n, c, v) = (50, 24, 13);
    let inp = rand_vec(n * c, 1);
    let w = rand_vec(v * c, 2);
    let dout = rand_vec(n * v, 3);
    let mut out = vec![0.0; n * v];
    let mut dinp = vec![0.0; n * c];
    let mut dw = vec![0.0; v * c];
    within_pool(2, || {
        head_forward(DType::F32, &mut out, &inp, &w, n, c, v);
        head_backward(
            DType::F32,
            &mut dinp,
            &mut dw,
            &dout,
            &inp,
            &w,
            n,
            c,
            v,
            true,
        );
    });
    let wt = transpose(&f64s(&w), v, c);
    assert_close(&out, &naive(&f64s(&inp), &wt, n, c, v), 1e-5, "logits");
    assert_close(
        &dinp,
        &naive(&f64s(&dout), &f64s(&w), n, v, c),
        1e-5,
        "dinp",
    );
    let dt = transpose(&f64s(&dout), n, v);
    assert_close(&dw, &naive(&dt, &f64s(&inp), v, n, c), 1e-5, "dw");
}

/// A weight gradient's product without `accumulate` (over memory holding NaN, which it must
/// never read) writes the bits the product adds into +0.0: what lets a lazy `zero_grad` skip
/// the weights' zeros. K = 2,500 rows is past one K block of every kernel (so later blocks
/// add to what the first wrote), the gradient is split by rows and by columns, and one
/// column of the output gradient is zero (sums of ±0 products).
#[test]
fn weight_gradients_overwritten_are_the_bits_added_into_zeros() {
    let mut dtypes = vec![DType::F32];
    if crate::cpu::bf16_supported() {
        dtypes.push(DType::Bf16);
    }
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for &(n, c, oc) in &[(2500, 70, 40), (2500, 33, 96)] {
        let inp = rand_vec(n * c, 1);
        let inp16: Vec<u16> = inp
            .iter()
            .map(|&v| crate::cpu::bf16::bf16_bits(v))
            .collect();
        let w = rand_vec(c * oc, 2);
        let mut dout = rand_vec(n * oc, 3);
        for row in dout.chunks_mut(oc) {
            row[1] = 0.0;
        }
        for &dtype in &dtypes {
            for threads in [1, 2] {
                let at = format!("{dtype:?} {threads} threads {n}x{c}x{oc}");
                // (accumulate, dw's start): into zeros, or over NaN
                let run = |accumulate: bool, start: f32| {
                    let (mut dw, mut db) = (vec![start; c * oc], vec![0.0; oc]);
                    let mut dw_plain = vec![start; c * oc];
                    let (mut dw16, mut db16) = (vec![start; c * oc], vec![0.0; oc]);
                    let mut dwh = vec![start; oc * c];
                    let mut dinp = vec![0.0; n * c];
                    let d = &dout;
                    within_pool(threads, || {
                        let (dw, db) = (&mut dw, Some(&mut db[..]));
                        matmul_backward(dtype, None, dw, db, d, &inp, &w, n, c, oc, accumulate);
                        let dw = &mut dw_plain;
                        matmul_backward(dtype, None, dw, None, d, &inp, &w, n, c, oc, accumulate);
                        if dtype == DType::Bf16 {
                            let (dw, db) = (&mut dw16, Some(&mut db16[..]));
                            matmul_backward_weight_bf16_input(
                                dtype, dw, db, d, &inp16, n, c, oc, accumulate,
                            );
                        }
                        // the head's (V, C) gradient of logits (N, V = oc) over inputs (N, C)
                        let (dwh, dinp) = (&mut dwh, &mut dinp);
                        head_backward(dtype, dinp, dwh, d, &inp, &w, n, c, oc, accumulate);
                    });
                    [dw, db, dw_plain, dw16, db16, dwh].map(|v| bits(&v))
                };
                let (added, written) = (run(true, 0.0), run(false, f32::NAN));
                let names = ["dw", "db", "dw alone", "dw bf16", "db bf16", "head dw"];
                for (name, (a, w)) in names.iter().zip(added.iter().zip(&written)) {
                    if !(dtype == DType::F32 && name.contains("bf16")) {
                        assert!(a == w, "{name}, {at}");
                    }
                }
                // the zero column's gradient is +0.0 both ways
                assert_eq!(written[0][1], 0, "{at}");
            }
        }
    }
}

#[test]
fn bias_gradients_are_the_bits_of_column_sums_at_any_thread_count() {
    let mut dtypes = vec![DType::F32];
    if crate::cpu::bf16_supported() {
        dtypes.push(DType::Bf16);
    }
    // the weight gradient (c x oc) split by rows (c >= oc) and by columns (c < oc)
    for &(n, c, oc) in &[(300, 200, 40), (300, 64, 96)] {
        let inp = rand_vec(n * c, 1);
        let inp16: Vec<u16> = inp
            .iter()
            .map(|&v| crate::cpu::bf16::bf16_bits(v))
            .collect();
        let dout = rand_vec(n * oc, 4);
        let db0 = rand_vec(oc, 6);
        let mut want = db0.clone();
        column_sums(&mut want, &dout);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for &dtype in &dtypes {
            for threads in [1, 2, 3] {
                let (mut dw, mut db) = (vec![0.0; c * oc], db0.clone());
                within_pool(threads, || {
                    matmul_backward(
                        dtype,
                        None,
                        &mut dw,
                        Some(&mut db),
                        &dout,
                        &inp,
                        &inp,
                        n,
                        c,
                        oc,
                        true,
                    )
                });
                let at = format!("{dtype:?} {threads} threads c{c} oc{oc}");
                assert_eq!(bits(&db), bits(&want), "{at}");
                if dtype == DType::Bf16 {
                    let mut db = db0.clone();
                    within_pool(threads, || {
                        matmul_backward_weight_bf16_input(
                            dtype,
                            &mut dw,
                            Some(&mut db),
                            &dout,
                            &inp16,
                            n,
                            c,
                            oc,
                            true,
                        )
                    });
                    assert_eq!(bits(&db), bits(&want), "{at}, bf16 input");
                }
            }
        }
    }
}

/// One product of [`gemm_on`] over `threads` threads: its result, the epilogue's output and
/// B's column sums, as bits.
#[derive(Clone, Copy, Default)]
struct Split {
    m: usize,
    k: usize,
    n: usize,
    /// A transposed (a weight gradient's), B transposed (an input gradient's).
    at: bool,
    bt: bool,
    /// A in bf16 (its bits).
    a16: bool,
    accumulate: bool,
    bias: bool,
    /// 0: none, 1: GELU, 2: SwiGLU's interleaved order.
    ep: u8,
    sums: bool,
}

impl Split {
    /// Asserts that two runs' results, epilogue outputs and column sums are the same bits,
    /// naming the case and `how` the runs differed.
    fn assert_same(&self, got: &[Vec<u32>], want: &[Vec<u32>], how: &str) {
        let what = format!(
            "{}x{}x{} (at {} bt {} a16 {} acc {} bias {} ep {} sums {}), {how}",
            self.m,
            self.k,
            self.n,
            self.at,
            self.bt,
            self.a16,
            self.accumulate,
            self.bias,
            self.ep,
            self.sums
        );
        for (x, name) in got.iter().zip(want).zip(["c", "epilogue", "sums"]) {
            assert!(x.0 == x.1, "{name} of {what}");
        }
    }

    /// With `threads` 0 (fp32 only): `sgemm` called directly, strip by strip.
    fn run(&self, dtype: DType, threads: usize) -> Vec<Vec<u32>> {
        let (m, k, n) = (self.m, self.k, self.n);
        let a = rand_vec(m * k, 1);
        let a16: Vec<u16> = a.iter().map(|&v| crate::cpu::bf16::bf16_bits(v)).collect();
        let b = rand_vec(k * n, 2);
        let bias = rand_vec(n, 3);
        let mut c = if self.accumulate {
            rand_vec(m * n, 4)
        } else {
            vec![f32::NAN; m * n]
        };
        let mut out = vec![0.0f32; m * n];
        let mut sums = rand_vec(n, 5);
        let am = match (self.a16, self.at) {
            (true, false) => Mat::rm_bf16(a16.as_ptr(), k),
            (true, true) => Mat::rm_bf16(a16.as_ptr(), m).t(),
            (false, false) => Mat::rm(a.as_ptr(), k),
            (false, true) => Mat::rm(a.as_ptr(), m).t(),
        };
        let bm = if self.bt {
            Mat::rm(b.as_ptr(), k).t()
        } else {
            Mat::rm(b.as_ptr(), n)
        };
        let ep = match self.ep {
            0 => Epilogue::None,
            1 => Epilogue::Gelu {
                out: SendPtr(out.as_mut_ptr()),
                rs: n,
            },
            _ => Epilogue::SwiGlu {
                out: SendPtr(out.as_mut_ptr()),
                rs: n / 2,
                half: n / 2,
            },
        };
        let sums_ptr = self.sums.then_some(SendPtr(sums.as_mut_ptr()));
        let cm = Mat::rm(c.as_mut_ptr(), n);
        let bias = self.bias.then_some(&bias[..]);
        #[cfg(target_arch = "x86_64")]
        if threads == 0 {
            // sgemm itself, B packed again for each strip of A's rows (fp32, AVX-512 only)
            let bias = bias.map(|b| b.as_ptr());
            // SAFETY: as below; AVX-512 is the caller's check.
            unsafe {
                if let Some(s) = sums_ptr {
                    add_column_sums(s.get(), bm, k, n);
                }
                sgemm(
                    m,
                    k,
                    n,
                    am.strided(0, 0),
                    bm.strided(0, 0),
                    cm.at(0, 0),
                    n,
                    self.accumulate,
                    bias,
                    ep,
                );
            }
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect();
            return vec![bits(&c), bits(&out), bits(&sums)];
        }
        within_pool(threads, || {
            // SAFETY: the descriptors cover the buffers above; c, out and sums are distinct.
            unsafe {
                gemm_on(
                    threads,
                    dtype,
                    m,
                    k,
                    n,
                    am,
                    bm,
                    cm,
                    self.accumulate,
                    bias,
                    ep,
                    sums_ptr,
                )
            }
        });
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect();
        vec![bits(&c), bits(&out), bits(&sums)]
    }
}

/// Products split over 2 and 3 threads, by rows and by columns (under bf16, the operand every
/// part reads packed once for all of them), give the bits of one thread: odd sizes, K whole
/// and split, A's rows in more than one shared chunk, transposed operands, a bias,
/// accumulating, epilogues, B's column sums, a left operand in bf16, SwiGLU's order.
#[test]
fn split_products_have_the_bits_of_one_thread() {
    let bf16 = crate::cpu::bf16_supported();
    if !bf16 {
        eprintln!("bf16 products not tested: this CPU has no bf16 product");
    }
    let base = Split::default();
    let cases = [
        // by rows, K whole, bias and GELU; and by columns
        Split {
            m: 301,
            k: 77,
            n: 45,
            bias: true,
            ep: 1,
            ..base
        },
        Split {
            m: 45,
            k: 77,
            n: 301,
            bias: true,
            ep: 1,
            ..base
        },
        // K split (three blocks), an input gradient's transposed B, accumulating
        Split {
            m: 203,
            k: 1100,
            n: 70,
            bt: true,
            accumulate: true,
            ..base
        },
        Split {
            m: 70,
            k: 1100,
            n: 203,
            at: true,
            accumulate: true,
            sums: true,
            ..base
        },
        // a weight gradient by rows and by columns, with B's sums; the second's A in chunks
        Split {
            m: 300,
            k: 130,
            n: 61,
            at: true,
            accumulate: true,
            sums: true,
            ..base
        },
        Split {
            m: 500,
            k: 60,
            n: 530,
            at: true,
            accumulate: true,
            sums: true,
            ..base
        },
        // SwiGLU's interleaved columns, by rows and by columns
        Split {
            m: 300,
            k: 64,
            n: 96,
            ep: 2,
            ..base
        },
        Split {
            m: 40,
            k: 64,
            n: 320,
            ep: 2,
            ..base
        },
    ];
    let a16_cases = [
        Split {
            m: 301,
            k: 77,
            n: 45,
            a16: true,
            bias: true,
            ..base
        },
        Split {
            m: 45,
            k: 1100,
            n: 301,
            a16: true,
            at: true,
            sums: true,
            accumulate: true,
            ..base
        },
    ];
    let mut runs: Vec<(&Split, DType)> = cases.iter().map(|s| (s, DType::F32)).collect();
    if bf16 {
        runs.extend(cases.iter().chain(&a16_cases).map(|s| (s, DType::Bf16)));
    }
    for (s, dtype) in runs {
        let one = s.run(dtype, 1);
        for threads in [2, 3] {
            let got = s.run(dtype, threads);
            s.assert_same(
                &got,
                &one,
                &format!("{dtype:?}, {threads} threads against one"),
            );
        }
    }
}

/// One thread's fp32 product packs B once per K block for all of A's strips of rows (the shared
/// product with one part): the bits of `sgemm` packing it again for each strip. Several strips
/// by rows, K whole and split, transposed operands (B transposed past the rows it packs once
/// for), a bias, accumulating, epilogues, B's column sums, SwiGLU's order.
#[cfg(target_arch = "x86_64")]
#[test]
fn one_thread_fp32_products_have_the_bits_of_strip_by_strip() {
    if simd_level() != SimdLevel::Avx512 {
        eprintln!("skipped: this CPU has no AVX-512");
        return;
    }
    let base = Split::default();
    let cases = [
        Split {
            m: 601,
            k: 77,
            n: 45,
            bias: true,
            ep: 1,
            ..base
        },
        Split {
            m: 500,
            k: 1100,
            n: 70,
            accumulate: true,
            ..base
        },
        Split {
            m: 1100,
            k: 300,
            n: 70,
            bt: true,
            accumulate: true,
            ..base
        },
        Split {
            m: 1100,
            k: 1030,
            n: 40,
            bt: true,
            bias: true,
            ..base
        },
        Split {
            m: 500,
            k: 60,
            n: 530,
            at: true,
            accumulate: true,
            sums: true,
            ..base
        },
        Split {
            m: 300,
            k: 64,
            n: 96,
            ep: 2,
            ..base
        },
    ];
    for s in cases {
        let (want, got) = (s.run(DType::F32, 0), s.run(DType::F32, 1));
        s.assert_same(&got, &want, "packed once against strip by strip");
    }
}

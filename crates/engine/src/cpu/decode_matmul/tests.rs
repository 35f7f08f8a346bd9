//! The decode products against f64 references of what they round, with sizes that leave tails
//! (C not a multiple of 32, OC not a multiple of the tile), and their paths against each other.

use super::*;
use crate::cpu::testing::{rand_vec, within_pool};

/// (N, C, OC) with tails on every side (and more output rows than one run of a build).
const SHAPES: [(usize, usize, usize); 7] = [
    (2, 40, 150),
    (1, 1, 1),
    (1, 31, 5),
    (3, 33, 7),
    (2, 70, 13),
    (5, 100, 9),
    (1, 576, 17),
];

fn run(w: &DecodeMatrix, x: &[f32], bias: Option<&[f32]>, n: usize, threads: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; n * w.out_features()];
    within_pool(threads, || decode_matmul_forward(&mut out, x, w, bias, n));
    out
}

/// Σ_k x[m, k] · w[k, o] in f64 of the values `xv` and `wv` give (input-major w).
fn reference(
    x: &[f32],
    w: &[f32],
    (n, c, oc): (usize, usize, usize),
    xv: impl Fn(usize, usize) -> f64,
    wv: impl Fn(usize, usize) -> f64,
) -> Vec<f64> {
    let _ = (x, w);
    let mut out = vec![0f64; n * oc];
    for m in 0..n {
        for o in 0..oc {
            out[m * oc + o] = (0..c).map(|k| xv(m, k) * wv(k, o)).sum();
        }
    }
    out
}

fn assert_near(got: &[f32], want: &[f64], tol: f64, what: &str) {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

#[test]
fn bf16_sums_the_rounded_operands() {
    for (s, &(n, c, oc)) in SHAPES.iter().enumerate() {
        let (x, w) = (rand_vec(n * c, s as u64), rand_vec(c * oc, 100 + s as u64));
        let bias = rand_vec(oc, 200 + s as u64);
        let dm = DecodeMatrix::from_input_major(&w, c, oc, DecodeFormat::Bf16);
        let r = |v: f32| bf16_to_f32(bf16_bits(v)) as f64;
        let mut want = reference(
            &x,
            &w,
            (n, c, oc),
            |m, k| r(x[m * c + k]),
            |k, o| r(w[k * oc + o]),
        );
        for (i, v) in want.iter_mut().enumerate() {
            *v += bias[i % oc] as f64;
        }
        let got = run(&dm, &x, Some(&bias), n, 2);
        assert_near(&got, &want, 1e-5, &format!("bf16 {n}x{c}x{oc}"));
        // against the exact f32 product: bf16's 8 bits of mantissa
        let exact = reference(
            &x,
            &w,
            (n, c, oc),
            |m, k| x[m * c + k] as f64,
            |k, o| w[k * oc + o] as f64,
        );
        let exact: Vec<f64> = exact
            .iter()
            .enumerate()
            .map(|(i, v)| v + bias[i % oc] as f64)
            .collect();
        assert_near(
            &got,
            &exact,
            2e-2 * (c as f64).sqrt(),
            &format!("bf16 vs f32 {n}x{c}x{oc}"),
        );
        // the portable path agrees with whichever ran to rounding
        let mut portable = vec![f32::NAN; n * oc];
        if let Data::Bf16 { buf, at } = &dm.data {
            let bits = &buf[*at..];
            bf16_portable_part(
                SendPtr(portable.as_mut_ptr()),
                &x,
                bits,
                &dm,
                Some(&bias),
                n,
                0..oc,
            );
        }
        assert_near(
            &portable,
            &want,
            1e-5,
            &format!("bf16 portable {n}x{c}x{oc}"),
        );
    }
}

#[test]
fn q8_sums_the_quantised_operands_and_every_path_agrees() {
    for (s, &(n, c, oc)) in SHAPES.iter().enumerate() {
        let (x, w) = (
            rand_vec(n * c, 300 + s as u64),
            rand_vec(c * oc, 400 + s as u64),
        );
        let dm = DecodeMatrix::from_input_major(&w, c, oc, DecodeFormat::Q8);
        let Data::Q8 { qs, scales } = &dm.data else {
            unreachable!()
        };
        let (cp, blocks) = (dm.cp, dm.cp / BLOCK);
        // the input quantised as the kernel does
        let (mut xq, mut xd) = (vec![0i8; n * cp], vec![0f32; n * blocks]);
        for m in 0..n {
            quantize_row(
                &mut xq[m * cp..(m + 1) * cp],
                &mut xd[m * blocks..],
                &x[m * c..(m + 1) * c],
            );
        }
        let deq_x = |m: usize, k: usize| xq[m * cp + k] as f64 * xd[m * blocks + k / BLOCK] as f64;
        let deq_w =
            |k: usize, o: usize| qs[o * cp + k] as f64 * scales[o * blocks + k / BLOCK] as f64;
        let want = reference(&x, &w, (n, c, oc), deq_x, deq_w);
        let got = run(&dm, &x, None, n, 2);
        assert_near(&got, &want, 1e-5, &format!("q8 {n}x{c}x{oc}"));
        let exact = reference(
            &x,
            &w,
            (n, c, oc),
            |m, k| x[m * c + k] as f64,
            |k, o| w[k * oc + o] as f64,
        );
        assert_near(
            &got,
            &exact,
            2e-2 * (c as f64).sqrt(),
            &format!("q8 vs f32 {n}x{c}x{oc}"),
        );
        // plain code, AVX2 and VNNI: the same bits
        let (xr, wr) = (
            Q8Rows {
                qs: &xq,
                scales: &xd,
            },
            Q8Rows { qs, scales },
        );
        let mut portable = vec![f32::NAN; n * oc];
        q8_portable_part(SendPtr(portable.as_mut_ptr()), xr, wr, &dm, None, n, 0..oc);
        assert_eq!(
            bits_of(&portable),
            bits_of(&got),
            "q8 portable {n}x{c}x{oc}"
        );
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            let mut avx2 = vec![f32::NAN; n * oc];
            // SAFETY: AVX2 and FMA detected; this call owns every column.
            unsafe { q8_x86::part_avx2(SendPtr(avx2.as_mut_ptr()), xr, wr, &dm, None, n, 0..oc) };
            assert_eq!(bits_of(&avx2), bits_of(&got), "q8 avx2 {n}x{c}x{oc}");
        }
    }
}

fn bits_of(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn a_row_gets_the_same_bits_alone_in_a_batch_and_on_any_threads() {
    let (n, c, oc) = (6, 77, 45);
    let (x, w) = (rand_vec(n * c, 7), rand_vec(c * oc, 8));
    for format in [DecodeFormat::Bf16, DecodeFormat::Q8] {
        let dm = DecodeMatrix::from_output_major(&w, oc, c, format);
        let batch = run(&dm, &x, None, n, 2);
        assert_eq!(
            bits_of(&batch),
            bits_of(&run(&dm, &x, None, n, 1)),
            "{format:?} threads"
        );
        for m in 0..n {
            let alone = run(&dm, &x[m * c..(m + 1) * c], None, 1, 3);
            assert_eq!(
                bits_of(&alone),
                bits_of(&batch[m * oc..(m + 1) * oc]),
                "{format:?} row {m}"
            );
        }
    }
}

#[test]
fn quantising_zeros_and_sizes() {
    let mut q = [1i8; 64];
    let mut d = [1f32; 2];
    quantize_row(&mut q, &mut d, &[0.0; 40]);
    assert_eq!((q, d), ([0i8; 64], [0.0; 2]));
    quantize_row(&mut q, &mut d, &[-2.0, 1.0]);
    assert_eq!((q[0], q[1], d[0]), (-127, 64, 2.0 / 127.0));
    let m = DecodeMatrix::from_output_major(&rand_vec(3 * 40, 1), 3, 40, DecodeFormat::Q8);
    assert_eq!(
        (m.bytes(), m.in_features(), m.out_features()),
        (3 * 64 + 3 * 2 * 4, 40, 3)
    );
    let b = DecodeMatrix::from_output_major(&rand_vec(3 * 40, 1), 3, 40, DecodeFormat::Bf16);
    assert_eq!(b.bytes(), 3 * 64 * 2);
}

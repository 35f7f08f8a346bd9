use super::*;
use crate::cpu::bf16::bf16_bits;
use crate::cpu::testing::rand_vec;

fn round(x: f32) -> f64 {
    f32::from_bits((bf16_bits(x) as u32) << 16) as f64
}

/// The product of the bf16-rounded operands, summed in f64.
fn reference(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for p in 0..k {
            let x = round(a[i * k + p]);
            for j in 0..n {
                c[i * n + j] += x * round(b[p * n + j]);
            }
        }
    }
    c
}

fn transpose(x: &[f32], r: usize, c: usize) -> Vec<f32> {
    (0..r * c).map(|i| x[(i % r) * c + i / r]).collect()
}

/// Every layout (plain, transposed and general strides for each operand), odd and even K,
/// edges on every block boundary: the result is the exact product of the rounded inputs
/// up to f32 summation error.
#[test]
fn matches_the_product_of_rounded_inputs() {
    if !avx512_bf16() {
        eprintln!("skipped: this CPU has no AVX512_BF16");
        return;
    }
    let mut kernels = vec![Kernel::Avx512];
    if amx_granted() {
        kernels.push(Kernel::Amx);
    } else {
        eprintln!("AMX kernel not tested: this CPU or OS has no AMX");
    }
    for kernel in kernels {
        products_match(kernel);
    }
}

fn products_match(kernel: Kernel) {
    for &(m, k, n) in &[
        (1, 1, 1),
        (5, 3, 7),
        (13, 33, 45),
        (200, 515, 70),
        (37, 1030, 2100),
    ] {
        let a = rand_vec(m * k, 1);
        let b = rand_vec(k * n, 2);
        let bias = rand_vec(n, 3);
        let want = reference(&a, &b, m, k, n);
        let at = transpose(&a, m, k);
        let bt = transpose(&b, k, n);
        let a_layouts = [
            Strided {
                ptr: a.as_ptr(),
                rs: k,
                cs: 1,
            },
            Strided {
                ptr: at.as_ptr(),
                rs: 1,
                cs: m,
            },
        ];
        let b_layouts = [
            Strided {
                ptr: b.as_ptr(),
                rs: n,
                cs: 1,
            },
            Strided {
                ptr: bt.as_ptr(),
                rs: 1,
                cs: k,
            },
        ];
        // A general stride: every other element of a doubled buffer.
        let a2: Vec<f32> = a.iter().flat_map(|&x| [x, 9.0]).collect();
        let b2: Vec<f32> = b.iter().flat_map(|&x| [x, 9.0]).collect();
        let ga = Strided {
            ptr: a2.as_ptr(),
            rs: 2 * k,
            cs: 2,
        };
        let gb = Strided {
            ptr: b2.as_ptr(),
            rs: 2 * n,
            cs: 2,
        };
        let mut cases: Vec<(Strided, Strided)> = Vec::new();
        for &sa in &a_layouts {
            for &sb in &b_layouts {
                cases.push((sa, sb));
            }
        }
        cases.push((ga, gb));
        for (sa, sb) in cases {
            let mut c = vec![f32::NAN; m * n];
            // B's column sums on the side: the bits of adding its rows in order
            let start: Vec<f32> = (0..n).map(|j| j as f32 * 0.25 - 1.0).collect();
            let mut sums = start.clone();
            // SAFETY: the descriptors cover the test's buffers; AVX512_BF16 checked above.
            unsafe {
                bgemm_with(
                    kernel,
                    m,
                    k,
                    n,
                    AOperand::F32(sa),
                    sb,
                    c.as_mut_ptr(),
                    n,
                    false,
                    None,
                    Epilogue::None,
                    n,
                    Some(sums.as_mut_ptr()),
                )
            };
            for (j, (&got, &s0)) in sums.iter().zip(&start).enumerate() {
                // SAFETY: row r, column j of the test's B.
                let want = (0..k).fold(s0, |acc, r| acc + unsafe { *sb.at(r, j) });
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{kernel:?} m{m} k{k} n{n} b({},{}) column {j}: sum {got}, want {want}",
                    sb.rs,
                    sb.cs
                );
            }
            for (i, (&g, &w)) in c.iter().zip(&want).enumerate() {
                assert!(
                    (g as f64 - w).abs() <= 1e-5 * (k as f64).sqrt() * (1.0 + w.abs()),
                    "{kernel:?} m{m} k{k} n{n} a({},{}) b({},{}) [{i}]: got {g}, want {w}",
                    sa.rs,
                    sa.cs,
                    sb.rs,
                    sb.cs
                );
            }
            // Bias, then accumulate on top of it.
            // SAFETY: as above.
            unsafe {
                let c = c.as_mut_ptr();
                bgemm_with(
                    kernel,
                    m,
                    k,
                    n,
                    AOperand::F32(sa),
                    sb,
                    c,
                    n,
                    false,
                    Some(bias.as_ptr()),
                    Epilogue::None,
                    n,
                    None,
                );
                bgemm_with(
                    kernel,
                    m,
                    k,
                    n,
                    AOperand::F32(sa),
                    sb,
                    c,
                    n,
                    true,
                    None,
                    Epilogue::None,
                    n,
                    None,
                );
            }
            for (i, (&g, &w)) in c.iter().zip(&want).enumerate() {
                let w = 2.0 * w + bias[i % n] as f64;
                assert!(
                    (g as f64 - w).abs() <= 2e-5 * (k as f64).sqrt() * (1.0 + w.abs()),
                    "{kernel:?} accumulate m{m} k{k} n{n} [{i}]: got {g}, want {w}"
                );
            }
        }
    }
}

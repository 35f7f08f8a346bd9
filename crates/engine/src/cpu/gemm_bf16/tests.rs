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

/// The pair of B's rows (2p, 2p + 1) at one column as the packs lay it out: rounded bf16
/// bits, the odd row's in the high half, zero past kc.
fn pair_at(at: impl Fn(usize) -> f32, p: usize, kc: usize) -> u32 {
    let half = |e: usize| if e < kc { bf16_bits(at(e)) as u32 } else { 0 };
    half(2 * p) | (half(2 * p + 1) << 16)
}

/// [`pack::pack_b`] one element at a time: panels of `stride` pairs x NR columns, column j of
/// the block read at B's column `col(j)`.
fn scalar_pack_b(
    b: &[f32],
    (rs, cs): (usize, usize),
    (kc, nc, stride): (usize, usize, usize),
    col: impl Fn(usize) -> usize,
) -> Vec<u32> {
    let mut out = vec![0; nc.div_ceil(NR) * NR * stride];
    for j in 0..nc {
        for p in 0..kc.div_ceil(2) {
            let at = |e: usize| b[e * rs + col(j) * cs];
            out[(j / NR) * NR * stride + p * NR + j % NR] = pair_at(at, p, kc);
        }
    }
    out
}

fn lines(u32s: usize) -> Vec<Line> {
    vec![Line([u32::MAX; 16]); u32s.div_ceil(16)]
}

fn u32s(buf: &[Line], n: usize) -> Vec<u32> {
    buf.iter().flat_map(|l| l.0).take(n).collect()
}

/// Every pack of B (row-major with and without sums, SwiGLU's halves, transposed, general
/// strides; f32 and bf16) holds exactly the scalar packing's bits, at odd K, edge panels and padded strides.
#[test]
fn packs_of_b_hold_the_scalar_packs_bits() {
    if !avx512_bf16() {
        eprintln!("skipped: this CPU has no AVX512_BF16");
        return;
    }
    for &(kc, nc, pad) in &[
        (1usize, 1usize, 0usize),
        (7, 45, 3),
        (64, 96, 0),
        (33, 2048, 16),
        (1024, 70, 0),
    ] {
        let stride = kc.div_ceil(2) + pad;
        let n_b = 2 * nc + 64; // room for the halves' second columns
        let b = rand_vec(3 * kc * n_b, 7);
        for (rs, cs) in [(n_b, 1), (1, kc), (3 * n_b, 2)] {
            let src = if rs == 1 {
                rand_vec(kc * nc, 8)
            } else {
                b.clone()
            };
            let want = scalar_pack_b(&src, (rs, cs), (kc, nc, stride), |j| j);
            let mut sums = rand_vec(nc, 9);
            let mut want_sums = sums.clone();
            for (j, s) in want_sums.iter_mut().enumerate() {
                for r in 0..kc {
                    *s += src[r * rs + j * cs];
                }
            }
            let mut buf = lines(want.len());
            // SAFETY: AVX512_BF16 checked; src holds the block; buf the panels, aligned.
            unsafe {
                let pb = buf.as_mut_ptr() as *mut u32;
                pack::pack_b(
                    pb,
                    src.as_ptr(),
                    rs,
                    cs,
                    kc,
                    nc,
                    stride,
                    Some(sums.as_mut_ptr()),
                );
            }
            assert_eq!(
                u32s(&buf, want.len()),
                want,
                "B {kc}x{nc} strides ({rs}, {cs})"
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let (got, want) = (bits(&sums), bits(&want_sums));
            assert_eq!(got, want, "sums of B {kc}x{nc} strides ({rs}, {cs})");
            // The same B kept in bf16: the same panels, its pairs moved.
            let want = scalar_pack_b(&src, (rs, cs), (kc, nc, stride), |j| j);
            let src16: Vec<u16> = src.iter().map(|&x| bf16_bits(x)).collect();
            let mut buf = lines(want.len());
            // SAFETY: as above, for src16.
            unsafe {
                let pb = buf.as_mut_ptr() as *mut u32;
                pack::pack_b_bf16(pb, src16.as_ptr(), rs, cs, kc, nc, stride);
            }
            let what = format!("bf16 B {kc}x{nc} strides ({rs}, {cs})");
            assert_eq!(u32s(&buf, want.len()), want, "{what}");
        }
        if nc.is_multiple_of(32) {
            let half = nc + 7;
            let col = |j: usize| 16 * (j / 32) + j % 16 + if j % 32 < 16 { 0 } else { half };
            let want = scalar_pack_b(&b, (n_b, 1), (kc, nc, stride), col);
            let mut buf = lines(want.len());
            // SAFETY: as above; the gate and up columns are inside b's rows.
            unsafe {
                let pb = buf.as_mut_ptr() as *mut u32;
                pack::pack_b_halves(pb, b.as_ptr(), n_b, kc, nc, stride, half);
            }
            assert_eq!(u32s(&buf, want.len()), want, "halves of B {kc}x{nc}");
        }
    }
}

/// Every pack of A (row-major, transposed, general strides; f32 and bf16) holds exactly the scalar packing's
/// bits, zero past kc.
#[test]
fn packs_of_a_hold_the_scalar_packs_bits() {
    if !avx512_bf16() {
        eprintln!("skipped: this CPU has no AVX512_BF16");
        return;
    }
    for &(mc, kc, pad) in &[
        (1usize, 1usize, 0usize),
        (5, 7, 3),
        (192, 1024, 0),
        (37, 515, 16),
    ] {
        let stride = kc.div_ceil(2) + pad;
        let a = rand_vec(3 * mc * kc, 11);
        for (rs, cs) in [(kc, 1), (1, mc), (3 * kc, 2)] {
            let mut want = vec![0; mc * stride];
            for i in 0..mc {
                for p in 0..stride {
                    want[i * stride + p] = pair_at(|e| a[i * rs + e * cs], p, kc);
                }
            }
            let mut buf = lines(want.len());
            // SAFETY: AVX512_BF16 checked; a holds the block; buf mc x stride u32.
            unsafe {
                pack::pack_a(
                    buf.as_mut_ptr() as *mut u32,
                    a.as_ptr(),
                    rs,
                    cs,
                    mc,
                    kc,
                    stride,
                )
            };
            assert_eq!(
                u32s(&buf, want.len()),
                want,
                "A {mc}x{kc} strides ({rs}, {cs})"
            );
            // The same A kept in bf16: the same pairs, copied.
            let a16: Vec<u16> = a.iter().map(|&x| bf16_bits(x)).collect();
            let mut buf = lines(want.len());
            // SAFETY: as above, for a16.
            unsafe {
                let pa = buf.as_mut_ptr() as *mut u32;
                pack::pack_a_bf16(pa, a16.as_ptr(), rs, cs, mc, kc, stride);
            }
            let what = format!("bf16 A {mc}x{kc} strides ({rs}, {cs})");
            assert_eq!(u32s(&buf, want.len()), want, "{what}");
        }
    }
}

/// The packs' pairing of two rows (one two-source conversion and a word permute) gives the
/// bits of converting each row on its own and widening them into pairs, the way it was first
/// written, on the values where rounding is delicate: ties to even either way, the largest
/// finite values, infinities, NaNs, signed zeros and subnormals.
#[test]
fn pairing_two_rows_keeps_the_single_conversions_bits() {
    if !avx512_bf16() {
        eprintln!("skipped: this CPU has no AVX512_BF16");
        return;
    }
    let edge = [
        0x3f80_8000u32, // a tie that rounds down to even
        0x3f81_8000,    // a tie that rounds up to even
        0x3f80_7fff,
        0x3f80_8001,
        0x7f7f_ffff, // rounds to infinity
        0xff7f_ffff,
        0x7f80_0000,
        0xff80_0000,
        0x7fc0_0001,
        0xffa0_0000, // a signalling NaN
        0x0000_0000,
        0x8000_0000,
        0x0000_8000, // subnormals
        0x807f_ffff,
        0x0080_0000, // the smallest normal
        0x3eaa_aaab,
    ];
    let mut vals: Vec<f32> = edge.iter().map(|&u| f32::from_bits(u)).collect();
    vals.extend(rand_vec(64, 12));
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    fn both(x: &[f32], y: &[f32]) -> ([u32; 16], [u32; 16]) {
        // SAFETY: x and y hold 16 floats each; the transmutes reinterpret 256- and 512-bit
        // vectors' bits.
        unsafe {
            let (vx, vy) = (_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(y.as_ptr()));
            let (lo, hi) = (
                std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(vx)),
                std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(vy)),
            );
            let old = _mm512_or_si512(
                _mm512_cvtepu16_epi32(lo),
                _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(hi)),
            );
            let new = pack::pair_up(vx, vy);
            let mut out = ([0u32; 16], [0u32; 16]);
            _mm512_storeu_si512(out.0.as_mut_ptr() as *mut __m512i, old);
            _mm512_storeu_si512(out.1.as_mut_ptr() as *mut __m512i, new);
            out
        }
    }
    for x in vals.chunks(16) {
        for y in vals.chunks(16) {
            // SAFETY: AVX512_BF16 checked above.
            let (old, new) = unsafe { both(x, y) };
            assert_eq!(old, new, "pairs of {x:?} and {y:?}");
            for j in 0..16 {
                // and the bits are the scalar rounding's, where the value is not subnormal
                // (the instructions take a subnormal as zero)
                let normal = |v: f32| v == 0.0 || !v.is_subnormal();
                if normal(x[j]) && normal(y[j]) {
                    let want = bf16_bits(x[j]) as u32 | (bf16_bits(y[j]) as u32) << 16;
                    assert_eq!(new[j], want, "pair of {} and {}", x[j], y[j]);
                }
            }
        }
    }
}

//! The fused row passes against the passes they replaced (softmax, dropout, `softmax_back_row`
//! in f32, then `pack_a`), at both kernels' packed strides: zmm's whole pairs and AMX's 16-pair
//! padding, so that AMX's layout is checked on machines without AMX too.

use super::rows::{exp16, grad_pairs, probs_pairs, softmax_pairs, softmax_rows, SoftRow};
use super::*;
use crate::cpu::attention::{probs_in, softmax_back_row, softmax_in};
use crate::cpu::testing::rand_vec;
use std::arch::x86_64::{_mm512_loadu_ps, _mm512_storeu_ps};

/// `rows` rows of `keys` f32 at row stride `keys`, packed as `pack_a` packs them, `kp` pairs a
/// row.
fn packed(x: &[f32], rows: usize, keys: usize, kp: usize) -> Vec<u32> {
    let mut out = vec![u32::MAX; rows * kp];
    // SAFETY: x has rows x keys floats; out rows x kp u32; the test checked AVX512_BF16.
    unsafe { pack_a(out.as_mut_ptr(), x.as_ptr(), keys, 1, rows, keys, kp) };
    out
}

#[test]
fn row_passes_write_what_the_separate_passes_packed() {
    if !std::arch::is_x86_feature_detected!("avx512bf16") {
        eprintln!("skipped: this CPU has no AVX512_BF16");
        return;
    }
    let scale = 0.125;
    // Keys past 32 and 64 (AMX pads those to 16 and 32 pairs), odd counts, the first key
    // masked, queries whose segment starts late or that see no key at all.
    for keys in [1usize, 7, 32, 33, 64, 77, 130] {
        let mut mf = vec![1.0f32; keys];
        mf[0] = 0.0;
        let scores: Vec<f32> = rand_vec(keys * keys, 3).iter().map(|x| x * 6.0).collect();
        let dpd = rand_vec(keys * keys, 4);
        for tiles in [Tiles::Zmm, Tiles::Amx] {
            let kp = tiles.pairs(keys);
            for drop in [None, Some(Dropout { p: 0.25, key: 5 })] {
                // row tq sees keys lo..=tq: its segment starts at tq / 3
                let lo = |tq: usize| tq / 3;
                let (mut want, mut got) = (scores.clone(), scores.clone());
                let (mut got_pa, mut lse) = (vec![u32::MAX; keys * kp], vec![0.0; keys]);
                for tq in 0..keys {
                    let off = (tq * keys) as u64;
                    let row = &mut want[tq * keys..(tq + 1) * keys];
                    lse[tq] = softmax_in(row, &mf, tq, lo(tq), scale);
                    if let Some(d) = drop {
                        d.apply(&mut row[..=tq], off);
                    }
                    let row = &mut got[tq * keys..(tq + 1) * keys];
                    let to = (got_pa[tq * kp..].as_mut_ptr(), kp);
                    // SAFETY: `to` has kp u32; AVX512_BF16 is present.
                    let l = unsafe {
                        softmax_pairs(row, &mf, (tq, lo(tq)), scale, drop.map(|d| (d, off)), to)
                    };
                    assert_eq!(l.to_bits(), lse[tq].to_bits(), "keys {keys} tq {tq}: lse");
                }
                let what = format!("{tiles:?}, keys {keys}, dropout {}", drop.is_some());
                assert_eq!(
                    got_pa,
                    packed(&want, keys, keys, kp),
                    "{what}: forward pairs"
                );

                // backward, from the same scores and lse (one query sees nothing)
                lse[keys / 2] = f32::NEG_INFINITY;
                let (mut p, mut dp, mut pd) = (scores.clone(), dpd.clone(), vec![0.0; keys * keys]);
                for tq in 0..keys {
                    let at = tq * keys..(tq + 1) * keys;
                    probs_in(&mut p[at.clone()], &mf, tq, lo(tq), lse[tq], scale);
                    dp[tq * keys + tq + 1..(tq + 1) * keys].fill(0.0);
                    pd[at.clone()].copy_from_slice(&p[at.clone()]);
                    if let Some(d) = drop {
                        let off = (tq * keys) as u64;
                        d.apply(&mut pd[at.clone()], off);
                        d.apply(&mut dp[tq * keys..tq * keys + tq + 1], off);
                    }
                }
                let used = if drop.is_some() { &pd } else { &p };
                let want_used = packed(used, keys, keys, kp);
                for tq in 0..keys {
                    let vis = tq * keys..tq * keys + tq + 1;
                    softmax_back_row(&mut dp[vis.clone()], &p[vis], scale);
                }
                let want_ds = packed(&dp, keys, keys, kp);
                let (mut gp, mut gdp, mut gpd) =
                    (scores.clone(), dpd.clone(), vec![0.0; keys * keys]);
                let (mut got_used, mut got_ds) =
                    (vec![u32::MAX; keys * kp], vec![u32::MAX; keys * kp]);
                for tq in 0..keys {
                    let at = tq * keys..(tq + 1) * keys;
                    let (pr, dpr) = (&mut gp[at.clone()], &mut gdp[at.clone()]);
                    let dr = drop.map(|d| (d, (tq * keys) as u64, &mut gpd[at]));
                    let used = Some((got_used[tq * kp..].as_mut_ptr(), kp));
                    let ds = (got_ds[tq * kp..].as_mut_ptr(), kp);
                    // SAFETY: as above.
                    unsafe {
                        let l = (lse[tq], scale);
                        let dsum = probs_pairs(pr, dpr, &mf, (tq, lo(tq)), l, dr, used);
                        grad_pairs(pr, dpr, tq, dsum, scale, ds);
                    }
                }
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&gp), bits(&p), "{what}: probabilities");
                if drop.is_some() {
                    assert_eq!(bits(&gpd), bits(&pd), "{what}: dropped probabilities");
                }
                assert_eq!(bits(&gdp), bits(&dp), "{what}: dS");
                assert_eq!(got_used, want_used, "{what}: used pairs");
                assert_eq!(got_ds, want_ds, "{what}: dS pairs");
            }
        }
    }
}

/// Rows taken through the forward's passes together (as the fused heads take them) get the
/// bits each gets alone: rows of different lengths and segment starts, one that sees no key,
/// with and without dropout.
#[test]
fn rows_together_give_each_rows_bits_alone() {
    if !std::arch::is_x86_feature_detected!("avx512bf16") {
        eprintln!("skipped: this CPU has no AVX512_BF16");
        return;
    }
    let (keys, kp, scale) = (70usize, 35usize, 0.125);
    let mut mf = vec![1.0f32; keys];
    mf[..3].fill(0.0);
    let scores: Vec<f32> = rand_vec(4 * keys, 8).iter().map(|x| x * 6.0).collect();
    // (tq, lo): a long row, a short one, one seeing only masked keys, one in a late segment
    let at = [(69usize, 0usize), (20, 0), (2, 0), (50, 33)];
    for drop in [None, Some(Dropout { p: 0.25, key: 9 })] {
        let off = |r: usize| (r * keys * 11) as u64;
        let (mut alone, mut want_pa, mut want_lse) = (scores.clone(), vec![0u32; 4 * kp], [0.0; 4]);
        for (r, &(tq, lo)) in at.iter().enumerate() {
            let row = &mut alone[r * keys..(r + 1) * keys];
            let to = (want_pa[r * kp..].as_mut_ptr(), kp);
            let d = drop.map(|d| (d, off(r)));
            // SAFETY: `to` has kp u32; AVX512_BF16 is present.
            want_lse[r] = unsafe { softmax_pairs(row, &mf, (tq, lo), scale, d, to) };
        }
        let (mut together, mut got_pa) = (scores.clone(), vec![0u32; 4 * kp]);
        let mut rows = together
            .chunks_mut(keys)
            .zip(got_pa.chunks_mut(kp))
            .enumerate();
        let four = std::array::from_fn(|_| {
            let (r, (row, to)) = rows.next().expect("four rows");
            let (tq, lo) = at[r];
            let drop = drop.map(|d| (d, off(r)));
            let to = (to.as_mut_ptr(), kp);
            SoftRow {
                row,
                tq,
                lo,
                drop,
                to,
            }
        });
        // SAFETY: each `to` has kp u32; AVX512_BF16 is present.
        let got_lse = unsafe { softmax_rows::<4>(four, &mf, scale) };
        assert_eq!(got_lse.map(f32::to_bits), want_lse.map(f32::to_bits), "lse");
        assert_eq!(got_pa, want_pa, "dropout {}: pairs", drop.is_some());
    }
}

/// The 16-lane exp gives the scalar one's bits everywhere: both clamps, NaN and infinities,
/// subnormal results, and a sweep of the range softmax uses.
#[test]
fn exp16_gives_the_scalar_exps_bits() {
    if !std::arch::is_x86_feature_detected!("avx512bf16") {
        eprintln!("skipped: this CPU has no AVX512_BF16");
        return;
    }
    let mut xs: Vec<f32> = (-9000..9000).map(|i| i as f32 * 0.0101).collect();
    xs.extend([
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.0,
        0.0,
        1e-40,
        -87.0,
        88.0,
    ]);
    xs.extend([
        -86.9999,
        88.0001,
        -1e30,
        1e30,
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
    ]);
    xs.resize(xs.len().div_ceil(16) * 16, 0.5);
    for ch in xs.chunks(16) {
        let mut got = [0f32; 16];
        // SAFETY: 16 floats in, 16 out; AVX512_BF16 (and so AVX-512F) is present.
        unsafe { _mm512_storeu_ps(got.as_mut_ptr(), exp16(_mm512_loadu_ps(ch.as_ptr()))) };
        for (x, g) in ch.iter().zip(got) {
            let want = crate::cpu::math::exp(*x);
            assert_eq!(g.to_bits(), want.to_bits(), "exp({x}): {g} against {want}");
        }
    }
}

use super::*;
use crate::cpu::bf16::bf16_bits_as_packed;
use crate::cpu::testing::{assert_close, check_grad, f64s, rand_vec, within_pool};

/// f64 reference: plain softmax attention per head, dropout mask from the same keys; with
/// `segs`, a query sees only the keys of its own run of equal ids.
pub(super) fn reference(
    qkv: &[f64],
    mask: &[u8],
    segs: Option<&[u32]>,
    d: AttnDims,
    drop: Option<Dropout>,
) -> Vec<f64> {
    let AttnDims { b, t, c, nh } = d;
    let hd = c / nh;
    let mut out = vec![0.0; b * t * c];
    for bi in 0..b {
        for h in 0..nh {
            let bh = bi * nh + h;
            for tq in 0..t {
                let qv =
                    |i: usize, o: usize| qkv[(bi * t + i) * 3 * c + o + h * hd..][..hd].to_vec();
                let q = qv(tq, 0);
                let same = |j: usize| {
                    segs.is_none_or(|s| (j..=tq).all(|i| s[bi * t + i] == s[bi * t + tq]))
                };
                let vis: Vec<usize> = (0..=tq)
                    .filter(|&j| mask[bi * t + j] != 0 && same(j))
                    .collect();
                if vis.is_empty() {
                    continue;
                }
                let sc: Vec<f64> = vis
                    .iter()
                    .map(|&j| {
                        q.iter().zip(qv(j, c)).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = sc.iter().map(|s| (s - m).exp()).sum();
                for (&j, s) in vis.iter().zip(&sc) {
                    let mut pr = (s - m).exp() / z;
                    if let Some(dr) = drop {
                        pr = if dr.keep(((bh * t + tq) * t + j) as u64) {
                            pr / (1.0 - dr.p as f64)
                        } else {
                            0.0
                        };
                    }
                    let vv = qv(j, 2 * c);
                    for e in 0..hd {
                        out[(bi * t + tq) * c + h * hd + e] += pr * vv[e];
                    }
                }
            }
        }
    }
    out
}

#[test]
fn attention_matches_f64_and_finite_differences() {
    // t = 70 spans two query blocks; batch 1 is left-padded, batch 0 has a hole; then the
    // same with segments: row 0 packs sequences of 30, 1, 25 and 14 positions (the last
    // crosses a query block), row 1 two sequences, the same id coming back after another
    // (a new run, a new sequence).
    let dims = AttnDims {
        b: 2,
        t: 70,
        c: 12,
        nh: 2,
    };
    let AttnDims { b, t, c, nh } = dims;
    let mut mask = vec![1u8; b * t];
    mask[5] = 0;
    mask[9] = 0;
    for m in &mut mask[t..t + 3] {
        *m = 0;
    }
    let qkv: Vec<f32> = rand_vec(b * t * 3 * c, 1).iter().map(|x| x * 2.0).collect();
    let dout = rand_vec(b * t * c, 2);
    let mut packed = vec![0u32; b * t];
    for (i, s) in packed[..t].iter_mut().enumerate() {
        *s = match i {
            0..30 => 4,
            30 => 5,
            31..56 => 6,
            _ => 7,
        };
    }
    for (i, s) in packed[t..].iter_mut().enumerate() {
        *s = if (40..60).contains(&i) { 1 } else { 0 };
    }
    let drop = Some(Dropout { p: 0.2, key: 7 });
    for (drop, threads, segs) in [
        (None, 1, None),
        (None, 2, None),
        (drop, 2, None),
        (None, 2, Some(packed.clone())),
        (drop, 1, Some(packed.clone())),
    ] {
        let mut out = vec![0.0; b * t * c];
        let mut again = vec![0.0; b * t * c];
        let mut lse = vec![0.0; b * nh * t];
        let mut dqkv = vec![f32::NAN; b * t * 3 * c];
        let mut scratch = vec![0.0; attention_scratch_len(t, threads)];
        within_pool(threads, || {
            attention_forward(
                DType::F32,
                &mut out,
                &mut lse,
                &qkv,
                Some(&mask),
                segs.as_deref(),
                dims,
                drop,
                &mut scratch,
            );
            attention_backward(
                DType::F32,
                &mut dqkv,
                Some(&mut again),
                &dout,
                &qkv,
                &lse,
                Some(&mask),
                segs.as_deref(),
                dims,
                drop,
                &mut scratch,
            );
        });
        let f = |x: &[f64]| reference(x, &mask, segs.as_deref(), dims, drop);
        assert_close(&out, &f(&f64s(&qkv)), 1e-5, "out");
        assert_close(&again, &f(&f64s(&qkv)), 1e-5, "recomputed out");
        check_grad("dqkv", &dqkv, 0.0, &f64s(&qkv), &dout, f);
    }
}

/// Fused heads (`attention_fused`, on this CPU's bf16 kernel) against the general bf16 path:
/// the same bits on the zmm kernel; on AMX, dK and dV within f32 rounding (they sum over
/// strips of 32 queries instead of blocks of 64). On each path, a qkv kept in bf16 (the
/// `attention_*_bf16_qkv` kernels) gives every result of the f32 qkv its bits round from.
#[cfg(target_arch = "x86_64")]
#[test]
fn fused_heads_give_the_general_products_results() {
    let Some(tiles) = fused_tiles() else {
        eprintln!("skipped: this CPU has no bf16 kernel to fuse heads on");
        return;
    };
    // T not a multiple of a strip (and one past 1024, where the products over keys split K),
    // left padding, dropout, a recomputed output, head sizes 16, 32 and 64, grouped and
    // single key/value heads, segments
    for (t, c, nh, nkv) in [
        (70usize, 32usize, 2usize, 2usize),
        (45, 128, 2, 1),
        (45, 64, 4, 2),
        (130, 96, 3, 3),
        (200, 128, 4, 1),
        (256, 64, 2, 2),
        (1100, 16, 1, 1),
    ] {
        let dims = AttnDims { b: 2, t, c, nh };
        let (b, w) = (dims.b, (nh + 2 * nkv) * (c / nh));
        let qkv = rand_vec(b * t * w, 5);
        let dout = rand_vec(b * t * c, 6);
        let mut mask = vec![1u8; b * t];
        mask[t..t + 3].fill(0);
        let drop = (t != 256).then_some(Dropout { p: 0.1, key: 77 });
        // three shapes pack several sequences per row (segment ids)
        let segs: Vec<u32> = (0..b * t).map(|i| ((i % t) / 17) as u32).collect();
        let segs = (t == 45 || t == 200).then_some(&segs[..]);
        // The same values kept in bf16, as the qkv product writes them under bf16 products;
        // at t = 70 two bytes off a 4-byte boundary, where Q's pairs are copied, not read in
        // place
        let off = usize::from(t == 70);
        let mut store = vec![0u16; off];
        store.extend(qkv.iter().map(|&x| bf16_bits_as_packed(x)));
        let qkv16 = &store[off..];
        let run = |fused: bool, bf16: bool| {
            let (mut out, mut lse) = (vec![0.0; b * t * c], vec![0.0; b * nh * t]);
            // dqkv and the output are overwritten, whatever they held
            let (mut dqkv, mut again) = (vec![f32::NAN; b * t * w], vec![f32::NAN; b * t * c]);
            let mut scratch = vec![0.0; attention_scratch_len(t, 2)];
            let mut passes = |qkv: Qkv| {
                let m = Some(&mask[..]);
                forward_with(
                    fused,
                    DType::Bf16,
                    &mut out,
                    &mut lse,
                    qkv,
                    m,
                    segs,
                    (dims, nkv),
                    drop,
                    &mut scratch,
                );
                // once with the output recomputed, once without (what training does)
                let mut again2 = vec![f32::NAN; b * t * w];
                backward_with(
                    fused,
                    DType::Bf16,
                    &mut again2,
                    None,
                    &dout,
                    qkv,
                    &lse,
                    m,
                    segs,
                    (dims, nkv),
                    drop,
                    &mut scratch,
                );
                backward_with(
                    fused,
                    DType::Bf16,
                    &mut dqkv,
                    Some(&mut again),
                    &dout,
                    qkv,
                    &lse,
                    m,
                    segs,
                    (dims, nkv),
                    drop,
                    &mut scratch,
                );
                assert!(again2
                    .iter()
                    .zip(&dqkv)
                    .all(|(x, y)| x.to_bits() == y.to_bits()));
            };
            within_pool(2, || {
                if bf16 {
                    // bf16 bits to fused heads, widened to f32 for the general ones
                    qkv16::with_qkv(fused, DType::Bf16, qkv16, passes)
                } else {
                    passes(Qkv::F32(&qkv))
                }
            });
            (out, lse, dqkv, again)
        };
        let (fused, general) = (run(true, false), run(false, false));
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        // A qkv kept in bf16 gives every result the f32 qkv gives, bit for bit, on either path
        for (f, want) in [(true, &fused), (false, &general)] {
            let got = run(f, true);
            let what = if f { "fused" } else { "general" };
            assert_eq!(
                bits(&got.0),
                bits(&want.0),
                "t {t} c {c}: bf16 qkv, {what} out"
            );
            assert_eq!(
                bits(&got.1),
                bits(&want.1),
                "t {t} c {c}: bf16 qkv, {what} lse"
            );
            assert_eq!(
                bits(&got.2),
                bits(&want.2),
                "t {t} c {c}: bf16 qkv, {what} dqkv"
            );
            let again = (bits(&got.3), bits(&want.3));
            assert_eq!(
                again.0, again.1,
                "t {t} c {c}: bf16 qkv, {what} recomputed out"
            );
        }
        // the same products, the same pairs in the same order: the same bits
        assert_eq!(bits(&fused.0), bits(&general.0), "t {t} c {c}: out");
        assert_eq!(bits(&fused.1), bits(&general.1), "t {t} c {c}: lse");
        assert_eq!(
            bits(&fused.3),
            bits(&general.3),
            "t {t} c {c}: recomputed out"
        );
        let scale = general.2.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (i, (a, g)) in fused.2.iter().zip(&general.2).enumerate() {
            let (row, col) = (i / w, i % w);
            if col < c || tiles == crate::cpu::attention_fused::Tiles::Zmm {
                assert_eq!(a.to_bits(), g.to_bits(), "t {t} c {c}: dqkv[{row}][{col}]");
            } else {
                assert!(
                    (a - g).abs() <= 1e-5 * scale,
                    "t {t} c {c}: dqkv[{row}][{col}] {a} vs {g}"
                );
            }
        }
        assert!(fused.2.iter().any(|x| *x != 0.0));
        // the queries of the left padding see no key: zero output
        assert!(fused.0[t * c..(t + 3) * c].iter().all(|x| *x == 0.0));
    }
}

#[test]
fn bf16_attention_tracks_the_reference() {
    if !crate::cpu::bf16_supported() {
        eprintln!("skipped: this CPU has neither AMX nor AVX512_BF16");
        return;
    }
    let dims = AttnDims {
        b: 2,
        t: 70,
        c: 32,
        nh: 2,
    };
    let AttnDims { b, t, c, nh } = dims;
    let qkv = rand_vec(b * t * 3 * c, 3);
    let dout = rand_vec(b * t * c, 4);
    // two sequences per row, the second crossing the query block boundary
    let segs: Vec<u32> = (0..b * t).map(|i| (i % t >= 20) as u32).collect();
    let run = |dtype: DType| {
        let mut out = vec![0.0; b * t * c];
        let mut lse = vec![0.0; b * nh * t];
        let mut dqkv = vec![0.0; b * t * 3 * c];
        let mut scratch = vec![0.0; attention_scratch_len(t, 2)];
        within_pool(2, || {
            attention_forward(
                dtype,
                &mut out,
                &mut lse,
                &qkv,
                None,
                Some(&segs),
                dims,
                None,
                &mut scratch,
            );
            attention_backward(
                dtype,
                &mut dqkv,
                None,
                &dout,
                &qkv,
                &lse,
                None,
                Some(&segs),
                dims,
                None,
                &mut scratch,
            );
        });
        (out, dqkv)
    };
    let (out32, d32) = run(DType::F32);
    let (out16, d16) = run(DType::Bf16);
    let mask = vec![1u8; b * t];
    assert_close(
        &out16,
        &reference(&f64s(&qkv), &mask, Some(&segs), dims, None),
        2e-2,
        "bf16 out",
    );
    let scale = d32.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
    let want: Vec<f64> = d32.iter().map(|&x| x as f64).collect();
    assert_close(&d16, &want, 3e-2 * scale.max(1.0), "bf16 dqkv");
    assert_ne!(
        out32, out16,
        "bf16 attention equals f32's: bf16 not in use?"
    );
}

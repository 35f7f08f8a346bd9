//! Tests of the attention kernels on grouped key/value heads (GQA, MQA): against the same
//! heads expanded to GPT-2's layout, and against finite differences of the f64 reference.

use super::tests::reference;
use super::*;
use crate::cpu::testing::{assert_close, check_grad, f64s, rand_vec, within_pool};

/// Grouped rows (B, T, (NH + 2·NKV)·HD) expanded to GPT-2's (B, T, 3C): each key/value
/// head copied to its query group.
fn expand<T: Copy>(x: &[T], d: AttnDims, nkv: usize) -> Vec<T> {
    let (hd, w) = (d.c / d.nh, (d.nh + 2 * nkv) * (d.c / d.nh));
    let mut out = Vec::with_capacity(x.len() / w * 3 * d.c);
    for row in x.chunks_exact(w) {
        out.extend_from_slice(&row[..d.c]);
        for kv in [d.nh, d.nh + nkv] {
            for h in 0..d.nh {
                let at = (kv + h / (d.nh / nkv)) * hd;
                out.extend_from_slice(&row[at..at + hd]);
            }
        }
    }
    out
}

#[test]
fn grouped_heads_match_expanded_heads_and_finite_differences() {
    let dims = AttnDims {
        b: 2,
        t: 70,
        c: 24,
        nh: 6,
    };
    let AttnDims { b, t, c, nh } = dims;
    let mut mask = vec![1u8; b * t];
    mask[t..t + 3].fill(0);
    let dout = rand_vec(b * t * c, 2);
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for (nkv, drop) in [(2, None), (1, Some(Dropout { p: 0.2, key: 9 })), (6, None)] {
        let w = (nh + 2 * nkv) * (c / nh);
        let qkv: Vec<f32> = rand_vec(b * t * w, 1).iter().map(|x| x * 2.0).collect();
        let m = Some(&mask[..]);
        let run = |threads: usize, grouped: bool| {
            let (mut out, mut lse) = (vec![0.0; b * t * c], vec![0.0; b * nh * t]);
            let x = if grouped {
                qkv.clone()
            } else {
                expand(&qkv, dims, nkv)
            };
            let mut dx = vec![f32::NAN; x.len()];
            let mut scratch = vec![0.0; attention_scratch_len(t, threads)];
            let kv = if grouped { nkv } else { nh };
            within_pool(threads, || {
                let d = DType::F32;
                let s = &mut scratch;
                attention_forward_grouped(d, &mut out, &mut lse, &x, m, None, dims, kv, drop, s);
                attention_backward_grouped(
                    d, &mut dx, None, &dout, &x, &lse, m, None, dims, kv, drop, s,
                );
            });
            (out, lse, dx)
        };
        let (g1, g2, e) = (run(1, true), run(2, true), run(2, false));
        assert_eq!(bits(&g1.0), bits(&e.0), "nkv {nkv}: out");
        assert_eq!(bits(&g1.1), bits(&e.1), "nkv {nkv}: lse");
        assert_eq!(bits(&g1.2), bits(&g2.2), "nkv {nkv}: threads change dqkv");
        // dq the same bits; dk, dv the group's sum (in another order than a sum of copies)
        let ex = expand(&g1.2, dims, nkv);
        let scale = e.2.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (i, (&a, &want)) in ex.iter().zip(&e.2).enumerate() {
            if i % (3 * c) < c {
                assert_eq!(a.to_bits(), want.to_bits(), "nkv {nkv}: dq[{i}]");
            }
        }
        let mut summed = vec![0.0f64; qkv.len()];
        for (row, er) in summed.chunks_exact_mut(w).zip(e.2.chunks_exact(3 * c)) {
            for j in 0..c {
                row[j] = er[j] as f64;
            }
            for (half, kv) in [(1, nh), (2, nh + nkv)] {
                for h in 0..nh {
                    let at = (kv + h / (nh / nkv)) * (c / nh);
                    for e in 0..c / nh {
                        row[at + e] += er[half * c + h * (c / nh) + e] as f64;
                    }
                }
            }
        }
        assert_close(&g1.2, &summed, 1e-5 * scale as f64, "dk, dv summed");
        let f = |x: &[f64]| reference(&expand(x, dims, nkv), &mask, None, dims, drop);
        check_grad("grouped dqkv", &g1.2, 0.0, &f64s(&qkv), &dout, f);
    }
}

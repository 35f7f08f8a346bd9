//! Token + position embedding lookup and its scatter-add backward, and the token embedding alone
//! (models whose positions are rotary).
//!
//! Backward splits the embedding width across threads, and each thread walks the tokens in
//! order, so repeated token ids accumulate in the same order whatever the thread count.

use rayon::prelude::*;

use super::simd_fn;

/// out (B, T, C) = wte[ids[b, t]] + wpe[t]. Ids must be `< V` (the model checks them).
pub fn encoder_forward(
    out: &mut [f32],
    ids: &[u32],
    wte: &[f32],
    wpe: &[f32],
    b: usize,
    t: usize,
    c: usize,
) {
    let (out, ids) = (&mut out[..b * t * c], &ids[..b * t]);
    out.par_chunks_mut(t * c)
        .zip(ids.par_chunks(t))
        .for_each(|(o, ids)| {
            for (pos, (o, &id)) in o.chunks_exact_mut(c).zip(ids).enumerate() {
                let te = &wte[id as usize * c..(id as usize + 1) * c];
                let pe = &wpe[pos * c..(pos + 1) * c];
                for ((o, &a), &p) in o.iter_mut().zip(te).zip(pe) {
                    *o = a + p;
                }
            }
        });
}

/// out (N, C) = wte[ids[n]]: the token embedding alone. Ids must be `< V`.
pub fn embedding_forward(out: &mut [f32], ids: &[u32], wte: &[f32], n: usize, c: usize) {
    let (out, ids) = (&mut out[..n * c], &ids[..n]);
    out.par_chunks_mut(64 * c)
        .zip(ids.par_chunks(64))
        .for_each(|(o, ids)| {
            for (o, &id) in o.chunks_exact_mut(c).zip(ids) {
                o.copy_from_slice(&wte[id as usize * c..(id as usize + 1) * c]);
            }
        });
}

/// Backward of [`embedding_forward`]: `dwte[ids[n]] += dout[n]`, in token order per column
/// block as [`encoder_backward`].
pub fn embedding_backward(dwte: &mut [f32], dout: &[f32], ids: &[u32], n: usize, c: usize) {
    scatter(dwte, None, dout, ids, n, n, c);
}

/// Backward of [`encoder_forward`]: `dwte[ids[b, t]] += dout[b, t]`, `dwpe[t] += dout[b, t]`.
#[allow(clippy::too_many_arguments)]
pub fn encoder_backward(
    dwte: &mut [f32],
    dwpe: &mut [f32],
    dout: &[f32],
    ids: &[u32],
    b: usize,
    t: usize,
    c: usize,
) {
    scatter(dwte, Some(dwpe), dout, ids, b * t, t, c);
}

/// `dwte[ids[i]] += dout[i]` and, with `dwpe`, `dwpe[i % t] += dout[i]`, for `n` rows.
fn scatter(
    dwte: &mut [f32],
    dwpe: Option<&mut [f32]>,
    dout: &[f32],
    ids: &[u32],
    n: usize,
    t: usize,
    c: usize,
) {
    let parts = if n * c < 1 << 15 {
        1
    } else {
        rayon::current_num_threads()
    };
    let block = c.div_ceil(parts).div_ceil(16) * 16;
    let (dout, ids) = (&dout[..n * c], &ids[..n]);
    // Each task owns the columns [c0, c0 + block) of every embedding row. The rows are
    // interleaved with other tasks' columns, so the task walks them through a raw pointer.
    let dwte_p = super::SendPtr(dwte.as_mut_ptr());
    let (npe, dwpe_p) = match dwpe {
        Some(dwpe) => (dwpe.len(), Some(super::SendPtr(dwpe.as_mut_ptr()))),
        None => (0, None),
    };
    let nte = dwte.len();
    assert!(
        ids.iter().all(|&id| (id as usize + 1) * c <= nte),
        "token id outside dwte"
    );
    assert!(dwpe_p.is_none() || t * c <= npe, "position outside dwpe");
    (0..c.div_ceil(block)).into_par_iter().for_each(|p| {
        let c0 = p * block;
        let w = block.min(c - c0);
        for (i, &id) in ids.iter().enumerate() {
            let d = &dout[i * c + c0..i * c + c0 + w];
            // safety: ids and positions were bounds-checked above; tasks own disjoint columns
            // and one task touches a row's columns sequentially.
            unsafe {
                let te = std::slice::from_raw_parts_mut(dwte_p.get().add(id as usize * c + c0), w);
                match dwpe_p {
                    Some(pe) => {
                        let pe = std::slice::from_raw_parts_mut(pe.get().add((i % t) * c + c0), w);
                        add2(te, pe, d);
                    }
                    None => add1(te, d),
                }
            }
        }
    });
}

simd_fn! {
    fn add1(a: &mut [f32], d: &[f32]) {
        for (a, &d) in a.iter_mut().zip(d) {
            *a += d;
        }
    }
}

simd_fn! {
    fn add2(a: &mut [f32], b: &mut [f32], d: &[f32]) {
        for ((a, b), &d) in a.iter_mut().zip(b.iter_mut()).zip(d) {
            *a += d;
            *b += d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testing::{check_grad, f64s, rand_vec, within_pool};

    #[test]
    fn encoder_backward_matches_finite_differences() {
        let (b, t, c, v) = (3, 5, 40, 7);
        let ids: Vec<u32> = (0..b * t).map(|i| (i * 5 % v) as u32).collect();
        let wte = rand_vec(v * c, 1);
        let wpe = rand_vec(t * c, 2);
        let dout = rand_vec(b * t * c, 3);
        for threads in [1, 2] {
            let mut out = vec![0.0; b * t * c];
            let (mut dwte, mut dwpe) = (vec![0.0; v * c], vec![0.0; t * c]);
            within_pool(threads, || {
                encoder_forward(&mut out, &ids, &wte, &wpe, b, t, c);
                encoder_backward(&mut dwte, &mut dwpe, &dout, &ids, b, t, c);
            });
            let f = |te: &[f64], pe: &[f64]| -> Vec<f64> {
                (0..b * t * c)
                    .map(|i| te[ids[i / c] as usize * c + i % c] + pe[(i / c % t) * c + i % c])
                    .collect()
            };
            let (te, pe) = (f64s(&wte), f64s(&wpe));
            crate::cpu::testing::assert_close(&out, &f(&te, &pe), 1e-6, "out");
            check_grad("dwte", &dwte, 0.0, &te, &dout, |x| f(x, &pe));
            check_grad("dwpe", &dwpe, 0.0, &pe, &dout, |x| f(&te, x));
        }
    }

    #[test]
    fn embedding_backward_matches_finite_differences() {
        let (n, c, v) = (15, 40, 7);
        let ids: Vec<u32> = (0..n).map(|i| (i * 5 % v) as u32).collect();
        let (wte, dout) = (rand_vec(v * c, 1), rand_vec(n * c, 3));
        for threads in [1, 2] {
            let (mut out, mut dwte) = (vec![0.0; n * c], vec![0.5; v * c]);
            within_pool(threads, || {
                embedding_forward(&mut out, &ids, &wte, n, c);
                embedding_backward(&mut dwte, &dout, &ids, n, c);
            });
            let f = |te: &[f64]| -> Vec<f64> {
                (0..n * c)
                    .map(|i| te[ids[i / c] as usize * c + i % c])
                    .collect()
            };
            crate::cpu::testing::assert_close(&out, &f(&f64s(&wte)), 0.0, "out");
            check_grad("dwte", &dwte, 0.5, &f64s(&wte), &dout, f);
        }
    }
}

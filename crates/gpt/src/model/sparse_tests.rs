//! [`Backward::sparse_embeddings`]: what a tied model's backward hands over instead of wte's
//! whole gradient, checked against the whole-table backward.

use super::tests::{model, wide_vocab};
use super::*;

/// Records what a sparse-embeddings backward hands over: each readiness range with its
/// gradient, each announced range, and the embeddings' rows.
#[derive(Default)]
struct SparseSeen {
    announced: Vec<(Part, Range<usize>)>,
    rows: Vec<(Range<usize>, Vec<u32>, Vec<f32>)>,
}

impl PartHooks for SparseSeen {
    fn before(&mut self, _: Part, _: Range<usize>, _: &mut [f32]) {}
    fn before_grads(&mut self, part: Part, range: Range<usize>, _: &mut [f32]) {
        self.announced.push((part, range));
    }
    fn embedding_rows(&mut self, wte: Range<usize>, ids: &[u32], rows: &[f32]) {
        self.rows.push((wte, ids.to_vec(), rows.to_vec()));
    }
}

/// With sparse embeddings a tied wte's gradient is never written whole: the head hands it
/// over in its blocks of the vocabulary (none larger than a block of logits' columns), the
/// embeddings as rows of the batch's distinct tokens, wpe alone; the head's blocks plus the
/// rows are the whole-table gradient, and every other range is the same bits. Untied, it
/// changes nothing.
#[test]
fn sparse_embeddings_hand_a_tied_wte_over_in_blocks_and_rows() {
    for tied in [true, false] {
        let cfg = wide_vocab(2, tied);
        let ids: Vec<u32> = (0..48).map(|i| (i * 37 % 300) as u32 % 97).collect();
        let labels: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
        let run = |sparse: bool| {
            let mut m = model(cfg.clone(), 2, 4);
            m.logits_max_bytes = 40_000; // blocks of 104 columns
            m.forward(Forward::new(&ids, 3, 16).labels(Labels::Aligned(&labels)))
                .unwrap();
            m.zero_grad();
            let mut seen = SparseSeen::default();
            let mut handed: Vec<(Range<usize>, Vec<f32>)> = Vec::new();
            let ready = |r: Range<usize>, g: ViewMut<'_, f32>| handed.push((r, g.host().to_vec()));
            let pass = Backward::new().parts(&mut seen).on_ready(ready);
            let pass = if sparse {
                pass.sparse_embeddings()
            } else {
                pass
            };
            m.backward(pass).unwrap();
            (m.layout.clone(), handed, seen)
        };
        let (lay, dense, _) = run(false);
        let (_, sparse, seen) = run(true);
        let whole = |h: &[(Range<usize>, Vec<f32>)]| {
            let mut g = vec![0f32; lay.total];
            for (r, v) in h {
                g[r.clone()].copy_from_slice(v);
            }
            g
        };
        let (want, mut got) = (whole(&dense), whole(&sparse));
        if !tied {
            assert!(seen.rows.is_empty(), "untied: no rows");
            assert_eq!(got, want, "untied: the same bits");
            continue;
        }
        let wte = lay.wte.clone();
        let ranges: Vec<_> = sparse.iter().map(|h| h.0.clone()).collect();
        let (blocks, rest) = ranges.split_at(3);
        assert_eq!(blocks, [0..104 * 16, 104 * 16..208 * 16, 208 * 16..wte.end]);
        assert_eq!(rest[0], lay.ln_f_w.start..lay.total, "then ln_f");
        assert_eq!(rest[rest.len() - 1], lay.wpe.clone(), "wpe alone, last");
        assert_eq!(rest.len(), 2 + cfg.n_layers, "each block whole");
        // ln_f's range announced first, then each block of wte's just before it is written.
        let mut heads = vec![(Part::Head, lay.ln_f_w.start..lay.total)];
        heads.extend(blocks.iter().map(|b| (Part::Head, b.clone())));
        assert_eq!(seen.announced[..4], heads);
        assert!(seen.announced.iter().all(|a| a.1.len() < wte.len()));
        // The rows: the distinct ids, ascending, each one's sum.
        let [(at, distinct, rows)] = &seen.rows[..] else {
            panic!("one hand-over of rows: {}", seen.rows.len());
        };
        assert_eq!(*at, wte);
        let mut want_ids = ids.clone();
        want_ids.sort_unstable();
        want_ids.dedup();
        assert_eq!(*distinct, want_ids);
        for (k, &id) in distinct.iter().enumerate() {
            let c = cfg.d_model;
            for (g, r) in got[id as usize * c..][..c]
                .iter_mut()
                .zip(&rows[k * c..][..c])
            {
                *g += r;
            }
        }
        let outside = |g: &[f32]| g[wte.end..].to_vec();
        assert_eq!(outside(&got), outside(&want), "the rest is the same bits");
        let worst = (want[wte.clone()].iter().zip(&got[wte.clone()]))
            .map(|(a, b)| (a - b).abs() / (1e-3 + a.abs()))
            .fold(0f32, f32::max);
        assert!(worst < 1e-5, "head + rows vs the whole table: {worst}");
    }
}

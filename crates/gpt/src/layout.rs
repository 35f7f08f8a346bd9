//! Where each parameter tensor lives in the flat parameter (and gradient) buffer.
//!
//! The order is the contract in `docs/GPT_LAYOUT.md`: wte, wpe, then one contiguous range per block,
//! then ln_f and (untied only) lm_head. Names and shapes are Hugging Face GPT-2's, weights in
//! Conv1D layout [in, out], for every model of the family: a Llama's tensors take the GPT-2
//! name of the tensor in their place (no `wpe` with rotary positions; `attn.c_attn` is q, k, v
//! side by side, (C, (NH+2·NKV)·HS); `mlp.c_fc` is gate and up side by side, (C, 2F)), and the
//! checkpoint module translates to Hugging Face's Llama names. This module only computes
//! offsets; it never touches the buffers.

use std::ops::Range;

use crate::GPTConfig;

/// One named tensor inside the flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamView {
    /// Hugging Face GPT-2 name, e.g. `h.0.attn.c_attn.weight`.
    pub name: String,
    /// Row-major shape.
    pub shape: Vec<usize>,
    /// Offsets in the flat parameter / gradient buffer.
    pub range: Range<usize>,
}

/// Offsets of one block's tensors; bias ranges are empty when the config has no biases.
#[derive(Clone, Debug)]
pub(crate) struct BlockLayout {
    pub ln_1_w: Range<usize>,
    pub ln_1_b: Range<usize>,
    pub attn_w: Range<usize>,
    pub attn_b: Range<usize>,
    pub proj_w: Range<usize>,
    pub proj_b: Range<usize>,
    pub ln_2_w: Range<usize>,
    pub ln_2_b: Range<usize>,
    pub fc_w: Range<usize>,
    pub fc_b: Range<usize>,
    pub fcproj_w: Range<usize>,
    pub fcproj_b: Range<usize>,
    /// The whole block: what the readiness hook reports (or its two halves, split at `ln_2_w`).
    pub all: Range<usize>,
}

/// The complete layout: named views plus typed offsets for the kernels.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    pub views: Vec<ParamView>,
    pub wte: Range<usize>,
    pub wpe: Range<usize>,
    pub blocks: Vec<BlockLayout>,
    pub ln_f_w: Range<usize>,
    pub ln_f_b: Range<usize>,
    /// The head's weight (V, C): wte's range when tied.
    pub lm_head: Range<usize>,
    pub total: usize,
}

impl Layout {
    /// The range of the flat buffer that `part`'s own parameters occupy.
    pub(crate) fn part_range(&self, part: crate::Part) -> Range<usize> {
        match part {
            crate::Part::Embeddings => self.wte.start..self.wpe.end,
            crate::Part::Block(l) => self.blocks[l].all.clone(),
            crate::Part::Head => self.ln_f_w.start..self.total,
        }
    }
}

impl Layout {
    /// Whether the head's weight is wte (tied embeddings).
    pub(crate) fn tied(&self) -> bool {
        self.lm_head == self.wte
    }

    /// The ranges `part` reads when it runs: its own, and wte's before it for a tied head.
    pub(crate) fn part_reads(&self, part: crate::Part) -> Vec<Range<usize>> {
        match part {
            crate::Part::Head if self.tied() => vec![self.wte.clone(), self.part_range(part)],
            _ => vec![self.part_range(part)],
        }
    }

    /// The weight matrices whose gradient one matrix product of a backward writes whole
    /// before anything else adds to it, in buffer order: each block's four, and the head's
    /// (wte's when tied: the head's backward writes it, then the embeddings' adds their
    /// rows). A lazy `zero_grad` leaves these unwritten for the products to overwrite.
    /// Allocates nothing (a zero_grad per step).
    pub(crate) fn product_weights(&self) -> impl Iterator<Item = Range<usize>> + Send + '_ {
        let blocks = self
            .blocks
            .iter()
            .flat_map(|b| [&b.attn_w, &b.proj_w, &b.fc_w, &b.fcproj_w].map(Range::clone));
        // A tied head's weight is wte, at the start of the buffer; an untied one is last.
        let head = Some(self.lm_head.clone());
        let (first, last) = if self.tied() {
            (head, None)
        } else {
            (None, head)
        };
        first.into_iter().chain(blocks).chain(last)
    }

    /// The ranges of the buffer outside [`Layout::product_weights`], in order (biases, norms,
    /// wpe, an untied wte): the gradients every backward only adds into, which a lazy
    /// `zero_grad` still fills. Contiguous tensors come as one range; allocates nothing.
    pub(crate) fn accumulated_only(&self) -> impl Iterator<Item = Range<usize>> + Send + '_ {
        let end = std::iter::once(self.total..self.total);
        let gaps = self.product_weights().chain(end).scan(0, |next, r| {
            let gap = *next..r.start;
            *next = r.end;
            Some(gap)
        });
        gaps.filter(|g| !g.is_empty())
    }
}

struct Carver {
    views: Vec<ParamView>,
    next: usize,
}

impl Carver {
    fn take(&mut self, name: String, shape: &[usize]) -> Range<usize> {
        let range = self.next..self.next + shape.iter().product::<usize>();
        self.next = range.end;
        self.views.push(ParamView {
            name,
            shape: shape.to_vec(),
            range: range.clone(),
        });
        range
    }

    fn bias(&mut self, on: bool, name: String, len: usize) -> Range<usize> {
        if on {
            self.take(name, &[len])
        } else {
            self.next..self.next
        }
    }
}

impl Layout {
    pub(crate) fn new(cfg: &GPTConfig) -> Layout {
        let (v, t, c, f) = (
            cfg.vocab_size,
            cfg.max_position_embeddings,
            cfg.d_model,
            cfg.d_ff,
        );
        let (bias, qkv_bias) = (cfg.bias, cfg.has_qkv_bias());
        let (w, fx) = (cfg.qkv_width(), cfg.fc_width());
        let learned = cfg.positions == crate::Positions::Learned;
        let mut cv = Carver {
            views: Vec::new(),
            next: 0,
        };
        let wte = cv.take("wte.weight".into(), &[v, c]);
        let wpe = if learned {
            cv.take("wpe.weight".into(), &[t, c])
        } else {
            cv.next..cv.next
        };
        let blocks = (0..cfg.n_layers)
            .map(|l| {
                let start = cv.next;
                let p = |s: &str| format!("h.{l}.{s}");
                let ln_1_w = cv.take(p("ln_1.weight"), &[c]);
                let ln_1_b = cv.bias(bias, p("ln_1.bias"), c);
                let attn_w = cv.take(p("attn.c_attn.weight"), &[c, w]);
                let attn_b = cv.bias(qkv_bias, p("attn.c_attn.bias"), w);
                let proj_w = cv.take(p("attn.c_proj.weight"), &[c, c]);
                let proj_b = cv.bias(bias, p("attn.c_proj.bias"), c);
                let ln_2_w = cv.take(p("ln_2.weight"), &[c]);
                let ln_2_b = cv.bias(bias, p("ln_2.bias"), c);
                let fc_w = cv.take(p("mlp.c_fc.weight"), &[c, fx]);
                let fc_b = cv.bias(bias, p("mlp.c_fc.bias"), fx);
                let fcproj_w = cv.take(p("mlp.c_proj.weight"), &[f, c]);
                let fcproj_b = cv.bias(bias, p("mlp.c_proj.bias"), c);
                BlockLayout {
                    ln_1_w,
                    ln_1_b,
                    attn_w,
                    attn_b,
                    proj_w,
                    proj_b,
                    ln_2_w,
                    ln_2_b,
                    fc_w,
                    fc_b,
                    fcproj_w,
                    fcproj_b,
                    all: start..cv.next,
                }
            })
            .collect();
        let ln_f_w = cv.take("ln_f.weight".into(), &[c]);
        let ln_f_b = cv.bias(bias, "ln_f.bias".into(), c);
        let lm_head = if cfg.tie_word_embeddings {
            wte.clone()
        } else {
            cv.take("lm_head.weight".into(), &[v, c])
        };
        Layout {
            total: cv.next,
            views: cv.views,
            wte,
            wpe,
            blocks,
            ln_f_w,
            ln_f_b,
            lm_head,
        }
    }

    /// The ranges the readiness hook reports, in backward order; they partition `0..total`.
    /// `split`: each block in two, its MLP's (from ln_2 up) final before its attention's.
    pub(crate) fn ready_order(&self, split: bool) -> Vec<Range<usize>> {
        let head_start = self.ln_f_w.start;
        let mut order = Vec::with_capacity(2 * self.blocks.len() + 2);
        order.push(head_start..self.total);
        for b in self.blocks.iter().rev() {
            if split {
                order.push(b.ln_2_w.start..b.all.end);
                order.push(b.all.start..b.ln_2_w.start);
            } else {
                order.push(b.all.clone());
            }
        }
        order.push(self.wte.start..self.wpe.end);
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_a_has_the_agreed_parameter_count() {
        let layout = Layout::new(&GPTConfig::config_a());
        assert_eq!(layout.total, 809_856);
        let b = Layout::new(&GPTConfig::config_b());
        assert_eq!(b.total, 10_770_816);
        // SmolLM2-135M's count, as transformers reports it
        assert_eq!(Layout::new(&GPTConfig::config_s()).total, 134_515_008);
    }

    #[test]
    fn views_are_contiguous_and_ready_ranges_partition_the_buffer() {
        for (bias, tied) in [(true, true), (false, false), (true, false), (false, true)] {
            let cfg = GPTConfig {
                bias,
                tie_word_embeddings: tied,
                ..GPTConfig::config_a()
            };
            let layout = Layout::new(&cfg);
            let mut next = 0;
            for v in &layout.views {
                assert_eq!(v.range.start, next, "{}", v.name);
                assert_eq!(v.range.len(), v.shape.iter().product::<usize>());
                next = v.range.end;
            }
            assert_eq!(next, layout.total);
            assert_eq!(
                layout.views.iter().any(|v| v.name == "lm_head.weight"),
                !tied
            );
            assert_eq!(layout.views.iter().any(|v| v.name.ends_with("bias")), bias);
            for split in [false, true] {
                let mut covered: Vec<Range<usize>> = layout.ready_order(split);
                covered.sort_by_key(|r| r.start);
                let mut next = 0;
                for r in covered {
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, layout.total);
            }
        }
    }

    #[test]
    fn product_weights_and_the_rest_partition_the_buffer() {
        for tied in [true, false] {
            let cfg = GPTConfig {
                tie_word_embeddings: tied,
                ..GPTConfig::config_a()
            };
            for cfg in [cfg.clone(), GPTConfig::llama_like(cfg)] {
                let layout = Layout::new(&cfg);
                let products: Vec<_> = layout.product_weights().collect();
                let mut all = products.clone();
                all.extend(layout.accumulated_only());
                all.sort_by_key(|r| r.start);
                let mut next = 0;
                for r in all {
                    assert!(!r.is_empty() && r.start == next, "{r:?} at {next}");
                    next = r.end;
                }
                assert_eq!(next, layout.total);
                // four per block and the head's; wte is a product's only when tied
                assert_eq!(products.len(), 4 * cfg.n_layers + 1);
                assert_eq!(products.contains(&layout.wte), tied);
                let weight = |name: &str| {
                    let v = layout.views.iter().find(|v| v.name == name).unwrap();
                    v.range.clone()
                };
                assert!(products.contains(&weight("h.1.mlp.c_fc.weight")));
                assert!(!products.contains(&weight("h.1.ln_2.weight")));
            }
        }
    }

    #[test]
    fn a_llama_has_grouped_qkv_fused_gate_up_and_no_wpe() {
        let cfg = GPTConfig {
            qkv_bias: Some(true),
            tie_word_embeddings: false,
            ..GPTConfig::llama_like(GPTConfig::config_a())
        };
        let layout = Layout::new(&cfg);
        let shape = |name: &str| {
            let v = layout.views.iter().find(|v| v.name == name);
            v.map(|v| v.shape.clone())
        };
        // 4 heads of 32, 2 key/value heads: (4 + 2·2)·32 = 256 columns
        assert_eq!(shape("h.0.attn.c_attn.weight"), Some(vec![128, 256]));
        assert_eq!(shape("h.0.attn.c_attn.bias"), Some(vec![256]));
        assert_eq!(shape("h.0.mlp.c_fc.weight"), Some(vec![128, 1024]));
        assert_eq!(shape("wpe.weight"), None);
        assert_eq!(shape("h.0.ln_1.bias"), None);
        assert_eq!(shape("lm_head.weight"), Some(vec![65, 128]));
        assert!(layout.wpe.is_empty() && layout.wpe.start == layout.wte.end);
    }
}

//! Which parameters get weight decay, decided from their Hugging Face names: the optimizer only
//! sees ranges. Must never look at values, only at names and shapes.

use cohort_engine::optim::DecayMask;

use crate::ParamView;

/// True for the tensors nanoGPT decays: the Linear/Conv1D weight matrices (`c_attn`, `c_proj`,
/// `c_fc`, and an untied `lm_head`). Biases, LayerNorm weights and the embeddings (`wte`, `wpe`;
/// with a tied head `wte` is also the head, and nanoGPT's original grouping leaves it undecayed)
/// are exempt.
pub fn is_decayed(view: &ParamView) -> bool {
    view.shape.len() == 2
        && view.name.ends_with(".weight")
        && view.name != "wte.weight"
        && view.name != "wpe.weight"
}

/// The [`DecayMask`] for a flat buffer laid out by `views` (which must cover it, as
/// `GPT::param_views` does): weight matrices decayed, everything else exempt.
pub fn decay_mask(views: &[ParamView]) -> DecayMask {
    let len = views.iter().map(|v| v.range.end).max().unwrap_or(0);
    let exempt = views
        .iter()
        .filter(|v| !is_decayed(v))
        .map(|v| v.range.clone());
    DecayMask::with_exempt(len, exempt).expect("views lie inside the buffer they describe")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GPTConfig, GPT};

    #[test]
    fn only_weight_matrices_are_decayed() {
        for tied in [true, false] {
            let cfg = GPTConfig {
                tie_word_embeddings: tied,
                ..GPTConfig::config_a()
            };
            let model = GPT::new(cfg.clone(), 1).unwrap();
            let mask = decay_mask(model.param_views());
            assert_eq!(mask.len(), model.num_params());
            let (c, f, v, l) = (cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers);
            let per_block = c * 3 * c + c * c + c * f + f * c;
            let head = if tied { 0 } else { v * c };
            assert_eq!(mask.decayed_count(), l * per_block + head, "tied {tied}");
            let decayed: Vec<&str> = model
                .param_views()
                .iter()
                .filter(|v| is_decayed(v))
                .map(|v| v.name.as_str())
                .collect();
            assert!(decayed.contains(&"h.3.mlp.c_proj.weight"));
            assert!(!decayed
                .iter()
                .any(|n| n.contains("ln_") || n.ends_with("bias")));
            assert_eq!(decayed.contains(&"lm_head.weight"), !tied);
        }
    }
}

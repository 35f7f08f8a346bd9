//! What one rank of a data-parallel strategy holds in memory: the bytes of
//! parameters, gradients, optimizer state and activations, computed in one
//! place for the start-of-run header (`memory per rank: ...`) and for the
//! check that refuses settings the host cannot hold.
//!
//! It only does arithmetic on sizes; it must never allocate what it counts,
//! and never count for one strategy what another strategy holds (a ZeRO
//! figure is the sharded one, not DDP's divided after the fact).

use cohort_engine::DType;
use cohort_gpt::{GPTConfig, GPT};

use crate::strategy::data_parallel::split_sizes;

/// How a data-parallel strategy splits the training state over `world` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharding {
    /// DDP: every rank holds everything.
    Replicated,
    /// ZeRO-1: AdamW's moments split into `world` padded shards.
    Zero1 {
        /// Ranks the state is split over.
        world: usize,
    },
    /// ZeRO-2: AdamW's moments and the gradient split, each part of the
    /// model into `world` padded shards.
    Zero2 {
        /// Ranks the state is split over.
        world: usize,
    },
    /// ZeRO-3: parameters too, each part gathered whole only while it runs.
    Zero3 {
        /// Ranks the state is split over.
        world: usize,
    },
}

impl Sharding {
    /// The ranks the state is split over (1 for DDP).
    fn world(self) -> u64 {
        match self {
            Sharding::Replicated => 1,
            Sharding::Zero1 { world } | Sharding::Zero2 { world } | Sharding::Zero3 { world } => {
                world.max(1) as u64
            }
        }
    }
}

/// One rank's bytes of training state, as [`memory_per_rank`] counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryPerRank {
    /// The model's parameters: whole, or (ZeRO-3) this rank's shards plus
    /// the largest part gathered whole while it runs.
    pub parameters: u64,
    /// The gradient buffer the model's backward writes into: whole, or
    /// (ZeRO-2 and 3) this rank's shards plus the parts in backward not yet
    /// reduce-scattered.
    pub gradients: u64,
    /// AdamW's two moments for the parameters this rank updates.
    pub optimizer: u64,
    /// DDP's optimizer state for the same model, for comparison.
    pub ddp_optimizer: u64,
    /// Forward activations, backward scratch and attention scratch.
    pub activations: u64,
    /// Buffers a sharded step keeps besides the above: the shard's own
    /// parameters and gradient, and, when the parameter count does not
    /// divide into the ranks, a padded copy of the whole buffer (ZeRO-1) or
    /// of the largest part (ZeRO-2 and 3) that the collectives need. Zero
    /// for DDP (its buckets are views of the gradient buffer).
    pub staging: u64,
    /// The sharding it was counted for.
    pub sharding: Sharding,
}

impl MemoryPerRank {
    /// Everything above, summed.
    pub fn total(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer + self.activations + self.staging
    }

    /// The header line: `memory per rank: parameters 3.1 MB, gradients
    /// 3.1 MB, optimizer state 1.6 MB (1/2 of DDP's 3.1 MB), activations
    /// 12.0 MB`.
    pub fn line(&self) -> String {
        let mb = |b: u64| format!("{:.3} MB", b as f64 / (1u64 << 20) as f64);
        let floats = self.optimizer / 8;
        let optimizer = match self.sharding {
            Sharding::Replicated => format!(
                "optimizer state {} (AdamW, 2 x {floats} floats)",
                mb(self.optimizer)
            ),
            Sharding::Zero1 { world } | Sharding::Zero2 { world } | Sharding::Zero3 { world } => {
                format!(
                    "optimizer state {} (AdamW, 2 x {floats} floats: 1/{world} of DDP's {})",
                    mb(self.optimizer),
                    mb(self.ddp_optimizer)
                )
            }
        };
        let world = self.sharding.world();
        let parameters = match self.sharding {
            Sharding::Zero3 { .. } => format!(
                "{} (1/{world} shards + the largest part gathered)",
                mb(self.parameters)
            ),
            _ => mb(self.parameters),
        };
        let gradients = match self.sharding {
            Sharding::Zero2 { .. } | Sharding::Zero3 { .. } => format!(
                "{} (1/{world} shards + the parts in backward)",
                mb(self.gradients)
            ),
            _ => mb(self.gradients),
        };
        let staging = if self.staging > 0 {
            format!(", shard buffers {}", mb(self.staging))
        } else {
            String::new()
        };
        format!(
            "memory per rank: parameters {parameters}, gradients {gradients}, {optimizer}, \
             activations {}{staging}",
            mb(self.activations),
        )
    }
}

/// One rank's bytes for `model` under `sharding`, with `tokens` tokens per
/// forward on `threads` threads (the attention scratch is per thread), products in
/// `precision`.
pub fn memory_per_rank(
    model: &GPTConfig,
    tokens: usize,
    threads: usize,
    activation_checkpointing: bool,
    precision: DType,
    sharding: Sharding,
) -> MemoryPerRank {
    let m = GPT::memory_estimate(model, tokens, threads, activation_checkpointing, precision);
    let n = m.parameters / 4;
    let ddp_optimizer = 2 * m.parameters;
    let world = sharding.world();
    let (mut parameters, mut gradients) = (m.parameters, m.gradients);
    let (optimizer, staging) = match sharding {
        Sharding::Replicated => (ddp_optimizer, 0),
        Sharding::Zero1 { .. } => {
            // The padded buffer's shard: ceil(n / world) floats per moment,
            // the same split as the strategy's.
            let shard = n.div_ceil(world);
            let padded = if shard * world == n { 0 } else { shard * world };
            (2 * shard * 4, (2 * shard + padded) * 4)
        }
        Sharding::Zero2 { .. } | Sharding::Zero3 { .. } => {
            // Each unit split on its own, as the strategy splits it: a
            // block's attention and MLP apart (the ranges backward hands
            // over), the embeddings and the head whole.
            let ranges = GPT::part_ranges_of(model);
            let split = split_sizes(&ranges, &GPT::split_ready_ranges_of(model), world as usize);
            let parts: Vec<u64> = ranges.iter().map(|r| r.len() as u64).collect();
            let flat = split.flat as u64;
            let largest = parts.iter().copied().max().unwrap_or(0);
            let (embeddings, others) = parts.split_first().map_or((0, &[][..]), |(e, o)| (*e, o));
            let head = others.last().copied().unwrap_or(0);
            let others = others.iter().copied().max().unwrap_or(0);
            // A tied head reads wte (below), and hands its gradient over
            // block by block of the vocabulary as it writes it (beside
            // ln_f's), the embeddings theirs as rows: never wte's whole.
            let tied = model.tie_word_embeddings;
            let wte = if tied {
                (model.vocab_size * model.d_model) as u64
            } else {
                0
            };
            let in_backward = if tied {
                others.max(m.head_block / 4 + head)
            } else {
                embeddings.max(others)
            };
            gradients = 4 * (flat + in_backward);
            // A part gathered through a staging copy (several units, or
            // one that does not divide into the ranks; or wte, a slice of
            // a part) needs a padded copy of the part; one reduce-scatter's
            // shard waits in a scratch buffer.
            let stage3 = matches!(sharding, Sharding::Zero3 { .. });
            let padded = (split.parts.iter().enumerate())
                .filter(|&(i, &(_, staged))| staged || (i == 0 && stage3 && wte > 0))
                .map(|(_, &(padded, _))| padded as u64)
                .max()
                .unwrap_or(0);
            let scratch = split.largest_unit_shard as u64;
            let mut staging = padded + scratch;
            if stage3 {
                parameters = 4 * (flat + largest.max(others + wte));
            } else {
                staging += flat;
            }
            (2 * flat * 4, staging * 4)
        }
    };
    MemoryPerRank {
        parameters,
        gradients,
        optimizer,
        ddp_optimizer,
        activations: m.activations,
        staging,
        sharding,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vocab 17, d_model 33: 19037 parameters, which neither 2 nor 3 divides.
    fn odd() -> GPTConfig {
        GPTConfig {
            vocab_size: 17,
            max_position_embeddings: 16,
            n_layers: 2,
            n_heads: 3,
            d_model: 33,
            d_ff: 64,
            ..GPTConfig::default()
        }
    }

    #[test]
    fn zero1_holds_one_nth_of_the_padded_optimizer_state_and_ddps_rest() {
        let ddp = memory_per_rank(&odd(), 64, 2, false, DType::F32, Sharding::Replicated);
        let n = ddp.parameters / 4;
        assert_eq!(ddp.optimizer, 2 * 4 * n);
        assert_eq!(ddp.staging, 0);
        for world in [1u64, 2, 3, 7] {
            let z = memory_per_rank(
                &odd(),
                64,
                2,
                false,
                DType::F32,
                Sharding::Zero1 { world: world as _ },
            );
            let padded = n.div_ceil(world) * world;
            assert_eq!(z.optimizer * world, 2 * 4 * padded, "world {world}");
            assert!(z.optimizer * world - ddp.optimizer < 8 * world);
            assert_eq!(
                (z.parameters, z.gradients, z.activations),
                (ddp.parameters, ddp.gradients, ddp.activations)
            );
            assert_eq!(z.ddp_optimizer, ddp.optimizer);
        }
    }

    #[test]
    fn zero2_and_zero3_shard_each_part_and_hold_one_part_whole() {
        // Six blocks of 8941 (attention 4554 from ln_1, MLP 4387 from ln_2:
        // split apart), embeddings 33 x (17 + 16) = 1089 (wte 561, tied to
        // the head), head 66.
        let cfg = GPTConfig {
            n_layers: 6,
            ..odd()
        };
        let ddp = memory_per_rank(&cfg, 64, 2, false, DType::F32, Sharding::Replicated);
        assert_eq!(ddp.parameters / 4, 1089 + 6 * 8941 + 66);
        for world in [2u64, 3] {
            let w = world as usize;
            let block = 4554u64.div_ceil(world) + 4387u64.div_ceil(world);
            let flat = 1089u64.div_ceil(world) + 6 * block + 66u64.div_ceil(world);
            // A block's gradient: the tied head's share of wte's was
            // handed over as it was written, not left behind beside it.
            let in_backward = 8941;
            let two = memory_per_rank(&cfg, 64, 2, false, DType::F32, Sharding::Zero2 { world: w });
            let three =
                memory_per_rank(&cfg, 64, 2, false, DType::F32, Sharding::Zero3 { world: w });
            for z in [two, three] {
                assert_eq!(z.optimizer, 2 * 4 * flat, "world {world}");
                assert_eq!(z.gradients, 4 * (flat + in_backward), "world {world}");
                assert_eq!(z.activations, ddp.activations);
            }
            assert_eq!(two.parameters, ddp.parameters);
            // The tied head reads wte whole.
            assert_eq!(three.parameters, 4 * (flat + 8941 + 561), "world {world}");
            // A block's gather goes through a staging copy (its units'
            // shards come rank by rank), beside a unit's reduce-scatter
            // shard (the attention's, the largest unit but the embeddings).
            let staged = block * world + 4554u64.div_ceil(world);
            assert_eq!(three.staging, 4 * staged, "world {world}");
            // Stage 2 keeps its own copy of the shard's parameters; stage 3's
            // shard is its parameters.
            assert_eq!(two.staging - three.staging, 4 * flat);
            assert!(three.total() < two.total() && two.total() < ddp.total());
        }
    }

    #[test]
    fn the_line_names_every_part_and_the_share_of_ddps_state() {
        let z = memory_per_rank(
            &odd(),
            64,
            2,
            false,
            DType::F32,
            Sharding::Zero1 { world: 2 },
        );
        let line = z.line();
        for part in [
            "memory per rank: parameters ",
            ", gradients ",
            "optimizer state ",
            "floats: 1/2 of DDP's ",
            ", activations ",
            ", shard buffers ",
        ] {
            assert!(line.contains(part), "{part:?} missing in {line}");
        }
        let ddp = memory_per_rank(&odd(), 64, 2, false, DType::F32, Sharding::Replicated).line();
        assert!(!ddp.contains("DDP's") && !ddp.contains("shard"), "{ddp}");
    }
}

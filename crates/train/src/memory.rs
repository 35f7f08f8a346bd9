//! What one rank of a data-parallel strategy holds in memory: the bytes of
//! parameters, gradients, optimizer state and activations, computed in one
//! place for the start-of-run header (`memory per rank: ...`) and for the
//! check that refuses settings the host cannot hold.
//!
//! It only does arithmetic on sizes; it must never allocate what it counts,
//! and never count for one strategy what another strategy holds (a ZeRO
//! figure is the sharded one, not DDP's divided after the fact).

use cohort_gpt::{GPTConfig, GPT};

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
}

/// One rank's bytes of training state, as [`memory_per_rank`] counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryPerRank {
    /// The model's parameters (every strategy here holds them whole).
    pub parameters: u64,
    /// The gradient buffer the model's backward writes into.
    pub gradients: u64,
    /// AdamW's two moments for the parameters this rank updates.
    pub optimizer: u64,
    /// DDP's optimizer state for the same model, for comparison.
    pub ddp_optimizer: u64,
    /// Forward activations, backward scratch and attention scratch.
    pub activations: u64,
    /// Buffers a sharded step keeps besides the above: the shard's own
    /// parameters and gradient, and, when the parameter count does not
    /// divide into the ranks, a padded copy of the whole buffer that the
    /// collectives need. Zero for DDP (its buckets are views of the
    /// gradient buffer).
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
            Sharding::Zero1 { world } => format!(
                "optimizer state {} (AdamW, 2 x {floats} floats: 1/{world} of DDP's {})",
                mb(self.optimizer),
                mb(self.ddp_optimizer)
            ),
        };
        let staging = if self.staging > 0 {
            format!(", shard buffers {}", mb(self.staging))
        } else {
            String::new()
        };
        format!(
            "memory per rank: parameters {}, gradients {}, {optimizer}, activations {}{staging}",
            mb(self.parameters),
            mb(self.gradients),
            mb(self.activations),
        )
    }
}

/// One rank's bytes for `model` under `sharding`, with `tokens` tokens per
/// forward on `threads` threads (the attention scratch is per thread).
pub fn memory_per_rank(
    model: &GPTConfig,
    tokens: usize,
    threads: usize,
    activation_checkpointing: bool,
    sharding: Sharding,
) -> MemoryPerRank {
    let m = GPT::memory_estimate(model, tokens, threads, activation_checkpointing);
    let n = m.parameters / 4;
    let ddp_optimizer = 2 * m.parameters;
    let (optimizer, staging) = match sharding {
        Sharding::Replicated => (ddp_optimizer, 0),
        Sharding::Zero1 { world } => {
            // The padded buffer's shard: ceil(n / world) floats per moment,
            // the same split as the strategy's.
            let world = world.max(1) as u64;
            let shard = n.div_ceil(world);
            let padded = if shard * world == n { 0 } else { shard * world };
            (2 * shard * 4, (2 * shard + padded) * 4)
        }
    };
    MemoryPerRank {
        parameters: m.parameters,
        gradients: m.gradients,
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
        let ddp = memory_per_rank(&odd(), 64, 2, false, Sharding::Replicated);
        let n = ddp.parameters / 4;
        assert_eq!(ddp.optimizer, 2 * 4 * n);
        assert_eq!(ddp.staging, 0);
        for world in [1u64, 2, 3, 7] {
            let z = memory_per_rank(&odd(), 64, 2, false, Sharding::Zero1 { world: world as _ });
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
    fn the_line_names_every_part_and_the_share_of_ddps_state() {
        let z = memory_per_rank(&odd(), 64, 2, false, Sharding::Zero1 { world: 2 });
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
        let ddp = memory_per_rank(&odd(), 64, 2, false, Sharding::Replicated).line();
        assert!(!ddp.contains("DDP's") && !ddp.contains("shard"), "{ddp}");
    }
}

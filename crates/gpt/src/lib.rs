//! The mini-GPT model: config, flat parameters, forward/backward, checkpoints, sampling.

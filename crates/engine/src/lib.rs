//! The compute engine: fused CPU kernels, a persistent thread pool, optimizers.

pub mod optim;

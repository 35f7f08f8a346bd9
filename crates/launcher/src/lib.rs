//! The cohort run launcher (torchrun's role): starts, watches and restarts the workers of a job.

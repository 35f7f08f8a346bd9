//! Saving and resuming a training run: the model through
//! `cohort_gpt::checkpoint` (Hugging Face GPT-2 format, atomic writes), with
//! the optimizer's state and the trainer's position (step, epoch, offset in
//! the epoch's sample order; see `trainer_files`) as further files of it,
//! and the shape of the job that produced it. Resuming restores all of it, so
//! the run continues bitwise as if it had never stopped: the learning rate
//! and dropout keys are functions of the step, the data of (epoch, offset).
//!
//! Checkpoints are `OUT/step-NNNNNN` directories, written atomically and
//! verified by `cohort_gpt::checkpoint` (CRC-32C of every file). A whole-model
//! save may be written by a writer thread from a copy of the state
//! (`background`, [`Saver`]) while training goes on. What goes
//! wrong on the way is not fatal (say, the disk fills up): a failed
//! save is reported and the run goes on with the previous checkpoint intact;
//! only the newest `keep_checkpoints` are kept. Resuming from `OUT` takes
//! the checkpoint `latest` names, or, if that one is damaged, the newest
//! intact one before it. Only rank 0 calls [`Saver::save_whole`] (a whole
//! model, DDP's format); every rank calls [`save_sharded`] (the ZeRO
//! stages: each rank writes its own shard, rank 0 commits them, see
//! `cohort_gpt::checkpoint`'s sharded format) and [`resume`] (or
//! [`resume_into`], for a rank that restores only its own shard: a sharded
//! checkpoint is then read only where that shard lies). Either kind of
//! checkpoint resumes under any strategy and world size, and
//! [`consolidate`] turns a sharded one into DDP's format. This module never
//! deletes a checkpoint that `latest` names, and never resumes ranks from
//! different steps or different checkpoints.

mod background;
mod consolidate;
mod layout;
mod resume;
mod save;
pub(crate) mod trainer_files;

pub(crate) use background::Saver;
pub use consolidate::consolidate;
pub(crate) use layout::output_root;
pub use layout::TrainState;
pub(crate) use resume::{
    choose, resume, resume_alone, resume_into, resume_split, Restore, Resumed, ShardTarget,
};
pub(crate) use save::{check_writable, save_file_or_report, save_sharded, OwnedShard, SaveReport};

//! Where checkpoints lie and what they record beyond the model: the
//! `OUT/step-NNNNNN` names, the trainer's position ([`TrainState`]), and
//! where that position lands when a checkpoint is resumed over another
//! number of ranks. Saving and resuming both build on it; it never reads
//! or writes a checkpoint's files itself.

use std::fs;
use std::path::{Path, PathBuf};

use cohort_gpt::checkpoint as ckpt;

/// Name prefix of the trainer's checkpoints (`step-000100`).
pub(super) const STEP_PREFIX: &str = "step-";

/// Where a run is: what a checkpoint records beyond weights and optimizer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrainState {
    /// Optimizer steps completed.
    pub step: u64,
    /// Epoch of the sampler.
    pub epoch: u64,
    /// Samples of this epoch this rank has consumed.
    pub offset: usize,
}

/// The name of the checkpoint of `step` (`step-000100`).
pub(super) fn step_name(step: u64) -> String {
    format!("{STEP_PREFIX}{step:06}")
}

/// The trainer's checkpoints in `root`, newest first, as (step, directory).
pub(super) fn step_dirs(root: &Path) -> Vec<(u64, PathBuf)> {
    let mut dirs: Vec<(u64, PathBuf)> = fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_str()?.to_string();
            let step = name.strip_prefix(STEP_PREFIX)?.parse().ok()?;
            entry.path().is_dir().then(|| (step, entry.path()))
        })
        .collect();
    dirs.sort_by_key(|(step, _)| std::cmp::Reverse(*step));
    dirs
}

/// The run's output directory that the checkpoint `path` (a resume's) lies in: `path`
/// itself when it is one (it has a `latest` pointer or `step-*` checkpoints), else the
/// directory holding it when that is one; `None` for a checkpoint that stands alone (an
/// export), which belongs to no run.
pub(crate) fn output_root(path: &Path) -> Option<PathBuf> {
    let is_root = |dir: &Path| dir.join(ckpt::LATEST_FILE).is_file() || !step_dirs(dir).is_empty();
    if is_root(path) {
        return Some(path.to_path_buf());
    }
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty())?;
    is_root(parent).then(|| parent.to_path_buf())
}

/// Whether file `name` of checkpoint `dir` is a shard of a sharded checkpoint (checked as
/// it is read, by the ranks that need it, rather than up front by every rank).
pub(super) fn is_shard_file(dir: &Path, name: &str) -> bool {
    name.starts_with("shard-") && dir.join(ckpt::SHARD_INDEX_FILE).is_file()
}

/// This rank's offset in the epoch after a change of world size: the
/// samples all `from` ranks consumed together, shared among `to` ranks
/// (rounded down, so at most `to - 1` samples are read twice, none skipped).
pub(super) fn remap_offset(offset: usize, from: usize, to: usize) -> usize {
    offset * from / to.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resume_writes_where_its_run_wrote() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("out");
        let step = root.join(step_name(4));
        fs::create_dir_all(&step).unwrap();
        assert_eq!(output_root(&root), Some(root.clone()));
        assert_eq!(output_root(&step), Some(root.clone()));
        let export = dir.path().join("export");
        fs::create_dir_all(&export).unwrap();
        fs::write(export.join(ckpt::CONFIG_FILE), "{}").unwrap();
        assert_eq!(output_root(&export), None);
    }

    #[test]
    fn the_position_is_the_samples_all_ranks_consumed() {
        assert_eq!(remap_offset(10, 2, 1), 20);
        assert_eq!(remap_offset(10, 1, 2), 5);
        assert_eq!(remap_offset(7, 2, 3), 4);
        assert_eq!(remap_offset(7, 3, 3), 7);
    }
}

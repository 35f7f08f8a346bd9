//! Worker liveness: a worker that the launcher started beats by touching a
//! file the launcher names in its environment, from a thread of its own, so
//! that a long step or a long save never looks silent. A worker whose file
//! goes untouched for `worker_timeout` is frozen (stopped with SIGSTOP,
//! swapped out, hung in the kernel): the launcher stops the group and
//! restarts it, naming the worker, its pid and how long it was silent.
//!
//! Only workers that beat are watched: the launcher starts watching a
//! worker once its file exists, so a program that never beats (a Python
//! script) runs as before, watched only by its collectives' timeouts. A
//! worker that is alive but deadlocked still beats; that is what the
//! collectives' timeouts are for.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// The variable that names a worker's heartbeat file.
pub const HEARTBEAT_FILE_VAR: &str = "COHORT_WORKER_HEARTBEAT";

/// How often a worker touches its file.
pub const BEAT_INTERVAL: Duration = Duration::from_secs(1);

/// In a worker: starts the thread that touches the file `HEARTBEAT_FILE_VAR`
/// names, when the launcher set it; returns whether it did. The thread runs
/// until the process exits.
pub fn start_beating_from_env() -> bool {
    let Some(path) = std::env::var_os(HEARTBEAT_FILE_VAR).map(PathBuf::from) else {
        return false;
    };
    std::thread::Builder::new()
        .name("cohort-heartbeat".into())
        .spawn(move || loop {
            // A beat that cannot be written is a missed beat: the launcher
            // sees the silence, which is the truth about this worker.
            let _ = touch(&path);
            std::thread::sleep(BEAT_INTERVAL);
        })
        .is_ok()
}

fn touch(path: &Path) -> std::io::Result<()> {
    let file = File::options().create(true).append(true).open(path)?;
    file.set_modified(SystemTime::now())
}

/// In the launcher: how long the worker beating into `path` has been
/// silent, or `None` if it has not beaten yet.
pub(crate) fn silent_for(path: &Path) -> Option<Duration> {
    let modified = std::fs::metadata(path).ok()?.modified().ok()?;
    Some(
        SystemTime::now()
            .duration_since(modified)
            .unwrap_or_default(),
    )
}

/// The directory of one group's per-worker files (heartbeats, and the error
/// files of `worker_error`), removed when dropped.
pub(crate) struct BeatDir(PathBuf);

impl BeatDir {
    /// A new directory for the group of restart `restart` of this launcher.
    pub(crate) fn create(restart: u32) -> std::io::Result<BeatDir> {
        let dir = std::env::temp_dir().join(format!(
            "cohort-heartbeats-{}-{restart}",
            std::process::id()
        ));
        // A directory left by a launcher with this pid that was killed.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(BeatDir(dir))
    }

    /// The file of the worker of `rank`.
    pub(crate) fn file(&self, rank: usize) -> PathBuf {
        self.0.join(format!("rank{rank}"))
    }

    /// Where the worker of `rank` may write why it failed (`worker_error`).
    pub(crate) fn error_file(&self, rank: usize) -> PathBuf {
        self.0.join(format!("error-rank{rank}.json"))
    }
}

impl Drop for BeatDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_silent_until_touched_and_for_as_long_as_it_is_not() {
        let dir = BeatDir::create(9999).unwrap();
        let path = dir.file(3);
        assert_eq!(silent_for(&path), None, "not beating yet");
        touch(&path).unwrap();
        assert!(silent_for(&path).unwrap() < Duration::from_secs(1));
        let old = SystemTime::now() - Duration::from_secs(120);
        File::options()
            .append(true)
            .open(&path)
            .unwrap()
            .set_modified(old)
            .unwrap();
        assert!(silent_for(&path).unwrap() >= Duration::from_secs(119));
        let kept = dir.0.clone();
        drop(dir);
        assert!(!kept.exists());
    }
}

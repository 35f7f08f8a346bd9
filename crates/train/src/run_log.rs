//! What a training run leaves behind to look at: TensorBoard event files and
//! `metrics.jsonl` (one JSON object per step that logged or evaluated) in
//! the run's log directory, written by rank 0 of the training loop.
//!
//! A run that continues in a directory (resumed, or restarted by the
//! launcher) continues its logs: `metrics.jsonl` keeps the lines up to the
//! step the run starts from and drops later ones (the steps after the
//! checkpoint are trained again), and the new event file opens with a
//! TensorBoard session start just after that step, which makes TensorBoard
//! drop what earlier files logged there. So every step appears once. A
//! restart by the launcher is logged as a marker (`elastic/restart`).
//!
//! This module only writes files; it never decides anything about training.

use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use cohort_tensorboard::EventWriter;
use serde_json::{json, Map, Value};

use crate::phases::PHASES;

/// The metrics file's name in the log directory.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// The figures of one step's log line.
#[derive(Debug, Clone, Default)]
pub(crate) struct TrainFigures {
    /// Mean training loss over the window's applied updates (NaN: none).
    pub loss: f32,
    /// The learning rate of the step.
    pub lr: f64,
    /// Mean gradient norm over the window, before clipping.
    pub grad_norm: f32,
    /// Updates skipped in the window.
    pub skipped: u64,
    /// The job's tokens per second over the window.
    pub tokens_per_s: f64,
    /// Each rank's milliseconds per step in each phase (rank 0's first), in
    /// the order of `PHASES`.
    pub rank_ms: Vec<[f64; PHASES.len()]>,
    /// The rank named the straggler over the last steps and how much slower than the
    /// median it computes (0.18: 18%), if one is.
    pub straggler: Option<(usize, f64)>,
}

/// An open run log.
pub(crate) struct RunLog {
    dir: PathBuf,
    events: EventWriter,
    metrics: File,
    started: Instant,
    /// Seconds the run had trained before this process started (a resumed
    /// run's last logged `elapsed_s`), so wall-clock curves continue.
    elapsed_before: f64,
}

/// An error writing the log, naming the file.
#[derive(Debug)]
pub(crate) struct RunLogError(pub String);

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> RunLogError + '_ {
    move |e| RunLogError(format!("{}: {e}", path.display()))
}

impl RunLog {
    /// Opens the log in `dir` for a run that starts after step `start`; a
    /// launcher restart (`restart > 0`) is logged as a marker at `start`.
    pub(crate) fn open(dir: &Path, start: u64, restart: u32) -> Result<RunLog, RunLogError> {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let path = dir.join(METRICS_FILE);
        let elapsed_before = keep_until(&path, start)?;
        let metrics = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io_err(&path))?;
        let mut events = EventWriter::create(dir).map_err(|e| RunLogError(e.to_string()))?;
        let now = cohort_tensorboard::now();
        events
            .session_start(start + 1, now)
            .map_err(|e| RunLogError(e.to_string()))?;
        let mut log = RunLog {
            dir: dir.to_path_buf(),
            events,
            metrics,
            started: Instant::now(),
            elapsed_before,
        };
        if restart > 0 {
            let mut o = Map::new();
            o.insert("restart".into(), json!(restart));
            log.write(start, o, &[("elastic/restart", restart as f32)])?;
        }
        Ok(log)
    }

    /// The directory.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Logs step `step`: the log line's figures (at a log step), the
    /// validation loss (at an evaluation) and the data's loss floor.
    pub(crate) fn step(
        &mut self,
        step: u64,
        train: Option<&TrainFigures>,
        val_loss: Option<f32>,
        floor: Option<f64>,
    ) -> Result<(), RunLogError> {
        let mut o = Map::new();
        let mut scalars: Vec<(String, f32)> = Vec::new();
        if let Some(t) = train {
            o.insert("train_loss".into(), num(t.loss as f64));
            o.insert("lr".into(), num(t.lr));
            o.insert("grad_norm".into(), num(t.grad_norm as f64));
            o.insert("skipped".into(), json!(t.skipped));
            o.insert("tokens_per_s".into(), num(t.tokens_per_s));
            scalars.push(("train/loss".into(), t.loss));
            scalars.push(("train/lr".into(), t.lr as f32));
            scalars.push(("train/grad_norm".into(), t.grad_norm));
            scalars.push(("train/skipped_updates".into(), t.skipped as f32));
            scalars.push(("train/tokens_per_s".into(), t.tokens_per_s as f32));
            let mut ranks = Vec::new();
            for (rank, ms) in t.rank_ms.iter().enumerate() {
                let mut phases = Map::new();
                for (p, &v) in PHASES.iter().zip(ms) {
                    phases.insert(p.long_name().into(), num(v));
                    if rank == 0 {
                        scalars.push((format!("time_ms/{}", p.long_name()), v as f32));
                    }
                    scalars.push((format!("rank{rank}/time_ms/{}", p.long_name()), v as f32));
                }
                ranks.push(Value::Object(phases));
            }
            if let Some(first) = ranks.first() {
                o.insert("ms_per_step".into(), first.clone());
            }
            o.insert("rank_ms_per_step".into(), Value::Array(ranks));
            if t.rank_ms.len() > 1 {
                // -1: nobody, so that TensorBoard draws the verdict over the whole run.
                let (rank, slower) = t.straggler.map_or((-1.0, 0.0), |(r, s)| (r as f32, s));
                scalars.push(("straggler/rank".into(), rank));
                scalars.push(("straggler/slower_pct".into(), (100.0 * slower) as f32));
                if let Some((rank, slower)) = t.straggler {
                    o.insert(
                        "straggler".into(),
                        json!({"rank": rank, "slower_pct": num(100.0 * slower)}),
                    );
                }
            }
        }
        if let Some(v) = val_loss {
            o.insert("val_loss".into(), num(v as f64));
            scalars.push(("val/loss".into(), v));
            if let Some(f) = floor {
                o.insert("floor".into(), num(f));
                scalars.push(("val/loss_floor".into(), f as f32));
            }
        }
        let tags: Vec<(&str, f32)> = scalars.iter().map(|(t, v)| (t.as_str(), *v)).collect();
        self.write(step, o, &tags)
    }

    /// One JSON line and one event, both flushed (TensorBoard and scripts
    /// read the files while they grow).
    fn write(
        &mut self,
        step: u64,
        fields: Map<String, Value>,
        scalars: &[(&str, f32)],
    ) -> Result<(), RunLogError> {
        let wall_time = cohort_tensorboard::now();
        let elapsed = self.elapsed_before + self.started.elapsed().as_secs_f64();
        let mut o = Map::new();
        o.insert("step".into(), json!(step));
        o.insert("wall_time".into(), json!(wall_time));
        o.insert("elapsed_s".into(), num(elapsed));
        o.extend(fields);
        let path = self.dir.join(METRICS_FILE);
        writeln!(self.metrics, "{}", Value::Object(o)).map_err(io_err(&path))?;
        self.metrics.flush().map_err(io_err(&path))?;
        let events = &mut self.events;
        events
            .add_scalars(step, wall_time, scalars)
            .and_then(|()| events.flush())
            .map_err(|e| RunLogError(e.to_string()))
    }
}

/// A JSON number, or null for NaN and infinities (JSON has neither).
fn num(x: f64) -> Value {
    serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number)
}

/// Keeps the lines of the metrics file at `path` up to step `start` (all
/// when it does not exist), rewriting it atomically if any go; returns the
/// last kept line's `elapsed_s` (0 for none).
fn keep_until(path: &Path, start: u64) -> Result<f64, RunLogError> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0.0),
        Err(e) => return Err(io_err(path)(e)),
    };
    let mut kept = Vec::new();
    let mut dropped = false;
    let mut elapsed = 0.0;
    for line in BufReader::new(file).lines() {
        let line = line.map_err(io_err(path))?;
        let parsed: Option<Value> = serde_json::from_str(&line).ok();
        let step = parsed.as_ref().and_then(|v| v["step"].as_u64());
        match step {
            Some(s) if s <= start => {
                if let Some(e) = parsed.as_ref().and_then(|v| v["elapsed_s"].as_f64()) {
                    elapsed = e;
                }
                kept.push(line);
            }
            // A later step (trained again now) or a line cut short by a kill.
            _ => dropped = true,
        }
    }
    if dropped {
        let tmp = path.with_extension("jsonl.tmp");
        let mut text = kept.join("\n");
        if !text.is_empty() {
            text.push('\n');
        }
        fs::write(&tmp, text).map_err(io_err(&tmp))?;
        fs::rename(&tmp, path).map_err(io_err(path))?;
    }
    Ok(elapsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(dir: &Path) -> Vec<Value> {
        fs::read_to_string(dir.join(METRICS_FILE))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    #[test]
    fn a_resumed_run_keeps_each_step_once_and_marks_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let figures = TrainFigures {
            loss: 2.0,
            lr: 1e-3,
            grad_norm: 0.5,
            skipped: 0,
            tokens_per_s: 1000.0,
            rank_ms: vec![[1.0; 6], [2.0; 6]],
            straggler: Some((1, 0.18)),
        };
        let mut log = RunLog::open(dir.path(), 0, 0).unwrap();
        for step in [5, 10, 15] {
            log.step(step, Some(&figures), None, None).unwrap();
        }
        log.step(15, None, Some(1.5), Some(1.0)).unwrap();
        drop(log);
        // Resumed from the checkpoint of step 10 after a launcher restart.
        let mut log = RunLog::open(dir.path(), 10, 1).unwrap();
        log.step(15, Some(&figures), Some(1.25), None).unwrap();
        let steps: Vec<u64> = lines(dir.path())
            .iter()
            .map(|l| l["step"].as_u64().unwrap())
            .collect();
        assert_eq!(steps, [5, 10, 10, 15]);
        let all = lines(dir.path());
        assert_eq!(all[2]["restart"], 1);
        assert_eq!(all[3]["val_loss"], 1.25);
        assert_eq!(all[1]["rank_ms_per_step"][1]["comm_wait"], 2.0);
        assert_eq!(all[1]["ms_per_step"]["forward"], 1.0);
        assert_eq!(all[1]["straggler"]["rank"], 1);
        // Two event files; the second opens with a session start after step 10.
        let mut files: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().contains("tfevents"))
            .collect();
        files.sort();
        assert_eq!(files.len(), 2);
        let events = cohort_tensorboard::read_events(&files[1]).unwrap();
        assert_eq!(events[1].what, cohort_tensorboard::What::SessionStart);
        assert_eq!(events[1].step, 11);
    }

    #[test]
    fn an_unwritable_directory_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        fs::write(&file, "x").unwrap();
        let e = RunLog::open(&file.join("logs"), 0, 0).err().unwrap();
        assert!(e.0.contains("a-file"), "{}", e.0);
    }
}

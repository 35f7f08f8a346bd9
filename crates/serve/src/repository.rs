//! The model repository, laid out as Triton's:
//!
//! ```text
//! REPO/<model>/config.pbtxt | config.toml    optional; defaults without one
//! REPO/<model>/<version>/                    version directories, positive integers
//!     config.json, model.safetensors         a checkpoint as cohort writes it ...
//!     tokenizer.json | vocab.json            ... with its text codec, for generate
//! REPO/<model>/<version>/latest, step-*/     ... or a checkpoint root (its `latest` is served)
//! REPO/<model>/<version>/model.onnx          an ONNX model (platform onnxruntime_onnx)
//! REPO/<model>/<version>/                    empty, for an ensemble (platform ensemble)
//! ```
//!
//! [`Repository::poll`] reconciles what is loaded with what is on disk: the version policy picks
//! versions; a version that is new, or whose checkpoint changed (another `latest`, newer files),
//! or whose model config changed, is loaded before it replaces the old one, so requests keep
//! being answered throughout and requests already queued on a replaced version finish on it. A
//! version that fails to load leaves whatever was serving in place. Models can be loaded and
//! unloaded explicitly (Triton's repository API); an unloaded model stays unloaded across polls
//! until loaded again. A load may carry a configuration that replaces the model's config file
//! until the next load without one. A version that stops being served loses its metrics series.
//!
//! Lookups take a read lock for a map access; loading happens outside it, under a separate
//! lock that serializes polls, loads and unloads. This module never parses requests.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use serde::Serialize;

use crate::backend;
use crate::config::{Kind, ModelConfig};
use crate::error::ServeError;
use crate::metrics::Metrics;
use crate::model::{ensemble, BuildOptions, LoadedVersion, Models, Stamp};

/// One row of the repository index (Triton's `RepositoryIndex`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IndexEntry {
    /// The model.
    pub name: String,
    /// The version; empty for a model-level row.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub version: String,
    /// `READY` or `UNAVAILABLE`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub state: String,
    /// Why it is unavailable.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

#[derive(Clone, Default)]
struct ModelEntry {
    config: Option<Arc<ModelConfig>>,
    versions: BTreeMap<u64, Arc<LoadedVersion>>,
    /// Why a version failed to load, by version.
    errors: BTreeMap<u64, String>,
    /// Why the model as a whole is unusable (bad config, no versions).
    model_error: Option<String>,
    /// Unloaded through the API: polls leave it alone.
    unloaded: bool,
    /// The configuration a load request gave, used instead of the model's config file.
    override_config: Option<Arc<ModelConfig>>,
}

/// The models being served and how to (re)load them.
pub(crate) struct Repository {
    root: PathBuf,
    /// None: every model directory; Some: only these (and those loaded through the API).
    only: Option<Vec<String>>,
    build: BuildOptions,
    /// A model directory without a config file fails to load (Triton's
    /// `--strict-model-config`), instead of being served with the config its files imply.
    strict_config: bool,
    metrics: Arc<Metrics>,
    models: RwLock<BTreeMap<String, ModelEntry>>,
    control: Mutex<()>,
}

impl Repository {
    pub fn new(
        root: PathBuf,
        only: Option<Vec<String>>,
        build: BuildOptions,
        strict_config: bool,
        metrics: Arc<Metrics>,
    ) -> Result<Repository, ServeError> {
        if !root.is_dir() {
            return Err(ServeError::Io {
                op: "open model repository",
                path: root,
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "not a directory"),
            });
        }
        Ok(Repository {
            root,
            only,
            build,
            strict_config,
            metrics,
            models: RwLock::new(BTreeMap::new()),
            control: Mutex::new(()),
        })
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, ModelEntry>> {
        self.models.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, ModelEntry>> {
        self.models.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The version that serves a request for `model` (`version` empty or None: the newest).
    pub fn resolve(
        &self,
        model: &str,
        version: Option<&str>,
    ) -> Result<Arc<LoadedVersion>, ServeError> {
        let models = self.read();
        let entry =
            models
                .get(model)
                .filter(|e| !e.unloaded)
                .ok_or_else(|| ServeError::UnknownModel {
                    model: model.to_string(),
                })?;
        let unknown = |v: &str| ServeError::UnknownVersion {
            model: model.to_string(),
            version: v.to_string(),
            ready: entry.versions.keys().copied().collect(),
        };
        match version.filter(|v| !v.is_empty()) {
            None => {
                entry
                    .versions
                    .values()
                    .next_back()
                    .cloned()
                    .ok_or_else(|| ServeError::NotReady {
                        model: model.to_string(),
                        reason: entry
                            .model_error
                            .clone()
                            .or_else(|| entry.errors.values().next_back().cloned())
                            .unwrap_or_else(|| "no version is loaded".into()),
                    })
            }
            Some(v) => {
                let n: u64 = v.parse().map_err(|_| unknown(v))?;
                entry.versions.get(&n).cloned().ok_or_else(|| unknown(v))
            }
        }
    }

    /// The ready versions of `model`, ascending.
    pub fn versions(&self, model: &str) -> Result<Vec<u64>, ServeError> {
        let models = self.read();
        let entry =
            models
                .get(model)
                .filter(|e| !e.unloaded)
                .ok_or_else(|| ServeError::UnknownModel {
                    model: model.to_string(),
                })?;
        Ok(entry.versions.keys().copied().collect())
    }

    /// The versions being served: of every model (`model` None), of one model, or one version
    /// of it (`version` empty or None: all its versions).
    pub fn served(
        &self,
        model: Option<&str>,
        version: Option<&str>,
    ) -> Result<Vec<Arc<LoadedVersion>>, ServeError> {
        let models = self.read();
        match (
            model.filter(|m| !m.is_empty()),
            version.filter(|v| !v.is_empty()),
        ) {
            (None, None) => Ok(models
                .values()
                .filter(|e| !e.unloaded)
                .flat_map(|e| e.versions.values().cloned())
                .collect()),
            (None, Some(v)) => Err(ServeError::malformed(format!(
                "version {v:?} given without a model name"
            ))),
            (Some(m), v) => {
                let entry = models.get(m).filter(|e| !e.unloaded).ok_or_else(|| {
                    ServeError::UnknownModel {
                        model: m.to_string(),
                    }
                })?;
                match v {
                    None => Ok(entry.versions.values().cloned().collect()),
                    Some(_) => {
                        drop(models);
                        Ok(vec![self.resolve(m, v)?])
                    }
                }
            }
        }
    }

    /// Every model directory and every loaded or failed version, with its state.
    pub fn index(&self, ready_only: bool) -> Vec<IndexEntry> {
        let models = self.read();
        let mut names: Vec<String> = self.model_dirs();
        names.extend(models.keys().cloned());
        names.sort();
        names.dedup();
        let mut out = Vec::new();
        for name in names {
            let row = |version: String, state: &str, reason: String| IndexEntry {
                name: name.clone(),
                version,
                state: state.into(),
                reason,
            };
            match models.get(&name) {
                Some(e) if !e.unloaded => {
                    for v in e.versions.keys() {
                        out.push(row(v.to_string(), "READY", String::new()));
                    }
                    for (v, why) in &e.errors {
                        if !e.versions.contains_key(v) {
                            out.push(row(v.to_string(), "UNAVAILABLE", why.clone()));
                        }
                    }
                    if e.versions.is_empty() && e.errors.is_empty() {
                        let why = e
                            .model_error
                            .clone()
                            .unwrap_or("no version is loaded".into());
                        out.push(row(String::new(), "UNAVAILABLE", why));
                    }
                }
                Some(_) => out.push(row(String::new(), "UNAVAILABLE", "unloaded".into())),
                None => out.push(row(String::new(), "", String::new())),
            }
        }
        if ready_only {
            out.retain(|e| e.state == "READY");
        }
        out
    }

    /// The models this server was asked to serve (those named at start, or every model
    /// directory; not those unloaded through the API) that are not ready, with why.
    pub fn not_ready(&self) -> Vec<(String, String)> {
        let mut names = match &self.only {
            Some(only) => only.clone(),
            None => self.model_dirs(),
        };
        let models = self.read();
        names.extend(
            models
                .iter()
                .filter(|(_, e)| !e.unloaded)
                .map(|(n, _)| n.clone()),
        );
        names.sort();
        names.dedup();
        names
            .into_iter()
            .filter(|n| !models.get(n).is_some_and(|e| e.unloaded))
            .filter_map(|n| {
                let why = match models.get(&n) {
                    None if !self.root.join(&n).is_dir() => {
                        format!("no model directory {}", self.root.join(&n).display())
                    }
                    None => "not loaded".to_string(),
                    Some(e) if !e.versions.is_empty() => return None,
                    Some(e) => (e.model_error.clone())
                        .or_else(|| e.errors.values().next_back().cloned())
                        .unwrap_or_else(|| "no version is loaded".into()),
                };
                Some((n, why))
            })
            .collect()
    }

    /// The model table Triton prints at startup: every model and version with its state and,
    /// when it is not ready, why.
    pub fn table(&self) -> String {
        let mut rows: Vec<[String; 4]> = self
            .index(false)
            .into_iter()
            .map(|e| {
                let state = if e.state.is_empty() {
                    "UNLOADED".into()
                } else {
                    e.state
                };
                [e.name, e.version, state, e.reason]
            })
            .collect();
        // a model named at start whose directory does not exist
        for (name, why) in self.not_ready() {
            if !rows.iter().any(|r| r[0] == name) {
                rows.push([name, String::new(), "UNAVAILABLE".into(), why]);
            }
        }
        let head = ["Model", "Version", "Status", "Reason"].map(String::from);
        let width = |i: usize| {
            rows.iter()
                .chain([&head])
                .map(|r| r[i].len())
                .max()
                .unwrap_or(0)
        };
        let widths = [width(0), width(1), width(2), width(3)];
        let line = |r: &[String; 4]| {
            let cells: Vec<String> = (0..4)
                .map(|i| format!("{:w$}", r[i], w = widths[i]))
                .collect();
            format!("| {} |", cells.join(" | "))
        };
        let rule = format!("+{}+", widths.map(|w| "-".repeat(w + 2)).join("+"));
        let mut out = vec![rule.clone(), line(&head), rule.clone()];
        if rows.is_empty() {
            out.push(format!("| {:w$} |", "(no models)", w = rule.len() - 4));
        }
        out.extend(rows.iter().map(line));
        out.push(rule);
        out.join("\n")
    }

    /// Names of the model directories in the repository.
    fn model_dirs(&self) -> Vec<String> {
        let Ok(rd) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut names: Vec<String> = rd
            .flatten()
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| !n.starts_with('.'))
            .collect();
        names.sort();
        names
    }

    fn control(&self) -> std::sync::MutexGuard<'_, ()> {
        self.control.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Brings what is loaded in line with the disk (blocking: loads checkpoints).
    pub fn poll(&self) {
        let _guard = self.control();
        let dirs = self.model_dirs();
        let known: Vec<(String, bool)> = self
            .read()
            .iter()
            .map(|(n, e)| (n.clone(), e.unloaded))
            .collect();
        for name in &dirs {
            let entry = known.iter().find(|(n, _)| n == name);
            let wanted = match entry {
                Some((_, unloaded)) => !unloaded,
                None => self.only.as_ref().is_none_or(|o| o.contains(name)),
            };
            if wanted {
                let _ = self.reconcile(name);
            }
        }
        // a model directory that disappeared is unloaded
        let gone: Vec<String> = known
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| !dirs.contains(n))
            .collect();
        if !gone.is_empty() {
            let mut models = self.write();
            for n in gone {
                tracing::info!(model = %n, "model directory removed; unloading");
                if let Some(e) = models.remove(&n) {
                    self.forget_metrics(&n, e.versions.keys());
                }
            }
        }
    }

    /// Loads (or reloads) `model` through the repository API, with `config` instead of its
    /// config file if given (until the next load without one).
    pub fn load(&self, model: &str, config: Option<ModelConfig>) -> Result<(), ServeError> {
        let _guard = self.control();
        if !valid_name(model) || !self.root.join(model).is_dir() {
            return Err(ServeError::UnknownModel {
                model: model.to_string(),
            });
        }
        let config = config
            .map(|c| check_name(c, model, None))
            .transpose()?
            .map(Arc::new);
        let previous = {
            let mut models = self.write();
            let e = models.entry(model.to_string()).or_default();
            e.unloaded = false;
            std::mem::replace(&mut e.override_config, config)
        };
        let out = self.reconcile(model);
        if out.is_err() {
            // an override that loaded nothing is not kept: later polls use what was used before
            if let Some(e) = self.write().get_mut(model) {
                e.override_config = previous;
            }
        }
        out
    }

    fn forget_metrics<'a>(&self, model: &str, versions: impl Iterator<Item = &'a u64>) {
        for &v in versions {
            self.metrics.remove(model, v);
        }
    }

    /// Unloads `model`: it stops taking requests; queued ones finish.
    pub fn unload(&self, model: &str) -> Result<(), ServeError> {
        let _guard = self.control();
        let mut models = self.write();
        let entry = models
            .get_mut(model)
            .filter(|e| !e.unloaded)
            .ok_or_else(|| ServeError::UnknownModel {
                model: model.to_string(),
            })?;
        let old = std::mem::replace(
            entry,
            ModelEntry {
                unloaded: true,
                ..ModelEntry::default()
            },
        );
        self.forget_metrics(model, old.versions.keys());
        tracing::info!(model, "unloaded");
        Ok(())
    }

    /// Drops every model (their instances drain their queues and exit).
    pub fn close(&self) {
        self.write().clear();
    }

    /// Loads what `model`'s directory asks for and swaps it in. Errs when the model ends up
    /// with no ready version.
    fn reconcile(&self, model: &str) -> Result<(), ServeError> {
        let dir = self.root.join(model);
        let old = self.read().get(model).cloned().unwrap_or_default();
        let from_disk = || {
            let (c, file) = ModelConfig::load(&dir)?;
            if self.strict_config && file.is_none() {
                return Err(ServeError::Config {
                    path: dir.clone(),
                    reason: "no config.pbtxt or config.toml, which --strict-model-config true \
                             requires"
                        .into(),
                });
            }
            check_name(c, model, file)
        };
        let cfg = match old
            .override_config
            .clone()
            .map_or_else(from_disk, |c| Ok((*c).clone()))
        {
            Ok(c) => Arc::new(c),
            Err(e) => {
                let msg = e.to_string();
                if old.model_error.as_deref() != Some(msg.as_str()) {
                    if old.versions.is_empty() {
                        tracing::error!(model, error = %msg, "model config unusable; the model is not loaded");
                    } else {
                        tracing::error!(model, error = %msg, "model config unusable; keeping the versions loaded before");
                    }
                }
                let mut models = self.write();
                let entry = models.entry(model.to_string()).or_default();
                entry.model_error = Some(msg);
                return Err(e);
            }
        };
        if old.config.as_deref() != Some(&*cfg) && !cfg.ignored.is_empty() {
            tracing::warn!(model, ignored = ?cfg.ignored_fields(), "config fields not used by cohort");
        }
        let config_changed = old.config.as_ref().is_some_and(|c| **c != *cfg);
        // an ensemble that reaches itself through the ensembles loaded so far is refused here
        // (the one loaded last in a loop is the one refused); requests catch what slips past
        let cycle = (cfg.kind() == Ok(Kind::Ensemble))
            .then(|| {
                let models = self.read();
                let config_of = |m: &str| {
                    models
                        .get(m)
                        .and_then(|e| e.config.as_deref())
                        .filter(|c| c.kind() == Ok(Kind::Ensemble))
                };
                ensemble::load_cycle(model, &cfg, &config_of)
            })
            .flatten();
        let present = version_dirs(&dir);
        let wanted = cfg.version_policy.select(&present);
        let mut versions = BTreeMap::new();
        let mut errors = BTreeMap::new();
        let mut first_err = None;
        for &v in &wanted {
            let vdir = dir.join(v.to_string());
            if let Some(cur) = old.versions.get(&v) {
                if !config_changed && Stamp::of(&vdir, cur.kind).as_ref() == Some(&cur.stamp) {
                    versions.insert(v, cur.clone());
                    continue;
                }
            }
            let loaded = match &cycle {
                Some(loop_) => Err(backend::Version { model, version: v }.error(format!(
                    "ensembles may not reach themselves through their steps: {loop_}"
                ))),
                None => {
                    let metrics = self.metrics.version(model, v);
                    LoadedVersion::load(model, v, &vdir, &cfg, self.build, metrics)
                }
            };
            match loaded {
                Ok(lv) => {
                    tracing::info!(model, version = v, platform = lv.kind.platform(),
                        instances = lv.instances, dir = %lv.stamp.dir.display(), "loaded");
                    versions.insert(v, Arc::new(lv));
                }
                Err(e) => {
                    let msg = e.to_string();
                    if old.errors.get(&v) != Some(&msg) {
                        tracing::error!(model, version = v, error = %msg, "load failed");
                    }
                    errors.insert(v, msg);
                    first_err.get_or_insert(e);
                    // the copy that was serving keeps serving
                    if let Some(cur) = old.versions.get(&v) {
                        versions.insert(v, cur.clone());
                    }
                }
            }
        }
        if versions.is_empty() && !errors.is_empty() {
            // none of the wanted versions loaded: keep serving what was there
            versions = old.versions.clone();
        }
        for v in old.versions.keys().filter(|v| !versions.contains_key(v)) {
            tracing::info!(
                model,
                version = v,
                "unloading (queued requests finish first)"
            );
            self.metrics.remove(model, *v);
        }
        let model_error = match (wanted.is_empty(), present.is_empty()) {
            (false, _) => None,
            (true, true) => Some(no_version_reason(&dir)),
            (true, false) => Some(format!(
                "no version directory matches the version policy (present: {present:?})"
            )),
        };
        if let Some(why) = model_error
            .as_ref()
            .filter(|&m| old.model_error.as_ref() != Some(m))
        {
            tracing::error!(model, error = %why, "model not loaded");
        }
        let ready = !versions.is_empty();
        self.write().insert(
            model.to_string(),
            ModelEntry {
                config: Some(cfg),
                versions,
                errors,
                model_error: model_error.clone(),
                unloaded: false,
                override_config: old.override_config.clone(),
            },
        );
        match (ready, first_err, model_error) {
            (true, _, _) => Ok(()),
            (false, Some(e), _) => Err(e),
            (false, None, reason) => Err(ServeError::NotReady {
                model: model.to_string(),
                reason: reason.unwrap_or_default(),
            }),
        }
    }
}

impl Models for Repository {
    fn resolve(
        &self,
        model: &str,
        version: Option<&str>,
    ) -> Result<Arc<LoadedVersion>, ServeError> {
        Repository::resolve(self, model, version)
    }
}

/// A model name that is a plain directory name.
fn valid_name(name: &str) -> bool {
    !name.is_empty() && !name.starts_with('.') && !name.contains(['/', '\\'])
}

fn check_name(
    cfg: ModelConfig,
    model: &str,
    file: Option<PathBuf>,
) -> Result<ModelConfig, ServeError> {
    match &cfg.name {
        Some(n) if n != model => Err(ServeError::Config {
            path: file.unwrap_or_default(),
            reason: format!("name {n:?} differs from the model directory's name {model:?}"),
        }),
        _ => Ok(cfg),
    }
}

/// Why model directory `dir` has no version to load: it has no directory named by a positive
/// integer, with what it has instead (`v1`, a checkpoint's files at the top).
fn no_version_reason(dir: &Path) -> String {
    let mut found: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| !n.starts_with('.') && !matches!(n.as_str(), "config.pbtxt" | "config.toml"))
        .collect();
    found.sort();
    let found = if found.is_empty() {
        "it has none".to_string()
    } else {
        format!("it has {}", found.join(", "))
    };
    format!(
        "no version directory: a model's versions are directories named 1, 2, ... ({}/1/model \
         files); {found}",
        dir.display()
    )
}

/// The version directories of model directory `dir` (positive integer names).
fn version_dirs(dir: &Path) -> Vec<u64> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<u64> = rd
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().to_str()?.parse::<u64>().ok())
        .filter(|&n| n > 0)
        .collect();
    v.sort_unstable();
    v
}

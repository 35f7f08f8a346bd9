//! ONNX models on the ONNX Runtime library itself, when the user has it (Triton's own ONNX
//! backend is onnxruntime), with tract ([`onnx`](super::onnx)) as the pure-Rust fallback. The
//! library is loaded at run time, never linked or downloaded at build time: from
//! `ORT_DYLIB_PATH` when set, else `libonnxruntime.so` on the system library paths, else an
//! installed `onnxruntime` Python wheel's `onnxruntime/capi/libonnxruntime.so*` (in python3's
//! `sys.path`). Which runtime serves a model: the config's `parameters { key: "backend" }`, else
//! `COHORT_ONNX_BACKEND`, each `auto` (the default: onnxruntime when it loads, else tract),
//! `onnxruntime` or `tract`. A library that cannot be loaded, or a model it refuses, is one line
//! naming the path and the reason: the load's error when onnxruntime was asked for, a warning
//! before tract serves under `auto`. Each load prints one line: model, runtime, library path
//! and version, threads.
//!
//! Sessions get onnxruntime's default options (full graph optimization, sequential execution,
//! spinning intra-op pool) but for the intra-op thread count, which is the instance's threads
//! as tract gets them. A profile ([`Backend::profile`]) runs its own session with onnxruntime's
//! profiler on. This module never reads a request off the wire and never writes to the
//! repository.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use ort::environment::Environment;
use ort::memory::Allocator;
use ort::session::{Session, SessionInputValue};
use ort::value::{DynTensor, DynTensorValueType, TensorElementType, ValueType};

use super::onnx::{batch_spec, unserved, MODEL_FILE};
use super::profile::{OpProfile, Tally};
use super::{Backend, Instance, Loaded, Version};
use crate::config::{ModelConfig, ONNX_BACKEND};
use crate::error::ServeError;
use crate::tensor::{DataType, Tensor, TensorSpec};
use crate::text::TextCodec;

/// The environment variable that picks the ONNX runtime when a config does not.
pub const BACKEND_ENV: &str = "COHORT_ONNX_BACKEND";

/// Which runtime executes an ONNX model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Choice {
    /// onnxruntime when its library loads and takes the model, else tract.
    Auto,
    /// tract only.
    Tract,
    /// onnxruntime only: a library that does not load fails the model's load.
    OnnxRuntime,
}

impl Choice {
    /// The choice a `backend` parameter or [`BACKEND_ENV`] value names.
    pub fn parse(s: &str) -> Option<Choice> {
        match s {
            "auto" => Some(Choice::Auto),
            "tract" => Some(Choice::Tract),
            "onnxruntime" => Some(Choice::OnnxRuntime),
            _ => None,
        }
    }

    /// The choice for `cfg`: its `backend` parameter, else [`BACKEND_ENV`], else auto.
    fn of(cfg: &ModelConfig) -> Result<Choice, String> {
        if let Some(v) = cfg.parameters.get(ONNX_BACKEND) {
            return Choice::parse(v).ok_or_else(|| {
                format!("parameter {ONNX_BACKEND} is {v:?}; it takes auto, tract or onnxruntime")
            });
        }
        match std::env::var(BACKEND_ENV) {
            Ok(v) if !v.is_empty() => Choice::parse(&v)
                .ok_or_else(|| format!("{BACKEND_ENV}={v:?}: expected auto, tract or onnxruntime")),
            _ => Ok(Choice::Auto),
        }
    }
}

/// The loaded library, once per process (onnxruntime's API table is process-wide).
struct Runtime {
    path: PathBuf,
    version: String,
    env: Environment,
}

/// The library, loaded on first use; the error says which path failed and why.
fn runtime() -> Result<&'static Runtime, String> {
    static RUNTIME: OnceLock<Result<Runtime, String>> = OnceLock::new();
    // one loader at a time: ort keeps the first library that loads
    static LOADING: Mutex<()> = Mutex::new(());
    let _one = LOADING.lock().unwrap_or_else(|e| e.into_inner());
    RUNTIME.get_or_init(open).as_ref().map_err(Clone::clone)
}

/// Finds and loads the library: `ORT_DYLIB_PATH` alone when set, else the system's, else a
/// Python wheel's.
fn open() -> Result<Runtime, String> {
    if let Some(p) = std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        return open_at(Path::new(&p)).map_err(|e| format!("ORT_DYLIB_PATH: {e}"));
    }
    let system = Path::new("libonnxruntime.so");
    let mut tried = Vec::new();
    match open_at(system) {
        Ok(r) => return Ok(r),
        Err(e) => tried.push(e),
    }
    let wheel = wheel_library();
    match &wheel {
        Some(p) => match open_at(p) {
            Ok(r) => return Ok(r),
            Err(e) => tried.push(e),
        },
        None => tried.push("no onnxruntime Python wheel in python3's sys.path".into()),
    }
    Err(format!(
        "no ONNX Runtime library (set ORT_DYLIB_PATH to libonnxruntime.so): {}",
        tried.join("; ")
    ))
}

/// Loads the library at `path` (a bare file name: the system's search) and checks its version.
fn open_at(path: &Path) -> Result<Runtime, String> {
    let shown = path.display();
    let builder = ort::init_from(path).map_err(|e| match e {
        // libloading keeps dlerror's text (which file is missing) in the error's source
        ort::LoadDynamicError::Dlopen { error, .. } => match std::error::Error::source(&error) {
            Some(why) => format!("{shown}: {error}: {why}"),
            None => format!("{shown}: {error}"),
        },
        other => format!("{shown}: {other}"),
    })?;
    let env = builder
        .with_name("cohort")
        .build()
        .map_err(|e| format!("{shown}: {e}"))?;
    let resolved = mapped_path("libonnxruntime.so").unwrap_or_else(|| path.to_path_buf());
    let version = library_version(&resolved).unwrap_or_else(|| "of unknown version".into());
    Ok(Runtime {
        path: resolved,
        version,
        env,
    })
}

/// The file a loaded library whose name starts with `stem` was mapped from (the system's
/// search resolves a bare name to it), from /proc/self/maps.
fn mapped_path(stem: &str) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            Path::new(p)
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(stem))
        })
        .map(PathBuf::from)
}

/// The release of the library at `path` ("1.32.0"), from its `OrtGetApiBase`; ort does not
/// say it.
fn library_version(path: &Path) -> Option<String> {
    // SAFETY: the library is the one ort has just loaded from this file, so opening it again
    // only takes another reference (its initializers ran already); the handle outlives every
    // use of its symbol below.
    let lib = unsafe { libloading::Library::new(path) }.ok()?;
    type GetApiBase = unsafe extern "C" fn() -> *const ort::sys::OrtApiBase;
    // SAFETY: `OrtGetApiBase` has this signature in every onnxruntime release (its C API).
    let get = unsafe { lib.get::<GetApiBase>(b"OrtGetApiBase") }.ok()?;
    // SAFETY: it returns a pointer to a static table, or null.
    let base = unsafe { get() };
    if base.is_null() {
        return None;
    }
    // SAFETY: `base` is the library's static table; GetVersionString returns a static
    // NUL-terminated string.
    let text = unsafe { std::ffi::CStr::from_ptr(((*base).GetVersionString)()) };
    text.to_str().ok().map(str::to_string)
}

/// `onnxruntime/capi/libonnxruntime.so*` in the first of python3's `sys.path` entries that has
/// one, if python3 runs.
fn wheel_library() -> Option<PathBuf> {
    let out = std::process::Command::new("python3")
        .args(["-c", "import sys; print('\\n'.join(sys.path))"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    let paths = String::from_utf8(out.stdout).ok()?;
    paths.lines().filter(|l| !l.is_empty()).find_map(|dir| {
        let capi = Path::new(dir).join("onnxruntime").join("capi");
        let mut libs: Vec<PathBuf> = std::fs::read_dir(&capi)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("libonnxruntime.so"))
            })
            .collect();
        // the versioned file, not a providers library or a dangling link
        libs.sort();
        libs.into_iter().next_back()
    })
}

/// Loads `model.onnx` on the runtime `cfg` (or the environment) picks, printing one line that
/// says which.
pub(crate) fn load(
    what: &Version<'_>,
    version_dir: &Path,
    cfg: &ModelConfig,
    count: usize,
    threads: usize,
) -> Result<Loaded, ServeError> {
    let choice = Choice::of(cfg).map_err(|e| what.error(e))?;
    let path = version_dir.join(MODEL_FILE);
    if !path.is_file() {
        return Err(what.error(format!(
            "{MODEL_FILE}: not found in {}",
            version_dir.display()
        )));
    }
    if choice != Choice::Tract {
        let tried = runtime()
            .map_err(Unusable::Runtime)
            .and_then(|rt| load_ort(rt, &path, cfg, count, threads).map(|l| (rt, l)));
        match tried {
            Ok((rt, loaded)) => {
                tracing::info!(
                    model = what.model,
                    version = what.version,
                    backend = "onnxruntime",
                    library = %rt.path.display(),
                    library_version = %rt.version,
                    threads,
                    "ONNX backend"
                );
                return Ok(loaded);
            }
            // the model disagrees with its config: no runtime would serve it
            Err(Unusable::Config(e)) => return Err(what.error(format!("{MODEL_FILE}: {e}"))),
            Err(Unusable::Runtime(e)) if choice == Choice::OnnxRuntime => {
                return Err(what.error(format!("onnxruntime: {e}")))
            }
            Err(Unusable::Runtime(e)) if first_time(&e) => tracing::warn!(
                model = what.model,
                version = what.version,
                "onnxruntime: {e}; tract serves the model"
            ),
            Err(Unusable::Runtime(_)) => {}
        }
    }
    let loaded = super::onnx::load(what, version_dir, cfg, count, threads)?;
    tracing::info!(
        model = what.model,
        version = what.version,
        backend = "tract",
        threads,
        "ONNX backend"
    );
    Ok(loaded)
}

/// Whether `warning` is new to this process: a model that fails to load is retried at each
/// repository poll, and says why once (as the repository's load errors do).
fn first_time(warning: &str) -> bool {
    static SAID: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
    if said.iter().any(|s| s == warning) {
        return false;
    }
    said.push(warning.to_string());
    true
}

/// Why onnxruntime does not serve a model.
enum Unusable {
    /// The library did not load, or refused the model: tract may serve it.
    Runtime(String),
    /// The model's tensors disagree with its config: neither runtime serves it.
    Config(String),
}

/// A model loaded by onnxruntime.
struct OrtBackend {
    inputs: Vec<TensorSpec>,
    outputs: Vec<TensorSpec>,
    describe: String,
    /// What a profile's own session is made of.
    rt: &'static Runtime,
    path: PathBuf,
    threads: usize,
}

impl Backend for OrtBackend {
    fn inputs(&self) -> &[TensorSpec] {
        &self.inputs
    }

    fn outputs(&self) -> &[TensorSpec] {
        &self.outputs
    }

    fn text(&self) -> Result<TextCodec, String> {
        Err("an ONNX model does not generate text".into())
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }

    /// Runs a session made with onnxruntime's profiler on: it writes a Chrome trace whose
    /// "Node" events are each kernel's time (`args.op_name`, `dur` in µs), read back here and
    /// deleted. The first run is untimed.
    fn profile(&self, inputs: &[Tensor], runs: usize) -> Result<OpProfile, String> {
        static PROFILES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = PROFILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let prefix =
            std::env::temp_dir().join(format!("cohort-ort-profile-{}-{n}", std::process::id()));
        let mut session = Session::builder(&self.rt.env)
            .and_then(|b| b.with_intra_threads(self.threads).map_err(Into::into))
            .and_then(|b| b.with_profiling(&prefix).map_err(Into::into))
            .and_then(|mut b| b.commit_from_file(&self.path))
            .map_err(|e| format!("{}: {e}", self.path.display()))?;
        let allocator = Allocator::default();
        let mut walls = Vec::with_capacity(runs);
        let mut ran = Ok(());
        for i in 0..=runs {
            let started = Instant::now();
            ran = ort_values(&allocator, inputs).and_then(|values| {
                session
                    .run(values.as_slice())
                    .map(drop)
                    .map_err(|e| e.to_string())
            });
            if ran.is_err() {
                break;
            }
            if i > 0 {
                walls.push(started.elapsed().as_secs_f64());
            }
        }
        // the trace is written when profiling ends (or the session is dropped): end it and
        // delete it whether the runs succeeded or not
        let file = session.end_profiling().map_err(|e| e.to_string())?;
        let text = std::fs::read_to_string(&file);
        let _ = std::fs::remove_file(&file);
        ran?;
        let text = text.map_err(|e| format!("onnxruntime's profile {file}: {e}"))?;
        let mut tally =
            tally_trace(&text).map_err(|e| format!("onnxruntime's profile {file}: {e}"))?;
        for w in walls {
            tally.run(w);
        }
        let rows = inputs.first().map_or(0, |t| t.shape[0]);
        Ok(tally.finish("onnxruntime", rows))
    }
}

/// The kernel times of onnxruntime's profile `trace` (a JSON array of Chrome trace events),
/// but for the first run's.
fn tally_trace(trace: &str) -> Result<Tally, String> {
    use serde_json::Value;
    let events: Vec<Value> = serde_json::from_str(trace).map_err(|e| e.to_string())?;
    let field = |e: &Value, k: &str| e.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    let text = |e: &Value, k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    // each run's span, in µs: the events of a run fall inside its "model_run"
    let mut spans: Vec<(f64, f64)> = events
        .iter()
        .filter(|e| text(e, "cat") == "Session" && text(e, "name") == "model_run")
        .map(|e| (field(e, "ts"), field(e, "ts") + field(e, "dur")))
        .collect();
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut tally = Tally::default();
    let mut nth_in_run = vec![0usize; spans.len()];
    for e in &events {
        let name = text(e, "name");
        let Some(node) = name.strip_suffix("_kernel_time") else {
            continue;
        };
        if text(e, "cat") != "Node" {
            continue;
        }
        let ts = field(e, "ts");
        let Some(run) = spans.iter().position(|&(a, b)| ts >= a && ts <= b) else {
            continue;
        };
        nth_in_run[run] += 1;
        if run == 0 {
            continue;
        }
        let op = e
            .get("args")
            .and_then(|a| a.get("op_name"))
            .and_then(Value::as_str)
            .unwrap_or("?");
        // an unnamed node is told apart by its place in the run
        let node = if node.is_empty() {
            format!("#{}", nth_in_run[run])
        } else {
            node.to_string()
        };
        tally.node(op, &node, field(e, "dur") * 1e-6);
    }
    Ok(tally)
}

/// One instance: its own session (onnxruntime's run is not `&self` in ort).
struct OrtInstance {
    session: Session,
    allocator: Allocator,
    outputs: Vec<TensorSpec>,
}

/// Builds `count` sessions of `threads` intra-op threads each over the model at `path`.
fn load_ort(
    rt: &'static Runtime,
    path: &Path,
    cfg: &ModelConfig,
    count: usize,
    threads: usize,
) -> Result<Loaded, Unusable> {
    let refused = |e: String| {
        Unusable::Runtime(format!(
            "{} refuses {}: {e}",
            rt.path.display(),
            path.display()
        ))
    };
    let mut sessions = Vec::with_capacity(count);
    for _ in 0..count.max(1) {
        let session = Session::builder(&rt.env)
            .and_then(|b| b.with_intra_threads(threads).map_err(Into::into))
            .and_then(|mut b| b.commit_from_file(path))
            .map_err(|e| refused(e.to_string().replace('\n', " ")))?;
        sessions.push(session);
    }
    let first = &sessions[0];
    let specs = |direction: &str, outlets: &[ort::value::Outlet]| {
        outlets
            .iter()
            .map(|o| outlet_spec(direction, o.name(), o.dtype()))
            .collect::<Result<Vec<_>, String>>()
    };
    let inputs = specs("input", first.inputs()).map_err(&refused)?;
    let outputs = specs("output", first.outputs()).map_err(&refused)?;
    if inputs.is_empty() {
        return Err(refused("the model has no inputs".into()));
    }
    let backend = OrtBackend {
        inputs,
        outputs,
        describe: format!(
            "onnxruntime {} ({}), {threads} thread(s) per instance",
            rt.version,
            rt.path.display()
        ),
        rt,
        path: path.to_path_buf(),
        threads,
    };
    super::check_declared(cfg, &backend).map_err(|e| Unusable::Config(format!("config {e}")))?;
    let instances = sessions
        .into_iter()
        .take(count)
        .map(|session| {
            Box::new(OrtInstance {
                session,
                allocator: Allocator::default(),
                outputs: backend.outputs.clone(),
            }) as Box<dyn Instance>
        })
        .collect();
    Ok(Loaded {
        backend: Box::new(backend),
        instances,
    })
}

/// The spec of a session input or output.
fn outlet_spec(direction: &str, name: &str, ty: &ValueType) -> Result<TensorSpec, String> {
    let ValueType::Tensor { ty, shape, .. } = ty else {
        return Err(format!("{direction} {name:?} is a {ty}, not a tensor"));
    };
    let datatype = DataType::ALL
        .into_iter()
        .find(|&d| element(d) == Some(*ty))
        .ok_or_else(|| {
            unserved(
                direction,
                name,
                &ty.to_string(),
                DataType::ALL.into_iter().filter(|&d| element(d).is_some()),
            )
        })?;
    batch_spec(direction, name, datatype, shape.to_vec())
}

/// onnxruntime's element type of `d`; None for BYTES (strings are not laid out as bytes).
fn element(d: DataType) -> Option<TensorElementType> {
    Some(match d {
        DataType::Bool => TensorElementType::Bool,
        DataType::Uint8 => TensorElementType::Uint8,
        DataType::Int8 => TensorElementType::Int8,
        DataType::Int16 => TensorElementType::Int16,
        DataType::Int32 => TensorElementType::Int32,
        DataType::Int64 => TensorElementType::Int64,
        DataType::Uint16 => TensorElementType::Uint16,
        DataType::Uint32 => TensorElementType::Uint32,
        DataType::Uint64 => TensorElementType::Uint64,
        DataType::Fp16 => TensorElementType::Float16,
        DataType::Fp32 => TensorElementType::Float32,
        DataType::Fp64 => TensorElementType::Float64,
        DataType::Bytes => return None,
    })
}

/// `inputs` as onnxruntime's values, allocated with `allocator`.
fn ort_values(
    allocator: &Allocator,
    inputs: &[Tensor],
) -> Result<Vec<SessionInputValue<'static>>, String> {
    let mut values: Vec<SessionInputValue<'static>> = Vec::with_capacity(inputs.len());
    for t in inputs {
        let ty = element(t.datatype)
            .ok_or_else(|| format!("input of type {} reached the ONNX backend", t.datatype))?;
        let mut value =
            DynTensor::new(allocator, ty, t.shape.clone()).map_err(|e| e.to_string())?;
        if !t.data.is_empty() {
            let dst = value.data_ptr_mut().cast::<u8>();
            // SAFETY: the tensor was just allocated on the CPU with t.shape and t's element
            // type, so it holds exactly t.data.len() bytes (the batcher checked the request's
            // byte size against its shape and type, a profile's caller its own); the regions
            // are distinct.
            unsafe { std::ptr::copy_nonoverlapping(t.data.as_ptr(), dst, t.data.len()) };
        }
        values.push(value.into_dyn().into());
    }
    Ok(values)
}

impl Instance for OrtInstance {
    fn execute(&mut self, inputs: &[Tensor], want: &[bool]) -> Result<Vec<Option<Tensor>>, String> {
        let values = ort_values(&self.allocator, inputs)?;
        let rows = inputs.first().map_or(0, |t| t.shape[0]);
        let outs = self
            .session
            .run(values.as_slice())
            .map_err(|e| e.to_string())?;
        let mut answer = Vec::with_capacity(self.outputs.len());
        for ((i, spec), &wanted) in self.outputs.iter().enumerate().zip(want) {
            if !wanted {
                answer.push(None);
                continue;
            }
            let out = &outs[i];
            let ValueType::Tensor { ty, shape, .. } = out.dtype() else {
                return Err(format!("output {:?} is not a tensor", spec.name));
            };
            if element(spec.datatype) != Some(*ty) {
                return Err(format!(
                    "output {:?} came out as {ty}, the model declares {}",
                    spec.name, spec.datatype
                ));
            }
            let shape: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
            if shape.first() != Some(&rows) {
                return Err(format!(
                    "output {:?} has shape {shape:?}, not {rows} rows like the inputs",
                    spec.name
                ));
            }
            let len = ty
                .byte_size(shape.iter().product())
                .ok_or_else(|| format!("output {:?}: element type {ty} has no size", spec.name))?;
            let tensor = out
                .view()
                .downcast::<DynTensorValueType>()
                .map_err(|e| format!("output {:?}: {e}", spec.name))?;
            let src = tensor.data_ptr().cast::<u8>();
            let data = if len == 0 {
                Vec::new()
            } else {
                // SAFETY: a CPU tensor of `shape` and element type `ty` (checked above) holds
                // `len` bytes at its data pointer, alive while `outs` is.
                unsafe { std::slice::from_raw_parts(src, len) }.to_vec()
            };
            answer.push(Some(Tensor {
                datatype: spec.datatype,
                shape,
                data,
            }));
        }
        Ok(answer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_parse() {
        assert_eq!(Choice::parse("auto"), Some(Choice::Auto));
        assert_eq!(Choice::parse("tract"), Some(Choice::Tract));
        assert_eq!(Choice::parse("onnxruntime"), Some(Choice::OnnxRuntime));
        assert_eq!(Choice::parse("ort"), None);
    }
}

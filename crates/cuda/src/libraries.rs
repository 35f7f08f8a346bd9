//! Finding the CUDA libraries and headers where users have them, and opening them before
//! cudarc's first call.
//!
//! cudarc loads each library lazily, by bare file name, and panics when none of its names
//! opens. So every library is looked for here first, in this order: the directories of
//! `COHORT_CUDA_LIB_DIRS` (colon-separated), `LD_LIBRARY_PATH`, the `nvidia/*/lib` folders of
//! the Python environments (the venv in `VIRTUAL_ENV`, then the site-packages of
//! `$COHORT_PYTHON` or `python3`: `pip install torch` puts CUDA 13 in `nvidia/cu13/lib` and
//! NCCL in `nvidia/nccl/lib`), the system directories, then the `ldconfig` cache. A found
//! library is opened by its absolute path with `RTLD_GLOBAL`, so that cudarc's open of the
//! same soname returns it; `libnvrtc-builtins` is opened before `libnvrtc`, which loads it.
//!
//! This module must never call into cudarc (a missing library would panic there), and never
//! close what it opened: cudarc keeps symbols from these handles for the process's life.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::CudaError;

/// The libraries this crate uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Library {
    /// The driver (`libcuda.so.1`): ships with the GPU driver, never in a wheel.
    Driver,
    /// NVRTC's builtins, which `libnvrtc` loads at its first compile.
    NvrtcBuiltins,
    /// NVRTC, the run-time CUDA C++ compiler.
    Nvrtc,
    /// cuBLAS.
    Cublas,
    /// cuBLASLt.
    CublasLt,
    /// NCCL.
    Nccl,
}

impl Library {
    /// Every library, in the order they must be opened.
    pub const ALL: [Library; 6] = [
        Library::Driver,
        Library::NvrtcBuiltins,
        Library::Nvrtc,
        Library::CublasLt,
        Library::Cublas,
        Library::Nccl,
    ];

    /// What the library is for, as an error names it ("no GPU/driver: ...").
    pub fn what(self) -> &'static str {
        match self {
            Library::Driver => "GPU/driver",
            Library::NvrtcBuiltins => "NVRTC builtins",
            Library::Nvrtc => "NVRTC",
            Library::Cublas => "cuBLAS",
            Library::CublasLt => "cuBLASLt",
            Library::Nccl => "NCCL",
        }
    }

    /// The file names tried, best first. A name ending in `*` is a prefix.
    fn file_names(self) -> &'static [&'static str] {
        match self {
            Library::Driver => &["libcuda.so.1", "libcuda.so"],
            Library::NvrtcBuiltins => &["libnvrtc-builtins.so.13*", "libnvrtc-builtins.so*"],
            Library::Nvrtc => &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"],
            Library::Cublas => &["libcublas.so.13", "libcublas.so.12", "libcublas.so"],
            Library::CublasLt => &["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"],
            Library::Nccl => &["libnccl.so.2", "libnccl.so"],
        }
    }

    /// Whether cudarc's loader, which opens bare names, reaches this library once the file
    /// at `path` is open: only when one of its names is the file's name (the soname). NCCL's
    /// wheel ships `libnccl.so.2`, a name cudarc never tries, so its NCCL bindings cannot be
    /// used with the wheel as is (cohort would have to resolve NCCL's symbols itself).
    pub fn reachable_by_cudarc(self, path: &Path) -> bool {
        let file = path.file_name().and_then(|f| f.to_str()).unwrap_or("");
        match self {
            Library::Nccl => matches!(file, "libnccl.so" | "libnccl.so.1" | "libnccl.so.13"),
            _ => true,
        }
    }
}

/// Where to look: an ordered list of directories, and whether the `ldconfig` cache counts.
#[derive(Debug, Clone)]
pub struct Search {
    dirs: Vec<PathBuf>,
    include_dirs: Vec<PathBuf>,
    ldconfig: bool,
}

/// The system's library directories (after the environment's).
const SYSTEM_DIRS: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/local/cuda/lib64",
    "/usr/local/cuda/targets/x86_64-linux/lib",
    "/usr/lib/wsl/lib",
];

impl Search {
    /// The search this process's environment describes (see the module doc).
    pub fn from_env() -> Search {
        let mut dirs = Vec::new();
        for var in ["COHORT_CUDA_LIB_DIRS", "LD_LIBRARY_PATH"] {
            if let Some(v) = std::env::var_os(var) {
                dirs.extend(std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()));
            }
        }
        let site = python_site_packages();
        for s in &site {
            dirs.extend(subdirs(&s.join("nvidia"), "lib"));
        }
        dirs.extend(SYSTEM_DIRS.iter().map(PathBuf::from));
        let mut include_dirs = Vec::new();
        if let Some(v) = std::env::var_os("COHORT_CUDA_INCLUDE_DIR") {
            include_dirs.push(PathBuf::from(v));
        }
        for s in &site {
            include_dirs.extend(subdirs(&s.join("nvidia"), "include"));
        }
        for var in ["CUDA_HOME", "CUDA_PATH"] {
            if let Some(v) = std::env::var_os(var) {
                include_dirs.push(PathBuf::from(v).join("include"));
            }
        }
        include_dirs.push(PathBuf::from("/usr/local/cuda/include"));
        Search {
            dirs: dedup(dirs),
            include_dirs: dedup(include_dirs),
            ldconfig: true,
        }
    }

    /// A search of these directories only (libraries and headers), without the `ldconfig`
    /// cache: what tests use to make a library missing.
    pub fn in_dirs(dirs: impl IntoIterator<Item = PathBuf>) -> Search {
        let dirs = dedup(dirs.into_iter().collect());
        Search {
            include_dirs: dirs.clone(),
            dirs,
            ldconfig: false,
        }
    }

    /// The library directories, in search order.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// The file of `lib`: the first directory holding one of its names, in name order within
    /// a directory; then the `ldconfig` cache. NVRTC's builtins are looked for beside NVRTC
    /// first, so the two come from one release.
    pub fn find(&self, lib: Library) -> Result<PathBuf, CudaError> {
        let mut dirs = self.dirs.clone();
        if lib == Library::NvrtcBuiltins {
            if let Some(dir) = self.find(Library::Nvrtc).ok().and_then(|p| dir_of(&p)) {
                dirs.insert(0, dir);
            }
        }
        for dir in &dirs {
            for name in lib.file_names() {
                if let Some(p) = file_in(dir, name) {
                    return Ok(p);
                }
            }
        }
        let mut looked_in: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        if self.ldconfig {
            let cache = ldconfig_cache();
            for name in lib.file_names() {
                if let Some((_, p)) = cache.iter().find(|(n, _)| name_matches(n, name)) {
                    return Ok(p.clone());
                }
            }
            looked_in.push("the ldconfig cache".to_string());
        }
        Err(CudaError::LibraryNotFound {
            what: lib.what(),
            names: lib.file_names().join(" or "),
            looked_in,
        })
    }

    /// The directory holding `cuda_bf16.h` (the CUDA runtime headers the kernels include):
    /// first the `include/` beside NVRTC's `lib/` (one release), then
    /// `COHORT_CUDA_INCLUDE_DIR`, the Python environments' `nvidia/*/include`, `CUDA_HOME`,
    /// `CUDA_PATH` and `/usr/local/cuda`.
    pub fn headers(&self) -> Result<PathBuf, CudaError> {
        let mut dirs = Vec::new();
        if let Some(lib_dir) = self.find(Library::Nvrtc).ok().and_then(|p| dir_of(&p)) {
            if let Some(parent) = lib_dir.parent() {
                dirs.push(parent.join("include"));
            }
        }
        dirs.extend(self.include_dirs.iter().cloned());
        let dirs = dedup(dirs);
        match dirs.iter().find(|d| d.join("cuda_bf16.h").is_file()) {
            Some(d) => Ok(d.clone()),
            None => Err(CudaError::HeadersNotFound {
                looked_in: dirs.iter().map(|d| d.display().to_string()).collect(),
            }),
        }
    }

    /// Finds `libs` and opens each (in [`Library::ALL`]'s order, whatever order they are
    /// given in) by absolute path with `RTLD_GLOBAL`. Returns the paths opened. A library
    /// opened before, by this or an earlier call, is not opened again.
    pub fn open(&self, libs: &[Library]) -> Result<Vec<(Library, PathBuf)>, CudaError> {
        let mut out = Vec::new();
        for lib in Library::ALL.into_iter().filter(|l| libs.contains(l)) {
            if let Some(p) = opened(lib) {
                out.push((lib, p));
                continue;
            }
            let path = self.find(lib)?;
            dlopen_global(&path)?;
            OPENED
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((lib, path.clone()));
            out.push((lib, path));
        }
        Ok(out)
    }
}

/// The libraries this process has opened through [`Search::open`].
static OPENED: Mutex<Vec<(Library, PathBuf)>> = Mutex::new(Vec::new());

/// Where `lib` was opened from, if it was.
pub fn opened(lib: Library) -> Option<PathBuf> {
    OPENED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|(l, _)| *l == lib)
        .map(|(_, p)| p.clone())
}

fn dlopen_global(path: &Path) -> Result<(), CudaError> {
    let open_err = |reason: String| CudaError::LibraryOpen {
        path: path.to_path_buf(),
        reason,
    };
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| open_err("the path holds a NUL byte".to_string()))?;
    // SAFETY: `c` is a NUL-terminated path that outlives the call; dlopen runs the library's
    // initialisers, which for the NVIDIA libraries only set up their own state. The handle is
    // never closed (cudarc resolves symbols from the same object for the process's life).
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl*
        // call on this thread; it is copied at once.
        let reason = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "dlopen failed".to_string()
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(open_err(reason));
    }
    Ok(())
}

/// The site-packages of the Python environments: `VIRTUAL_ENV`'s, then those `$COHORT_PYTHON`
/// (default `python3`) reports. No Python is fine: the list is then shorter.
fn python_site_packages() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        for lib in ["lib", "lib64"] {
            for d in subdirs(&PathBuf::from(&venv).join(lib), "site-packages") {
                if d.parent()
                    .and_then(|p| p.file_name())
                    .is_some_and(|n| n.to_string_lossy().starts_with("python"))
                {
                    out.push(d);
                }
            }
        }
    }
    let python = std::env::var("COHORT_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let script = "import site, sys\nfor p in site.getsitepackages() + [site.getusersitepackages()]: print(p)";
    if let Ok(o) = std::process::Command::new(&python)
        .args(["-c", script])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
    {
        if o.status.success() {
            let text = String::from_utf8_lossy(&o.stdout);
            out.extend(text.lines().filter(|l| !l.is_empty()).map(PathBuf::from));
        }
    }
    out
}

/// `base/*/leaf` for every subdirectory of `base` that has one, sorted by name.
fn subdirs(base: &Path, leaf: &str) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(base) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .filter_map(|e| e.ok())
        .map(|e| e.path().join(leaf))
        .filter(|p| p.is_dir())
        .collect();
    v.sort();
    v
}

/// The file named `name` in `dir` (a `*`-suffixed name: the first such file by name).
fn file_in(dir: &Path, name: &str) -> Option<PathBuf> {
    match name.strip_suffix('*') {
        None => Some(dir.join(name)).filter(|p| p.is_file()),
        Some(prefix) => {
            let mut hits: Vec<PathBuf> = std::fs::read_dir(dir)
                .ok()?
                .filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
                .map(|e| e.path())
                .filter(|p| p.is_file())
                .collect();
            hits.sort();
            hits.into_iter().next()
        }
    }
}

fn name_matches(file: &str, pattern: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => file.starts_with(prefix),
        None => file == pattern,
    }
}

fn dir_of(p: &Path) -> Option<PathBuf> {
    p.parent().map(Path::to_path_buf)
}

fn dedup(v: Vec<PathBuf>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::with_capacity(v.len());
    for p in v {
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

/// `ldconfig -p`'s (name, path) pairs for this machine's word size; empty without ldconfig.
fn ldconfig_cache() -> Vec<(String, PathBuf)> {
    let run = |prog: &str| {
        std::process::Command::new(prog)
            .arg("-p")
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())
    };
    let Some(o) = run("ldconfig").or_else(|| run("/sbin/ldconfig")) else {
        return Vec::new();
    };
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(parse_ldconfig_line)
        .collect()
}

/// "\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1" -> the pair,
/// for 64-bit entries only.
fn parse_ldconfig_line(line: &str) -> Option<(String, PathBuf)> {
    let (left, path) = line.split_once(" => ")?;
    let left = left.trim();
    let (name, flags) = left.split_once(' ')?;
    if cfg!(target_pointer_width = "64") && !flags.contains("64") {
        return None;
    }
    Some((name.to_string(), PathBuf::from(path.trim())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldconfig_lines_parse_and_32_bit_ones_are_skipped() {
        let l = "\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1";
        assert_eq!(
            parse_ldconfig_line(l),
            Some((
                "libcuda.so.1".to_string(),
                PathBuf::from("/usr/lib/x86_64-linux-gnu/libcuda.so.1")
            ))
        );
        assert_eq!(
            parse_ldconfig_line("\tlibcuda.so.1 (libc6) => /usr/lib32/libcuda.so.1"),
            None
        );
        assert_eq!(parse_ldconfig_line("1234 libs found in cache"), None);
    }

    #[test]
    fn nccl_from_the_wheel_is_not_reachable_by_cudarc() {
        assert!(!Library::Nccl.reachable_by_cudarc(Path::new("/x/nvidia/nccl/lib/libnccl.so.2")));
        assert!(Library::Nvrtc.reachable_by_cudarc(Path::new("/x/libnvrtc.so.13")));
    }

    #[test]
    fn prefixed_names_find_versioned_builtins() {
        let dir = std::env::temp_dir().join(format!("cohort-cuda-lib-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("libnvrtc.so.13"), b"").unwrap();
        std::fs::write(dir.join("libnvrtc-builtins.so.13.2"), b"").unwrap();
        let s = Search::in_dirs([dir.clone()]);
        assert_eq!(s.find(Library::Nvrtc).unwrap(), dir.join("libnvrtc.so.13"));
        assert_eq!(
            s.find(Library::NvrtcBuiltins).unwrap(),
            dir.join("libnvrtc-builtins.so.13.2")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

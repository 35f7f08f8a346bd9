//! Compiling the kernel sources with NVRTC at run time: no nvcc at build time, and code made by
//! the NVRTC found next to the machine's CUDA (so its PTX version never outruns the driver).
//!
//! A [`Compiler`] exists only once NVRTC and its builtins are open and the runtime headers are
//! found, so no cudarc NVRTC call can run (and panic) before that. Each family compiles to a
//! cubin for one `sm_XX` with ptxas's verbose report, which is read for register spills: a
//! spill is an error naming the kernel, so a kernel that spills never lands. This module must
//! never launch anything or touch a device: it runs on machines without a GPU (CI).

use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;

use cudarc::nvrtc::{result, sys};

use crate::kernels::{self, Family};
use crate::libraries::{Library, Search};
use crate::CudaError;

/// A GPU architecture to compile for, as compute capability ×10 (80 = sm_80, 90 = sm_90).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arch(pub u32);

impl Arch {
    /// The architectures CI compiles every kernel for (A100, H100/H200).
    pub const CHECKED: [Arch; 2] = [Arch(80), Arch(90)];

    /// "sm_90".
    pub fn sm(self) -> String {
        format!("sm_{}", self.0)
    }
}

/// One family compiled for one architecture.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The family.
    pub family: &'static str,
    /// The target.
    pub arch: Arch,
    /// The cubin.
    pub cubin: Vec<u8>,
    /// Per kernel: (name, registers, spill store bytes, spill load bytes), from ptxas.
    pub kernels: Vec<KernelReport>,
}

/// What ptxas reported for one kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelReport {
    /// The kernel's name.
    pub name: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of spill stores.
    pub spill_stores: u32,
    /// Bytes of spill loads.
    pub spill_loads: u32,
}

/// NVRTC, opened, with the headers directory the kernels include from.
#[derive(Debug, Clone)]
pub struct Compiler {
    headers: PathBuf,
    nvrtc: PathBuf,
    version: (i32, i32),
}

impl Compiler {
    /// Opens NVRTC (and its builtins) found by `search` and finds the runtime headers.
    pub fn new(search: &Search) -> Result<Compiler, CudaError> {
        let headers = search.headers()?;
        let opened = search.open(&[Library::NvrtcBuiltins, Library::Nvrtc])?;
        let nvrtc = opened
            .iter()
            .find(|(l, _)| *l == Library::Nvrtc)
            .map(|(_, p)| p.clone())
            .unwrap_or_default();
        let (mut major, mut minor) = (0, 0);
        // SAFETY: NVRTC is open (above), so cudarc's lazy symbol lookup finds nvrtcVersion;
        // the two out-pointers are valid for the call.
        unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
            .result()
            .map_err(|e| nvrtc_err("nvrtcVersion", e))?;
        Ok(Compiler {
            headers,
            nvrtc,
            version: (major, minor),
        })
    }

    /// NVRTC's version (13, 0).
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// Where NVRTC was opened from.
    pub fn nvrtc_path(&self) -> &PathBuf {
        &self.nvrtc
    }

    /// The headers directory passed as `--include-path`.
    pub fn headers(&self) -> &PathBuf {
        &self.headers
    }

    /// Compiles one family for `arch` to a cubin; a compile error or a spill is an error.
    pub fn compile(&self, family: &Family, arch: Arch) -> Result<Compiled, CudaError> {
        self.compile_with(family, arch, &[])
    }

    /// [`Compiler::compile`] with more NVRTC options after the usual ones (a test forces a
    /// spill with `--maxrregcount`).
    pub fn compile_with(
        &self,
        family: &Family,
        arch: Arch,
        extra: &[&str],
    ) -> Result<Compiled, CudaError> {
        let (prog, log) = self.run(family, &arch.sm(), extra)?;
        let reports = parse_ptxas_log(&log);
        if let Some((kernel, line)) = first_spill(&log) {
            return Err(CudaError::Spill {
                family: family.name,
                kernel,
                arch: arch.sm(),
                line,
            });
        }
        let mut size = 0usize;
        // SAFETY: `prog` compiled successfully; `size` is a valid out-pointer.
        unsafe { sys::nvrtcGetCUBINSize(prog.raw, &mut size) }
            .result()
            .map_err(|e| nvrtc_err("nvrtcGetCUBINSize", e))?;
        let mut cubin = vec![0u8; size];
        // SAFETY: `cubin` holds the `size` bytes NVRTC just reported.
        unsafe { sys::nvrtcGetCUBIN(prog.raw, cubin.as_mut_ptr() as *mut c_char) }
            .result()
            .map_err(|e| nvrtc_err("nvrtcGetCUBIN", e))?;
        Ok(Compiled {
            family: family.name,
            arch,
            cubin,
            kernels: reports,
        })
    }

    /// One family as PTX for the virtual architecture `compute_XX`: what a driver compiles
    /// itself for a GPU newer than the cubins (no ptxas runs, so no spill report).
    pub fn compile_ptx(&self, family: &Family, arch: Arch) -> Result<String, CudaError> {
        let (prog, _) = self.run(family, &format!("compute_{}", arch.0), &[])?;
        // SAFETY: `prog` compiled successfully.
        let ptx = unsafe { result::get_ptx(prog.raw) }.map_err(|e| nvrtc_err("nvrtcGetPTX", e))?;
        Ok(c_chars_to_string(&ptx))
    }

    /// Compiles `family` for `--gpu-architecture=target`; returns the program and its log.
    fn run(
        &self,
        family: &Family,
        target: &str,
        extra: &[&str],
    ) -> Result<(Program, String), CudaError> {
        let compile_err = |log: String| CudaError::Compile {
            family: family.name,
            arch: target.to_string(),
            log,
        };
        let src = CString::new(kernels::full_source(family))
            .map_err(|_| compile_err("the source holds a NUL byte".to_string()))?;
        let name = CString::new(format!("{}.cu", family.name)).unwrap_or_default();
        let prog = result::create_program(&src, Some(name.as_c_str()))
            .map_err(|e| nvrtc_err("create", e))?;
        let prog = Program {
            raw: prog,
            _src: src,
            _name: name,
        };
        let mut options = vec![
            format!("--gpu-architecture={target}"),
            format!("--include-path={}", self.headers.display()),
            "-std=c++17".to_string(),
            "-lineinfo".to_string(),
        ];
        // ptxas runs only for a real architecture (sm_XX): ask it for registers and spills.
        if target.starts_with("sm_") {
            options.push("--ptxas-options=--verbose".to_string());
        }
        options.extend(extra.iter().map(|s| s.to_string()));
        // SAFETY: `prog` was made by create_program and is destroyed only by Program's drop.
        let compiled = unsafe { result::compile_program(prog.raw, &options) };
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(prog.raw) }
            .map(|l| c_chars_to_string(&l))
            .unwrap_or_default();
        if compiled.is_err() {
            return Err(compile_err(first_lines(&log, 12)));
        }
        Ok((prog, log))
    }

    /// Every family for `arch`.
    pub fn compile_all(&self, arch: Arch) -> Result<Vec<Compiled>, CudaError> {
        kernels::FAMILIES
            .iter()
            .map(|f| self.compile(f, arch))
            .collect()
    }
}

/// Destroys the NVRTC program when dropped, on every return path; holds the source and name
/// the program may point into until then.
struct Program {
    raw: sys::nvrtcProgram,
    _src: CString,
    _name: CString,
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by create_program and is destroyed once, here.
        // A failure to free it is not worth a panic.
        let _ = unsafe { result::destroy_program(self.raw) };
    }
}

fn nvrtc_err(call: &'static str, e: result::NvrtcError) -> CudaError {
    CudaError::Nvrtc {
        call,
        reason: format!("{:?}", e.0),
    }
}

fn c_chars_to_string(v: &[c_char]) -> String {
    let bytes: Vec<u8> = v.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    CString::new(bytes)
        .ok()
        .map(|c| CStr::to_string_lossy(&c).into_owned())
        .unwrap_or_default()
}

fn first_lines(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut s = lines[..lines.len().min(n)].join(" | ");
    if lines.len() > n {
        s.push_str(&format!(" | ... ({} more lines)", lines.len() - n));
    }
    s
}

/// The kernel a ptxas line is about: "Compiling entry function 'name' for 'sm_90'" or
/// "Function properties for name".
fn kernel_of(line: &str) -> Option<String> {
    if let Some(rest) = line.split("Compiling entry function '").nth(1) {
        return rest.split('\'').next().map(str::to_string);
    }
    line.split("Function properties for ")
        .nth(1)
        .map(|s| s.trim().to_string())
}

/// The numbers before "bytes spill stores" and "bytes spill loads" on a ptxas line.
fn spills(line: &str) -> Option<(u32, u32)> {
    let before = |key: &str| -> Option<u32> {
        let head = line.split(key).next()?;
        if head.len() == line.len() {
            return None;
        }
        head.split(|c: char| !c.is_ascii_digit())
            .rfind(|s| !s.is_empty())?
            .parse()
            .ok()
    };
    Some((before("bytes spill stores")?, before("bytes spill loads")?))
}

/// The first kernel whose spill stores or loads are nonzero, and its line.
fn first_spill(log: &str) -> Option<(String, String)> {
    let mut current = String::from("(unknown kernel)");
    for line in log.lines() {
        if let Some(k) = kernel_of(line) {
            current = k;
        }
        if let Some((st, ld)) = spills(line) {
            if st > 0 || ld > 0 {
                return Some((current, line.trim().to_string()));
            }
        }
    }
    None
}

/// Registers and spills per kernel, in the log's order.
fn parse_ptxas_log(log: &str) -> Vec<KernelReport> {
    let mut out: Vec<KernelReport> = Vec::new();
    let mut current: Option<String> = None;
    for line in log.lines() {
        if let Some(k) = kernel_of(line) {
            if !out.iter().any(|r| r.name == k) {
                out.push(KernelReport {
                    name: k.clone(),
                    registers: 0,
                    spill_stores: 0,
                    spill_loads: 0,
                });
            }
            current = Some(k);
        }
        let Some(r) = current
            .as_ref()
            .and_then(|k| out.iter_mut().find(|r| &r.name == k))
        else {
            continue;
        };
        if let Some((st, ld)) = spills(line) {
            r.spill_stores = st;
            r.spill_loads = ld;
        }
        if let Some(head) = line
            .split(" registers")
            .next()
            .filter(|h| h.len() < line.len())
        {
            if let Some(n) = head
                .split(|c: char| !c.is_ascii_digit())
                .rfind(|s| !s.is_empty())
                .and_then(|s| s.parse().ok())
            {
                r.registers = n;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'layernorm_forward' for 'sm_90'\n\
ptxas info    : Function properties for layernorm_forward\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 24 registers, used 1 barriers, 400 bytes cmem[0]\n\
ptxas info    : Compiling entry function 'attention_forward' for 'sm_90'\n\
ptxas info    : Function properties for attention_forward\n\
    16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads\n\
ptxas info    : Used 255 registers, 400 bytes cmem[0]\n";

    #[test]
    fn ptxas_log_reports_registers_and_the_spilling_kernel() {
        let r = parse_ptxas_log(LOG);
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].registers, r[0].spill_stores), (24, 0));
        assert_eq!(
            (
                r[1].name.as_str(),
                r[1].registers,
                r[1].spill_stores,
                r[1].spill_loads
            ),
            ("attention_forward", 255, 12, 8)
        );
        let (k, line) = first_spill(LOG).unwrap();
        assert_eq!(k, "attention_forward");
        assert!(line.contains("12 bytes spill stores"));
        assert_eq!(
            first_spill(
                &LOG.replace("12 bytes", "0 bytes")
                    .replace("8 bytes", "0 bytes")
            ),
            None
        );
    }
}
